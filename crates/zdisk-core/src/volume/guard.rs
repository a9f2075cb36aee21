//! The state lock, and the log writer that does the medium's work after
//! it is released.
//!
//! [`StateGuard`] is how every thread holds the state lock. Nothing under
//! it touches the medium: appends queue whole pages, and the engine queues
//! the medium's segment events (prepare, sealed, freed) and staging writes
//! the same way (`outbound.rs`). The *log writer* drains that queue, in
//! order, outside the lock:
//!
//! - on a volume with background work, a thread of its own
//!   (`zdisk-log-writer`), woken when a guard that leaves work unclaimed
//!   is dropped;
//! - without it (tests, the crash simulator), the thread that queued the
//!   work, as it drops its guard, so that runs stay deterministic.
//!
//! A reader never writes and never waits for the queue: only a guard that
//! queued work and left the queue over its bound waits for it to shrink.
//! Anything that makes the medium durable or reads it behind the lock's
//! back first waits for what was queued (and writes it itself if nobody
//! is): [`Volume::sync_media`] before a sync, [`Volume::wait_written`]
//! before the cleaner, the checker or a checkpoint's dump.
//!
//! The lock is a reader-writer lock. Everything that changes the state
//! holds it exclusively ([`StateGuard`]); a read whose map leaves are in
//! RAM only looks, and holds it shared ([`SharedState`]), beside other
//! reads. Waits for the log writer use a [`Signal`] (a generation and its
//! own condition variable), since a condition variable cannot release a
//! reader-writer lock.
//!
//! Every hold is marked for the debug-build check (`held.rs`) and timed
//! ([`LockProfile`]).

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, RwLockReadGuard, RwLockWriteGuard, Weak};
use std::time::{Duration, Instant};

use crate::error::Result;
use crate::held::Held;

use super::outbound::{PageWrite, WriteKind};
use super::state::State;
use super::Volume;

/// How long the log writer sleeps between checks that its volume is still
/// there, when idle.
const LOG_WRITER_IDLE: Duration = Duration::from_millis(100);

/// How much the state lock was used since the volume opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LockProfile {
    /// Times the lock was taken exclusively.
    pub acquisitions: u64,
    /// Nanoseconds it was held exclusively, in total (waits on a condition
    /// excluded): the time nobody else could hold it.
    pub hold_nanos: u64,
    /// Nanoseconds threads waited to take it exclusively, in total.
    pub wait_nanos: u64,
    /// Times a read took it shared.
    pub shared_acquisitions: u64,
    /// Nanoseconds it was held shared, summed over the holders (shared
    /// holds overlap: they keep out only exclusive ones).
    pub shared_hold_nanos: u64,
    /// Nanoseconds reads waited to take it shared, in total.
    pub shared_wait_nanos: u64,
}

impl LockProfile {
    /// What was used between `before` and this profile.
    pub fn since(&self, before: &LockProfile) -> LockProfile {
        LockProfile {
            acquisitions: self.acquisitions - before.acquisitions,
            hold_nanos: self.hold_nanos - before.hold_nanos,
            wait_nanos: self.wait_nanos - before.wait_nanos,
            shared_acquisitions: self.shared_acquisitions - before.shared_acquisitions,
            shared_hold_nanos: self.shared_hold_nanos - before.shared_hold_nanos,
            shared_wait_nanos: self.shared_wait_nanos - before.shared_wait_nanos,
        }
    }
}

/// The lock's counters, each on its own cache line.
#[derive(Debug, Default)]
pub(crate) struct LockStats {
    acquisitions: Padded,
    hold_nanos: Padded,
    wait_nanos: Padded,
    shared_acquisitions: Padded,
    shared_hold_nanos: Padded,
    shared_wait_nanos: Padded,
}

#[derive(Debug, Default)]
#[repr(align(128))]
struct Padded(AtomicU64);

impl LockStats {
    pub(crate) fn profile(&self) -> LockProfile {
        LockProfile {
            acquisitions: self.acquisitions.0.load(Ordering::Relaxed),
            hold_nanos: self.hold_nanos.0.load(Ordering::Relaxed),
            wait_nanos: self.wait_nanos.0.load(Ordering::Relaxed),
            shared_acquisitions: self.shared_acquisitions.0.load(Ordering::Relaxed),
            shared_hold_nanos: self.shared_hold_nanos.0.load(Ordering::Relaxed),
            shared_wait_nanos: self.shared_wait_nanos.0.load(Ordering::Relaxed),
        }
    }
}

