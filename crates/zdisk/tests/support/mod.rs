//! Shared plumbing for the integration tests: starting the real `zdisk`
//! binary, running real clients, and turning a missing prerequisite into a
//! reported skip instead of a silent pass.

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

/// Where a client finds its tool, or why the test must be skipped.
pub fn require_tools(tools: &[&str]) -> Result<(), String> {
    for tool in tools {
        let found = if tool.starts_with('/') {
            Path::new(tool).exists()
        } else {
            std::env::var_os("PATH")
                .map(|paths| std::env::split_paths(&paths).any(|dir| dir.join(tool).is_file()))
                .unwrap_or(false)
        };
        if !found {
            return Err(format!(
                "{tool} is not installed (run .ci/run, which installs the test prerequisites)"
            ));
        }
    }
    Ok(())
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

/// Wraps a test body so that a skip reason becomes a runtime "ignored".
pub fn skip_unless(check: Result<(), String>) -> Option<TestResult> {
    match check {
        Ok(()) => None,
        Err(reason) => {
            eprintln!("SKIPPED: {reason}");
            Some(Ok(Completion::ignored_with(reason)))
        }
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
