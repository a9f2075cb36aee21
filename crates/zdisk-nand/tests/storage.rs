//! Page storage: the RAM and file back-ends return what was programmed,
//! read erased flash as 0xFF, and a reopened image file brings back its
//! parameters, metadata slots, pages, staged pages and erase counts.

mod common;

use common::*;
use zdisk_core::clock::Timing;
use zdisk_core::media::{DriveModel, Media};
use zdisk_core::units::{PageIndex, SegmentId};
use zdisk_core::Error;
use zdisk_nand::{is_nand_image, NandMedia, NandParams, IMAGE_MAGIC};

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn read(drive: &NandMedia, segment: u32, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    drive.read(SegmentId(segment), offset, &mut buf).unwrap();
    buf
}

fn check_round_trip(drive: &NandMedia) {
    let segment_size = drive.geometry().segment_size_bytes as usize;
    // Never erased, never written: erased flash.
    assert_eq!(read(drive, 3, 0, segment_size), vec![0xFF; segment_size]);
    drive.erase_segment(SegmentId(0)).unwrap();
    let first = pattern(1, 3 * PAGE);
    let second = pattern(2, 2 * PAGE);
    drive
        .write_pages(SegmentId(0), PageIndex(0), &first)
        .unwrap();
    drive
        .write_pages(SegmentId(0), PageIndex(3), &second)
        .unwrap();
    let mut expected = first.clone();
    expected.extend_from_slice(&second);
    assert_eq!(read(drive, 0, 0, 5 * PAGE), expected);
    // Unaligned reads across page boundaries, and into the unwritten tail.
    assert_eq!(read(drive, 0, 4000, 5000), expected[4000..9000].to_vec());
    let tail = read(drive, 0, 5 * PAGE as u64 - 10, 20);
    assert_eq!(&tail[..10], &expected[5 * PAGE - 10..]);
    assert_eq!(&tail[10..], &[0xFF; 10]);
    // An erase returns the segment to 0xFF.
    drive.erase_segment(SegmentId(0)).unwrap();
    assert_eq!(read(drive, 0, 0, 5 * PAGE), vec![0xFF; 5 * PAGE]);
    // The last segment, whole: every page of the medium is addressable.
    let last = drive.geometry().segment_count - 1;
    assert_eq!(read(drive, last, 0, segment_size), vec![0xFF; segment_size]);
    drive.erase_segment(SegmentId(last)).unwrap();
    let full = pattern(3, segment_size);
    drive
        .write_pages(SegmentId(last), PageIndex(0), &full)
        .unwrap();
    assert_eq!(read(drive, last, 0, segment_size), full);
    // Reads outside the medium are errors, not panics.
    let mut buf = [0u8; 16];
    assert!(drive
        .read(SegmentId(0), segment_size as u64 - 8, &mut buf)
        .is_err());
    assert!(drive
        .read(SegmentId(drive.geometry().segment_count), 0, &mut buf)
        .is_err());
    // Metadata slots hold what was written, padded to their capacity.
    drive.write_meta_slot(1, b"slot one").unwrap();
    let slot = drive.read_meta_slot(1).unwrap();
    assert_eq!(slot.len(), drive.geometry().meta_slot_size_bytes as usize);
    assert_eq!(&slot[..8], b"slot one");
}

#[test]
fn ram_back_end_returns_what_was_written() {
    check_round_trip(&virtual_drive(tiny()));
}

#[test]
fn file_back_end_returns_what_was_written() {
    let path = TempPath::new("round-trip.nand");
    let drive = NandMedia::create(&path.0, tiny(), Timing::Virtual, false).unwrap();
    check_round_trip(&drive);
}

