//! Hostile clients against the real `zdisk serve`: connections that never
//! finish their handshake must not lock out real clients.
//!
//! Each test runs the server with 20,000 file descriptors and an
//! established fio client (4 KiB random reads over the nbd engine), then
//! attacks it from 127.0.0.1 (10,000 connections) and 127.0.0.2 (100),
//! reopening whatever the server closes: connections that stay silent,
//! connections that drip a byte every 9 s, or connections that send a TLS
//! ClientHello (each costing the server a handshake's public-key work) and
//! stall. Meanwhile an honest client from 127.0.0.3, and one from the
//! attacker's own address (behind a NAT, say), each complete a handshake
//! and a read on every try.
//!
//! Drippers from 127.0.0.4 stay under the per-address cap, so only the
//! handshake deadline (for the whole handshake, not per read) ends them.
//! A fourth test gives the server 256 descriptors and 2,000 silent
//! connections: accept fails with EMFILE, and the server must make room
//! for honest clients without spinning.
//!
//! What must hold (events, not times): every honest try completes; fio
//! finishes without error; the server's RSS grows at most 64 MiB; the
//! server's counters show the attack was absorbed (evictions or
//! timeouts); the server exits cleanly afterwards. Handshake times and
//! fio's rate alone and under attack are printed for the report.
//!
//! Attackers are threads of this process; each socket binds its source
//! address before connecting (all of 127/8 is loopback).

mod support;

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::os::fd::FromRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Trial};
use openssl::ssl::{SslConnector, SslMethod, SslStream, SslVerifyMode};

use support::*;

const ATTACKER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 1);
const SECOND_ATTACKER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
const BYSTANDER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 3);
/// Drippers that stay under the per-address cap, so only the handshake
/// deadline can end them.
const DRIPPER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 4);
/// File descriptors of the server (and of this process).
const FDS: u64 = 20_000;
const RSS_GROWTH_MAX_BYTES: u64 = 64 << 20;
/// How often attackers reopen what the server closed.
const ATTACK_ROUND: Duration = Duration::from_secs(2);
const DRIP_EVERY: Duration = Duration::from_secs(9);
/// Longest wait for the attack's first wave before the honest clients come.
const RAMP_MAX: Duration = Duration::from_secs(8);
/// Patience of an honest client for each step; only a hang trips it.
const HONEST_PATIENCE: Duration = Duration::from_secs(30);

const NBD_OPT_GO: u32 = 7;
const NBD_OPT_STARTTLS: u32 = 5;
const NBD_REP_ACK: u32 = 1;
const IHAVEOPT: u64 = 0x4948_4156_454F_5054;

type TestFn = fn() -> TestResult;

fn main() {
    let mut args = Arguments::from_args();
    // Each test loads the machine on its own.
    args.test_threads.get_or_insert(1);
    let tests: Vec<(&str, TestFn)> = vec![
        ("silent_connections_do_not_lock_out_clients", silent),
        ("slow_drip_connections_do_not_lock_out_clients", drip),
        ("client_hello_flood_does_not_lock_out_clients", hello_flood),
        (
            "running_out_of_descriptors_neither_spins_nor_locks_out",
            descriptors,
        ),
    ];
    let trials = tests
        .into_iter()
        .map(|(name, test)| Trial::ignorable_test(name, test))
        .collect();
    libtest_mimic::run(&args, trials).exit();
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Attack {
    Silent,
    Drip,
    ClientHello,
}

/// Over 30 s, three times the server's 10 s handshake timeout: the silent
/// connections time out and are replaced by new ones at least twice while
/// the honest clients come.
fn silent() -> TestResult {
    siege(Attack::Silent, 20, Duration::from_secs(30))
}

fn drip() -> TestResult {
    siege(Attack::Drip, 20, Duration::from_secs(30))
}

fn hello_flood() -> TestResult {
    siege(Attack::ClientHello, 20, Duration::from_secs(30))
}

/// Raises this process's descriptor limit to [`FDS`]; the server, started
/// after, inherits it.
fn raise_fd_limit() -> Result<(), String> {
    let limit = libc::rlimit {
        rlim_cur: FDS,
        rlim_max: FDS,
    };
    let mut current = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: valid rlimit structs for the calls.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut current);
        let wanted = libc::rlimit {
            rlim_cur: FDS,
            rlim_max: current.rlim_max.max(FDS),
        };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &wanted) != 0
            && libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0
        {
            return Err(format!(
                "cannot raise the descriptor limit to {FDS} (hard limit {})",
                current.rlim_max
            ));
        }
    }
    Ok(())
}

