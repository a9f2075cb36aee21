//! The control socket: a Unix socket next to a served image, through
//! which `zdisk stats IMAGE` asks the server for its statistics (an image
//! being served is locked, so it cannot be read directly).
//!
//! Where: `.NAME.zdisk-control` in the directory of the image file (its
//! symbolic links resolved, so every path to the image finds it); for a
//! block device, `/run/zdisk/NAME.control`. Who may ask: the socket's
//! permissions follow the image's read bits (whoever may read the image
//! may read its statistics).
//!
//! The protocol is one line each way: the client sends `stats`, the
//! server answers with the statistics as one line of JSON (the keys of
//! `zdisk stats --json`), or a line starting `error:`.
//!
//! A server killed with -9 leaves its socket behind. The next server of
//! the image holds the image's lock when it binds, so no other process can
//! be serving through that path: it removes the stale socket first. A
//! client that finds nobody listening reads the image itself.

use std::fs;
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use zdisk_core::{Stats, Volume};

/// How long either side waits for the other.
const TIMEOUT: Duration = Duration::from_secs(5);

/// The longest path a Unix socket address holds (`sun_path` less its NUL).
const SOCKET_PATH_MAX: usize = 107;

/// Directory of the control sockets of block devices.
const RUN_DIR: &str = "/run/zdisk";

/// The control socket's path for the image at `image`.
pub fn socket_path(image: &Path) -> Result<PathBuf, String> {
    let real =
        fs::canonicalize(image).map_err(|e| format!("cannot resolve {}: {e}", image.display()))?;
    let name = real
        .file_name()
        .ok_or_else(|| format!("{} does not name a file", image.display()))?
        .to_string_lossy()
        .into_owned();
    let metadata =
        fs::metadata(&real).map_err(|e| format!("cannot inspect {}: {e}", image.display()))?;
    let path = if metadata.file_type().is_block_device() {
        Path::new(RUN_DIR).join(format!("{name}.control"))
    } else {
        real.with_file_name(format!(".{name}.zdisk-control"))
    };
    if path.as_os_str().len() > SOCKET_PATH_MAX {
        return Err(format!(
            "the control socket's path {} is longer than a Unix socket address holds ({SOCKET_PATH_MAX} bytes)",
            path.display()
        ));
    }
    Ok(path)
}

/// A bound control socket; removed when dropped.
pub struct ControlSocket {
    path: PathBuf,
    inode: u64,
}

