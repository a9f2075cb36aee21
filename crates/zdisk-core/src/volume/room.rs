//! Making room: climbing the one ladder that `Space::next_rung` describes.
//!
//! Every caller that needs segments, sequence numbers or versions comes
//! through [`Volume::make_room`]: host writes and trims (this is how they
//! are throttled when space runs short: the writer's own thread cleans),
//! the cleaner before it relocates a victim, a checkpoint before it takes
//! segments for its dump. The background thread climbs one rung of the
//! same ladder per tick ([`Volume::maintenance_tick`]). The decisions are
//! `space.rs`'s; this file only carries them out.

use crate::error::{Error, Result};
use crate::units::Lba;

use super::clean::Cleaning;
use super::guard::StateGuard;
use super::space::{Climbed, Need, Reach, Rung, Writer};
use super::state::State;
use super::Volume;

impl Volume {
    /// Climbs the ladder until `need_of` (asked again under the state lock
    /// at every rung, as the streams move) can go ahead; returns the state
    /// lock then, with the number of free segments the writer must leave.
    /// `Reach::Nested` is for callers that hold the maintenance lock in the
    /// middle of a cleaning step or a checkpoint. Fails with `NoSpace` at
    /// the top of the ladder.
    pub(crate) fn make_room(
        &self,
        reach: Reach,
        need_of: impl Fn(&State) -> Need,
    ) -> Result<(StateGuard<'_>, u64)> {
        self.make_room_resident(reach, &[], need_of)
    }

    /// [`Volume::make_room`], returning the lock with the map leaves of
    /// `ranges` in RAM, read without the lock (`fault.rs`): what the
    /// caller changes under it never reads the medium.
    pub(crate) fn make_room_resident(
        &self,
        reach: Reach,
        ranges: &[(Lba, u64)],
        need_of: impl Fn(&State) -> Need,
    ) -> Result<(StateGuard<'_>, u64)> {
        let mut climbed = Climbed::default();
        // Rungs climbed while nothing changed anywhere: the bound that
        // stops a climb going round in circles. Under contention a writer
        // may climb many more: each flush or cleaning step it takes makes
        // room that other writers may take first.
        let stalled_max = 4 * self.geometry.segment_count as u64 + 16;
        let mut stalled = 0u64;
        let mut last_mark = None;
        // Where space stood the last time this climb reached the top.
        let mut last_full = None;
        loop {
            let state = self.make_resident(self.lock(), ranges)?;
            state.check_writable()?;
            let mark = state.space().progress_mark();
            if last_mark != Some(mark) {
                last_mark = Some(mark);
                stalled = 0;
            }
            let need = need_of(&state);
            let host = matches!(need.writer, Writer::Host { .. } | Writer::Range);
            if host && state.is_closing() {
                return Err(Error::ShutDown);
            }
            let floor = state.floor(need.writer);
            let interval = self.options.checkpoint_interval_bytes;
            let Some(rung) = state.next_rung(&need, reach, &climbed, interval) else {
                return Ok((state, floor));
            };
            let full = Error::NoSpace {
                free_segments: state.space().free_count(),
                reserved_segments: floor,
            };
            drop(state);
            if stalled >= stalled_max {
                return Err(full);
            }
            stalled += 1;
            if rung == Rung::Full {
                // Other threads may be cleaning meanwhile: this thread's
                // cleaning step finds nothing when another writer just
                // cleaned the victim worth cleaning, whose space comes
                // back at the next barrier. While space keeps changing,
                // wait for the cleaning step under way and climb again;
                // only a top reached twice with nothing changed is full.
                if reach == Reach::Nested || last_full == Some(mark) {
                    return Err(full);
                }
                last_full = Some(mark);
                drop(self.maintenance.lock().expect("maintenance lock poisoned"));
                climbed.restart();
                continue;
            }
            if host && matches!(rung, Rung::Flush | Rung::Clean { .. }) {
                // The background thread may help too.
                self.poke();
            }
            let progress = self.climb(rung, reach, Cleaning::Foreground)?;
            climbed.note(rung, progress);
        }
    }

    /// Climbs one rung. Returns false if a cleaning step found nothing to
    /// clean.
    pub(crate) fn climb(&self, rung: Rung, reach: Reach, who: Cleaning) -> Result<bool> {
        match rung {
            Rung::Renew { segments, versions } => {
                self.renew_reservations(segments, versions, reach)?;
                Ok(true)
            }
            Rung::Flush => self.flush().map(|()| true),
            Rung::Clean { min_garbage_bytes } => {
                assert_eq!(reach, Reach::All, "cleaning inside a cleaning step");
                self.clean_one_by(min_garbage_bytes, who)
            }
            Rung::Checkpoint => {
                assert_eq!(reach, Reach::All, "a checkpoint inside a checkpoint");
                // A checkpoint that finds no room either has still freed
                // what it could; the ladder goes on.
                match self.checkpoint() {
                    Ok(()) | Err(Error::NoSpace { .. }) => Ok(true),
                    Err(other) => Err(other),
                }
            }
            Rung::Full => unreachable!("the top of the ladder is not climbed"),
        }
    }

    /// Writes a root to renew the reservations of sequence numbers,
    /// versions and segments, for at least `min_segments` segments and
    /// `min_versions` versions, unless another thread did meanwhile.
    fn renew_reservations(&self, min_segments: u64, min_versions: u64, reach: Reach) -> Result<()> {
        let _maintenance = match reach {
            Reach::All => Some(self.maintenance.lock().expect("maintenance lock poisoned")),
            Reach::Nested => None,
        };
        let ahead = {
            let state = self.lock();
            let space = state.space();
            if !space.reservation_short(min_segments, min_versions) {
                return Ok(());
            }
            if space.versions_exhausted(min_versions) {
                return Err(Error::InvalidArgument(
                    "the volume has used up its 2^48 versions; copy its data to a new image".into(),
                ));
            }
            space.ahead()
        };
        // Ahead of what is asked, so that renewals stay rare.
        self.write_root(false, min_segments + ahead.segments / 2, min_versions)
    }

    /// One round of background work, one rung of the ladder for
    /// `Writer::Background`; returns true if it did something.
    pub fn maintenance_tick(&self) -> Result<bool> {
        if self.read_only {
            return Ok(false);
        }
        let active = self.gc_active();
        let rung = {
            let state = self.lock();
            // Enough for a host write to open a segment and the cleaner
            // to follow it.
            let low = self
                .gc_low_free_segments
                .max(state.floor(Writer::Host { blocks: 0 }) + 2);
            let high = self.gc_high_free_segments.max(low + 1);
            let need = Need {
                writer: Writer::Background { low, high, active },
                segments: 0,
                versions: 0,
                bytes: 0,
            };
            let interval = self.options.checkpoint_interval_bytes;
            state.next_rung(&need, Reach::All, &Climbed::default(), interval)
        };
        match rung {
            None => {
                self.set_gc_active(false);
                Ok(false)
            }
            Some(rung @ (Rung::Renew { .. } | Rung::Checkpoint)) => {
                self.climb(rung, Reach::All, Cleaning::Background)
            }
            Some(Rung::Full) => {
                // A rate-capped recycling engine is still busy.
                self.set_gc_active(true);
                Ok(false)
            }
            Some(rung @ (Rung::Flush | Rung::Clean { .. })) => {
                self.set_gc_active(true);
                let worked = self.climb(rung, Reach::All, Cleaning::Background)?;
                if !worked {
                    self.set_gc_active(false);
                }
                Ok(worked)
            }
        }
    }
}
