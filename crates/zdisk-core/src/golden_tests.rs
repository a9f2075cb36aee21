//! Golden vectors of the on-disk structures, written by hand from
//! docs/format.md: a version 3 root, record headers (a data, a trim and a
//! unit record), a staging record and a checkpoint directory's item
//! stream, each as bytes with the field every byte belongs to (map pages:
//! `map/page_golden_tests.rs`). Each is checked both ways: decoding the
//! bytes gives the fields the comments name, and encoding those fields
//! gives the bytes. A change to a format that moves, widens or renumbers a field
//! fails here even when its encoder and decoder change together; such a
//! change needs a new format version (and fixtures, tests/format_v1.rs),
//! not new vectors. The CRCs were computed apart from this code, by a
//! plain bitwise CRC32C over the bytes the format says they cover.

use crate::codec::{lz4_decompress, Codec};
use crate::dump::{decode_chunk_payload, encode_directory, Directory, DumpedSegment};
use crate::gc::GcPolicy;
use crate::map::{Map, MapCounts, PageLoc, PageSource, SnapshotPage};
use crate::media::MediaGeometry;
use crate::meta::{CheckpointRoot, DumpRef, MediaKind, OpenSegmentPos, Root, Settings, Superblock};
use crate::record::{
    decode_record, decode_ref, decode_unit, encode_record, encode_ref, encode_unit_prefix,
    range_count, record_len_for_payload, RecordHeader, RecordKey, RecordKind, RefMember,
    REF_NO_OWNER,
};
use crate::stats::Counters;
use crate::units::SegmentId;
use crate::volume::staging::Staged;

/// The volume UUID of every vector: bytes 0x10 to 0x1f. Records and
/// staging records are keyed with it.
const UUID: [u8; 16] = [
    0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18, 0x19, 0x1a, 0x1b, 0x1c, 0x1d, 0x1e, 0x1f,
];

