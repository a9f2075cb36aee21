//! zdisk-nbd: the NBD protocol server for zdisk, serving any
//! [`zdisk_core::BlockDevice`] over TCP or a Unix socket.
//!
//! The wire format's bytes are laid out in `zdisk-nbd-wire` (shared with
//! zdisk's NBD client); this crate holds the server's side of the protocol
//! (fixed newstyle handshake, simple and structured replies,
//! `base:allocation` block status). It knows nothing of how the device
//! stores data: engine errors arrive as [`zdisk_core::Error`] values and are
//! mapped to NBD errno values at this boundary only.
//!
//! Code map:
//! - [`wire`]: `zdisk_nbd_wire::wire` (every protocol constant, pure
//!   parsers and encoders) re-exported, plus the `zdisk:compression` bits
//!   of an engine extent.
//! - `handshake`: option haggling up to the transmission phase, one
//!   option at a time.
//! - `lobby`: the event loop that accepts connections and runs every
//!   handshake (TLS included) without a thread per connection.
//! - `admission`: the handshake budget, in total and per source address,
//!   and who is dropped when it is full; the fair TLS queue.
//! - `counters`: connection counters for statistics, rate-limited logs.
//! - `request`: what a request means and whether the session allows it.
//! - `reply`: running a request on the device, encoding its reply, errno
//!   mapping.
//! - `transmission`: one connection's request loop and reply delivery.
//! - `budget`: in-flight limits per connection and for the whole server.
//! - `socket`: TCP or Unix sockets, and how a non-blocking call waits.
//! - `transport`: a connection's socket, plain or TLS, with deadlines.
//! - `tls`: credentials (X.509 or PSK) and TLS sessions.
//! - `pool`: the worker threads shared by all connections.
//! - `server`: listeners, session limits, threads, shutdown ([`Server`]).
//! - [`testing`]: a RAM device with fault injection, for tests and fuzzing.
//! - [`fuzz_handshake`] / [`fuzz_transmission`]: the real state machines
//!   over in-memory bytes, for cargo-fuzz targets.
//!
//! Architecture invariant: the handshake and transmission code run over
//! any `Read`/`Write` (the lobby feeds the same option state machine one
//! message at a time); only `server`, `lobby` and `transport` touch
//! sockets, and only `server` starts threads.

mod admission;
mod budget;
mod buffers;
mod counters;
#[cfg(any(test, feature = "testing"))]
mod fuzz;
mod handshake;
mod lobby;
mod pool;
mod reply;
mod request;
mod server;
mod session;
mod socket;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
mod tls;
mod transmission;
mod transport;
pub mod wire;

pub use counters::ServerCounters;
#[cfg(any(test, feature = "testing"))]
pub use fuzz::{fuzz_handshake, fuzz_transmission};
pub use server::{
    BoundListener, ExtraExport, ExtraExports, ListenAddr, Server, ServerConfig, ShutdownHandle,
    SHUTDOWN_REPLY_PATIENCE,
};
pub use tls::{TlsConfig, TlsCredentials, TlsMode};
