//! What a hostile or broken client must not be able to do to the others:
//! a client that stops reading its replies stalls only itself and is
//! dropped after the reply timeout; connections over the limit are refused
//! with a reason; silent connections make room for prompt ones and never
//! count as sessions; a silent or trickling handshake is dropped at its
//! deadline; shutdown does not wait for clients that stopped reading; and
//! under `--tls require` nothing but STARTTLS is answered in plain text.
//!
//! Each test that claims "B is not blocked" first makes sure A really holds
//! what it would hold (requests queued, socket buffers full), and runs with
//! few worker threads, so that the old failure (workers stuck sending A's
//! replies) would show as B's requests hanging.

mod common;

use std::io::Read;
use std::net::TcpStream;
use std::thread;
use std::time::{Duration, Instant};

use common::{Client, Setup, TestServer};
use zdisk_nbd::wire::*;
use zdisk_nbd::{ListenAddr, ServerConfig, TlsConfig, TlsCredentials, TlsMode};

const SIZE: u64 = 128 << 20;
const BIG_READ: u32 = 32 << 20;

/// Starts a client that asks for four 32 MiB reads and never reads a reply.
fn stalled_client(server: &TestServer) -> Client {
    let (mut c, _) = Client::connect_with(&server.addr, Setup::SIMPLE);
    for i in 0..4u64 {
        c.send_request(0, NBD_CMD_READ, i * u64::from(BIG_READ), BIG_READ, &[]);
    }
    // Let the workers run them and the replies fill the socket buffers.
    thread::sleep(Duration::from_millis(500));
    c
}

/// An honest client does `rounds` small writes and reads; returns how long.
fn honest_rounds(server: &TestServer, rounds: u64) -> Duration {
    let started = Instant::now();
    let (mut c, _) = Client::connect_with(&server.addr, Setup::STRUCTURED);
    for round in 0..rounds {
        let data = vec![round as u8 | 1; 4096];
        assert_eq!(c.write(round * 4096, &data).error, 0);
        assert_eq!(c.read(round * 4096, 4096).data, data);
    }
    c.disconnect();
    started.elapsed()
}

/// How long a stalled client is given before the server drops it, in the
/// tests that tell "served beside the stall" from "served once the stall
/// is dropped".
const STALL_DROPPED_AFTER: Duration = Duration::from_secs(300);

/// A liveness bound, not a speed floor: far above what a loaded machine
/// takes, far below [`STALL_DROPPED_AFTER`].
const SERVED_BESIDE_THE_STALL: Duration = Duration::from_secs(120);

#[test]
fn a_client_that_stops_reading_stalls_only_itself() {
    let config = ServerConfig {
        worker_threads: 2,
        reply_timeout: STALL_DROPPED_AFTER,
        shutdown_timeout: STALL_DROPPED_AFTER,
        ..ServerConfig::default()
    };
    let server = TestServer::start_with(SIZE, config);
    let stalled = stalled_client(&server);
    // Before per-connection reply queues, both workers sat in A's sends and
    // B's first request never ran (the client's I/O timeout is 20 s). The
    // events told apart: B served while A still stalls (within B's own I/O
    // timeouts), or only once A is dropped, 300 s on.
    let took = honest_rounds(&server, 50);
    assert!(
        took < SERVED_BESIDE_THE_STALL,
        "honest client took {took:?}: served only after the stalled one went?"
    );
    // Shutdown gives up on A after SHUTDOWN_REPLY_PATIENCE, not at the
    // 300 s backstop.
    let started = Instant::now();
    server.stop().unwrap();
    assert!(
        started.elapsed() < SERVED_BESIDE_THE_STALL,
        "shutdown took {:?}: it waited for the backstop",
        started.elapsed()
    );
    drop(stalled);
}

#[test]
fn a_stalled_client_is_dropped_after_the_reply_timeout() {
    let config = ServerConfig {
        reply_timeout: Duration::from_millis(500),
        ..ServerConfig::default()
    };
    let server = TestServer::start_with(SIZE, config);
    let mut stalled = stalled_client(&server);
    thread::sleep(Duration::from_secs(2));
    // What was in flight when the server gave up arrives, then the end:
    // far less than the 128 MiB asked for.
    let received = stalled.drain_until_closed();
    assert!(
        received < 4 * BIG_READ as usize,
        "the stalled client got all {received} bytes"
    );
    // Its budget was given back: a new client gets big reads through.
    let (mut c, _) = Client::connect_with(&server.addr, Setup::SIMPLE);
    assert_eq!(c.read(0, BIG_READ).error, 0);
    server.stop().unwrap();
}

