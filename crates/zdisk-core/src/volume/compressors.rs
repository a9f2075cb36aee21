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
//!
//! Reads come first when both want the cores: every large write (from
//! `PARALLEL_MIN_BLOCKS` blocks) compresses on the pool, whose threads run
//! at a lower CPU priority (`COMPRESS_NICE`, +5), so that a streaming writer
//! that keeps every core compressing no longer makes a 4 KiB read wait a
//! whole time slice for one. Small writes compress on their own thread at
//! normal priority: a hand-off would cost them more than they gain. The
//! priority only matters when the cores are contended; alone, the writer
//! runs as fast as before.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Requests at least this many blocks long may be split.
pub(crate) const PARALLEL_MIN_BLOCKS: usize = 32;

/// The nice value the compression threads add to the process's: CFS then
/// gives a runnable reader about three times their share of a core. In
/// one A/B run of `scripts/mixed-rw.py` (issue #23), +10 gave reads more
/// but cost a streaming writer 28%; +5 cost it 13%.
pub(crate) const COMPRESS_NICE: i32 = 5;

/// The pool large requests compress on, one thread per CPU (up to 8).
fn pool() -> &'static rayon::ThreadPool {
    static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(cpus())
            .thread_name(|index| format!("zdisk-compress-{index}"))
            .start_handler(|_| lower_this_threads_priority(COMPRESS_NICE))
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
        let result = if blocks >= PARALLEL_MIN_BLOCKS {
            pool().install(|| work(idle.max(1)))
        } else {
            work(1)
        };
        self.active.fetch_sub(1, Ordering::AcqRel);
        result
    }
}

/// Lowers the calling thread's CPU priority by `by` nice steps (Linux
/// keeps a nice value per thread). Best effort: on failure the thread
/// keeps its priority.
fn lower_this_threads_priority(by: i32) {
    #[cfg(target_os = "linux")]
    // SAFETY: plain system calls on the calling thread, no pointers.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        *libc::__errno_location() = 0;
        let now = libc::getpriority(libc::PRIO_PROCESS, tid);
        if *libc::__errno_location() == 0 {
            libc::setpriority(libc::PRIO_PROCESS, tid, (now + by).min(19));
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = by;
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn large_writes_compress_on_threads_of_lower_priority() {
        let mine = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
        let compressors = Compressors::default();
        let (theirs, name) = compressors.compress(PARALLEL_MIN_BLOCKS, |_| {
            let tid = unsafe { libc::syscall(libc::SYS_gettid) } as libc::id_t;
            let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid) };
            (nice, std::thread::current().name().map(String::from))
        });
        assert!(name.unwrap_or_default().starts_with("zdisk-compress-"));
        assert_eq!(theirs, (mine + COMPRESS_NICE).min(19));
        let small = compressors.compress(1, |_| std::thread::current().name().map(String::from));
        assert!(
            !small.unwrap_or_default().starts_with("zdisk-compress-"),
            "small writes stay home"
        );
    }
}
