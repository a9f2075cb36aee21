//! `zdisk stats` on an image while it is served, through the real binary:
//! the server answers through its control socket (no `--metrics` needed),
//! a socket left by `kill -9` is ignored by the client and replaced by the
//! next server, a clean stop removes it, and a user who may not read the
//! image may not ask its server either. The human output leads with the
//! summary a person asks for. `zdisk check` shows progress on a terminal
//! (through `script`, a test of its own) and nowhere else. An idle server gives the dead
//! space of an overwritten copy back (physical use falls to the stored
//! bytes), and keeps it with `--recompress off --idle-compact off`.
//! `serve --write-effort` shows in the stats with the bytes it wrote fast,
//! and is refused with one line where it does not apply.

mod support;

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use libtest_mimic::{Arguments, Trial};

use support::*;

type TestFn = fn() -> TestResult;

fn main() {
    let args = Arguments::from_args();
    let tests: Vec<(&str, TestFn)> = vec![
        ("stats_of_a_served_image_come_from_its_server", served_stats),
        ("check_shows_progress_on_a_terminal_only", check_progress),
        (
            "a_user_who_cannot_read_the_image_cannot_ask_its_server",
            permissions,
        ),
        (
            "an_idle_server_gives_dead_space_back_unless_told_not_to",
            idle_compaction,
        ),
        (
            "write_effort_is_chosen_shown_and_refused_where_it_does_not_apply",
            write_effort,
        ),
    ];
    let trials = tests
        .into_iter()
        .map(|(name, test)| Trial::ignorable_test(name, test))
        .collect();
    libtest_mimic::run(&args, trials).exit();
}

/// Where the server of `image` (in a directory of its own) puts its
/// control socket.
fn control_socket(image: &Path) -> PathBuf {
    let real = std::fs::canonicalize(image).expect("image exists");
    let name = real.file_name().unwrap().to_string_lossy().into_owned();
    real.with_file_name(format!(".{name}.zdisk-control"))
}

fn stats_json(image: &Path) -> Result<serde_json::Value, Failed> {
    let output = run(
        zdisk_bin().to_str().unwrap(),
        &["stats", image.to_str().unwrap(), "--json"],
    )?;
    serde_json::from_slice(&output.stdout).map_err(|e| format!("bad stats JSON: {e}").into())
}

fn stats_text(image: &Path) -> Result<String, Failed> {
    let output = run(
        zdisk_bin().to_str().unwrap(),
        &["stats", image.to_str().unwrap()],
    )?;
    Ok(stdout(&output))
}

fn served_stats() -> TestResult {
    if let Some(skip) = skip_unless(require_tools(&["nbdcopy"])) {
        return skip;
    }
    let scratch = Scratch::new("stats-served");
    let image = scratch.join("vol.zdisk");
    let image_arg = image.to_str().unwrap();
    run(
        zdisk_bin().to_str().unwrap(),
        &["create", image_arg, "--logical", "64M"],
    )?;
    let mut data = pseudo_random(4 << 20, 5);
    data.extend(std::iter::repeat_n(b'z', 4 << 20));
    let source = scratch.join("data.bin");
    std::fs::write(&source, &data)?;

    let mut server = Server::start(&image, &scratch.join("nbd.sock"), &[])?;
    let socket = control_socket(&image);
    ensure!(
        std::fs::symlink_metadata(&socket).is_ok_and(|m| m.file_type().is_socket()),
        "no control socket at {}",
        socket.display()
    );
    run(
        "nbdcopy",
        &["--flush", source.to_str().unwrap(), &server.uri()],
    )?;
    // The image is locked; the answer comes from the server, and is live.
    let live = stats_json(&image)?;
    ensure!(
        live["mapped_bytes"] == 8 << 20,
        "mapped_bytes {} after an 8 MiB copy",
        live["mapped_bytes"]
    );
    ensure!(
        live["stored_bytes"].as_u64().unwrap() < 6 << 20,
        "half of the copy compresses away: {live}"
    );
    let text = stats_text(&image)?;
    let lines: Vec<&str> = text.lines().collect();
    ensure!(
        lines[0].contains("being served"),
        "the header says where the figures come from: {text}"
    );
    for (line, label) in lines[1..6].iter().zip([
        "logical size",
        "data stored",
        "physical used",
        "available",
        "savings",
    ]) {
        ensure!(line.starts_with(label), "expected {label:?} first: {text}");
    }
    // A symbolic link to the image finds the same server.
    let link = scratch.join("link.zdisk");
    std::os::unix::fs::symlink(&image, &link)?;
    ensure!(
        stats_json(&link)?["mapped_bytes"] == 8 << 20,
        "through a link"
    );

    // kill -9 leaves the socket: the client reads the image instead.
    server.stop_with("KILL")?;
    ensure!(socket.exists(), "kill -9 cannot remove the socket");
    let text = stats_text(&image)?;
    ensure!(
        text.lines()
            .next()
            .unwrap_or("")
            .contains("not being served"),
        "after kill -9: {text}"
    );
    ensure!(
        stats_json(&image)?["mapped_bytes"] == 8 << 20,
        "the stale socket's image, read directly"
    );
    // The next server replaces the stale socket; a clean stop removes it.
    let mut server = Server::start(&image, &scratch.join("nbd.sock"), &[])?;
    ensure!(
        server.log().contains("removed a stale control socket"),
        "{}",
        server.log()
    );
    ensure!(
        stats_text(&image)?.contains("being served"),
        "the new server answers"
    );
    server.stop()?;
    ensure!(!socket.exists(), "a clean stop leaves {}", socket.display());

    Ok(Completion::Completed)
}