/// A version 9 root of a 64 MiB file volume with one snapshot and one
/// clone of it, written cleanly. (Version 8 roots have the same layout;
/// version 9 only marks records written at fast effort. Version 7 roots have the same layout
/// without the snapshot's `volume` and the clone list, version 6 without
/// the snapshot list, versions 3 to 5 without the `dedup` byte either:
/// `meta.rs` tests that they still decode.)
#[rustfmt::skip]
const ROOT_V9: &[u8] = &[
    b'Z', b'D', b'I', b'S', b'K', b'M', b'T', b'1', // magic
    0x09, 0x00, 0x00, 0x00,                         // format_version 9
    0x08, 0x02, 0x00, 0x00,                         // total_length 520
    0x07, 0, 0, 0, 0, 0, 0, 0,                      // generation 7
    0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, // uuid
    0x18, 0x19, 0x1a, 0x1b, 0x1c, 0x1d, 0x1e, 0x1f,
    0x00, 0x00, 0x00, 0x04, 0, 0, 0, 0,             // logical_size_bytes 64 MiB
    0x00, 0x00, 0x10, 0x02, 0, 0, 0, 0,             // physical_size_bytes 33 MiB
    0x00, 0x10, 0x00, 0x00,                         // page_size_bytes 4096
    0x00, 0x00, 0x10, 0x00, 0, 0, 0, 0,             // segment_size_bytes 1 MiB
    0x20, 0x00, 0x00, 0x00,                         // segment_count 32
    0x00, 0x00, 0x08, 0x00,                         // meta_slot_size_bytes 512 KiB
    0x01,                                           // media_kind 1 (file)
    0x02, 0x00, 0x00, 0x00,                         // media_params_length 2
    0xab, 0xcd,                                     // media_params
    0x00, 0xf1, 0x53, 0x65, 0, 0, 0, 0,             // created_unix_secs 1700000000
    0x02,                                           // codec_id 2 (zstd)
    0x03, 0x00, 0x00, 0x00,                         // codec_level 3
    0x02,                                           // gc_policy 2 (cost-benefit)
    0x08,                                           // unit_blocks 8
    0x01,                                           // dedup 1 (on)
    0x01,                                           // clean
    0x28, 0, 0, 0, 0, 0, 0, 0,                      // seq_boundary 40
    0x2a, 0, 0, 0, 0, 0, 0, 0,                      // next_seq 42
    0xe8, 0x03, 0, 0, 0, 0, 0, 0,                   // next_version 1000
    0x32, 0, 0, 0, 0, 0, 0, 0,                      // seq_reserved 50
    0xd0, 0x07, 0, 0, 0, 0, 0, 0,                   // version_reserved 2000
    0x02, 0x00, 0x00, 0x00,                         // reserved_count 2
    0x05, 0x00, 0x00, 0x00,                         //   segment 5
    0x06, 0x00, 0x00, 0x00,                         //   segment 6
    0x01, 0x00, 0x00, 0x00,                         // open_count 1
    0x03, 0x00, 0x00, 0x00,                         //   segment 3
    0x29, 0, 0, 0, 0, 0, 0, 0,                      //   seq 41
    0x00, 0x20, 0, 0, 0, 0, 0, 0,                   //   offset 8192
    0x01,                                           // dump_present
    0x02, 0, 0, 0, 0, 0, 0, 0,                      //   record_count 2
    0x07, 0, 0, 0, 0, 0, 0, 0,                      //   generation 7
    0x01, 0x00, 0x00, 0x00,                         //   copy 0: 1 segment
    0x09, 0x00, 0x00, 0x00,                         //     segment 9
    0x01, 0x00, 0x00, 0x00,                         //   copy 1: 1 segment
    0x0a, 0x00, 0x00, 0x00,                         //     segment 10
    0x19, 0x00,                                     // counters: 25, (id u16, value u64) each
    0x01, 0x00, 0x01, 0, 0, 0, 0, 0, 0, 0,          //   1 host_write_bytes = 1
    0x02, 0x00, 0x02, 0, 0, 0, 0, 0, 0, 0,          //   2 host_read_bytes = 2
    0x03, 0x00, 0x03, 0, 0, 0, 0, 0, 0, 0,          //   3 media_write_bytes = 3
    0x04, 0x00, 0x04, 0, 0, 0, 0, 0, 0, 0,          //   4 padding_bytes = 4
    0x05, 0x00, 0x05, 0, 0, 0, 0, 0, 0, 0,          //   5 gc_write_bytes = 5
    0x06, 0x00, 0x06, 0, 0, 0, 0, 0, 0, 0,          //   6 gc_read_bytes = 6
    0x07, 0x00, 0x07, 0, 0, 0, 0, 0, 0, 0,          //   7 meta_write_bytes = 7
    0x08, 0x00, 0x08, 0, 0, 0, 0, 0, 0, 0,          //   8 segments_cleaned = 8
    0x09, 0x00, 0x09, 0, 0, 0, 0, 0, 0, 0,          //   9 checkpoints = 9
    0x0a, 0x00, 0x0a, 0, 0, 0, 0, 0, 0, 0,          //   10 flushes = 10
    0x0b, 0x00, 0x0b, 0, 0, 0, 0, 0, 0, 0,          //   11 media_read_bytes = 11
    0x0c, 0x00, 0x0c, 0, 0, 0, 0, 0, 0, 0,          //   12 host_trim_bytes = 12
    0x0d, 0x00, 0x0d, 0, 0, 0, 0, 0, 0, 0,          //   13 host_zero_bytes = 13
    0x0e, 0x00, 0x0e, 0, 0, 0, 0, 0, 0, 0,          //   14 recoveries = 14
    0x0f, 0x00, 0x0f, 0, 0, 0, 0, 0, 0, 0,          //   15 damaged_blocks_found = 15
    0x10, 0x00, 0x10, 0, 0, 0, 0, 0, 0, 0,          //   16 host_write_requests = 16
    0x11, 0x00, 0x11, 0, 0, 0, 0, 0, 0, 0,          //   17 segment_tail_bytes = 17
    0x12, 0x00, 0x12, 0, 0, 0, 0, 0, 0, 0,          //   18 staging_bytes = 18
    0x14, 0x00, 0x14, 0, 0, 0, 0, 0, 0, 0,          //   20 recompressed_blocks = 20
    0x15, 0x00, 0x15, 0, 0, 0, 0, 0, 0, 0,          //   21 recompress_in_bytes = 21
    0x16, 0x00, 0x16, 0, 0, 0, 0, 0, 0, 0,          //   22 recompress_out_bytes = 22
    0x17, 0x00, 0x17, 0, 0, 0, 0, 0, 0, 0,          //   23 dedup_blocks = 23
    0x18, 0x00, 0x18, 0, 0, 0, 0, 0, 0, 0,          //   24 dedup_saved_bytes = 24
    0x19, 0x00, 0x19, 0, 0, 0, 0, 0, 0, 0,          //   25 dedup_index_write_bytes = 25
    0x1a, 0x00, 0x1a, 0, 0, 0, 0, 0, 0, 0,          //   26 host_write_fast_bytes = 26
    0x01, 0x00,                                     // snapshot_count 1
    0x02, 0x00,                                     //   space 2
    0x00, 0x00,                                     //   volume 0 (the image's)
    0x84, 0x03, 0, 0, 0, 0, 0, 0,                   //   version 900
    0x64, 0xf1, 0x53, 0x65, 0, 0, 0, 0,             //   created_unix_secs 1_700_000_100
    0x07,                                           //   name_length 7
    b'n', b'i', b'g', b'h', b't', b'l', b'y',       //   name "nightly"
    0x01, 0x00,                                     // clone_count 1
    0x03, 0x00,                                     //   space 3
    0x02, 0x00,                                     //   base 2 (snapshot "nightly")
    0x85, 0x03, 0, 0, 0, 0, 0, 0,                   //   version 901
    0xc8, 0xf1, 0x53, 0x65, 0, 0, 0, 0,             //   created_unix_secs 1_700_000_200
    0x02,                                           //   name_length 2
    b'v', b'm',                                     //   name "vm"
    CRC_ROOT[0], CRC_ROOT[1], CRC_ROOT[2], CRC_ROOT[3], // crc: CRC32C of every byte above
];
const CRC_ROOT: [u8; 4] = 0x23ce_cbd0u32.to_le_bytes();

