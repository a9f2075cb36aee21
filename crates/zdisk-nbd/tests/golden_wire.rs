//! Golden bytes of the NBD protocol as this server speaks it, written by
//! hand from the NBD specification (doc/proto.md of the NBD project) and
//! docs/semantics.md: a scripted raw client sends exact bytes on a socket
//! and expects exact bytes back, for the fixed-newstyle greeting, option
//! requests and replies (STRUCTURED_REPLY, SET_META_CONTEXT with
//! `base:allocation` and `zdisk:compression`, GO with its INFO replies),
//! transmission request headers, simple replies and structured reply
//! chunks (OFFSET_DATA, BLOCK_STATUS per context, ERROR), and the
//! `zdisk:compression` status bits. Nothing here uses the server's
//! encoders or constants, so a change to the wire format fails here even
//! if every encoder and decoder in the crate changes with it. Where the
//! specification leaves the server a choice (an unrequested
//! NBD_INFO_BLOCK_SIZE, a simple reply to a successful write) the bytes pin
//! what zdisk chose; a change there is a deliberate protocol change.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;

use common::{TestServer, IO_TIMEOUT};
use zdisk_core::codec::CodecId;
use zdisk_core::Stored;
use zdisk_nbd::ListenAddr;

/// The export: 1 MiB of RAM, all holes.
const DEVICE_BYTES: u64 = 1 << 20;

/// The server's greeting.
#[rustfmt::skip]
const GREETING: &[u8] = &[
    b'N', b'B', b'D', b'M', b'A', b'G', b'I', b'C', // NBDMAGIC
    b'I', b'H', b'A', b'V', b'E', b'O', b'P', b'T', // IHAVEOPT: fixed newstyle
    0x00, 0x03,                                     // handshake flags: FIXED_NEWSTYLE | NO_ZEROES
];

/// The client's flags: FIXED_NEWSTYLE | NO_ZEROES.
const CLIENT_FLAGS: &[u8] = &[0x00, 0x00, 0x00, 0x03];

#[rustfmt::skip]
const OPT_STRUCTURED_REPLY: &[u8] = &[
    b'I', b'H', b'A', b'V', b'E', b'O', b'P', b'T', // option magic
    0x00, 0x00, 0x00, 0x08,                         // NBD_OPT_STRUCTURED_REPLY
    0x00, 0x00, 0x00, 0x00,                         // data length 0
];

#[rustfmt::skip]
const ACK_STRUCTURED_REPLY: &[u8] = &[
    0x00, 0x03, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9, // option reply magic
    0x00, 0x00, 0x00, 0x08,                         // option NBD_OPT_STRUCTURED_REPLY
    0x00, 0x00, 0x00, 0x01,                         // NBD_REP_ACK
    0x00, 0x00, 0x00, 0x00,                         // data length 0
];

#[rustfmt::skip]
const OPT_SET_META_CONTEXT: &[u8] = &[
    b'I', b'H', b'A', b'V', b'E', b'O', b'P', b'T', // option magic
    0x00, 0x00, 0x00, 0x0a,                         // NBD_OPT_SET_META_CONTEXT
    0x00, 0x00, 0x00, 0x35,                         // data length 53
    0x00, 0x00, 0x00, 0x05,                         // export name length 5
    b'z', b'd', b'i', b's', b'k',                   // export name
    0x00, 0x00, 0x00, 0x02,                         // 2 queries
    0x00, 0x00, 0x00, 0x0f,                         // query length 15
    b'b', b'a', b's', b'e', b':', b'a', b'l', b'l', b'o', b'c', b'a', b't', b'i', b'o', b'n',
    0x00, 0x00, 0x00, 0x11,                         // query length 17
    b'z', b'd', b'i', b's', b'k', b':', b'c', b'o', b'm', b'p', b'r', b'e', b's', b's', b'i', b'o', b'n',
];

