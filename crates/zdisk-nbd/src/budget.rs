//! What clients may hold in flight: the memory of READ and WRITE buffers,
//! which a client controls by what it asks for and how fast it takes its
//! replies.
//!
//! Two limits, both taken by a connection's reader before it reads a
//! request's payload or dispatches it, and given back when the reply has
//! been sent (or dropped, if the connection failed):
//! - per connection ([`InFlight`]): a number of requests and a number of
//!   buffer bytes. A client that stops reading its replies therefore stops
//!   itself: its reader waits here, and nobody else does.
//! - for the whole server ([`MemoryBudget`]): buffer bytes over all
//!   connections, so many connections cannot add up to more than the
//!   operator allowed. Its last quarter is kept for connections that hold
//!   little (at most [`SMALL_HOLDING_BYTES`]): clients with big requests,
//!   stalled ones among them, can fill at most three quarters, so they can
//!   slow but never starve clients doing ordinary I/O.
//!
//! A request larger than a limit is admitted when nothing else holds that
//! limit, so no valid request can wait forever. Memory is therefore bounded
//! by the server-wide budget plus one request.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// How often a waiting reader looks again at whether it should stop.
const STOP_CHECK: Duration = Duration::from_millis(100);
/// A connection holding at most this much (with the request it asks for)
/// may use the server's reserve (see the module documentation).
pub(crate) const SMALL_HOLDING_BYTES: usize = 16 * 1024 * 1024;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Counters only: a panic while one is held leaves them consistent.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Buffer bytes held by all connections together.
#[derive(Debug)]
pub(crate) struct MemoryBudget {
    limit_bytes: usize,
    used_bytes: Mutex<usize>,
    freed: Condvar,
}

impl MemoryBudget {
    pub fn new(limit_bytes: usize) -> MemoryBudget {
        assert!(limit_bytes > 0, "a memory budget must allow something");
        MemoryBudget {
            limit_bytes,
            used_bytes: Mutex::new(0),
            freed: Condvar::new(),
        }
    }

    /// An unlimited budget, for callers that bound memory otherwise (the fuzzer).
    #[cfg(any(test, feature = "testing"))]
    pub fn unlimited() -> MemoryBudget {
        MemoryBudget::new(usize::MAX)
    }

    /// Takes `bytes` for a connection that will then hold `holding` bytes,
    /// if they fit under its cap (or nothing is held at all), waiting at
    /// most `patience`. Returns whether it took them.
    fn take(&self, bytes: usize, holding: usize, patience: Duration) -> bool {
        let cap = if holding <= SMALL_HOLDING_BYTES {
            self.limit_bytes
        } else {
            self.limit_bytes - self.limit_bytes / 4
        };
        let mut used = lock(&self.used_bytes);
        let fits = |used: usize| used == 0 || used.saturating_add(bytes) <= cap;
        if !fits(*used) {
            used = self
                .freed
                .wait_timeout_while(used, patience, |used| !fits(*used))
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
            if !fits(*used) {
                return false;
            }
        }
        *used += bytes;
        true
    }

    fn give_back(&self, bytes: usize) {
        let mut used = lock(&self.used_bytes);
        assert!(*used >= bytes, "gave back more than was taken");
        *used -= bytes;
        drop(used);
        self.freed.notify_all();
    }

    #[cfg(test)]
    pub fn used_bytes(&self) -> usize {
        *lock(&self.used_bytes)
    }
}

/// Limits on what one connection may have in flight at once.
#[derive(Debug, Clone, Copy)]
pub(crate) struct InFlightLimits {
    pub max_requests: usize,
    pub max_buffer_bytes: usize,
}

#[derive(Default)]
struct Held {
    requests: usize,
    buffer_bytes: usize,
}

/// One connection's dispatched-but-unanswered requests and their buffers.
/// Only the connection's reader acquires; replies release from any thread.
pub(crate) struct InFlight {
    limits: InFlightLimits,
    held: Mutex<Held>,
    changed: Condvar,
    server: Arc<MemoryBudget>,
}

impl InFlight {
    pub fn new(limits: InFlightLimits, server: Arc<MemoryBudget>) -> InFlight {
        assert!(
            limits.max_requests > 0,
            "a connection needs room for one request"
        );
        InFlight {
            limits,
            held: Mutex::new(Held::default()),
            changed: Condvar::new(),
            server,
        }
    }

