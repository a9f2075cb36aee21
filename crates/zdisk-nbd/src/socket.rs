//! The sockets a connection can run on, and how a non-blocking call on one
//! says it must wait. The bottom of the connection's I/O: `tls.rs` and
//! `transport.rs` both build on it.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;

/// An accepted connection of either kind.
pub(crate) enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Socket {
    pub fn raw_fd(&self) -> RawFd {
        match self {
            Socket::Tcp(stream) => stream.as_raw_fd(),
            Socket::Unix(stream) => stream.as_raw_fd(),
        }
    }

    /// Asks the kernel for a send buffer of `bytes` (it may grant less:
    /// `net.core.wmem_max` caps it), so that a large read reply goes out
    /// in one write instead of being handed to the sender thread in
    /// pieces. Best effort: a refusal leaves the default.
    pub fn request_send_buffer(&self, bytes: usize) {
        let value = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
        // SAFETY: a valid descriptor, an int option and its size.
        unsafe {
            libc::setsockopt(
                self.raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }

    pub fn try_clone(&self) -> io::Result<Socket> {
        Ok(match self {
            Socket::Tcp(stream) => Socket::Tcp(stream.try_clone()?),
            Socket::Unix(stream) => Socket::Unix(stream.try_clone()?),
        })
    }
}

impl Read for Socket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        plain_read(self, buf)
    }
}

impl Write for Socket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        plain_write(self, buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Plain-text I/O on a shared socket, as `&TcpStream` allows.
pub(crate) fn plain_read(socket: &Socket, buf: &mut [u8]) -> io::Result<usize> {
    match socket {
        Socket::Tcp(stream) => (&*stream).read(buf),
        Socket::Unix(stream) => (&*stream).read(buf),
    }
}

pub(crate) fn plain_write(socket: &Socket, buf: &[u8]) -> io::Result<usize> {
    match socket {
        Socket::Tcp(stream) => (&*stream).write(buf),
        Socket::Unix(stream) => (&*stream).write(buf),
    }
}

/// Why a non-blocking call did not complete.
pub(crate) enum Blocked {
    /// It must wait for these poll events, then be retried.
    On(libc::c_short),
    Failed(io::Error),
}

impl Blocked {
    /// A plain socket call's error: `WouldBlock` waits for `events`.
    pub fn waiting(error: io::Error, events: libc::c_short) -> Blocked {
        if error.kind() == io::ErrorKind::WouldBlock {
            Blocked::On(events)
        } else {
            Blocked::Failed(error)
        }
    }
}