#[test]
fn stalled_big_clients_cannot_starve_small_ones() {
    // A stalled client with big requests fills what big holders may use of
    // the server-wide budget; the last quarter stays for small holders, so
    // an honest client is served long before the stalled one is dropped.
    let config = ServerConfig {
        max_in_flight_bytes: 64 << 20,
        reply_timeout: STALL_DROPPED_AFTER,
        shutdown_timeout: Duration::from_secs(5),
        ..ServerConfig::default()
    };
    let server = TestServer::start_with(SIZE, config);
    let stalled = stalled_client(&server);
    let took = honest_rounds(&server, 5);
    assert!(
        took < SERVED_BESIDE_THE_STALL,
        "honest client took {took:?}: served only after the stalled one went?"
    );
    server.stop().unwrap();
    drop(stalled);
}

#[test]
fn connections_over_the_limit_are_refused_with_a_reason() {
    let config = ServerConfig {
        max_connections: 2,
        ..ServerConfig::default()
    };
    let server = TestServer::start_with(SIZE, config);
    let (mut first, _) = Client::connect_with(&server.addr, Setup::SIMPLE);
    let (mut second, _) = Client::connect_with(&server.addr, Setup::SIMPLE);
    let mut third = server.connect();
    third.start_handshake();
    let replies = third.option(NBD_OPT_GO, &Client::go_data("zdisk", &[]));
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_eq!(replies[0].reply_type, NBD_REP_ERR_POLICY);
    let message = String::from_utf8_lossy(&replies[0].data);
    assert!(message.contains("too many connections"), "{message}");
    assert!(message.contains('2'), "the limit is named: {message}");
    first.assert_works();
    second.assert_works();
    // A place freed is a place taken.
    first.disconnect();
    assert!(first.is_closed());
    // The freed place comes back once the server has seen the disconnect;
    // the bound only tells "never" from "later".
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut next = server.connect();
        next.start_handshake();
        let replies = next.option(NBD_OPT_GO, &Client::go_data("zdisk", &[]));
        if replies.last().is_some_and(|r| r.reply_type == NBD_REP_ACK) {
            next.assert_works();
            break;
        }
        assert!(Instant::now() < deadline, "the freed place never came back");
        thread::sleep(Duration::from_millis(50));
    }
    server.stop().unwrap();
}

#[test]
fn silent_connections_make_room_and_are_not_sessions() {
    // Two places for sessions, four per address for handshakes: 200
    // silent connections from this address must neither take the session
    // places nor keep prompt clients out.
    let config = ServerConfig {
        max_connections: 2,
        max_handshakes: 8,
        max_handshakes_per_address: 4,
        ..ServerConfig::default()
    };
    let server = TestServer::start_with(SIZE, config);
    let ListenAddr::Tcp(addr) = server.addr.clone() else {
        unreachable!("the test server listens on TCP");
    };
    let mut silent: Vec<TcpStream> = (0..200)
        .map(|_| TcpStream::connect(addr).expect("connect"))
        .collect();
    let (mut first, _) = Client::connect_with(&server.addr, Setup::SIMPLE);
    let (mut second, _) = Client::connect_with(&server.addr, Setup::SIMPLE);
    first.assert_works();
    second.assert_works();
    // The oldest silent connection got its greeting and then, dropped to
    // make room, the end of the stream.
    let oldest = &mut silent[0];
    oldest
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut bytes = Vec::new();
    oldest
        .read_to_end(&mut bytes)
        .expect("closed by the server");
    assert_eq!(bytes.len(), 18, "a greeting, then nothing");
    assert_eq!(&bytes[..8], b"NBDMAGIC");
    drop(silent);
    server.stop().unwrap();
}

