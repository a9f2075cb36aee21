//! Who compresses a write: its own thread, or its own thread's request
//! spread over the cores that are idle.
//!
//! Compression is where a write's CPU goes, and it runs before the state
//! lock is taken. With several requests in flight (a deep queue, several
//! connections) each compresses on its own thread and the cores are busy
//! anyway; splitting them would only add hand-offs. A large request that
//! finds cores idle (one client writing big requests one at a time) is
//! split across a fixed pool of compression threads, started once per
//! process: no thread is created per request.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Requests at least this many blocks long may be split.
pub(crate) const PARALLEL_MIN_BLOCKS: usize = 32;

/// The pool large requests are split across, one thread per CPU (up to 8).
fn pool() -> &'static rayon::ThreadPool {
    static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(cpus())
            .thread_name(|index| format!("zdisk-compress-{index}"))
            .build()
            .expect("starting the compression threads")
    })
}

/// The CPUs this process may use, up to 8 (asked once: the query reads
/// cgroup files on Linux).
pub(crate) fn cpus() -> usize {
    static CPUS: OnceLock<usize> = OnceLock::new();
    *CPUS.get_or_init(|| {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(8)
    })
}

/// Counts the requests compressing now, to tell idle cores from busy ones.
#[derive(Debug, Default)]
pub(crate) struct Compressors {
    active: AtomicUsize,
}

impl Compressors {
    /// Runs `work` for a request of `blocks` blocks. `work(parts)` gets how
    /// many parts to split into (1: compress on this thread); with more
    /// than one it runs on the compression pool.
    pub fn compress<T: Send>(&self, blocks: usize, work: impl FnOnce(usize) -> T + Send) -> T {
        let others = self.active.fetch_add(1, Ordering::AcqRel);
        let idle = cpus().saturating_sub(others);
        let result = if blocks >= PARALLEL_MIN_BLOCKS && idle > 1 {
            pool().install(|| work(idle))
        } else {
            work(1)
        };
        self.active.fetch_sub(1, Ordering::AcqRel);
        result
    }
}
