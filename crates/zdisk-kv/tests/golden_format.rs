//! Golden bytes of the key-value store's layout (docs/format.md, "The
//! key-value store's layout"), written by hand: a superblock and a slot
//! holding two records with its OVERFLOWED flag set. Each is checked both
//! ways: decoding the bytes gives the fields, and building the same
//! geometry or slot through the crate gives the bytes. A change that moves
//! a field fails here even if the encoder and decoder change together. The
//! CRCs were computed apart from this code (a bitwise CRC32C).

use zdisk_kv::format::{Geometry, Slot, SLOT_BYTES};

/// A store of 1000 home slots and 8 probe slots.
#[rustfmt::skip]
const SUPERBLOCK_HEAD: &[u8] = &[
    b'Z', b'D', b'I', b'S', b'K', b'K', b'V', b'1', // magic
    0x01, 0x00, 0x00, 0x00,                         // version 1
    0x00, 0x10, 0x00, 0x00,                         // slot_bytes 4096
    0xe8, 0x03, 0, 0, 0, 0, 0, 0,                   // home_slots 1000
    0xf0, 0x03, 0, 0, 0, 0, 0, 0,                   // total_slots 1008
    0x08, 0x00, 0x00, 0x00,                         // probe_slots 8
    CRC_SUPERBLOCK[0], CRC_SUPERBLOCK[1], CRC_SUPERBLOCK[2], CRC_SUPERBLOCK[3], // crc32c of bytes 0..36
];
const CRC_SUPERBLOCK: [u8; 4] = 0xf9ee_9cefu32.to_le_bytes();

/// A slot with "alpha" = "one" and "be" = [7, 8], overflowed.
#[rustfmt::skip]
const SLOT_HEAD: &[u8] = &[
    b'K', b'V', b'S', b'1',                         // magic
    CRC_SLOT[0], CRC_SLOT[1], CRC_SLOT[2], CRC_SLOT[3], // crc32c of bytes 8..16+used_bytes
    0x02, 0x00,                                     // record_count 2
    0x12, 0x00,                                     // used_bytes 18
    0x01,                                           // flags: OVERFLOWED
    0x00, 0x00, 0x00,                               // reserved
    0x05,                                           // key_len 5
    0x03, 0x00,                                     // value_len 3
    b'a', b'l', b'p', b'h', b'a',                   // key
    b'o', b'n', b'e',                               // value
    0x02,                                           // key_len 2
    0x02, 0x00,                                     // value_len 2
    b'b', b'e',                                     // key
    0x07, 0x08,                                     // value
];
const CRC_SLOT: [u8; 4] = 0xa506_c46eu32.to_le_bytes();

fn block(head: &[u8]) -> Box<[u8; SLOT_BYTES]> {
    let mut block = Box::new([0u8; SLOT_BYTES]);
    block[..head.len()].copy_from_slice(head);
    block
}

fn geometry() -> Geometry {
    Geometry {
        home_slots: 1000,
        probe_slots: 8,
    }
}

#[test]
fn the_superblock_decodes_to_its_fields() {
    let decoded = Geometry::decode(&block(SUPERBLOCK_HEAD)[..]).expect("the superblock decodes");
    assert_eq!(decoded, geometry());
    assert_eq!(decoded.total_slots(), 1008);
    assert_eq!(
        decoded.slot_offset(0),
        4096,
        "slot 0 follows the superblock"
    );
    assert_eq!(decoded.slot_offset(1007), 1008 * 4096);
}

#[test]
fn the_geometry_encodes_to_the_golden_superblock() {
    assert_eq!(geometry().encode(), block(SUPERBLOCK_HEAD).to_vec());
}

#[test]
fn the_slot_decodes_to_its_records() {
    let slot = Slot::decode(block(SLOT_HEAD), 3).expect("the slot decodes");
    assert_eq!(slot.record_count(), 2);
    assert_eq!(slot.used_bytes(), 18);
    assert!(slot.overflowed());
    let records = slot.records();
    assert_eq!(
        records,
        [(&b"alpha"[..], &b"one"[..]), (&b"be"[..], &[7u8, 8][..])]
    );
}

#[test]
fn records_appended_to_a_slot_seal_to_the_golden_bytes() {
    let mut slot = Slot::empty();
    assert!(slot.append(b"alpha", b"one"));
    assert!(slot.append(b"be", &[7, 8]));
    slot.set_overflowed();
    assert_eq!(slot.seal().to_vec(), block(SLOT_HEAD).to_vec());
}

#[test]
fn an_all_zero_slot_is_empty_and_a_damaged_one_is_refused() {
    let empty = Slot::decode(Box::new([0u8; SLOT_BYTES]), 0).expect("zeros are an empty slot");
    assert_eq!(empty.record_count(), 0);
    for at in [0, 4, 8, 10, 16, 20] {
        let mut damaged = block(SLOT_HEAD);
        damaged[at] ^= 0x01;
        assert!(Slot::decode(damaged, 3).is_err(), "byte {at} flipped");
    }
}
