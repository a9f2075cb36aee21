//! How blocks are stored: hole, zero, raw or compressed (with which codec,
//! alone or in a unit, and how small), for NBD's `zdisk:compression`
//! context and `zdisk map`.
//!
//! The map knows where each block's record lies, its length and the
//! block's place in it, but not the codec, which only the record's header
//! names. So the map is walked a window of data blocks at a time under the
//! state lock, and the headers of that window's records are read after it
//! is released, one small read per record. A call stops once it has
//! `max_extents` runs or has looked at `DATA_BLOCKS_PER_CALL` data blocks;
//! the caller asks again from where it stopped, as NBD clients do.
//!
//! A header read races with the cleaner, which may move the record and
//! reuse its segment meanwhile: a header that is not the record the map
//! pointed at is not believed, and the run says the codec is unknown.
//!
//! A snapshot's or a clone's export is described the same way, from the
//! entries it sees (`State::view_entry`, in runs cut where any of the maps
//! it looks at changes); a record it sees may name the block in another
//! key space (a clone's, or a snapshot's the cleaner rewrote it for).

use std::collections::hash_map::Entry::Vacant;
use std::collections::HashMap;
use std::ops::ControlFlow;

use crate::codec::CodecId;
use crate::device::{Stored, StoredExtent};
use crate::error::Error;
use crate::error::Result;
use crate::map::{key_block, table_key, Entry, Location, Slot};
use crate::record::{RecordHeader, RecordKind, HEADER_SIZE, RAW_RECORD_LEN};
use crate::units::{Lba, SegmentId, BLOCK_SIZE_U64};

use super::Volume;

/// Data blocks looked up before their headers are read.
const WINDOW_DATA_BLOCKS: u64 = 4096;
/// Data blocks one call describes at most (1 GiB of data).
const DATA_BLOCKS_PER_CALL: u64 = 1 << 18;
/// Blocks of the map one window spans at most (4 GiB logical): its leaves
/// are read back first when they are paged out, so this bounds what one
/// window brings into the map cache.
const WINDOW_SPAN_BLOCKS: u64 = 1 << 20;
/// The same for a snapshot, whose runs are cut from the maps of up to one
/// space per newer snapshot besides the volume's, all walked before the
/// window's first run is classified: what one hold of the lock costs.
const SNAPSHOT_WINDOW_SPAN_BLOCKS: u64 = 1 << 16;

type Headers = HashMap<(SegmentId, u32), Option<RecordHeader>>;

pub(crate) use super::state::View;

/// What one window of the map holds, found under the state lock.
struct Window {
    found: Vec<Found>,
    /// Headers of records still in a stream's buffer.
    headers: Headers,
    /// The block after the window.
    next: u64,
    data_blocks: u64,
}

/// A run found in the map, before its headers are read.
enum Found {
    Known(Stored, u64),
    Data {
        lba: Lba,
        blocks: u64,
        loc: Location,
        /// The block shares its content: the record names another block.
        shared: bool,
    },
}

impl Volume {
    /// Runs of equally stored blocks from `offset`, clipped to
    /// `offset..offset + len`; see the module documentation.
    pub(crate) fn stored_runs(
        &self,
        view: View,
        offset: u64,
        len: u64,
        max_extents: usize,
    ) -> Result<Vec<StoredExtent>> {
        if len == 0 {
            return Ok(Vec::new());
        }
        let max_extents = max_extents.max(1);
        let first = offset / BLOCK_SIZE_U64;
        let end = (offset + len).div_ceil(BLOCK_SIZE_U64);
        let mut runs: Vec<(Stored, u64)> = Vec::new();
        let mut cursor = first;
        let mut data_blocks = 0u64;
        while cursor < end && runs.len() <= max_extents && data_blocks < DATA_BLOCKS_PER_CALL {
            let window = self.look_up_window(view, Lba(cursor), end)?;
            let headers = self.read_headers(&window.found, window.headers);
            for piece in window.found {
                let (stored, blocks) = match piece {
                    Found::Known(stored, blocks) => (stored, blocks),
                    Found::Data {
                        lba,
                        blocks,
                        loc,
                        shared,
                    } => {
                        let header = headers.get(&loc.record_key()).copied().flatten();
                        (classify(view, lba, loc, shared, header), blocks)
                    }
                };
                match runs.last_mut() {
                    Some((last, n)) if *last == stored => *n += blocks,
                    _ => runs.push((stored, blocks)),
                }
            }
            debug_assert!(window.next > cursor, "every window moves on");
            cursor = window.next;
            data_blocks += window.data_blocks;
        }
        runs.truncate(max_extents);
        Ok(super::clip_runs(offset, len, runs)
            .map(|(length_bytes, stored)| StoredExtent {
                length_bytes,
                stored,
            })
            .collect())
    }