fn siege(attack: Attack, tries: usize, spread: Duration) -> TestResult {
    let mut tools = vec!["fio", "curl"];
    if attack == Attack::ClientHello {
        tools.push("certtool");
    }
    if let Some(skip) = skip_unless(require_tools(&tools).and_then(|()| raise_fd_limit())) {
        return skip;
    }
    let dir = Scratch::new(&format!("hostile-{attack:?}"));
    let image = dir.join("siege.zdisk");
    let port = free_port();
    let metrics_port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let metrics = format!("127.0.0.1:{metrics_port}");
    let pki = dir.join("pki");
    let mut args = vec![
        "--listen",
        &listen,
        "--metrics",
        &metrics,
        "--logical",
        "1G",
    ];
    let pki_server = pki.join("server");
    let pki_server_text = pki_server.to_str().expect("UTF-8 path").to_string();
    if attack == Attack::ClientHello {
        make_pki(&pki)?;
        args.extend(["--tls", "on", "--tls-certificates", &pki_server_text]);
    }
    let mut server = Server::start_tcp(&image, &args)?;
    let pid = server.pid();
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits"))?;
    ensure!(
        limits
            .lines()
            .any(|l| l.starts_with("Max open files") && l.contains(&FDS.to_string())),
        "the server's descriptor limit is not {FDS}:\n{limits}"
    );
    let target = SocketAddrV4::new(ATTACKER, port);
    let uri = format!("nbd://127.0.0.1:{port}/zdisk");

    // Data to read, then fio alone for a reference rate.
    fio(&uri, "write", 0)?;
    let alone_iops = fio(&uri, "randread", 8)?;

    // The established client, for the whole siege.
    // Two seconds before the attack, the ramp, the tries, and a margin.
    let fio_seconds = spread.as_secs() + RAMP_MAX.as_secs() + 4;
    let fio_uri = uri.clone();
    let reader = thread::spawn(move || fio(&fio_uri, "randread", fio_seconds));
    thread::sleep(Duration::from_secs(2));
    let rss_base = rss_bytes(pid)?;
    let rss_max = Arc::new(AtomicU64::new(rss_base));
    let stop = Arc::new(AtomicBool::new(false));
    let monitor = {
        let (rss_max, stop) = (Arc::clone(&rss_max), Arc::clone(&stop));
        thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(rss) = rss_bytes(pid) {
                    rss_max.fetch_max(rss, Ordering::Relaxed);
                }
                thread::sleep(Duration::from_millis(250));
            }
        })
    };

    // The attack.
    let opened = Arc::new(AtomicU64::new(0));
    let hello = if attack == Attack::ClientHello {
        Some(Arc::new(client_hello()?))
    } else {
        None
    };
    let mut attackers = Vec::new();
    let mut waves = vec![(ATTACKER, 10_000usize), (SECOND_ATTACKER, 100)];
    if attack == Attack::Drip {
        waves.push((DRIPPER, 50));
    }
    // A ClientHello flood opens only as fast as the server answers.
    let wave_total: usize = match attack {
        Attack::ClientHello => 500,
        _ => waves.iter().map(|(_, count)| count).sum(),
    };
    for (source, count) in waves {
        let (stop, opened, hello) = (Arc::clone(&stop), Arc::clone(&opened), hello.clone());
        attackers.push(thread::spawn(move || match &hello {
            Some(hello) => flood_hellos(source, target, count, hello, &stop, &opened),
            None => hold(
                source,
                target,
                count,
                attack == Attack::Drip,
                &stop,
                &opened,
            ),
        }));
    }
    // Let the first wave arrive before the honest clients come.
    let ramp = Instant::now();
    while opened.load(Ordering::Relaxed) < wave_total as u64 && ramp.elapsed() < RAMP_MAX {
        thread::sleep(Duration::from_millis(100));
    }

    let connector = if attack == Attack::ClientHello {
        Some(honest_connector(&pki.join("ca-cert.pem"))?)
    } else {
        None
    };
    let mut times: Vec<(Ipv4Addr, Duration)> = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    let mut retried: Vec<String> = Vec::new();
    let started = Instant::now();
    for i in 0..tries {
        let due = started + spread.mul_f64(i as f64 / tries as f64);
        thread::sleep(due.saturating_duration_since(Instant::now()));
        for source in [BYSTANDER, ATTACKER] {
            // Behind the flooding address itself, an honest TLS client
            // cannot be told from the flood until its handshake completes:
            // starved of CPU past the slot's grace, it loses its slot like
            // the flood's, and before its first message is read it is the
            // address's oldest silent connection, which the address's cap
            // drops first when the flood's queue reaches it (two attempts
            // in a row were, once, on a loaded machine). It must get in
            // when it tries again, as a client reconnects. Everyone else
            // must get in the first time.
            let attempts = if attack == Attack::ClientHello && source == ATTACKER {
                3
            } else {
                1
            };
            let mut result = honest(source, target, connector.as_ref());
            for _ in 1..attempts {
                if let Err(e) = &result {
                    retried.push(format!("try {i} from {source}: {e}"));
                    result = honest(source, target, connector.as_ref());
                }
            }
            match result {
                Ok(took) => times.push((source, took)),
                Err(e) => failures.push(format!("try {i} from {source}: {e}")),
            }
        }
    }
    let attacked_for = ramp.elapsed();
    let counters = server.stats().map(|s| s["nbd"].clone());

    stop.store(true, Ordering::Relaxed);
    for attacker in attackers {
        let _ = attacker.join();
    }
    let _ = monitor.join();
    let under_attack = reader.join().map_err(|_| "the fio thread panicked")?;
    let rss_max = rss_max.load(Ordering::Relaxed);
    let counters = counters?;
    server.stop()?;

    println!(
        "{attack:?}: {} attacker connections opened in {:.0} s",
        opened.load(Ordering::Relaxed),
        attacked_for.as_secs_f64()
    );
    for source in [BYSTANDER, ATTACKER] {
        let mut mine: Vec<Duration> = times
            .iter()
            .filter(|(s, _)| *s == source)
            .map(|(_, t)| *t)
            .collect();
        mine.sort();
        if let (Some(first), Some(last)) = (mine.first(), mine.last()) {
            println!(
                "{attack:?}: honest handshakes from {source}: {} done, min {:.1} ms, median {:.1} ms, max {:.1} ms",
                mine.len(),
                first.as_secs_f64() * 1e3,
                mine[mine.len() / 2].as_secs_f64() * 1e3,
                last.as_secs_f64() * 1e3
            );
        }
    }
    println!(
        "{attack:?}: fio 4 KiB random reads: {alone_iops:.0} IOPS alone, {} under attack",
        under_attack.as_ref().map_or_else(
            |e| format!("failed ({e})"),
            |iops| format!("{iops:.0} IOPS")
        )
    );
    println!(
        "{attack:?}: server RSS {} MiB before the attack, at most {} MiB during it",
        rss_base >> 20,
        rss_max >> 20
    );
    println!("{attack:?}: server counters {counters}");
    for retry in &retried {
        println!("{attack:?}: retried (behind the flooding address) after {retry}");
    }

    ensure!(
        failures.is_empty(),
        "honest clients failed:\n{}",
        failures.join("\n")
    );
    ensure!(
        times.len() == 2 * tries,
        "{} honest tries of {}",
        times.len(),
        2 * tries
    );
    let iops = under_attack?;
    ensure!(iops > 0.0, "fio read nothing under attack");
    ensure!(
        rss_max.saturating_sub(rss_base) <= RSS_GROWTH_MAX_BYTES,
        "server RSS grew from {} to {} MiB",
        rss_base >> 20,
        rss_max >> 20
    );
    let count = |key: &str| counters[key].as_u64().unwrap_or(0);
    ensure!(
        count("evicted_per_source") + count("handshakes_timed_out") + count("evicted_tls_slot") > 0,
        "the attack left no trace in the counters: {counters}"
    );
    ensure!(
        count("handshakes_completed") >= 2 * tries as u64,
        "counters miss honest handshakes: {counters}"
    );
    if attack == Attack::Drip {
        ensure!(
            count("handshakes_timed_out") > 0,
            "no dripping handshake met its deadline: {counters}"
        );
    }
    if attack == Attack::ClientHello {
        ensure!(
            count("tls_handshakes_started") > 2 * tries as u64,
            "the flood started no TLS handshakes: {counters}"
        );
    }
    Ok(Completion::Completed)
}

