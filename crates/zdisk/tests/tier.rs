//! The object-store tier end to end, on a real one-node Ceph (radosgw's S3
//! gateway) that each test boots from nothing with `support/ceph.sh` and
//! stops by PID. Tests skip, saying why, without root or the Ceph packages.
//!
//! Guards: the test cluster itself (a signed PUT, conditional PUTs
//! honoured, as the tier's single-writer rule needs); 512 MiB of OS files
//! written over NBD through a 256 MiB local cache into a tiered volume,
//! read back identical, then served again from a new image made `--from`
//! the bucket after the first image is deleted; a second writer refused.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use libtest_mimic::{Arguments, Trial};

use support::ceph::Ceph;
use support::*;

fn main() {
    let args = Arguments::from_args();
    let trials = vec![
        Trial::ignorable_test(
            "one_node_ceph_takes_signed_and_conditional_puts",
            one_node_ceph,
        ),
        Trial::ignorable_test(
            "os_files_through_a_small_cache_come_back_from_the_bucket_on_a_new_image",
            os_files_round_trip,
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}

fn one_node_ceph() -> TestResult {
    if let Some(skip) = skip_unless(Ceph::unavailable()) {
        return skip;
    }
    let scratch = Scratch::new("ceph-boot");
    let started = std::time::Instant::now();
    let ceph = Ceph::start(&scratch.join("ceph"))?;
    eprintln!(
        "one-node Ceph booted in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    ceph.create_bucket("boot")?;
    let body = scratch.join("body");
    std::fs::write(&body, b"hello from zdisk").map_err(|e| e.to_string())?;
    let body = body.to_str().expect("UTF-8 path");
    let put = ceph.curl(&["-T", body, &ceph.url("boot/object")])?;
    ensure!(put == "200", "signed PUT: HTTP {put}");
    let again = ceph.curl(&[
        "-T",
        body,
        "-H",
        "If-None-Match: *",
        &ceph.url("boot/object"),
    ])?;
    ensure!(
        again == "412",
        "conditional PUT over an existing object: HTTP {again}"
    );
    let other = ceph.curl(&[
        "-T",
        body,
        "-H",
        "If-None-Match: *",
        &ceph.url("boot/other"),
    ])?;
    ensure!(
        other == "200",
        "conditional PUT of a new object: HTTP {other}"
    );
    let mut get = std::process::Command::new("curl");
    get.arg("-sf")
        .args(ceph.curl_auth())
        .arg(ceph.url("boot/object"));
    let got = get.output().map_err(|e| e.to_string())?;
    ensure!(
        got.stdout == b"hello from zdisk",
        "GET returned {:?}",
        String::from_utf8_lossy(&got.stdout)
    );
    let unsigned = std::process::Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}"])
        .arg(ceph.url("boot/object"))
        .output()
        .map_err(|e| e.to_string())?;
    ensure!(
        unsigned.stdout == b"403",
        "an unsigned GET must be refused, got HTTP {}",
        String::from_utf8_lossy(&unsigned.stdout)
    );
    ceph.stop();
    Ok(Completion::Completed)
}

/// Runs `zdisk` with the cluster's S3 settings; fails with its stderr.
fn zdisk_s3(ceph: &Ceph, args: &[&str]) -> Result<String, Failed> {
    let output = Command::new(zdisk_bin())
        .args(args)
        .envs(ceph.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .map_err(|e| format!("cannot run zdisk: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "zdisk {args:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        )
        .into());
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// `zdisk serve` with the cluster's S3 settings in its environment.
fn serve_s3(ceph: &Ceph, image: &Path, socket: &Path, metrics: &str) -> Result<Server, Failed> {
    // Server::start inherits this process's environment.
    for (key, value) in &ceph.env {
        std::env::set_var(key, value);
    }
    Server::start(image, socket, &["--metrics", metrics])
}

fn stat(stats: &serde_json::Value, name: &str) -> u64 {
    stats[name].as_u64().unwrap_or(0)
}

fn os_files_round_trip() -> TestResult {
    if let Some(skip) = skip_unless(Ceph::unavailable()) {
        return skip;
    }
    if let Some(skip) = skip_unless(require_tools(&["nbdcopy", "tar", "cmp", "curl"])) {
        return skip;
    }
    let scratch = Scratch::new("tier-os-files");
    let ceph = Ceph::start(&scratch.join("ceph"))?;
    ceph.create_bucket("zdisk")?;
    let url = "s3://zdisk/volumes/usr";

    let tar = scratch.join("usr.tar");
    let script = format!(
        "tar cf - --one-file-system /usr 2>/dev/null | head -c {} > {}",
        512u64 << 20,
        tar.display()
    );
    run("sh", &["-c", &script])?;
    let len = std::fs::metadata(&tar).map_err(|e| e.to_string())?.len();
    ensure!(
        len == 512 << 20,
        "only {len} bytes of /usr could be archived"
    );
    let tar = tar.to_str().expect("UTF-8 path");

    let image = scratch.join("first.zdisk");
    let image_arg = image.to_str().expect("UTF-8 path");
    zdisk_s3(
        &ceph,
        &[
            "create",
            image_arg,
            "--logical",
            "1G",
            "--physical",
            "256M",
            "--tier",
            url,
        ],
    )?;
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut server = serve_s3(&ceph, &image, &scratch.join("sock"), &metrics)?;
    let started = Instant::now();
    run("nbdcopy", &[tar, &server.uri()])?;
    let write_seconds = started.elapsed().as_secs_f64();
    // The bucket catches up, and the cache comes back within its bound
    // (segments are evicted only once they are in the bucket).
    let deadline = Instant::now() + std::time::Duration::from_secs(300);
    loop {
        let stats = server.stats()?;
        if stat(&stats, "tier_lag_bytes") == 0 && stat(&stats, "tier_resident_bytes") <= 256 << 20 {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the tier did not catch up in 300 s: {stats}"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    eprintln!(
        "the bucket caught up {:.1} s after the write began",
        started.elapsed().as_secs_f64()
    );
    let back = scratch.join("back.raw");
    let back_arg = back.to_str().expect("UTF-8 path");
    run("nbdcopy", &[&server.uri(), back_arg])?;
    run("cmp", &["-n", &len.to_string(), tar, back_arg])?;
    let stats = server.stats()?;
    eprintln!(
        "wrote {len} bytes in {write_seconds:.1} s; uploaded {} evicted {} resident {} lag {} fetched {} hits {} misses {} (stored {})",
        stat(&stats, "tier_uploaded_bytes"),
        stat(&stats, "tier_evicted_bytes"),
        stat(&stats, "tier_resident_bytes"),
        stat(&stats, "tier_lag_bytes"),
        stat(&stats, "tier_fetched_bytes"),
        stat(&stats, "tier_cache_hits"),
        stat(&stats, "tier_cache_misses"),
        stat(&stats, "stored_bytes"),
    );
    ensure!(
        stat(&stats, "stored_bytes") > 256 << 20,
        "the data must not fit the cache for this test to mean anything"
    );
    ensure!(
        stat(&stats, "tier_evicted_bytes") > 0,
        "nothing was evicted"
    );
    ensure!(
        stat(&stats, "tier_resident_bytes") <= 256 << 20,
        "the cache holds {} bytes, over its 256 MiB",
        stat(&stats, "tier_resident_bytes")
    );
    ensure!(
        stat(&stats, "tier_cache_misses") > 0,
        "nothing was read from the bucket"
    );
    let prometheus = run("curl", &["-sf", &format!("http://{metrics}/metrics")])?;
    ensure!(
        stdout(&prometheus).contains("zdisk_tier_lag_bytes "),
        "/metrics lacks the tier"
    );
    server.stop()?;
    let allocated = std::fs::metadata(&image)
        .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
        .map_err(|e| e.to_string())?;
    eprintln!("the stopped image takes {allocated} bytes of disk");
    ensure!(
        allocated <= (256 << 20) + (4 << 20),
        "the image takes {allocated} bytes of disk, over its 256 MiB cache"
    );

    // The first machine is gone: a new image from the bucket alone.
    std::fs::remove_file(&image).map_err(|e| e.to_string())?;
    std::fs::remove_file(scratch.join("first.zdisk.tier")).map_err(|e| e.to_string())?;
    std::fs::remove_file(&back).map_err(|e| e.to_string())?;
    let second = scratch.join("second.zdisk");
    let second_arg = second.to_str().expect("UTF-8 path");
    let started = Instant::now();
    zdisk_s3(
        &ceph,
        &["create", second_arg, "--physical", "256M", "--from", url],
    )?;
    eprintln!(
        "restored from the bucket in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut server = serve_s3(&ceph, &second, &scratch.join("sock2"), &metrics)?;
    let started = Instant::now();
    run("nbdcopy", &[&server.uri(), back_arg])?;
    let read_seconds = started.elapsed().as_secs_f64();
    run("cmp", &["-n", &len.to_string(), tar, back_arg])?;
    let stats = server.stats()?;
    eprintln!(
        "read {len} bytes back from the bucket in {read_seconds:.1} s; fetched {}",
        stat(&stats, "tier_fetched_bytes")
    );
    ensure!(
        stat(&stats, "tier_fetched_bytes") > 128 << 20,
        "the data did not come from the bucket"
    );
    server.stop()?;

    // A third machine attaches and writes (its create claims the next
    // root): the second image may no longer write the volume.
    let third = scratch.join("third.zdisk");
    zdisk_s3(
        &ceph,
        &[
            "create",
            third.to_str().expect("UTF-8 path"),
            "--physical",
            "64M",
            "--from",
            url,
        ],
    )?;
    let refused = Command::new(zdisk_bin())
        .args(["serve", second_arg, "--socket"])
        .arg(scratch.join("sock3"))
        .envs(ceph.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .map_err(|e| e.to_string())?;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    ensure!(!refused.status.success(), "a second writer was let in");
    ensure!(
        stderr.contains("another writer"),
        "the refusal does not say why: {stderr}"
    );
    ceph.stop();
    Ok(Completion::Completed)
}
