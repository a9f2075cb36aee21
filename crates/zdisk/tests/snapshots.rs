//! Snapshots through the real binary and real clients: taken while the
//! image is served (through its control socket) and while it is not,
//! listed by `zdisk volumes` and by `nbdinfo --list`, read by qemu-io
//! under their own export names while the volume changes beside them,
//! refused writes, deleted, and what deleting and compacting give back.
//! An emulated drive and a malformed name get one clear line each; an
//! image with snapshots is not overwritten by `create --force`. And 30
//! rounds of kill -9 under a writer (repeating contents, overwrites and
//! trims) while snapshots are taken and deleted: every flushed block of
//! the volume survives, every snapshot whose command returned survives
//! and reads as the volume did when it was taken, and `check` is clean.
//! Clones the same way: made while served, written through their own
//! writable exports beside the volume's, snapshotted and cloned in turn,
//! deleted in the order their dependents allow; and 12 rounds of kill -9
//! under a writer on a clone while its snapshots are taken and deleted.

mod support;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Trial};

use support::*;

type TestFn = fn() -> TestResult;

fn main() {
    let args = Arguments::from_args();
    let tests: Vec<(&str, TestFn)> = vec![
        (
            "snapshots_of_a_served_image_are_exports_that_keep_their_data",
            served_snapshots,
        ),
        (
            "snapshots_of_an_image_at_rest_and_what_force_and_compact_do",
            snapshots_at_rest,
        ),
        ("snapshot_errors_are_one_clear_line", snapshot_errors),
        (
            "kill_9_while_snapshots_are_taken_and_deleted_loses_nothing",
            kill9_snapshots,
        ),
        (
            "clones_of_a_served_image_are_writable_exports_of_their_own",
            served_clones,
        ),
        (
            "kill_9_while_a_clone_is_written_and_snapshotted_loses_nothing",
            kill9_clones,
        ),
    ];
    let trials = tests
        .into_iter()
        .map(|(name, test)| Trial::ignorable_test(name, test))
        .collect();
    libtest_mimic::run(&args, trials).exit();
}

fn zdisk_ok(args: &[&str]) -> Result<String, Failed> {
    Ok(stdout(&run(zdisk_bin().to_str().unwrap(), args)?))
}

fn json(args: &[&str]) -> Result<serde_json::Value, Failed> {
    let out = zdisk_ok(args)?;
    serde_json::from_str(&out).map_err(|e| format!("{args:?}: bad JSON ({e}): {out}").into())
}

/// qemu-io on `uri` running `command` (read-only with `-r`); its output.
fn qemu_io(uri: &str, read_only: bool, command: &str) -> Result<std::process::Output, Failed> {
    let mut args = vec!["-f", "raw"];
    if read_only {
        args.push("-r");
    }
    args.extend(["-c", command, uri]);
    std::process::Command::new("qemu-io")
        .args(&args)
        .output()
        .map_err(|e| format!("qemu-io: {e}").into())
}

/// Fails unless `command` succeeds on `uri` without a verification error.
fn qemu_io_ok(uri: &str, read_only: bool, command: &str) -> Result<(), Failed> {
    let output = qemu_io(uri, read_only, command)?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    ensure!(
        output.status.success() && !text.contains("Pattern verification failed"),
        "qemu-io {command:?} on {uri}: {text}"
    );
    Ok(())
}

fn export_uri(socket: &Path, export: &str) -> String {
    format!("nbd+unix:///{export}?socket={}", socket.display())
}

/// A new 256 MiB image in a scratch directory of its own, served on a
/// Unix socket there.
struct Served {
    scratch: Scratch,
    image: std::path::PathBuf,
    socket: std::path::PathBuf,
    server: Server,
}

