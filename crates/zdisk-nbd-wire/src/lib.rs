//! zdisk-nbd-wire: the NBD wire format, and the one NBD client zdisk's
//! tools and tests use.
//!
//! Code map:
//! - [`wire`]: every protocol constant, and pure parsers and encoders for
//!   both sides (the server in `zdisk-nbd` uses the server's half).
//! - [`client`]: a blocking client over TCP or a Unix socket, from an
//!   `nbd://` or `nbd+unix://` URI: fixed newstyle handshake with
//!   NBD_OPT_GO, simple and structured replies, metadata contexts, and
//!   read, write, flush, trim, write zeroes and block status. Its
//!   low-level half (options, requests and replies one at a time, and the
//!   raw stream) is what the protocol tests drive the server with.
//!
//! API boundary: this crate depends on nothing of zdisk (no engine, no
//! server, no TLS), so a client of any NBD export (zdisk-kv, the
//! benchmark's write-ahead log, tests) needs only it.

pub mod client;
pub mod wire;

pub use client::{Address, ClientError, Config, Connection, Export};
