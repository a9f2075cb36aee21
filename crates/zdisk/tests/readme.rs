//! The README as a newcomer follows it: its first command
//! (`cargo run --release -- serve demo.zdisk`, run by cargo from a scratch
//! folder inside the workspace, so that it builds with the workspace's
//! target dir and breaks if the workspace ever has a second binary), its
//! quick start and its kernel-filesystem recipe run here exactly as written
//! (the blocks marked `<!-- readme-test: NAME -->`), with the `zdisk`
//! under test first on PATH, so that they cannot rot; and the messages a
//! newcomer meets when they slip say what happened, on one line.
//!
//! The snippets use 127.0.0.1:10809 and /tmp paths, as a reader would. As
//! root they run in a network namespace of their own (`unshare --net`),
//! so the port cannot clash; otherwise the quick start needs the port
//! free, and is skipped if it is not. The kernel-filesystem recipe needs
//! root, /dev/fuse and loop devices, and is skipped without them.

mod support;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use libtest_mimic::{Arguments, Trial};

use support::*;

type TestFn = fn() -> TestResult;

fn main() {
    let args = Arguments::from_args();
    let tests: Vec<(&str, TestFn)> = vec![
        ("the_first_command_serves_as_written", first_command),
        ("the_quick_start_runs_as_written", quick_start),
        ("the_snapshot_commands_run_as_written", snapshot_commands),
        ("the_clone_commands_run_as_written", clone_commands),
        (
            "the_kernel_filesystem_recipe_runs_as_written",
            kernel_filesystem,
        ),
        ("a_newcomers_slips_get_clear_messages", slips),
        ("the_readme_synopsis_lists_every_option", synopsis_complete),
    ];
    let trials = tests
        .into_iter()
        .map(|(name, test)| Trial::ignorable_test(name, test))
        .collect();
    libtest_mimic::run(&args, trials).exit();
}

