//! Breaking a flash rule is an engine bug, so the emulated drive panics
//! with a message naming the page. Each test breaks one rule.

mod common;

use common::*;
use zdisk_core::media::{DriveModel, Media};
use zdisk_core::units::{PageIndex, SegmentId};

#[test]
#[should_panic(expected = "programmed without an erase")]
fn programming_without_an_erase_panics() {
    let drive = virtual_drive(tiny());
    drive
        .write_pages(SegmentId(0), PageIndex(0), &page(1))
        .unwrap();
}

#[test]
#[should_panic(expected = "programmed twice")]
fn programming_a_page_twice_panics() {
    let drive = erased_drive(tiny(), 1);
    drive
        .write_pages(SegmentId(0), PageIndex(0), &page(1))
        .unwrap();
    drive
        .write_pages(SegmentId(0), PageIndex(0), &page(2))
        .unwrap();
}

#[test]
#[should_panic(expected = "programmed out of order")]
fn programming_out_of_order_panics() {
    let drive = erased_drive(tiny(), 1);
    drive
        .write_pages(SegmentId(0), PageIndex(0), &page(1))
        .unwrap();
    // Page 5 is page 1 of unit 1's block, whose page 0 (segment page 1) is unwritten.
    drive
        .write_pages(SegmentId(0), PageIndex(5), &page(2))
        .unwrap();
}

#[test]
#[should_panic(expected = "programmed out of order (the segment's next programmable page is 1)")]
fn skipping_a_page_of_the_segment_panics() {
    let drive = erased_drive(tiny(), 1);
    drive
        .write_pages(SegmentId(0), PageIndex(0), &page(1))
        .unwrap();
    // Page 2 is the first page of unit 2's block, but segment page 1 was skipped.
    drive
        .write_pages(SegmentId(0), PageIndex(2), &page(2))
        .unwrap();
}

#[test]
#[should_panic(expected = "is not whole pages")]
fn a_partial_page_write_panics() {
    let drive = erased_drive(tiny(), 1);
    drive
        .write_pages(SegmentId(0), PageIndex(0), &[0u8; 100])
        .unwrap();
}

#[test]
#[should_panic(expected = "runs past the segment end")]
fn writing_past_the_segment_end_panics() {
    let drive = erased_drive(tiny(), 1);
    let segment = drive.geometry().segment_size_bytes as usize;
    drive
        .write_pages(SegmentId(0), PageIndex(1), &vec![0u8; segment])
        .unwrap();
}

#[test]
#[should_panic(expected = "beyond the medium")]
fn erasing_past_the_last_segment_panics() {
    let drive = virtual_drive(tiny());
    let segments = drive.geometry().segment_count;
    drive.erase_segment(SegmentId(segments)).unwrap();
}

#[test]
#[should_panic(expected = "staged out of order")]
fn staging_ahead_of_the_write_pointer_panics() {
    let mut params = tiny();
    params.config.power_loss_protection = true;
    let drive = erased_drive(params, 1);
    drive
        .stage_partial_page(SegmentId(0), PageIndex(1), &[1u8; 100])
        .unwrap();
}

#[test]
#[should_panic(expected = "programmed twice")]
fn staging_a_programmed_page_panics() {
    let mut params = tiny();
    params.config.power_loss_protection = true;
    let drive = erased_drive(params, 1);
    drive
        .write_pages(SegmentId(0), PageIndex(0), &page(1))
        .unwrap();
    drive
        .stage_partial_page(SegmentId(0), PageIndex(0), &[1u8; 100])
        .unwrap();
}

#[test]
fn an_erase_makes_a_segment_programmable_again_and_staging_needs_plp() {
    let drive = erased_drive(tiny(), 1);
    drive
        .write_pages(SegmentId(0), PageIndex(0), &page(1))
        .unwrap();
    drive.erase_segment(SegmentId(0)).unwrap();
    drive
        .write_pages(SegmentId(0), PageIndex(0), &page(2))
        .unwrap();
    assert!(drive
        .stage_partial_page(SegmentId(0), PageIndex(1), &[1u8; 10])
        .is_err());
}
