//! Shared plumbing for the integration tests: starting the real `zdisk`
//! binary, running real clients, and turning a missing prerequisite into a
//! reported skip instead of a silent pass (under `CI=true`, a failure:
//! see [`skip_unless`]).

#![allow(dead_code)]

pub mod ceph;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub use libtest_mimic::{Completion, Failed};

pub type TestResult = Result<Completion, Failed>;

/// Fails the current test with a message.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $($arg:tt)+) => {
        let holds: bool = $cond;
        if !holds {
            return Err(format!($($arg)+).into());
        }
    };
}

pub fn zdisk_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_zdisk"))
}

/// Where a client finds its tools, or why the test must be skipped: every
/// missing tool is named, not only the first.
pub fn require_tools(tools: &[&str]) -> Result<(), String> {
    let missing: Vec<&str> = tools
        .iter()
        .copied()
        .filter(|tool| {
            if tool.starts_with('/') {
                !Path::new(tool).exists()
            } else {
                !std::env::var_os("PATH").is_some_and(|paths| {
                    std::env::split_paths(&paths).any(|dir| dir.join(tool).is_file())
                })
            }
        })
        .collect();
    match missing.as_slice() {
        [] => Ok(()),
        [tool] => Err(format!(
            "{tool} is not installed (run .ci/run, which installs the test prerequisites)"
        )),
        tools => Err(format!(
            "{} are not installed (run .ci/run, which installs the test prerequisites)",
            tools.join(", ")
        )),
    }
}

/// Skips unless running as root with /dev/fuse and loop devices.
pub fn require_root_fuse_loop() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("needs root (for losetup and mount)".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Err("needs /dev/fuse".into());
    }
    if !Path::new("/dev/loop-control").exists() {
        return Err("needs loop devices (/dev/loop-control)".into());
    }
    Ok(())
}

/// A scratch directory removed at drop.
pub struct Scratch {
    pub path: PathBuf,
}

impl Scratch {
    pub fn new(name: &str) -> Scratch {
        // Tests run in parallel, and one body may run for several media:
        // every scratch directory is distinct.
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let serial = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let base = std::env::var_os("ZDISK_TEST_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let path = base.join(format!("zdisk-test-{name}-{}-{serial}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create scratch dir");
        Scratch { path }
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Runs `zdisk` with arguments and returns its output.
pub fn zdisk(args: &[&str]) -> Output {
    Command::new(zdisk_bin())
        .args(args)
        .output()
        .expect("run zdisk")
}

/// Runs `zdisk`, which must fail with `expect` in its error and no panic.
pub fn one_line_error(args: &[&str], expect: &str) -> Result<(), Failed> {
    let output = zdisk(args);
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(!output.status.success(), "zdisk {args:?} should fail");
    ensure!(
        stderr.contains(expect),
        "zdisk {args:?}: expected {expect:?} in {stderr:?}"
    );
    ensure!(
        !stderr.contains("panicked"),
        "zdisk {args:?} panicked: {stderr}"
    );
    ensure!(
        stderr.trim_end().lines().count() == 1,
        "zdisk {args:?}: not one line: {stderr:?}"
    );
    Ok(())
}

/// Runs a command; fails with its stderr if it exits non-zero.
pub fn run(program: &str, args: &[&str]) -> Result<Output, Failed> {
    let output = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "{program} {} failed ({}):\n{}\n{}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
        .into());
    }
    Ok(output)
}

pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// A running `zdisk serve` on a Unix socket.
pub struct Server {
    pub child: Option<Child>,
    pub socket: PathBuf,
    pub image: PathBuf,
    pub log: std::sync::Arc<std::sync::Mutex<String>>,
    pub metrics: Option<String>,
}

impl Server {
    /// Starts `zdisk serve IMAGE --socket SOCK [extra...]` and waits until it listens.
    pub fn start(image: &Path, socket: &Path, extra: &[&str]) -> Result<Server, Failed> {
        let _ = std::fs::remove_file(socket);
        let mut all = vec!["--socket", socket.to_str().expect("UTF-8 path")];
        all.extend_from_slice(extra);
        Self::start_args(image, socket, &all)
    }

    /// Starts `zdisk serve IMAGE [extra...]` where `extra` says where to
    /// listen (`--listen ADDR`); `uri()` is then meaningless.
    pub fn start_tcp(image: &Path, extra: &[&str]) -> Result<Server, Failed> {
        Self::start_args(image, Path::new(""), extra)
    }

