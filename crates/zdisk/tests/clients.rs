//! End-to-end tests of the real `zdisk` binary with the real clients a user
//! would reach for: qemu-io, nbdcopy, nbdinfo, fio's nbd engine, libnbd
//! from Python, and a kernel ext4 on nbdfuse plus a loop device.
//!
//! Each test starts its own server on a Unix socket in a scratch directory.
//! A test whose prerequisite is missing (a client, root, /dev/fuse) is
//! reported as ignored with the reason; it never passes silently.
//! `.ci/run` installs every prerequisite.

mod support;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Trial};

use support::*;

type TestFn = fn(Medium) -> TestResult;

fn main() {
    let args = Arguments::from_args();
    let tests: Vec<(&str, TestFn)> = vec![
        (
            "qemu_io_patterns_zeroes_discard_and_unaligned_io",
            qemu_io_patterns,
        ),
        ("nbdcopy_round_trips_real_files", nbdcopy_round_trip),
        ("nbdinfo_map_shows_data_zeroes_and_holes", nbdinfo_map),
        ("fio_nbd_engine_random_writes_verify", fio_verify),
        ("kill_9_keeps_every_flushed_block", kill9_recovery),
        (
            "kill_9_with_duplicates_keeps_every_flushed_block",
            kill9_duplicates,
        ),
        ("flush_on_one_connection_covers_another", multi_conn_flush),
        ("ext4_on_nbdfuse_and_loop_survives_fsck", ext4_on_nbdfuse),
        (
            "bad_requests_get_errors_and_connections_survive",
            bad_requests,
        ),
        ("cli_errors_are_one_clear_line", cli_errors),
        (
            "second_server_on_one_image_is_refused",
            second_server_refused,
        ),
        ("sigterm_flushes_and_checkpoints", sigterm_clean_shutdown),
        ("tcp_listener_and_metrics_endpoint", tcp_and_metrics),
        ("empty_1tib_volume_stays_small_in_ram", empty_volume_rss),
    ];
    // The MVP's client tests again, on an emulated NAND drive.
    let on_nand = [
        "qemu_io_patterns_zeroes_discard_and_unaligned_io",
        "nbdcopy_round_trips_real_files",
        "nbdinfo_map_shows_data_zeroes_and_holes",
        "fio_nbd_engine_random_writes_verify",
        "kill_9_keeps_every_flushed_block",
        "flush_on_one_connection_covers_another",
        "ext4_on_nbdfuse_and_loop_survives_fsck",
        "bad_requests_get_errors_and_connections_survive",
        "sigterm_flushes_and_checkpoints",
    ];
    let mut trials = Vec::new();
    for (name, test) in &tests {
        let test = *test;
        trials.push(Trial::ignorable_test(*name, move || test(Medium::File)));
    }
    for (name, test) in &tests {
        if on_nand.contains(name) {
            let test = *test;
            trials.push(Trial::ignorable_test(
                format!("nand_tiny::{name}"),
                move || test(Medium::Nand),
            ));
        }
    }
    libtest_mimic::run(&args, trials).exit();
}

/// Where a test's image lives: a plain file, or an emulated NAND drive
/// (the small `tiny` profile) run in virtual time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Medium {
    File,
    Nand,
}

