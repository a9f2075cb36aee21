//! The committed seed inputs of the NBD fuzz targets (fuzz/seeds/
//! nbd_handshake and fuzz/seeds/nbd_transmission, which `fuzz/run` hands
//! to each target beside the corpus, so that fuzzing starts from
//! complete sessions instead of from nothing): they are exactly what the
//! functions below make, each is small, and each runs through the same
//! entry point its target calls without a panic; the complete sessions,
//! sent to a real server, reach transmission and write. `ZDISK_WRITE_FUZZ_SEEDS=1`
//! writes them anew.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;

use common::{TestServer, IO_TIMEOUT};
use zdisk_core::BlockDevice;
use zdisk_nbd::ListenAddr;

/// An option request: IHAVEOPT, the option, its data.
fn option(code: u32, data: &[u8]) -> Vec<u8> {
    let mut out = b"IHAVEOPT".to_vec();
    out.extend_from_slice(&code.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out
}

/// A length-prefixed (u32) string.
fn string(text: &str) -> Vec<u8> {
    let mut out = (text.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out
}

fn meta_context(code: u32, queries: &[&str]) -> Vec<u8> {
    let mut data = string("zdisk");
    data.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for query in queries {
        data.extend_from_slice(&string(query));
    }
    option(code, &data)
}

fn go(code: u32, infos: &[u16]) -> Vec<u8> {
    let mut data = string("zdisk");
    data.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for info in infos {
        data.extend_from_slice(&info.to_be_bytes());
    }
    option(code, &data)
}

/// A transmission request, with `payload` after it for a write.
fn request(flags: u16, command: u16, cookie: u64, offset: u64, length: u32) -> Vec<u8> {
    let mut out = 0x2560_9513u32.to_be_bytes().to_vec();
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&command.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out.extend_from_slice(&offset.to_be_bytes());
    out.extend_from_slice(&length.to_be_bytes());
    if command == 1 {
        out.extend((0..length).map(|i| (i % 251) as u8));
    }
    out
}

/// Every kind of request once: write, FUA write, read, block status, trim,
/// write zeroes (punching and not), cache, flush, an out-of-range read,
/// then disconnect.
fn requests() -> Vec<u8> {
    [
        request(0, 1, 1, 0, 1024),
        request(1, 1, 2, 8192, 512),
        request(0, 0, 3, 0, 4096),
        request(0, 7, 4, 0, 65536),
        request(8, 7, 5, 4096, 4096),
        request(0, 4, 6, 0, 4096),
        request(0, 6, 7, 16384, 8192),
        request(2, 6, 8, 32768, 4096),
        request(0, 5, 9, 0, 4096),
        request(0, 3, 10, 0, 0),
        request(0, 0, 11, 1 << 30, 512),
        request(0, 2, 12, 0, 0),
    ]
    .concat()
}

const CLIENT_FLAGS: [u8; 4] = [0, 0, 0, 3];

fn handshake_seeds() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        (
            "structured-go",
            [
                CLIENT_FLAGS.to_vec(),
                option(8, &[]),
                meta_context(10, &["base:allocation", "zdisk:compression"]),
                go(7, &[3, 1, 2]),
                requests(),
            ]
            .concat(),
        ),
        (
            "list-info-abort",
            [
                CLIENT_FLAGS.to_vec(),
                option(3, &[]),
                go(6, &[0, 1, 2, 3]),
                option(8, &[]),
                meta_context(9, &["base:", "zdisk:"]),
                option(2, &[]),
            ]
            .concat(),
        ),
        (
            "export-name",
            [CLIENT_FLAGS.to_vec(), option(1, b"zdisk"), requests()].concat(),
        ),
        (
            "starttls-go",
            [
                CLIENT_FLAGS.to_vec(),
                option(5, &[]),
                option(8, &[]),
                go(7, &[]),
                requests(),
            ]
            .concat(),
        ),
    ]
}

/// The first byte is the setup (see `zdisk_nbd::fuzz_transmission`): bit
/// 0 structured replies, 1 base:allocation, 2 512-byte blocks agreed, 3
/// read-only, 4 I/O errors, 5 out of space, 6 shut down, 7
/// zdisk:compression.
fn transmission_seeds() -> Vec<(&'static str, Vec<u8>)> {
    [
        ("simple", 0x00u8),
        ("structured-contexts", 0x87),
        ("read-only", 0x0b),
        ("io-errors", 0x13),
        ("no-space", 0x21),
    ]
    .into_iter()
    .map(|(name, setup)| (name, [vec![setup], requests()].concat()))
    .collect()
}

#[test]
fn committed_fuzz_seeds_are_current_and_run_clean() {
    for (target, seeds) in [
        ("nbd_handshake", handshake_seeds()),
        ("nbd_transmission", transmission_seeds()),
    ] {
        zdisk_core::fuzz::check_committed_seeds(
            target,
            &seeds,
            "cargo test -p zdisk-nbd --release --test fuzz_seeds",
        );
        for (_, bytes) in &seeds {
            match target {
                "nbd_handshake" => zdisk_nbd::fuzz_handshake(bytes),
                _ => zdisk_nbd::fuzz_transmission(bytes),
            }
        }
    }
}

/// The handshake seeds that open a session are valid sessions: sent as
/// they are to a real server, their FUA write lands on the device.
#[test]
fn session_seeds_reach_transmission_on_a_real_server() {
    for (name, bytes) in handshake_seeds() {
        if !matches!(name, "structured-go" | "export-name" | "starttls-go") {
            continue;
        }
        let server = TestServer::start(1 << 20);
        let ListenAddr::Tcp(addr) = &server.addr else {
            panic!("the test server listens on TCP");
        };
        let mut stream = TcpStream::connect(addr).unwrap();
        stream.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        stream.write_all(&bytes).unwrap();
        let mut replies = Vec::new();
        stream
            .read_to_end(&mut replies)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut written = vec![0u8; 512];
        server.device.read(8192, &mut written).unwrap();
        let expected: Vec<u8> = (0..512u32).map(|i| (i % 251) as u8).collect();
        assert!(
            written == expected,
            "{name}: the session's write did not land"
        );
        server.stop().unwrap();
    }
}