    fn start_args(image: &Path, socket: &Path, args: &[&str]) -> Result<Server, Failed> {
        let extra = args;
        let mut child = Command::new(zdisk_bin())
            .arg("serve")
            .arg(image)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start zdisk serve: {e}"))?;
        let stderr = child.stderr.take().expect("piped stderr");
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (ready_tx, ready_rx) = mpsc::channel();
        let log_writer = log.clone();
        std::thread::spawn(move || {
            let mut ready = Some(ready_tx);
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                log_writer.lock().unwrap().push_str(&format!("{line}\n"));
                if line.contains("listening on") {
                    if let Some(tx) = ready.take() {
                        let _ = tx.send(());
                    }
                }
            }
        });
        let mut server = Server {
            child: Some(child),
            socket: socket.to_path_buf(),
            image: image.to_path_buf(),
            log,
            metrics: extra
                .iter()
                .position(|a| *a == "--metrics")
                .and_then(|i| extra.get(i + 1))
                .map(|s| s.to_string()),
        };
        match ready_rx.recv_timeout(Duration::from_secs(60)) {
            Ok(()) => Ok(server),
            Err(_) => {
                let status = server
                    .child
                    .as_mut()
                    .and_then(|c| c.try_wait().ok().flatten());
                Err(format!("zdisk serve did not start ({status:?}):\n{}", server.log()).into())
            }
        }
    }

