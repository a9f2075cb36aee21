//! A connection's byte stream: a TCP or Unix socket, in plain text or under
//! TLS after NBD_OPT_STARTTLS, shared by the connection's reader thread and
//! its sender thread.
//!
//! The socket is non-blocking and every wait is a `poll`, so that
//! - every read and write can have a limit: the handshake has a deadline,
//!   and a reply that makes no progress for too long (a client that stopped
//!   reading) fails instead of holding its thread forever;
//! - one TLS session can serve both directions at once: each TLS call runs
//!   under a short lock and never blocks while holding it, so the reader
//!   waiting for the next request never stops a reply from going out.
//!
//! Invariants: no lock is held across a `poll`; a write either completes or
//! fails (after which the connection is shut down and nothing more is sent);
//! [`Transport::shutdown`] wakes every thread waiting on the socket.

use std::io::{self, Read};
use std::net::Shutdown;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::socket::{plain_read, plain_write, Blocked, Socket};
use crate::tls::TlsSession;

/// Longest single `poll`: waits are re-evaluated this often, so a limit
/// that shrinks (at shutdown) takes effect promptly.
const POLL_SLICE: Duration = Duration::from_millis(200);

/// What a stalled write may wait for; see [`Transport::write_all`].
pub(crate) type Patience<'a> = &'a dyn Fn(Duration) -> bool;

/// One connection's stream.
pub(crate) struct Transport {
    socket: Socket,
    /// Set once, by a successful NBD_OPT_STARTTLS; from then on every byte
    /// goes through it.
    tls: OnceLock<Mutex<TlsSession>>,
}

impl Transport {
    /// Takes an accepted socket and makes it non-blocking.
    pub fn new(socket: Socket) -> io::Result<Transport> {
        match &socket {
            Socket::Tcp(stream) => {
                stream.set_nonblocking(true)?;
                // Replies are written whole; Nagle would only delay them.
                stream.set_nodelay(true)?;
            }
            Socket::Unix(stream) => stream.set_nonblocking(true)?,
        }
        Ok(Transport {
            socket,
            tls: OnceLock::new(),
        })
    }

    /// Ends the connection: a TLS session says close_notify first (if the
    /// socket takes it at once), then the socket is shut both ways.
    pub fn close(&self) {
        if let Some(mut session) = self.tls_session() {
            session.close();
        }
        self.shutdown(Shutdown::Both);
    }

    /// Shuts the socket down: a thread waiting to read (for `Read`) or
    /// write (for `Both`) wakes, and sees end of stream or an error.
    /// Errors mean it was already disconnected, which is the goal.
    pub fn shutdown(&self, how: Shutdown) {
        let _ = match &self.socket {
            Socket::Tcp(stream) => stream.shutdown(how),
            Socket::Unix(stream) => stream.shutdown(how),
        };
    }

    pub fn is_tls(&self) -> bool {
        self.tls.get().is_some()
    }

