//! What a careless operator or a hostile client must not be able to do,
//! through the real binary: wipe an image with `create --force` (served, or
//! with arguments that fail late), panic a command whose output cannot be
//! written, stall or kill the server through its log, leave an image behind
//! when the port is busy, have layout flags silently ignored, or go
//! unnoticed when its requests are rejected. (The soak run, with hostile
//! clients and a kill -9, is `scripts/soak.py`, run by `scripts.rs`.)

mod support;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Trial};

use support::*;

type TestFn = fn() -> TestResult;

fn main() {
    let args = Arguments::from_args();
    let tests: Vec<(&str, TestFn)> = vec![
        (
            "create_force_never_wipes_what_it_cannot_replace",
            create_force,
        ),
        (
            "commands_report_unwritable_output_without_panicking",
            unwritable_output,
        ),
        ("a_closed_or_stuck_log_never_stalls_the_server", stuck_log),
        ("serve_binds_first_and_refuses_ignored_flags", serve_order),
        (
            "rejected_requests_are_logged_with_their_reason",
            rejected_logged,
        ),
    ];
    let trials = tests
        .into_iter()
        .map(|(name, test)| Trial::ignorable_test(name, test))
        .collect();
    libtest_mimic::run(&args, trials).exit();
}

fn zdisk_ok(args: &[&str]) -> Result<std::process::Output, Failed> {
    run(zdisk_bin().to_str().unwrap(), args)
}

fn create_force() -> TestResult {
    if let Some(skip) = skip_unless(require_tools(&["nbdcopy"])) {
        return skip;
    }
    let scratch = Scratch::new("ops-create");
    let image = scratch.join("keep.zdisk");
    let path = image.to_str().unwrap();
    zdisk_ok(&["create", path, "--logical", "64M"])?;
    let data = scratch.join("data.bin");
    std::fs::write(&data, pseudo_random(4 << 20, 11))?;
    let mut server = Server::start(&image, &scratch.join("s.sock"), &[])?;
    run("nbdcopy", &[data.to_str().unwrap(), &server.uri()])?;
    // Served: refused, and the server keeps serving the same data.
    one_line_error(&["create", path, "--logical", "32M", "--force"], "in use")?;
    one_line_error(&["create", path, "--logical", "100T", "--force"], "in use")?;
    let back = scratch.join("back.bin");
    run("nbdcopy", &[&server.uri(), back.to_str().unwrap()])?;
    ensure!(
        std::fs::read(&back)?[..4 << 20] == std::fs::read(&data)?[..],
        "the served data changed"
    );
    server.stop()?;
    // At rest: arguments that fail, early or late, leave it byte for byte.
    let before = std::fs::read(&image)?;
    one_line_error(
        &[
            "create",
            path,
            "--logical",
            "64M",
            "--physical",
            "100K",
            "--force",
        ],
        "too small",
    )?;
    one_line_error(&["create", path, "--logical", "64M"], "--force")?;
    let huge = zdisk(&[
        "create",
        path,
        "--logical",
        "100T",
        "--physical",
        "100T",
        "--force",
    ]);
    if !huge.status.success() {
        // Where the filesystem cannot hold it (ext4: 16 TiB files).
        ensure!(
            String::from_utf8_lossy(&huge.stderr).contains("cannot hold"),
            "100T: {}",
            String::from_utf8_lossy(&huge.stderr)
        );
        ensure!(
            std::fs::read(&image)? == before,
            "a failed create changed the image"
        );
    }
    let leftovers: Vec<_> = std::fs::read_dir(&scratch.path)?
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().contains("creating"))
        .collect();
    ensure!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
    // And --force does replace an unused image.
    zdisk_ok(&["create", path, "--logical", "32M", "--force"])?;
    let stats = zdisk_ok(&["stats", path, "--json"])?;
    let json: serde_json::Value = serde_json::from_slice(&stats.stdout)?;
    ensure!(
        json["logical_size_bytes"] == 32 << 20,
        "not replaced: {json}"
    );
    Ok(Completion::Completed)
}

fn unwritable_output() -> TestResult {
    let scratch = Scratch::new("ops-full");
    let image = scratch.join("out.zdisk");
    let path = image.to_str().unwrap();
    zdisk_ok(&["create", path, "--logical", "16M"])?;
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full")?;
    for args in [
        vec!["stats", path],
        vec!["stats", path, "--json"],
        vec!["check", path],
        vec![
            "create",
            scratch.join("other.zdisk").to_str().unwrap(),
            "--logical",
            "16M",
        ],
        vec!["bench", "--profile", "tiny", "--scenario", "qd", "--quiet"],
    ] {
        let output = Command::new(zdisk_bin())
            .args(&args)
            .stdout(full.try_clone()?)
            .output()?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        ensure!(
            output.status.code() == Some(2),
            "{args:?}: {}",
            output.status
        );
        ensure!(
            stderr.contains("cannot write to standard output"),
            "{args:?}: {stderr}"
        );
        ensure!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
        ensure!(
            stderr.lines().count() == 1,
            "{args:?}: not one line: {stderr}"
        );
    }
    Ok(Completion::Completed)
}

/// `count` nbdinfo connections, each of which must succeed.
fn connect_many(socket: &std::path::Path, count: usize) -> Result<(), Failed> {
    let uri = format!("nbd+unix:///?socket={}", socket.display());
    for _ in 0..count {
        run("nbdinfo", &["--size", &uri])?;
    }
    Ok(())
}

