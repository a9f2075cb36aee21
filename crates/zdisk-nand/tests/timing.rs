//! The timing model against hand-computed schedules, in virtual time.
//!
//! Every test uses the `tiny` drive of `common::tiny()` (4 planes on 2
//! channels, 10 us page transfers, 100 us programs, 20 us reads, 500 us
//! erases, 8 pages of write buffer) and spells out the schedule it
//! expects, in microseconds after the operation's issue time `T`.

mod common;

use common::*;
use zdisk_core::media::{DriveModel, HostDirection, Media, ReadRange};
use zdisk_core::units::{PageIndex, SegmentId};

const T: u64 = 10 * MS;
const SEG: SegmentId = SegmentId(0);

fn write(drive: &zdisk_nand::NandMedia, first_page: u32, pages: usize) {
    let data = vec![0xA5u8; pages * PAGE];
    drive
        .write_pages(SEG, PageIndex(first_page), &data)
        .unwrap();
}

fn sync_at(drive: &zdisk_nand::NandMedia, issue_ns: u64) -> u64 {
    op(drive, issue_ns, |d| d.sync().unwrap())
}

#[test]
fn one_page_program_is_a_transfer_then_a_program() {
    let drive = erased_drive(tiny(), 1);
    // Admitted to the empty buffer at once: the write returns at T.
    assert_eq!(op(&drive, T, |d| write(d, 0, 1)), T);
    // Channel [T, T+10], plane [T+10, T+110].
    assert_eq!(drive.idle_at_ns(), T + 110 * US);
    assert_eq!(sync_at(&drive, T), T + 110 * US);
    let stats = drive.stats();
    assert_eq!(stats.pages_programmed, 1);
    assert_eq!(stats.channel_busy_ns, 10 * US);
}

#[test]
fn without_a_buffer_writes_wait_for_their_programs() {
    let mut params = tiny();
    params.profile.write_buffer_pages = 0;
    let drive = erased_drive(params, 1);
    // Page 0: unit 0 (channel 0): transfer [T, T+10], program [T+10, T+110].
    assert_eq!(op(&drive, T, |d| write(d, 0, 1)), T + 110 * US);
    // Page 1: unit 1 on channel 1 overlaps page 0 completely.
    assert_eq!(op(&drive, T, |d| write(d, 1, 1)), T + 110 * US);
    // Page 2: unit 2 shares channel 0: transfer [T+10, T+20], program to T+120.
    assert_eq!(op(&drive, T, |d| write(d, 2, 1)), T + 120 * US);
    assert_eq!(op(&drive, T, |d| write(d, 3, 1)), T + 120 * US);
    // Page 4 is unit 0 again: transfer [T+20, T+30], then it waits for the
    // plane until T+110 and programs to T+210.
    assert_eq!(op(&drive, T, |d| write(d, 4, 1)), T + 210 * US);
}

#[test]
fn programs_on_different_channels_overlap() {
    let drive = erased_drive(tiny(), 1);
    op(&drive, T, |d| write(d, 0, 2));
    // Pages 0 and 1 run side by side on channels 0 and 1.
    assert_eq!(sync_at(&drive, T), T + 110 * US);
}

#[test]
fn programs_on_one_channel_share_its_bus() {
    let drive = erased_drive(tiny(), 1);
    op(&drive, T, |d| write(d, 0, 3));
    // Page 2 (plane 1 of channel 0) waits for page 0's transfer: T+20 + 100.
    assert_eq!(sync_at(&drive, T), T + 120 * US);
}

#[test]
fn programs_on_one_plane_serialise() {
    let drive = erased_drive(tiny(), 1);
    op(&drive, T, |d| write(d, 0, 5));
    // Page 4 is page 1 of unit 0's block: it programs after page 0, T+110..T+210.
    assert_eq!(sync_at(&drive, T), T + 210 * US);
}