/// A condition the state lock's holders wait for: a generation bumped by
/// every [`Signal::notify`]. A waiter reads the generation while it holds
/// the state lock, releases the lock, and sleeps until the generation
/// moves; a notifier changes the state under the lock before it bumps, so
/// no wake-up falls between a waiter's check and its sleep.
#[derive(Debug, Default)]
pub(crate) struct Signal {
    generation: Mutex<u64>,
    changed: Condvar,
}

impl Signal {
    /// Wakes every waiter.
    pub(crate) fn notify(&self) {
        *self.generation.lock().expect("signal lock poisoned") += 1;
        self.changed.notify_all();
    }

    fn generation(&self) -> u64 {
        *self.generation.lock().expect("signal lock poisoned")
    }

    /// Sleeps until the generation is past `seen`, or `timeout` passed;
    /// true if it timed out.
    fn wait_past(&self, seen: u64, timeout: Option<Duration>) -> bool {
        let deadline = timeout.map(|timeout| Instant::now() + timeout);
        let mut generation = self.generation.lock().expect("signal lock poisoned");
        while *generation == seen {
            generation = match deadline {
                None => self.changed.wait(generation).expect("signal lock poisoned"),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return true;
                    }
                    self.changed
                        .wait_timeout(generation, deadline - now)
                        .expect("signal lock poisoned")
                        .0
                }
            };
        }
        false
    }
}

/// A guard from `tried`, else from `block`, which waits for it (that
/// wait added to `wait_nanos`); with the moment the hold began.
/// Uncontended, taking the lock costs no clock reading for the wait.
fn take_timed<G>(
    tried: std::sync::TryLockResult<G>,
    block: impl FnOnce() -> std::sync::LockResult<G>,
    wait_nanos: &Padded,
) -> (G, Instant) {
    match tried {
        Ok(guard) => (guard, Instant::now()),
        Err(std::sync::TryLockError::Poisoned(_)) => panic!("volume state lock poisoned"),
        Err(std::sync::TryLockError::WouldBlock) => {
            let asked = Instant::now();
            let guard = block().expect("volume state lock poisoned");
            let since = Instant::now();
            wait_nanos
                .0
                .fetch_add((since - asked).as_nanos() as u64, Ordering::Relaxed);
            (guard, since)
        }
    }
}

/// The state lock, held exclusively: marked for the debug check and timed.
pub(crate) struct Locked<'a> {
    guard: Option<RwLockWriteGuard<'a, State>>,
    stats: &'a LockStats,
    since: Instant,
    _held: Option<Held>,
}

impl<'a> Locked<'a> {
    fn take(volume: &'a Volume) -> Locked<'a> {
        Locked::take_marked(volume, true)
    }

    fn take_marked(volume: &'a Volume, marked: bool) -> Locked<'a> {
        let stats = &volume.lock_stats;
        let (guard, since) = take_timed(
            volume.state.try_write(),
            || volume.state.write(),
            &stats.wait_nanos,
        );
        stats.acquisitions.0.fetch_add(1, Ordering::Relaxed);
        Locked {
            guard: Some(guard),
            stats,
            since,
            _held: marked.then(|| Held::mark("state")),
        }
    }

    fn add_hold(&self) {
        self.stats
            .hold_nanos
            .0
            .fetch_add(self.since.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// Waits for `signal` with the lock released.
    fn wait(self, volume: &'a Volume, signal: &Signal) -> Locked<'a> {
        self.wait_timeout(volume, signal, None).0
    }

    /// Waits for `signal`, for at most `timeout`, with the lock released,
    /// and takes it again; true if it timed out.
    fn wait_timeout(
        self,
        volume: &'a Volume,
        signal: &Signal,
        timeout: Option<Duration>,
    ) -> (Locked<'a>, bool) {
        let seen = signal.generation();
        let marked = self._held.is_some();
        drop(self);
        let timed_out = signal.wait_past(seen, timeout);
        (Locked::take_marked(volume, marked), timed_out)
    }
}

impl Deref for Locked<'_> {
    type Target = State;

    fn deref(&self) -> &State {
        self.guard.as_ref().expect("a live guard")
    }
}

impl DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut State {
        self.guard.as_mut().expect("a live guard")
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        if self.guard.is_some() {
            self.add_hold();
        }
    }
}

/// The state lock, held shared by a read that only looks: beside other
/// such reads, never beside a change. Dereferences to [`State`]. Nothing
/// is evicted or queued under it, so dropping it does nothing more.
pub(crate) struct SharedState<'a> {
    guard: RwLockReadGuard<'a, State>,
    stats: &'a LockStats,
    since: Instant,
    _held: Held,
}

impl Deref for SharedState<'_> {
    type Target = State;

    fn deref(&self) -> &State {
        &self.guard
    }
}

impl Drop for SharedState<'_> {
    fn drop(&mut self) {
        self.stats
            .shared_hold_nanos
            .0
            .fetch_add(self.since.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

/// The state lock, held exclusively. Dereferences to [`State`].
pub(crate) struct StateGuard<'a> {
    volume: &'a Volume,
    locked: Option<Locked<'a>>,
    /// The last queued ticket when the lock was taken: work queued beyond
    /// it was queued by this holder.
    queued_from: u64,
}

impl Deref for StateGuard<'_> {
    type Target = State;

    fn deref(&self) -> &State {
        self.locked.as_ref().expect("a live guard")
    }
}

impl DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut State {
        self.locked.as_mut().expect("a live guard")
    }
}

