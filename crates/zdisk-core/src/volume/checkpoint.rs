//! Checkpoints: the procedure that writes the map and segment table into
//! the log and commits a root naming them.
//!
//! A dump writes only the pages that changed: a leaf changed since its
//! last page is encoded under the lock at the snapshot; a clean leaf keeps
//! its page where an earlier dump wrote it, and the new directory names
//! that place. So a checkpoint's I/O follows what the host changed, not
//! the map's size. A dump segment stays as long as a retained root lists
//! it (the root lists its own dump's segments, then the earlier ones its
//! kept pages live in: `DumpRef`), and is released when neither root
//! does. To keep dump segments from filling with pages nobody needs, a
//! clean leaf whose page lies in a segment holding less than half a
//! segment of needed pages moves with the dump: encoded if in RAM, copied
//! after the lock is released if evicted (from a segment the newest
//! durable root lists, which nothing releases before this checkpoint's
//! root is durable). So dump segments hold at least half a segment each
//! of needed pages, beside the newest dump's own. The cleaner never sees
//! a map page. Once the root is durable, the leaves unchanged since the
//! snapshot are clean at their new or kept pages (`Map::commit_pages`).
//!
//! The dump's byte format lives in `dump.rs`; this module decides when its
//! pieces are taken, written and committed, so that the root it writes is
//! durable only once everything it points at is, and the dump it replaces
//! is given back only once nothing needs it.

use crate::dump::{
    build_segment, chunk_target_bytes, encode_directory, place, DumpedSegment, Placement,
};
use crate::error::{Error, Result};
use crate::map::{read_page_payload, PageLoc, PageSource, PageStore, SnapshotPage};
use crate::meta::{DumpRef, OpenSegmentPos, RetainedRoot};
use crate::record::record_len_for_payload;
use crate::segments::SegmentState;
use crate::units::{PageIndex, SegmentId};

use super::space::{Need, Reach, Reservation, Writer};
use super::state::{State, Tally};
use super::Volume;

/// How one checkpoint attempt ended.
enum Attempt {
    Done,
    /// Renewing and flushing did not give the dump its `segments`.
    Short {
        segments: u64,
    },
}

/// The map and segment table at a barrier, encoded.
struct Snapshot {
    /// The directory and segment table's records.
    directory: Vec<Vec<u8>>,
    /// The pages it writes, in block order, after them.
    pages: Vec<SnapshotPage>,
    /// The dump segments (copy 0, copy 1) of the pages it keeps.
    kept: Vec<[SegmentId; 2]>,
    /// How many pages it keeps.
    kept_pages: u64,
    /// What copying evicted leaves' pages needs.
    source: Option<PageStore>,
    /// Segments with a sequence number at least this were opened after it.
    boundary: u64,
    /// Where the open streams stood.
    open: Vec<OpenSegmentPos>,
    /// The snapshots the map holds kept entries for.
    snapshots: crate::snapshots::Snapshots,
}

/// The dump of `state`: its map's directory and pages (those it keeps
/// included: see `OpenOptions::map_page_keep_bytes`), and every segment
/// that is not free and never used.
fn encode_state(
    state: &mut State,
    segment_size: u64,
    keep_from_bytes: u64,
) -> (Vec<Vec<u8>>, Vec<SnapshotPage>) {
    let pages = state.snapshot_map(keep_from_bytes);
    let segments = state
        .space()
        .table()
        .iter()
        .filter(|(_, info)| info.seq != 0 || info.state != SegmentState::Free)
        .map(|(segment, info)| {
            let dumped = DumpedSegment {
                seq: info.seq,
                fill_bytes: info.fill_bytes,
                max_version: info.max_version,
                cold_bytes: info.cold_bytes,
                fast_bytes: info.fast_bytes,
            };
            (segment, dumped)
        });
    let directory = encode_directory(
        &pages,
        state.map().counts(),
        segments,
        chunk_target_bytes(segment_size),
    );
    (directory, pages)
}

impl Snapshot {
    /// Every record's length: the directory's, then the pages'.
    fn record_lens(&self) -> Vec<u64> {
        let directory = self
            .directory
            .iter()
            .map(|p| record_len_for_payload(p.len()));
        let pages = self
            .pages
            .iter()
            .map(|page| record_len_for_payload(page.payload_len()));
        directory.chain(pages).collect()
    }

    /// Transient bytes it holds.
    fn bytes(&self) -> usize {
        let pages: usize = self
            .pages
            .iter()
            .map(|page| match &page.source {
                PageSource::Encoded(payload) => payload.len(),
                PageSource::Stored(_) | PageSource::Kept(_) => 0,
            })
            .sum();
        self.directory.iter().map(Vec::len).sum::<usize>() + pages
    }
}

/// Transient bytes from which a checkpoint hands the allocator's free
/// memory back to the system.
const TRIM_FROM_BYTES: usize = 8 << 20;

