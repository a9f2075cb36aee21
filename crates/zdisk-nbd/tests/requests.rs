//! Transmission-phase requests over a real socket: every command with
//! simple and structured replies, block status, and every error case the
//! server promises (validation errors and device errors mapped to NBD
//! errno values). Each error is followed by a successful request on the
//! same connection, because the promise is that errors never cost the
//! client its connection — except a bad request magic, which must.

mod common;

use common::{Client, Setup, TestServer};
use zdisk_core::BlockDevice;
use zdisk_nbd::testing::Call;
use zdisk_nbd::wire::*;
use zdisk_nbd::ServerConfig;

const SIZE: u64 = 8 << 20;

fn pattern(length: usize, seed: u8) -> Vec<u8> {
    (0..length)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

fn both_reply_kinds() -> [Setup; 2] {
    [Setup::SIMPLE, Setup::STRUCTURED]
}

#[test]
fn write_then_read_back_with_both_reply_kinds() {
    for setup in both_reply_kinds() {
        let server = TestServer::start(SIZE);
        let (mut c, _) = Client::connect_with(&server.addr, setup);
        let data = pattern(128 * 1024, 5);
        assert_eq!(c.write(65536, &data).error, 0);
        let r = c.read(65536, data.len() as u32);
        assert_eq!(r.error, 0);
        assert_eq!(r.simple, !setup.structured);
        assert_eq!(r.data, data);
        if setup.structured {
            // One OFFSET_DATA chunk carrying DONE.
            assert_eq!(r.chunks.len(), 1);
            assert_eq!(r.chunks[0].chunk_type, NBD_REPLY_TYPE_OFFSET_DATA);
            assert_eq!(r.chunks[0].flags, NBD_REPLY_FLAG_DONE);
        }
        assert_eq!(server.device.snapshot(65536, data.len() as u64), data);
    }
}

#[test]
fn max_payload_read_and_write() {
    let server = TestServer::start(64 << 20);
    let (mut c, _) = Client::connect_with(&server.addr, Setup::STRUCTURED);
    let data = pattern(MAX_PAYLOAD_BYTES as usize, 9);
    assert_eq!(c.write(0, &data).error, 0);
    let r = c.read(0, MAX_PAYLOAD_BYTES);
    assert_eq!(r.error, 0);
    assert!(r.data == data, "32 MiB read matches");
}

#[test]
fn zero_length_requests_succeed_without_touching_the_device() {
    for setup in both_reply_kinds() {
        let server = TestServer::start(SIZE);
        let (mut c, _) = Client::connect_with(&server.addr, setup);
        let before = server.device.calls().len();
        assert_eq!(c.read(4096, 0).error, 0);
        assert_eq!(c.write(4096, &[]).error, 0);
        assert_eq!(c.request(0, NBD_CMD_TRIM, 4096, 0, &[]).error, 0);
        assert_eq!(c.request(0, NBD_CMD_WRITE_ZEROES, 4096, 0, &[]).error, 0);
        assert_eq!(c.request(0, NBD_CMD_CACHE, SIZE, 0, &[]).error, 0);
        assert_eq!(server.device.calls().len(), before);
        c.assert_works();
    }
}

#[test]
fn fua_flush_trim_zero_and_cache_reach_the_device() {
    let server = TestServer::start(SIZE);
    let device = &server.device;
    let (mut c, _) = Client::connect_with(&server.addr, Setup::STRUCTURED);

    let w = c.request(NBD_CMD_FLAG_FUA, NBD_CMD_WRITE, 0, 4096, &[1; 4096]);
    assert_eq!(w.error, 0);
    assert_eq!(
        device.last_call(),
        Some(Call::Write {
            offset: 0,
            length: 4096,
            fua: true
        })
    );

    assert_eq!(c.request(0, NBD_CMD_FLUSH, 0, 0, &[]).error, 0);
    assert_eq!(device.flush_count(), 1);

    assert_eq!(
        c.request(NBD_CMD_FLAG_FUA, NBD_CMD_TRIM, 8192, 8192, &[])
            .error,
        0
    );
    assert_eq!(
        device.last_call(),
        Some(Call::Trim {
            offset: 8192,
            length: 8192,
            fua: true
        })
    );

    let flags = NBD_CMD_FLAG_NO_HOLE | NBD_CMD_FLAG_FAST_ZERO;
    assert_eq!(
        c.request(flags, NBD_CMD_WRITE_ZEROES, 16384, 4096, &[])
            .error,
        0
    );
    assert_eq!(
        device.last_call(),
        Some(Call::WriteZeroes {
            offset: 16384,
            length: 4096,
            may_punch: false,
            fua: false
        })
    );
    assert_eq!(
        c.request(0, NBD_CMD_WRITE_ZEROES, 20480, 4096, &[]).error,
        0
    );
    assert_eq!(
        device.last_call(),
        Some(Call::WriteZeroes {
            offset: 20480,
            length: 4096,
            may_punch: true,
            fua: false
        })
    );

    assert_eq!(
        c.request(NBD_CMD_FLAG_FUA, NBD_CMD_CACHE, 0, 65536, &[])
            .error,
        0
    );
    assert_eq!(
        device.last_call(),
        Some(Call::Cache {
            offset: 0,
            length: 65536
        })
    );
}

#[test]
fn block_status_reports_holes_zeroes_and_data() {
    let server = TestServer::start(SIZE);
    let (mut c, _) = Client::connect_with(&server.addr, Setup::STRUCTURED);
    // Layout: [data 8K][zero 4K (NO_HOLE)][hole 4K (punched)][hole ...]
    assert_eq!(c.write(0, &[7; 8192]).error, 0);
    assert_eq!(
        c.request(NBD_CMD_FLAG_NO_HOLE, NBD_CMD_WRITE_ZEROES, 8192, 4096, &[])
            .error,
        0
    );
    assert_eq!(c.write(12288, &[7; 4096]).error, 0);
    assert_eq!(c.request(0, NBD_CMD_TRIM, 12288, 4096, &[]).error, 0);

    let r = c.request(0, NBD_CMD_BLOCK_STATUS, 0, 65536, &[]);
    assert_eq!(r.error, 0);
    let (context, extents) = r.extents();
    assert_eq!(context, BASE_ALLOCATION_ID);
    let hole_zero = NBD_STATE_HOLE | NBD_STATE_ZERO;
    // Adjacent runs with equal flags arrive merged, and the total is the request.
    assert_eq!(
        extents,
        vec![
            (8192, 0),
            (4096, NBD_STATE_ZERO),
            (65536 - 12288, hole_zero)
        ]
    );

    // REQ_ONE: exactly one extent, never longer than the request.
    let r = c.request(NBD_CMD_FLAG_REQ_ONE, NBD_CMD_BLOCK_STATUS, 0, 4096, &[]);
    assert_eq!(r.extents().1, vec![(4096, 0)]);
    let r = c.request(
        NBD_CMD_FLAG_REQ_ONE,
        NBD_CMD_BLOCK_STATUS,
        12288,
        1 << 20,
        &[],
    );
    assert_eq!(r.extents().1, vec![(1 << 20, hole_zero)]);
}

#[test]
fn block_status_answers_each_selected_context() {
    let server = TestServer::start(SIZE);
    let mut c = Client::connect(&server.addr);
    c.start_handshake();
    c.structured_reply();
    let selected = c
        .set_meta_context("", &[BASE_ALLOCATION, ZDISK_COMPRESSION])
        .unwrap();
    assert_eq!(selected.len(), 2);
    Client::parse_info(&c.option(NBD_OPT_GO, &Client::go_data("", &[])));
    assert_eq!(c.write(0, &[7; 8192]).error, 0);
    assert_eq!(
        c.request(NBD_CMD_FLAG_NO_HOLE, NBD_CMD_WRITE_ZEROES, 8192, 4096, &[])
            .error,
        0
    );
    // The RAM device does not compress: its data is stored raw, whole.
    let raw = ZDISK_KIND_RAW | 15 << ZDISK_SIZE_SHIFT;
    let r = c.request(0, NBD_CMD_BLOCK_STATUS, 0, 65536, &[]);
    assert_eq!(r.error, 0);
    assert_eq!(
        r.extents_by_context(),
        vec![
            (
                BASE_ALLOCATION_ID,
                false,
                vec![
                    (8192, 0),
                    (4096, NBD_STATE_ZERO),
                    (65536 - 12288, NBD_STATE_HOLE | NBD_STATE_ZERO)
                ]
            ),
            (
                ZDISK_COMPRESSION_ID,
                true,
                vec![
                    (8192, raw),
                    (4096, ZDISK_KIND_ZERO),
                    (65536 - 12288, ZDISK_KIND_HOLE)
                ]
            ),
        ]
    );
    // REQ_ONE: one descriptor per context, within the request.
    let r = c.request(NBD_CMD_FLAG_REQ_ONE, NBD_CMD_BLOCK_STATUS, 4096, 65536, &[]);
    assert_eq!(
        r.extents_by_context(),
        vec![
            (BASE_ALLOCATION_ID, false, vec![(4096, 0)]),
            (ZDISK_COMPRESSION_ID, true, vec![(4096, raw)]),
        ]
    );
    // Only zdisk:compression.
    let mut c = Client::connect(&server.addr);
    c.start_handshake();
    c.structured_reply();
    c.set_meta_context("", &[ZDISK_COMPRESSION]).unwrap();
    Client::parse_info(&c.option(NBD_OPT_GO, &Client::go_data("", &[])));
    let r = c.request(0, NBD_CMD_BLOCK_STATUS, 8192, 8192, &[]);
    assert_eq!(
        r.extents_by_context(),
        vec![(
            ZDISK_COMPRESSION_ID,
            true,
            vec![(4096, ZDISK_KIND_ZERO), (4096, ZDISK_KIND_HOLE)]
        )]
    );
    c.assert_works();
}

#[test]
fn block_status_descriptor_count_is_capped() {
    let server = TestServer::start(64 << 20);
    let (mut c, _) = Client::connect_with(&server.addr, Setup::STRUCTURED);
    // Alternate data and hole blocks: 8192 runs in 32 MiB.
    for block in (0..(32 << 20) / 4096u64).step_by(2) {
        server
            .device
            .write(block * 4096, &[1; 4096], false)
            .unwrap();
    }
    let r = c.request(0, NBD_CMD_BLOCK_STATUS, 0, 32 << 20, &[]);
    assert_eq!(r.error, 0);
    let (_, extents) = r.extents();
    assert_eq!(extents.len(), MAX_BLOCK_STATUS_EXTENTS);
    assert!(extents.iter().all(|&(length, _)| length == 4096));
    c.assert_works();
}

// -- validation errors --------------------------------------------------------

#[test]
fn unknown_command_is_einval() {
    for setup in both_reply_kinds() {
        let server = TestServer::start(SIZE);
        let (mut c, _) = Client::connect_with(&server.addr, setup);
        for command in [NBD_CMD_RESIZE, 9, 0xffff] {
            let r = c.request(0, command, 0, 512, &[]);
            assert_eq!(r.error, NBD_EINVAL);
            c.assert_works();
        }
    }
}

#[test]
fn invalid_flags_are_einval() {
    for setup in both_reply_kinds() {
        let server = TestServer::start(SIZE);
        let (mut c, _) = Client::connect_with(&server.addr, setup);
        let cases = [
            (NBD_CMD_FLAG_NO_HOLE, NBD_CMD_READ, 512),
            (NBD_CMD_FLAG_REQ_ONE, NBD_CMD_TRIM, 512),
            (NBD_CMD_FLAG_FAST_ZERO, NBD_CMD_CACHE, 512),
            (NBD_CMD_FLAG_DF, NBD_CMD_FLUSH, 0),
            (1 << 9, NBD_CMD_WRITE_ZEROES, 512),
            (NBD_CMD_FLAG_PAYLOAD_LEN, NBD_CMD_READ, 512),
        ];
        for (flags, command, length) in cases {
            let r = c.request(flags, command, 0, length, &[]);
            assert_eq!(r.error, NBD_EINVAL, "flags {flags:#x} on command {command}");
            c.assert_works();
        }
        // A rejected write still has its payload consumed.
        let r = c.request(NBD_CMD_FLAG_NO_HOLE, NBD_CMD_WRITE, 0, 512, &[9; 512]);
        assert_eq!(r.error, NBD_EINVAL);
        c.assert_works();
        // DF is only valid once structured replies are on.
        let r = c.request(NBD_CMD_FLAG_DF, NBD_CMD_READ, 0, 512, &[]);
        assert_eq!(r.error, if setup.structured { 0 } else { NBD_EINVAL });
        c.assert_works();
    }
}

#[test]
fn out_of_range_requests() {
    for setup in both_reply_kinds() {
        let server = TestServer::start(SIZE);
        let (mut c, _) = Client::connect_with(&server.addr, setup);
        let cases = [
            (NBD_CMD_READ, SIZE - 512, 1024, NBD_EINVAL),
            (NBD_CMD_READ, SIZE, 512, NBD_EINVAL),
            (NBD_CMD_TRIM, SIZE - 512, 1024, NBD_EINVAL),
            (NBD_CMD_CACHE, SIZE, 512, NBD_EINVAL),
            (NBD_CMD_WRITE_ZEROES, SIZE - 512, 1024, NBD_ENOSPC),
            (NBD_CMD_READ, u64::MAX - 511, 1024, NBD_EINVAL),
            (NBD_CMD_WRITE_ZEROES, u64::MAX - 511, 1024, NBD_EINVAL),
        ];
        for (command, offset, length, errno) in cases {
            let r = c.request(0, command, offset, length, &[]);
            assert_eq!(r.error, errno, "command {command} at {offset}+{length}");
            c.assert_works();
        }
        let r = c.request(0, NBD_CMD_WRITE, SIZE - 512, 1024, &[1; 1024]);
        assert_eq!(r.error, NBD_ENOSPC);
        c.assert_works();
        let r = c.request(0, NBD_CMD_WRITE, u64::MAX - 511, 1024, &[1; 1024]);
        assert_eq!(r.error, NBD_EINVAL, "offset + length overflows");
        c.assert_works();
    }
}

#[test]
fn block_status_errors() {
    let server = TestServer::start(SIZE);
    let (mut c, _) = Client::connect_with(&server.addr, Setup::STRUCTURED);
    assert_eq!(
        c.request(0, NBD_CMD_BLOCK_STATUS, 0, 0, &[]).error,
        NBD_EINVAL
    );
    c.assert_works();
    assert_eq!(
        c.request(0, NBD_CMD_BLOCK_STATUS, SIZE - 512, 1024, &[])
            .error,
        NBD_EINVAL
    );
    c.assert_works();

    // Structured replies but no context selected.
    let (mut c, _) = Client::connect_with(
        &server.addr,
        Setup {
            base_allocation: false,
            ..Setup::STRUCTURED
        },
    );
    assert_eq!(
        c.request(0, NBD_CMD_BLOCK_STATUS, 0, 4096, &[]).error,
        NBD_EINVAL
    );
    c.assert_works();

    // Simple replies only: block status cannot even be answered.
    let (mut c, _) = Client::connect_with(&server.addr, Setup::SIMPLE);
    let r = c.request(0, NBD_CMD_BLOCK_STATUS, 0, 4096, &[]);
    assert!(r.simple);
    assert_eq!(r.error, NBD_EINVAL);
    c.assert_works();
}

#[test]
fn oversized_read_is_einval() {
    for setup in both_reply_kinds() {
        let server = TestServer::start(64 << 20);
        let (mut c, _) = Client::connect_with(&server.addr, setup);
        let r = c.read(0, MAX_PAYLOAD_BYTES + 512);
        assert_eq!(r.error, NBD_EINVAL);
        assert!(r.data.is_empty() || r.data.iter().all(|&b| b == 0));
        c.assert_works();
    }
}

#[test]
fn oversized_write_payload_is_discarded_and_the_stream_stays_in_sync() {
    let server = TestServer::start(64 << 20);
    let (mut c, _) = Client::connect_with(&server.addr, Setup::STRUCTURED);
    let length = MAX_PAYLOAD_BYTES + 512;
    // The payload looks like requests: if the server parsed any of it as
    // such, the replies that follow would not match.
    let mut payload = Vec::with_capacity(length as usize);
    while payload.len() < length as usize {
        payload.extend_from_slice(&Client::request_bytes(0, NBD_CMD_FLUSH, 77, 0, 0));
    }
    payload.truncate(length as usize);
    let r = c.request(0, NBD_CMD_WRITE, 0, length, &payload);
    assert_eq!(r.error, NBD_EINVAL);
    assert_eq!(server.device.flush_count(), 0);
    c.assert_works();
}

#[test]
fn huge_write_length_is_discarded_in_chunks() {
    // A write claiming ~4 GiB past the end of a small export: the server must
    // read and drop the payload rather than allocate it.
    let server = TestServer::start(SIZE);
    let (mut c, _) = Client::connect_with(&server.addr, Setup::SIMPLE);
    let length: u32 = 0xffff_fe00;
    let cookie = c.send_request(0, NBD_CMD_WRITE, 0, length, &[]);
    let chunk = vec![0u8; 1 << 20];
    let mut left = u64::from(length);
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        c.send(&chunk[..n]);
        left -= n as u64;
    }
    let r = c.reply();
    assert_eq!(r.cookie, cookie);
    assert_eq!(r.error, NBD_EINVAL);
    c.assert_works();
}

