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
//! Every hold is marked for the debug-build check (`held.rs`) and timed
//! ([`LockProfile`]).

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, MutexGuard, Weak};
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
    /// Times the lock was taken.
    pub acquisitions: u64,
    /// Nanoseconds it was held, in total (waits on a condition excluded).
    pub hold_nanos: u64,
    /// Nanoseconds threads waited to take it, in total.
    pub wait_nanos: u64,
}

/// The lock's counters, each on its own cache line.
#[derive(Debug, Default)]
pub(crate) struct LockStats {
    acquisitions: Padded,
    hold_nanos: Padded,
    wait_nanos: Padded,
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
        }
    }
}

/// The state mutex, held: marked for the debug check and timed.
pub(crate) struct Locked<'a> {
    guard: Option<MutexGuard<'a, State>>,
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
        // Uncontended, the lock costs no clock reading to take.
        let (guard, since) = match volume.state.try_lock() {
            Ok(guard) => (guard, Instant::now()),
            Err(std::sync::TryLockError::Poisoned(_)) => panic!("volume state lock poisoned"),
            Err(std::sync::TryLockError::WouldBlock) => {
                let asked = Instant::now();
                let guard = volume.state.lock().expect("volume state lock poisoned");
                let since = Instant::now();
                stats
                    .wait_nanos
                    .0
                    .fetch_add((since - asked).as_nanos() as u64, Ordering::Relaxed);
                (guard, since)
            }
        };
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

    /// Waits on `condvar` (which releases the lock meanwhile).
    fn wait(mut self, condvar: &Condvar) -> Locked<'a> {
        self.add_hold();
        let guard = self.guard.take().expect("a live guard");
        self.guard = Some(condvar.wait(guard).expect("volume state lock poisoned"));
        self.since = Instant::now();
        self
    }

    /// Waits on `condvar` for at most `timeout`; true if it timed out.
    fn wait_timeout(mut self, condvar: &Condvar, timeout: Duration) -> (Locked<'a>, bool) {
        self.add_hold();
        let guard = self.guard.take().expect("a live guard");
        let (guard, result) = condvar
            .wait_timeout(guard, timeout)
            .expect("volume state lock poisoned");
        self.guard = Some(guard);
        self.since = Instant::now();
        (self, result.timed_out())
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

/// The state lock, held. Dereferences to [`State`].
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
                volume.log_work.notify_one();
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
                WriteKind::Sectors => {
                    media.write_sectors(write.segment, write.offset, &write.bytes)
                }
                WriteKind::Stage => {
                    media.stage_partial_page(write.segment, write.first_page, &write.bytes)
                }
                WriteKind::Staging(slot) => media.write_staging(slot, &write.bytes),
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
    fn perform_claim<'a>(&'a self, locked: Locked<'a>, writes: &[PageWrite]) -> Locked<'a> {
        drop(locked);
        let (through, failure) = self.perform(writes);
        let mut locked = self.raw_lock();
        locked.page_writes_done(through, failure.as_ref());
        self.page_written.notify_all();
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
                    locked = self.perform_claim(locked, &writes);
                    continue;
                }
            }
            if locked.page_writes_over_limit()
                && (locked.page_writer_busy() || locked.page_writes_unclaimed())
            {
                locked = locked.wait(&self.page_written);
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
                locked = self.perform_claim(locked, &writes);
            } else {
                locked = locked.wait(&self.page_written);
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
            self.log_work.notify_all();
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
                locked = volume_ref.perform_claim(locked, &writes);
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
            let (relocked, timed_out) = locked.wait_timeout(&volume_ref.log_work, LOG_WRITER_IDLE);
            locked = relocked;
            if timed_out {
                break;
            }
        }
        drop(locked);
    }
}
