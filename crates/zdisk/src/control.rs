//! The control socket: a Unix socket next to a served image, through
//! which `zdisk stats IMAGE` asks the server for its statistics, and
//! `zdisk snapshot`, `volumes` and `delete` ask it to take, list and
//! delete snapshots (an image being served is locked, so it cannot be
//! opened directly).
//!
//! Where: `.NAME.zdisk-control` in the directory of the image file (its
//! symbolic links resolved, so every path to the image finds it); for a
//! block device, `/run/zdisk/NAME.control`. Who may ask: the socket's
//! permissions follow the image's read bits (whoever may read the image
//! may read its statistics).
//!
//! The protocol is one line each way: the client sends `stats`,
//! `snapshots`, `volumes`, `snapshot NAME [CLONE]`, `clone SNAPSHOT NAME`,
//! `delete NAME` or `compact`; the server answers with one line of JSON
//! (the statistics with the keys of `zdisk stats --json`; the snapshots;
//! the snapshots and clones; the snapshot taken; the clone made; what
//! deleting freed; what compacting did), or a line starting `error:`.
//! Taking and deleting snapshots, making and deleting clones and
//! compacting change the image, so they take write permission on the
//! image: the server checks the asking process's credentials
//! (`SO_PEERCRED`) against the image file's owner and mode.
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
    let image_path = image.to_path_buf();
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
            let image = image_path;
            for stream in listener.incoming() {
                match stream {
                    Ok(stream) => answer(&stream, &volume, &image),
                    // Out of descriptors (EMFILE) fails at once: wait
                    // rather than spin on it.
                    Err(_) => std::thread::sleep(Duration::from_millis(100)),
                }
            }
        })
        .map_err(|e| format!("cannot start the control socket's thread: {e}"))?;
    Ok(socket)
}

/// JSON encoding behind a trait object, for the replies above.
mod erased {
    pub trait Json {
        fn json(&self) -> Result<String, String>;
    }

    impl<T: serde::Serialize> Json for T {
        fn json(&self) -> Result<String, String> {
            serde_json::to_string(self).map_err(|e| format!("cannot encode the reply: {e}"))
        }
    }
}

/// The snapshots and clones of a volume, as the `volumes` request
/// answers them.
#[derive(serde::Serialize)]
pub struct Listing {
    pub snapshots: Vec<zdisk_core::SnapshotInfo>,
    pub clones: Vec<ListedClone>,
}

/// A clone with what its view holds (`Volume::clone_mapped`'s walk).
#[derive(serde::Serialize)]
pub struct ListedClone {
    #[serde(flatten)]
    pub info: zdisk_core::CloneInfo,
    #[serde(flatten)]
    pub mapped: zdisk_core::CloneMapped,
}

pub fn listing(volume: &Volume) -> Result<Listing, String> {
    let mut clones = Vec::new();
    for info in volume.clones().map_err(|e| e.to_string())? {
        let mapped = volume.clone_mapped(&info.name).map_err(|e| e.to_string())?;
        clones.push(ListedClone { info, mapped });
    }
    Ok(Listing {
        snapshots: volume.snapshots().map_err(|e| e.to_string())?,
        clones,
    })
}

/// What deleting a snapshot or a clone did, as the `delete` request
/// answers it.
#[derive(serde::Serialize)]
pub struct DeletedAny {
    /// `snapshot` or `clone`.
    pub kind: &'static str,
    /// A snapshot's entries that went to the next older snapshot.
    pub handed_down: u64,
    pub freed: u64,
}

/// Deletes the snapshot or the clone named `name`.
pub fn delete_named(volume: &Volume, name: &str) -> Result<DeletedAny, String> {
    if volume.clone_list().iter().any(|c| c.name == name) {
        let deleted = volume.delete_clone(name).map_err(|e| e.to_string())?;
        return Ok(DeletedAny {
            kind: "clone",
            handed_down: 0,
            freed: deleted.freed,
        });
    }
    if !volume.snapshot_list().iter().any(|s| s.name == name) {
        return Err(format!("no snapshot or clone named {name:?}"));
    }
    let deleted = volume.delete_snapshot(name).map_err(|e| e.to_string())?;
    Ok(DeletedAny {
        kind: "snapshot",
        handed_down: deleted.handed_down,
        freed: deleted.freed,
    })
}