fn root_fields() -> Root {
    let mut counters = Counters::default();
    for (name, _) in Counters::DOCS {
        let id = counter_id(name);
        *counter_mut(&mut counters, name) = id;
    }
    Root {
        generation: 7,
        superblock: Superblock {
            uuid: UUID,
            logical_size_bytes: 64 << 20,
            physical_size_bytes: 33 << 20,
            geometry: MediaGeometry {
                page_size_bytes: 4096,
                segment_size_bytes: 1 << 20,
                segment_count: 32,
                meta_slot_size_bytes: 512 << 10,
            },
            media_kind: MediaKind::File,
            media_params: vec![0xab, 0xcd],
            created_unix_secs: 1_700_000_000,
        },
        settings: Settings {
            codec: Codec::Zstd { level: 3 },
            gc_policy: GcPolicy::CostBenefit,
            unit_blocks: 8,
            dedup: true,
        },
        checkpoint: CheckpointRoot {
            clean: true,
            seq_boundary: 40,
            next_seq: 42,
            next_version: 1000,
            seq_reserved: 50,
            version_reserved: 2000,
            reserved_segments: vec![SegmentId(5), SegmentId(6)],
            open_segments: vec![OpenSegmentPos {
                segment: SegmentId(3),
                seq: 41,
                offset_bytes: 8192,
            }],
            dump: Some(DumpRef {
                copies: [vec![SegmentId(9)], vec![SegmentId(10)]],
                record_count: 2,
                generation: 7,
            }),
            counters,
            snapshots: {
                let mut snapshots = crate::snapshots::Snapshots::default();
                snapshots.apply(&crate::snapshots::SnapshotChange::Take(
                    crate::snapshots::Snapshot {
                        space: 2,
                        volume: 0,
                        version: 900,
                        name: "nightly".into(),
                        created_unix_secs: 1_700_000_100,
                    },
                ));
                snapshots.apply(&crate::snapshots::SnapshotChange::Clone(
                    crate::snapshots::CloneVolume {
                        space: 3,
                        base: 2,
                        version: 901,
                        name: "vm".into(),
                        created_unix_secs: 1_700_000_200,
                    },
                ));
                snapshots
            },
        },
    }
}

