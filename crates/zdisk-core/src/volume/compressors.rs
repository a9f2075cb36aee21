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

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::codec::Effort;

/// How hard host writes compress (issue #27; `serve --write-effort`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WriteEffort {
    /// Full effort while compression keeps up, cheaper as requests queue
    /// for the cores ([`effort_for`]). The cold-data pass rewrites what was
    /// written cheaply first, so only the speed of a burst depends on it,
    /// not the ratio the volume ends up with. Without the pass
    /// (`--recompress off`, and on emulated drives) it is `Full`.
    #[default]
    Adaptive,
    /// Always the codec's own effort: every byte is written once, for
    /// media where wear matters more than a burst's speed.
    Full,
    /// Always fast effort (for measuring it, and for tests).
    Fast,
    /// Always stored raw for the idle pass (for measuring it, and for
    /// tests).
    Deferred,
}

impl WriteEffort {
    pub fn parse(text: &str) -> Result<WriteEffort, String> {
        match text {
            "adaptive" => Ok(WriteEffort::Adaptive),
            "full" => Ok(WriteEffort::Full),
            "fast" => Ok(WriteEffort::Fast),
            "deferred" => Ok(WriteEffort::Deferred),
            other => Err(format!(
                "unknown write effort {other:?}: use adaptive, full, fast or deferred"
            )),
        }
    }
}

impl fmt::Display for WriteEffort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WriteEffort::Adaptive => "adaptive",
            WriteEffort::Full => "full",
            WriteEffort::Fast => "fast",
            WriteEffort::Deferred => "deferred",
        })
    }
}

/// An adaptive write may be deferred only while at least this share of
/// the medium's segments is free (one in `DEFER_FREE_SHARE`): a raw write
/// takes about twice the room of a compressed one until the idle pass
/// comes, and must not be what fills a thin volume's medium.
pub(crate) const DEFER_FREE_SHARE: u64 = 4;

/// The effort a write takes under `policy` when `compressing` requests,
/// this one included, are compressing on a machine of `cpus` cores, with
/// `roomy` true while the medium has room to defer
/// ([`DEFER_FREE_SHARE`]). A function of that state alone, so a run that
/// replays the same queue (the simulator's, one request at a time) makes
/// the same choice. Adaptive writes:
/// - compress at full effort while a core is idle;
/// - at fast effort once the requests compressing are as many as the
///   cores: full effort would only queue writes behind the compressor;
/// - are stored raw, their compression deferred to the idle pass, once
///   they are twice as many (every core has a request waiting for it),
///   while the medium has room; at fast effort when it has not.
pub(crate) fn effort_for(
    policy: WriteEffort,
    compressing: usize,
    cpus: usize,
    roomy: bool,
) -> Effort {
    let cpus = cpus.max(1);
    match policy {
        WriteEffort::Full => Effort::Full,
        WriteEffort::Fast => Effort::Fast,
        WriteEffort::Deferred => Effort::Deferred,
        WriteEffort::Adaptive if compressing >= 2 * cpus && roomy => Effort::Deferred,
        WriteEffort::Adaptive if compressing >= cpus => Effort::Fast,
        WriteEffort::Adaptive => Effort::Full,
    }
}

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

/// Counts the requests compressing now, to tell idle cores from busy ones,
/// and chooses each write's effort from that count.
#[derive(Debug, Default)]
pub(crate) struct Compressors {
    active: AtomicUsize,
    policy: WriteEffort,
    /// The medium has room for deferred writes ([`Compressors::note_room`]).
    roomy: AtomicBool,
}

impl Compressors {
    pub fn new(policy: WriteEffort) -> Compressors {
        Compressors {
            active: AtomicUsize::new(0),
            policy,
            roomy: AtomicBool::new(false),
        }
    }

    /// Notes how many of the medium's `segments` are `free` (after each
    /// write, under the state lock): whether adaptive writes may defer.
    pub fn note_room(&self, free: u64, segments: u64) {
        self.roomy
            .store(free * DEFER_FREE_SHARE >= segments, Ordering::Relaxed);
    }

    /// The policy writes follow.
    pub fn policy(&self) -> WriteEffort {
        self.policy
    }

    /// Runs `work` for a request of `blocks` blocks. `work(parts, effort)`
    /// gets how many parts to split into (1: compress on this thread) and
    /// the effort to compress at; with more than one part it runs on the
    /// compression pool.
    pub fn compress<T: Send>(
        &self,
        blocks: usize,
        work: impl FnOnce(usize, Effort) -> T + Send,
    ) -> T {
        let others = self.active.fetch_add(1, Ordering::AcqRel);
        let roomy = self.roomy.load(Ordering::Relaxed);
        let effort = effort_for(self.policy, others + 1, cpus(), roomy);
        let idle = cpus().saturating_sub(others);
        let result = if blocks >= PARALLEL_MIN_BLOCKS {
            pool().install(|| work(idle.max(1), effort))
        } else {
            work(1, effort)
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
        let (theirs, name) = compressors.compress(PARALLEL_MIN_BLOCKS, |_, _| {
            let tid = unsafe { libc::syscall(libc::SYS_gettid) } as libc::id_t;
            let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid) };
            (nice, std::thread::current().name().map(String::from))
        });
        assert!(name.unwrap_or_default().starts_with("zdisk-compress-"));
        assert_eq!(theirs, (mine + COMPRESS_NICE).min(19));
        let small = compressors.compress(1, |_, _| std::thread::current().name().map(String::from));
        assert!(
            !small.unwrap_or_default().starts_with("zdisk-compress-"),
            "small writes stay home"
        );
    }

    #[test]
    fn adaptive_effort_goes_fast_when_every_core_is_compressing_and_defers_beyond() {
        use WriteEffort::*;
        for cpus in [1, 2, 4, 8] {
            for compressing in 1..=3 * cpus {
                for roomy in [false, true] {
                    let adaptive = effort_for(Adaptive, compressing, cpus, roomy);
                    let expected = if compressing >= 2 * cpus && roomy {
                        Effort::Deferred
                    } else if compressing >= cpus {
                        Effort::Fast
                    } else {
                        Effort::Full
                    };
                    assert_eq!(adaptive, expected, "{compressing} on {cpus}, {roomy}");
                    for (policy, effort) in [
                        (Full, Effort::Full),
                        (Fast, Effort::Fast),
                        (Deferred, Effort::Deferred),
                    ] {
                        assert_eq!(effort_for(policy, compressing, cpus, roomy), effort);
                    }
                }
            }
        }
        // One request at a time (the simulator's queue) compresses fully
        // wherever there is a second core.
        assert_eq!(effort_for(Adaptive, 1, 2, true), Effort::Full);
        for text in ["adaptive", "full", "fast", "deferred"] {
            assert_eq!(WriteEffort::parse(text).unwrap().to_string(), text);
        }
        assert!(WriteEffort::parse("hard")
            .unwrap_err()
            .contains("adaptive, full, fast or deferred"));
    }

    #[test]
    fn deferring_needs_a_quarter_of_the_segments_free() {
        let compressors = Compressors::new(WriteEffort::Adaptive);
        let busy = 2 * cpus();
        let effort_now = |compressors: &Compressors| {
            effort_for(
                compressors.policy(),
                busy,
                cpus(),
                compressors.roomy.load(Ordering::Relaxed),
            )
        };
        assert_eq!(effort_now(&compressors), Effort::Fast, "unknown room: no");
        compressors.note_room(25, 100);
        assert_eq!(effort_now(&compressors), Effort::Deferred);
        compressors.note_room(24, 100);
        assert_eq!(effort_now(&compressors), Effort::Fast);
    }
}