impl Drop for ControlSocket {
    fn drop(&mut self) {
        // Only ours: a socket another process put there since is left.
        if fs::symlink_metadata(&self.path).is_ok_and(|m| m.ino() == self.inode) {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Binds the control socket of `image` (whose lock the caller holds, as
/// the open `volume`) and answers on a thread of its own.
pub fn serve(image: &Path, volume: Arc<Volume>) -> Result<ControlSocket, String> {
    let path = socket_path(image)?;
    if path.starts_with(RUN_DIR) {
        fs::create_dir_all(RUN_DIR).map_err(|e| format!("cannot create {RUN_DIR}: {e}"))?;
    }
    match fs::symlink_metadata(&path) {
        Ok(metadata) if metadata.file_type().is_socket() => {
            // Stale: left by a server that could not remove it (kill -9);
            // a live one would hold the image's lock, which we hold.
            fs::remove_file(&path)
                .map_err(|e| format!("cannot remove the stale {}: {e}", path.display()))?;
            log::info!("removed a stale control socket {}", path.display());
        }
        Ok(_) => {
            return Err(format!(
                "{} exists and is not a socket; leaving it alone",
                path.display()
            ))
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(format!("cannot inspect {}: {e}", path.display())),
    }
    let listener =
        UnixListener::bind(&path).map_err(|e| format!("cannot bind {}: {e}", path.display()))?;
    let socket = ControlSocket {
        inode: fs::symlink_metadata(&path)
            .map_err(|e| format!("cannot inspect {}: {e}", path.display()))?
            .ino(),
        path: path.clone(),
    };
    // Whoever may read the image may ask (connecting takes write permission).
    let image_mode = fs::metadata(image).map(|m| m.mode()).unwrap_or(0o600);
    let mode = (0..3).fold(0, |mode, class| {
        let read = 0o4 << (3 * class);
        if image_mode & read != 0 {
            mode | (0o6 << (3 * class))
        } else {
            mode
        }
    }) | 0o600;
    fs::set_permissions(&path, fs::Permissions::from_mode(mode))
        .map_err(|e| format!("cannot set the permissions of {}: {e}", path.display()))?;
    std::thread::Builder::new()
        .name("zdisk-control".into())
        .spawn(move || {
            for stream in listener.incoming() {
                match stream {
                    Ok(stream) => answer(&stream, &volume),
                    // Out of descriptors (EMFILE) fails at once: wait
                    // rather than spin on it.
                    Err(_) => std::thread::sleep(Duration::from_millis(100)),
                }
            }
        })
        .map_err(|e| format!("cannot start the control socket's thread: {e}"))?;
    Ok(socket)
}

/// Answers one request on `stream`.
fn answer(stream: &UnixStream, volume: &Volume) {
    let _ = stream.set_read_timeout(Some(TIMEOUT));
    let _ = stream.set_write_timeout(Some(TIMEOUT));
    // A request line is short: a client cannot make the server read much.
    let mut request = String::new();
    if BufReader::new(Read::take(stream, 256))
        .read_line(&mut request)
        .is_err()
    {
        return;
    }
    let reply = match request.trim() {
        "stats" => serde_json::to_string(&volume.stats())
            .unwrap_or_else(|e| format!("error: cannot encode the statistics: {e}")),
        other => format!("error: unknown request {other:?}; try stats"),
    };
    let mut stream = stream;
    let _ = writeln!(stream, "{reply}");
}

/// Why a server's statistics could not be had.
#[derive(Debug)]
pub enum AskError {
    /// Nobody listens there: no socket, a stale one, or no path for one.
    NotServed(String),
    /// A server listens, and refused or failed.
    Failed(String),
}

/// Asks the server of `image`, if any, for its statistics.
pub fn ask_stats(image: &Path) -> Result<Stats, AskError> {
    let path = socket_path(image).map_err(AskError::NotServed)?;
    let stream = match UnixStream::connect(&path) {
        Ok(stream) => stream,
        Err(e) if e.kind() == ErrorKind::PermissionDenied => {
            return Err(AskError::Failed(format!(
                "{} is being served, and its control socket {} refuses this user ({e}): \
                 run zdisk stats as the user serving it, or as root",
                image.display(),
                path.display()
            )))
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {
            return Err(AskError::NotServed(format!(
                "no control socket at {}",
                path.display()
            )))
        }
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
            return Err(AskError::NotServed(format!(
                "nobody listens on {} (left by a server killed with -9?)",
                path.display()
            )))
        }
        Err(e) => {
            return Err(AskError::NotServed(format!(
                "cannot connect to {}: {e}",
                path.display()
            )))
        }
    };
    let failed = |e: std::io::Error| {
        AskError::Failed(format!(
            "the server of {} did not answer on {}: {e}",
            image.display(),
            path.display()
        ))
    };
    stream.set_read_timeout(Some(TIMEOUT)).map_err(failed)?;
    stream.set_write_timeout(Some(TIMEOUT)).map_err(failed)?;
    (&stream).write_all(b"stats\n").map_err(failed)?;
    let mut reply = String::new();
    BufReader::new(&stream)
        .read_line(&mut reply)
        .map_err(failed)?;
    if let Some(error) = reply.strip_prefix("error:") {
        return Err(AskError::Failed(format!(
            "the server of {} refused: {}",
            image.display(),
            error.trim()
        )));
    }
    serde_json::from_str(&reply).map_err(|e| {
        AskError::Failed(format!(
            "the server of {} answered what is not statistics ({e})",
            image.display()
        ))
    })
}
