//! End-to-end tests of space management and damage handling through the
//! real binary: a thin volume filled until ENOSPC and brought back by TRIM,
//! the cleaner keeping a small volume writable under heavy overwrites,
//! flipped bytes in an image surfacing as EIO and in `zdisk check`, a
//! damaged root and log reported lost, an
//! image truncated and extended again that `zdisk check` must not call
//! clean, and an image on a real block device (a loop device).
//!
//! Missing prerequisites are reported as ignored, with the reason.

mod support;

use std::process::Command;

use libtest_mimic::{Arguments, Trial};
use rand::{Rng, RngCore, SeedableRng};

use support::*;

type TestFn = fn() -> TestResult;

fn main() {
    let args = Arguments::from_args();
    let tests: Vec<(&str, TestFn)> = vec![
        ("thin_volume_full_trim_and_write_again", thin_volume_enospc),
        (
            "cleaner_keeps_an_overwritten_volume_writable",
            cleaner_under_overwrites,
        ),
        (
            "flipped_bytes_read_as_eio_and_check_lists_them",
            flipped_bytes,
        ),
        (
            "a_damaged_root_and_log_are_reported_and_never_serve_garbage",
            damaged_root_and_log,
        ),
        ("image_on_a_block_device", block_device),
        (
            "a_truncated_and_extended_image_is_not_clean",
            truncated_image,
        ),
    ];
    let trials = tests
        .into_iter()
        .map(|(name, test)| Trial::ignorable_test(name, test))
        .collect();
    libtest_mimic::run(&args, trials).exit();
}