/// The id docs/format.md gives each counter.
fn counter_id(name: &str) -> u64 {
    match name {
        "host_write_bytes" => 1,
        "host_read_bytes" => 2,
        "media_write_bytes" => 3,
        "padding_bytes" => 4,
        "gc_write_bytes" => 5,
        "gc_read_bytes" => 6,
        "meta_write_bytes" => 7,
        "segments_cleaned" => 8,
        "checkpoints" => 9,
        "flushes" => 10,
        "media_read_bytes" => 11,
        "host_trim_bytes" => 12,
        "host_zero_bytes" => 13,
        "recoveries" => 14,
        "damaged_blocks_found" => 15,
        "host_write_requests" => 16,
        "segment_tail_bytes" => 17,
        "staging_bytes" => 18,
        "recompressed_blocks" => 20,
        "recompress_in_bytes" => 21,
        "recompress_out_bytes" => 22,
        "dedup_blocks" => 23,
        "dedup_saved_bytes" => 24,
        "dedup_index_write_bytes" => 25,
        "host_write_fast_bytes" => 26,
        other => panic!("counter {other} has no id in docs/format.md"),
    }
}

fn counter_mut<'a>(counters: &'a mut Counters, name: &str) -> &'a mut u64 {
    match name {
        "host_write_bytes" => &mut counters.host_write_bytes,
        "host_read_bytes" => &mut counters.host_read_bytes,
        "media_write_bytes" => &mut counters.media_write_bytes,
        "padding_bytes" => &mut counters.padding_bytes,
        "gc_write_bytes" => &mut counters.gc_write_bytes,
        "gc_read_bytes" => &mut counters.gc_read_bytes,
        "meta_write_bytes" => &mut counters.meta_write_bytes,
        "segments_cleaned" => &mut counters.segments_cleaned,
        "checkpoints" => &mut counters.checkpoints,
        "flushes" => &mut counters.flushes,
        "media_read_bytes" => &mut counters.media_read_bytes,
        "host_trim_bytes" => &mut counters.host_trim_bytes,
        "host_zero_bytes" => &mut counters.host_zero_bytes,
        "recoveries" => &mut counters.recoveries,
        "damaged_blocks_found" => &mut counters.damaged_blocks_found,
        "host_write_requests" => &mut counters.host_write_requests,
        "segment_tail_bytes" => &mut counters.segment_tail_bytes,
        "staging_bytes" => &mut counters.staging_bytes,
        "recompressed_blocks" => &mut counters.recompressed_blocks,
        "recompress_in_bytes" => &mut counters.recompress_in_bytes,
        "recompress_out_bytes" => &mut counters.recompress_out_bytes,
        "dedup_blocks" => &mut counters.dedup_blocks,
        "dedup_saved_bytes" => &mut counters.dedup_saved_bytes,
        "dedup_index_write_bytes" => &mut counters.dedup_index_write_bytes,
        "host_write_fast_bytes" => &mut counters.host_write_fast_bytes,
        other => panic!("counter {other} is not in this test"),
    }
}

#[test]
fn root_v9_decodes_to_its_fields() {
    let root = Root::decode(ROOT_V9).expect("the golden root decodes");
    assert_eq!(root, root_fields());
    for (name, _) in Counters::DOCS {
        assert_eq!(
            root.checkpoint.counters.get(name),
            Some(counter_id(name)),
            "{name}"
        );
    }
}

#[test]
fn root_v9_fields_encode_to_the_golden_bytes() {
    assert_eq!(root_fields().encode(), ROOT_V9);
}

#[test]
fn a_root_with_any_byte_changed_is_refused() {
    for at in [0, 8, 12, 16, 100, ROOT_V9.len() - 1] {
        let mut bytes = ROOT_V9.to_vec();
        bytes[at] ^= 0x01;
        assert!(Root::decode(&bytes).is_err(), "byte {at} flipped");
    }
}

