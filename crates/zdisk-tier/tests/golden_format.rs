//! Golden bytes of the object-store tier's formats (docs/format.md, "The
//! object-store tier"), written by hand: a root object, the names of
//! segment and root objects, and the state file `IMAGE.tier`. Each is
//! checked both ways (decoding gives the fields, encoding the fields gives
//! the bytes), so a change that moves a field or renames a key fails here
//! even if the encoder and decoder change together. The root object's CRC
//! was computed apart from this code (a bitwise CRC32C).

use zdisk_tier::objects::{
    parse_root_name, parse_segment_name, root_key, segment_key, short_writer, RootObject,
    SegmentEntry,
};
use zdisk_tier::{sidecar_path, Sidecar};

/// Root object 7 of writer 01..10, not clean, listing two incarnations,
/// carrying a 4-byte stand-in for the engine root (the tier does not look
/// inside it).
#[rustfmt::skip]
const ROOT_OBJECT: &[u8] = &[
    b'Z', b'D', b'T', b'R', b'O', b'O', b'T', b'1', // magic
    0x07, 0, 0, 0, 0, 0, 0, 0,                      // number 7
    0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, // writer_id
    0x09, 0x0a, 0x0b, 0x0c, 0x0d, 0x0e, 0x0f, 0x10,
    0x00,                                           // clean: no
    0x02, 0x00, 0x00, 0x00,                         // segment_count 2
    0x03, 0x00, 0x00, 0x00,                         //   segment 3
    0x29, 0x00, 0x00, 0x00,                         //   seq32 41
    0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, //   writer (its id's first 8 bytes, LE)
    0x00, 0x00, 0x04, 0, 0, 0, 0, 0,                //   len 256 KiB
    0x04, 0x00, 0x00, 0x00,                         //   segment 4
    0x2a, 0x00, 0x00, 0x00,                         //   seq32 42
    0xef, 0xcd, 0xab, 0x89, 0x67, 0x45, 0x23, 0x01, //   writer 0x0123456789abcdef
    0x00, 0x10, 0, 0, 0, 0, 0, 0,                   //   len 4096
    0x04, 0x00, 0x00, 0x00,                         // root_length 4
    b'Z', b'D', b'I', b'S',                         // engine_root
    CRC[0], CRC[1], CRC[2], CRC[3],                 // crc: CRC32C of every byte above
];
const CRC: [u8; 4] = 0xd920_ce9au32.to_le_bytes();

const WRITER_ID: [u8; 16] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16];

fn root_fields() -> RootObject {
    RootObject {
        number: 7,
        writer_id: WRITER_ID,
        clean: false,
        segments: vec![
            SegmentEntry {
                segment: 3,
                seq32: 41,
                writer: 0x0807_0605_0403_0201,
                len_bytes: 256 << 10,
            },
            SegmentEntry {
                segment: 4,
                seq32: 42,
                writer: 0x0123_4567_89ab_cdef,
                len_bytes: 4096,
            },
        ],
        engine_root: b"ZDIS".to_vec(),
    }
}

#[test]
fn the_root_object_decodes_to_its_fields() {
    assert_eq!(
        RootObject::decode(ROOT_OBJECT).expect("it decodes"),
        root_fields()
    );
}

#[test]
fn root_object_fields_encode_to_the_golden_bytes() {
    assert_eq!(root_fields().encode(), ROOT_OBJECT);
    assert_eq!(short_writer(&WRITER_ID), 0x0807_0605_0403_0201);
}

#[test]
fn object_names_are_the_documented_ones() {
    let writer = 0x0807_0605_0403_0201;
    assert_eq!(
        segment_key("vol/", (3, 41, writer)),
        "vol/seg/00000003-00000029-0807060504030201"
    );
    assert_eq!(
        parse_segment_name("seg/00000003-00000029-0807060504030201"),
        Some((3, 41, writer))
    );
    assert_eq!(root_key("vol/", 7), "vol/root/0000000000000007");
    assert_eq!(parse_root_name("root/0000000000000007"), Some(7));
    assert_eq!(parse_root_name("root/7"), None, "16 hex digits");
}

/// `IMAGE.tier` as this zdisk writes it: compact JSON, keys in this order.
const SIDECAR: &str = concat!(
    r#"{"version":1,"url":"s3://bucket/vol/","#,
    r#""writer_id":"0102030405060708090a0b0c0d0e0f10","#,
    r#""bucket_root":7,"cache_bytes":268435456,"#,
    r#""evicted":[[3,41,578437695752307201,262144]],"#,
    r#""written_back":[[4,42,81985529216486895]],"reader":false}"#
);

/// One written before `written_back` and `reader` existed.
const SIDECAR_OLD: &str = r#"{"version":1,"url":"s3://bucket/vol/","writer_id":"0102030405060708090a0b0c0d0e0f10","bucket_root":7,"cache_bytes":268435456,"evicted":[]}"#;

fn sidecar_fields() -> Sidecar {
    let mut sidecar = Sidecar::new("s3://bucket/vol/", WRITER_ID, 7, 256 << 20);
    sidecar.evicted = vec![(3, 41, 0x0807_0605_0403_0201, 256 << 10)];
    sidecar.written_back = vec![(4, 42, 0x0123_4567_89ab_cdef)];
    sidecar
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("zdisk-golden-tier-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn the_state_file_decodes_to_its_fields() {
    let dir = scratch("load");
    let path = sidecar_path(&dir.join("vol.zdisk"));
    assert!(path.ends_with("vol.zdisk.tier"));
    std::fs::write(&path, SIDECAR).unwrap();
    let sidecar = Sidecar::load(&path).expect("the golden state file loads");
    assert_eq!(sidecar, sidecar_fields());
    assert_eq!(sidecar.writer_id().unwrap(), WRITER_ID);
    std::fs::write(&path, SIDECAR_OLD).unwrap();
    let old = Sidecar::load(&path).expect("an older state file loads");
    assert!(old.written_back.is_empty() && !old.reader);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn state_fields_store_as_the_golden_text() {
    let dir = scratch("store");
    let path = dir.join("vol.zdisk.tier");
    sidecar_fields().store(&path).expect("it stores");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), SIDECAR);
    std::fs::remove_dir_all(&dir).unwrap();
}