#[test]
fn staged_pages_read_back_until_programmed_or_erased() {
    let mut params = tiny();
    params.config.power_loss_protection = true;
    let drive = erased_drive(params, 1);
    drive
        .write_pages(SegmentId(0), PageIndex(0), &pattern(1, PAGE))
        .unwrap();
    drive
        .stage_partial_page(SegmentId(0), PageIndex(1), &[7u8; 100])
        .unwrap();
    // A longer stage of the same page replaces the first.
    drive
        .stage_partial_page(SegmentId(0), PageIndex(1), &[8u8; 300])
        .unwrap();
    let page1 = read(&drive, 0, PAGE as u64, PAGE);
    assert_eq!(&page1[..300], &[8u8; 300]);
    assert_eq!(&page1[300..], &vec![0xFF; PAGE - 300][..]);
    // A read straddling pages 0 and 1 sees both.
    let straddle = read(&drive, 0, PAGE as u64 - 4, 8);
    assert_eq!(&straddle[..4], &pattern(1, PAGE)[PAGE - 4..]);
    assert_eq!(&straddle[4..], &[8u8; 4]);
    let stats = drive.stats();
    assert_eq!((stats.staged_pages, stats.staged_bytes), (2, 400));
    assert_eq!(stats.pages_programmed, 1, "staging is not a NAND write");
    // Programming the page replaces the staged bytes.
    drive
        .write_pages(SegmentId(0), PageIndex(1), &pattern(3, PAGE))
        .unwrap();
    assert_eq!(read(&drive, 0, PAGE as u64, PAGE), pattern(3, PAGE));
    // A staged page dropped by an erase is gone.
    drive
        .stage_partial_page(SegmentId(0), PageIndex(2), &[9u8; 10])
        .unwrap();
    drive.erase_segment(SegmentId(0)).unwrap();
    assert_eq!(read(&drive, 0, 2 * PAGE as u64, 10), vec![0xFF; 10]);
}

#[test]
fn a_reopened_image_keeps_parameters_slots_pages_staged_pages_and_erase_counts() {
    let path = TempPath::new("reopen.nand");
    let mut params = tiny();
    params.config.power_loss_protection = true;
    params.config.recycle_cap_bytes_per_sec = Some(12_345_678);
    {
        let drive = NandMedia::create(&path.0, params.clone(), Timing::Virtual, false).unwrap();
        drive.write_meta_slot(0, b"root zero").unwrap();
        drive.write_meta_slot(1, b"root one").unwrap();
        for segment in 0..3 {
            drive.erase_segment(SegmentId(segment)).unwrap();
        }
        drive.erase_segment(SegmentId(2)).unwrap();
        drive
            .write_pages(SegmentId(0), PageIndex(0), &pattern(5, 4 * PAGE))
            .unwrap();
        drive
            .write_pages(SegmentId(1), PageIndex(0), &pattern(6, PAGE))
            .unwrap();
        drive
            .stage_partial_page(SegmentId(1), PageIndex(1), &[4u8; 1000])
            .unwrap();
        // Staged, then dropped by an erase: must not come back.
        drive
            .stage_partial_page(SegmentId(2), PageIndex(0), &[5u8; 10])
            .unwrap();
        drive.erase_segment(SegmentId(2)).unwrap();
        drive.sync().unwrap();
    }
    let mut prefix = [0u8; 16];
    std::io::Read::read_exact(&mut std::fs::File::open(&path.0).unwrap(), &mut prefix).unwrap();
    assert!(is_nand_image(&prefix));
    assert_eq!(&prefix[..9], IMAGE_MAGIC);
    assert_ne!(&prefix[..8], zdisk_core::meta::META_MAGIC);

    let drive = NandMedia::open(&path.0, Timing::Virtual).unwrap();
    assert_eq!(drive.params(), &params);
    assert_eq!(&drive.read_meta_slot(0).unwrap()[..9], b"root zero");
    assert_eq!(&drive.read_meta_slot(1).unwrap()[..8], b"root one");
    assert_eq!(read(&drive, 0, 0, 4 * PAGE), pattern(5, 4 * PAGE));
    assert_eq!(read(&drive, 0, 4 * PAGE as u64, PAGE), vec![0xFF; PAGE]);
    assert_eq!(read(&drive, 1, 0, PAGE), pattern(6, PAGE));
    let staged = read(&drive, 1, PAGE as u64, PAGE);
    assert_eq!(&staged[..1000], &[4u8; 1000]);
    assert_eq!(&staged[1000..], &vec![0xFF; PAGE - 1000][..]);
    assert_eq!(read(&drive, 2, 0, 10), vec![0xFF; 10]);
    // After a reopen the model cannot know which pages are erased: reading
    // one costs an array read (20 us) and a 10-byte transfer (25 ns).
    drive.begin_op(10 * MS);
    read(&drive, 3, 0, 10);
    assert_eq!(drive.end_op(), 10 * MS + 20 * US + 25);
    let stats = drive.stats();
    assert_eq!((stats.erase_count_min, stats.erase_count_max), (0, 3));
    // Segments 0 and 1 once, segment 2 three times: (4 + 4 + 12) of 256 blocks.
    assert!((stats.erase_count_mean - 20.0 / 256.0).abs() < 1e-9);
}