/// Dropped after a checkpoint's snapshot: gives the allocator's free
/// memory back to the system if the dump was large. A dump (its encoded
/// payloads and segment images) is the largest transient allocation the
/// engine makes, tens of MiB for a sparse map of a million chunks, and the
/// C allocator would otherwise keep it resident for good. Small dumps (the
/// simulator writes thousands) are not worth the system calls.
struct TrimAfter {
    transient_bytes: usize,
}

impl Drop for TrimAfter {
    fn drop(&mut self) {
        if self.transient_bytes < TRIM_FROM_BYTES {
            return;
        }
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: malloc_trim only returns free pages to the system; it
        // takes the allocator's locks itself and touches no live allocation.
        unsafe {
            libc::malloc_trim(0);
        }
    }
}

impl Volume {
    /// Checkpoints, cleaning first if the medium has no room for the dump
    /// (the checkpoint's own rungs of the ladder, renewing and flushing,
    /// run inside it; cleaning cannot, once its snapshot is taken).
    pub(super) fn checkpoint_making_room(&self, clean: bool) -> Result<()> {
        for _ in 0..=self.geometry.segment_count {
            let attempt = {
                let _maintenance = self.maintenance.lock().expect("maintenance lock poisoned");
                self.checkpoint_attempt(clean)?
            };
            let Attempt::Short { segments } = attempt else {
                return Ok(());
            };
            let need = |_: &State| Need {
                writer: Writer::Checkpoint,
                segments,
                versions: 0,
                bytes: 0,
            };
            drop(self.make_room(Reach::All, need)?);
        }
        let state = self.lock();
        Err(Error::NoSpace {
            free_segments: state.space().free_count(),
            reserved_segments: 0,
        })
    }

    /// Writes a checkpoint; the caller holds the maintenance lock. Fails
    /// with `NoSpace` if the dump finds no room.
    pub(crate) fn checkpoint_locked(&self, clean: bool) -> Result<()> {
        match self.checkpoint_attempt(clean)? {
            Attempt::Done => Ok(()),
            Attempt::Short { .. } => {
                let state = self.lock();
                Err(Error::NoSpace {
                    free_segments: state.space().free_count(),
                    reserved_segments: 0,
                })
            }
        }
    }

    /// 1. Under the state lock: a barrier, the map snapshot, and the open
    ///    stream positions (everything appended later is replayed on recovery).
    /// 2. Sync, so every record the snapshot points at is durable.
    /// 3. Take segments for both dump copies, write them and sync.
    /// 4. Write the root into the other metadata slot and sync: the commit point.
    /// 5. Free the previous dump's segments.
    fn checkpoint_attempt(&self, clean: bool) -> Result<Attempt> {
        let segment_size = self.geometry.segment_size_bytes;
        // Declared before the snapshot, so dropped after it.
        let mut trim = TrimAfter { transient_bytes: 0 };
        let (snapshot, gen) = {
            let mut state = self.lock();
            let gen = state.barrier()?;
            let keep_from_bytes = self.options.map_page_keep_bytes.unwrap_or(segment_size / 2);
            let (directory, mut pages) = encode_state(&mut state, segment_size, keep_from_bytes);
            let mut kept: Vec<[SegmentId; 2]> = pages
                .iter()
                .filter_map(|page| match page.source {
                    PageSource::Kept(loc) => Some(loc.segments),
                    _ => None,
                })
                .collect();
            let kept_pages = kept.len() as u64;
            kept.sort_unstable();
            kept.dedup();
            pages.retain(SnapshotPage::is_written);
            let snapshot = Snapshot {
                directory,
                pages,
                kept,
                kept_pages,
                source: state.map().store().cloned(),
                boundary: state.space().next_seq(),
                open: state.open_positions(),
                snapshots: state.snapshots().clone(),
            };
            (snapshot, gen)
        };
        trim.transient_bytes = snapshot.bytes() + segment_size as usize;
        self.sync_to(gen)?;

        let placement = place(&snapshot.record_lens(), segment_size);
        let wanted = 2 * placement.segments.len();
        self.lock().release_replaced_root();
        let need = |_: &State| Need {
            writer: Writer::Checkpoint,
            segments: wanted as u64,
            versions: 0,
            bytes: 0,
        };
        // The generation is taken here but counted only once the root is
        // durable: a failed attempt must not skip a generation, or the next
        // root would overwrite the newest durable one in the same slot.
        let (copies, generation) = match self.make_room(Reach::Nested, need) {
            Ok((mut state, _)) => {
                let mut first = state.acquire_dump_segments(wanted)?;
                let second = first.split_off(placement.segments.len());
                debug_assert!(
                    first.iter().all(|taken| !second.contains(taken)),
                    "the two dump copies share a segment"
                );
                ([first, second], state.generation() + 1)
            }
            Err(Error::NoSpace { .. }) => {
                return Ok(Attempt::Short {
                    segments: wanted as u64,
                })
            }
            Err(other) => return Err(other),
        };
        let written = self.write_dump_and_root(&snapshot, &placement, &copies, generation, clean);
        let mut state = self.lock();
        let (dump, reservation) = match written {
            Ok(done) => done,
            Err(error) => {
                // Nothing refers to the new dump: its segments go back.
                for copy in copies.iter().rev() {
                    state.forfeit_dump_segments(copy);
                }
                return Err(error);
            }
        };
        let store = PageStore {
            key: self.record_key,
            segment_count: self.geometry.segment_count,
            segment_size_bytes: segment_size,
        };
        let retained = RetainedRoot {
            generation,
            boundary: snapshot.boundary,
            open: snapshot.open,
            dump: Some(dump),
            snapshots: snapshot.snapshots,
        };
        state.install_root(retained, &reservation);
        let first_page = snapshot.directory.len();
        let placed: Vec<(u64, PageLoc)> = snapshot
            .pages
            .iter()
            .zip(&placement.at[first_page..])
            .map(|(page, &(position, offset))| {
                let position = position as usize;
                let loc = PageLoc {
                    segments: [copies[0][position].0, copies[1][position].0],
                    offset: offset as u32,
                    len: record_len_for_payload(page.payload_len()) as u32,
                    generation,
                };
                (page.start, loc)
            })
            .collect();
        state.commit_map_pages(&placed, snapshot.kept_pages, store);
        // Segments cleaned while damage forced a checkpoint can go now.
        state.note_checkpoint();
        Ok(Attempt::Done)
    }