/// A data record: block 0x1234 at version 1000, LZ4, 5 payload bytes (the
/// record framing does not look inside them), in incarnation 41.
#[rustfmt::skip]
const DATA_RECORD: &[u8] = &[
    0x5a, 0x52,                                     // magic "ZR"
    0x01,                                           // kind 1 (data)
    0x01,                                           // codec 1 (LZ4)
    0x29, 0x00, 0x00, 0x00,                         // seg_seq 41
    0x34, 0x12, 0, 0, 0, 0, 0, 0,                   // lba 0x1234
    0xe8, 0x03, 0, 0, 0, 0, 0, 0,                   // version 1000
    0x05, 0x00, 0x00, 0x00,                         // payload_length 5
    CRC_DATA[0], CRC_DATA[1], CRC_DATA[2], CRC_DATA[3], // crc: payload, header 0..28, uuid
    0x50, 0x61, 0x79, 0x21, 0x0a,                   // payload
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,                // zeros to a multiple of 16 (48)
];
const CRC_DATA: [u8; 4] = 0x034c_af27u32.to_le_bytes();

/// A trim record: 300 blocks from block 64 at version 1001.
#[rustfmt::skip]
const TRIM_RECORD: &[u8] = &[
    0x5a, 0x52,                                     // magic "ZR"
    0x02,                                           // kind 2 (trim)
    0x00,                                           // codec 0 (not data)
    0x29, 0x00, 0x00, 0x00,                         // seg_seq 41
    0x40, 0, 0, 0, 0, 0, 0, 0,                      // lba: first block 64
    0xe9, 0x03, 0, 0, 0, 0, 0, 0,                   // version 1001
    0x08, 0x00, 0x00, 0x00,                         // payload_length 8
    CRC_TRIM[0], CRC_TRIM[1], CRC_TRIM[2], CRC_TRIM[3], // crc
    0x2c, 0x01, 0, 0, 0, 0, 0, 0,                   // payload: block count 300
    0, 0, 0, 0, 0, 0, 0, 0,                         // zeros to 48
];
const CRC_TRIM: [u8; 4] = 0x754c_26a4u32.to_le_bytes();

/// A unit record of blocks 96..99 at versions 7, 9 and 8 (not
/// consecutive, so listed), zstd, written by the cold-data pass.
#[rustfmt::skip]
const UNIT_RECORD: &[u8] = &[
    0x5a, 0x52,                                     // magic "ZR"
    0x06,                                           // kind 6 (unit)
    0x02,                                           // codec 2 (zstd)
    0x29, 0x00, 0x00, 0x00,                         // seg_seq 41
    0x60, 0, 0, 0, 0, 0, 0, 0,                      // lba: first block 96
    0x09, 0, 0, 0, 0, 0, 0, 0,                      // version: the highest, 9
    0x1f, 0x00, 0x00, 0x00,                         // payload_length 31
    CRC_UNIT[0], CRC_UNIT[1], CRC_UNIT[2], CRC_UNIT[3], // crc
    0x03,                                           // count 3
    0x02,                                           // flags: 2 cold-data pass (1 clear: listed)
    0x00, 0x00,                                     // reserved
    0x07, 0, 0, 0, 0, 0, 0, 0,                      // version of block 96
    0x09, 0, 0, 0, 0, 0, 0, 0,                      // version of block 97
    0x08, 0, 0, 0, 0, 0, 0, 0,                      // version of block 98
    0xc0, 0xff, 0xee,                               // data (compressed blocks)
    0,                                              // zero to 64
];
const CRC_UNIT: [u8; 4] = 0x02de_8ab0u32.to_le_bytes();

/// A reference record (format 5): blocks 0x200 and 0x201, at versions
/// 1002 and 1003, share content version 1000 (block 0x1234 held it
/// directly, and becomes shared) and content 900 (shared already).
#[rustfmt::skip]
const REF_RECORD: &[u8] = &[
    0x5a, 0x52,                                     // magic "ZR"
    0x07,                                           // kind 7 (reference)
    0x00,                                           // codec 0 (not data)
    0x29, 0x00, 0x00, 0x00,                         // seg_seq 41
    0x00, 0x02, 0, 0, 0, 0, 0, 0,                   // lba: first block 0x200
    0xea, 0x03, 0, 0, 0, 0, 0, 0,                   // version of the first block, 1002
    0x24, 0x00, 0x00, 0x00,                         // payload_length 36
    CRC_REF[0], CRC_REF[1], CRC_REF[2], CRC_REF[3], // crc
    0x02, 0x00, 0x00, 0x00,                         // count 2
    0xe8, 0x03, 0, 0, 0, 0, 0, 0,                   // block 0x200: content 1000
    0x34, 0x12, 0, 0, 0, 0, 0, 0,                   //   owner block 0x1234
    0x84, 0x03, 0, 0, 0, 0, 0, 0,                   // block 0x201: content 900
    0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, //   no owner: shared already
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,             // zeros to 80
];
const CRC_REF: [u8; 4] = 0x1ece_9886u32.to_le_bytes();