fn served_image(name: &str) -> Result<Served, Failed> {
    let scratch = Scratch::new(name);
    let image = scratch.join("vol.zdisk");
    let socket = scratch.join("sock");
    zdisk_ok(&["create", image.to_str().unwrap(), "--logical", "256M"])?;
    let server = Server::start(&image, &socket, &[])?;
    Ok(Served {
        scratch,
        image,
        socket,
        server,
    })
}

fn served_snapshots() -> TestResult {
    if let Some(skip) = skip_unless(require_tools(&["qemu-io", "nbdinfo"])) {
        return skip;
    }
    let Served {
        scratch: _scratch,
        image,
        socket,
        mut server,
    } = served_image("snapshots-served")?;
    let image_arg = image.to_str().unwrap();
    let volume = server.uri();
    // 16 MiB of 0xaa, then a snapshot, then 8 MiB of it overwritten with
    // 0xbb, a second snapshot, then 4 MiB trimmed.
    qemu_io_ok(&volume, false, "write -P 0xaa 0 16M")?;
    let said = zdisk_ok(&["snapshot", image_arg, "monday"])?;
    println!("{}", said.trim());
    ensure!(
        said.contains("took snapshot monday") && said.contains("exports it read-only"),
        "zdisk snapshot said: {said}"
    );
    qemu_io_ok(&volume, false, "write -P 0xbb 4M 8M")?;
    zdisk_ok(&["snapshot", image_arg, "tuesday"])?;
    qemu_io_ok(&volume, false, "discard 0 4M")?;

    // Every export is listed; each reads as it was.
    let list = stdout(&run("nbdinfo", &["--list", &volume])?);
    for name in ["monday", "tuesday"] {
        ensure!(
            list.contains(&format!("export=\"{name}\"")) || list.contains(name),
            "nbdinfo --list does not show {name}:\n{list}"
        );
    }
    let monday = export_uri(&socket, "monday");
    let tuesday = export_uri(&socket, "tuesday");
    qemu_io_ok(&monday, true, "read -P 0xaa 0 16M")?;
    qemu_io_ok(&tuesday, true, "read -P 0xaa 0 4M")?;
    qemu_io_ok(&tuesday, true, "read -P 0xbb 4M 8M")?;
    qemu_io_ok(&tuesday, true, "read -P 0xaa 12M 4M")?;
    qemu_io_ok(&volume, true, "read -P 0 0 4M")?;
    qemu_io_ok(&volume, true, "read -P 0xbb 4M 8M")?;
    // A snapshot refuses writes (read-only export).
    let write = qemu_io(&monday, false, "write -P 0xcc 0 4k")?;
    ensure!(
        !write.status.success()
            || String::from_utf8_lossy(&write.stderr).contains("read-only")
            || String::from_utf8_lossy(&write.stdout).contains("read-only")
            || String::from_utf8_lossy(&write.stdout).contains("Operation not permitted"),
        "a write to a snapshot went through: {write:?}"
    );
    qemu_io_ok(&monday, true, "read -P 0xaa 0 4k")?;

    // `zdisk map` of each export says how the blocks it sees are stored:
    // monday's 16 MiB and tuesday's all compressed (a byte pattern), the
    // volume's 12 MiB after the trim.
    for (uri, written) in [
        (&monday, "16 MiB"),
        (&tuesday, "16 MiB"),
        (&volume, "12 MiB"),
    ] {
        let map = zdisk_ok(&["map", uri])?;
        println!("{}", map.lines().next().unwrap_or(""));
        ensure!(
            map.contains(&format!("{written} written (0 B raw, {written} compressed")),
            "zdisk map {uri}:\n{map}"
        );
    }

    // What each keeps: monday the 8 MiB overwritten (it alone sees those),
    // tuesday the 4 MiB trimmed.
    let listed = json(&["volumes", image_arg, "--json"])?;
    println!("{listed}");
    let kept = |i: usize| listed[i]["kept_blocks"].as_u64().unwrap_or(0);
    let frees = |i: usize| listed[i]["frees_blocks"].as_u64().unwrap_or(u64::MAX);
    // Deleting monday would free all it keeps; tuesday's trimmed blocks
    // are monday's view too, so deleting tuesday would hand them down.
    ensure!(
        listed.as_array().map(Vec::len) == Some(2)
            && listed[0]["name"] == "monday"
            && kept(0) == 2048
            && frees(0) == 2048
            && listed[1]["name"] == "tuesday"
            && kept(1) == 1024
            && frees(1) == 0,
        "zdisk volumes --json: {listed}"
    );
    let stats = json(&["stats", image_arg, "--json"])?;
    ensure!(
        stats["snapshots"] == 2 && stats["snapshot_kept_blocks"] == 3072,
        "stats: snapshots {} kept {}",
        stats["snapshots"],
        stats["snapshot_kept_blocks"]
    );
    let human = zdisk_ok(&["volumes", image_arg])?;
    println!("{human}");
    ensure!(
        human.contains("monday") && human.contains("being served"),
        "{human}"
    );

    // Deleting monday frees what only it kept; tuesday reads the same.
    let deleted = json(&["delete", image_arg, "monday", "--json"])?;
    ensure!(
        deleted["freed"] == 2048 && deleted["handed_down"] == 0,
        "delete monday: {deleted}"
    );
    let list = stdout(&run("nbdinfo", &["--list", &volume])?);
    ensure!(
        !list.contains("monday"),
        "nbdinfo --list still shows monday:\n{list}"
    );
    qemu_io_ok(&tuesday, true, "read -P 0xaa 0 4M")?;
    qemu_io_ok(&tuesday, true, "read -P 0xbb 4M 8M")?;
    let gone = qemu_io(&monday, true, "read 0 4k")?;
    ensure!(!gone.status.success(), "a deleted snapshot still reads");

    // A restart keeps tuesday; check finds nothing wrong.
    server.stop()?;
    let report = zdisk_ok(&["check", image_arg])?;
    println!("{}", report.trim());
    let _server = Server::start(&image, &socket, &[])?;
    qemu_io_ok(&tuesday, true, "read -P 0xbb 4M 8M")?;
    qemu_io_ok(&tuesday, true, "read -P 0xaa 12M 4M")?;
    Ok(Completion::Completed)
}

