//! The devices of a split by tensors adding up their partial sums: a small sum (a few
//! tokens' residual stream, a decode step's) over the devices' peer links, one kernel
//! that writes into every device's inbox and waits for theirs; a larger one (a prompt's
//! chunk) through NCCL or RCCL, whose rings move many bytes faster. Both give every
//! device the same sum bit for bit; the two may differ from each other in the last bits.

use std::sync::Arc;

use hip_backend::{Communicator, Device, DeviceBuffer, DeviceViewMut, Stream};

use super::gpu;
use super::kernels::{self, PEER_MAX};
use crate::ModelError;

/// Most values a sum over the peer links takes: a decode step's residual stream of a
/// model up to 16,384 wide (or a few tokens of a narrower one).
pub(super) const PEER_VALUES: usize = 16_384;

/// One device's inbox: `[2][ranks][PEER_VALUES]` floats, and its flags (`ranks`) and
/// count of sums (one more), zero at first.
struct Inbox {
    values: DeviceBuffer<f32>,
    flags: DeviceBuffer<u32>,
}

/// One device's side of a split by tensors' sums.
pub(in crate::gpu) struct Team {
    comm: Communicator,
    /// Every device's inbox, where all devices reach each other over peer links.
    peers: Option<Arc<Vec<Inbox>>>,
}