#[test]
fn flush_with_offset_or_length_is_einval() {
    let server = TestServer::start(SIZE);
    let (mut c, _) = Client::connect_with(&server.addr, Setup::SIMPLE);
    assert_eq!(c.request(0, NBD_CMD_FLUSH, 512, 0, &[]).error, NBD_EINVAL);
    c.assert_works();
    assert_eq!(c.request(0, NBD_CMD_FLUSH, 0, 512, &[]).error, NBD_EINVAL);
    c.assert_works();
}

#[test]
fn misaligned_requests_after_a_block_size_agreement() {
    for setup in both_reply_kinds() {
        let server = TestServer::start(SIZE);
        let (mut c, _) = Client::connect_with(&server.addr, setup);
        for (command, offset, length) in [
            (NBD_CMD_READ, 1, 512),
            (NBD_CMD_READ, 0, 100),
            (NBD_CMD_TRIM, 256, 512),
            (NBD_CMD_WRITE_ZEROES, 512, 513),
            (NBD_CMD_CACHE, 3, 512),
        ] {
            let r = c.request(0, command, offset, length, &[]);
            assert_eq!(
                r.error, NBD_EINVAL,
                "command {command} at {offset}+{length}"
            );
            c.assert_works();
        }
        let r = c.request(0, NBD_CMD_WRITE, 7, 512, &[1; 512]);
        assert_eq!(r.error, NBD_EINVAL);
        c.assert_works();
    }
}