#[rustfmt::skip]
const REPLIES_SET_META_CONTEXT: &[u8] = &[
    0x00, 0x03, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9, // option reply magic
    0x00, 0x00, 0x00, 0x0a,                         // option NBD_OPT_SET_META_CONTEXT
    0x00, 0x00, 0x00, 0x04,                         // NBD_REP_META_CONTEXT
    0x00, 0x00, 0x00, 0x13,                         // data length 19
    0x00, 0x00, 0x00, 0x01,                         // context id 1
    b'b', b'a', b's', b'e', b':', b'a', b'l', b'l', b'o', b'c', b'a', b't', b'i', b'o', b'n',
    0x00, 0x03, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9, // option reply magic
    0x00, 0x00, 0x00, 0x0a,                         // option NBD_OPT_SET_META_CONTEXT
    0x00, 0x00, 0x00, 0x04,                         // NBD_REP_META_CONTEXT
    0x00, 0x00, 0x00, 0x15,                         // data length 21
    0x00, 0x00, 0x00, 0x02,                         // context id 2
    b'z', b'd', b'i', b's', b'k', b':', b'c', b'o', b'm', b'p', b'r', b'e', b's', b's', b'i', b'o', b'n',
    0x00, 0x03, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9, // option reply magic
    0x00, 0x00, 0x00, 0x0a,                         // option NBD_OPT_SET_META_CONTEXT
    0x00, 0x00, 0x00, 0x01,                         // NBD_REP_ACK
    0x00, 0x00, 0x00, 0x00,                         // data length 0
];

#[rustfmt::skip]
const OPT_GO: &[u8] = &[
    b'I', b'H', b'A', b'V', b'E', b'O', b'P', b'T', // option magic
    0x00, 0x00, 0x00, 0x07,                         // NBD_OPT_GO
    0x00, 0x00, 0x00, 0x0d,                         // data length 13
    0x00, 0x00, 0x00, 0x05,                         // export name length 5
    b'z', b'd', b'i', b's', b'k',                   // export name
    0x00, 0x01,                                     // 1 information request
    0x00, 0x03,                                     // NBD_INFO_BLOCK_SIZE
];

#[rustfmt::skip]
const REPLIES_GO: &[u8] = &[
    0x00, 0x03, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9, // option reply magic
    0x00, 0x00, 0x00, 0x07,                         // option NBD_OPT_GO
    0x00, 0x00, 0x00, 0x03,                         // NBD_REP_INFO
    0x00, 0x00, 0x00, 0x0c,                         // data length 12
    0x00, 0x00,                                     // NBD_INFO_EXPORT
    0x00, 0x00, 0x00, 0x00, 0x00, 0x10, 0x00, 0x00, // export size 1 MiB
    // transmission flags 0x0ded: HAS_FLAGS 0x1, SEND_FLUSH 0x4, SEND_FUA
    // 0x8, SEND_TRIM 0x20, SEND_WRITE_ZEROES 0x40, SEND_DF 0x80,
    // CAN_MULTI_CONN 0x100, SEND_CACHE 0x400, SEND_FAST_ZERO 0x800
    0x0d, 0xed,
    0x00, 0x03, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9, // option reply magic
    0x00, 0x00, 0x00, 0x07,                         // option NBD_OPT_GO
    0x00, 0x00, 0x00, 0x03,                         // NBD_REP_INFO
    0x00, 0x00, 0x00, 0x0e,                         // data length 14
    0x00, 0x03,                                     // NBD_INFO_BLOCK_SIZE
    0x00, 0x00, 0x02, 0x00,                         // minimum 512
    0x00, 0x00, 0x10, 0x00,                         // preferred 4096
    0x04, 0x00, 0x00, 0x00,                         // maximum payload 64 MiB
    0x00, 0x03, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9, // option reply magic
    0x00, 0x00, 0x00, 0x07,                         // option NBD_OPT_GO
    0x00, 0x00, 0x00, 0x01,                         // NBD_REP_ACK
    0x00, 0x00, 0x00, 0x00,                         // data length 0
];

/// NBD_CMD_WRITE of 4096 bytes at 8192 (the data follows the header).
#[rustfmt::skip]
const WRITE_HEADER: &[u8] = &[
    0x25, 0x60, 0x95, 0x13,                         // request magic
    0x00, 0x00,                                     // command flags: none
    0x00, 0x01,                                     // NBD_CMD_WRITE
    0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, // cookie
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x20, 0x00, // offset 8192
    0x00, 0x00, 0x10, 0x00,                         // length 4096
];

#[rustfmt::skip]
const WRITE_REPLY: &[u8] = &[
    0x67, 0x44, 0x66, 0x98,                         // simple reply magic
    0x00, 0x00, 0x00, 0x00,                         // error 0
    0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, // cookie
];

