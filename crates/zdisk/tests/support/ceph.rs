//! A one-node Ceph with an S3 gateway for the tier's end-to-end tests,
//! booted by `ceph.sh` beside this file and stopped by PID when dropped.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{Failed, Unmet};

pub struct Ceph {
    dir: PathBuf,
    /// The `AWS_*` settings a client needs: endpoint, credentials, region.
    pub env: Vec<(String, String)>,
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/ceph.sh")
}

impl Ceph {
    /// Why a cluster cannot be started here: `ceph.sh check` exits 2 when
    /// a prerequisite is absent (not root, a package not installed), which
    /// is [`Unmet::Missing`]; any other failure (the daemons' binaries do not
    /// run, or a bug in the script) is [`Unmet::Broken`] and fails the test
    /// instead of passing for "not installed".
    pub fn unavailable() -> Result<(), Unmet> {
        let output = Command::new("bash")
            .arg(script())
            .arg("check")
            .output()
            .map_err(|e| Unmet::Broken(format!("cannot run ceph.sh: {e}")))?;
        let said = || {
            format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            )
            .trim()
            .to_string()
        };
        match output.status.code() {
            Some(0) => Ok(()),
            Some(2) => Err(Unmet::Missing(said())),
            _ => Err(Unmet::Broken(format!(
                "ceph.sh check failed ({}): {}",
                output.status,
                said()
            ))),
        }
    }

    /// Boots a cluster whose files live in `dir`; on a loaded machine a
    /// daemon now and then misses its deadline, so a failed boot is torn
    /// down and tried once more in a fresh directory.
    pub fn start(dir: &Path) -> Result<Ceph, Failed> {
        match Self::start_once(dir) {
            Ok(ceph) => Ok(ceph),
            Err(first) => {
                eprintln!(
                    "the first boot failed, trying again: {}",
                    first.message().unwrap_or("")
                );
                Self::start_once(&dir.with_extension("again"))
            }
        }
    }

    fn start_once(dir: &Path) -> Result<Ceph, Failed> {
        let mut ceph = Ceph {
            dir: dir.to_path_buf(),
            env: Vec::new(),
        };
        let output = Command::new("bash")
            .arg(script())
            .arg("start")
            .arg(dir)
            .output()
            .map_err(|e| format!("cannot run ceph.sh: {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "ceph.sh start failed: {}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            )
            .into());
        }
        for line in String::from_utf8_lossy(&output.stdout).lines() {
            if let Some((key, value)) = line.split_once('=') {
                ceph.env.push((key.to_string(), value.to_string()));
            }
        }
        Ok(ceph)
    }

    pub fn var(&self, key: &str) -> &str {
        self.env
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .unwrap_or("")
    }

    /// `curl` arguments that sign a request as the cluster's S3 user.
    pub fn curl_auth(&self) -> Vec<String> {
        vec![
            "--aws-sigv4".into(),
            "aws:amz:us-east-1:s3".into(),
            "--user".into(),
            format!(
                "{}:{}",
                self.var("AWS_ACCESS_KEY_ID"),
                self.var("AWS_SECRET_ACCESS_KEY")
            ),
            // curl 7.88 signs no payload hash of its own; radosgw wants one.
            "-H".into(),
            "x-amz-content-sha256: UNSIGNED-PAYLOAD".into(),
        ]
    }

    /// Makes a bucket.
    pub fn create_bucket(&self, bucket: &str) -> Result<(), Failed> {
        let status = self.curl(&["-X", "PUT", &self.url(bucket)])?;
        if status != "200" {
            return Err(format!("creating bucket {bucket}: HTTP {status}").into());
        }
        Ok(())
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}/{path}", self.var("AWS_ENDPOINT_URL"))
    }

    /// Runs a signed curl request; returns the HTTP status.
    pub fn curl(&self, args: &[&str]) -> Result<String, Failed> {
        let output = Command::new("curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{http_code}"])
            .args(self.curl_auth())
            .args(args)
            .output()
            .map_err(|e| format!("cannot run curl: {e}"))?;
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
    }

    /// Stops the S3 gateway alone (the cluster keeps its data); returns
    /// once its port refuses connections.
    pub fn stop_gateway(&self) -> Result<(), Failed> {
        self.script_command("rgw-stop")
    }

    /// Starts the gateway again on the same port; returns once it answers.
    pub fn start_gateway(&self) -> Result<(), Failed> {
        self.script_command("rgw-start")
    }

    fn script_command(&self, command: &str) -> Result<(), Failed> {
        let output = Command::new("bash")
            .arg(script())
            .arg(command)
            .arg(&self.dir)
            .output()
            .map_err(|e| format!("cannot run ceph.sh: {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "ceph.sh {command} failed: {}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            )
            .into());
        }
        Ok(())
    }

    /// Stops the daemons (also done on drop).
    pub fn stop(&self) {
        let _ = Command::new("bash")
            .arg(script())
            .arg("stop")
            .arg(&self.dir)
            .output();
    }
}

impl Drop for Ceph {
    fn drop(&mut self) {
        self.stop();
    }
}
