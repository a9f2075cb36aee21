//! The server's connection counters, for statistics and `/metrics`, and a
//! log that a flood of connections cannot flood.
//!
//! Counters are atomics bumped by the lobby thread and read by anyone
//! holding the [`ServerCounters`] handle ([`crate::Server::counters`]).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How often a summary line may be logged per kind of event.
const LOG_PERIOD: Duration = Duration::from_secs(10);
/// Lines logged one by one in a period before the rest are only counted.
const LOG_BURST: u64 = 5;

macro_rules! counters {
    ($( $(#[$doc:meta])* $name:ident: $kind:literal, $help:literal, )*) => {
        /// What the server has seen of its connections since it started.
        #[derive(Debug, Default)]
        pub struct ServerCounters {
            $( $(#[$doc])* pub $name: AtomicU64, )*
        }

        impl ServerCounters {
            /// Every figure: name, value, "counter" or "gauge", one-line meaning.
            pub fn snapshot(&self) -> Vec<(&'static str, u64, &'static str, &'static str)> {
                vec![$( (stringify!($name), self.$name.load(Ordering::Relaxed), $kind, $help), )*]
            }
        }
    };
}

counters! {
    /// Connections accepted (each starts a handshake).
    connections_accepted: "counter", "connections accepted; each starts a handshake",
    /// Handshakes that reached transmission: established sessions.
    handshakes_completed: "counter", "handshakes that reached transmission (sessions established)",
    /// Handshakes the client ended or broke (closed, aborted, protocol error).
    handshakes_failed: "counter", "handshakes the client ended or broke (closed, aborted, protocol error, failed TLS)",
    /// Handshakes not finished within the handshake timeout.
    handshakes_timed_out: "counter", "handshakes dropped for not finishing within --handshake-timeout",
    /// Waiting connections dropped because their source had too many waiting.
    evicted_per_source: "counter", "waiting connections dropped because their source address had --max-handshakes-per-address waiting",
    /// Waiting connections dropped because the lobby was full.
    evicted_lobby_full: "counter", "waiting connections dropped because --max-handshakes were waiting",
    /// Waiting connections dropped to free a file descriptor.
    evicted_for_fds: "counter", "waiting connections dropped to free a file descriptor when accept found none",
    /// TLS handshakes dropped to give their slot to a queued connection.
    evicted_tls_slot: "counter", "TLS handshakes dropped, their client being the slowest, to give the slot to a queued one",
    /// Connections accepted and closed at once: no descriptor to keep them.
    dropped_no_fds: "counter", "connections accepted and closed at once because the process had no file descriptor left",
    /// Times accept failed for want of file descriptors or memory.
    accept_exhausted: "counter", "times accept failed for want of file descriptors (EMFILE, ENFILE) or memory",
    /// Connections told the server has too many established sessions.
    refused_busy: "counter", "connections refused because --max-connections sessions were established",
    /// TLS handshakes started.
    tls_handshakes_started: "counter", "TLS handshakes started",
    /// Connections in their handshake now.
    handshakes_waiting: "gauge", "connections in their handshake now",
    /// TLS handshakes in progress now.
    tls_handshakes_running: "gauge", "TLS handshakes in progress now",
    /// Established sessions now.
    sessions: "gauge", "established sessions now",
}

/// One kind of event logged without flooding the log: the first few lines
/// of each period one by one, then a count of the rest in one line when
/// the next event comes after the period.
#[derive(Debug)]
pub(crate) struct Tally {
    what: &'static str,
    period_start: Option<Instant>,
    logged: u64,
    unlogged: u64,
}

impl Tally {
    pub const fn new(what: &'static str) -> Tally {
        Tally {
            what,
            period_start: None,
            logged: 0,
            unlogged: 0,
        }
    }

    /// Logs one event (a warning if `warn`), or counts it.
    pub fn note(&mut self, warn: bool, detail: fmt::Arguments<'_>) {
        let now = Instant::now();
        if self
            .period_start
            .is_none_or(|start| now.duration_since(start) >= LOG_PERIOD)
        {
            if self.unlogged > 0 {
                log::warn!(
                    target: "zdisk_nbd",
                    "{}: {} more in the last {} s, not logged one by one",
                    self.what,
                    self.unlogged,
                    LOG_PERIOD.as_secs()
                );
            }
            self.period_start = Some(now);
            self.logged = 0;
            self.unlogged = 0;
        }
        if self.logged < LOG_BURST {
            self.logged += 1;
            if warn {
                log::warn!(target: "zdisk_nbd", "{}: {detail}", self.what);
            } else {
                log::info!(target: "zdisk_nbd", "{}: {detail}", self.what);
            }
        } else {
            self.unlogged += 1;
        }
    }
}

/// Adds one to a counter.
pub(crate) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}
