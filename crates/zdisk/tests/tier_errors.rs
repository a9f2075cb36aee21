//! What an operator sees when the bucket cannot be used: `zdisk create
//! --tier`, `create --from` and `serve` of a tiered image must fail with
//! one line naming the cause (and the fix), exit non-zero and leave no
//! partial image, instead of a retry trace half a minute later.
//!
//! Guards, on a port where nothing listens (no Ceph needed): the endpoint
//! refusing connections. On one one-node Ceph (`support/ceph.sh`, shared
//! by every case so it boots once): a missing bucket (and
//! `--create-bucket` making it), a wrong secret and an unknown access key,
//! the gateway stopped (create, `--from` and serve refused, naming it),
//! and `serve --tier-wait` waiting for the gateway to come back and then
//! serving. Times are printed, not asserted.

mod support;

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Trial};

use support::ceph::Ceph;
use support::*;

fn main() {
    let args = Arguments::from_args();
    let trials = vec![
        Trial::test(
            "an_unreachable_endpoint_is_one_line_naming_it",
            unreachable_endpoint,
        ),
        Trial::ignorable_test(
            "ceph_missing_bucket_wrong_secret_and_stopped_gateway_are_named",
            ceph_refusals,
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}

/// Runs `zdisk` with these `AWS_*` settings; returns its output and time.
fn zdisk_with(env: &[(String, String)], args: &[&str]) -> Result<(Output, Duration), Failed> {
    let started = Instant::now();
    let output = Command::new(zdisk_bin())
        .args(args)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .map_err(|e| format!("cannot run zdisk: {e}"))?;
    Ok((output, started.elapsed()))
}

/// Runs `zdisk`, which must fail with one line holding every one of
/// `words`; prints the line and the time it took under `case`.
fn refused(
    case: &str,
    env: &[(String, String)],
    args: &[&str],
    words: &[&str],
) -> Result<String, Failed> {
    let (error, warnings) = refused_after(case, env, args, words)?;
    ensure!(
        warnings.is_empty(),
        "{case}: not one line: {warnings:?} before {error:?}"
    );
    Ok(error)
}

/// Runs `zdisk`, which must fail with an error line holding every one of
/// `words`, after nothing but warnings; returns the error and the warnings.
fn refused_after(
    case: &str,
    env: &[(String, String)],
    args: &[&str],
    words: &[&str],
) -> Result<(String, Vec<String>), Failed> {
    let (output, took) = zdisk_with(env, args)?;
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    eprintln!("{case}: {:.2} s: {}", took.as_secs_f64(), stderr.trim_end());
    ensure!(
        !output.status.success(),
        "{case}: zdisk {args:?} should fail; stderr: {stderr}"
    );
    ensure!(
        !stderr.contains("panicked"),
        "{case}: zdisk {args:?} panicked: {stderr}"
    );
    let mut lines: Vec<String> = stderr.trim_end().lines().map(str::to_string).collect();
    let error = lines.pop().unwrap_or_default();
    ensure!(
        error.starts_with("zdisk: error: "),
        "{case}: the last line is no error: {stderr:?}"
    );
    ensure!(
        lines
            .iter()
            .all(|line| line.starts_with("zdisk: warning: ")),
        "{case}: more than warnings before the error: {stderr:?}"
    );
    for word in words {
        ensure!(
            error.contains(word),
            "{case}: expected {word:?} in {error:?}"
        );
    }
    Ok((error, lines))
}

fn nothing_left(image: &Path) -> Result<(), Failed> {
    let mut tier = image.as_os_str().to_owned();
    tier.push(".tier");
    ensure!(
        !image.exists() && !Path::new(&tier).exists(),
        "a failed create left {} or its .tier file",
        image.display()
    );
    Ok(())
}

fn refs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

fn with(env: &[(String, String)], key: &str, value: &str) -> Vec<(String, String)> {
    let mut env: Vec<_> = env.iter().filter(|(k, _)| k != key).cloned().collect();
    env.push((key.to_string(), value.to_string()));
    env
}

fn unreachable_endpoint() -> Result<(), Failed> {
    let scratch = Scratch::new("tier-errors-unreachable");
    let env: Vec<(String, String)> = [
        ("AWS_ENDPOINT_URL", "http://127.0.0.1:1"),
        ("AWS_ALLOW_HTTP", "true"),
        ("AWS_ACCESS_KEY_ID", "KEY"),
        ("AWS_SECRET_ACCESS_KEY", "SECRET"),
        ("AWS_REGION", "us-east-1"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let image = scratch.join("a.img");
    let image_arg = image.to_str().expect("UTF-8 path");
    refused(
        "create --tier, nothing listening",
        &env,
        &[
            "create",
            image_arg,
            "--logical",
            "64M",
            "--physical",
            "32M",
            "--tier",
            "s3://nob/x",
        ],
        &["s3://nob/x", "refuses connections", "http://127.0.0.1:1"],
    )?;
    nothing_left(&image)?;
    refused(
        "create --from, nothing listening",
        &env,
        &[
            "create",
            image_arg,
            "--physical",
            "32M",
            "--from",
            "s3://nob/x",
        ],
        &["refuses connections", "http://127.0.0.1:1"],
    )?;
    nothing_left(&image)?;
    refused(
        "create --tier, a host that does not resolve",
        &with(&env, "AWS_ENDPOINT_URL", "http://no-such-host.invalid:7480"),
        &[
            "create",
            image_arg,
            "--logical",
            "64M",
            "--physical",
            "32M",
            "--tier",
            "s3://nob/x",
        ],
        &["does not resolve", "AWS_ENDPOINT_URL"],
    )?;
    nothing_left(&image)?;
    Ok(())
}

fn ceph_refusals() -> TestResult {
    if let Some(skip) =
        skip_unless(Ceph::unavailable().and(require_tools(&["nbdinfo"]).map_err(Unmet::from)))
    {
        return skip;
    }
    let scratch = Scratch::new("tier-errors-ceph");
    let ceph = Ceph::start(&scratch.join("ceph"))?;
    ceph.create_bucket("zdisk")?;
    let env = ceph.env.clone();
    let path = |name: &str| scratch.join(name).to_str().expect("UTF-8").to_string();
    let create = |image: &str, url: &str, extra: &[&str]| {
        let mut args = vec![
            "create".to_string(),
            image.to_string(),
            "--logical".into(),
            "64M".into(),
            "--physical".into(),
            "32M".into(),
            "--tier".into(),
            url.to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };

    // The bucket does not exist.
    let missing = path("missing.img");
    let args = create(&missing, "s3://nob/x", &[]);
    refused(
        "create --tier, bucket missing",
        &env,
        &refs(&args),
        &["bucket \"nob\" does not exist", "--create-bucket"],
    )?;
    nothing_left(Path::new(&missing))?;

    // --create-bucket makes it, and takes a bucket that is there.
    let made = path("made.img");
    let (output, took) = zdisk_with(
        &env,
        &refs(&create(&made, "s3://made/x", &["--create-bucket"])),
    )?;
    eprintln!(
        "create --tier --create-bucket: {:.2} s: {}",
        took.as_secs_f64(),
        String::from_utf8_lossy(&output.stderr).trim_end()
    );
    ensure!(
        output.status.success(),
        "create --create-bucket failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let head = ceph.curl(&["-I", &ceph.url("made")])?;
    ensure!(head == "200", "the made bucket: HEAD answered HTTP {head}");
    let again = path("again.img");
    zdisk_with(
        &env,
        &refs(&create(&again, "s3://made/y", &["--create-bucket"])),
    )
    .and_then(|(output, _)| {
        if output.status.success() {
            Ok(())
        } else {
            Err(format!(
                "--create-bucket on a bucket that is there failed: {}",
                String::from_utf8_lossy(&output.stderr)
            )
            .into())
        }
    })?;

    // Refused credentials.
    let wrong = path("wrong.img");
    let wrong_secret = with(&env, "AWS_SECRET_ACCESS_KEY", "not-the-secret");
    refused(
        "create --tier, wrong secret",
        &wrong_secret,
        &refs(&create(&wrong, "s3://zdisk/w", &[])),
        &["SignatureDoesNotMatch", "AWS_SECRET_ACCESS_KEY"],
    )?;
    nothing_left(Path::new(&wrong))?;
    refused(
        "create --tier, unknown access key",
        &with(&env, "AWS_ACCESS_KEY_ID", "NOSUCHKEY"),
        &refs(&create(&wrong, "s3://zdisk/w", &[])),
        &["InvalidAccessKeyId", "AWS_ACCESS_KEY_ID", "NOSUCHKEY"],
    )?;
    nothing_left(Path::new(&wrong))?;
    let socket = path("nbd.sock");
    refused(
        "serve of a tiered image, wrong secret",
        &wrong_secret,
        &["serve", &made, "--socket", &socket],
        &["SignatureDoesNotMatch", "AWS_SECRET_ACCESS_KEY"],
    )?;

    // The gateway stopped.
    ceph.stop_gateway()?;
    let endpoint = ceph.var("AWS_ENDPOINT_URL").to_string();
    let down = path("down.img");
    refused(
        "create --tier, gateway stopped",
        &env,
        &refs(&create(&down, "s3://zdisk/d", &[])),
        &["refuses connections", &endpoint],
    )?;
    nothing_left(Path::new(&down))?;
    refused(
        "create --from, gateway stopped",
        &env,
        &[
            "create",
            &down,
            "--physical",
            "32M",
            "--from",
            "s3://made/x",
        ],
        &["refuses connections", &endpoint],
    )?;
    nothing_left(Path::new(&down))?;
    refused(
        "serve of a tiered image, gateway stopped",
        &env,
        &["serve", &made, "--socket", &socket],
        &["refuses connections", &endpoint, "--tier-wait"],
    )?;
    let (_, warnings) = refused_after(
        "serve --tier-wait 3, gateway stopped",
        &env,
        &["serve", &made, "--socket", &socket, "--tier-wait", "3"],
        &["refuses connections", "waited"],
    )?;
    ensure!(
        !warnings.is_empty()
            && warnings
                .iter()
                .all(|w| w.contains("waiting for the bucket") && w.contains("refuses connections")),
        "serve --tier-wait 3 did not say what it waited for: {warnings:?}"
    );

    // serve --tier-wait comes up once the gateway is back.
    for (key, value) in &env {
        std::env::set_var(key, value);
    }
    let started = Instant::now();
    let (server, restarted) = std::thread::scope(|scope| {
        let restarter = scope.spawn(|| {
            std::thread::sleep(Duration::from_secs(4));
            ceph.start_gateway()
        });
        let server = Server::start(
            Path::new(&made),
            Path::new(&socket),
            &["--tier-wait", "120"],
        );
        (server, restarter.join())
    });
    restarted.map_err(|_| Failed::from("the gateway restarter panicked"))??;
    let mut server = server?;
    eprintln!(
        "serve --tier-wait 120: listening {:.1} s after it started, the gateway restarted after 4 s",
        started.elapsed().as_secs_f64()
    );
    let log = server.log();
    ensure!(
        log.contains("waiting for the bucket") && log.contains("refuses connections"),
        "serve --tier-wait did not say what it waited for: {log}"
    );
    let size = run("nbdinfo", &["--size", &server.uri()])?;
    ensure!(
        stdout(&size).trim() == (64u64 << 20).to_string(),
        "the served size is {}",
        stdout(&size)
    );
    server.stop()?;
    ceph.stop();
    Ok(Completion::Completed)
}