struct RecordCase {
    bytes: &'static [u8],
    header: RecordHeader,
    payload: Vec<u8>,
}

fn record_cases() -> Vec<RecordCase> {
    let header = |kind, codec, lba, version, payload_len, crc: [u8; 4]| RecordHeader {
        kind,
        codec,
        seg_seq: 41,
        lba,
        version,
        payload_len,
        crc: u32::from_le_bytes(crc),
    };
    let mut unit_payload = encode_unit_prefix(&[7, 9, 8], true);
    unit_payload.extend_from_slice(&[0xc0, 0xff, 0xee]);
    vec![
        RecordCase {
            bytes: DATA_RECORD,
            header: header(RecordKind::Data, 1, 0x1234, 1000, 5, CRC_DATA),
            payload: b"Pay!\n".to_vec(),
        },
        RecordCase {
            bytes: TRIM_RECORD,
            header: header(RecordKind::Trim, 0, 64, 1001, 8, CRC_TRIM),
            payload: 300u64.to_le_bytes().to_vec(),
        },
        RecordCase {
            bytes: UNIT_RECORD,
            header: header(RecordKind::Unit, 2, 96, 9, 31, CRC_UNIT),
            payload: unit_payload,
        },
        RecordCase {
            bytes: REF_RECORD,
            header: header(RecordKind::Ref, 0, 0x200, 1002, 36, CRC_REF),
            payload: encode_ref(&ref_members()),
        },
    ]
}

#[test]
fn records_decode_to_their_fields() {
    for case in record_cases() {
        let (header, payload) =
            decode_record(case.bytes, &RecordKey(UUID), Some(41)).expect("the record decodes");
        assert_eq!(header, case.header);
        assert_eq!(payload, case.payload.as_slice(), "{:?}", case.header.kind);
        assert_eq!(header.record_len(), case.bytes.len() as u64);
    }
    let trim = &record_cases()[1];
    assert_eq!(range_count(&trim.payload), 300);
    let unit = &record_cases()[2];
    let decoded = decode_unit(&unit.header, &unit.payload).expect("the unit decodes");
    assert_eq!(decoded.versions, [7, 9, 8]);
    assert!(decoded.recompressed);
    assert_eq!(decoded.data, [0xc0, 0xff, 0xee]);
    let reference = &record_cases()[3];
    assert_eq!(decode_ref(&reference.payload).unwrap(), ref_members());
}

fn ref_members() -> Vec<RefMember> {
    vec![
        RefMember {
            content: 1000,
            owner: 0x1234,
        },
        RefMember {
            content: 900,
            owner: REF_NO_OWNER,
        },
    ]
}

#[test]
fn record_fields_encode_to_the_golden_bytes() {
    for case in record_cases() {
        let mut out = vec![0xaa; record_len_for_payload(case.payload.len()) as usize];
        let header = RecordHeader {
            crc: 0,
            ..case.header
        };
        encode_record(
            &mut out,
            header,
            &case.payload,
            crc32c::crc32c(&case.payload),
            &RecordKey(UUID),
        );
        assert_eq!(out, case.bytes, "{:?}", case.header.kind);
    }
}

#[test]
fn a_record_of_another_volume_or_incarnation_is_refused() {
    for case in record_cases() {
        let mut other = UUID;
        other[15] ^= 1;
        assert!(decode_record(case.bytes, &RecordKey(other), Some(41)).is_err());
        assert!(decode_record(case.bytes, &RecordKey(UUID), Some(42)).is_err());
    }
}

