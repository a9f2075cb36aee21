//! Golden bytes of the write-ahead log's format (docs/format.md, "The
//! benchmark's write-ahead log"), written by hand: two chained commit
//! records and an anchor. Each is checked both ways: decoding gives the
//! fields, encoding the fields gives the bytes, so a change that moves a
//! field or the CRC chain's coverage fails here even if the encoder and
//! decoder change together. The CRCs were computed apart from this code
//! (a bitwise CRC32C over the bytes the format says they cover).

use super::format::{
    decode_header, encode_record, initial_chain_crc, verify_record, Anchor, Layout, RecordHeader,
};

/// The log id of every vector; the first commit's chain starts from
/// CRC32C of its 8 little-endian bytes.
const LOG_ID: u64 = 0x1122_3344_5566_7788;

/// Commit 1 of epoch 3, payload "commit".
#[rustfmt::skip]
const COMMIT_1: &[u8] = &[
    b'W', b'A', b'L', b'r',                         // magic
    0x06, 0x00, 0x00, 0x00,                         // payload length 6
    0x01, 0, 0, 0, 0, 0, 0, 0,                      // sequence number 1
    CRC_1[0], CRC_1[1], CRC_1[2], CRC_1[3],         // crc: from the log id's, over 0..16, 20..24, payload
    0x03, 0x00, 0x00, 0x00,                         // epoch 3
    b'c', b'o', b'm', b'm', b'i', b't',             // payload
];
const CRC_1: [u8; 4] = 0x2d1b_5c1fu32.to_le_bytes();

/// Commit 2 of epoch 3, payload "ok", chained from commit 1's CRC.
#[rustfmt::skip]
const COMMIT_2: &[u8] = &[
    b'W', b'A', b'L', b'r',                         // magic
    0x02, 0x00, 0x00, 0x00,                         // payload length 2
    0x02, 0, 0, 0, 0, 0, 0, 0,                      // sequence number 2
    CRC_2[0], CRC_2[1], CRC_2[2], CRC_2[3],         // crc: from commit 1's
    0x03, 0x00, 0x00, 0x00,                         // epoch 3
    b'o', b'k',                                     // payload
];
const CRC_2: [u8; 4] = 0x9c87_45e0u32.to_le_bytes();

/// The anchor of a sparse log of 64 blocks whose live part starts at
/// position 12288 with commit 42.
#[rustfmt::skip]
const ANCHOR: &[u8] = &[
    b'z', b'd', b'i', b's', b'k', b'W', b'A', b'L', // magic
    0x01, 0x00, 0x00, 0x00,                         // format version 1
    0x02, 0x00, 0x00, 0x00,                         // layout 2 (sparse)
    0x05, 0, 0, 0, 0, 0, 0, 0,                      // generation 5 (slot 1)
    0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, // log id
    0x00, 0x00, 0x04, 0, 0, 0, 0, 0,                // area bytes 256 KiB
    0x00, 0x30, 0, 0, 0, 0, 0, 0,                   // start position 12288
    0x2a, 0, 0, 0, 0, 0, 0, 0,                      // start sequence number 42
    0xef, 0xbe, 0xad, 0xde,                         // chain CRC 0xdeadbeef
    0x00, 0x10, 0x00, 0x00,                         // block bytes 4096
    CRC_ANCHOR[0], CRC_ANCHOR[1], CRC_ANCHOR[2], CRC_ANCHOR[3], // CRC32C of bytes 0..64
];
const CRC_ANCHOR: [u8; 4] = 0xe862_8feau32.to_le_bytes();

#[test]
fn commits_decode_to_their_fields_and_chain() {
    let first_crc = initial_chain_crc(LOG_ID);
    assert_eq!(
        first_crc,
        u32::from_le_bytes(CRC_LOG_ID),
        "CRC32C of the log id"
    );
    assert_eq!(
        decode_header(COMMIT_1),
        Some(RecordHeader {
            payload_bytes: 6,
            seq: 1,
            crc: u32::from_le_bytes(CRC_1),
            epoch: 3,
        })
    );
    assert!(verify_record(COMMIT_1, first_crc));
    assert_eq!(
        decode_header(COMMIT_2),
        Some(RecordHeader {
            payload_bytes: 2,
            seq: 2,
            crc: u32::from_le_bytes(CRC_2),
            epoch: 3,
        })
    );
    assert!(verify_record(COMMIT_2, u32::from_le_bytes(CRC_1)));
    assert!(
        !verify_record(COMMIT_2, first_crc),
        "commit 2 follows commit 1 only"
    );
}

/// CRC32C of the log id's little-endian bytes.
const CRC_LOG_ID: [u8; 4] = 0xaf59_5116u32.to_le_bytes();

#[test]
fn commit_fields_encode_to_the_golden_bytes() {
    let (first, crc) = encode_record(1, 3, b"commit", initial_chain_crc(LOG_ID));
    assert_eq!(first, COMMIT_1);
    assert_eq!(crc, u32::from_le_bytes(CRC_1));
    let (second, crc) = encode_record(2, 3, b"ok", crc);
    assert_eq!(second, COMMIT_2);
    assert_eq!(crc, u32::from_le_bytes(CRC_2));
}

fn anchor_fields() -> Anchor {
    Anchor {
        layout: Layout::Sparse,
        generation: 5,
        log_id: LOG_ID,
        area_bytes: 64 * 4096,
        start_position: 3 * 4096,
        start_seq: 42,
        chain_crc: 0xdead_beef,
    }
}

#[test]
fn the_anchor_decodes_to_its_fields() {
    let mut block = ANCHOR.to_vec();
    block.resize(4096, 0);
    assert_eq!(Anchor::decode(&block), Some(anchor_fields()));
    assert_eq!(anchor_fields().slot(), 1, "generation 5 lives in slot 1");
}

#[test]
fn anchor_fields_encode_to_the_golden_block() {
    let block = anchor_fields().encode();
    assert_eq!(block.len(), 4096, "one block");
    assert_eq!(&block[..ANCHOR.len()], ANCHOR);
    assert!(block[ANCHOR.len()..].iter().all(|&b| b == 0));
}