/// Copies `data` onto the export at `uri` from offset 0 with nbdcopy.
fn copy_in(scratch: &Scratch, uri: &str, data: &[u8]) -> Result<(), Failed> {
    let file = scratch.join("in.bin");
    std::fs::write(&file, data).map_err(|e| e.to_string())?;
    run("nbdcopy", &["--", file.to_str().unwrap(), uri])?;
    Ok(())
}

/// The first `len` bytes of the export at `uri`.
fn copy_out(scratch: &Scratch, uri: &str, len: usize) -> Result<Vec<u8>, Failed> {
    let file = scratch.join("out.bin");
    let _ = std::fs::remove_file(&file);
    run("nbdcopy", &["--", uri, file.to_str().unwrap()])?;
    let mut bytes = std::fs::read(&file).map_err(|e| e.to_string())?;
    bytes.truncate(len);
    Ok(bytes)
}

fn snapshots_at_rest() -> TestResult {
    if let Some(skip) = skip_unless(require_tools(&["nbdcopy"])) {
        return skip;
    }
    let scratch = Scratch::new("snapshots-at-rest");
    let image = scratch.join("vol.zdisk");
    let image_arg = image.to_str().unwrap();
    let socket = scratch.join("sock");
    zdisk_ok(&["create", image_arg, "--logical", "32M"])?;
    // Incompressible data, so that what it takes on the medium shows.
    let first = pseudo_random(8 << 20, 11);
    let second = pseudo_random(8 << 20, 12);
    {
        let mut server = Server::start(&image, &socket, &[])?;
        copy_in(&scratch, &server.uri(), &first)?;
        server.stop()?;
    }
    let said = zdisk_ok(&["snapshot", image_arg, "base"])?;
    ensure!(said.contains("will export it"), "{said}");
    let forced = zdisk(&["create", image_arg, "--logical", "64M", "--force"]);
    let message = String::from_utf8_lossy(&forced.stderr);
    ensure!(
        !forced.status.success() && message.contains("snapshot") && message.lines().count() == 1,
        "create --force over an image with snapshots: {message}"
    );
    {
        let mut server = Server::start(&image, &socket, &[])?;
        copy_in(&scratch, &server.uri(), &second)?;
        let base = copy_out(&scratch, &export_uri(&socket, "base"), first.len())?;
        ensure!(base == first, "snapshot base does not read as it was taken");
        let now = copy_out(&scratch, &server.uri(), second.len())?;
        ensure!(now == second, "the volume does not read as written");
        server.stop()?;
    }
    let listed = json(&["volumes", image_arg, "--json"])?;
    ensure!(listed[0]["kept_blocks"] == 2048, "{listed}");
    let before = json(&["stats", image_arg, "--json"])?;
    json(&["delete", image_arg, "base", "--json"])?;
    let compacted = json(&["compact", image_arg, "--json"])?;
    let after = json(&["stats", image_arg, "--json"])?;
    println!(
        "stored {} -> {}, medium in use {} -> {} ({compacted})",
        before["stored_bytes"],
        after["stored_bytes"],
        before["physical_used_bytes"],
        after["physical_used_bytes"]
    );
    let stored = |v: &serde_json::Value| v["stored_bytes"].as_u64().unwrap_or(0);
    let used = |v: &serde_json::Value| v["physical_used_bytes"].as_u64().unwrap_or(0);
    ensure!(
        stored(&after) < stored(&before) * 6 / 10,
        "deleting the snapshot did not free its 8 MiB"
    );
    ensure!(
        used(&after) < used(&before) * 6 / 10,
        "compact gave the medium back too little: {compacted}"
    );
    let forced = zdisk(&["create", image_arg, "--logical", "64M", "--force"]);
    ensure!(
        forced.status.success(),
        "create --force once the snapshots are gone: {}",
        String::from_utf8_lossy(&forced.stderr)
    );
    Ok(Completion::Completed)
}

