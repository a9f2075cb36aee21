//! Checkpoints: the procedure that writes the map and segment table into
//! the log and commits a root naming them.
//!
//! The dump's byte format lives in `dump.rs`; this module decides when its
//! pieces are taken, written and committed, so that the root it writes is
//! durable only once everything it points at is, and the dump it replaces
//! is given back only once nothing needs it.

use crate::dump::{build_segment, chunk_target_bytes, encode_dump, layout, DumpedSegment};
use crate::error::Result;
use crate::meta::DumpRef;
use crate::segments::SegmentState;
use crate::units::SegmentId;

impl super::Volume {
    /// Writes a checkpoint; the caller holds the maintenance lock.
    ///
    /// 1. Under the state lock: a barrier, the map snapshot, and the open
    ///    stream positions (everything appended later is replayed on recovery).
    /// 2. Sync, so every record the snapshot points at is durable.
    /// 3. Write both dump copies into fresh segments and sync.
    /// 4. Write the root into the other metadata slot and sync: the commit point.
    /// 5. Free the previous dump's segments.
    pub(crate) fn checkpoint_locked(&self, clean: bool) -> Result<()> {
        let segment_size = self.geometry.segment_size_bytes;
        let target = chunk_target_bytes(segment_size);
        let (payloads, gen, boundary, open) = {
            let mut state = self.lock();
            let gen = state.barrier()?;
            let payloads = encode_dump(
                &state.map,
                state
                    .segments
                    .iter()
                    .filter(|(_, info)| info.seq != 0 || info.state != SegmentState::Free)
                    .map(|(segment, info)| {
                        (
                            segment,
                            DumpedSegment {
                                seq: info.seq,
                                fill_bytes: info.fill_bytes,
                                max_version: info.max_version,
                            },
                        )
                    }),
                target,
            );
            (payloads, gen, state.next_seq, state.open_positions())
        };
        self.sync_to(gen)?;

        let placement = layout(&payloads, segment_size);
        let wanted = 2 * placement.len() as u64;
        let (short, ahead) = {
            let mut state = self.lock();
            // The root this checkpoint's root will overwrite stops being a
            // fallback as soon as that write starts, so its dump can make
            // room for the new one: a checkpoint never needs more than one
            // dump's worth of free space.
            let replaced = ((state.generation + 1) % 2) as usize;
            if let Some(old) = state.roots[replaced].take() {
                let other_uses = |dump: &DumpRef| {
                    state.roots[1 - replaced]
                        .as_ref()
                        .and_then(|root| root.dump.as_ref())
                        .is_some_and(|d| d.generation == dump.generation)
                };
                if let Some(dump) = old.dump.filter(|d| !other_uses(d)) {
                    for segment in dump.segments() {
                        state.segments.release(segment);
                    }
                }
            }
            (
                state.segments.reserved_count() < wanted || !state.numbering_room(wanted, 0),
                state.segment_reserve_ahead,
            )
        };
        if short {
            self.write_root(false, wanted + ahead / 2, 0)?;
        }
        // The generation is taken here but counted only once the root is
        // durable: a failed attempt must not skip a generation, or the next
        // root would overwrite the newest durable one in the same slot.
        let (copies, generation) = {
            let mut state = self.lock();
            let mut taken: Vec<(SegmentId, u64)> = Vec::with_capacity(2 * placement.len());
            while taken.len() < 2 * placement.len() {
                match state.allocate_segment() {
                    Ok(segment) => {
                        let info = state.segments.get_mut(segment);
                        info.state = SegmentState::Dump;
                        taken.push((segment, info.seq));
                    }
                    Err(error) => {
                        for (segment, _) in taken.into_iter().rev() {
                            state.segments.unallocate(segment);
                        }
                        return Err(error);
                    }
                }
            }
            let second = taken.split_off(placement.len());
            ([taken, second], state.generation + 1)
        };
        let result = self.write_dump_and_root(
            &payloads, &placement, &copies, generation, clean, boundary, &open,
        );
        let mut state = self.lock();
        let (dump, reservation) = match result {
            Ok(done) => done,
            Err(error) => {
                // Nothing refers to the new dump: its segments go back.
                for copy in copies.iter().rev() {
                    for &(segment, _) in copy.iter().rev() {
                        state.segments.unallocate(segment);
                    }
                }
                return Err(error);
            }
        };
        state.generation = generation;
        state.commit_reservation(&reservation);
        state.install_root(super::state::RetainedRoot {
            generation,
            boundary,
            open,
            dump: Some(dump),
        });
        state.log_bytes_since_checkpoint = 0;
        state.range_bytes_since_checkpoint = 0;
        // Segments cleaned while damage forced a checkpoint can go now.
        let release_gen = state.barrier_gen + 1;
        state.segments.unpark(release_gen);
        Ok(())
    }

    /// Steps 3 and 4 of a checkpoint: both dump copies, a sync, the root.
    #[allow(clippy::too_many_arguments)]
    fn write_dump_and_root(
        &self,
        payloads: &[Vec<u8>],
        placement: &[Vec<usize>],
        copies: &[Vec<(SegmentId, u64)>; 2],
        generation: u64,
        clean: bool,
        boundary: u64,
        open: &[crate::meta::OpenSegmentPos],
    ) -> Result<(DumpRef, super::state::Reservation)> {
        use crate::meta::{CheckpointRoot, Root};
        use crate::units::PageIndex;

        let page_size = self.geometry.page_size_bytes as u64;
        let mut written = 0u64;
        for copy in copies {
            for (&(segment, seq), indices) in copy.iter().zip(placement.iter()) {
                let image = build_segment(
                    payloads,
                    indices,
                    seq,
                    generation,
                    page_size,
                    &self.record_key,
                );
                self.media.write_pages(segment, PageIndex(0), &image)?;
                written += image.len() as u64;
                let mut state = self.lock();
                let info = state.segments.get_mut(segment);
                info.fill_bytes = image.len() as u64;
            }
        }
        if let Err(error) = self.media.sync() {
            // A failed sync may also have dropped data written since the
            // last one: stop writing, as a failed flush does.
            let mut state = self.lock();
            if state.failed.is_none() {
                state.failed = Some(error.to_string());
            }
            return Err(error);
        }

        let dump = DumpRef {
            copies: [
                copies[0].iter().map(|(s, _)| *s).collect(),
                copies[1].iter().map(|(s, _)| *s).collect(),
            ],
            record_count: payloads.len() as u64,
            generation,
        };
        let (root, reservation) = {
            let mut state = self.lock();
            let reservation = state.reservations_for_root(0, 0);
            state.counters.meta_write_bytes += written;
            state.counters.media_write_bytes += written;
            state.counters.checkpoints += 1;
            let root = Root {
                generation,
                superblock: self.superblock.clone(),
                settings: self.settings,
                checkpoint: CheckpointRoot {
                    clean,
                    seq_boundary: boundary,
                    next_seq: state.next_seq,
                    next_version: state.next_version,
                    seq_reserved: reservation.seq,
                    version_reserved: reservation.version,
                    reserved_segments: reservation.segments.clone(),
                    open_segments: open.to_vec(),
                    dump: Some(dump.clone()),
                    counters: state.counters,
                },
            };
            (root, reservation)
        };
        self.commit_root(&root)?;
        Ok((dump, reservation))
    }
}