fn create(m: Medium, image: &std::path::Path, args: &[&str]) -> Result<(), Failed> {
    let mut all = vec!["create", image.to_str().unwrap()];
    all.extend_from_slice(args);
    if m == Medium::Nand {
        all.extend_from_slice(&["--nand", "tiny"]);
    }
    let output = zdisk(&all);
    ensure!(
        output.status.success(),
        "zdisk create failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

/// Starts a server on `image`; an emulated drive runs in virtual time.
fn serve(
    m: Medium,
    image: &std::path::Path,
    socket: &std::path::Path,
    extra: &[&str],
) -> Result<Server, Failed> {
    let mut args = extra.to_vec();
    if m == Medium::Nand {
        args.push("--virtual-time");
    }
    Server::start(image, socket, &args)
}

fn qemu_io(uri: &str, commands: &[&str]) -> Result<String, Failed> {
    let mut args = vec!["-f", "raw", uri];
    for command in commands {
        args.push("-c");
        args.push(command);
    }
    let output = run("qemu-io", &args)?;
    let text = stdout(&output);
    // qemu-io reports pattern mismatches on stdout and still exits 0.
    ensure!(
        !text.contains("Pattern verification failed"),
        "qemu-io: {text}"
    );
    ensure!(
        !text.contains("failed:"),
        "qemu-io reported a failure: {text}"
    );
    Ok(text)
}

fn qemu_io_patterns(m: Medium) -> TestResult {
    if let Some(skip) = skip_unless(require_tools(&["qemu-io"])) {
        return skip;
    }
    let dir = Scratch::new("qemu-io");
    let image = dir.join("qemu.zdisk");
    create(m, &image, &["--logical", "256M", "--physical", "128M"])?;
    let mut server = serve(m, &image, &dir.join("sock"), &[])?;
    let uri = server.uri();
    qemu_io(
        &uri,
        &[
            "write -P 0xab 0 1M",
            "write -P 0xcd 1M 64k",
            "write -z 2M 256k",
            "write -z -u 3M 256k",
            "write -P 0x11 4M 1M",
            "discard 4M 512k",
            // Unaligned, sub-block I/O: 512-byte sectors inside blocks.
            "write -P 0x22 5M 512",
            "write -P 0x33 5243392 1536",
            "write -P 0x44 6291968 4096",
            "flush",
            "read -P 0xab 0 1M",
            "read -P 0xcd 1M 64k",
            "read -P 0 2M 256k",
            "read -P 0 3M 256k",
            "read -P 0 4M 512k",
            "read -P 0x11 4718592 512k",
            "read -P 0x22 5M 512",
            "read -P 0x33 5243392 1536",
            "read -P 0 5244928 2560",
            "read -P 0 6291456 512",
            "read -P 0x44 6291968 4096",
            "read -P 0 6296064 3584",
        ],
    )?;
    // Everything survives a clean restart.
    server.stop()?;
    let server = serve(m, &image, &dir.join("sock"), &[])?;
    qemu_io(
        &server.uri(),
        &[
            "read -P 0xab 0 1M",
            "read -P 0xcd 1M 64k",
            "read -P 0 2M 256k",
            "read -P 0x11 4718592 512k",
            "read -P 0x22 5M 512",
            "read -P 0x33 5243392 1536",
            "read -P 0x44 6291968 4096",
        ],
    )?;
    Ok(Completion::Completed)
}

/// Builds a tar of real files under /usr, `limit_bytes` long.
fn usr_tar(path: &std::path::Path, limit_bytes: u64) -> Result<u64, Failed> {
    let script = format!(
        "tar cf - --one-file-system /usr 2>/dev/null | head -c {limit_bytes} > {}",
        path.display()
    );
    run("sh", &["-c", &script])?;
    let len = std::fs::metadata(path).map_err(|e| e.to_string())?.len();
    ensure!(len > 64 << 20, "only {len} bytes of /usr could be archived");
    Ok(len)
}

fn nbdcopy_round_trip(m: Medium) -> TestResult {
    if let Some(skip) = skip_unless(require_tools(&["nbdcopy", "tar", "cmp", "curl"])) {
        return skip;
    }
    let dir = Scratch::new("nbdcopy");
    let tar = dir.join("usr.tar");
    let len = usr_tar(&tar, 300 << 20)?;
    let image = dir.join("copy.zdisk");
    create(m, &image, &["--logical", "512M", "--physical", "512M"])?;
    let port = free_port();
    let metrics = format!("127.0.0.1:{port}");
    // Full effort: adaptive effort may store much of a fast copy raw
    // until the idle pass, and this checks that real files compress.
    let mut server = serve(
        m,
        &image,
        &dir.join("sock"),
        &["--metrics", &metrics, "--write-effort", "full"],
    )?;
    let started = Instant::now();
    run("nbdcopy", &[tar.to_str().unwrap(), &server.uri()])?;
    let seconds = started.elapsed().as_secs_f64();
    let stats = server.stats()?;
    println!(
        "nbdcopy wrote {len} bytes of /usr in {seconds:.2} s ({:.0} MB/s); compression ratio {}",
        len as f64 / seconds / 1e6,
        stats["compression_ratio"]
    );
    let back = dir.join("back.raw");
    run("nbdcopy", &[&server.uri(), back.to_str().unwrap()])?;
    run(
        "cmp",
        &[
            "-n",
            &len.to_string(),
            tar.to_str().unwrap(),
            back.to_str().unwrap(),
        ],
    )?;
    // The rest of the export reads as zeros.
    let rest = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "tail -c +{} {} | tr -d '\\000' | wc -c",
            len + 1,
            back.display()
        ))
        .output()
        .map_err(|e| e.to_string())?;
    ensure!(
        stdout(&rest).trim() == "0",
        "bytes after the copied data are not zero"
    );
    let ratio = stats["compression_ratio"].as_f64().unwrap_or(0.0);
    ensure!(ratio > 1.2, "real files should compress; ratio {ratio}");
    server.stop()?;
    // Every read a copy (no mapping): the same bytes.
    let mut server = serve(m, &image, &dir.join("sock"), &["--mapped-reads", "off"])?;
    std::fs::remove_file(&back)?;
    run("nbdcopy", &[&server.uri(), back.to_str().unwrap()])?;
    let n = len.to_string();
    run(
        "cmp",
        &["-n", &n, tar.to_str().unwrap(), back.to_str().unwrap()],
    )?;
    server.stop()?;
    Ok(Completion::Completed)
}