    /// The socket's descriptor, for the lobby's event loop.
    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        self.socket.raw_fd()
    }

    /// A TLS session over this socket, for the handshake the client starts
    /// after our NBD_REP_ACK to NBD_OPT_STARTTLS. The caller steps it
    /// (`TlsSession::handshake`) until done, then hands it to
    /// [`Transport::adopt_tls`].
    pub fn new_tls_session(&self, config: &crate::tls::TlsConfig) -> io::Result<TlsSession> {
        assert!(!self.is_tls(), "TLS started twice on one connection");
        TlsSession::new(config, self.socket.try_clone()?)
    }

    /// Carries every later byte over `session`, whose handshake is done.
    pub fn adopt_tls(&self, session: TlsSession) {
        if self.tls.set(Mutex::new(session)).is_err() {
            panic!("TLS started twice on one connection");
        }
    }

    /// The TLS session's protocol and cipher, for logs; None in plain text.
    pub fn tls_description(&self) -> Option<String> {
        self.tls_session().map(|session| session.describe())
    }

    /// One read attempt that never waits: the bytes read (0 at end of
    /// stream), or what to wait for before trying again.
    pub fn try_read(&self, buf: &mut [u8]) -> Result<usize, Blocked> {
        loop {
            let attempt = match self.tls_session() {
                Some(mut session) => session.read(buf),
                None => {
                    plain_read(&self.socket, buf).map_err(|e| Blocked::waiting(e, libc::POLLIN))
                }
            };
            match attempt {
                Err(Blocked::Failed(error)) if error.kind() == io::ErrorKind::Interrupted => {}
                other => return other,
            }
        }
    }

    fn tls_session(&self) -> Option<MutexGuard<'_, TlsSession>> {
        // A panic under this lock cannot leave the session half-updated in
        // a way a later call could misread: OpenSSL keeps its own state.
        self.tls
            .get()
            .map(|m| m.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }

    /// Reads some bytes (0 at end of stream), waiting at most until
    /// `deadline`, after which it fails with `TimedOut`.
    pub fn read(&self, buf: &mut [u8], deadline: Option<Instant>) -> io::Result<usize> {
        loop {
            let attempt = match self.tls_session() {
                Some(mut session) => session.read(buf),
                None => {
                    plain_read(&self.socket, buf).map_err(|e| Blocked::waiting(e, libc::POLLIN))
                }
            };
            match attempt {
                Ok(count) => return Ok(count),
                Err(Blocked::On(events)) => self.wait(events, deadline)?,
                Err(Blocked::Failed(error)) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(Blocked::Failed(error)) => return Err(error),
            }
        }
    }

    /// Writes as much of `buf` as the socket takes without waiting, and
    /// returns how much that was (0 if it takes nothing now).
    pub fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        let mut written = 0;
        while written < buf.len() {
            let attempt = match self.tls_session() {
                Some(mut session) => session.write(&buf[written..]),
                None => plain_write(&self.socket, &buf[written..])
                    .map_err(|e| Blocked::waiting(e, libc::POLLOUT)),
            };
            match attempt {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(count) => written += count,
                Err(Blocked::On(_)) => break,
                Err(Blocked::Failed(error)) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(Blocked::Failed(error)) => return Err(error),
            }
        }
        Ok(written)
    }

    /// Writes all of `buf`. `give_up` is asked, whenever the socket cannot
    /// take more, how long it has been since the last byte went out; once
    /// it says true the write fails with `TimedOut`.
    pub fn write_all(&self, mut buf: &[u8], give_up: Patience<'_>) -> io::Result<()> {
        let mut progress = Instant::now();
        while !buf.is_empty() {
            let attempt = match self.tls_session() {
                Some(mut session) => session.write(buf),
                None => {
                    plain_write(&self.socket, buf).map_err(|e| Blocked::waiting(e, libc::POLLOUT))
                }
            };
            match attempt {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(count) => {
                    buf = &buf[count..];
                    progress = Instant::now();
                }
                Err(Blocked::On(events)) => {
                    if give_up(progress.elapsed()) {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!(
                                "the client took no reply data for {:.1} s",
                                progress.elapsed().as_secs_f64()
                            ),
                        ));
                    }
                    self.wait(events, Some(Instant::now() + POLL_SLICE))
                        .or_else(|e| match e.kind() {
                            io::ErrorKind::TimedOut => Ok(()),
                            _ => Err(e),
                        })?;
                }
                Err(Blocked::Failed(error)) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(Blocked::Failed(error)) => return Err(error),
            }
        }
        Ok(())
    }

    /// Waits until the socket is ready for `events` or `deadline` passes.
    fn wait(&self, events: libc::c_short, deadline: Option<Instant>) -> io::Result<()> {
        let timeout_ms = match deadline {
            None => -1,
            Some(deadline) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client did not answer in time",
                    ));
                }
                left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int
            }
        };
        let mut fd = libc::pollfd {
            fd: self.socket.raw_fd(),
            events,
            revents: 0,
        };
        // SAFETY: one valid pollfd that outlives the call, count 1.
        let result = unsafe { libc::poll(&mut fd, 1, timeout_ms) };
        if result < 0 {
            let error = io::Error::last_os_error();
            if error.kind() != io::ErrorKind::Interrupted {
                return Err(error);
            }
        }
        // Readiness, an error or a hangup all mean: try the call again; it
        // then returns the data, the error or end of stream.
        Ok(())
    }

    /// The stream as `Read`, each read waiting at most until `deadline`.
    pub fn reader(&self, deadline: Option<Instant>) -> TransportReader<'_> {
        TransportReader {
            transport: self,
            deadline,
        }
    }
}

/// [`Transport`] as a `Read` with a deadline (set per phase: the
/// handshake has one, transmission has none).
pub(crate) struct TransportReader<'a> {
    transport: &'a Transport,
    pub deadline: Option<Instant>,
}

impl Read for TransportReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.transport.read(buf, self.deadline)
    }
}