/// NBD_CMD_READ of 1024 bytes at 7680: 512 bytes of hole, then 512 of the
/// write (the client agreed to 512-byte blocks by asking for their size).
#[rustfmt::skip]
const READ: &[u8] = &[
    0x25, 0x60, 0x95, 0x13,                         // request magic
    0x00, 0x00,                                     // command flags: none
    0x00, 0x00,                                     // NBD_CMD_READ
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, // cookie 2
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1e, 0x00, // offset 7680
    0x00, 0x00, 0x04, 0x00,                         // length 1024
];

/// The OFFSET_DATA chunk before its 1024 data bytes.
#[rustfmt::skip]
const READ_REPLY_HEAD: &[u8] = &[
    0x66, 0x8e, 0x33, 0xef,                         // structured reply magic
    0x00, 0x01,                                     // flags: NBD_REPLY_FLAG_DONE
    0x00, 0x01,                                     // NBD_REPLY_TYPE_OFFSET_DATA
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, // cookie 2
    0x00, 0x00, 0x04, 0x08,                         // chunk length 1032: offset and data
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1e, 0x00, // offset 7680
];

/// NBD_CMD_BLOCK_STATUS of the first 16 KiB.
#[rustfmt::skip]
const BLOCK_STATUS: &[u8] = &[
    0x25, 0x60, 0x95, 0x13,                         // request magic
    0x00, 0x00,                                     // command flags: none
    0x00, 0x07,                                     // NBD_CMD_BLOCK_STATUS
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03, // cookie 3
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // offset 0
    0x00, 0x00, 0x40, 0x00,                         // length 16384
];

/// One chunk per selected context, `base:allocation` first, the last done.
#[rustfmt::skip]
const BLOCK_STATUS_REPLY: &[u8] = &[
    0x66, 0x8e, 0x33, 0xef,                         // structured reply magic
    0x00, 0x00,                                     // flags: none (more follow)
    0x00, 0x05,                                     // NBD_REPLY_TYPE_BLOCK_STATUS
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03, // cookie 3
    0x00, 0x00, 0x00, 0x1c,                         // chunk length 28
    0x00, 0x00, 0x00, 0x01,                         // context id 1 (base:allocation)
    0x00, 0x00, 0x20, 0x00, 0x00, 0x00, 0x00, 0x03, // 8192 bytes: HOLE | ZERO
    0x00, 0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00, // 4096 bytes: data
    0x00, 0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x03, // 4096 bytes: HOLE | ZERO
    0x66, 0x8e, 0x33, 0xef,                         // structured reply magic
    0x00, 0x01,                                     // flags: NBD_REPLY_FLAG_DONE
    0x00, 0x05,                                     // NBD_REPLY_TYPE_BLOCK_STATUS
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03, // cookie 3
    0x00, 0x00, 0x00, 0x1c,                         // chunk length 28
    0x00, 0x00, 0x00, 0x02,                         // context id 2 (zdisk:compression)
    0x00, 0x00, 0x20, 0x00, 0x00, 0x00, 0x00, 0x00, // 8192 bytes: kind 0 hole
    0x00, 0x00, 0x10, 0x00, 0x00, 0x00, 0x0f, 0x02, // 4096 bytes: kind 2 raw, size class 15
    0x00, 0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00, // 4096 bytes: kind 0 hole
];

/// NBD_CMD_READ past the end of the export.
#[rustfmt::skip]
const READ_PAST_END: &[u8] = &[
    0x25, 0x60, 0x95, 0x13,                         // request magic
    0x00, 0x00,                                     // command flags: none
    0x00, 0x00,                                     // NBD_CMD_READ
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, // cookie 4
    0x00, 0x00, 0x00, 0x00, 0x00, 0x10, 0x00, 0x00, // offset 1 MiB (the end)
    0x00, 0x00, 0x02, 0x00,                         // length 512
];

/// The ERROR chunk's header, before its variable-length message.
#[rustfmt::skip]
const READ_PAST_END_REPLY_HEAD: &[u8] = &[
    0x66, 0x8e, 0x33, 0xef,                         // structured reply magic
    0x00, 0x01,                                     // flags: NBD_REPLY_FLAG_DONE
    0x80, 0x01,                                     // NBD_REPLY_TYPE_ERROR
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, // cookie 4
];