/// The server at 256 descriptors, and 2,000 silent connections from one
/// address that it would keep (its handshake budget is raised past its
/// descriptors): accept fails with EMFILE, and the server must drop
/// waiting connections to let newcomers in, without spinning.
fn descriptors() -> TestResult {
    if let Some(skip) = skip_unless(require_tools(&["curl"]).and_then(|()| raise_fd_limit())) {
        return skip;
    }
    let dir = Scratch::new("hostile-fds");
    let image = dir.join("fds.zdisk");
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let metrics = format!("127.0.0.1:{}", free_port());
    let args = [
        "--listen",
        &listen,
        "--metrics",
        &metrics,
        "--logical",
        "1G",
        "--max-handshakes",
        "4000",
        "--max-handshakes-per-address",
        "4000",
    ];
    let mut server = Server::start_tcp(&image, &args)?;
    let pid = server.pid();
    let few = libc::rlimit {
        rlim_cur: 256,
        rlim_max: 256,
    };
    // SAFETY: a valid rlimit struct; no old value asked for.
    let set = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            &few,
            std::ptr::null_mut(),
        )
    };
    ensure!(set == 0, "prlimit: {}", io::Error::last_os_error());
    let target = SocketAddrV4::new(ATTACKER, port);
    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicU64::new(0));
    let attacker = {
        let (stop, opened) = (Arc::clone(&stop), Arc::clone(&opened));
        thread::spawn(move || hold(ATTACKER, target, 2000, false, &stop, &opened))
    };
    let ramp = Instant::now();
    while opened.load(Ordering::Relaxed) < 2000 && ramp.elapsed() < Duration::from_secs(15) {
        thread::sleep(Duration::from_millis(100));
    }
    let cpu_before = cpu_seconds(pid)?;
    let window = Instant::now();
    let mut failures = Vec::new();
    let mut times = Vec::new();
    for i in 0..10 {
        thread::sleep(Duration::from_millis(1000));
        for source in [BYSTANDER, ATTACKER] {
            match honest(source, target, None) {
                Ok(took) => times.push(took),
                Err(e) => failures.push(format!("try {i} from {source}: {e}")),
            }
        }
    }
    let cpu = cpu_seconds(pid)? - cpu_before;
    let elapsed = window.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let _ = attacker.join();
    // The attacker's sockets are closed now, which frees the server's
    // descriptors for the statistics request.
    thread::sleep(Duration::from_secs(1));
    let counters = server.stats()?["nbd"].clone();
    server.stop()?;
    times.sort();
    println!(
        "descriptors: {} attacker connections; {} honest handshakes, max {:.1} ms; server CPU {cpu:.1} s in {elapsed:.1} s",
        opened.load(Ordering::Relaxed),
        times.len(),
        times.last().map_or(0.0, |t| t.as_secs_f64() * 1e3)
    );
    println!("descriptors: server counters {counters}");
    ensure!(
        failures.is_empty(),
        "honest clients failed:\n{}",
        failures.join("\n")
    );
    let count = |key: &str| counters[key].as_u64().unwrap_or(0);
    ensure!(
        count("accept_exhausted") > 0,
        "accept never ran out: {counters}"
    );
    ensure!(
        count("evicted_for_fds") > 0,
        "no waiting connection made room: {counters}"
    );
    Ok(Completion::Completed)
}