#[test]
fn a_full_buffer_admits_pages_as_programs_finish() {
    let drive = erased_drive(tiny(), 1);
    // Pages 0..8 fill the 8-page buffer at T; they finish at T+110 (pages
    // 0, 1), T+120 (2, 3), T+210 (4, 5), T+220 (6, 7). Page 8 and 9 are
    // admitted at T+110, pages 10 and 11 at T+120, so the write returns at
    // T+120. Page 8 (unit 0): transfer [T+110, T+120], program after page
    // 4 at [T+210, T+310]; page 10 (unit 2): [T+220, T+320].
    assert_eq!(op(&drive, T, |d| write(d, 0, 12)), T + 120 * US);
    assert_eq!(sync_at(&drive, T + 120 * US), T + 320 * US);
    assert_eq!(drive.stats().buffer_wait_ns, 120 * US);
}

#[test]
fn sync_waits_for_outstanding_programs_only_once_issued() {
    let drive = erased_drive(tiny(), 1);
    op(&drive, T, |d| write(d, 0, 1));
    // Issued after the program finished, a sync costs nothing.
    assert_eq!(sync_at(&drive, T + MS), T + MS);
    // Issued before, it waits for it.
    op(&drive, T + 2 * MS, |d| write(d, 1, 1));
    assert_eq!(sync_at(&drive, T + 2 * MS), T + 2 * MS + 110 * US);
}

#[test]
fn sync_with_power_loss_protection_returns_at_once() {
    let mut params = tiny();
    params.config.power_loss_protection = true;
    let drive = erased_drive(params, 1);
    op(&drive, T, |d| write(d, 0, 5));
    assert_eq!(sync_at(&drive, T), T);
    // The programs still occupy the planes.
    assert_eq!(drive.idle_at_ns(), T + 210 * US);
}

#[test]
fn a_metadata_write_costs_a_sync_one_program_time() {
    let drive = erased_drive(tiny(), 0);
    assert_eq!(op(&drive, T, |d| d.write_meta_slot(0, b"root").unwrap()), T);
    assert_eq!(sync_at(&drive, T), T + 100 * US);
}

#[test]
fn a_read_waits_behind_a_program_on_its_plane() {
    let drive = erased_drive(tiny(), 2);
    // Segment 1 was programmed long ago (pages 0..4 on units 0..3).
    op(&drive, MS, |d| {
        d.write_pages(SegmentId(1), PageIndex(0), &vec![7u8; 4 * PAGE])
            .unwrap()
    });
    // At T a program of segment 0 page 0 occupies unit 0 until T+110.
    op(&drive, T, |d| write(d, 0, 1));
    let mut buf = vec![0u8; PAGE];
    // Segment 1 page 0 is on unit 0: read [T+110, T+130], transfer to T+140.
    let done = op(&drive, T, |d| d.read(SegmentId(1), 0, &mut buf).unwrap());
    assert_eq!(done, T + 140 * US);
    assert_eq!(buf, vec![7u8; PAGE]);
    // Segment 1 page 1 is on unit 1, idle: read [T, T+20], transfer to T+30.
    let done = op(&drive, T, |d| {
        d.read(SegmentId(1), PAGE as u64, &mut buf).unwrap()
    });
    assert_eq!(done, T + 30 * US);
    // A small read transfers only the bytes asked for (1 KiB: 2.48 us at
    // 412.8 MB/s).
    let mut small = vec![0u8; 1024];
    let done = op(&drive, T + MS, |d| {
        d.read(SegmentId(1), 2 * PAGE as u64, &mut small).unwrap()
    });
    assert_eq!(done, T + MS + 22_481);
    assert_eq!(drive.stats().pages_read, 3);
}

