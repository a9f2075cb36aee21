//! Buffers a connection reuses for read replies and write payloads.
//!
//! A fresh buffer is zeroed before the device or the socket fills it; for
//! large sequential reads that memset was 8% of the server's profile. A
//! connection keeps a few finished buffers and hands them out again with
//! their old bytes, which are overwritten before anyone reads them: a read
//! reply is filled by the device (or replaced by an error reply), a write
//! payload by `read_exact`.
//!
//! Invariants:
//! - A buffer only ever returns to the connection it came from, so old
//!   bytes in it are the same client's own data.
//! - Kept buffers are bounded per connection (`KEPT_PER_CONNECTION` of at
//!   most `KEPT_BYTES_MAX`) and for the whole process (`KEPT_TOTAL_MAX`),
//!   outside the in-flight budgets, which count only requests in flight.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Enough for a client reading 1 MiB at a queue depth of 16: with 4 kept,
/// a queue of 8 made half of its replies fresh allocations (zeroed, page
/// faulted, unmapped again), and 1 MiB sequential reads took 9% more
/// server CPU per byte than with 16. Kept
/// buffers are what the same connection had in flight at once, so this
/// raises idle memory, never the peak.
const KEPT_PER_CONNECTION: usize = 64;
/// Smaller buffers cost little to zero; larger ones are not kept.
const KEPT_BYTES_MIN: usize = 64 << 10;
const KEPT_BYTES_MAX: usize = 4 << 20;
const KEPT_TOTAL_MAX: usize = 64 << 20;

/// Bytes kept by every connection of the process.
static KEPT_TOTAL: AtomicUsize = AtomicUsize::new(0);

#[derive(Default)]
pub(crate) struct Buffers {
    kept: Mutex<Vec<Vec<u8>>>,
}

impl Buffers {
    /// A buffer of `len` bytes holding whatever it held before (zeros
    /// where it is new). The caller overwrites all of it.
    pub(crate) fn take(&self, len: usize) -> Vec<u8> {
        let reused = if len >= KEPT_BYTES_MIN {
            self.kept
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .pop()
        } else {
            None
        };
        let Some(mut buffer) = reused else {
            return vec![0; len];
        };
        KEPT_TOTAL.fetch_sub(buffer.capacity(), Ordering::Relaxed);
        if buffer.len() >= len {
            buffer.truncate(len);
        } else {
            buffer.resize(len, 0);
        }
        buffer
    }

    /// Keeps `buffer` for a later `take` if there is room; drops it otherwise.
    pub(crate) fn give(&self, buffer: Vec<u8>) {
        let capacity = buffer.capacity();
        if !(KEPT_BYTES_MIN..=KEPT_BYTES_MAX).contains(&capacity) {
            return;
        }
        let mut kept = self
            .kept
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if kept.len() >= KEPT_PER_CONNECTION {
            return;
        }
        let total = KEPT_TOTAL.fetch_add(capacity, Ordering::Relaxed);
        if total + capacity > KEPT_TOTAL_MAX {
            KEPT_TOTAL.fetch_sub(capacity, Ordering::Relaxed);
            return;
        }
        kept.push(buffer);
    }
}

impl Drop for Buffers {
    fn drop(&mut self) {
        let kept = self
            .kept
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let bytes: usize = kept.iter().map(Vec::capacity).sum();
        KEPT_TOTAL.fetch_sub(bytes, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_with_the_asked_length_and_stay_bounded() {
        let buffers = Buffers::default();
        let mut first = buffers.take(1 << 20);
        assert_eq!(first.len(), 1 << 20);
        first.fill(7);
        let address = first.as_ptr();
        buffers.give(first);
        let again = buffers.take(256 << 10);
        assert_eq!(again.len(), 256 << 10);
        assert_eq!(again.as_ptr(), address, "the kept buffer was reused");
        assert!(again.iter().all(|&b| b == 7), "no zeroing on reuse");
        buffers.give(again);
        let grown = buffers.take(2 << 20);
        assert_eq!(grown.len(), 2 << 20);
        assert!(
            grown[256 << 10..].iter().all(|&b| b == 0),
            "new bytes are zeros"
        );
        // Small and huge buffers are not kept; at most a few per connection.
        buffers.give(vec![0; 100]);
        buffers.give(vec![0; 8 << 20]);
        for _ in 0..KEPT_PER_CONNECTION + 6 {
            buffers.give(vec![0; 1 << 20]);
        }
        assert_eq!(buffers.kept.lock().unwrap().len(), KEPT_PER_CONNECTION);
        assert_eq!(buffers.take(100).len(), 100);
    }
}