/// CPU seconds (user and system) the process has used.
fn cpu_seconds(pid: u32) -> Result<f64, String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_err(|e| format!("the server is gone: {e}"))?;
    let after_name = &stat[stat.rfind(')').ok_or("bad stat")? + 2..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 here.
    let ticks: u64 =
        fields[11].parse::<u64>().unwrap_or(0) + fields[12].parse::<u64>().unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok(ticks as f64 / per_second)
}

/// Runs fio's nbd engine: `write` fills 256 MiB once, `randread` reads
/// 4 KiB blocks for `seconds`. Returns the IOPS.
fn fio(uri: &str, rw: &str, seconds: u64) -> Result<f64, String> {
    let mut args = vec![
        "--name=siege".to_string(),
        "--ioengine=nbd".to_string(),
        format!("--uri={uri}"),
        format!("--rw={rw}"),
        "--size=256M".to_string(),
        "--output-format=json".to_string(),
    ];
    if rw == "write" {
        args.extend(["--bs=1M".to_string(), "--refill_buffers".to_string()]);
    } else {
        args.extend([
            "--bs=4k".to_string(),
            "--iodepth=8".to_string(),
            "--time_based".to_string(),
            format!("--runtime={seconds}"),
        ]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let output = run("fio", &args).map_err(|e| format!("{e:?}"))?;
    let text = stdout(&output);
    let json_start = text.find('{').ok_or("fio printed no JSON")?;
    let report: serde_json::Value =
        serde_json::from_str(&text[json_start..]).map_err(|e| format!("fio JSON: {e}"))?;
    let job = &report["jobs"][0];
    if job["error"] != 0 {
        return Err(format!("fio job failed: {job}"));
    }
    let side = if rw == "write" { "write" } else { "read" };
    Ok(job[side]["iops"].as_f64().unwrap_or(0.0))
}

fn rss_bytes(pid: u32) -> Result<u64, String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("the server is gone: {e}"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .ok_or("no VmRSS")?;
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .ok_or("bad VmRSS")?;
    Ok(kib << 10)
}

fn sockaddr(ip: Ipv4Addr, port: u16) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    }
}