#[test]
fn read_only_export_refuses_writes_with_eperm() {
    let config = ServerConfig {
        read_only: true,
        ..ServerConfig::default()
    };
    let server = TestServer::start_with(SIZE, config);
    server.device.write(0, &[3; 4096], false).unwrap();
    let (mut c, _) = Client::connect_with(&server.addr, Setup::STRUCTURED);
    let before = server.device.snapshot(0, 4096);
    assert_eq!(
        c.request(0, NBD_CMD_WRITE, 0, 512, &[9; 512]).error,
        NBD_EPERM
    );
    assert_eq!(c.request(0, NBD_CMD_TRIM, 0, 4096, &[]).error, NBD_EPERM);
    assert_eq!(
        c.request(0, NBD_CMD_WRITE_ZEROES, 0, 4096, &[]).error,
        NBD_EPERM
    );
    assert_eq!(server.device.snapshot(0, 4096), before);
    // Reads, flushes and block status still work, and the write payload was
    // consumed (otherwise this read's reply would be garbage).
    let r = c.read(0, 4096);
    assert_eq!(r.error, 0);
    assert_eq!(r.data, before);
    assert_eq!(c.request(0, NBD_CMD_FLUSH, 0, 0, &[]).error, 0);
    assert_eq!(c.request(0, NBD_CMD_BLOCK_STATUS, 0, 4096, &[]).error, 0);
}