#[test]
fn handshakes_must_finish_within_the_deadline() {
    let config = ServerConfig {
        handshake_timeout: Duration::from_millis(300),
        ..ServerConfig::default()
    };
    let server = TestServer::start_with(SIZE, config);
    // Silent after the greeting.
    // (is_closed waits on the client's read timeout, far above 300 ms: a
    // server that never closed would fail it.)
    let mut silent = server.connect();
    silent.greeting();
    assert!(silent.is_closed());
    // A byte at a time, each well within the deadline: the deadline is for
    // the whole handshake, not per read.
    // A per-read deadline would take all 100 bytes, one every 50 ms; the
    // whole-handshake one closes while they still arrive.
    let mut trickle = server.connect();
    trickle.start_handshake();
    let option = [IHAVEOPT.to_be_bytes().as_slice(), &[0, 0, 0, 3, 0, 0, 0, 0]].concat();
    let mut sent = 0;
    for byte in option.iter().cycle().take(100) {
        thread::sleep(Duration::from_millis(50));
        if trickle.try_send(&[*byte]).is_err() {
            break;
        }
        sent += 1;
    }
    assert!(
        sent < 100,
        "a trickling handshake was kept for all {sent} bytes"
    );
    // A prompt client is unaffected.
    let (mut c, _) = Client::connect_with(&server.addr, Setup::SIMPLE);
    thread::sleep(Duration::from_millis(500));
    c.assert_works();
    server.stop().unwrap();
}

#[test]
fn requests_up_to_the_advertised_maximum_are_served() {
    let server = TestServer::start(SIZE);
    let (mut c, info) = Client::connect_with(&server.addr, Setup::STRUCTURED);
    let maximum = info.block_sizes.expect("block sizes").2;
    assert_eq!(maximum, 64 << 20);
    let data: Vec<u8> = (0..maximum as usize).map(|i| (i / 4096) as u8).collect();
    assert_eq!(c.write(0, &data).error, 0);
    assert!(c.read(0, maximum).data == data);
    assert_eq!(c.read(0, maximum + 512).error, NBD_EINVAL);
    c.assert_works();
    server.stop().unwrap();
}

fn psk_config(mode: TlsMode) -> ServerConfig {
    let path = std::env::temp_dir().join(format!("zdisk-limits-{}.psk", std::process::id()));
    std::fs::write(&path, "alice:000102030405060708090a0b0c0d0e0f\n").unwrap();
    let tls = TlsConfig::load(&TlsCredentials::PskFile(path.clone())).unwrap();
    let _ = std::fs::remove_file(&path);
    ServerConfig {
        tls_mode: mode,
        tls: Some(tls),
        ..ServerConfig::default()
    }
}

#[test]
fn tls_required_answers_nothing_but_starttls_in_plain_text() {
    let server = TestServer::start_with(SIZE, psk_config(TlsMode::Require));
    let mut c = server.connect();
    c.start_handshake();
    for (option, data) in [
        (NBD_OPT_LIST, Vec::new()),
        (NBD_OPT_INFO, Client::go_data("zdisk", &[])),
        (NBD_OPT_GO, Client::go_data("zdisk", &[])),
        (NBD_OPT_STRUCTURED_REPLY, Vec::new()),
        (99, vec![1, 2, 3]),
    ] {
        let replies = c.option(option, &data);
        assert_eq!(replies.len(), 1);
        assert_eq!(
            replies[0].reply_type, NBD_REP_ERR_TLS_REQD,
            "option {option}"
        );
    }
    let replies = c.option(NBD_OPT_STARTTLS, b"x");
    assert_eq!(replies[0].reply_type, NBD_REP_ERR_INVALID);
    // EXPORT_NAME cannot be refused, so it ends the connection.
    c.send_option(NBD_OPT_EXPORT_NAME, b"zdisk");
    assert!(c.is_closed());

    // STARTTLS is acknowledged; bytes sent before the TLS handshake
    // (a plain-text injection) end the connection.
    let mut c = server.connect();
    c.start_handshake();
    let mut both = Vec::new();
    for option in [NBD_OPT_STARTTLS, NBD_OPT_STRUCTURED_REPLY] {
        both.extend_from_slice(&IHAVEOPT.to_be_bytes());
        both.extend_from_slice(&option.to_be_bytes());
        both.extend_from_slice(&0u32.to_be_bytes());
    }
    c.send(&both);
    assert_eq!(c.option_reply(NBD_OPT_STARTTLS).reply_type, NBD_REP_ACK);
    assert!(c.is_closed());
    server.stop().unwrap();
}

#[test]
fn tls_on_lets_plain_text_clients_in() {
    let server = TestServer::start_with(SIZE, psk_config(TlsMode::On));
    let (mut c, _) = Client::connect_with(&server.addr, Setup::STRUCTURED);
    c.assert_works();
    server.stop().unwrap();
}