/// NBD_CMD_FLUSH, then NBD_CMD_TRIM of the written block with FUA.
#[rustfmt::skip]
const FLUSH_AND_TRIM: &[u8] = &[
    0x25, 0x60, 0x95, 0x13,                         // request magic
    0x00, 0x00,                                     // command flags: none
    0x00, 0x03,                                     // NBD_CMD_FLUSH
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x05, // cookie 5
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // offset 0
    0x00, 0x00, 0x00, 0x00,                         // length 0
    0x25, 0x60, 0x95, 0x13,                         // request magic
    0x00, 0x01,                                     // command flags: NBD_CMD_FLAG_FUA
    0x00, 0x04,                                     // NBD_CMD_TRIM
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x06, // cookie 6
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x20, 0x00, // offset 8192
    0x00, 0x00, 0x10, 0x00,                         // length 4096
];

#[rustfmt::skip]
const FLUSH_AND_TRIM_REPLIES: &[u8] = &[
    0x67, 0x44, 0x66, 0x98,                         // simple reply magic
    0x00, 0x00, 0x00, 0x00,                         // error 0
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x05, // cookie 5
    0x67, 0x44, 0x66, 0x98,                         // simple reply magic
    0x00, 0x00, 0x00, 0x00,                         // error 0
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x06, // cookie 6
];

#[rustfmt::skip]
const DISCONNECT: &[u8] = &[
    0x25, 0x60, 0x95, 0x13,                         // request magic
    0x00, 0x00,                                     // command flags: none
    0x00, 0x02,                                     // NBD_CMD_DISC
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x07, // cookie 7
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // offset 0
    0x00, 0x00, 0x00, 0x00,                         // length 0
];