fn nbdinfo_map(m: Medium) -> TestResult {
    if let Some(skip) = skip_unless(require_tools(&["nbdinfo", "qemu-io"])) {
        return skip;
    }
    let dir = Scratch::new("map");
    let image = dir.join("map.zdisk");
    create(m, &image, &["--logical", "64M", "--physical", "64M"])?;
    let server = serve(m, &image, &dir.join("sock"), &[])?;
    qemu_io(
        &server.uri(),
        &[
            "write -P 0x61 0 1M",
            "write -z 1M 1M",
            "write -P 0x62 2M 1M",
            "discard 2M 512k",
            "write -P 0 8M 64k",
        ],
    )?;
    let map = stdout(&run("nbdinfo", &["--map", &server.uri()])?);
    println!("{map}");
    let rows: Vec<(u64, u64, String)> = map
        .lines()
        .filter_map(|line| {
            let mut parts = line.split_whitespace();
            let offset = parts.next()?.parse().ok()?;
            let length = parts.next()?.parse().ok()?;
            let _type = parts.next()?;
            Some((offset, length, parts.collect::<Vec<_>>().join(" ")))
        })
        .collect();
    let expected = [
        (0u64, 1u64 << 20, "data"),
        (1 << 20, 1 << 20, "zero"),
        (2 << 20, 512 << 10, "hole,zero"),
        ((2 << 20) + (512 << 10), 512 << 10, "data"),
        (3 << 20, 5 << 20, "hole,zero"),
        // A write of zeros is allocated but takes no space.
        (8 << 20, 64 << 10, "zero"),
        ((8 << 20) + (64 << 10), (56 << 20) - (64 << 10), "hole,zero"),
    ];
    let got: Vec<(u64, u64, &str)> = rows.iter().map(|(o, l, d)| (*o, *l, d.as_str())).collect();
    ensure!(
        got == expected,
        "nbdinfo --map gave {got:?}, expected {expected:?}"
    );
    Ok(Completion::Completed)
}