#[test]
fn a_batch_of_reads_is_dispatched_to_every_die_at_once() {
    let drive = erased_drive(tiny(), 3);
    for segment in [1, 2] {
        op(&drive, MS, |d| {
            d.write_pages(
                SegmentId(segment),
                PageIndex(0),
                &vec![segment as u8; 4 * PAGE],
            )
            .unwrap()
        });
    }
    let (mut a, mut b) = (vec![0u8; PAGE], vec![0u8; PAGE]);
    // Segment 1 pages 0 and 1 sit on units 0 and 1 (channels 0 and 1):
    // both read [T, T+20] and transfer [T+20, T+30].
    let done = op(&drive, T, |d| {
        let mut batch = [
            ReadRange {
                segment: SegmentId(1),
                offset_bytes: 0,
                buf: &mut a,
            },
            ReadRange {
                segment: SegmentId(1),
                offset_bytes: PAGE as u64,
                buf: &mut b,
            },
        ];
        assert!(d.read_batch(&mut batch).iter().all(|r| r.is_ok()));
    });
    assert_eq!(done, T + 30 * US);
    assert_eq!((a[0], b[0]), (1, 1));
    // Page 0 of segments 1 and 2 share unit 0: the second read waits for
    // the plane, [T+20, T+40], and transfers [T+40, T+50].
    let done = op(&drive, 2 * T, |d| {
        let mut batch = [
            ReadRange {
                segment: SegmentId(1),
                offset_bytes: 0,
                buf: &mut a,
            },
            ReadRange {
                segment: SegmentId(2),
                offset_bytes: 0,
                buf: &mut b,
            },
        ];
        assert!(d.read_batch(&mut batch).iter().all(|r| r.is_ok()));
    });
    assert_eq!(done, 2 * T + 50 * US);
    assert_eq!((a[0], b[0]), (1, 2));
    // One after another, the same two reads take twice as long.
    let done = op(&drive, 3 * T, |d| {
        d.read(SegmentId(1), 0, &mut a).unwrap();
        d.read(SegmentId(1), PAGE as u64, &mut b).unwrap();
    });
    assert_eq!(done, 3 * T + 60 * US);
}

#[test]
fn pages_known_to_be_erased_are_read_without_the_array() {
    let drive = erased_drive(tiny(), 1);
    op(&drive, T, |d| write(d, 0, 1));
    let mut buf = vec![0u8; 2 * PAGE];
    // Page 1 was never programmed since the erase; segment 5 never since
    // the drive was made. The controller's block table answers both.
    let done = op(&drive, T + MS, |d| {
        d.read(SEG, PAGE as u64, &mut buf).unwrap()
    });
    assert_eq!(done, T + MS);
    assert_eq!(buf, vec![0xFF; 2 * PAGE]);
    let done = op(&drive, T + MS, |d| {
        d.read(SegmentId(5), 0, &mut buf).unwrap()
    });
    assert_eq!(done, T + MS);
    let stats = drive.stats();
    assert_eq!((stats.erased_page_reads, stats.pages_read), (4, 0));
}

#[test]
fn a_page_still_in_the_write_buffer_is_read_from_it() {
    let drive = erased_drive(tiny(), 1);
    op(&drive, T, |d| write(d, 0, 1));
    let mut buf = vec![0u8; PAGE];
    // Its program runs until T+110: the read is served from the buffer.
    assert_eq!(
        op(&drive, T + 50 * US, |d| d.read(SEG, 0, &mut buf).unwrap()),
        T + 50 * US
    );
    assert_eq!(buf, vec![0xA5u8; PAGE]);
    // Once programmed it comes from the array: [T+200, T+220] + 10 us.
    assert_eq!(
        op(&drive, T + 200 * US, |d| d.read(SEG, 0, &mut buf).unwrap()),
        T + 230 * US
    );
    let stats = drive.stats();
    assert_eq!((stats.buffer_read_hits, stats.pages_read), (1, 1));
}

#[test]
fn an_erase_occupies_every_plane_but_not_the_caller() {
    let drive = erased_drive(tiny(), 0);
    assert_eq!(op(&drive, T, |d| d.erase_segment(SEG).unwrap()), T);
    assert_eq!(drive.idle_at_ns(), T + 500 * US);
    // A program of the fresh segment queues behind the erase: T+500..T+600.
    assert_eq!(op(&drive, T, |d| write(d, 0, 1)), T);
    assert_eq!(sync_at(&drive, T), T + 600 * US);
    let stats = drive.stats();
    assert_eq!(stats.blocks_erased, 4);
    assert_eq!((stats.erase_count_min, stats.erase_count_max), (0, 1));
    // One segment of 64 erased once: 4 of 256 blocks.
    assert!((stats.erase_count_mean - 4.0 / 256.0).abs() < 1e-9);
}