    /// Under the state lock: the runs from `from` up to about
    /// `WINDOW_DATA_BLOCKS` data blocks, within `WINDOW_SPAN_BLOCKS`.
    fn look_up_window(&self, view: View, from: Lba, end: u64) -> Result<Window> {
        let span = match view {
            View::Volume => WINDOW_SPAN_BLOCKS,
            View::Snapshot(_) | View::Clone(..) => SNAPSHOT_WINDOW_SPAN_BLOCKS,
        };
        let end = end.min(from.0 + span);
        let mut found = Vec::new();
        let mut headers = HashMap::new();
        let mut next = from.0;
        let mut window_data = 0u64;
        let mut partial = Vec::new();
        // Every snapshot's space comes with the volume's blocks.
        let state = self.lock_resident(from, end - from.0)?;
        let visit = |lba: Lba, blocks: u64, entry: Entry| {
            // A shared block is stored where its content's cell says.
            let (slot, shared) = match entry.slot() {
                Slot::Shared { content } => match state.map().get(table_key(content)).slot() {
                    Slot::Data(loc) => (Slot::Data(loc), true),
                    _ => (Slot::Damaged, true),
                },
                slot => (slot, false),
            };
            let piece = match slot {
                Slot::Hole => Found::Known(Stored::Hole, blocks),
                Slot::Shared { .. } => Found::Known(Stored::Damaged, blocks),
                Slot::Zero => Found::Known(Stored::Zero, blocks),
                Slot::Damaged => Found::Known(Stored::Damaged, blocks),
                Slot::Data(loc) => {
                    if let Vacant(slot) = headers.entry(loc.record_key()) {
                        // A record partly on the medium is left to
                        // `read_headers`, outside the lock, unless its
                        // header is in RAM.
                        if let Ok(Some(buffered)) = state.read_buffered(loc) {
                            match buffered.in_ram() {
                                Some(bytes) => {
                                    slot.insert(RecordHeader::decode(bytes).ok());
                                }
                                None => partial.push(buffered),
                            }
                        }
                    }
                    window_data += blocks;
                    Found::Data {
                        lba,
                        blocks,
                        loc,
                        shared,
                    }
                }
            };
            found.push(piece);
            next = lba.0 + blocks;
            match window_data >= WINDOW_DATA_BLOCKS {
                true => ControlFlow::Break(()),
                false => ControlFlow::Continue(()),
            }
        };
        match view {
            View::Volume => state.map().for_each_run(from, end - from.0, visit),
            view => {
                if !state.view_exists(view) {
                    return Err(Error::InvalidArgument(
                        "the snapshot or clone was deleted meanwhile".into(),
                    ));
                }
                state.for_each_view_run(view, from, end - from.0, visit);
            }
        }
        drop(state);
        for buffered in partial {
            let key = buffered.loc().record_key();
            let header = buffered
                .complete(&*self.media)
                .ok()
                .and_then(|bytes| RecordHeader::decode(&bytes).ok());
            headers.insert(key, header);
        }
        Ok(Window {
            found,
            headers,
            next: next.min(end),
            data_blocks: window_data,
        })
    }

    /// Reads the header of every record in `found` not already in `headers`.
    fn read_headers(&self, found: &[Found], mut headers: Headers) -> Headers {
        let mut bytes = [0u8; HEADER_SIZE];
        for piece in found {
            let Found::Data { loc, .. } = piece else {
                continue;
            };
            headers.entry(loc.record_key()).or_insert_with(|| {
                self.media
                    .read(loc.segment, loc.offset as u64, &mut bytes)
                    .ok()
                    .and_then(|()| RecordHeader::decode(&bytes).ok())
            });
        }
        headers
    }
}