/// `zdisk check` of an image holding data shows its progress on a
/// terminal (on stderr, then erased), through `script`, and nowhere else.
fn check_progress() -> TestResult {
    if let Some(skip) = skip_unless(require_tools(&["script", "nbdcopy"])) {
        return skip;
    }
    let scratch = Scratch::new("stats-progress");
    let image = scratch.join("vol.zdisk");
    let image_arg = image.to_str().unwrap();
    run(
        zdisk_bin().to_str().unwrap(),
        &["create", image_arg, "--logical", "64M"],
    )?;
    let source = scratch.join("data.bin");
    std::fs::write(&source, pseudo_random(4 << 20, 9))?;
    let mut server = Server::start(&image, &scratch.join("nbd.sock"), &[])?;
    run(
        "nbdcopy",
        &["--flush", source.to_str().unwrap(), &server.uri()],
    )?;
    server.stop()?;
    let command = format!("{} check {image_arg}", zdisk_bin().display());
    let output = run("script", &["-qec", &command, "/dev/null"])?;
    let shown = stdout(&output);
    ensure!(
        shown.contains("verifying: 100%") && shown.contains(": clean"),
        "check on a terminal: {shown:?}"
    );
    let output = run(zdisk_bin().to_str().unwrap(), &["check", image_arg])?;
    ensure!(
        !String::from_utf8_lossy(&output.stderr).contains("verifying"),
        "progress only on a terminal"
    );
    Ok(Completion::Completed)
}

fn permissions() -> TestResult {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip_unless(Err("needs root (to ask as another user)".to_string())).unwrap();
    }
    if let Some(skip) = skip_unless(require_tools(&["setpriv"])) {
        return skip;
    }
    let scratch = Scratch::new("stats-perm");
    std::fs::set_permissions(&scratch.path, std::fs::Permissions::from_mode(0o755))?;
    let image = scratch.join("private.zdisk");
    let image_arg = image.to_str().unwrap();
    run(
        zdisk_bin().to_str().unwrap(),
        &["create", image_arg, "--logical", "64M"],
    )?;
    std::fs::set_permissions(&image, std::fs::Permissions::from_mode(0o600))?;
    let mut server = Server::start(&image, &scratch.join("nbd.sock"), &[])?;
    let as_nobody = |image: &str| {
        std::process::Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(zdisk_bin())
            .args(["stats", image])
            .output()
    };
    let output = as_nobody(image_arg)?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(
        output.status.code() == Some(2),
        "nobody read a private image's stats: {stderr}"
    );
    ensure!(
        stderr.contains("refuses this user") && stderr.trim_end().lines().count() == 1,
        "{stderr}"
    );
    server.stop()?;
    // A readable image's server answers anyone who may read it.
    std::fs::set_permissions(&image, std::fs::Permissions::from_mode(0o644))?;
    let mut server = Server::start(&image, &scratch.join("nbd.sock"), &[])?;
    let output = as_nobody(image_arg)?;
    ensure!(
        output.status.success() && stdout(&output).contains("being served"),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    server.stop()?;
    Ok(Completion::Completed)
}

/// Overwrites 16 MiB of incompressible data once, so that the first copy's
/// segments are dead, and returns the statistics.
fn overwrite_twice(scratch: &Scratch, server: &Server) -> Result<serde_json::Value, Failed> {
    for seed in [1, 2] {
        let source = scratch.join(&format!("data{seed}.bin"));
        std::fs::write(&source, pseudo_random(16 << 20, seed))?;
        run(
            "nbdcopy",
            &["--flush", source.to_str().unwrap(), &server.uri()],
        )?;
    }
    stats_json(&server.image)
}

fn number(stats: &serde_json::Value, key: &str) -> Result<u64, Failed> {
    stats[key]
        .as_u64()
        .ok_or_else(|| format!("no {key} in {stats}").into())
}

