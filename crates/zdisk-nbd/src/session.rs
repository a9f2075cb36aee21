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
use std::io::{self, BufRead, BufReader, Read};

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

/// Payloads this long or longer are read straight into their buffer, not
/// through the connection's read buffer.
const DIRECT_PAYLOAD_BYTES: usize = 16 * 1024;

/// Where the transmission phase reads requests from. A buffered socket
/// reads small requests many to a syscall; large payloads skip its buffer.
pub(crate) trait RequestStream: Read {
    /// Fills a request header. `direct`: the last request was a large
    /// write, so another is likely to follow; the header is then read
    /// alone, so that the read does not pull its payload into a buffer it
    /// must be copied out of.
    fn read_header(&mut self, header: &mut [u8], direct: bool) -> io::Result<bool> {
        let _ = direct;
        read_message(self, header)
    }

    /// Fills a WRITE payload.
    fn read_payload(&mut self, payload: &mut [u8]) -> io::Result<()> {
        self.read_exact(payload)
    }
}

/// The fuzzers' input.
impl RequestStream for &[u8] {}

impl<R: Read> RequestStream for BufReader<R> {
    fn read_header(&mut self, header: &mut [u8], direct: bool) -> io::Result<bool> {
        if direct && self.buffer().is_empty() {
            read_message(self.get_mut(), header)
        } else {
            read_message(self, header)
        }
    }

    fn read_payload(&mut self, payload: &mut [u8]) -> io::Result<()> {
        // What the buffer holds already, then the rest from the socket:
        // straight into the payload if it is large.
        let held = self.buffer().len().min(payload.len());
        payload[..held].copy_from_slice(&self.buffer()[..held]);
        self.consume(held);
        let rest = &mut payload[held..];
        if rest.len() >= DIRECT_PAYLOAD_BYTES {
            self.get_mut().read_exact(rest)
        } else {
            self.read_exact(rest)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A socket that hands out at most `chunk` bytes a read.
    struct Trickle<'a> {
        bytes: &'a [u8],
        chunk: usize,
    }

    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = buf.len().min(self.chunk).min(self.bytes.len());
            buf[..n].copy_from_slice(&self.bytes[..n]);
            self.bytes = &self.bytes[n..];
            Ok(n)
        }
    }

    /// Headers and payloads of every size read back exactly, whatever part
    /// of a payload the buffer already held and however the socket
    /// splits the stream, with headers read alone or buffered.
    #[test]
    fn requests_read_back_exactly_through_the_buffer_and_around_it() {
        let sizes = [
            0,
            1,
            4096,
            DIRECT_PAYLOAD_BYTES - 1,
            DIRECT_PAYLOAD_BYTES,
            256 << 10,
        ];
        let mut stream = Vec::new();
        for (i, &size) in sizes.iter().enumerate() {
            stream.extend((0..28).map(|b| (b + i) as u8));
            stream.extend((0..size).map(|b| (b * 7 + i) as u8));
        }
        for chunk in [1, 100, 5000, 1 << 20] {
            for buffer in [64, 16 << 10, 128 << 10] {
                for direct in [false, true] {
                    let source = Trickle {
                        bytes: &stream,
                        chunk,
                    };
                    let mut reader = BufReader::with_capacity(buffer, source);
                    let mut at = 0;
                    for &size in &sizes {
                        let mut header = [0u8; 28];
                        assert!(reader.read_header(&mut header, direct).unwrap());
                        assert_eq!(header[..], stream[at..at + 28]);
                        at += 28;
                        let mut payload = vec![0u8; size];
                        reader.read_payload(&mut payload).unwrap();
                        assert_eq!(
                            payload[..],
                            stream[at..at + size],
                            "{size} {chunk} {buffer}"
                        );
                        at += size;
                    }
                    let mut header = [0u8; 28];
                    assert!(
                        !reader.read_header(&mut header, direct).unwrap(),
                        "clean end"
                    );
                }
            }
        }
    }
}