/// How block `lba`, the member of the record at `loc` (written for
/// another block if `shared`), is stored; the record's header names its
/// codec if it is the record the map expects.
fn classify(
    view: View,
    lba: Lba,
    loc: Location,
    shared: bool,
    header: Option<RecordHeader>,
) -> Stored {
    let share = loc.share();
    let size_sixteenths = (share * 16).div_ceil(BLOCK_SIZE_U64).clamp(1, 16) as u8;
    let unit = loc.members > 1;
    let header = header.filter(|header| {
        let kind = if unit {
            RecordKind::Unit
        } else {
            RecordKind::Data
        };
        // A shared block's record names its owner or its content's cell;
        // one a snapshot keeps may name the block in the snapshot's space.
        let named = match view {
            View::Volume => header.lba,
            View::Snapshot(_) | View::Clone(..) => key_block(header.lba),
        };
        header.kind == kind && (shared || lba.0.checked_sub(loc.member as u64) == Some(named))
    });
    let codec = header.and_then(|header| header.codec_id());
    let raw = match codec {
        Some(codec) => codec == CodecId::Raw,
        // Unknown: a lone record as long as a raw block is one.
        None => !unit && loc.len as u64 >= RAW_RECORD_LEN,
    };
    if raw {
        Stored::Raw {
            size_sixteenths,
            shared,
        }
    } else {
        Stored::Compressed {
            codec,
            unit,
            size_sixteenths,
            shared,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::Codec;
    use crate::device::BlockDevice;
    use crate::media::{Media, MemMedia};
    use crate::volume::{CreateOptions, OpenOptions};
    use rand::{RngCore, SeedableRng};
    use std::sync::Arc;

    const MIB: u64 = 1 << 20;

    fn volume(codec: Codec) -> Arc<Volume> {
        volume_with_map_cache(codec, None)
    }

    fn volume_with_map_cache(codec: Codec, map_cache_bytes: Option<u64>) -> Arc<Volume> {
        let media: Arc<dyn Media> = Arc::new(MemMedia::with_size(4096, MIB, 32).unwrap());
        // Its blocks repeat: without dedup, so each is described as stored.
        let create = CreateOptions {
            codec,
            unit_blocks: crate::meta::default_unit_blocks(codec),
            dedup: false,
            ..CreateOptions::new(64 * MIB)
        };
        let options = OpenOptions {
            background: false,
            map_cache_bytes,
            ..OpenOptions::default()
        };
        Volume::create(media, create, options).unwrap()
    }

    fn text(len: usize) -> Vec<u8> {
        b"how is this stored? compressed, in a unit. "
            .iter()
            .cycle()
            .take(len)
            .copied()
            .collect()
    }

    #[test]
    fn runs_say_hole_zero_raw_and_compressed_with_the_codec() {
        for (codec, id) in [
            (Codec::Lz4, CodecId::Lz4),
            (Codec::Zstd { level: 3 }, CodecId::Zstd),
        ] {
            let volume = volume(codec);
            let mut random = vec![0u8; MIB as usize];
            rand::rngs::SmallRng::seed_from_u64(1).fill_bytes(&mut random);
            volume.write(0, &text(MIB as usize), false).unwrap();
            volume.write_zeroes(MIB, MIB, false, false).unwrap();
            volume.write(2 * MIB, &random, false).unwrap();
            // A lone block: compressed alone, not in a unit.
            volume.write(4 * MIB, &text(4096), false).unwrap();
            volume.write(5 * MIB, &text(MIB as usize), false).unwrap();
            volume.trim(5 * MIB, MIB / 2, false).unwrap();
            // Half of these records are still in the stream's buffer.
            let runs = volume.stored_status(0, 8 * MIB, 100).unwrap();
            let kinds: Vec<(u64, Stored)> =
                runs.iter().map(|r| (r.length_bytes, r.stored)).collect();
            let tiny = 1; // text shrinks to the smallest class
            assert_eq!(
                kinds,
                vec![
                    (
                        MIB,
                        Stored::Compressed {
                            codec: Some(id),
                            unit: true,
                            size_sixteenths: tiny,
                            shared: false,
                        }
                    ),
                    (MIB, Stored::Zero),
                    (
                        MIB,
                        Stored::Raw {
                            size_sixteenths: 16,
                            shared: false,
                        }
                    ),
                    (MIB, Stored::Hole),
                    (
                        4096,
                        Stored::Compressed {
                            codec: Some(id),
                            unit: false,
                            size_sixteenths: tiny,
                            shared: false,
                        }
                    ),
                    (MIB - 4096 + MIB / 2, Stored::Hole),
                    (
                        MIB / 2,
                        Stored::Compressed {
                            codec: Some(id),
                            unit: true,
                            size_sixteenths: tiny,
                            shared: false,
                        }
                    ),
                    (2 * MIB, Stored::Hole),
                ],
                "{codec}"
            );
            // The same after everything reached the medium and a restart of
            // the lookup mid-way: unaligned, one extent at most.
            volume.flush().unwrap();
            let one = volume.stored_status(MIB + 100, 3 * MIB, 1).unwrap();
            assert_eq!(
                one,
                vec![StoredExtent {
                    length_bytes: MIB - 100,
                    stored: Stored::Zero
                }]
            );
            let end = volume.stored_status(8 * MIB - 10, 10, 5).unwrap();
            assert_eq!(end.len(), 1);
            assert_eq!(end[0].length_bytes, 10);
        }
    }

    #[test]
    fn paged_out_map_leaves_are_read_back_to_describe_them() {
        // A map cache of 0 evicts every clean leaf whenever the state lock
        // is released, so after the checkpoint every leaf is on the medium.
        let volume = volume_with_map_cache(Codec::Lz4, Some(0));
        let mut random = vec![0u8; MIB as usize];
        rand::rngs::SmallRng::seed_from_u64(3).fill_bytes(&mut random);
        volume.write(0, &text(MIB as usize), false).unwrap();
        volume.write(2 * MIB, &random, false).unwrap();
        volume.checkpoint().unwrap();
        let before = volume.stats();
        assert!(before.map_paged_leaves > 0, "the leaves must be paged out");
        let runs = volume.stored_status(0, 8 * MIB, 100).unwrap();
        let kinds: Vec<(u64, bool, bool)> = runs
            .iter()
            .map(|r| {
                let compressed = matches!(r.stored, Stored::Compressed { .. });
                let raw = matches!(r.stored, Stored::Raw { .. });
                (r.length_bytes, compressed, raw)
            })
            .collect();
        assert_eq!(
            kinds,
            vec![
                (MIB, true, false),
                (MIB, false, false),
                (MIB, false, true),
                (5 * MIB, false, false)
            ]
        );
        assert!(
            volume.stats().map_cache_misses > before.map_cache_misses,
            "describing the range must have read pages back"
        );
    }

    #[test]
    fn a_large_range_is_described_in_bounded_calls() {
        let volume = volume(Codec::Lz4);
        // Pairs of text and of random blocks, alternating: one run per
        // pair (lz4 units are two blocks).
        let mut data = Vec::new();
        let mut rng = rand::rngs::SmallRng::seed_from_u64(2);
        for block in 0..2048 {
            let mut piece = text(4096);
            if block / 2 % 2 == 1 {
                rng.fill_bytes(&mut piece);
            }
            data.extend(piece);
        }
        volume.write(0, &data, false).unwrap();
        let runs = volume.stored_status(0, 64 * MIB, 300).unwrap();
        assert_eq!(runs.len(), 300);
        let covered: u64 = runs.iter().map(|r| r.length_bytes).sum();
        assert_eq!(covered, 300 * 2 * 4096, "stopped at the 300th run");
        // The whole volume, asked again from where each answer stopped.
        let mut offset = 0;
        let mut raw_bytes = 0;
        while offset < 64 * MIB {
            let runs = volume
                .stored_status(offset, 64 * MIB - offset, 4096)
                .unwrap();
            assert!(!runs.is_empty());
            for run in runs {
                if matches!(run.stored, Stored::Raw { .. }) {
                    raw_bytes += run.length_bytes;
                }
                offset += run.length_bytes;
            }
        }
        assert_eq!(offset, 64 * MIB);
        assert_eq!(raw_bytes, 1024 * 4096);
    }
}