/// A TCP connection from `source` to `target`; non-blocking ones return
/// while the connection is still being made.
fn open_from(source: Ipv4Addr, target: SocketAddrV4, nonblocking: bool) -> io::Result<TcpStream> {
    let flags =
        libc::SOCK_STREAM | libc::SOCK_CLOEXEC | if nonblocking { libc::SOCK_NONBLOCK } else { 0 };
    // SAFETY: plain syscalls on a descriptor this function owns (through
    // `stream` from the moment it exists), with valid address structs.
    unsafe {
        let fd = libc::socket(libc::AF_INET, flags, 0);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let stream = TcpStream::from_raw_fd(fd);
        // Let connect pick the port for the whole address pair, so that
        // thousands of connections from one address do not run out.
        let one: libc::c_int = 1;
        libc::setsockopt(
            fd,
            libc::IPPROTO_IP,
            libc::IP_BIND_ADDRESS_NO_PORT,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
        let local = sockaddr(source, 0);
        let size = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        if libc::bind(fd, (&local as *const libc::sockaddr_in).cast(), size) != 0 {
            return Err(io::Error::last_os_error());
        }
        let remote = sockaddr(*target.ip(), target.port());
        if libc::connect(fd, (&remote as *const libc::sockaddr_in).cast(), size) != 0 {
            let error = io::Error::last_os_error();
            if !(nonblocking && error.raw_os_error() == Some(libc::EINPROGRESS)) {
                return Err(error);
            }
        }
        Ok(stream)
    }
}

/// Holds `count` connections from `source` that never finish a message:
/// silent ones, or ones that send a byte every [`DRIP_EVERY`]. Whatever
/// the server closes is reopened the next round.
fn hold(
    source: Ipv4Addr,
    target: SocketAddrV4,
    count: usize,
    drip: bool,
    stop: &AtomicBool,
    opened: &AtomicU64,
) {
    struct Held {
        stream: TcpStream,
        next_drip: Instant,
    }
    let mut held: Vec<Option<Held>> = (0..count).map(|_| None).collect();
    let mut buf = [0u8; 256];
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        for slot in held.iter_mut() {
            let alive = slot
                .as_ref()
                .is_some_and(|h| match (&h.stream).read(&mut buf) {
                    Ok(0) => false,
                    Ok(_) => true,
                    Err(e) => e.kind() == io::ErrorKind::WouldBlock,
                });
            if !alive {
                *slot = open_from(source, target, true).ok().map(|stream| {
                    opened.fetch_add(1, Ordering::Relaxed);
                    Held {
                        stream,
                        next_drip: now,
                    }
                });
            }
            if let Some(h) = slot.as_mut().filter(|h| drip && h.next_drip <= now) {
                // The client flags, a byte at a time: never a whole message
                // before the handshake deadline.
                let _ = (&h.stream).write(&[0]);
                h.next_drip = now + DRIP_EVERY;
            }
        }
        let round = Instant::now();
        while round.elapsed() < ATTACK_ROUND && !stop.load(Ordering::Relaxed) {
            thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Opens connections from `source` as fast as the server answers, each
/// asking for TLS and sending a ClientHello, then stalling; holds up to
/// `count` of them.
fn flood_hellos(
    source: Ipv4Addr,
    target: SocketAddrV4,
    count: usize,
    hello: &[u8],
    stop: &AtomicBool,
    opened: &AtomicU64,
) {
    let mut held = VecDeque::new();
    while !stop.load(Ordering::Relaxed) {
        match send_hello(source, target, hello) {
            Ok(stream) => {
                opened.fetch_add(1, Ordering::Relaxed);
                held.push_back(stream);
                if held.len() > count {
                    held.pop_front();
                }
            }
            Err(_) => thread::sleep(Duration::from_millis(10)),
        }
    }
}

fn send_hello(source: Ipv4Addr, target: SocketAddrV4, hello: &[u8]) -> io::Result<TcpStream> {
    let mut stream = open_from(source, target, false)?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.set_write_timeout(Some(Duration::from_secs(2)))?;
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting)?;
    stream.write_all(&[0, 0, 0, 3])?;
    stream.write_all(&option(NBD_OPT_STARTTLS, &[]))?;
    let reply = read_option_reply(&mut stream)?;
    if reply.0 != NBD_REP_ACK {
        return Err(io::Error::other("STARTTLS refused"));
    }
    stream.write_all(hello)?;
    Ok(stream)
}

/// A real ClientHello, captured once and replayed by the flood: each copy
/// makes the server do a full handshake's key exchange and signature.
fn client_hello() -> Result<Vec<u8>, Failed> {
    #[derive(Default)]
    struct Capture(Vec<u8>);
    impl Read for Capture {
        fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
            Err(io::ErrorKind::WouldBlock.into())
        }
    }
    impl Write for Capture {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    let mut builder = SslConnector::builder(SslMethod::tls_client()).map_err(|e| e.to_string())?;
    builder.set_verify(SslVerifyMode::NONE);
    let ssl = builder
        .build()
        .configure()
        .map_err(|e| e.to_string())?
        .verify_hostname(false)
        .into_ssl("localhost")
        .map_err(|e| e.to_string())?;
    let mut stream = SslStream::new(ssl, Capture::default()).map_err(|e| e.to_string())?;
    let _ = stream.connect();
    let hello = stream.get_ref().0.clone();
    ensure!(
        hello.first() == Some(&0x16),
        "no TLS handshake record captured"
    );
    Ok(hello)
}

fn honest_connector(ca: &Path) -> Result<SslConnector, Failed> {
    let mut builder = SslConnector::builder(SslMethod::tls_client()).map_err(|e| e.to_string())?;
    builder.set_ca_file(ca).map_err(|e| e.to_string())?;
    Ok(builder.build())
}

fn option(option: u32, data: &[u8]) -> Vec<u8> {
    let mut out = IHAVEOPT.to_be_bytes().to_vec();
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out
}

/// Reads one option reply: its type and data.
fn read_option_reply(stream: &mut impl Read) -> io::Result<(u32, Vec<u8>)> {
    let mut header = [0u8; 20];
    stream.read_exact(&mut header)?;
    let reply_type = u32::from_be_bytes(header[12..16].try_into().expect("4 bytes"));
    let length = u32::from_be_bytes(header[16..20].try_into().expect("4 bytes"));
    let mut data = vec![0u8; length.min(1 << 16) as usize];
    stream.read_exact(&mut data)?;
    Ok((reply_type, data))
}

/// An honest client: connects from `source`, negotiates (over TLS if a
/// connector is given), reads 4 KiB and leaves. Returns the time from the
/// connect to the server's acknowledgement of NBD_OPT_GO.
fn honest(
    source: Ipv4Addr,
    target: SocketAddrV4,
    tls: Option<&SslConnector>,
) -> Result<Duration, String> {
    let started = Instant::now();
    let mut stream = open_from(source, target, false).map_err(|e| format!("connect: {e}"))?;
    stream
        .set_read_timeout(Some(HONEST_PATIENCE))
        .and_then(|()| stream.set_write_timeout(Some(HONEST_PATIENCE)))
        .map_err(|e| e.to_string())?;
    let mut greeting = [0u8; 18];
    stream
        .read_exact(&mut greeting)
        .map_err(|e| format!("greeting: {e}"))?;
    if &greeting[..8] != b"NBDMAGIC" {
        return Err("bad greeting".into());
    }
    stream
        .write_all(&[0, 0, 0, 3])
        .map_err(|e| format!("flags: {e}"))?;
    match tls {
        None => go_and_read(&mut stream, started),
        Some(connector) => {
            stream
                .write_all(&option(NBD_OPT_STARTTLS, &[]))
                .map_err(|e| format!("STARTTLS: {e}"))?;
            let (reply, data) =
                read_option_reply(&mut stream).map_err(|e| format!("STARTTLS reply: {e}"))?;
            if reply != NBD_REP_ACK {
                return Err(format!(
                    "STARTTLS refused: {}",
                    String::from_utf8_lossy(&data)
                ));
            }
            let mut tls = connector
                .connect("localhost", stream)
                .map_err(|e| format!("TLS handshake: {e}"))?;
            go_and_read(&mut tls, started)
        }
    }
}

fn go_and_read(stream: &mut (impl Read + Write), started: Instant) -> Result<Duration, String> {
    let name = b"zdisk";
    let mut data = (name.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(name);
    data.extend_from_slice(&0u16.to_be_bytes());
    stream
        .write_all(&option(NBD_OPT_GO, &data))
        .map_err(|e| format!("GO: {e}"))?;
    loop {
        let (reply, data) = read_option_reply(stream).map_err(|e| format!("GO reply: {e}"))?;
        if reply == NBD_REP_ACK {
            break;
        }
        if reply & 0x8000_0000 != 0 {
            return Err(format!("GO refused: {}", String::from_utf8_lossy(&data)));
        }
    }
    let took = started.elapsed();
    // One 4 KiB read, then NBD_CMD_DISC.
    let request = |kind: u16, length: u32| {
        let mut out = 0x2560_9513u32.to_be_bytes().to_vec();
        out.extend_from_slice(&0u16.to_be_bytes());
        out.extend_from_slice(&kind.to_be_bytes());
        out.extend_from_slice(&7u64.to_be_bytes());
        out.extend_from_slice(&0u64.to_be_bytes());
        out.extend_from_slice(&length.to_be_bytes());
        out
    };
    stream
        .write_all(&request(0, 4096))
        .map_err(|e| format!("read request: {e}"))?;
    let mut reply = [0u8; 16 + 4096];
    stream
        .read_exact(&mut reply)
        .map_err(|e| format!("read reply: {e}"))?;
    if reply[..4] != 0x6744_6698u32.to_be_bytes() || reply[4..8] != [0; 4] {
        return Err(format!("bad read reply {:?}", &reply[..16]));
    }
    let _ = stream.write_all(&request(2, 0));
    Ok(took)
}
