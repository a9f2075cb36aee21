//! Server-level behaviour: concurrency within one connection (requests run
//! in parallel, replies may overtake each other, the in-flight limit holds),
//! NBD_CMD_DISC and shutdown both draining in-flight requests, many
//! connections at once, and Unix socket handling.
//!
//! Concurrency is made deterministic with the RAM device's gates: a request
//! held at a gate is provably still inside the device, so "reply B arrived
//! while A was held" cannot pass by luck.

mod common;

use std::fs;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::thread;
use std::time::{Duration, Instant};

use common::{Client, Setup, TestServer};
use zdisk_nbd::testing::RamDevice;
use zdisk_nbd::wire::*;
use zdisk_nbd::{ListenAddr, Server, ServerConfig};

const SIZE: u64 = 16 << 20;
const HELD_TIMEOUT: Duration = Duration::from_secs(10);

#[test]
fn replies_overtake_slow_requests() {
    let server = TestServer::start(SIZE);
    let (mut c, _) = Client::connect_with(&server.addr, Setup::STRUCTURED);
    server.device.hold(0);
    let slow = c.send_request(0, NBD_CMD_READ, 0, 4096, &[]);
    assert!(server.device.wait_for_held(1, HELD_TIMEOUT));
    let fast = c.send_request(0, NBD_CMD_READ, 8192, 4096, &[]);
    let first = c.reply();
    assert_eq!(first.cookie, fast, "the later request is answered first");
    server.device.release(0);
    let second = c.reply();
    assert_eq!(second.cookie, slow);
    assert_eq!(second.error, 0);
}

#[test]
fn requests_on_one_connection_run_in_parallel() {
    let config = ServerConfig {
        worker_threads: 4,
        ..ServerConfig::default()
    };
    let server = TestServer::start_with(SIZE, config);
    let (mut c, _) = Client::connect_with(&server.addr, Setup::SIMPLE);
    server.device.hold(0);
    server.device.hold(65536);
    c.send_request(0, NBD_CMD_WRITE, 0, 512, &[1; 512]);
    c.send_request(0, NBD_CMD_READ, 65536, 512, &[]);
    assert!(
        server.device.wait_for_held(2, HELD_TIMEOUT),
        "two requests of one connection are inside the device at once"
    );
    server.device.release(0);
    server.device.release(65536);
    let mut errors: Vec<u32> = (0..2).map(|_| c.reply().error).collect();
    errors.sort();
    assert_eq!(errors, vec![0, 0]);
}

#[test]
fn in_flight_limit_stops_the_reader() {
    let config = ServerConfig {
        max_in_flight_per_conn: 2,
        ..ServerConfig::default()
    };
    let server = TestServer::start_with(SIZE, config);
    let (mut c, _) = Client::connect_with(&server.addr, Setup::SIMPLE);
    server.device.hold(0);
    for _ in 0..3 {
        c.send_request(0, NBD_CMD_READ, 0, 512, &[]);
    }
    assert!(server.device.wait_for_held(2, HELD_TIMEOUT));
    assert!(
        !server.device.wait_for_held(3, Duration::from_millis(300)),
        "the third request must wait for a free slot"
    );
    server.device.release(0);
    for _ in 0..3 {
        assert_eq!(c.reply().error, 0);
    }
}

#[test]
fn disconnect_waits_for_in_flight_replies() {
    let server = TestServer::start(SIZE);
    let (mut c, _) = Client::connect_with(&server.addr, Setup::STRUCTURED);
    server.device.hold(4096);
    let held = c.send_request(0, NBD_CMD_READ, 4096, 512, &[]);
    assert!(server.device.wait_for_held(1, HELD_TIMEOUT));
    c.disconnect();
    // Give the server time to (wrongly) close before the reply exists.
    thread::sleep(Duration::from_millis(100));
    server.device.release(4096);
    let reply = c.reply();
    assert_eq!(reply.cookie, held);
    assert_eq!(reply.error, 0);
    assert!(c.is_closed());
}

#[test]
fn shutdown_drains_in_flight_requests_then_returns() {
    let server = TestServer::start(SIZE);
    let (mut c, _) = Client::connect_with(&server.addr, Setup::SIMPLE);
    let (mut idle, _) = Client::connect_with(&server.addr, Setup::SIMPLE);
    server.device.hold(0);
    let held = c.send_request(0, NBD_CMD_WRITE, 0, 512, &[5; 512]);
    assert!(server.device.wait_for_held(1, HELD_TIMEOUT));

    server.shutdown_handle().shutdown();
    thread::sleep(Duration::from_millis(200));
    assert!(!server.is_finished(), "run() waits for the held request");
    // The idle connection is closed without waiting for anything.
    assert!(idle.is_closed());

    server.device.release(0);
    let reply = c.reply();
    assert_eq!(reply.cookie, held);
    assert_eq!(reply.error, 0);
    assert!(c.is_closed());
    let addr = server.addr.clone();
    server.stop().expect("run() returns Ok after shutdown");
    assert!(
        !accepts_connections(&addr),
        "nobody listens after run() returned"
    );
}

fn accepts_connections(addr: &ListenAddr) -> bool {
    match addr {
        ListenAddr::Tcp(a) => std::net::TcpStream::connect(a).is_ok(),
        ListenAddr::Unix(p) => std::os::unix::net::UnixStream::connect(p).is_ok(),
    }
}

#[test]
fn shutdown_closes_connections_in_the_handshake() {
    let server = TestServer::start(SIZE);
    let mut c = server.connect();
    c.start_handshake();
    server.shutdown_handle().shutdown();
    assert!(c.is_closed());
    server.stop().unwrap();
}

