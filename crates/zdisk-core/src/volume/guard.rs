//! The state lock, and the page writer that runs when it is released.
//!
//! [`StateGuard`] is how every thread holds the state lock. Appends queue
//! whole pages instead of writing them (`outbound.rs`); when a guard is
//! dropped with queued pages nobody is writing, the dropping thread becomes
//! the page writer: it writes them to the medium outside the lock, in
//! order, and retires them under it. Whoever queued pages therefore sees
//! them on their way as soon as it lets go of the lock, and no call site
//! can forget to.
//!
//! Anything that makes the medium durable or reads it behind the lock's
//! back first waits for what was queued: [`Volume::sync_media`] before a
//! sync, [`Volume::wait_written`] before the cleaner or the checker reads
//! a sealed segment.

use std::ops::{Deref, DerefMut};
use std::sync::MutexGuard;

use crate::error::Result;

use super::outbound::WriteKind;
use super::state::State;
use super::Volume;

/// The state lock, held. Dereferences to [`State`].
pub(crate) struct StateGuard<'a> {
    volume: &'a Volume,
    guard: Option<MutexGuard<'a, State>>,
}

impl Deref for StateGuard<'_> {
    type Target = State;

    fn deref(&self) -> &State {
        self.guard.as_ref().expect("a live guard")
    }
}

impl DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut State {
        self.guard.as_mut().expect("a live guard")
    }
}

impl Drop for StateGuard<'_> {
    fn drop(&mut self) {
        let Some(mut guard) = self.guard.take() else {
            return;
        };
        // Nothing holds on to a map leaf across the lock's release.
        guard.evict_map_leaves();
        if guard.page_writes_unclaimed() || guard.page_writes_over_limit() {
            self.volume.write_out(guard);
        }
    }
}

impl Volume {
    pub(crate) fn lock(&self) -> StateGuard<'_> {
        StateGuard {
            volume: self,
            guard: Some(self.raw_lock()),
        }
    }

    fn raw_lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("volume state lock poisoned")
    }

    /// Writes queued pages while there are any and nobody else is writing
    /// them; if the queue is over its bound and another thread writes,
    /// waits for it to shrink. Write errors are recorded in the state
    /// (later writes and syncs fail), as the thread that queued the pages
    /// has already moved on.
    fn write_out<'a>(&'a self, mut guard: MutexGuard<'a, State>) {
        loop {
            if let Some(writes) = guard.claim_page_writes() {
                drop(guard);
                let mut through = 0;
                let mut failure = None;
                for write in &writes {
                    let written = match write.kind {
                        WriteKind::Pages => {
                            self.media
                                .write_pages(write.segment, write.first_page, &write.bytes)
                        }
                        WriteKind::Sectors => {
                            self.media
                                .write_sectors(write.segment, write.offset, &write.bytes)
                        }
                        WriteKind::Stage => self.media.stage_partial_page(
                            write.segment,
                            write.first_page,
                            &write.bytes,
                        ),
                    };
                    match written {
                        Ok(()) => through = write.ticket,
                        Err(error) => {
                            failure = Some(error);
                            break;
                        }
                    }
                }
                guard = self.raw_lock();
                guard.page_writes_done(through, failure.as_ref());
                self.page_written.notify_all();
                continue;
            }
            if guard.page_writes_over_limit() && guard.page_writer_busy() {
                guard = self
                    .page_written
                    .wait(guard)
                    .expect("volume state lock poisoned");
                continue;
            }
            return;
        }
    }

    /// Waits until every page write queued up to `ticket` is on the
    /// medium, writing them in this thread if nobody else is.
    pub(crate) fn wait_written(&self, ticket: u64) {
        let mut guard = self.raw_lock();
        while guard.pages_written_through() < ticket {
            if guard.page_writes_unclaimed() {
                self.write_out(guard);
                guard = self.raw_lock();
            } else {
                guard = self
                    .page_written
                    .wait(guard)
                    .expect("volume state lock poisoned");
            }
        }
    }

    /// Everything queued so far, on the medium.
    pub(crate) fn wait_all_written(&self) {
        let ticket = self.raw_lock().last_page_ticket();
        self.wait_written(ticket);
    }

    /// Makes every write queued so far durable: waits for the page writer,
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
}