impl Drop for StateGuard<'_> {
    fn drop(&mut self) {
        let Some(mut locked) = self.locked.take() else {
            return;
        };
        // Nothing holds on to a map leaf across the lock's release.
        locked.evict_map_leaves();
        let queued = locked.last_page_ticket() > self.queued_from;
        let volume = self.volume;
        if locked.page_writes_unclaimed() {
            if volume.log_writer_running.load(Ordering::Acquire) {
                volume.log_work.notify();
            } else if queued {
                volume.write_out(locked, true);
                return;
            }
        }
        if queued && locked.page_writes_over_limit() {
            let claim = !volume.log_writer_running.load(Ordering::Acquire);
            volume.write_out(locked, claim);
        }
    }
}

impl Volume {
    pub(crate) fn lock(&self) -> StateGuard<'_> {
        let locked = Locked::take(self);
        let queued_from = locked.last_page_ticket();
        StateGuard {
            volume: self,
            locked: Some(locked),
            queued_from,
        }
    }

    /// The state lock, shared with other readers: for a read that finds
    /// its map leaves in RAM and changes nothing.
    pub(crate) fn lock_shared(&self) -> SharedState<'_> {
        let stats = &self.lock_stats;
        let (guard, since) = take_timed(
            self.state.try_read(),
            || self.state.read(),
            &stats.shared_wait_nanos,
        );
        stats.shared_acquisitions.0.fetch_add(1, Ordering::Relaxed);
        SharedState {
            guard,
            stats,
            since,
            _held: Held::mark("state"),
        }
    }

    /// The state lock for the checker, which freezes the volume on
    /// purpose: it reads map pages and records under the lock to see one
    /// consistent volume. It runs offline (`zdisk check`) and in tests,
    /// never beside host I/O, so it is the one holder the debug check
    /// (`held.rs`) lets do I/O.
    pub(crate) fn lock_frozen(&self) -> StateGuard<'_> {
        let locked = Locked::take_marked(self, false);
        let queued_from = locked.last_page_ticket();
        StateGuard {
            volume: self,
            locked: Some(locked),
            queued_from,
        }
    }

    fn raw_lock(&self) -> Locked<'_> {
        Locked::take(self)
    }

    /// How much the state lock was used since the volume opened.
    pub fn lock_profile(&self) -> LockProfile {
        self.lock_stats.profile()
    }

    /// Writes `writes` (a claim) to the medium in order, stopping at the
    /// first failure; returns the ticket written through and the failure.
    fn perform(&self, writes: &[PageWrite]) -> (u64, Option<crate::Error>) {
        let mut through = 0;
        for write in writes {
            let media = &self.media;
            let done = match write.kind {
                WriteKind::Pages => {
                    media.write_pages(write.segment, write.first_page, &write.bytes)
                }
                WriteKind::Sectors => media
                    .staging_required()
                    .and_then(|s| s.write_sectors(write.segment, write.offset, &write.bytes)),
                WriteKind::Stage => media.drive_required().and_then(|d| {
                    d.stage_partial_page(write.segment, write.first_page, &write.bytes)
                }),
                WriteKind::Staging(slot) => media
                    .staging_required()
                    .and_then(|s| s.write_staging(slot, &write.bytes)),
                WriteKind::Prepare => media.prepare_segment(write.segment),
                WriteKind::Sealed => {
                    media.segment_sealed(write.segment, write.offset);
                    Ok(())
                }
                WriteKind::Freed => {
                    media.segment_freed(write.segment);
                    Ok(())
                }
            };
            match done {
                Ok(()) => through = write.ticket,
                Err(error) => return (through, Some(error)),
            }
        }
        (through, None)
    }

    /// Performs `writes`, the claim `locked` just made, with the lock
    /// released; retires them and returns the lock taken again.
    fn perform_claim<'a>(&'a self, locked: Locked<'a>, writes: Vec<PageWrite>) -> Locked<'a> {
        drop(locked);
        let (through, failure) = self.perform(&writes);
        // Dropped before the queue lets go of them, so that their buffers
        // come back for reuse.
        drop(writes);
        let mut locked = self.raw_lock();
        locked.page_writes_done(through, failure.as_ref());
        self.page_written.notify();
        locked
    }

    /// Claims and performs queued work while there is any (if `claim`),
    /// and while the queue is over its bound waits for whoever writes it
    /// to shrink it. Failures are recorded in the state (later writes and
    /// syncs fail), as the thread that queued the work has moved on.
    fn write_out<'a>(&'a self, mut locked: Locked<'a>, claim: bool) {
        loop {
            if claim {
                if let Some(writes) = locked.claim_page_writes() {
                    locked = self.perform_claim(locked, writes);
                    continue;
                }
            }
            if locked.page_writes_over_limit()
                && (locked.page_writer_busy() || locked.page_writes_unclaimed())
            {
                locked = locked.wait(self, &self.page_written);
                continue;
            }
            return;
        }
    }

    /// Waits until all work queued up to `ticket` is done, doing it in
    /// this thread if nobody is.
    pub(crate) fn wait_written(&self, ticket: u64) {
        let mut locked = self.raw_lock();
        while locked.pages_written_through() < ticket {
            if let Some(writes) = locked.claim_page_writes() {
                locked = self.perform_claim(locked, writes);
            } else {
                locked = locked.wait(self, &self.page_written);
            }
        }
    }

    /// Everything queued so far, done.
    pub(crate) fn wait_all_written(&self) {
        let ticket = self.raw_lock().last_page_ticket();
        self.wait_written(ticket);
    }

    /// Makes every write queued so far durable: waits for the log writer,
    /// then syncs the medium. A failed sync stops all writing, as a failed
    /// flush may have lost data written since the last one.
    pub(crate) fn sync_media(&self) -> Result<()> {
        self.wait_all_written();
        self.raw_lock().check_writable()?;
        if let Err(error) = self.media.sync() {
            self.raw_lock().note_failure(&error);
            return Err(error);
        }
        Ok(())
    }

    /// Starts the log writer thread.
    pub(crate) fn start_log_writer(self: &std::sync::Arc<Self>) -> Result<()> {
        let weak = std::sync::Arc::downgrade(self);
        self.log_writer_running.store(true, Ordering::Release);
        let handle = std::thread::Builder::new()
            .name("zdisk-log-writer".into())
            .spawn(move || log_writer_loop(weak));
        match handle {
            Ok(handle) => {
                *self.log_writer.lock().expect("log writer lock") = Some(handle);
                Ok(())
            }
            Err(e) => {
                self.log_writer_running.store(false, Ordering::Release);
                Err(crate::Error::io("starting the log writer thread", e))
            }
        }
    }

    /// Stops the log writer once the queue is empty, and waits for it.
    pub(crate) fn stop_log_writer(&self) {
        {
            let _locked = self.raw_lock();
            self.log_work.notify();
        }
        let handle = self.log_writer.lock().expect("log writer lock").take();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
    }
}

/// The log writer thread: performs queued work in order until its volume
/// stops or goes away. Holds its volume only while awake, so that dropping
/// the last handle drops the volume.
fn log_writer_loop(volume: Weak<Volume>) {
    loop {
        let Some(strong) = volume.upgrade() else {
            return;
        };
        let volume_ref: &Volume = &strong;
        let mut locked = volume_ref.raw_lock();
        loop {
            if let Some(writes) = locked.claim_page_writes() {
                locked = volume_ref.perform_claim(locked, writes);
                continue;
            }
            if volume_ref.stop.load(Ordering::SeqCst) {
                // Under the lock: a guard dropped from now on sees the
                // writer gone and writes what it queued itself.
                volume_ref
                    .log_writer_running
                    .store(false, Ordering::Release);
                return;
            }
            let (relocked, timed_out) =
                locked.wait_timeout(volume_ref, &volume_ref.log_work, Some(LOG_WRITER_IDLE));
            locked = relocked;
            if timed_out {
                break;
            }
        }
        drop(locked);
    }
}
