//! `rocmforge devices`: the GPUs this build can use, or why there are none.

use anyhow::Result;
use hip_backend::{list_devices, HipError, OFFLOAD_ARCHS, PLATFORM};
use serde_json::json;

#[derive(clap::Args)]
pub struct DevicesArgs {
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(args: &DevicesArgs) -> Result<()> {
    let found = list_devices();
    if args.json {
        let value = match &found {
            Ok(devices) => json!({
                "platform": PLATFORM.name(),
                "offload_archs": OFFLOAD_ARCHS,
                "devices": devices.iter().map(|d| json!({
                    "ordinal": d.ordinal,
                    "name": d.name,
                    "arch": d.arch,
                    "total_memory": d.total_memory,
                    "free_memory": d.free_memory,
                    "multiprocessors": d.multiprocessor_count,
                    "pci_bus_id": d.pci_bus_id,
                })).collect::<Vec<_>>(),
            }),
            Err(e) => json!({
                "platform": PLATFORM.name(),
                "offload_archs": OFFLOAD_ARCHS,
                "devices": [],
                "reason": e.to_string(),
            }),
        };
        println!("{value}");
        return unavailable_is_ok(found.map(|_| ()));
    }
    println!(
        "platform: {} (kernels for: {})",
        PLATFORM,
        if OFFLOAD_ARCHS.is_empty() {
            "none"
        } else {
            OFFLOAD_ARCHS
        }
    );
    match &found {
        Ok(devices) => {
            for d in devices {
                let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
                let free = d
                    .free_memory
                    .map_or(String::new(), |f| format!(", {:.1} GiB free", gib(f)));
                println!(
                    "  [{}] {} ({}), {:.1} GiB{free}, {} multiprocessors, PCI {}",
                    d.ordinal,
                    d.name,
                    d.arch,
                    gib(d.total_memory),
                    d.multiprocessor_count,
                    d.pci_bus_id
                );
            }
        }
        Err(e) => println!("no GPU: {e}"),
    }
    unavailable_is_ok(found.map(|_| ()))
}

/// Having no GPU is an answer, not a failure; any other runtime error is.
fn unavailable_is_ok(result: Result<(), HipError>) -> Result<()> {
    match result {
        Err(e) if !e.is_unavailable() => Err(e.into()),
        _ => Ok(()),
    }
}
