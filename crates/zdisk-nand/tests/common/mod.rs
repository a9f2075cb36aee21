//! Helpers shared by the integration tests: a tiny drive whose every
//! timing figure is spelled out here, so each test's hand-computed
//! schedule can be checked against these numbers.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use zdisk_core::clock::Timing;
use zdisk_core::media::Media;
use zdisk_core::units::SegmentId;
use zdisk_nand::{NandMedia, NandParams};

pub const US: u64 = 1_000;
pub const MS: u64 = 1_000_000;
/// The page the engine writes: 4 KiB of data plus the 32 spare-area bytes
/// zdisk uses.
pub const PAGE: usize = 4096 + 32;

/// The `tiny` profile with its timing restated: 4 planes (unit u is
/// channel u % 2, plane u / 2), 8 pages per block so 32 pages per
/// segment, a page crosses a channel in 10 us, programs in 100 us, reads
/// in 20 us, erases in 500 us; 8 pages of write buffer; 5 us per command,
/// 10 us per 4 KiB on the link, 20 us per 4 KiB in the compressor.
pub fn tiny() -> NandParams {
    let mut params = NandParams::named("tiny").unwrap();
    let p = &mut params.profile;
    p.channels = 2;
    p.dies_per_channel = 1;
    p.planes_per_die = 2;
    p.pages_per_block = 8;
    p.page_size_bytes = 4096;
    // A 4128-byte page crosses the channel in exactly 10 us.
    p.channel_bytes_per_sec = Some(412_800_000);
    p.latency_program_ns = 100 * US;
    p.latency_read_ns = 20 * US;
    p.latency_erase_ns = 500 * US;
    p.write_buffer_pages = 8;
    p.command_overhead_ns = 5 * US;
    p.link_bytes_per_sec = Some(409_600_000);
    p.compress_bytes_per_sec = Some(204_800_000);
    params.config.power_loss_protection = false;
    params.config.recycle_cap_bytes_per_sec = None;
    params
}

pub fn virtual_drive(params: NandParams) -> NandMedia {
    NandMedia::new_in_memory(params, Timing::Virtual).unwrap()
}

/// A drive whose first `segments` segments were erased at time 0, and
/// whose clock then idles at 10 ms, long after the erases finished.
pub fn erased_drive(params: NandParams, segments: u32) -> NandMedia {
    let drive = virtual_drive(params);
    for segment in 0..segments {
        drive.erase_segment(SegmentId(segment)).unwrap();
    }
    drive.set_time(10 * MS);
    drive
}

pub fn page(fill: u8) -> Vec<u8> {
    vec![fill; PAGE]
}

/// Runs `body` as one host operation issued at `issue_ns`; returns its completion.
pub fn op(drive: &NandMedia, issue_ns: u64, body: impl FnOnce(&NandMedia)) -> u64 {
    drive.begin_op(issue_ns);
    body(drive);
    drive.end_op()
}

/// A unique path in the temporary directory, removed when dropped.
pub struct TempPath(pub PathBuf);

impl TempPath {
    pub fn new(name: &str) -> TempPath {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let unique = COUNTER.fetch_add(1, Ordering::Relaxed);
        TempPath(
            std::env::temp_dir().join(format!("zdisk-nand-{}-{unique}-{name}", std::process::id())),
        )
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
