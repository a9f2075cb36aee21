//! Real-time smoke test: calls sleep until their modelled completion, and
//! the shared resources serialise concurrent callers. The lower bounds are
//! exact (a call may not finish before its modelled completion); there is
//! no upper bound on the host's speed, only a liveness bound that catches
//! a call that never returns, since the host may be busy for any time.
//! Whether a write waited for buffer room is read from the drive's own
//! counters, not from a clock.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use zdisk_core::clock::Timing;
use zdisk_core::media::{DriveModel, HostDirection, Media};
use zdisk_core::units::{PageIndex, SegmentId};
use zdisk_nand::NandMedia;

/// Catches a hang, not slowness: far above anything a busy host adds.
const LIVENESS: Duration = Duration::from_secs(60);

fn slow_tiny() -> zdisk_nand::NandParams {
    let mut params = tiny();
    params.profile.latency_program_ns = 2 * MS;
    params.profile.latency_erase_ns = 0;
    params.profile.command_overhead_ns = MS;
    params
}

fn timed(body: impl FnOnce()) -> Duration {
    let start = Instant::now();
    body();
    start.elapsed()
}

fn assert_about(elapsed: Duration, modelled: Duration) {
    assert!(
        elapsed >= modelled,
        "took {elapsed:?}, modelled {modelled:?}"
    );
    assert!(
        elapsed < modelled + LIVENESS,
        "took {elapsed:?}, modelled {modelled:?}: stuck?"
    );
}

#[test]
fn writes_and_syncs_take_about_the_modelled_time() {
    let drive = NandMedia::new_in_memory(slow_tiny(), Timing::Real).unwrap();
    drive.erase_segment(SegmentId(0)).unwrap();
    // One clock over both calls: the sum of two clocks would miss the gap
    // between them, and fall short of the model by that much.
    let started = Instant::now();
    // Five pages fit the 8-page buffer: admitted without waiting for room.
    drive
        .write_pages(SegmentId(0), PageIndex(0), &vec![1u8; 5 * PAGE])
        .unwrap();
    let stats = drive.stats();
    assert_eq!(
        stats.buffer_wait_ns, 0,
        "a buffered write waited: {stats:?}"
    );
    // Page 4 programs after page 0 on unit 0: done 4.03 ms after the write.
    drive.sync().unwrap();
    assert_about(started.elapsed(), Duration::from_micros(4030));
    let mut buf = vec![0u8; PAGE];
    drive.read(SegmentId(0), 0, &mut buf).unwrap();
    assert_eq!(buf, vec![1u8; PAGE]);
}

#[test]
fn concurrent_commands_serialise_on_the_controller() {
    let drive = Arc::new(NandMedia::new_in_memory(slow_tiny(), Timing::Real).unwrap());
    let elapsed = timed(|| {
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let drive = drive.clone();
                std::thread::spawn(move || drive.host_transfer(HostDirection::Read, 0))
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
    });
    // Four commands of 1 ms each on one controller.
    assert_about(elapsed, Duration::from_millis(4));
    assert_eq!(drive.stats().host_commands, 4);
}
