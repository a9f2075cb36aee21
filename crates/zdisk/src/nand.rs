//! Emulated NAND drives for the CLI (filled in once zdisk-nand lands).

use zdisk_bench::drive::Drive;

use crate::bench::BenchArgs;

pub fn bench_drive(profile: &str, _args: &BenchArgs) -> Result<Box<dyn Drive>, String> {
    Err(format!(
        "emulated drive profile {profile:?}: not available yet"
    ))
}