fn snapshot_errors() -> TestResult {
    let scratch = Scratch::new("snapshot-errors");
    let image = scratch.join("vol.zdisk");
    let image_arg = image.to_str().unwrap();
    zdisk_ok(&["create", image_arg, "--logical", "64M"])?;
    one_line_error(&["snapshot", image_arg, "a b"], "letters, digits")?;
    one_line_error(&["snapshot", image_arg, "-x"], "")?;
    one_line_error(
        &["delete", image_arg, "nope"],
        "no snapshot or clone named \"nope\"",
    )?;
    zdisk_ok(&["snapshot", image_arg, "once"])?;
    one_line_error(&["snapshot", image_arg, "once"], "exists already")?;
    let nand = scratch.join("nand.zdisk");
    let nand_arg = nand.to_str().unwrap();
    zdisk_ok(&["create", nand_arg, "--nand", "tiny"])?;
    one_line_error(&["snapshot", nand_arg, "x"], "emulated drive")?;
    one_line_error(&["clone", nand_arg, "x", "y"], "emulated drive")?;
    let missing = scratch.join("missing.zdisk");
    one_line_error(&["volumes", missing.to_str().unwrap()], "does not exist")?;
    Ok(Completion::Completed)
}

fn crashwriter() -> String {
    format!(
        "{}/tests/scripts/crashwriter.py",
        env!("CARGO_MANIFEST_DIR")
    )
}