    /// Waits until a request with `buffer_bytes` fits this connection's
    /// limits and the server's budget, and takes it. Returns false, having
    /// taken nothing, if `stop()` turned true while waiting.
    pub fn acquire(&self, buffer_bytes: usize, stop: &dyn Fn() -> bool) -> bool {
        let fits = |held: &Held| {
            held.requests < self.limits.max_requests
                && (held.requests == 0
                    || held.buffer_bytes.saturating_add(buffer_bytes)
                        <= self.limits.max_buffer_bytes)
        };
        loop {
            let mut held = lock(&self.held);
            while !fits(&held) {
                if stop() {
                    return false;
                }
                held = self
                    .changed
                    .wait_timeout(held, STOP_CHECK)
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .0;
            }
            // Only this connection's reader adds to `held`, so the room
            // found above stays while the server's budget is asked.
            let holding = held.buffer_bytes.saturating_add(buffer_bytes);
            drop(held);
            if buffer_bytes == 0 || self.server.take(buffer_bytes, holding, STOP_CHECK) {
                let mut held = lock(&self.held);
                held.requests += 1;
                held.buffer_bytes += buffer_bytes;
                debug_assert!(held.requests <= self.limits.max_requests);
                return true;
            }
            if stop() {
                return false;
            }
        }
    }

    pub fn release(&self, buffer_bytes: usize) {
        let mut held = lock(&self.held);
        assert!(held.requests > 0, "release without acquire");
        assert!(
            held.buffer_bytes >= buffer_bytes,
            "released more bytes than held"
        );
        held.requests -= 1;
        held.buffer_bytes -= buffer_bytes;
        drop(held);
        if buffer_bytes > 0 {
            self.server.give_back(buffer_bytes);
        }
        self.changed.notify_all();
    }

    /// Waits until every acquired request has been released.
    pub fn wait_idle(&self) {
        let mut held = lock(&self.held);
        while held.requests > 0 {
            held = self
                .changed
                .wait(held)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }
}

#[cfg(test)]
mod tests {
    //! The admission rules, with threads where a wait is the point.

    use super::*;
    use std::thread;

    const LIMITS: InFlightLimits = InFlightLimits {
        max_requests: 2,
        max_buffer_bytes: 100,
    };

    #[test]
    fn a_connection_waits_for_its_own_room_only() {
        let server = Arc::new(MemoryBudget::new(1000));
        let one = InFlight::new(LIMITS, Arc::clone(&server));
        let other = InFlight::new(LIMITS, Arc::clone(&server));
        assert!(one.acquire(60, &|| false));
        // 60 + 60 > 100: this connection is full, and waits until stopped.
        assert!(!one.acquire(60, &|| true));
        // Another connection is not affected.
        assert!(other.acquire(60, &|| false));
        assert_eq!(server.used_bytes(), 120);
        one.release(60);
        other.release(60);
        assert_eq!(server.used_bytes(), 0);
        // Alone, a request may exceed the connection's byte limit.
        assert!(one.acquire(500, &|| false));
        one.release(500);
    }

    #[test]
    fn big_holders_leave_the_last_quarter_to_small_ones() {
        const MIB: usize = 1 << 20;
        let server = Arc::new(MemoryBudget::new(64 * MIB));
        let limits = InFlightLimits {
            max_requests: 8,
            max_buffer_bytes: 128 * MIB,
        };
        let big = InFlight::new(limits, Arc::clone(&server));
        // 3 × 16 MiB: the third makes this connection hold 48 MiB, over the
        // 48 MiB that big holders may fill (64 less a quarter) only if more.
        for _ in 0..3 {
            assert!(big.acquire(16 * MIB, &|| false));
        }
        assert!(
            !big.acquire(16 * MIB, &|| true),
            "a big holder took the reserve"
        );
        let small = InFlight::new(limits, Arc::clone(&server));
        assert!(
            small.acquire(4 * MIB, &|| false),
            "the reserve was not there"
        );
        assert!(small.acquire(4 * MIB, &|| false));
        assert_eq!(server.used_bytes(), 56 * MIB);
    }

    #[test]
    fn the_server_budget_bounds_all_connections() {
        let server = Arc::new(MemoryBudget::new(100));
        let one = InFlight::new(LIMITS, Arc::clone(&server));
        let other = Arc::new(InFlight::new(LIMITS, Arc::clone(&server)));
        assert!(one.acquire(80, &|| false));
        assert!(!other.acquire(30, &|| true), "over the server budget");
        let waiter = {
            let other = Arc::clone(&other);
            thread::spawn(move || other.acquire(30, &|| false))
        };
        thread::sleep(Duration::from_millis(50));
        assert!(!waiter.is_finished(), "admitted over the server budget");
        one.release(80);
        assert!(waiter.join().unwrap());
        assert_eq!(server.used_bytes(), 30);
        other.release(30);
        other.wait_idle();
    }
}