impl Team {
    /// The teams of `devices` (in rank order, one communicator each): with `peer_sums`,
    /// the peer links' inboxes where every pair of devices has peer access (enabled
    /// here); NCCL alone otherwise.
    pub fn for_devices(
        devices: &[Device],
        comms: Vec<Communicator>,
        peer_sums: bool,
    ) -> Result<Vec<Team>, ModelError> {
        let peers = if peer_sums && devices.len() <= PEER_MAX && all_peers(devices)? {
            Some(Arc::new(
                devices
                    .iter()
                    .map(|d| Inbox::new(d, devices.len()))
                    .collect::<Result<Vec<_>, _>>()?,
            ))
        } else {
            tracing::info!(peer_sums, "every sum through the collectives library");
            None
        };
        Ok(comms
            .into_iter()
            .map(|comm| Team {
                comm,
                peers: peers.clone(),
            })
            .collect())
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// `x` summed over the devices, in place, queued on `stream` (this device's).
    pub fn all_reduce_sum(
        &self,
        x: DeviceViewMut<'_, f32>,
        stream: &Stream,
    ) -> Result<(), ModelError> {
        match &self.peers {
            Some(peers) if x.len() <= PEER_VALUES => {
                let inboxes: Vec<usize> = peers.iter().map(|p| p.values.view().address()).collect();
                let flags: Vec<usize> = peers.iter().map(|p| p.flags.view().address()).collect();
                let rank = self.comm.rank();
                kernels::peer_all_reduce(x, rank, &inboxes, &flags, PEER_VALUES, stream)?;
                Ok(())
            }
            _ => self
                .comm
                .all_reduce_sum(x, stream)
                .map_err(gpu("adding up the devices' partial products")),
        }
    }
}

/// Whether every pair of `devices` has peer access; enables it where so.
fn all_peers(devices: &[Device]) -> Result<bool, ModelError> {
    for a in devices {
        for b in devices {
            if a.ordinal() != b.ordinal() && !a.can_access_peer(b).map_err(gpu("peer access"))? {
                return Ok(false);
            }
        }
    }
    for a in devices {
        for b in devices {
            a.enable_peer_access(b).map_err(gpu("peer access"))?;
        }
    }
    Ok(true)
}

impl Inbox {
    fn new(device: &Device, ranks: usize) -> Result<Inbox, ModelError> {
        let values = device
            .alloc::<f32>(2 * ranks * PEER_VALUES)
            .map_err(gpu("the devices' inboxes"))?;
        let mut flags = device
            .alloc::<u32>(ranks + 1)
            .map_err(gpu("the devices' inboxes"))?;
        let stream = device.new_stream().map_err(gpu("the devices' inboxes"))?;
        stream
            .memset_async(flags.view_mut(), 0)
            .and_then(|()| stream.synchronize())
            .map_err(gpu("the devices' inboxes"))?;
        Ok(Inbox { values, flags })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ranks' sums over the inboxes, queued on two streams of one device (the sums'
    /// protocol does not care where the inboxes are, and a one-GPU machine runs it):
    /// each rank ends with the two inputs' sum, the same bits on both, over sums enough
    /// to use both halves of the inboxes many times, queued directly and replayed from
    /// captured graphs, of lengths up to the inboxes' capacity.
    #[test]
    fn two_ranks_sum_over_the_inboxes() {
        let device = match Device::open(0) {
            Ok(device) => device,
            Err(error) => {
                eprintln!("SKIPPED two_ranks_sum_over_the_inboxes: {error}");
                return;
            }
        };
        let inboxes = [
            Inbox::new(&device, 2).unwrap(),
            Inbox::new(&device, 2).unwrap(),
        ];
        let values: Vec<usize> = inboxes.iter().map(|i| i.values.view().address()).collect();
        let flags: Vec<usize> = inboxes.iter().map(|i| i.flags.view().address()).collect();
        let streams = [device.new_stream().unwrap(), device.new_stream().unwrap()];
        let n = PEER_VALUES;
        let mut xs = [
            device.alloc::<f32>(n).unwrap(),
            device.alloc::<f32>(n).unwrap(),
        ];
        let input = |rank: usize, round: usize| -> Vec<f32> {
            (0..n)
                .map(|i| ((i * (rank + 3) + round * 7) % 1001) as f32 * 0.25 - 100.0)
                .collect()
        };
        let fill = |xs: &mut [DeviceBuffer<f32>; 2], round: usize| {
            for (rank, x) in xs.iter_mut().enumerate() {
                streams[rank]
                    .write_from_host(&input(rank, round), x.view_mut())
                    .unwrap();
            }
        };
        let check = |xs: &[DeviceBuffer<f32>; 2], round: usize, len: usize, what: &str| {
            let (a, b) = (input(0, round), input(1, round));
            let mut got = [vec![0f32; n], vec![0f32; n]];
            for (rank, x) in xs.iter().enumerate() {
                streams[rank].synchronize().unwrap();
                streams[rank]
                    .read_to_host(x.view(), &mut got[rank])
                    .unwrap();
            }
            for i in 0..n {
                // Past `len`, each rank keeps its own values.
                let sum = a[i] + b[i];
                let want = if i < len { [sum, sum] } else { [a[i], b[i]] };
                for rank in 0..2 {
                    assert_eq!(
                        got[rank][i].to_bits(),
                        want[rank].to_bits(),
                        "{what}: rank {rank}, value {i}"
                    );
                }
            }
        };
        // Queued directly, of several lengths.
        for (round, len) in [1, 17, 1000, n, 5, n - 1, 256, 3].into_iter().enumerate() {
            fill(&mut xs, round);
            for (rank, x) in xs.iter_mut().enumerate() {
                let x = x.slice_mut(0..len).unwrap();
                kernels::peer_all_reduce(x, rank, &values, &flags, PEER_VALUES, &streams[rank])
                    .unwrap();
            }
            check(&xs, round, len, &format!("round {round}, {len} values"));
        }
        // Captured once, replayed.
        let graphs: Vec<hip_backend::Graph> = xs
            .iter_mut()
            .enumerate()
            .map(|(rank, x)| {
                streams[rank]
                    .capture(|s| -> Result<(), ModelError> {
                        kernels::peer_all_reduce(x.view_mut(), rank, &values, &flags, n, s)?;
                        Ok(())
                    })
                    .unwrap()
            })
            .collect();
        for round in 10..17 {
            fill(&mut xs, round);
            for (rank, graph) in graphs.iter().enumerate() {
                graph.launch(&streams[rank]).unwrap();
            }
            check(&xs, round, n, &format!("replay {round}"));
        }
    }
}