fn fio_verify(m: Medium) -> TestResult {
    if let Some(skip) = skip_unless(require_tools(&["fio"])) {
        return skip;
    }
    let dir = Scratch::new("fio");
    let image = dir.join("fio.zdisk");
    create(m, &image, &["--logical", "256M", "--physical", "256M"])?;
    let mut server = serve(m, &image, &dir.join("sock"), &[])?;
    let uri = server.uri();
    let output = run(
        "fio",
        &[
            "--name=zdisk-verify",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--numjobs=2",
            "--size=48M",
            "--offset_increment=64M",
            "--verify=crc32c",
            "--verify_state_save=0",
            "--do_verify=1",
            "--verify_fatal=1",
            "--refill_buffers",
            "--output-format=json",
        ],
    )?;
    let text = stdout(&output);
    let json_start = text.find('{').ok_or("fio printed no JSON")?;
    let report: serde_json::Value =
        serde_json::from_str(&text[json_start..]).map_err(|e| format!("fio JSON: {e}"))?;
    let jobs = report["jobs"].as_array().ok_or("no jobs in fio output")?;
    ensure!(jobs.len() == 2, "expected 2 fio jobs, got {}", jobs.len());
    for job in jobs {
        ensure!(job["error"] == 0, "fio job failed: {job}");
        let written = job["write"]["io_bytes"].as_u64().unwrap_or(0);
        let read = job["read"]["io_bytes"].as_u64().unwrap_or(0);
        ensure!(written == 48 << 20, "job wrote {written} bytes");
        ensure!(read == 48 << 20, "job verified {read} bytes");
        println!(
            "fio job {}: {:.0} write IOPS, verified {read} bytes",
            job["jobname"],
            job["write"]["iops"].as_f64().unwrap_or(0.0)
        );
    }
    server.stop()?;
    Ok(Completion::Completed)
}

