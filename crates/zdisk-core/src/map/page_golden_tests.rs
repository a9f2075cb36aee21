//! Golden bytes of map pages (docs/format.md, "Page records"), written by
//! hand: a run leaf and a sparse leaf with a zero entry, a one-block data
//! record, a unit member (whose offset and version are deltas against
//! the data entry before it) and a shared entry (format 5). Decoding the golden payload gives the
//! entries; encoding the leaf gives the golden uncompressed stream (the
//! LZ4 block around it is any valid one: the golden payloads here are
//! literal-only LZ4 blocks, which any decoder reads).

use super::entry::{Entry, Location, Slot};
use super::leaf::Leaf;
use super::page::{decode_page, encode_page};
use crate::codec::lz4_decompress;
use crate::units::SegmentId;

/// A run leaf: 512 blocks, all zeros written at version 9.
#[rustfmt::skip]
const RUN_RAW: &[u8] = &[
    0x00,                                           // form 0 run
    0x80, 0x04,                                     // blocks 512 (varint)
    0x01, 0x09,                                     // entry: zero (tag 1), version 9
];

/// A sparse leaf of one chunk: block 3 zero at version 5, block 10 a data
/// record (segment 2, offset 4096, 4128 bytes) at version 7, block 11
/// member 1 of a 3-block unit right after it (1024 bytes) at version 6,
/// block 20 sharing content version 1000 at version 1005.
#[rustfmt::skip]
const SPARSE_RAW: &[u8] = &[
    0x02,                                           // form 2 sparse
    0x80, 0x02,                                     // blocks 256 (varint)
    0x04,                                           // count 4
    0x03,                                           // key delta 3: block 3
    0x01, 0x05,                                     //   zero (tag 1), version 5
    0x07,                                           // key delta 7: block 10
    0x02,                                           //   data (tag 2)
    0x04,                                           //   segment delta +2 (zigzag)
    0x80, 0x40,                                     //   offset delta +4096 (zigzag varint)
    0xa0, 0x20,                                     //   record length 4128 (varint)
    0x00, 0x01,                                     //   member 0 of 1
    0x0e,                                           //   version delta +7 (zigzag)
    0x01,                                           // key delta 1: block 11
    0x02,                                           //   data (tag 2)
    0x00,                                           //   segment delta 0
    0x00,                                           //   offset delta 0: where the last ended
    0x80, 0x08,                                     //   record length 1024
    0x01, 0x03,                                     //   member 1 of 3
    0x01,                                           //   version delta -1 (zigzag)
    0x09,                                           // key delta 9: block 20
    0x04,                                           //   shared (tag 4)
    0xe8, 0x07,                                     //   content version 1000 (varint)
    0xed, 0x07,                                     //   version 1005 (varint)
];

/// A page payload: the uncompressed length (u32), then a literal-only LZ4
/// block of `raw` (token, extra length byte past 15, the literals).
fn payload(raw: &[u8]) -> Vec<u8> {
    let mut out = (raw.len() as u32).to_le_bytes().to_vec();
    if raw.len() < 15 {
        out.push((raw.len() as u8) << 4);
    } else {
        assert!(raw.len() - 15 < 255, "one extra length byte");
        out.push(0xf0);
        out.push((raw.len() - 15) as u8);
    }
    out.extend_from_slice(raw);
    out
}

fn data(segment: u32, offset: u32, len: u32, member: u8, members: u8, version: u64) -> Entry {
    let loc = Location::unit_member(SegmentId(segment), offset, len, member, members);
    Entry::new(Slot::Data(loc), version)
}

fn sparse_leaf() -> Leaf {
    Leaf::sparse(
        256,
        vec![3, 10, 11, 20],
        &[
            Entry::new(Slot::Zero, 5),
            data(2, 4096, 4128, 0, 1, 7),
            data(2, 8224, 1024, 1, 3, 6),
            Entry::new(Slot::Shared { content: 1000 }, 1005),
        ],
    )
}

/// The uncompressed stream of an encoded page payload.
fn raw_of(payload: &[u8]) -> Vec<u8> {
    let len = u32::from_le_bytes(payload[..4].try_into().unwrap()) as usize;
    lz4_decompress(&payload[4..], len).expect("the page's LZ4 block decodes")
}

#[test]
fn golden_pages_decode_to_their_entries() {
    let run = decode_page(&payload(RUN_RAW), 16).expect("the run page decodes");
    assert_eq!(run.blocks(), 512);
    for offset in [0, 255, 511] {
        assert_eq!(run.get(offset), Entry::new(Slot::Zero, 9), "block {offset}");
    }
    let sparse = decode_page(&payload(SPARSE_RAW), 16).expect("the sparse page decodes");
    assert_eq!(sparse.blocks(), 256);
    let expected = sparse_leaf();
    for offset in 0..256 {
        assert_eq!(sparse.get(offset), expected.get(offset), "block {offset}");
    }
    assert_eq!(sparse.get(10), data(2, 4096, 4128, 0, 1, 7));
    assert_eq!(sparse.get(11), data(2, 8224, 1024, 1, 3, 6));
    assert_eq!(
        sparse.get(20),
        Entry::new(Slot::Shared { content: 1000 }, 1005)
    );
    assert_eq!(
        sparse.get(4),
        Entry::default(),
        "a key not listed is a hole"
    );
}

#[test]
fn leaves_encode_to_the_golden_streams() {
    let run = Leaf::Run {
        blocks: 512,
        entry: Entry::new(Slot::Zero, 9),
    };
    assert_eq!(raw_of(&encode_page(&run)), RUN_RAW);
    assert_eq!(raw_of(&encode_page(&sparse_leaf())), SPARSE_RAW);
}

#[test]
fn a_page_naming_a_segment_beyond_the_medium_is_refused() {
    assert!(
        decode_page(&payload(SPARSE_RAW), 2).is_err(),
        "segment 2 of 2"
    );
    assert!(decode_page(&payload(SPARSE_RAW), 3).is_ok());
}