fn script(name: &str) -> String {
    format!("{}/tests/scripts/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn space_py(args: &[&str]) -> Result<String, Failed> {
    let path = script("space.py");
    let mut all = vec![path.as_str()];
    all.extend_from_slice(args);
    Ok(stdout(&run("/usr/bin/python3", &all)?))
}

fn create(image: &std::path::Path, args: &[&str]) -> Result<(), Failed> {
    let mut all = vec!["create", image.to_str().unwrap()];
    all.extend_from_slice(args);
    let output = zdisk(&all);
    ensure!(
        output.status.success(),
        "zdisk create failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

/// A 64 MiB image of 256 KiB segments in `dir`.
fn small_image(dir: &Scratch, name: &str) -> Result<std::path::PathBuf, Failed> {
    let image = dir.join(name);
    let size = ["--logical", "64M", "--physical", "64M"];
    create(&image, &[&size[..], &["--segment-size", "256K"]].concat())?;
    Ok(image)
}

fn thin_volume_enospc() -> TestResult {
    if let Some(skip) = skip_unless(python_has_libnbd()) {
        return skip;
    }
    let dir = Scratch::new("thin");
    let image = dir.join("thin.zdisk");
    create(&image, &["--logical", "256M", "--physical", "64M"])?;
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut server = Server::start(&image, &dir.join("sock"), &["--metrics", &metrics])?;
    let report = space_py(&["fill", &server.uri()])?;
    print!("{report}");
    let stats = server.stats()?;
    println!(
        "free segments {}, cleaned {}, physical used {}",
        stats["free_segments"], stats["segments_cleaned"], stats["physical_used_bytes"]
    );
    ensure!(
        stats["segments_cleaned"].as_u64().unwrap_or(0) > 0,
        "TRIM should let the cleaner reclaim segments"
    );
    server.stop()?;
    // Everything is still there after a restart.
    let output = zdisk(&["check", image.to_str().unwrap()]);
    ensure!(
        output.status.success(),
        "check after ENOSPC: {}",
        stdout(&output)
    );
    Ok(Completion::Completed)
}

fn cleaner_under_overwrites() -> TestResult {
    if let Some(skip) = skip_unless(require_tools(&["fio", "curl"])) {
        return skip;
    }
    let dir = Scratch::new("overwrite");
    let image = dir.join("gc.zdisk");
    // 48 MiB of live data on 64 MiB: the cleaner must run constantly.
    create(
        &image,
        &[
            "--logical",
            "48M",
            "--physical",
            "64M",
            "--segment-size",
            "256K",
        ],
    )?;
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut server = Server::start(&image, &dir.join("sock"), &["--metrics", &metrics])?;
    // The same job on whichever server `uri` names.
    let fio_on = |uri: &str, extra: &[&str]| -> Result<std::process::Output, Failed> {
        let uri = format!("--uri={uri}");
        let common = [
            "--name=overwrite",
            "--ioengine=nbd",
            &uri,
            "--bs=4k",
            "--iodepth=16",
            "--size=48M",
            "--refill_buffers",
        ];
        run("fio", &[&common[..], extra].concat())
    };
    let uri = server.uri();
    let fio = |extra: &[&str]| fio_on(&uri, extra).map(|_| ());
    // Fill, overwrite four times at random, then a verified pass that
    // ends with a flush.
    fio(&["--rw=write"])?;
    fio(&["--rw=randwrite", "--loops=4", "--randrepeat=0"])?;
    let verified = [
        "--rw=randwrite",
        "--verify=crc32c",
        "--verify_state_save=0",
        "--verify_fatal=1",
        "--end_fsync=1",
    ];
    fio(&[&verified[..], &["--do_verify=1"]].concat())?;
    let stats = server.stats()?;
    let cleaned = stats["segments_cleaned"].as_u64().unwrap_or(0);
    println!(
        "host wrote {} bytes; cleaner: {cleaned} segments, relocated {} bytes; write amplification {}",
        stats["host_write_bytes"], stats["gc_write_bytes"], stats["write_amplification"]
    );
    ensure!(cleaned > 100, "the cleaner cleaned only {cleaned} segments");
    // Reused segments are overwritten in place, so older incarnations'
    // records lie past the new ones. A crash now must replay none of them:
    // after kill -9 and a restart, the flushed pass reads back intact.
    server.stop_with("KILL")?;
    let mut server = Server::start(&image, &dir.join("sock"), &[])?;
    let output = fio_on(
        &server.uri(),
        &[&verified[..], &["--verify_only", "--output-format=json"]].concat(),
    )?;
    // fio's nbd engine prints a line before the JSON.
    let text = stdout(&output);
    let report: serde_json::Value = serde_json::from_str(&text[text.find('{').unwrap_or(0)..])
        .map_err(|e| format!("fio JSON: {e}: {text}"))?;
    let read = report["jobs"][0]["read"]["io_bytes"].as_u64().unwrap_or(0);
    ensure!(read > 0, "fio verified nothing after the restart: {text}");
    println!("after kill -9 and a restart, fio verified {read} bytes");
    server.stop()?;
    let output = zdisk(&["check", image.to_str().unwrap()]);
    ensure!(output.status.success(), "check: {}", stdout(&output));
    Ok(Completion::Completed)
}

fn flipped_bytes() -> TestResult {
    if let Some(skip) = skip_unless(python_has_libnbd()) {
        return skip;
    }
    let dir = Scratch::new("flip");
    let image = small_image(&dir, "flip.zdisk")?;
    let blocks = "8192";
    let mut server = Server::start(&image, &dir.join("sock"), &[])?;
    print!("{}", space_py(&["write-known", &server.uri(), blocks])?);
    server.stop()?;

    // Flip one bit at each of 40 random offsets in the written part of the
    // log (any 512-byte sector past the metadata area holding a non-zero
    // byte: records and checkpoint copies alike). Damage to the newest
    // root as well is the next test's.
    let mut bytes = std::fs::read(&image).map_err(|e| e.to_string())?;
    let written = flip_log_bits(&mut bytes, 40, 0x5eed);
    std::fs::write(&image, &bytes).map_err(|e| e.to_string())?;
    println!("flipped one bit at each of 40 random offsets among {written} written sectors");

    let output = zdisk(&["check", image.to_str().unwrap(), "--json"]);
    let report: serde_json::Value =
        serde_json::from_slice(&output.stdout).map_err(|e| format!("check --json: {e}"))?;
    let damaged: Vec<u64> = report["report"]["damaged_blocks"]
        .as_array()
        .ok_or("no damaged_blocks in the report")?
        .iter()
        .filter_map(|v| v.as_u64())
        .collect();
    println!(
        "zdisk check lists {} damaged blocks: {damaged:?}",
        damaged.len()
    );
    ensure!(
        !damaged.is_empty(),
        "40 flipped bits in written data damaged no block?"
    );
    ensure!(
        output.status.code() == Some(4),
        "check should exit 4 with damage, got {:?}",
        output.status
    );

    let list = damaged
        .iter()
        .map(|b| b.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let mut server = Server::start(&image, &dir.join("sock"), &[])?;
    print!(
        "{}",
        space_py(&["verify-known", &server.uri(), blocks, &list])?
    );
    server.stop()?;

    let output = zdisk(&["check", image.to_str().unwrap(), "--repair"]);
    println!("{}", stdout(&output).trim());
    ensure!(
        output.status.code() == Some(1),
        "repair should exit 1, got {:?}: {}",
        output.status,
        stdout(&output)
    );
    let output = zdisk(&["check", image.to_str().unwrap()]);
    ensure!(
        output.status.success(),
        "check after repair: {}",
        stdout(&output)
    );
    Ok(Completion::Completed)
}

/// The metadata slots (and their staging areas) before segment 0.
const METADATA_BYTES: usize = 1 << 20;

/// Flips one bit at each of `flips` random offsets (from `seed`) in the
/// written part of the log of the image in `bytes`: any 512-byte sector
/// past the metadata area holding a non-zero byte. Returns how many
/// sectors that is.
fn flip_log_bits(bytes: &mut [u8], flips: usize, seed: u64) -> usize {
    let written: Vec<usize> = bytes[METADATA_BYTES..]
        .chunks(512)
        .enumerate()
        .filter(|(_, sector)| sector.iter().any(|&b| b != 0))
        .map(|(index, _)| METADATA_BYTES + index * 512)
        .collect();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    for _ in 0..flips {
        let at = written[rng.gen_range(0..written.len())] + rng.gen_range(0..512);
        bytes[at] ^= 1 << rng.gen_range(0..8);
    }
    written.len()
}

/// The newest root unreadable and records damaged in the log it would
/// have spared recovery from reading: recovery starts from the older root
/// and skips the records it cannot read. A crash's torn writes look the
/// same (a page that never reached the medium between two that did), so
/// `check` cannot call this damage; it must still say what recovery
/// skipped and which root it passed over, and every block it does serve
/// must be the data written or older data, never garbage.
fn damaged_root_and_log() -> TestResult {
    if let Some(skip) = skip_unless(python_has_libnbd()) {
        return skip;
    }
    let dir = Scratch::new("rootlog");
    let image = small_image(&dir, "rootlog.zdisk")?;
    let mut server = Server::start(&image, &dir.join("sock"), &[])?;
    print!("{}", space_py(&["write-known", &server.uri(), "8192"])?);
    server.stop()?;

    let (_, report) = check_json(&image)?;
    let generation = report["open"]["root_generation"]
        .as_u64()
        .ok_or("no root generation in the report")?;
    // Generation g lives in slot g % 2 (512 KiB each); its first sector
    // holds the header.
    let mut bytes = std::fs::read(&image).map_err(|e| e.to_string())?;
    let slot = (generation % 2) as usize * (512 << 10);
    bytes[slot + 100] ^= 0x10;
    let written = flip_log_bits(&mut bytes, 20, 0x0b5e55ed);
    std::fs::write(&image, &bytes).map_err(|e| e.to_string())?;
    println!("damaged root generation {generation} and 20 bytes among {written} log sectors");

    let output = zdisk(&["check", image.to_str().unwrap()]);
    let text = stdout(&output);
    println!("{}", text.trim());
    ensure!(
        text.contains(&format!("metadata: slot {}", generation % 2)),
        "check did not report the damaged root"
    );
    ensure!(
        text.contains("recovery skipped an unreadable record"),
        "check did not report the records recovery skipped"
    );
    // The server stopped cleanly: the replay is blamed on the root.
    ensure!(
        !text.contains("not shut down cleanly")
            && text.contains("recovery started from an older checkpoint"),
        "check gave the wrong reason for the replay"
    );
    let (_, report) = check_json(&image)?;
    let skipped = report["open"]["replay_damage"]
        .as_array()
        .map_or(0, Vec::len);
    ensure!(skipped > 0, "no replay damage in check --json");

    // What is served is what was written, older data or holes; and reads
    // of blocks check calls damaged fail.
    let damaged = report["report"]["damaged_blocks"]
        .as_array()
        .ok_or("no damaged_blocks in the report")?
        .iter()
        .filter_map(|v| v.as_u64())
        .map(|b| b.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let mut server = Server::start(&image, &dir.join("sock"), &[])?;
    print!(
        "{}",
        space_py(&["verify-known-or-zero", &server.uri(), "8192", &damaged])?
    );
    server.stop()?;
    Ok(Completion::Completed)
}

/// `zdisk check --json` on `image`: its exit code and report.
fn check_json(image: &std::path::Path) -> Result<(Option<i32>, serde_json::Value), Failed> {
    let output = zdisk(&["check", image.to_str().unwrap(), "--json"]);
    let report = serde_json::from_slice(&output.stdout).map_err(|e| {
        format!(
            "check --json: {e}: {}",
            String::from_utf8_lossy(&output.stderr)
        )
    })?;
    Ok((output.status.code(), report))
}

/// Issue #9: an image cut short and extended back to its size reads zeros
/// where its tail was. Here the tail held the checkpoint of the clean
/// shutdown, so recovery falls back to an older root and replays what is
/// left of the log: the blocks only the lost checkpoint recorded read as
/// zeros, and no map names them. `zdisk check` must report that and exit
/// 4, not call the image clean.
fn truncated_image() -> TestResult {
    if let Some(skip) = skip_unless(require_tools(&["nbdcopy"])) {
        return skip;
    }
    let dir = Scratch::new("truncate");
    let image = small_image(&dir, "truncate.zdisk")?;
    let size: u64 = 64 << 20;
    // Incompressible, so that it fills the image's first 25 MiB; the
    // checkpoint of the clean shutdown lands after it.
    let data = dir.join("data.bin");
    let mut bytes = vec![0u8; 24 << 20];
    rand::rngs::SmallRng::seed_from_u64(9).fill_bytes(&mut bytes);
    std::fs::write(&data, &bytes).map_err(|e| e.to_string())?;
    let mut server = Server::start(&image, &dir.join("sock"), &[])?;
    run("nbdcopy", &[data.to_str().unwrap(), &server.uri()])?;
    server.stop()?;

    let (code, report) = check_json(&image)?;
    ensure!(
        code == Some(0) && report["clean"] == true,
        "the intact image should check clean: {code:?} {report}"
    );
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&image)
        .map_err(|e| e.to_string())?;
    file.set_len(size / 4).map_err(|e| e.to_string())?;
    file.set_len(size).map_err(|e| e.to_string())?;
    drop(file);
    println!("truncated the image to 16 MiB and extended it back to 64 MiB");

    let (code, report) = check_json(&image)?;
    let lost = report["report"]["lost"].as_array().map_or(0, Vec::len);
    let damaged = report["report"]["damaged_blocks"]
        .as_array()
        .map_or(0, Vec::len);
    println!("zdisk check: exit {code:?}, {lost} lost, {damaged} damaged blocks");
    ensure!(
        report["clean"] == false,
        "a truncated image checked clean: {report}"
    );
    ensure!(
        lost + damaged > 0,
        "check names nothing lost or damaged: {report}"
    );
    ensure!(
        code == Some(4),
        "check should exit 4, got {code:?}: {report}"
    );
    if lost > 0 {
        // Serving it for writing would hide the loss under a new root.
        one_line_error(
            &[
                "serve",
                image.to_str().unwrap(),
                "--socket",
                dir.join("s2").to_str().unwrap(),
            ],
            "--repair",
        )?;
        let (code, _) = check_json(&image)?;
        ensure!(code == Some(4), "a refused serve changed the image");
        // Read-only, it serves what remains.
        let mut server = Server::start(&image, &dir.join("sock"), &["--read-only"])?;
        run("nbdinfo", &["--size", &server.uri()])?;
        server.stop()?;
        // Repair accepts the loss (exit 1); afterwards the image is clean.
        let output = zdisk(&["check", image.to_str().unwrap(), "--repair"]);
        let text = String::from_utf8_lossy(&output.stdout);
        ensure!(
            output.status.code() == Some(1) && text.contains("accepted the loss"),
            "repair: {:?} {text}",
            output.status
        );
        let (code, report) = check_json(&image)?;
        ensure!(code == Some(0), "after repair: {code:?} {report}");
    }
    Ok(Completion::Completed)
}

fn block_device() -> TestResult {
    if let Some(skip) =
        skip_unless(require_tools(&["losetup", "qemu-io"]).and_then(|_| require_root_fuse_loop()))
    {
        return skip;
    }
    let dir = Scratch::new("blockdev");
    let backing = dir.join("backing.raw");
    let file = std::fs::File::create(&backing).map_err(|e| e.to_string())?;
    file.set_len(256 << 20).map_err(|e| e.to_string())?;
    let device = stdout(&run(
        "losetup",
        &["-f", "--show", backing.to_str().unwrap()],
    )?)
    .trim()
    .to_string();
    struct Detach(String);
    impl Drop for Detach {
        fn drop(&mut self) {
            let _ = Command::new("losetup").args(["-d", &self.0]).status();
        }
    }
    let _detach = Detach(device.clone());
    let device_path = std::path::Path::new(&device);
    create(device_path, &["--logical", "1G"])?;
    let output = zdisk(&["stats", &device, "--json"]);
    let stats: serde_json::Value =
        serde_json::from_slice(&output.stdout).map_err(|e| e.to_string())?;
    ensure!(
        stats["physical_size_bytes"] == 256u64 << 20,
        "the physical size should default to the device size, got {}",
        stats["physical_size_bytes"]
    );
    let mut server = Server::start(device_path, &dir.join("sock"), &[])?;
    let uri = server.uri();
    run(
        "qemu-io",
        &["-f", "raw", &uri, "-c", "write -P 0x77 0 8M", "-c", "flush"],
    )?;
    server.stop()?;
    let server = Server::start(device_path, &dir.join("sock"), &[])?;
    let out = stdout(&run(
        "qemu-io",
        &["-f", "raw", &server.uri(), "-c", "read -P 0x77 0 8M"],
    )?);
    ensure!(!out.contains("Pattern verification failed"), "{out}");
    Ok(Completion::Completed)
}