// -- device errors ------------------------------------------------------------

#[test]
fn device_read_error_is_eio_with_no_data_in_simple_replies() {
    let server = TestServer::start(SIZE);
    server.device.fail_io_at(65536 + 100);
    let (mut c, _) = Client::connect_with(&server.addr, Setup::SIMPLE);
    let r = c.read(65536, 4096);
    assert_eq!(r.error, NBD_EIO);
    assert!(r.data.is_empty(), "no payload after a simple error reply");
    c.assert_works();
}

#[test]
fn device_read_error_is_an_error_chunk_with_the_engine_message() {
    let server = TestServer::start(SIZE);
    server.device.fail_io_at(65536 + 100);
    let (mut c, _) = Client::connect_with(&server.addr, Setup::STRUCTURED);
    let r = c.read(65536, 4096);
    assert_eq!(r.error, NBD_EIO);
    assert_eq!(r.chunks.len(), 1);
    assert_eq!(r.chunks[0].chunk_type, NBD_REPLY_TYPE_ERROR);
    assert_eq!(r.chunks[0].flags, NBD_REPLY_FLAG_DONE);
    assert!(r.message.contains("injected I/O error"), "{}", r.message);
    c.assert_works();
}

#[test]
fn device_errors_map_to_errnos() {
    for setup in both_reply_kinds() {
        let server = TestServer::start(SIZE);
        let device = &server.device;
        let (mut c, _) = Client::connect_with(&server.addr, setup);

        device.set_no_space(true);
        assert_eq!(c.write(0, &[1; 512]).error, NBD_ENOSPC);
        assert_eq!(
            c.request(0, NBD_CMD_WRITE_ZEROES, 0, 512, &[]).error,
            NBD_ENOSPC
        );
        device.clear_faults();
        c.assert_works();

        device.fail_io_at(0);
        assert_eq!(c.write(0, &[1; 512]).error, NBD_EIO);
        assert_eq!(c.request(0, NBD_CMD_TRIM, 0, 4096, &[]).error, NBD_EIO);
        if setup.structured {
            assert_eq!(
                c.request(0, NBD_CMD_BLOCK_STATUS, 0, 4096, &[]).error,
                NBD_EIO
            );
        }
        device.clear_faults();
        c.assert_works();

        // The device turned read-only behind the server's back.
        device.set_read_only(true);
        assert_eq!(c.write(0, &[1; 512]).error, NBD_EPERM);
        device.clear_faults();
        c.assert_works();

        device.set_shut_down(true);
        assert_eq!(c.request(0, NBD_CMD_FLUSH, 0, 0, &[]).error, NBD_ESHUTDOWN);
        assert_eq!(c.read(0, 512).error, NBD_ESHUTDOWN);
        device.clear_faults();
        c.assert_works();
    }
}

#[test]
fn device_panic_becomes_eio_and_the_server_survives() {
    let server = TestServer::start(SIZE);
    server.device.panic_at(1 << 20);
    let (mut c, _) = Client::connect_with(&server.addr, Setup::STRUCTURED);
    assert_eq!(c.read(1 << 20, 512).error, NBD_EIO);
    server.device.clear_faults();
    c.assert_works();
}

// -- ending the stream --------------------------------------------------------

#[test]
fn bad_request_magic_hangs_up() {
    let server = TestServer::start(SIZE);
    let (mut c, _) = Client::connect_with(&server.addr, Setup::STRUCTURED);
    let mut request = Client::request_bytes(0, NBD_CMD_READ, 1, 0, 512);
    request[0] ^= 0xff;
    c.send(&request);
    assert!(c.is_closed());
    // The server itself is fine.
    let (mut c, _) = Client::connect_with(&server.addr, Setup::STRUCTURED);
    c.assert_works();
}

#[test]
fn disconnect_closes_without_a_reply() {
    let server = TestServer::start(SIZE);
    let (mut c, _) = Client::connect_with(&server.addr, Setup::SIMPLE);
    c.assert_works();
    c.disconnect();
    assert!(c.is_closed());
}