fn hex(bytes: &[u8]) -> String {
    bytes
        .chunks(16)
        .map(|line| {
            line.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Reads exactly `expected.len()` bytes: the replies of requests in
/// flight together, each `reply_len` bytes. The specification lets a
/// server answer them in any order, so they must be `expected`'s replies
/// in some order.
fn expect_in_any_order(stream: &mut TcpStream, what: &str, expected: &[u8], reply_len: usize) {
    let mut got = vec![0u8; expected.len()];
    stream
        .read_exact(&mut got)
        .unwrap_or_else(|e| panic!("{what}: reading {} bytes: {e}", expected.len()));
    let mut got_replies: Vec<&[u8]> = got.chunks(reply_len).collect();
    let mut expected_replies: Vec<&[u8]> = expected.chunks(reply_len).collect();
    got_replies.sort();
    expected_replies.sort();
    assert!(
        got_replies == expected_replies,
        "{what}: the server sent\n{}\nexpected, in any order of its {reply_len}-byte replies,\n{}",
        hex(&got),
        hex(expected)
    );
}

/// Reads exactly `expected.len()` bytes; they must be `expected`.
fn expect(stream: &mut TcpStream, what: &str, expected: &[u8]) {
    let mut got = vec![0u8; expected.len()];
    stream
        .read_exact(&mut got)
        .unwrap_or_else(|e| panic!("{what}: reading {} bytes: {e}", expected.len()));
    assert!(
        got == expected,
        "{what}: the server sent\n{}\nexpected\n{}",
        hex(&got),
        hex(expected)
    );
}

fn connect(server: &TestServer) -> TcpStream {
    let ListenAddr::Tcp(addr) = &server.addr else {
        panic!("the test server listens on TCP");
    };
    let stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    stream.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
    stream
}

#[test]
fn a_scripted_session_gets_the_golden_bytes_back() {
    let server = TestServer::start(DEVICE_BYTES);
    let mut stream = connect(&server);

    expect(&mut stream, "greeting", GREETING);
    stream.write_all(CLIENT_FLAGS).unwrap();
    stream.write_all(OPT_STRUCTURED_REPLY).unwrap();
    expect(&mut stream, "STRUCTURED_REPLY", ACK_STRUCTURED_REPLY);
    stream.write_all(OPT_SET_META_CONTEXT).unwrap();
    expect(&mut stream, "SET_META_CONTEXT", REPLIES_SET_META_CONTEXT);
    stream.write_all(OPT_GO).unwrap();
    expect(&mut stream, "GO", REPLIES_GO);

    stream.write_all(WRITE_HEADER).unwrap();
    stream.write_all(&[0xab; 4096]).unwrap();
    expect(&mut stream, "WRITE", WRITE_REPLY);
    stream.write_all(READ).unwrap();
    expect(&mut stream, "READ", READ_REPLY_HEAD);
    let data = [[0x00; 512], [0xab; 512]].concat();
    expect(&mut stream, "READ data: a hole, then the write", &data);
    stream.write_all(BLOCK_STATUS).unwrap();
    expect(&mut stream, "BLOCK_STATUS", BLOCK_STATUS_REPLY);

    stream.write_all(READ_PAST_END).unwrap();
    expect(&mut stream, "READ past the end", READ_PAST_END_REPLY_HEAD);
    // Chunk length, then the error and a message of the rest's length.
    let mut fixed = [0u8; 10];
    stream.read_exact(&mut fixed).unwrap();
    let chunk_len = u32::from_be_bytes(fixed[0..4].try_into().unwrap()) as usize;
    let errno = u32::from_be_bytes(fixed[4..8].try_into().unwrap());
    let message_len = u16::from_be_bytes(fixed[8..10].try_into().unwrap()) as usize;
    assert_eq!(errno, 22, "EINVAL for a read past the end");
    assert_eq!(
        chunk_len,
        4 + 2 + message_len,
        "the chunk is the error and its message"
    );
    let mut message = vec![0u8; message_len];
    stream.read_exact(&mut message).unwrap();
    assert!(
        std::str::from_utf8(&message).is_ok_and(|text| !text.is_empty()),
        "the error message is UTF-8 text: {message:?}"
    );

    stream.write_all(FLUSH_AND_TRIM).unwrap();
    expect_in_any_order(&mut stream, "FLUSH and TRIM", FLUSH_AND_TRIM_REPLIES, 16);
    stream.write_all(DISCONNECT).unwrap();
    let mut rest = Vec::new();
    stream
        .read_to_end(&mut rest)
        .expect("the server closes the connection after NBD_CMD_DISC");
    assert!(rest.is_empty(), "no reply to NBD_CMD_DISC: {}", hex(&rest));
    server.stop().expect("the server stops cleanly");
}

/// docs/semantics.md's table: kind in bits 0-3, codec 4-7, stored-size
/// class 8-11, unit bit 12, shared bit 13; and its four examples.
#[test]
fn compression_status_bits_are_the_documented_ones() {
    use zdisk_nbd::wire::compression_status;
    let compressed = |codec, unit, size_sixteenths| Stored::Compressed {
        codec,
        unit,
        size_sixteenths,
        shared: false,
    };
    let cases: Vec<(Stored, u32, &str)> = vec![
        (Stored::Hole, 0x0000_0000, "kind 0 hole"),
        (Stored::Zero, 0x0000_0001, "kind 1 zero"),
        (Stored::Damaged, 0x0000_0004, "kind 4 damaged"),
        (
            Stored::Raw {
                size_sixteenths: 16,
                shared: false,
            },
            0x0000_0f02,
            "kind 2 raw, size class 15 (the doc's 0xf02)",
        ),
        (
            Stored::Compressed {
                codec: Some(CodecId::Lz4),
                unit: true,
                size_sixteenths: 3,
                shared: true,
            },
            0x0000_3213,
            "kind 3, codec 1 lz4, size class 2, unit, shared (the doc's 0x3213)",
        ),
        (
            compressed(Some(CodecId::Zstd), true, 2),
            0x0000_1123,
            "kind 3, codec 2 zstd, size class 1, unit (the doc's 0x1123)",
        ),
        (
            compressed(Some(CodecId::Lz4), false, 1),
            0x0000_0013,
            "kind 3, codec 1 lz4, size class 0 (the doc's 0x13)",
        ),
        (
            compressed(Some(CodecId::Deflate), false, 8),
            0x0000_0733,
            "kind 3, codec 3 deflate, size class 7 (at most half)",
        ),
        (
            compressed(None, true, 16),
            0x0000_1ff3,
            "kind 3, codec 15 (record unreadable), size class 15, unit",
        ),
    ];
    for (stored, bits, what) in cases {
        assert_eq!(
            compression_status(stored),
            bits,
            "{what}: {stored:?} gives {:#x}",
            compression_status(stored)
        );
    }
}