fn served_clones() -> TestResult {
    if let Some(skip) = skip_unless(require_tools(&["qemu-io", "nbdinfo"])) {
        return skip;
    }
    let Served {
        scratch: _scratch,
        image,
        socket,
        mut server,
    } = served_image("clones-served")?;
    let image_arg = image.to_str().unwrap();
    let volume = server.uri();
    // A golden image: 16 MiB of 0xaa; a snapshot of it, and a clone.
    qemu_io_ok(&volume, false, "write -P 0xaa 0 16M")?;
    zdisk_ok(&["snapshot", image_arg, "golden"])?;
    let said = zdisk_ok(&["clone", image_arg, "golden", "vm1"])?;
    println!("{}", said.trim());
    ensure!(
        said.contains("made clone vm1 of snapshot golden") && said.contains("exports it writable"),
        "zdisk clone said: {said}"
    );
    let list = stdout(&run("nbdinfo", &["--list", "--json", &volume])?);
    let exports: serde_json::Value =
        serde_json::from_str(&list).map_err(|e| format!("nbdinfo --list --json: {e}: {list}"))?;
    let vm1_listed = exports["exports"]
        .as_array()
        .and_then(|all| all.iter().find(|e| e["export-name"] == "vm1"))
        .cloned()
        .ok_or_else(|| format!("nbdinfo --list does not show vm1:\n{list}"))?;
    ensure!(
        vm1_listed["is_read_only"] == false,
        "vm1 is not writable: {vm1_listed}"
    );
    let vm1 = export_uri(&socket, "vm1");
    // The clone reads as the snapshot; what it writes is its own.
    qemu_io_ok(&vm1, true, "read -P 0xaa 0 16M")?;
    qemu_io_ok(&vm1, false, "write -P 0xbb 4M 4M")?;
    qemu_io_ok(&vm1, false, "discard 8M 4M")?;
    qemu_io_ok(&vm1, true, "read -P 0xaa 0 4M")?;
    qemu_io_ok(&vm1, true, "read -P 0xbb 4M 4M")?;
    qemu_io_ok(&vm1, true, "read -P 0 8M 4M")?;
    qemu_io_ok(&vm1, true, "read -P 0xaa 12M 4M")?;
    qemu_io_ok(&volume, true, "read -P 0xaa 0 16M")?;
    // `zdisk map` of the clone: 12 MiB of data it sees (its own 4 MiB and
    // the snapshot's 8 MiB), all compressed; its zeros are not data.
    let map = zdisk_ok(&["map", &vm1])?;
    println!("{}", map.lines().next().unwrap_or(""));
    ensure!(
        map.contains("12 MiB written (0 B raw, 12 MiB compressed"),
        "zdisk map {vm1}:\n{map}"
    );
    // The volume moves on; neither the snapshot nor the clone sees it.
    qemu_io_ok(&volume, false, "write -P 0xcc 0 16M")?;
    qemu_io_ok(&export_uri(&socket, "golden"), true, "read -P 0xaa 0 16M")?;
    qemu_io_ok(&vm1, true, "read -P 0xaa 12M 4M")?;
    // A snapshot of the clone, and a clone of that.
    zdisk_ok(&["snapshot", image_arg, "vm1-base", "--of", "vm1"])?;
    zdisk_ok(&["clone", image_arg, "vm1-base", "vm2"])?;
    let vm2 = export_uri(&socket, "vm2");
    qemu_io_ok(&vm1, false, "write -P 0xdd 0 4M")?;
    qemu_io_ok(&vm2, true, "read -P 0xaa 0 4M")?;
    qemu_io_ok(&vm2, true, "read -P 0xbb 4M 4M")?;
    qemu_io_ok(&vm2, false, "write -P 0xee 12M 4M")?;
    qemu_io_ok(&vm1, true, "read -P 0xaa 12M 4M")?;
    // What each holds, and what the stats say.
    let listed = json(&["volumes", image_arg, "--json"])?;
    println!("{listed}");
    let entry = |name: &str| {
        listed
            .as_array()
            .and_then(|all| all.iter().find(|e| e["name"] == name))
            .cloned()
            .unwrap_or_default()
    };
    // vm1 wrote 1024 blocks of 0xbb and trimmed 1024 (zeros of its own),
    // then 1024 of 0xdd over the snapshot's blocks.
    ensure!(
        entry("vm1")["kind"] == "clone"
            && entry("vm1")["own_blocks"] == 3072
            && entry("vm1")["own_zero_blocks"] == 1024
            && entry("vm2")["own_blocks"] == 1024
            && entry("vm1-base")["of"] == "vm1"
            && entry("vm2")["snapshot"] == "vm1-base"
            // vm1 sees 12 MiB of data: 8 MiB its own, 4 MiB golden's;
            // vm2 12 MiB: 4 MiB its own, 8 MiB vm1-base's.
            && entry("vm1")["mapped_blocks"] == 3072
            && entry("vm1")["shared_blocks"] == 1024
            && entry("vm2")["mapped_blocks"] == 3072
            && entry("vm2")["shared_blocks"] == 2048,
        "zdisk volumes --json: {listed}"
    );
    let stats = json(&["stats", image_arg, "--json"])?;
    ensure!(
        stats["clones"] == 2
            && stats["clone_blocks"] == 4096
            && stats["clone_volumes"][0]["name"] == "vm1"
            && stats["clone_volumes"][0]["own_blocks"] == 3072
            && stats["clone_volumes"][1]["own_blocks"] == 1024,
        "stats: clones {} clone_blocks {} per clone {}",
        stats["clones"],
        stats["clone_blocks"],
        stats["clone_volumes"]
    );
    // Deleting goes in the order dependents allow, each refusal one line.
    one_line_error(&["delete", image_arg, "golden"], "has clones")?;
    one_line_error(&["delete", image_arg, "vm1"], "has snapshots")?;
    one_line_error(&["delete", image_arg, "nope"], "no snapshot or clone named")?;
    one_line_error(&["clone", image_arg, "nope", "vm3"], "no snapshot named")?;
    one_line_error(&["clone", image_arg, "golden", "vm1"], "exists already")?;
    let deleted = json(&["delete", image_arg, "vm2", "--json"])?;
    ensure!(
        deleted["kind"] == "clone" && deleted["freed"] == 1024,
        "delete vm2: {deleted}"
    );
    zdisk_ok(&["delete", image_arg, "vm1-base"])?;
    zdisk_ok(&["delete", image_arg, "vm1"])?;
    let list = stdout(&run("nbdinfo", &["--list", &volume])?);
    ensure!(
        !list.contains("vm1"),
        "nbdinfo --list still shows vm1:\n{list}"
    );
    zdisk_ok(&["delete", image_arg, "golden"])?;
    zdisk_ok(&["compact", image_arg])?;
    let stats = json(&["stats", image_arg, "--json"])?;
    ensure!(
        stats["clones"] == 0 && stats["clone_blocks"] == 0 && stats["snapshots"] == 0,
        "after deleting: {stats}"
    );
    qemu_io_ok(&volume, true, "read -P 0xcc 0 16M")?;
    server.stop()?;
    let report = zdisk(&["check", image_arg]);
    ensure!(
        report.status.success(),
        "check: {}{}",
        String::from_utf8_lossy(&report.stdout),
        String::from_utf8_lossy(&report.stderr)
    );
    Ok(Completion::Completed)
}

