//! What the emulated-drive tests share.

use zdisk_bench::drive::NandDrive;
use zdisk_core::GcPolicy;
use zdisk_nand::NandParams;

/// A named profile's drive with `physical` bytes of NAND and, if given, a
/// cap on its recycling rate in MB/s.
pub fn drive(profile: &str, physical: u64, recycle_cap_mb_s: Option<u64>) -> NandDrive {
    let mut params = NandParams::named(profile).unwrap();
    params.profile = params.profile.clone().with_physical_bytes(physical);
    params.config.recycle_cap_bytes_per_sec = recycle_cap_mb_s.map(|cap| cap * 1_000_000);
    NandDrive {
        params,
        codec: None,
        gc_policy: GcPolicy::CostBenefit,
    }
}