fn idle_compaction() -> TestResult {
    if let Some(skip) = skip_unless(require_tools(&["nbdcopy"])) {
        return skip;
    }
    for compact in ["on", "off"] {
        let scratch = Scratch::new("stats-idle");
        let image = scratch.join("idle.zdisk");
        run(
            zdisk_bin().to_str().unwrap(),
            &["create", image.to_str().unwrap(), "--logical", "64M"],
        )?;
        let mut server = Server::start(
            &image,
            &scratch.join("nbd.sock"),
            &["--recompress", "off", "--idle-compact", compact],
        )?;
        let busy = overwrite_twice(&scratch, &server)?;
        ensure!(
            number(&busy, "reclaimable_bytes")? >= 15 << 20,
            "the first copy is dead space: {busy}"
        );
        // The server is idle after 5 s; give the pass time to finish.
        let started = std::time::Instant::now();
        let idle = loop {
            std::thread::sleep(std::time::Duration::from_millis(500));
            let stats = stats_json(&image)?;
            let done = number(&stats, "reclaimable_bytes")? < 1 << 20;
            if done
                || started.elapsed()
                    > std::time::Duration::from_secs(if compact == "on" { 40 } else { 9 })
            {
                break stats;
            }
        };
        let (used, stored, metadata) = (
            number(&idle, "physical_used_bytes")?,
            number(&idle, "stored_bytes")?,
            number(&idle, "metadata_bytes")?,
        );
        println!(
            "--idle-compact {compact}: physical_used {} -> {used} bytes, stored {stored}, reclaimable {} -> {}",
            number(&busy, "physical_used_bytes")?,
            number(&busy, "reclaimable_bytes")?,
            number(&idle, "reclaimable_bytes")?,
        );
        if compact == "on" {
            ensure!(
                used < stored + metadata + (1 << 20),
                "idle, {used} bytes are used for {stored} stored: {idle}"
            );
        } else {
            ensure!(
                number(&idle, "reclaimable_bytes")? >= 15 << 20,
                "--idle-compact off compacted: {idle}"
            );
        }
        server.stop()?;
    }
    Ok(Completion::Completed)
}

fn zdisk_ok(args: &[&str]) -> Result<(), Failed> {
    run(zdisk_bin().to_str().unwrap(), args).map(|_| ())
}

fn write_effort() -> TestResult {
    if let Some(skip) = skip_unless(require_tools(&["nbdcopy"])) {
        return skip;
    }
    let scratch = Scratch::new("stats-effort");
    let image = scratch.join("effort.zdisk");
    let image_arg = image.to_str().unwrap();
    zdisk_ok(&["create", image_arg, "--logical", "64M"])?;
    let source = scratch.join("data.bin");
    std::fs::write(&source, pseudo_random(16 << 20, 3))?;
    let sock = scratch.join("nbd.sock");
    // Serves the image at `effort`, copies `source` in, and returns the
    // stats once the server has stopped.
    let copy_at = |effort: &str| -> Result<serde_json::Value, Failed> {
        let mut server = Server::start(&image, &sock, &["--write-effort", effort])?;
        run(
            "nbdcopy",
            &["--flush", source.to_str().unwrap(), &server.uri()],
        )?;
        let stats = stats_json(&image)?;
        server.stop()?;
        Ok(stats)
    };
    let fast = copy_at("fast")?;
    ensure!(fast["write_effort"] == "fast", "{fast}");
    ensure!(
        number(&fast, "host_write_fast_bytes")? == 16 << 20,
        "{fast}"
    );
    let pending = number(&fast, "recompress_pending_bytes")?;
    let marked = number(&fast, "fast_stored_bytes")?;
    ensure!(marked > 0 && marked <= pending, "{fast}");
    ensure!(fast["recompress_expected_saving_bytes"].is_null(), "{fast}");

    let full = copy_at("full")?;
    ensure!(full["write_effort"] == "full", "{full}");
    ensure!(
        number(&full, "host_write_fast_bytes")? == 16 << 20,
        "full effort wrote nothing fast: {full}"
    );
    // Deferred: other data (the same would be found stored), raw.
    std::fs::write(&source, pseudo_random(16 << 20, 4))?;
    let deferred = copy_at("deferred")?;
    ensure!(deferred["write_effort"] == "deferred", "{deferred}");
    ensure!(
        number(&deferred, "host_write_fast_bytes")? == 32 << 20,
        "{deferred}"
    );
    // Raw and marked: at least the 16 MiB written (less a segment's share
    // for the per-segment estimate, where older dead records share one).
    ensure!(
        number(&deferred, "fast_stored_bytes")? >= 15 << 20,
        "raw, marked: {deferred}"
    );
    // Without the idle pass, adaptive effort is full effort.
    let mut server = Server::start(&image, &sock, &["--recompress", "off"])?;
    let off = stats_json(&image)?;
    server.stop()?;
    ensure!(off["write_effort"] == "full", "{off}");
    ensure!(number(&off, "recompress_pending_bytes")? == 0, "{off}");

    one_line_error(
        &["serve", image_arg, "--write-effort", "hard"],
        "use adaptive, full, fast or deferred",
    )?;
    let nand = scratch.join("nand.zdisk");
    let nand_arg = nand.to_str().unwrap();
    zdisk_ok(&["create", nand_arg, "--nand", "tiny"])?;
    one_line_error(
        &["serve", nand_arg, "--write-effort", "fast"],
        "does not apply to an emulated drive",
    )?;
    Ok(Completion::Completed)
}