/// A snapshot the test took: what the writer had logged when the
/// command returned (nothing logged later may be in it), and the values
/// blocks held when the writer's round began.
struct Taken {
    name: String,
    log_prefix: std::path::PathBuf,
    baseline: std::path::PathBuf,
}

/// The crash writer's verifier on `snapshot`'s export: every block holds
/// a value its log prefix allows.
fn verify_snapshot(
    socket: &Path,
    blocks: &str,
    snapshot: &Taken,
    when: &str,
) -> Result<(), Failed> {
    let uri = export_uri(socket, &snapshot.name);
    let output = Command::new("/usr/bin/python3")
        .arg(crashwriter())
        .args([
            "verify",
            &uri,
            blocks,
            snapshot.log_prefix.to_str().unwrap(),
            snapshot.baseline.to_str().unwrap(),
            "dup",
        ])
        .output()
        .map_err(|e| e.to_string())?;
    ensure!(
        output.status.success(),
        "{when}: snapshot {} does not read as taken: {}{}",
        snapshot.name,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

fn kill9_snapshots() -> TestResult {
    kill9_rounds("snapshots-kill9", 30, None)
}

/// The same with a clone: the writer writes a clone of a snapshot of the
/// volume (which holds data of its own), the snapshots are the clone's.
fn kill9_clones() -> TestResult {
    kill9_rounds("clones-kill9", 12, Some("vm"))
}

/// `rounds` rounds of kill -9 under the crash writer, on the volume or on
/// clone `clone`, while snapshots of it are taken and deleted.
fn kill9_rounds(scratch_name: &str, rounds: u64, clone: Option<&str>) -> TestResult {
    if let Some(skip) = skip_unless(python_has_libnbd()) {
        return skip;
    }
    let scratch = Scratch::new(scratch_name);
    let image = scratch.join("crash.zdisk");
    let image_arg = image.to_str().unwrap();
    let socket = scratch.join("sock");
    zdisk_ok(&["create", image_arg, "--logical", "64M", "--physical", "64M"])?;
    let blocks = "4096";
    let baseline = scratch.join("baseline");
    if let Some(clone) = clone {
        // The volume's blocks beyond the writer's (it writes the first
        // 16 MiB) are the clone's too, and stay as they were.
        let mut server = Server::start(&image, &socket, &[])?;
        qemu_io_ok(&server.uri(), false, "write -P 0x5c 16M 8M")?;
        zdisk_ok(&["snapshot", image_arg, "golden"])?;
        zdisk_ok(&["clone", image_arg, "golden", clone])?;
        qemu_io_ok(&server.uri(), false, "write -P 0x7d 16M 8M")?;
        server.stop()?;
    }
    let mut taken: Vec<Taken> = Vec::new();
    let mut verified = 0;
    for round in 0..rounds {
        let mut server = Server::start(&image, &socket, &[])?;
        let target = match clone {
            Some(clone) => export_uri(&socket, clone),
            None => server.uri(),
        };
        if let Some(clone) = clone {
            qemu_io_ok(&target, true, "read -P 0x5c 16M 8M")
                .map_err(|e| format!("round {round}: clone {clone}: {e:?}"))?;
            qemu_io_ok(&server.uri(), true, "read -P 0x7d 16M 8M")?;
        }
        if round > 0 {
            ensure!(
                server.log().contains("recovered after an unclean stop"),
                "round {round}: restart did not report a recovery:\n{}",
                server.log()
            );
        }
        // The snapshot of the round the kill ended reads as it was taken
        // (each is read once after a crash here, and all at the end).
        for snapshot in taken
            .iter()
            .filter(|t| t.name == format!("r{}", round.wrapping_sub(1)))
        {
            verify_snapshot(&socket, blocks, snapshot, &format!("round {round}"))?;
            verified += 1;
        }
        // The volume as the previous round's writer left it.
        if round > 0 {
            let log = scratch.join(&format!("writes-{}.log", round - 1));
            let output = Command::new("/usr/bin/python3")
                .arg(crashwriter())
                .args([
                    "verify",
                    &target,
                    blocks,
                    log.to_str().unwrap(),
                    baseline.to_str().unwrap(),
                    "dup",
                ])
                .output()
                .map_err(|e| e.to_string())?;
            ensure!(
                output.status.success(),
                "round {round}: the volume lost flushed blocks: {}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let round_baseline = scratch.join(&format!("baseline-{round}"));
        if baseline.exists() {
            std::fs::copy(&baseline, &round_baseline).map_err(|e| e.to_string())?;
        }
        let log_path = scratch.join(&format!("writes-{round}.log"));
        let log = std::fs::File::create(&log_path).map_err(|e| e.to_string())?;
        let mut writer = Command::new("/usr/bin/python3")
            .arg(crashwriter())
            .args([
                "write",
                &target,
                blocks,
                &round.to_string(),
                baseline.to_str().unwrap(),
                "dup",
            ])
            .stdout(log)
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| e.to_string())?;
        let started = Instant::now();
        while flushes_logged(&log_path) < 2 {
            ensure!(
                started.elapsed() < Duration::from_secs(60),
                "round {round}: the writer completed fewer than 2 flushes in 60 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // A snapshot while it writes; every third round one is deleted.
        // What it must hold: the values as of the last flush logged before
        // the command was issued; what it may hold besides: any write
        // logged before the command returned (the writer logs a write
        // before issuing it). Flushes logged after it was issued say
        // nothing about it, so they are left out of its log.
        let name = format!("r{round}");
        let before = std::fs::read(&log_path).map_err(|e| e.to_string())?;
        match clone {
            Some(clone) => zdisk_ok(&["snapshot", image_arg, &name, "--of", clone])?,
            None => zdisk_ok(&["snapshot", image_arg, &name])?,
        };
        let after = std::fs::read(&log_path).map_err(|e| e.to_string())?;
        let whole_lines = |bytes: &[u8]| {
            let end = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
            String::from_utf8_lossy(&bytes[..end]).into_owned()
        };
        let issued = whole_lines(&before);
        let mut prefix_text = issued.clone();
        for line in whole_lines(&after)[issued.len()..].lines() {
            if line.starts_with('W') {
                prefix_text.push_str(line);
                prefix_text.push('\n');
            }
        }
        let prefix = scratch.join(&format!("prefix-{round}"));
        std::fs::write(&prefix, prefix_text).map_err(|e| e.to_string())?;
        let snapshot_baseline = scratch.join(&format!("snapshot-baseline-{round}"));
        if round_baseline.exists() {
            std::fs::copy(&round_baseline, &snapshot_baseline).map_err(|e| e.to_string())?;
        }
        taken.push(Taken {
            name,
            log_prefix: prefix,
            baseline: snapshot_baseline,
        });
        if round % 3 == 2 && taken.len() > 2 {
            let gone = taken.remove(round as usize % (taken.len() - 1));
            zdisk_ok(&["delete", image_arg, &gone.name])?;
        }
        std::thread::sleep(Duration::from_millis(100 + (round * 137) % 400));
        let status = server.stop_with("KILL")?;
        ensure!(
            !status.success(),
            "the server should have died from SIGKILL"
        );
        let _ = writer.wait();
        println!(
            "round {round}: {} flushes before kill -9, {} snapshots",
            flushes_logged(&log_path),
            taken.len()
        );
    }
    // The last round's writes, every snapshot left, then a clean stop and
    // a check.
    let mut server = Server::start(&image, &socket, &[])?;
    for snapshot in &taken {
        verify_snapshot(&socket, blocks, snapshot, "at the end")?;
        verified += 1;
    }
    let listed = json(&["volumes", image_arg, "--json"])?;
    let of = clone.map_or(serde_json::Value::Null, |c| c.into());
    let names: Vec<&str> = listed
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|s| s["kind"] == "snapshot" && s["of"] == of)
                .filter_map(|s| s["name"].as_str())
                .collect()
        })
        .unwrap_or_default();
    let want: Vec<&str> = taken.iter().map(|t| t.name.as_str()).collect();
    ensure!(names == want, "snapshots {names:?}, expected {want:?}");
    server.stop()?;
    let report = zdisk(&["check", image_arg]);
    ensure!(
        report.status.success(),
        "check after the rounds: {}{}",
        String::from_utf8_lossy(&report.stdout),
        String::from_utf8_lossy(&report.stderr)
    );
    println!("{verified} snapshot verifications, check clean");
    Ok(Completion::Completed)
}
