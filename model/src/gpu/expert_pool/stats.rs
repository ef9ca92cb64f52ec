//! What the pools of experts have done, as callers read it.

/// What the pools have done since the model was built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExpertStats {
    /// Routes of a token to an expert resident on the device, multiplied there.
    pub hits: u64,
    /// Routes to an expert that was not: brought over the link and multiplied on the
    /// device (`linked` of them), or multiplied on the host.
    pub misses: u64,
    pub linked: u64,
    /// Routes to an expert that was not resident, read in place from the registered
    /// mapping by the device's products (of the misses too).
    pub in_place: u64,
    /// Experts copied into a slot.
    pub promotions: u64,
    /// Of those, the ones that took a slot from another expert.
    pub evictions: u64,
    /// Slots of each layer's pool that hold experts resident.
    pub slots_per_layer: usize,
    /// Link slots of each layer's pool, while the link is in place (0 before its
    /// registration has ended, and where it failed).
    pub link_slots: usize,
    /// Experts in the pools now, over every layer.
    pub resident: usize,
    /// Nanoseconds the passes waited for the device's routes (its work up to each
    /// router included), and spent on the host's routes (the CPU's products and the
    /// copy of their sum queued).
    pub wait_ns: u64,
    pub host_ns: u64,
    /// Layer passes that sent routes to the host, and the nanoseconds of theirs spent
    /// in the CPU's products alone (the rest of `host_ns` is reading and queueing).
    pub host_passes: u64,
    pub host_product_ns: u64,
    /// Nanoseconds the passes spent between the device's routes and the device's
    /// products: splitting the routes (with the promotions they call for) and queueing
    /// the copies of the device's routes and of the experts over the link.
    pub queue_ns: u64,
}

/// The pools of several models (replicas of one) added up: every count and the experts
/// resident; the slots of a layer's pool are each one's.
impl std::ops::Add for ExpertStats {
    type Output = ExpertStats;

    fn add(self, other: ExpertStats) -> ExpertStats {
        ExpertStats {
            hits: self.hits + other.hits,
            misses: self.misses + other.misses,
            linked: self.linked + other.linked,
            in_place: self.in_place + other.in_place,
            promotions: self.promotions + other.promotions,
            evictions: self.evictions + other.evictions,
            slots_per_layer: self.slots_per_layer.max(other.slots_per_layer),
            link_slots: self.link_slots.max(other.link_slots),
            resident: self.resident + other.resident,
            wait_ns: self.wait_ns + other.wait_ns,
            host_ns: self.host_ns + other.host_ns,
            host_passes: self.host_passes + other.host_passes,
            host_product_ns: self.host_product_ns + other.host_product_ns,
            queue_ns: self.queue_ns + other.queue_ns,
        }
    }
}