/// A staging record: the first 5 bytes of the sector at 1024 of
/// incarnation 0x1_0000_0029 of segment 3; one 512-byte sector.
#[rustfmt::skip]
const STAGING_HEAD: &[u8] = &[
    b'Z', b'S', b'T', b'G',                         // magic
    0x03, 0x00, 0x00, 0x00,                         // segment 3
    0x29, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, // seq 0x1_0000_0029
    0x00, 0x04, 0x00, 0x00,                         // offset 1024
    0x05, 0x00,                                     // length 5
    0x00, 0x00,                                     // zero
    CRC_STAGING[0], CRC_STAGING[1], CRC_STAGING[2], CRC_STAGING[3], // crc: data, bytes 0..24, uuid
    0x00, 0x00, 0x00, 0x00,                         // zero
    0x5a, 0x52, 0x01, 0x02, 0x03,                   // data
];
const CRC_STAGING: [u8; 4] = 0xa790_f57bu32.to_le_bytes();

fn staging_fields() -> Staged {
    Staged {
        segment: SegmentId(3),
        seq: 0x1_0000_0029,
        offset_bytes: 1024,
        data: vec![0x5a, 0x52, 0x01, 0x02, 0x03],
    }
}

#[test]
fn a_staging_record_decodes_to_its_fields() {
    let mut sector = STAGING_HEAD.to_vec();
    sector.resize(512, 0);
    assert_eq!(
        Staged::decode(&sector, &RecordKey(UUID)),
        Some(staging_fields())
    );
}

#[test]
fn staging_fields_encode_to_the_golden_bytes() {
    let encoded = staging_fields().encode(&RecordKey(UUID));
    assert_eq!(encoded.len(), 512, "one sector");
    assert_eq!(&encoded[..STAGING_HEAD.len()], STAGING_HEAD);
    assert!(encoded[STAGING_HEAD.len()..].iter().all(|&b| b == 0));
}

/// A version 3 checkpoint directory's item stream (uncompressed): the
/// map's totals, two pages, a segment and a segment with cold data.
#[rustfmt::skip]
const DIRECTORY_RAW: &[u8] = &[
    0x04,                                           // item 4: map totals
    0x03,                                           //   data_blocks 3
    0xac, 0x02,                                     //   zero_blocks 300
    0x00,                                           //   damaged_blocks 0
    0xd0, 0x28,                                     //   stored_bytes 5200
    0x05,                                           // item 5: page
    0x00,                                           //   first block: 0 past the previous end (0)
    0x80, 0x02,                                     //   blocks 256
    0x01,                                           //   chunk_items 1
    0x1e,                                           //   payload_length 30
    0x05,                                           // item 5: page
    0x80, 0x02,                                     //   first block: 256 past the previous end (256)
    0x80, 0x04,                                     //   blocks 512
    0x02,                                           //   chunk_items 2
    0x09,                                           //   payload_length 9
    0x06,                                           // item 6: kept page
    0x80, 0x04,                                     //   first block: 512 past the previous end (1024)
    0x80, 0x02,                                     //   blocks 256
    0x01,                                           //   chunk_items 1
    0x20,                                           //   payload_length 32
    0x05,                                           //   copy 0 in segment 5
    0xc8, 0x01,                                     //   offset 3200 (200 x 16)
    0x07,                                           //   written by generation 7
    0x02,                                           // item 2: segment
    0x03, 0x00, 0x00, 0x00,                         //   id 3
    0x29, 0, 0, 0, 0, 0, 0, 0,                      //   seq 41
    0x00, 0x20, 0, 0, 0, 0, 0, 0,                   //   fill_bytes 8192
    0xe8, 0x03, 0, 0, 0, 0, 0, 0,                   //   max_version 1000
    0x03,                                           // item 3: segment with cold data
    0x04, 0x00, 0x00, 0x00,                         //   id 4
    0x2b, 0, 0, 0, 0, 0, 0, 0,                      //   seq 43
    0x00, 0x10, 0, 0, 0, 0, 0, 0,                   //   fill_bytes 4096
    0xe9, 0x03, 0, 0, 0, 0, 0, 0,                   //   max_version 1001
    0x00, 0x08, 0, 0, 0, 0, 0, 0,                   //   cold_bytes 2048
    0x07,                                           // item 7: segment with fast-effort data (format 9)
    0x06, 0x00, 0x00, 0x00,                         //   id 6
    0x2c, 0, 0, 0, 0, 0, 0, 0,                      //   seq 44
    0x00, 0x30, 0, 0, 0, 0, 0, 0,                   //   fill_bytes 12288
    0xea, 0x03, 0, 0, 0, 0, 0, 0,                   //   max_version 1002
    0x00, 0x00, 0, 0, 0, 0, 0, 0,                   //   cold_bytes 0
    0x00, 0x2c, 0, 0, 0, 0, 0, 0,                   //   fast_bytes 11264
    0x00,                                           // item 0: end
];