#[test]
#[should_panic(expected = "programmed without an erase")]
fn a_reopened_image_needs_an_erase_before_programming() {
    let path = TempPath::new("reerase.nand");
    {
        let drive = NandMedia::create(&path.0, tiny(), Timing::Virtual, false).unwrap();
        drive.erase_segment(SegmentId(0)).unwrap();
    }
    let drive = NandMedia::open(&path.0, Timing::Virtual).unwrap();
    drive
        .write_pages(SegmentId(0), PageIndex(0), &page(1))
        .unwrap();
}

#[test]
fn images_are_created_opened_and_locked_with_care() {
    let path = TempPath::new("care.nand");
    std::fs::write(&path.0, b"ZDISKMT1 is a zdisk file image, not a NAND image").unwrap();
    assert!(matches!(
        NandMedia::create(&path.0, tiny(), Timing::Virtual, false),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        NandMedia::open(&path.0, Timing::Virtual),
        Err(Error::CorruptImage(_))
    ));
    let drive = NandMedia::create(&path.0, tiny(), Timing::Virtual, true).unwrap();
    assert!(matches!(
        NandMedia::open(&path.0, Timing::Real),
        Err(Error::Locked { .. })
    ));
    drop(drive);
    // A damaged header is refused, not trusted.
    let mut bytes = std::fs::read(&path.0).unwrap();
    bytes[40] ^= 1;
    std::fs::write(&path.0, &bytes).unwrap();
    assert!(matches!(
        NandMedia::open(&path.0, Timing::Virtual),
        Err(Error::CorruptImage(_))
    ));
    // So is a truncated image.
    bytes[40] ^= 1;
    std::fs::write(&path.0, &bytes[..bytes.len() / 2]).unwrap();
    assert!(matches!(
        NandMedia::open(&path.0, Timing::Virtual),
        Err(Error::CorruptImage(_))
    ));
}

#[test]
fn a_large_profile_costs_no_memory_or_disk_until_written() {
    // 16 GiB of FEMU-default NAND in RAM and in a sparse file.
    let params = NandParams::named("femu-default").unwrap();
    assert_eq!(params.profile.physical_bytes(), 16 << 30);
    let drive = virtual_drive(params.clone());
    assert_eq!(read(&drive, 255, 0, 64), vec![0xFF; 64]);
    let path = TempPath::new("femu.nand");
    let drive = NandMedia::create(&path.0, params, Timing::Virtual, false).unwrap();
    drive.erase_segment(SegmentId(7)).unwrap();
    drive
        .write_pages(SegmentId(7), PageIndex(0), &page(3))
        .unwrap();
    assert_eq!(read(&drive, 7, 0, PAGE), page(3));
    use std::os::unix::fs::MetadataExt;
    let allocated = std::fs::metadata(&path.0).unwrap().blocks() * 512;
    assert!(allocated < 64 << 20, "{allocated} bytes allocated");
}