#[test]
fn host_commands_serialise_on_the_controller_link_and_compressor() {
    let drive = erased_drive(tiny(), 0);
    // Write A: controller [T, T+5], link [T+5, T+15], compressor streams
    // from T+5 and needs 20 us: done at T+25.
    let a = op(&drive, T, |d| d.host_transfer(HostDirection::Write, 4096));
    assert_eq!(a, T + 25 * US);
    // Write B, issued at T too (queue depth 2): controller [T+5, T+10],
    // link [T+15, T+25], compressor [T+25, T+45].
    let b = op(&drive, T, |d| d.host_transfer(HostDirection::Write, 4096));
    assert_eq!(b, T + 45 * US);
    // A read later: controller 5 us, link 10 us, no compression.
    let c = op(&drive, T + MS, |d| {
        d.host_transfer(HostDirection::Read, 4096)
    });
    assert_eq!(c, T + MS + 15 * US);
    // A trim moves no data: only the command overhead.
    let trim = op(&drive, T + 2 * MS, |d| {
        d.host_transfer(HostDirection::Write, 0)
    });
    assert_eq!(trim, T + 2 * MS + 5 * US);
    let stats = drive.stats();
    assert_eq!(stats.host_commands, 4);
    assert_eq!(stats.host_write_bytes, 8192);
    assert_eq!(stats.compress_busy_ns, 40 * US);
}

#[test]
fn without_a_compressor_writes_are_link_bound() {
    let mut params = tiny();
    params.profile.compress_bytes_per_sec = None;
    let drive = erased_drive(params, 0);
    assert_eq!(
        op(&drive, T, |d| d.host_transfer(HostDirection::Write, 4096)),
        T + 15 * US
    );
}

#[test]
fn the_recycling_cap_paces_reclaimed_segments() {
    let mut params = tiny();
    // One tiny segment (32 pages) per millisecond.
    params.config.recycle_cap_bytes_per_sec = Some(32 * PAGE as u64 * 1000);
    let drive = erased_drive(params, 0);
    let segment = drive.geometry().segment_size_bytes;
    assert_eq!(segment, 32 * PAGE as u64);
    assert!(drive.recycling_ready());
    // Background cleaning at T: the engine is busy until T+1ms; the
    // caller (outside an operation) waits for nothing.
    drive.set_time(T);
    drive.segment_recycled(segment, 0);
    assert!(!drive.recycling_ready());
    drive.set_time(T + MS);
    assert!(drive.recycling_ready());
    // Foreground cleaning during a host write issued at T+0.5ms queues
    // behind the background recycle and waits for its own: T+2ms.
    drive.set_time(T);
    let done = op(&drive, T + MS / 2, |d| d.segment_recycled(segment, 4096));
    assert_eq!(done, T + 2 * MS);
    let stats = drive.stats();
    assert_eq!(stats.segments_recycled, 2);
    assert_eq!(stats.relocated_bytes, 4096);
    assert_eq!(stats.recycle_busy_ns, 2 * MS);
}

#[test]
fn without_a_cap_recycling_is_free() {
    let drive = erased_drive(tiny(), 0);
    let done = op(&drive, T, |d| d.segment_recycled(128 * 1024, 0));
    assert_eq!(done, T);
    assert!(drive.recycling_ready());
}

#[test]
fn identical_runs_give_identical_times() {
    let run = || {
        let drive = erased_drive(tiny(), 2);
        let mut times = Vec::new();
        for i in 0..32u32 {
            let issue = T + i as u64 * 30 * US;
            times.push(op(&drive, issue, |d| {
                d.host_transfer(HostDirection::Write, 4096);
                d.write_pages(SEG, PageIndex(i), &page(i as u8)).unwrap();
            }));
        }
        (times, drive.stats())
    };
    assert_eq!(run(), run());
}