#[test]
fn shutdown_gives_up_on_clients_that_stop_reading() {
    let config = ServerConfig {
        shutdown_timeout: Duration::from_millis(300),
        ..ServerConfig::default()
    };
    let server = TestServer::start_with(64 << 20, config);
    let (mut c, _) = Client::connect_with(&server.addr, Setup::SIMPLE);
    // Ask for far more data than socket buffers hold, and never read it.
    for _ in 0..64 {
        c.send_request(0, NBD_CMD_READ, 0, 4 << 20, &[]);
    }
    thread::sleep(Duration::from_millis(200));
    // Without the backstop, stop() would wait on the unread replies for
    // ever; the bound only tells a hang, not slowness.
    let started = Instant::now();
    server.stop().unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(120),
        "stop() took {:?}: it waited on a client that never reads",
        started.elapsed()
    );
    drop(c);
}

#[test]
fn many_connections_at_once_share_one_device() {
    let server = TestServer::start(SIZE);
    let addr = server.addr.clone();
    let clients: Vec<_> = (0..16u64)
        .map(|n| {
            let addr = addr.clone();
            thread::spawn(move || {
                let (mut c, _) = Client::connect_with(&addr, Setup::STRUCTURED);
                let data = vec![n as u8 + 1; 65536];
                let offset = n * 65536;
                for _ in 0..20 {
                    assert_eq!(c.write(offset, &data).error, 0);
                    assert_eq!(c.read(offset, 65536).data, data);
                }
                assert_eq!(c.request(0, NBD_CMD_FLUSH, 0, 0, &[]).error, 0);
                c.disconnect();
                assert!(c.is_closed());
            })
        })
        .collect();
    for client in clients {
        client.join().unwrap();
    }
    // Writes on one connection are visible on another.
    let (mut c, _) = Client::connect_with(&server.addr, Setup::SIMPLE);
    assert_eq!(c.read(3 * 65536, 512).data, vec![4u8; 512]);
}

#[test]
fn a_deep_queue_on_one_connection_gets_every_reply() {
    let server = TestServer::start(SIZE);
    let (mut c, _) = Client::connect_with(&server.addr, Setup::STRUCTURED);
    let mut expected = std::collections::HashMap::new();
    for i in 0..256u64 {
        let data = vec![i as u8; 4096];
        let cookie = c.send_request(0, NBD_CMD_WRITE, i * 4096, 4096, &data);
        expected.insert(cookie, ());
    }
    for _ in 0..256 {
        let reply = c.reply();
        assert_eq!(reply.error, 0);
        assert!(
            expected.remove(&reply.cookie).is_some(),
            "one reply per cookie"
        );
    }
    for i in (0..256u64).step_by(37) {
        assert_eq!(c.read(i * 4096, 4096).data, vec![i as u8; 4096]);
    }
}

#[test]
fn run_may_only_be_called_once() {
    let device = std::sync::Arc::new(RamDevice::new(SIZE));
    let server = Server::bind(
        &ListenAddr::Tcp("127.0.0.1:0".parse().unwrap()),
        device,
        ServerConfig::default(),
    )
    .unwrap();
    server.shutdown_handle().shutdown();
    server.run().unwrap();
    assert!(server.run().is_err());
}

#[test]
fn bind_rejects_bad_configuration() {
    let device = std::sync::Arc::new(RamDevice::new(SIZE));
    let addr = ListenAddr::Tcp("127.0.0.1:0".parse().unwrap());
    for config in [
        ServerConfig {
            worker_threads: 0,
            ..ServerConfig::default()
        },
        ServerConfig {
            max_in_flight_per_conn: 0,
            ..ServerConfig::default()
        },
        ServerConfig {
            export_name: "x".repeat(MAX_STRING_BYTES + 1),
            ..ServerConfig::default()
        },
    ] {
        let error = Server::bind(&addr, device.clone(), config).err().unwrap();
        assert_eq!(error.kind(), std::io::ErrorKind::InvalidInput);
    }
}

fn temp_socket_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zdisk-nbd-test-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    let _ = fs::remove_file(&path);
    path
}

#[test]
fn unix_socket_replaces_a_stale_socket_and_cleans_up() {
    let path = temp_socket_path("stale.sock");
    drop(UnixListener::bind(&path).unwrap()); // leaves a stale socket file
    assert!(path.exists());

    let server = TestServer::start_at(
        &ListenAddr::Unix(path.clone()),
        SIZE,
        ServerConfig::default(),
    );
    let (mut c, info) = Client::connect_with(&server.addr, Setup::STRUCTURED);
    assert_eq!(info.size_bytes, SIZE);
    c.assert_works();
    c.disconnect();
    assert!(c.is_closed());
    server.stop().unwrap();
    assert!(!path.exists(), "the server removes its socket file");
}

#[test]
fn unix_socket_never_removes_other_files_or_live_sockets() {
    let device = std::sync::Arc::new(RamDevice::new(SIZE));

    let file = temp_socket_path("regular-file");
    fs::write(&file, b"keep me").unwrap();
    let error = Server::bind(
        &ListenAddr::Unix(file.clone()),
        device.clone(),
        ServerConfig::default(),
    )
    .err()
    .unwrap();
    assert_eq!(error.kind(), std::io::ErrorKind::AlreadyExists);
    assert_eq!(fs::read(&file).unwrap(), b"keep me");

    let live = temp_socket_path("live.sock");
    let _listener = UnixListener::bind(&live).unwrap();
    let error = Server::bind(
        &ListenAddr::Unix(live.clone()),
        device,
        ServerConfig::default(),
    )
    .err()
    .unwrap();
    assert_eq!(error.kind(), std::io::ErrorKind::AddrInUse);
    assert!(live.exists());
}
