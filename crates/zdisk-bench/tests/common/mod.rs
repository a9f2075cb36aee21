//! What the emulated-drive tests share.

use zdisk_bench::drive::NandDrive;
use zdisk_core::GcPolicy;
use zdisk_nand::NandParams;

/// How an emulated drive recycles erase blocks.
#[derive(Debug, Clone, Copy)]
#[allow(dead_code)] // each test file uses some of these
pub enum Recycling {
    /// The profile's own: its controller's cap, if it has one.
    ProfileDefault,
    /// zdisk's cleaner, uncapped (`--recycle-cap-mb-s 0`).
    Uncapped,
    /// Capped at this many MB/s.
    CapMbS(u64),
}

/// A named profile's drive with `physical` bytes of NAND, recycling as told.
pub fn drive(profile: &str, physical: u64, recycling: Recycling) -> NandDrive {
    let mut params = NandParams::named(profile).unwrap();
    params.profile = params.profile.clone().with_physical_bytes(physical);
    match recycling {
        Recycling::ProfileDefault => {}
        Recycling::Uncapped => params.config.recycle_cap_bytes_per_sec = None,
        Recycling::CapMbS(cap) => params.config.recycle_cap_bytes_per_sec = Some(cap * 1_000_000),
    }
    NandDrive {
        params,
        codec: None,
        gc_policy: GcPolicy::CostBenefit,
    }
}