/// Whether the process at the other end of `stream` may change `image`:
/// root, or a user with write permission on the image file by its mode.
fn may_change(stream: &UnixStream, image: &Path) -> Result<(), String> {
    let (uid, gid) = peer_credentials(stream)?;
    let metadata =
        fs::metadata(image).map_err(|e| format!("cannot inspect {}: {e}", image.display()))?;
    let mode = metadata.mode();
    let writable = uid == 0
        || (uid == metadata.uid() && mode & 0o200 != 0)
        || (gid == metadata.gid() && mode & 0o020 != 0)
        || mode & 0o002 != 0;
    if writable {
        Ok(())
    } else {
        Err(format!(
            "user {uid} may not write {}, so may not change its snapshots or clones",
            image.display()
        ))
    }
}

/// The user and group of the process at the other end of `stream`.
fn peer_credentials(stream: &UnixStream) -> Result<(u32, u32), String> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a valid ucred of `len` bytes for the kernel to fill.
    let done = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if done != 0 {
        return Err(format!(
            "cannot tell who asks: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok((cred.uid, cred.gid))
}

/// Answers one request on `stream`.
fn answer(stream: &UnixStream, volume: &Volume, image: &Path) {
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
    let request = request.trim();
    let json = |value: Result<String, String>| value.unwrap_or_else(|e| format!("error: {e}"));
    let encode = |value: &dyn erased::Json| value.json();
    let reply = match request.split_once(' ') {
        None if request == "stats" => json(encode(&volume.stats())),
        None if request == "snapshots" => json(
            volume
                .snapshots()
                .map_err(|e| e.to_string())
                .and_then(|list| encode(&list)),
        ),
        None if request == "volumes" => json(listing(volume).and_then(|listing| encode(&listing))),
        None if request == "compact" => match may_change(stream, image) {
            Err(why) => format!("error: {why}"),
            Ok(()) => json(
                volume
                    .compact()
                    .map_err(|e| e.to_string())
                    .and_then(|done| encode(&done)),
            ),
        },
        Some((verb @ ("snapshot" | "delete" | "clone"), words)) => {
            match may_change(stream, image) {
                Err(why) => format!("error: {why}"),
                Ok(()) => json(match (verb, words.split_once(' ')) {
                    ("snapshot", None) => volume
                        .take_snapshot(words)
                        .map_err(|e| e.to_string())
                        .and_then(|taken| encode(&taken)),
                    ("snapshot", Some((name, clone))) => volume
                        .take_snapshot_of(clone, name)
                        .map_err(|e| e.to_string())
                        .and_then(|taken| encode(&taken)),
                    ("clone", Some((snapshot, name))) => volume
                        .make_clone(snapshot, name)
                        .map_err(|e| e.to_string())
                        .and_then(|made| encode(&made)),
                    ("delete", None) => {
                        delete_named(volume, words).and_then(|deleted| encode(&deleted))
                    }
                    _ => Err(format!("malformed request {request:?}")),
                }),
            }
        }
        _ => format!(
            "error: unknown request {request:?}; try stats, snapshots, volumes, snapshot NAME \
             [CLONE], clone SNAPSHOT NAME, delete NAME or compact"
        ),
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
    let reply = ask(image, "stats", "zdisk stats")?;
    serde_json::from_str(&reply).map_err(|e| {
        AskError::Failed(format!(
            "the server of {} answered what is not statistics ({e})",
            image.display()
        ))
    })
}

/// Asks the server of `image`, if any, `request` (for `command`, which
/// the permission error names); returns its JSON reply.
pub fn ask(image: &Path, request: &str, command: &str) -> Result<String, AskError> {
    let path = socket_path(image).map_err(AskError::NotServed)?;
    let stream = match UnixStream::connect(&path) {
        Ok(stream) => stream,
        Err(e) if e.kind() == ErrorKind::PermissionDenied => {
            return Err(AskError::Failed(format!(
                "{} is being served, and its control socket {} refuses this user ({e}): \
                 run {command} as the user serving it, or as root",
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
    // Statistics come at once; a snapshot or a deletion flushes, and
    // compacting cleans the whole image: those wait as long as they take.
    let read_timeout = match request {
        // `volumes` walks each clone's view: it waits as long as that.
        "stats" | "snapshots" => Some(TIMEOUT),
        _ => None,
    };
    stream.set_read_timeout(read_timeout).map_err(failed)?;
    stream.set_write_timeout(Some(TIMEOUT)).map_err(failed)?;
    (&stream)
        .write_all(format!("{request}\n").as_bytes())
        .map_err(failed)?;
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
    Ok(reply)
}
