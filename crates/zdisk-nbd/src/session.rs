//! What one client connection shares between its phases: why it ended, how
//! it logs, and the few read helpers both phases need.
//!
//! A session ends exactly once, with a [`SessionEnd`] that says whose doing
//! it was; the server logs that reason in the connection's closing line.
//! Logging is one line per connection open/close, per device error and
//! per rejected request (the first few of each connection), and nothing per
//! successful request, so a busy server's log stays readable. Lines go to
//! the `log` facade; the binary's logger never blocks the server on them.

use std::fmt;
use std::io::{self, Read};

/// Why a session stopped. Only `Protocol` and `Io` are failures; the rest are
/// the normal ways a conversation ends.
#[derive(Debug)]
pub(crate) enum SessionEnd {
    /// The client sent NBD_OPT_ABORT during the handshake.
    ClientAbort,
    /// The client sent NBD_CMD_DISC.
    ClientDisconnect,
    /// The client closed its end between two messages.
    ClientClosed,
    /// The server is shutting down and stopped reading.
    Shutdown,
    /// The client broke a rule that leaves no way to continue (bad magic,
    /// unknown client flags, an export name we cannot serve); the
    /// specification asks for a hard disconnect.
    Protocol(String),
    /// Reading from or writing to the client failed.
    Io(io::Error),
}

impl fmt::Display for SessionEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SessionEnd::ClientAbort => write!(f, "client aborted the handshake"),
            SessionEnd::ClientDisconnect => write!(f, "client disconnected"),
            SessionEnd::ClientClosed => write!(f, "client closed the connection"),
            SessionEnd::Shutdown => write!(f, "server shutting down"),
            SessionEnd::Protocol(what) => write!(f, "protocol error: {what}"),
            SessionEnd::Io(error) => write!(f, "I/O error: {error}"),
        }
    }
}

impl From<io::Error> for SessionEnd {
    fn from(error: io::Error) -> Self {
        if error.kind() == io::ErrorKind::UnexpectedEof {
            SessionEnd::Protocol("connection closed in the middle of a message".into())
        } else {
            SessionEnd::Io(error)
        }
    }
}

/// Where a connection's log lines go. Disabled for fuzzing, where every
/// injected device error would otherwise print.
#[derive(Debug, Clone)]
pub(crate) struct ConnLog {
    pub enabled: bool,
    /// Identifies the connection in every line, e.g. `conn 7 (127.0.0.1:5000)`.
    pub label: String,
}

impl ConnLog {
    #[cfg(any(test, feature = "testing"))]
    pub fn quiet() -> Self {
        ConnLog {
            enabled: false,
            label: String::new(),
        }
    }

    /// Logs one line about this connection (never blocks: see the
    /// binary's logger).
    pub fn line(&self, message: fmt::Arguments<'_>) {
        if self.enabled {
            log::info!(target: "zdisk_nbd", "{}: {}", self.label, message);
        }
    }
}

/// Fills `buf` from `reader`. Returns `Ok(false)` if the peer closed cleanly
/// before the first byte (a message boundary), and an error if it closed in
/// the middle.
pub(crate) fn read_message<R: Read + ?Sized>(reader: &mut R, buf: &mut [u8]) -> io::Result<bool> {
    let mut filled = 0;
    while filled < buf.len() {
        match reader.read(&mut buf[filled..]) {
            Ok(0) if filled == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(count) => filled += count,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    Ok(true)
}

/// Reads and drops `count` bytes through a small fixed buffer, so a peer
/// announcing gigabytes of payload costs time, never memory.
pub(crate) fn discard<R: Read + ?Sized>(reader: &mut R, count: u64) -> io::Result<()> {
    let copied = io::copy(&mut reader.take(count), &mut io::sink())?;
    if copied < count {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

/// Reads exactly `count` bytes into a fresh buffer. Callers bound `count`
/// before calling (option data by `MAX_OPTION_BYTES`, write payloads by
/// `MAX_PAYLOAD_BYTES` and the device size).
#[cfg(any(test, feature = "testing"))]
pub(crate) fn read_vec<R: Read + ?Sized>(reader: &mut R, count: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; count];
    reader.read_exact(&mut buf)?;
    Ok(buf)
}