    /// Steps 3 and 4 of a checkpoint: both dump copies, a sync, the root.
    fn write_dump_and_root(
        &self,
        snapshot: &Snapshot,
        placement: &Placement,
        copies: &[Vec<(SegmentId, u64)>; 2],
        generation: u64,
        clean: bool,
    ) -> Result<(DumpRef, Reservation)> {
        // The dump's segments are readied by the log writer: first that.
        self.wait_all_written();
        let page_size = self.geometry.page_size_bytes as u64;
        let first_page = snapshot.directory.len();
        let mut written = 0u64;
        for (position, indices) in placement.segments.iter().enumerate() {
            // Evicted leaves' pages, copied from the dump they were read from.
            let mut copied: Vec<Vec<u8>> = Vec::new();
            for &index in indices.iter().filter(|&&index| index >= first_page) {
                let page = &snapshot.pages[index - first_page];
                if let PageSource::Stored(loc) = page.source {
                    let source = snapshot
                        .source
                        .as_ref()
                        .expect("evicted leaves have a store");
                    copied.push(read_page_payload(&*self.media, source, page.start, loc)?);
                }
            }
            let mut copied_iter = copied.iter();
            let records: Vec<(u64, &[u8])> = indices
                .iter()
                .map(|&index| match index.checked_sub(first_page) {
                    None => (index as u64, snapshot.directory[index].as_slice()),
                    Some(page_index) => {
                        let page = &snapshot.pages[page_index];
                        let payload = match &page.source {
                            PageSource::Encoded(payload) => payload.as_slice(),
                            PageSource::Stored(_) => {
                                copied_iter.next().expect("a copied page").as_slice()
                            }
                            PageSource::Kept(_) => unreachable!("kept pages are not written"),
                        };
                        (page.start, payload)
                    }
                })
                .collect();
            for copy in copies {
                assert_eq!(
                    copy.len(),
                    placement.segments.len(),
                    "both copies have one layout"
                );
                let (segment, seq) = copy[position];
                let image = build_segment(&records, seq, generation, page_size, &self.record_key);
                self.media.write_pages(segment, PageIndex(0), &image)?;
                written += image.len() as u64;
                self.lock().note_dump_segment(segment, image.len() as u64);
            }
        }
        // A failed sync stops all writing, as a failed flush does: it may
        // also have dropped data written since the last one.
        self.sync_media()?;

        // Its own segments, then those of the pages it keeps.
        let listed = |copy: usize| -> Vec<SegmentId> {
            let own = copies[copy].iter().map(|(s, _)| *s);
            own.chain(snapshot.kept.iter().map(|pair| pair[copy]))
                .collect()
        };
        let dump = DumpRef {
            copies: [listed(0), listed(1)],
            record_count: snapshot.directory.len() as u64,
            generation,
        };
        let retained = RetainedRoot {
            generation,
            boundary: snapshot.boundary,
            open: snapshot.open.clone(),
            dump: Some(dump.clone()),
            snapshots: snapshot.snapshots.clone(),
        };
        let (root, reservation) = {
            let mut state = self.lock();
            let reservation = state.propose_reservation(0, 0);
            state.tally(Tally::DumpWritten(written));
            (
                self.root_of(&state, clean, &retained, &reservation),
                reservation,
            )
        };
        self.commit_root(&root)?;
        Ok((dump, reservation))
    }
}