fn script(name: &str) -> String {
    format!("{}/tests/scripts/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn kill9_recovery(m: Medium) -> TestResult {
    kill9_rounds(m, 3, false)
}

/// Issue #25's crash test: a writer whose blocks repeat (so dedup shares
/// them), overwrites and trims them; every flushed block must survive
/// 30 kills, a record freed while still referenced would show here.
fn kill9_duplicates(m: Medium) -> TestResult {
    kill9_rounds(m, 30, true)
}

fn kill9_rounds(m: Medium, rounds: u64, dup: bool) -> TestResult {
    if let Some(skip) = skip_unless(python_has_libnbd()) {
        return skip;
    }
    let dir = Scratch::new(if dup { "kill9-dup" } else { "kill9" });
    let image = dir.join("crash.zdisk");
    let mut create_args = vec!["--logical", "64M", "--physical", "64M"];
    if dup {
        create_args.extend(["--dedup", "on"]);
    }
    create(m, &image, &create_args)?;
    let blocks = "4096";
    // What each block held after the previous round's recovery (gen per line).
    let baseline = dir.join("baseline");
    let mode: &[&str] = if dup { &["dup"] } else { &[] };
    let mut shared_seen = 0;
    for round in 0..rounds {
        let mut server = serve(m, &image, &dir.join("sock"), &[])?;
        let log_path = dir.join(&format!("writes-{round}.log"));
        let log = std::fs::File::create(&log_path).map_err(|e| e.to_string())?;
        let mut writer = Command::new("/usr/bin/python3")
            .arg(script("crashwriter.py"))
            .args([
                "write",
                &server.uri(),
                blocks,
                &round.to_string(),
                baseline.to_str().unwrap(),
            ])
            .args(mode)
            .stdout(log)
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| e.to_string())?;
        // Let it write through two flushes at least (however slowly a
        // loaded machine starts it), then for a while longer, then pull
        // the plug; with many rounds, for less and less predictable times.
        let started = std::time::Instant::now();
        while flushes_logged(&log_path) < 2 {
            ensure!(
                started.elapsed() < Duration::from_secs(60),
                "the writer completed fewer than 2 flushes in 60 s"
            );
            if let Some(status) = writer.try_wait().map_err(|e| e.to_string())? {
                return Err(format!("the writer exited early: {status}").into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let millis = if rounds > 3 {
            200 + (round * 137) % 600
        } else {
            1500 + 700 * round
        };
        std::thread::sleep(Duration::from_millis(millis));
        let status = server.stop_with("KILL")?;
        ensure!(
            !status.success(),
            "the server should have died from SIGKILL"
        );
        let _ = writer.wait();
        let flushes = flushes_logged(&log_path);
        ensure!(
            flushes >= 2,
            "the writer completed only {flushes} flushes before the kill"
        );
        let server = serve(m, &image, &dir.join("sock"), &[])?;
        ensure!(
            server.log().contains("recovered after an unclean stop"),
            "restart did not report a recovery:\n{}",
            server.log()
        );
        let uri = server.uri();
        let mut verify_args = vec![
            "verify",
            &uri,
            blocks,
            log_path.to_str().unwrap(),
            baseline.to_str().unwrap(),
        ];
        verify_args.extend(mode);
        let verify = python_file("crashwriter.py", &verify_args)?;
        let output = zdisk(&["stats", image.to_str().unwrap(), "--json"]);
        let stats: serde_json::Value = serde_json::from_slice(&output.stdout).map_err(|e| {
            format!(
                "zdisk stats --json: {e}: {}",
                String::from_utf8_lossy(&output.stderr)
            )
        })?;
        shared_seen += stats["shared_blocks"].as_u64().unwrap_or(0);
        println!(
            "round {round}: {flushes} flushes before kill -9; {}; {} blocks shared after recovery",
            stdout(&verify).trim(),
            stats["shared_blocks"]
        );
        drop(server);
        // Dropping kills the verifying server too: the next round recovers again.
    }
    ensure!(
        !dup || shared_seen > 0,
        "no block was ever shared: the writer's duplicates were not found"
    );
    Ok(Completion::Completed)
}

fn python_file(name: &str, args: &[&str]) -> Result<std::process::Output, Failed> {
    let path = script(name);
    let mut all = vec![path.as_str()];
    all.extend_from_slice(args);
    run("/usr/bin/python3", &all)
}

fn multi_conn_flush(m: Medium) -> TestResult {
    if let Some(skip) = skip_unless(python_has_libnbd()) {
        return skip;
    }
    let dir = Scratch::new("multiconn");
    let image = dir.join("mc.zdisk");
    create(m, &image, &["--logical", "16M", "--physical", "16M"])?;
    let mut server = serve(m, &image, &dir.join("sock"), &[])?;
    let mut client = Command::new("/usr/bin/python3")
        .arg(script("crashwriter.py"))
        .args(["multiconn", &server.uri(), "512"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut line = String::new();
    use std::io::BufRead;
    std::io::BufReader::new(client.stdout.take().unwrap())
        .read_line(&mut line)
        .map_err(|e| e.to_string())?;
    ensure!(
        line.trim() == "F",
        "multiconn client did not flush: {line:?}"
    );
    // The flush on the second connection returned: kill before anything else can sync.
    server.stop_with("KILL")?;
    drop(client.stdin.take());
    let _ = client.wait();
    let server = serve(m, &image, &dir.join("sock"), &[])?;
    let check = python_file("crashwriter.py", &["check-gen", &server.uri(), "512", "7"])?;
    println!("{}", stdout(&check).trim());
    Ok(Completion::Completed)
}

/// Unmounts, detaches and unmaps whatever the ext4 test set up, even on failure.
struct FuseLoop {
    fuse_file: std::path::PathBuf,
    loop_device: Option<String>,
    mount_point: std::path::PathBuf,
    mounted: bool,
    nbdfuse: Option<std::process::Child>,
}

impl FuseLoop {
    fn unmount(&mut self) -> Result<(), Failed> {
        if self.mounted {
            run("umount", &[self.mount_point.to_str().unwrap()])?;
            self.mounted = false;
        }
        Ok(())
    }

    fn mount(&mut self) -> Result<(), Failed> {
        let device = self.loop_device.clone().ok_or("no loop device")?;
        run("mount", &[&device, self.mount_point.to_str().unwrap()])?;
        self.mounted = true;
        Ok(())
    }
}

impl Drop for FuseLoop {
    fn drop(&mut self) {
        if self.mounted {
            let _ = Command::new("umount").arg(&self.mount_point).status();
        }
        if let Some(device) = &self.loop_device {
            let _ = Command::new("losetup").args(["-d", device]).status();
        }
        let _ = Command::new("fusermount3")
            .arg("-u")
            .arg(&self.fuse_file)
            .status();
        if let Some(mut child) = self.nbdfuse.take() {
            let _ = child.wait();
        }
    }
}

fn ext4_on_nbdfuse(m: Medium) -> TestResult {
    if let Some(skip) = skip_unless(
        require_tools(&[
            "nbdfuse",
            "losetup",
            "mkfs.ext4",
            "e2fsck",
            "mount",
            "umount",
            "fusermount3",
            "diff",
        ])
        .and_then(|_| require_root_fuse_loop()),
    ) {
        return skip;
    }
    let dir = Scratch::new("ext4");
    let image = dir.join("fs.zdisk");
    create(
        m,
        &image,
        &["--logical", "1G", "--physical", "512M", "--codec", "zstd:1"],
    )?;
    let mut server = serve(
        m,
        &image,
        &dir.join("sock"),
        &["--metrics", &format!("127.0.0.1:{}", free_port())],
    )?;
    let fuse_file = dir.join("disk.raw");
    std::fs::File::create(&fuse_file).map_err(|e| e.to_string())?;
    let mount_point = dir.join("mnt");
    std::fs::create_dir_all(&mount_point).map_err(|e| e.to_string())?;
    let nbdfuse = Command::new("nbdfuse")
        .arg(&fuse_file)
        .arg(server.uri())
        .spawn()
        .map_err(|e| format!("nbdfuse: {e}"))?;
    let mut setup = FuseLoop {
        fuse_file: fuse_file.clone(),
        loop_device: None,
        mount_point: mount_point.clone(),
        mounted: false,
        nbdfuse: Some(nbdfuse),
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::fs::metadata(&fuse_file).map(|m| m.len()).unwrap_or(0) != 1 << 30 {
        ensure!(
            Instant::now() < deadline,
            "nbdfuse did not expose the export"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let device = stdout(&run(
        "losetup",
        &["-f", "--show", fuse_file.to_str().unwrap()],
    )?)
    .trim()
    .to_string();
    setup.loop_device = Some(device.clone());
    run("mkfs.ext4", &["-q", "-F", &device])?;
    setup.mount()?;
    let source = ["/usr/share/doc", "/usr/lib/python3", "/usr/share/perl"]
        .into_iter()
        .find(|p| std::path::Path::new(p).is_dir())
        .ok_or("no directory tree to copy")?;
    run(
        "cp",
        &["-a", source, mount_point.join("tree").to_str().unwrap()],
    )?;
    setup.unmount()?;
    let fsck = run("e2fsck", &["-fn", &device])?;
    println!(
        "{}",
        String::from_utf8_lossy(&fsck.stdout)
            .lines()
            .last()
            .unwrap_or("")
    );
    setup.mount()?;
    run(
        "diff",
        &[
            "-r",
            "--no-dereference",
            source,
            mount_point.join("tree").to_str().unwrap(),
        ],
    )?;
    setup.unmount()?;
    let stats = server.stats()?;
    println!(
        "ext4 with a copy of {source}: {} logical bytes mapped, compression ratio {}",
        stats["mapped_bytes"], stats["compression_ratio"]
    );
    drop(setup);
    server.stop()?;
    Ok(Completion::Completed)
}

fn bad_requests(m: Medium) -> TestResult {
    if let Some(skip) = skip_unless(python_has_libnbd()) {
        return skip;
    }
    let dir = Scratch::new("bad");
    let image = dir.join("bad.zdisk");
    create(m, &image, &["--logical", "64M", "--physical", "64M"])?;
    let mut server = serve(m, &image, &dir.join("sock"), &[])?;
    let output = python_file("bad_requests.py", &[server.socket.to_str().unwrap()])?;
    println!("{}", stdout(&output));
    // The server is still up and serving after all of that.
    server.stop()?;
    Ok(Completion::Completed)
}

fn cli_errors(m: Medium) -> TestResult {
    let dir = Scratch::new("cli");
    let image = dir.join("cli.zdisk");
    let image_str = image.to_str().unwrap();
    one_line_error(&["create", image_str, "--logical", "12Q"], "invalid size")?;
    one_line_error(
        &["create", image_str, "--logical", "1G", "--codec", "brotli"],
        "unknown codec",
    )?;
    one_line_error(
        &["create", image_str, "--logical", "1G", "--codec", "zstd:99"],
        "out of range",
    )?;
    one_line_error(
        &["create", image_str, "--logical", "1000"],
        "multiple of 4096",
    )?;
    one_line_error(
        &["create", image_str, "--logical", "1G", "--physical", "1M"],
        "too small",
    )?;
    one_line_error(
        &["stats", dir.join("missing.zdisk").to_str().unwrap()],
        "does not exist",
    )?;
    std::fs::write(dir.join("junk.zdisk"), vec![7u8; 4 << 20]).map_err(|e| e.to_string())?;
    one_line_error(
        &["stats", dir.join("junk.zdisk").to_str().unwrap()],
        "not a zdisk image",
    )?;
    create(m, &image, &["--logical", "1G", "--physical", "64M"])?;
    one_line_error(&["create", image_str, "--logical", "1G"], "already exists")?;
    one_line_error(
        &["serve", image_str, "--listen", "not-an-address"],
        "invalid --listen",
    )?;
    let output = zdisk(&["stats", image_str, "--json"]);
    ensure!(
        output.status.success(),
        "stats failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stats: serde_json::Value =
        serde_json::from_slice(&output.stdout).map_err(|e| e.to_string())?;
    for key in [
        "logical_size_bytes",
        "physical_size_bytes",
        "mapped_bytes",
        "zero_bytes",
        "stored_bytes",
        "physical_used_bytes",
        "compression_ratio",
        "host_write_bytes",
        "media_write_bytes",
        "padding_bytes",
        "write_amplification",
        "gc_write_bytes",
        "gc_read_bytes",
        "free_segments",
        "segments_cleaned",
    ] {
        ensure!(stats.get(key).is_some(), "stats --json lacks {key}");
    }
    ensure!(
        stats["logical_size_bytes"] == 1u64 << 30,
        "logical size {}",
        stats["logical_size_bytes"]
    );
    Ok(Completion::Completed)
}

fn second_server_refused(m: Medium) -> TestResult {
    let dir = Scratch::new("lock");
    let image = dir.join("lock.zdisk");
    create(m, &image, &["--logical", "64M", "--physical", "64M"])?;
    let mut server = serve(m, &image, &dir.join("sock"), &[])?;
    one_line_error(
        &[
            "serve",
            image.to_str().unwrap(),
            "--socket",
            dir.join("sock2").to_str().unwrap(),
        ],
        "in use by another zdisk process",
    )?;
    // stats is not refused: the server answers it.
    let output = zdisk(&["stats", image.to_str().unwrap()]);
    ensure!(
        output.status.success() && stdout(&output).contains("being served"),
        "stats of a served image: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    server.stop()?;
    let output = zdisk(&["stats", image.to_str().unwrap()]);
    ensure!(
        output.status.success(),
        "stats after the server stopped: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(Completion::Completed)
}

fn sigterm_clean_shutdown(m: Medium) -> TestResult {
    if let Some(skip) = skip_unless(require_tools(&["qemu-io"])) {
        return skip;
    }
    let dir = Scratch::new("sigterm");
    let image = dir.join("term.zdisk");
    create(m, &image, &["--logical", "64M", "--physical", "64M"])?;
    for signal in ["TERM", "INT"] {
        let mut server = serve(m, &image, &dir.join("sock"), &[])?;
        qemu_io(&server.uri(), &["write -P 0x5c 0 2M"])?;
        let status = server.stop_with(signal)?;
        ensure!(
            status.success(),
            "exit status {status} after SIG{signal}:\n{}",
            server.log()
        );
        ensure!(
            server.log().contains("closed cleanly"),
            "no clean close after SIG{signal}:\n{}",
            server.log()
        );
        let server = serve(m, &image, &dir.join("sock"), &[])?;
        ensure!(
            !server.log().contains("recovered"),
            "a clean shutdown must not need recovery:\n{}",
            server.log()
        );
        qemu_io(&server.uri(), &["read -P 0x5c 0 2M"])?;
    }
    Ok(Completion::Completed)
}

fn tcp_and_metrics(m: Medium) -> TestResult {
    if let Some(skip) = skip_unless(require_tools(&["qemu-io", "curl", "nbdinfo"])) {
        return skip;
    }
    let dir = Scratch::new("tcp");
    let image = dir.join("tcp.zdisk");
    create(
        m,
        &image,
        &[
            "--logical",
            "64M",
            "--physical",
            "64M",
            "--codec",
            "deflate:6",
        ],
    )?;
    let port = free_port();
    let metrics_port = free_port();
    let mut child = Command::new(zdisk_bin())
        .args([
            "serve",
            image.to_str().unwrap(),
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--metrics",
            &format!("127.0.0.1:{metrics_port}"),
            "--map-cache",
            "1M",
        ])
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    let uri = format!("nbd://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while run("nbdinfo", &["--size", &uri]).is_err() {
        if Instant::now() > deadline {
            let _ = child.kill();
            return Err("server did not come up on TCP".into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let result = (|| -> Result<(), Failed> {
        qemu_io(&uri, &["write -P 0x41 0 4M", "read -P 0x41 0 4M"])?;
        let metrics = stdout(&run(
            "curl",
            &["-sf", &format!("http://127.0.0.1:{metrics_port}/metrics")],
        )?);
        ensure!(
            metrics.contains("# TYPE zdisk_compression_ratio gauge"),
            "metrics: {metrics}"
        );
        let written = metrics
            .lines()
            .find_map(|l| l.strip_prefix("zdisk_host_write_bytes_total "))
            .ok_or("no host write counter")?;
        ensure!(
            written.trim() == (4u64 << 20).to_string(),
            "host writes {written}"
        );
        let stats = stdout(&run(
            "curl",
            &["-sf", &format!("http://127.0.0.1:{metrics_port}/stats")],
        )?);
        let stats: serde_json::Value = serde_json::from_str(&stats).map_err(|e| e.to_string())?;
        ensure!(stats["codec"] == "deflate:6", "codec {}", stats["codec"]);
        ensure!(
            stats["map_cache_bytes"] == 1 << 20,
            "map cache {}",
            stats["map_cache_bytes"]
        );
        let hits = metrics
            .lines()
            .find_map(|l| l.strip_prefix("zdisk_map_cache_hits_total "))
            .ok_or("no map cache hit counter")?;
        ensure!(
            hits.trim().parse::<u64>().is_ok_and(|hits| hits > 0),
            "map cache hits {hits}"
        );
        Ok(())
    })();
    let _ = Command::new("kill").arg(child.id().to_string()).status();
    let status = child.wait().map_err(|e| e.to_string())?;
    result?;
    ensure!(status.success(), "exit status {status}");
    Ok(Completion::Completed)
}

fn empty_volume_rss(m: Medium) -> TestResult {
    let dir = Scratch::new("rss");
    let image = dir.join("big.zdisk");
    create(m, &image, &["--logical", "1T", "--physical", "2G"])?;
    let mut server = serve(m, &image, &dir.join("sock"), &[])?;
    std::thread::sleep(Duration::from_millis(300));
    let status = std::fs::read_to_string(format!("/proc/{}/status", server.pid()))
        .map_err(|e| e.to_string())?;
    let rss_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .ok_or("no VmRSS")?;
    println!(
        "RSS of a server on an empty 1 TiB volume: {:.1} MiB",
        rss_kib as f64 / 1024.0
    );
    ensure!(rss_kib < 50 * 1024, "RSS {rss_kib} KiB exceeds 50 MiB");
    server.stop()?;
    let _ = std::io::stdout().flush();
    Ok(Completion::Completed)
}