/// The shell block that follows `<!-- readme-test: NAME -->` in the README.
fn snippet(name: &str) -> Result<String, Failed> {
    let readme = include_str!("../../../README.md");
    let marker = format!("<!-- readme-test: {name} -->");
    let after = readme
        .split_once(&marker)
        .ok_or_else(|| format!("README has no {marker}"))?
        .1;
    let body = after
        .trim_start()
        .strip_prefix("```sh\n")
        .ok_or_else(|| format!("{marker} is not followed by a sh block"))?;
    let end = body
        .find("\n```")
        .ok_or_else(|| format!("the block after {marker} does not end"))?;
    Ok(body[..=end].to_string())
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Runs `client` (a shell script) while the README's serve block runs in
/// the background, in `dir`, with the `zdisk` under test on PATH; stops
/// the server with SIGINT (Ctrl-C) and returns the client's output and
/// the server's log.
fn with_readme_server(dir: &Path, client: &str) -> Result<(String, String), Failed> {
    with_server_command(dir, &snippet("serve")?, Duration::from_secs(60), client)
}

/// [`with_readme_server`] with any serve command, given `patience` to
/// start listening (a `cargo run` may have to build first).
fn with_server_command(
    dir: &Path,
    serve: &str,
    patience: Duration,
    client: &str,
) -> Result<(String, String), Failed> {
    // One at a time: the snippets share 127.0.0.1:10809 when not root, and
    // the first command's `cargo run` may rewrite the `zdisk` binary that
    // the others run.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // The driver: serve as written, wait until it listens, run the client
    // as written (stopping at its first failure), then Ctrl-C the server.
    let tenths = patience.as_millis() / 100;
    let driver = format!(
        r#"set -u
[ "$(id -u)" = 0 ] && ip link set lo up
( {serve} ) 2> serve.log &
server=$!
for i in $(seq {tenths}); do grep -q 'listening on' serve.log && break; sleep 0.1; done
grep -q 'listening on' serve.log || {{ echo "zdisk serve did not start"; cat serve.log; exit 1; }}
bash -e -c '{client}'
status=$?
# Ctrl-C: to zdisk, whether the subshell became it or is its parent.
kill -INT "$server" 2> /dev/null; pkill -INT -P "$server" 2> /dev/null; wait "$server"
exit $status
"#,
        client = client.replace('\'', r"'\''"),
    );
    let path = format!(
        "{}:{}",
        zdisk_bin().parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut command = if is_root() {
        let mut command = Command::new("unshare");
        command.args(["--net", "bash", "-c", &driver]);
        command
    } else {
        let mut command = Command::new("bash");
        command.args(["-c", &driver]);
        command
    };
    let output = command
        .current_dir(dir)
        .env("PATH", path)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run bash: {e}"))?;
    let log = std::fs::read_to_string(dir.join("serve.log")).unwrap_or_default();
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    ensure!(
        output.status.success(),
        "the README's snippets failed ({}):\n{out}\nserver log:\n{log}",
        output.status
    );
    Ok((out, log))
}

/// Skips unless the snippets can have 127.0.0.1:10809.
fn port_for_snippets() -> Result<(), String> {
    if is_root() {
        return require_tools(&["unshare", "ip"]);
    }
    std::net::TcpListener::bind("127.0.0.1:10809")
        .map(|_| ())
        .map_err(|e| format!("127.0.0.1:10809 is busy ({e}), and only root gets a private one"))
}

/// The README's opening block: its first line, exactly as written.
fn first_command_line() -> Result<String, Failed> {
    let readme = include_str!("../../../README.md");
    let block = readme
        .split_once("```sh\n")
        .ok_or("README has no sh block")?
        .1;
    let line = block.lines().next().unwrap_or_default();
    let command = line.split_once('#').map_or(line, |(command, _)| command);
    ensure!(
        command.trim() == "cargo run --release -- serve demo.zdisk",
        "the README's first command changed: {line:?}"
    );
    Ok(command.trim().to_string())
}

/// The first command a newcomer types, from a fresh clone: cargo must pick
/// the one binary, build it if needed and serve a default image that
/// `nbdinfo` reads; Ctrl-C stops it cleanly. It runs from a scratch folder
/// under the workspace's `target/`, so cargo finds the workspace above it
/// and reuses its target dir, and `demo.zdisk` lands in the scratch
/// folder, never beside a reader's own.
fn first_command() -> TestResult {
    let ready = require_tools(&["bash", "cargo", "nbdinfo"]).and_then(|()| port_for_snippets());
    if let Some(skip) = skip_unless(ready) {
        return skip;
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| workspace.join("target"));
    let scratch = workspace
        .join("target")
        .join(format!("readme-first-command-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).map_err(|e| format!("{}: {e}", scratch.display()))?;
    // Cargo finds the workspace from the scratch folder; its target dir is
    // the workspace's (or CARGO_TARGET_DIR, which the child inherits).
    let command = format!(
        "CARGO_TARGET_DIR='{}' CARGO_NET_OFFLINE=true {}",
        target.display(),
        first_command_line()?
    );
    let result = with_server_command(
        &scratch,
        &command,
        Duration::from_secs(20 * 60),
        "nbdinfo nbd://127.0.0.1:10809",
    );
    let _ = std::fs::remove_dir_all(&scratch);
    let (out, log) = result?;
    ensure!(
        log.contains("did not exist; created it"),
        "serve created demo.zdisk: {log}"
    );
    ensure!(out.contains("export-size: 8589934592"), "nbdinfo: {out}");
    ensure!(
        log.contains("closed cleanly"),
        "Ctrl-C stopped the server cleanly: {log}"
    );
    Ok(Completion::Completed)
}

fn quick_start() -> TestResult {
    let ready = require_tools(&["bash", "nbdinfo", "nbdcopy", "tar", "/usr/share/doc"])
        .and_then(|()| port_for_snippets());
    if let Some(skip) = skip_unless(ready) {
        return skip;
    }
    let scratch = Scratch::new("readme-quick");
    let (out, log) = with_readme_server(&scratch.path, &snippet("quick-start")?)?;
    ensure!(
        log.contains("did not exist; created it"),
        "serve created demo.zdisk: {log}"
    );
    ensure!(out.contains("export-size: 8589934592"), "nbdinfo: {out}");
    ensure!(
        out.contains("demo.zdisk: being served") && out.contains("savings"),
        "zdisk stats asked the server: {out}"
    );
    ensure!(
        log.contains("closed cleanly"),
        "Ctrl-C stopped the server cleanly: {log}"
    );
    Ok(Completion::Completed)
}

fn snapshot_commands() -> TestResult {
    let ready = require_tools(&["bash", "nbdinfo", "nbdcopy", "tar", "/usr/share/doc"])
        .and_then(|()| port_for_snippets());
    if let Some(skip) = skip_unless(ready) {
        return skip;
    }
    let scratch = Scratch::new("readme-snapshots");
    // After the quick start's writes, the snapshot snippet as written.
    let client = format!("{}\n{}", snippet("quick-start")?, snippet("snapshots")?);
    let (out, log) = with_readme_server(&scratch.path, &client)?;
    ensure!(
        out.contains("took snapshot nightly") && out.contains("export=\"nightly\""),
        "the snapshot was taken and listed: {out}"
    );
    ensure!(
        out.contains("deleted snapshot nightly") && out.contains("compacted demo.zdisk"),
        "delete and compact ran: {out}"
    );
    let copied = std::fs::metadata(scratch.path.join("nightly.img")).map_err(|e| e.to_string())?;
    ensure!(
        copied.len() == 8 << 30,
        "nbdcopy copied the snapshot whole: {} bytes",
        copied.len()
    );
    ensure!(log.contains("closed cleanly"), "{log}");
    Ok(Completion::Completed)
}

fn clone_commands() -> TestResult {
    let ready = require_tools(&[
        "bash",
        "nbdinfo",
        "nbdcopy",
        "tar",
        "/usr/share/doc",
        "/usr/share/man",
    ])
    .and_then(|()| port_for_snippets());
    if let Some(skip) = skip_unless(ready) {
        return skip;
    }
    let scratch = Scratch::new("readme-clones");
    // After the quick start's writes, the clone snippet as written.
    let client = format!("{}\n{}", snippet("quick-start")?, snippet("clones")?);
    let (out, log) = with_readme_server(&scratch.path, &client)?;
    ensure!(
        out.contains("made clone vm1 of snapshot golden")
            && out.contains("export=\"vm1\"")
            && out.contains("export=\"golden\""),
        "the clone was made and listed: {out}"
    );
    // zdisk volumes: vm1's row says it wrote blocks of its own.
    let row = out
        .lines()
        .find(|line| line.starts_with("vm1 ") && line.contains("clone"))
        .ok_or_else(|| format!("zdisk volumes shows no vm1 row: {out}"))?;
    let own: u64 = row
        .split_whitespace()
        .nth(5)
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("vm1's row has no block count: {row}"))?;
    ensure!(own > 1000, "vm1 holds {own} blocks of its own: {row}");
    ensure!(
        out.contains("deleted clone vm1") && out.contains("deleted snapshot golden"),
        "the deletions ran: {out}"
    );
    ensure!(log.contains("closed cleanly"), "{log}");
    Ok(Completion::Completed)
}

fn kernel_filesystem() -> TestResult {
    let ready = require_root_fuse_loop()
        .and_then(|()| {
            require_tools(&[
                "bash",
                "nbdfuse",
                "fusermount3",
                "losetup",
                "mkfs.ext4",
                "mount",
                "umount",
            ])
        })
        .and_then(|()| port_for_snippets())
        .and_then(|()| paths_free_for_recipe());
    if let Some(skip) = skip_unless(ready) {
        return skip;
    }
    let scratch = Scratch::new("readme-kernel");
    let recipe = snippet("kernel-filesystem")?;
    // The recipe, then what a reader would see: a mounted ext4 while it
    // ran (df), and after the teardown no mount, no loop device and no
    // FUSE file left.
    let client = format!(
        "{recipe}wait\n\
         if mountpoint -q /mnt/zdisk; then echo 'still mounted'; exit 1; fi\n\
         if losetup -j /tmp/zdisk.raw | grep -q .; then echo 'loop device left'; exit 1; fi\n\
         if mountpoint -q /tmp/zdisk.raw; then echo 'nbdfuse left'; exit 1; fi\n"
    );
    let (out, log) = with_readme_server(&scratch.path, &client)?;
    ensure!(out.contains("/mnt/zdisk"), "df shows the filesystem: {out}");
    ensure!(log.contains("closed cleanly"), "{log}");
    let _ = std::fs::remove_file("/tmp/zdisk.raw");
    let _ = std::fs::remove_file("/tmp/zdisk.pid");
    Ok(Completion::Completed)
}

/// Skips rather than disturb a reader who is using the recipe's paths.
fn paths_free_for_recipe() -> Result<(), String> {
    for path in ["/mnt/zdisk", "/tmp/zdisk.raw"] {
        let mounted = Command::new("mountpoint")
            .args(["-q", path])
            .status()
            .is_ok_and(|status| status.success());
        if mounted {
            return Err(format!("{path} is mounted: someone is using the recipe"));
        }
    }
    Ok(())
}

/// Runs zdisk in `dir`; returns (exit code, stdout, stderr).
fn zdisk_in(dir: &Path, args: &[&str]) -> (Option<i32>, String, String) {
    let output = Command::new(zdisk_bin())
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run zdisk");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// One line on stderr, exit status 2, containing `expect`.
fn refused(dir: &Path, args: &[&str], expect: &str) -> Result<String, Failed> {
    let (code, _, stderr) = zdisk_in(dir, args);
    ensure!(code == Some(2), "zdisk {args:?} exited {code:?}: {stderr}");
    ensure!(
        stderr.trim_end().lines().count() == 1,
        "zdisk {args:?}: not one line: {stderr}"
    );
    ensure!(stderr.contains(expect), "zdisk {args:?}: {stderr}");
    Ok(stderr)
}

fn slips() -> TestResult {
    let scratch = Scratch::new("readme-slips");
    let dir = &scratch.path;
    // Not an image: say what it is, not that it is corrupt.
    let mut ext4 = vec![0u8; 2 << 20];
    ext4[1080..1082].copy_from_slice(&[0x53, 0xef]);
    std::fs::write(dir.join("disk.img"), &ext4)?;
    let stderr = refused(dir, &["stats", "disk.img"], "is not a zdisk image")?;
    ensure!(
        stderr.contains("ext2/3/4 filesystem") && !stderr.contains("corrupt"),
        "{stderr}"
    );
    // Argument errors: one line.
    refused(
        dir,
        &["create", "x.zdisk", "--logical", "1Q"],
        "invalid size",
    )?;
    refused(dir, &["stats"], "IMAGE")?;
    refused(
        dir,
        &["serve", "x.zdisk", "--idle-compact", "maybe"],
        "neither on nor off",
    )?;
    // An emulated drive smaller than its profile allows is refused.
    refused(
        dir,
        &["create", "sf.zdisk", "--nand", "sf1200", "--physical", "1M"],
        "smaller than the smallest sf1200 drive",
    )?;
    ensure!(
        !dir.join("sf.zdisk").exists(),
        "a refused create left a file"
    );
    // --virtual-time on a plain image, new or existing.
    refused(
        dir,
        &["serve", "new.zdisk", "--virtual-time", "--socket", "s.sock"],
        "--virtual-time applies to emulated drives",
    )?;
    ensure!(!dir.join("new.zdisk").exists(), "serve created an image");
    // A physical size above the logical is noted.
    let (code, stdout, _) = zdisk_in(
        dir,
        &[
            "create",
            "big.zdisk",
            "--logical",
            "64M",
            "--physical",
            "128M",
        ],
    );
    ensure!(code == Some(0), "create failed");
    ensure!(
        stdout.contains("note: the physical size (128 MiB) exceeds the logical size (64 MiB)"),
        "{stdout}"
    );
    // bench checks its output paths before it runs: refused with no
    // result printed (a run of sweep,qd prints a table per scenario).
    for (flag, path, expect) in [
        ("--plot", "chart.txt", "must end in .png or .svg"),
        ("--plot", "missing/chart.png", "is not a directory"),
        ("--json", "missing/out.json", "is not a directory"),
    ] {
        let args = [
            "bench",
            "--profile",
            "tiny",
            "--scenario",
            "sweep,qd",
            flag,
            path,
        ];
        let (code, stdout, stderr) = zdisk_in(dir, &args);
        ensure!(
            code == Some(2),
            "bench {flag} {path} exited {code:?}: {stderr}"
        );
        ensure!(
            stderr.trim_end().lines().count() == 1 && stderr.contains(expect),
            "bench {flag} {path}: not one line naming {expect:?}: {stderr}"
        );
        ensure!(
            stdout.trim().is_empty(),
            "bench {flag} {path} ran before it was refused: {stdout}"
        );
    }
    // An empty export name: no empty -N in the hints.
    let mut server = Server::start(
        &dir.join("big.zdisk"),
        &dir.join("s.sock"),
        &["--export-name", ""],
    )?;
    server.stop()?;
    let log = server.log();
    ensure!(log.contains("nbd-client -unix"), "{log}");
    ensure!(!log.contains("-N  ") && !log.contains("-N /dev"), "{log}");
    Ok(Completion::Completed)
}

/// Every long option `zdisk COMMAND --help` lists appears in the README's
/// synopsis of that command (the lines from `zdisk COMMAND` to the next
/// command's).
fn synopsis_complete() -> TestResult {
    let readme = include_str!("../../../README.md");
    let commands = &readme[readme.find("## Commands").ok_or("no Commands section")?..];
    let block = commands
        .split("```")
        .nth(1)
        .ok_or("no synopsis block under Commands")?;
    for command in ["create", "serve", "stats", "check", "bench"] {
        let mut synopsis = String::new();
        let mut inside = false;
        for line in block.lines() {
            if line.starts_with("zdisk ") {
                inside = line.split_whitespace().nth(1) == Some(command);
            }
            if inside {
                synopsis.push_str(line);
                synopsis.push('\n');
            }
        }
        ensure!(!synopsis.is_empty(), "no synopsis of zdisk {command}");
        let help = zdisk(&[command, "--help"]);
        let help = String::from_utf8_lossy(&help.stdout).into_owned();
        let options: std::collections::BTreeSet<&str> = help
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
            .filter(|word| word.starts_with("--") && word.len() > 2 && *word != "--help")
            .collect();
        ensure!(
            !options.is_empty(),
            "zdisk {command} --help lists no options"
        );
        for option in options {
            ensure!(
                synopsis
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                    .any(|word| word == option),
                "README's synopsis of zdisk {command} lacks {option}"
            );
        }
    }
    Ok(Completion::Completed)
}