    pub fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.socket.display())
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Sends a signal and waits for the exit; returns the exit status.
    pub fn stop_with(&mut self, signal: &str) -> Result<std::process::ExitStatus, Failed> {
        let mut child = self.child.take().ok_or("server already stopped")?;
        run("kill", &[&format!("-{signal}"), &child.id().to_string()])?;
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
                // Give the log reader a moment to collect the last lines.
                std::thread::sleep(Duration::from_millis(50));
                return Ok(status);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                return Err(
                    format!("zdisk did not exit after SIG{signal}:\n{}", self.log()).into(),
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Clean shutdown; fails unless the server exits 0.
    pub fn stop(&mut self) -> Result<(), Failed> {
        let status = self.stop_with("TERM")?;
        if !status.success() {
            return Err(
                format!("zdisk exited with {status} after SIGTERM:\n{}", self.log()).into(),
            );
        }
        Ok(())
    }

    /// Fetches /stats from the metrics endpoint.
    pub fn stats(&self) -> Result<serde_json::Value, Failed> {
        let addr = self
            .metrics
            .as_ref()
            .ok_or("server started without --metrics")?;
        let output = run("curl", &["-sf", &format!("http://{addr}/stats")])?;
        serde_json::from_slice(&output.stdout).map_err(|e| format!("bad /stats JSON: {e}").into())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Skips unless Debian's python3 has the libnbd bindings.
pub fn python_has_libnbd() -> Result<(), String> {
    require_tools(&["/usr/bin/python3"])?;
    let ok = Command::new("/usr/bin/python3")
        .args(["-c", "import nbd"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        Ok(())
    } else {
        Err("python3-libnbd is not installed".into())
    }
}

/// Runs a Python snippet under Debian's python3 (which has the libnbd bindings).
pub fn python(script: &str, args: &[&str]) -> Result<Output, Failed> {
    let mut all = vec!["-c", script];
    all.extend_from_slice(args);
    run("/usr/bin/python3", &all)
}

/// A free TCP port on localhost.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind port 0")
        .local_addr()
        .expect("local addr")
        .port()
}

/// Why a test cannot run here.
#[derive(Debug)]
pub enum Unmet {
    /// A prerequisite is absent (a tool, root, a device): the test skips,
    /// or under CI fails, with this reason.
    Missing(String),
    /// The check itself broke (a probe script that failed in a way that is
    /// not "absent"): the test fails everywhere, since a bug in a check
    /// must not pass for a missing package.
    Broken(String),
}

impl From<String> for Unmet {
    fn from(reason: String) -> Unmet {
        Unmet::Missing(reason)
    }
}

/// Whether this run is CI's: `CI` set to anything but "" , "0" or "false"
/// (`.ci/run` exports `CI=true`).
pub fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|value| !matches!(value.trim(), "" | "0" | "false"))
}

/// The prerequisites CI may skip: the comma-separated words of
/// `ZDISK_CI_ALLOW_SKIP` (empty by default; `.ci/test` prints it).
pub fn ci_allowed_skips() -> Vec<String> {
    std::env::var("ZDISK_CI_ALLOW_SKIP")
        .unwrap_or_default()
        .split(',')
        .map(|word| word.trim().to_string())
        .filter(|word| !word.is_empty())
        .collect()
}

/// Whether a skip reason names one of `allowed`: a word of the allowlist
/// matches a whole word of the reason (`fuse` matches "needs /dev/fuse",
/// `qemu-img` matches "qemu-img is not installed"; `qemu` matches neither).
pub fn skip_allowed(reason: &str, allowed: &[String]) -> bool {
    let words: Vec<&str> = reason
        .split(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
        .map(|word| word.trim_end_matches('.'))
        .filter(|word| !word.is_empty())
        .collect();
    allowed
        .iter()
        .any(|entry| words.iter().any(|word| word.eq_ignore_ascii_case(entry)))
}

/// Wraps a test body's prerequisite check: `None` runs the test. A missing
/// prerequisite is a visible skip (`SKIPPED: reason`, and the trial
/// reports itself ignored with the reason) outside CI; under `CI=true` it
/// fails the trial with its reason, unless `ZDISK_CI_ALLOW_SKIP` names it.
/// A broken check fails everywhere.
pub fn skip_unless<E: Into<Unmet>>(check: Result<(), E>) -> Option<TestResult> {
    let unmet = check.err()?.into();
    let outcome = skip_decision(unmet, under_ci(), &ci_allowed_skips());
    if let Ok(Completion::Ignored {
        reason: Some(reason),
    }) = &outcome
    {
        eprintln!("SKIPPED: {reason}");
    }
    Some(outcome)
}

/// What [`skip_unless`] makes of an unmet prerequisite, given whether this
/// is CI's run and what CI may skip.
pub fn skip_decision(unmet: Unmet, ci: bool, allowed: &[String]) -> TestResult {
    match unmet {
        Unmet::Broken(reason) => Err(format!("a prerequisite check failed: {reason}").into()),
        Unmet::Missing(reason) if ci && !skip_allowed(&reason, allowed) => Err(format!(
            "missing prerequisite under CI: {reason} (CI=true turns skips into failures; \
             ZDISK_CI_ALLOW_SKIP lists the prerequisites that may skip)"
        )
        .into()),
        Unmet::Missing(reason) => Ok(Completion::ignored_with(reason)),
    }
}

/// `len` bytes of incompressible data, the same for the same seed.
pub fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        // xorshift64*: fast, and far beyond what any codec can compress.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        out.extend_from_slice(&state.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A certificate authority, a server certificate for localhost, and two
/// client directories: one with a signed client certificate, one with the
/// CA only. Made as nbdkit's documentation describes, with certtool.
pub fn make_pki(dir: &Path) -> Result<(), Failed> {
    let write = |name: &str, text: &str| std::fs::write(dir.join(name), text);
    for sub in ["server", "client", "client-nocert"] {
        std::fs::create_dir_all(dir.join(sub))?;
    }
    write("ca.info", "cn = zdisk test CA\nca\ncert_signing_key\n")?;
    write(
        "server.info",
        "organization = zdisk tests\ncn = localhost\ndns_name = localhost\nip_address = 127.0.0.1\ntls_www_server\nencryption_key\nsigning_key\n",
    )?;
    write(
        "client.info",
        "organization = zdisk tests\ncn = client.example.com\ntls_www_client\nencryption_key\nsigning_key\n",
    )?;
    let path = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let certtool = |args: &[&str]| run("certtool", args).map(|_| ());
    certtool(&["--generate-privkey", "--outfile", &path("ca-key.pem")])?;
    certtool(&[
        "--generate-self-signed",
        "--load-privkey",
        &path("ca-key.pem"),
        "--template",
        &path("ca.info"),
        "--outfile",
        &path("ca-cert.pem"),
    ])?;
    for (who, key, cert, info) in [
        (
            "server",
            "server/server-key.pem",
            "server/server-cert.pem",
            "server.info",
        ),
        (
            "client",
            "client/client-key.pem",
            "client/client-cert.pem",
            "client.info",
        ),
    ] {
        certtool(&["--generate-privkey", "--outfile", &path(key)])?;
        certtool(&[
            "--generate-certificate",
            "--load-ca-certificate",
            &path("ca-cert.pem"),
            "--load-ca-privkey",
            &path("ca-key.pem"),
            "--load-privkey",
            &path(key),
            "--template",
            &path(info),
            "--outfile",
            &path(cert),
        ])
        .map_err(|e| format!("{who} certificate: {e:?}"))?;
    }
    for sub in ["server", "client", "client-nocert"] {
        std::fs::copy(dir.join("ca-cert.pem"), dir.join(sub).join("ca-cert.pem"))?;
    }
    Ok(())
}

/// Flushes the crash writer (`tests/scripts/crashwriter.py`) logged as
/// completed so far in `log` (its lines starting with `F`).
pub fn flushes_logged(log: &Path) -> usize {
    std::fs::read_to_string(log)
        .map(|text| text.lines().filter(|l| l.starts_with('F')).count())
        .unwrap_or(0)
}
