//! zdisk-nbd: the NBD protocol server for zdisk, serving any
//! [`zdisk_core::BlockDevice`] over TCP or a Unix socket.
//!
//! This crate is the only place in zdisk that knows the NBD wire format
//! (fixed newstyle handshake, simple and structured replies,
//! `base:allocation` block status). It knows nothing of how the device
//! stores data: engine errors arrive as [`zdisk_core::Error`] values and are
//! mapped to NBD errno values at this boundary only.
//!
//! Code map:
//! - [`wire`]: every protocol constant, and pure parsers/encoders.
//! - `handshake`: option haggling up to the transmission phase.
//! - `transmission`: request checking, execution, replies, per-connection
//!   in-flight limits.
//! - `pool`: the worker threads shared by all connections.
//! - `server`: sockets, connection threads, shutdown ([`Server`]).
//! - [`testing`]: a RAM device with fault injection, for tests and fuzzing.
//! - [`fuzz_handshake`] / [`fuzz_transmission`]: the real state machines
//!   over in-memory bytes, for cargo-fuzz targets.
//!
//! Architecture invariant: the handshake and transmission code run over
//! any `Read`/`Write`; only `server` touches sockets and threads.

#[cfg(any(test, feature = "testing"))]
mod fuzz;
mod handshake;
mod pool;
mod server;
// A few helpers in these serve only the fuzz entry points.
#[cfg_attr(not(any(test, feature = "testing")), allow(dead_code))]
mod session;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
#[cfg_attr(not(any(test, feature = "testing")), allow(dead_code))]
mod transmission;
pub mod wire;

#[cfg(any(test, feature = "testing"))]
pub use fuzz::{fuzz_handshake, fuzz_transmission};
pub use server::{ListenAddr, Server, ServerConfig, ShutdownHandle};