fn wait_exit(child: &mut std::process::Child, limit: Duration) -> Result<i32, Failed> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status.code().unwrap_or(-1));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            return Err(format!("zdisk did not exit within {limit:?}").into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait_for_socket(socket: &std::path::Path) -> Result<(), Failed> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !socket.exists() {
        ensure!(Instant::now() < deadline, "the server never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn stuck_log() -> TestResult {
    if let Some(skip) = skip_unless(require_tools(&["nbdinfo", "kill"])) {
        return skip;
    }
    let scratch = Scratch::new("ops-log");
    let image = scratch.join("log.zdisk");
    zdisk_ok(&["create", image.to_str().unwrap(), "--logical", "16M"])?;
    // 1. The log's reader goes away at once (`zdisk serve ... |& head -1`).
    let socket = scratch.join("a.sock");
    let mut child = Command::new(zdisk_bin())
        .args(["serve", image.to_str().unwrap(), "--socket"])
        .arg(&socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut first = [0u8; 16];
    child.stderr.take().expect("piped").read_exact(&mut first)?; // then dropped
    drop(child.stdout.take());
    wait_for_socket(&socket)?;
    connect_many(&socket, 30)?;
    run("kill", &["-TERM", &child.id().to_string()])?;
    ensure!(
        wait_exit(&mut child, Duration::from_secs(20))? == 0,
        "exit after SIGTERM"
    );

    // 2. The log's reader stays but never reads: the pipe fills (each
    // connection logs two lines; 600 connections are far more than a
    // 64 KiB pipe holds). SIGHUP still stops it cleanly.
    let socket = scratch.join("b.sock");
    let mut child = Command::new(zdisk_bin())
        .args(["serve", image.to_str().unwrap(), "--socket"])
        .arg(&socket)
        .stderr(Stdio::piped())
        .spawn()?;
    let stuck = child.stderr.take(); // held, never read
    wait_for_socket(&socket)?;
    let started = Instant::now();
    connect_many(&socket, 600)?;
    let took = started.elapsed();
    run("kill", &["-HUP", &child.id().to_string()])?;
    ensure!(
        wait_exit(&mut child, Duration::from_secs(20))? == 0,
        "exit after SIGHUP"
    );
    drop(stuck);
    // A liveness bound, not a speed floor: with its stderr stuck, a server
    // that blocked on logging would never take the 600 connections.
    ensure!(
        took < Duration::from_secs(120),
        "600 connections took {took:?}: is the server blocked on stderr?"
    );
    Ok(Completion::Completed)
}

fn serve_order() -> TestResult {
    // clap's own mistakes are one line too, with the details on it.
    one_line_error(&["create"], "<IMAGE>")?;
    one_line_error(&["serve", "x.zdisk", "--bogus"], "--bogus")?;
    let scratch = Scratch::new("ops-serve");
    let image = scratch.join("new.zdisk");
    let busy = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = busy.local_addr()?.to_string();
    one_line_error(
        &["serve", image.to_str().unwrap(), "--listen", &addr],
        "cannot listen",
    )?;
    ensure!(!image.exists(), "a busy port left an image behind");
    drop(busy);
    zdisk_ok(&["create", image.to_str().unwrap(), "--logical", "16M"])?;
    for flag in [
        ["--logical", "1G"],
        ["--physical", "1G"],
        ["--segment-size", "1M"],
    ] {
        one_line_error(
            &[
                "serve",
                image.to_str().unwrap(),
                "--listen",
                "127.0.0.1:0",
                flag[0],
                flag[1],
            ],
            "applies only when serve creates the image",
        )?;
    }
    one_line_error(
        &[
            "serve",
            image.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--virtual-time",
        ],
        "emulated drives",
    )?;
    for flag in [
        &["--tier-sync"][..],
        &["--tier-timeout", "5"],
        &["--tier-keep", "0"],
        &["--tier-wait", "5"],
    ] {
        let mut args = vec!["serve", image.to_str().unwrap(), "--listen", "127.0.0.1:0"];
        args.extend_from_slice(flag);
        one_line_error(&args, "apply to tiered volumes")?;
    }
    Ok(Completion::Completed)
}

fn rejected_logged() -> TestResult {
    if let Some(skip) = skip_unless(python_has_libnbd()) {
        return skip;
    }
    let scratch = Scratch::new("ops-reject");
    let image = scratch.join("r.zdisk");
    zdisk_ok(&["create", image.to_str().unwrap(), "--logical", "16M"])?;
    let mut server = Server::start(&image, &scratch.join("s.sock"), &[])?;
    // libnbd checks requests itself unless strict mode is off.
    let script = "import nbd, sys\nh = nbd.NBD()\nh.set_strict_mode(0)\nh.connect_uri(sys.argv[1])\nfails = 0\nfor i in range(20):\n    try:\n        h.pread(4096, h.get_size())\n    except nbd.Error:\n        fails += 1\nassert fails == 20, fails\nh.shutdown()\n";
    python(script, &[&server.uri()])?;
    server.stop()?;
    let log = server.log();
    let logged = log.matches("rejected a request").count();
    ensure!(
        logged == 5,
        "{logged} rejections logged, expected 5:\n{log}"
    );
    ensure!(
        log.contains("past the end of the"),
        "the reason is not logged:\n{log}"
    );
    ensure!(log.contains("counted, not logged"), "no quiet note:\n{log}");
    ensure!(log.contains("(20 rejected)"), "no count at close:\n{log}");
    Ok(Completion::Completed)
}