fn directory_counts() -> MapCounts {
    MapCounts {
        data_blocks: 3,
        zero_blocks: 300,
        damaged_blocks: 0,
        stored_bytes: 5200,
    }
}

fn directory_segments() -> Vec<(SegmentId, DumpedSegment)> {
    vec![
        (
            SegmentId(3),
            DumpedSegment {
                seq: 41,
                fill_bytes: 8192,
                max_version: 1000,
                cold_bytes: 0,
                fast_bytes: 0,
            },
        ),
        (
            SegmentId(4),
            DumpedSegment {
                seq: 43,
                fill_bytes: 4096,
                max_version: 1001,
                cold_bytes: 2048,
                fast_bytes: 0,
            },
        ),
        (
            SegmentId(6),
            DumpedSegment {
                seq: 44,
                fill_bytes: 12288,
                max_version: 1002,
                cold_bytes: 0,
                fast_bytes: 11264,
            },
        ),
    ]
}

/// A chunk record's payload: the uncompressed length (u32), then a
/// literal-only LZ4 block of `raw` (token 0xf0, the length past 15 in
/// 255s and a last byte, the literals), which any LZ4 decoder reads.
fn literal_lz4_payload(raw: &[u8]) -> Vec<u8> {
    let mut out = (raw.len() as u32).to_le_bytes().to_vec();
    out.push(0xf0);
    let mut extra = raw.len() - 15;
    while extra >= 255 {
        out.push(255);
        extra -= 255;
    }
    out.push(extra as u8);
    out.extend_from_slice(raw);
    out
}

#[test]
fn a_golden_directory_decodes_to_its_items() {
    let mut map = Map::new(true);
    let mut directory = Directory::default();
    let mut segments = vec![None; 8];
    decode_chunk_payload(
        &literal_lz4_payload(DIRECTORY_RAW),
        &mut map,
        &mut directory,
        &mut segments,
        1 << 20,
    )
    .expect("the golden directory decodes");
    let (totals, pages) = directory.contents();
    assert_eq!(totals, Some(directory_counts()));
    assert_eq!(
        pages,
        [
            (0, 256, 1, 30, None),
            (512, 512, 2, 9, None),
            (1536, 256, 1, 32, Some((5, 3200, 7)))
        ]
    );
    for (segment, dumped) in directory_segments() {
        assert_eq!(segments[segment.0 as usize], Some(dumped), "{segment:?}");
    }
    let listed = segments.iter().filter(|s| s.is_some()).count();
    assert_eq!(listed, 3, "only the listed segments");
}

#[test]
fn directory_items_encode_to_the_golden_stream() {
    let page = |start, blocks, chunk_items, payload_bytes| SnapshotPage {
        start,
        blocks,
        chunk_items,
        source: PageSource::Encoded(vec![0; payload_bytes]),
    };
    let kept = SnapshotPage {
        start: 1536,
        blocks: 256,
        chunk_items: 1,
        source: PageSource::Kept(PageLoc {
            segments: [SegmentId(5), SegmentId(6)],
            offset: 3200,
            len: 64,
            generation: 7,
        }),
    };
    let pages = [page(0, 256, 1, 30), page(512, 512, 2, 9), kept];
    let payloads = encode_directory(
        &pages,
        directory_counts(),
        directory_segments().into_iter(),
        1 << 20,
    );
    assert_eq!(payloads.len(), 1, "one directory record");
    let payload = &payloads[0];
    let raw_len = u32::from_le_bytes(payload[..4].try_into().unwrap()) as usize;
    assert_eq!(raw_len, DIRECTORY_RAW.len());
    let raw = lz4_decompress(&payload[4..], raw_len).expect("the LZ4 block decodes");
    assert_eq!(raw, DIRECTORY_RAW);
}
