//! The object-store tier end to end, on a real one-node Ceph (radosgw's S3
//! gateway) that each test boots from nothing with `support/ceph.sh` and
//! stops by PID. Tests skip, saying why, without root or the Ceph packages.
//!
//! Guards: the test cluster itself (a signed PUT, conditional PUTs
//! honoured, as the tier's single-writer rule needs).

mod support;

use libtest_mimic::{Arguments, Trial};

use support::ceph::Ceph;
use support::*;

fn main() {
    let args = Arguments::from_args();
    let trials = vec![Trial::ignorable_test(
        "one_node_ceph_takes_signed_and_conditional_puts",
        one_node_ceph,
    )];
    libtest_mimic::run(&args, trials).exit();
}

fn one_node_ceph() -> TestResult {
    if let Some(skip) = skip_unless(Ceph::unavailable()) {
        return skip;
    }
    let scratch = Scratch::new("ceph-boot");
    let started = std::time::Instant::now();
    let ceph = Ceph::start(&scratch.join("ceph"))?;
    eprintln!("one-node Ceph booted in {:.1} s", started.elapsed().as_secs_f64());
    ceph.create_bucket("boot")?;
    let body = scratch.join("body");
    std::fs::write(&body, b"hello from zdisk").map_err(|e| e.to_string())?;
    let body = body.to_str().expect("UTF-8 path");
    let put = ceph.curl(&["-T", body, &ceph.url("boot/object")])?;
    ensure!(put == "200", "signed PUT: HTTP {put}");
    let again = ceph.curl(&["-T", body, "-H", "If-None-Match: *", &ceph.url("boot/object")])?;
    ensure!(again == "412", "conditional PUT over an existing object: HTTP {again}");
    let other = ceph.curl(&["-T", body, "-H", "If-None-Match: *", &ceph.url("boot/other")])?;
    ensure!(other == "200", "conditional PUT of a new object: HTTP {other}");
    let mut get = std::process::Command::new("curl");
    get.arg("-sf").args(ceph.curl_auth()).arg(ceph.url("boot/object"));
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
