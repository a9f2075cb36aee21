//! Inline deduplication (issue #25; docs/sharing.md): a write looks up
//! each new block's fingerprint in the dedup index before compressing it,
//! and a block whose content is still stored is shared by reference
//! (`State::apply_ref`) instead of being compressed and written again.
//!
//! The steps of a write with dedup on, and what each holds:
//! 1. Fingerprints (BLAKE3 of each non-zero block), on the compression
//!    pool for large requests. No lock.
//! 2. Lookups, under the index's mutex only. A lookup that needs a
//!    chapter from the medium releases the mutex, reads the chapter
//!    (taking the state lock only to copy it if it is still buffered) and
//!    looks again. A block equal to an earlier new block of the same
//!    request is found too.
//! 3. Compression of the rest (`io.rs`), as without dedup.
//! 4. Under the state lock: each found block is checked against the map
//!    (`State::dedup_member`; the index is advisory and may name a
//!    content since overwritten), then shared, skipped (the block holds
//!    that content already) or, if its content is gone, compressed and
//!    written after all. New blocks are written as before, and their
//!    fingerprints go into the index with the versions they got; a
//!    chapter the index seals is appended to the log as a chapter record.
//!
//! Lock order: the state lock may be held while the index's mutex is
//! taken, never the other way round.
//!
//! Chapter records are advisory: never live (their bytes count as dead
//! from the start, so the cleaner drops them), never replayed. Where each
//! was written is kept in RAM (`places`); a chapter whose segment was
//! cleaned since fails its record check when read and is forgotten
//! (`DedupIndex::invalidate_chapter`). The index is not carried across a
//! restart: it starts empty, and blocks written before are found again
//! only once written again. The references it leads to are exact and
//! survive anything (`state/shares.rs`).

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};

use rayon::prelude::*;

use crate::dedup::{encoded_len, ChapterId, DedupConfig, DedupIndex, Hit, Lookup};
use crate::fingerprint::{Fingerprint, BATCH_BLOCKS};
use crate::map::Location;
use crate::record::{decode_record, record_len_for_payload, RecordKind, CHAPTER_PAYLOAD_MAX};
use crate::units::{Lba, BLOCK_SIZE};

use super::io::{is_zero, Found};
use super::state::{State, StreamKind};
use super::Volume;

/// Entries per chapter: 256, or fewer where segments are too small for a
/// chapter record to stay a sixteenth of one.
fn chapter_entries(segment_size_bytes: u64) -> u32 {
    let room = (segment_size_bytes / 16).min(CHAPTER_PAYLOAD_MAX as u64) as usize;
    let entries = room.saturating_sub(crate::record::HEADER_SIZE + encoded_len(0))
        / crate::dedup::CHAPTER_ENTRY_LEN;
    (entries as u32).clamp(1, crate::dedup::DEFAULT_CHAPTER_ENTRIES)
}

/// How the dedup index has done since the volume opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DedupRunStats {
    /// Non-zero blocks written and looked up.
    pub lookups: u64,
    /// Blocks the index found (before the check against the map).
    pub index_hits: u64,
    /// Blocks equal to an earlier block of their own request.
    pub request_hits: u64,
    /// Blocks the index found whose content was gone by then.
    pub stale_hits: u64,
    /// Blocks rewritten with the content they held: nothing written.
    pub unchanged_blocks: u64,
    /// New blocks added to the index.
    pub inserted: u64,
    /// Chapters read back from the medium, and reads that failed their
    /// check (the chapter's segment was cleaned since).
    pub chapter_reads: u64,
    pub chapter_read_failures: u64,
    /// RAM the index takes now (hooks, cached chapters, the open chapter
    /// and where each chapter was written), and its bound.
    pub ram_bytes: u64,
    pub ram_bound_bytes: u64,
    /// Hooks sampled: a fingerprint is a hook if its tag's low
    /// `sampling_bits` bits are zero.
    pub sampling_bits: u32,
}

/// The index and where its chapters were written.
pub(super) struct Deduper {
    index: DedupIndex,
    /// Where chapter `first_place + i` was written, if it was.
    places: VecDeque<Option<Location>>,
    first_place: u64,
    /// Most places kept: the oldest are forgotten beyond it.
    max_places: usize,
    stats: DedupRunStats,
}

impl Deduper {
    /// An empty index with `cache_bytes` of RAM for a volume with
    /// `segment_size_bytes` segments.
    pub(super) fn new(cache_bytes: u64, segment_size_bytes: u64) -> Deduper {
        let config = DedupConfig {
            chapter_entries: chapter_entries(segment_size_bytes),
            ..DedupConfig::with_cache_bytes(cache_bytes)
        };
        let index = DedupIndex::new(config).expect("the engine's dedup settings are valid");
        // A place costs 16 bytes; they may take a sixteenth of the budget.
        let max_places = (cache_bytes / 16 / 16).max(64) as usize;
        Deduper {
            index,
            places: VecDeque::new(),
            first_place: 0,
            max_places,
            stats: DedupRunStats::default(),
        }
    }

    fn place(&self, id: ChapterId) -> Option<Location> {
        let at = id.0.checked_sub(self.first_place)?;
        self.places.get(at as usize).copied().flatten()
    }

    fn note_place(&mut self, id: ChapterId, loc: Location) {
        if self.places.is_empty() {
            self.first_place = id.0;
        }
        while self.first_place + (self.places.len() as u64) < id.0 {
            self.places.push_back(None);
        }
        if id.0 >= self.first_place {
            self.places.push_back(Some(loc));
        }
        while self.places.len() > self.max_places {
            self.places.pop_front();
            self.first_place += 1;
        }
    }

    fn stats(&self) -> DedupRunStats {
        let index = self.index.stats();
        let places = (self.places.capacity() * size_of::<Option<Location>>()) as u64;
        DedupRunStats {
            ram_bytes: index.ram_bytes + places,
            ram_bound_bytes: index.ram_bound_bytes + (self.max_places * 16) as u64,
            sampling_bits: index.sampling_bits,
            ..self.stats
        }
    }
}

impl Volume {
    fn deduper(&self) -> Option<MutexGuard<'_, Deduper>> {
        self.dedup
            .as_ref()
            .map(|dedup| dedup.lock().expect("dedup index lock"))
    }

    /// The dedup index's figures, if dedup is on.
    pub fn dedup_stats(&self) -> Option<DedupRunStats> {
        self.deduper().map(|dedup| dedup.stats())
    }

    /// Steps 1 and 2 of the module doc for the whole blocks of `data`:
    /// `None` with dedup off.
    pub(super) fn find_stored(&self, data: &[u8]) -> Option<Vec<Found>> {
        let dedup = self.dedup.as_ref()?;
        let count = data.len() / BLOCK_SIZE;
        // Zero blocks have none; the others are hashed in batches.
        let fingerprints_of = |blocks: &[u8]| -> Vec<Option<Fingerprint>> {
            let zero: Vec<bool> = blocks.chunks_exact(BLOCK_SIZE).map(is_zero).collect();
            let nonzero: Vec<&[u8]> = blocks
                .chunks_exact(BLOCK_SIZE)
                .zip(&zero)
                .filter_map(|(block, &zero)| (!zero).then_some(block))
                .collect();
            let mut hashed = Fingerprint::of_blocks(&nonzero).into_iter();
            zero.iter()
                .map(|&zero| (!zero).then(|| hashed.next().expect("one per block")))
                .collect()
        };
        let fingerprints: Vec<Option<Fingerprint>> =
            self.compressors.compress(count, |parts, _| {
                if parts == 1 {
                    fingerprints_of(data)
                } else {
                    let per = count.div_ceil(parts).div_ceil(BATCH_BLOCKS) * BATCH_BLOCKS;
                    data.par_chunks(per * BLOCK_SIZE)
                        .flat_map_iter(fingerprints_of)
                        .collect()
                }
            });
        let mut found = Vec::with_capacity(count);
        let mut new_here: HashMap<Fingerprint, usize> = HashMap::new();
        let mut index = dedup.lock().expect("dedup index lock");
        for (i, fingerprint) in fingerprints.into_iter().enumerate() {
            let Some(fingerprint) = fingerprint else {
                found.push(Found::Zero);
                continue;
            };
            index.stats.lookups += 1;
            if let Some(&earlier) = new_here.get(&fingerprint) {
                index.stats.request_hits += 1;
                found.push(Found::Earlier(earlier));
                continue;
            }
            let hit;
            (index, hit) = self.look_up_fingerprint(index, &fingerprint);
            match hit {
                Some(hit) => {
                    index.stats.index_hits += 1;
                    found.push(Found::Stored(fingerprint, hit));
                }
                None => {
                    new_here.insert(fingerprint, i);
                    found.push(Found::New(fingerprint));
                }
            }
        }
        Some(found)
    }

    /// One lookup, reading chapters the index asks for with its mutex
    /// released (at most two rounds, as `Lookup::NeedChapter` says), and
    /// the chapter a hit says the run goes on into.
    fn look_up_fingerprint<'a>(
        &'a self,
        mut index: MutexGuard<'a, Deduper>,
        fingerprint: &Fingerprint,
    ) -> (MutexGuard<'a, Deduper>, Option<Hit>) {
        for _ in 0..2 {
            match index.index.lookup(fingerprint) {
                Lookup::Hit { hit, prefetch } => {
                    if let Some(next) = prefetch {
                        index = self.load_chapter(index, next);
                    }
                    return (index, Some(hit));
                }
                Lookup::Miss => return (index, None),
                Lookup::NeedChapter(id) => index = self.load_chapter(index, id),
            }
        }
        (index, None)
    }

    /// Reads chapter `id` with the index's mutex released and hands it to
    /// the index; a chapter not written, or whose record fails its check,
    /// is forgotten.
    fn load_chapter<'a>(
        &'a self,
        index: MutexGuard<'a, Deduper>,
        id: ChapterId,
    ) -> MutexGuard<'a, Deduper> {
        let place = index.place(id);
        drop(index);
        let bytes = place.and_then(|loc| self.read_chapter(id, loc));
        let mut index = self.deduper().expect("dedup is on");
        index.stats.chapter_reads += 1;
        let added = bytes.is_some_and(|bytes| index.index.add_chapter(id, &bytes).is_ok());
        if !added {
            index.stats.chapter_read_failures += 1;
            index.index.invalidate_chapter(id);
        }
        index
    }

    /// The payload of the chapter record at `loc`, if it is still there:
    /// copied under the state lock if still buffered, else read from the
    /// medium without it.
    fn read_chapter(&self, id: ChapterId, loc: Location) -> Option<Vec<u8>> {
        let buffered = self.lock().read_buffered(loc).ok()?;
        let bytes = match buffered {
            Some(buffered) => buffered.complete(self.media.as_ref()).ok()?,
            None => {
                let mut bytes = vec![0u8; loc.len as usize];
                self.media
                    .read(loc.segment, loc.offset as u64, &mut bytes)
                    .ok()?;
                bytes
            }
        };
        let (header, payload) = decode_record(&bytes, &self.record_key, None).ok()?;
        (header.kind == RecordKind::Chapter && header.lba == id.0).then(|| payload.to_vec())
    }

    /// Step 4's end, under the state lock: indexes the new blocks written
    /// (fingerprint, the version each got, its block) and appends the
    /// chapters that fills.
    pub(super) fn index_new_blocks(
        &self,
        state: &mut State,
        written: &[(Fingerprint, Lba)],
        floor: u64,
    ) -> crate::error::Result<()> {
        let Some(mut dedup) = self.deduper() else {
            return Ok(());
        };
        let mut sealed = Vec::new();
        for &(fingerprint, lba) in written {
            let version = state.map().get(lba).version();
            dedup.stats.inserted += 1;
            sealed.extend(dedup.index.insert(fingerprint, version, lba.0));
        }
        for chapter in sealed {
            let loc = state.append_chapter(chapter.id.0, &chapter.bytes, floor)?;
            dedup.note_place(chapter.id, loc);
        }
        Ok(())
    }

    /// Notes a block found stale, rewritten unchanged or shared.
    pub(super) fn note_dedup(&self, stale: u64, unchanged: u64) {
        if let Some(mut dedup) = self.deduper() {
            dedup.stats.stale_hits += stale;
            dedup.stats.unchanged_blocks += unchanged;
        }
    }

    /// Log bytes the chapters that `new_blocks` more indexed blocks may
    /// seal take, at most.
    pub(super) fn chapter_bytes_for(&self, new_blocks: u64) -> u64 {
        if self.dedup.is_none() || new_blocks == 0 {
            return 0;
        }
        let entries = chapter_entries(self.geometry.segment_size_bytes) as u64;
        (new_blocks / entries + 1) * record_len_for_payload(encoded_len(entries as usize))
    }
}

impl State {
    /// Appends a sealed chapter of the dedup index: a record that is never
    /// live, so its bytes count as dead from the start.
    pub(super) fn append_chapter(
        &mut self,
        id: u64,
        bytes: &[u8],
        floor: u64,
    ) -> crate::error::Result<Location> {
        let loc = self.append_metadata(
            StreamKind::Host,
            RecordKind::Chapter,
            Lba(id),
            0,
            bytes,
            floor,
        )?;
        self.note_chapter_written(loc.len as u64);
        Ok(loc)
    }
}

/// The dedup index of a volume, if the volume deduplicates: `cache_bytes`
/// of RAM at most.
pub(super) fn deduper_for(
    on: bool,
    read_only: bool,
    cache_bytes: u64,
    segment_size_bytes: u64,
) -> Option<Mutex<Deduper>> {
    (on && !read_only).then(|| Mutex::new(Deduper::new(cache_bytes, segment_size_bytes)))
}

#[cfg(test)]
mod tests {
    //! Inline dedup against a byte model: duplicates are shared and read
    //! back, wherever they land and whatever the unit; a stale hit is
    //! stored; chapters are written, read back and forgotten when gone;
    //! all of it survives a restart and `check`.

    use std::sync::Arc;

    use super::*;
    use crate::device::BlockDevice;
    use crate::media::{Media, MemMedia};
    use crate::units::BLOCK_SIZE_U64;
    use crate::{Codec, CreateOptions, OpenOptions, Volume};

    #[test]
    fn chapters_stay_a_sixteenth_of_a_segment() {
        assert_eq!(chapter_entries(1 << 20), 256);
        assert_eq!(chapter_entries(256 << 10), 256);
        let small = chapter_entries(64 << 10);
        assert!(small < 256 && small > 16, "{small}");
        let len = record_len_for_payload(encoded_len(small as usize));
        assert!(len <= (64 << 10) / 16, "{len}");
        assert!(chapter_entries(4096) >= 1);
    }

    #[test]
    fn places_keep_the_newest_chapters() {
        let mut dedup = Deduper::new(1 << 20, 1 << 20);
        let loc = |n: u32| Location::record(crate::units::SegmentId(n), 0, 64);
        for id in 0..(dedup.max_places as u64 + 10) {
            dedup.note_place(ChapterId(id), loc(id as u32));
        }
        assert_eq!(dedup.place(ChapterId(0)), None);
        let last = dedup.max_places as u64 + 9;
        assert_eq!(dedup.place(ChapterId(last)), Some(loc(last as u32)));
        assert_eq!(dedup.places.len(), dedup.max_places);
    }

    const BLOCKS: u64 = 16_384;

    fn open_options(dedup_cache_bytes: Option<u64>) -> OpenOptions {
        OpenOptions {
            background: false,
            dedup_cache_bytes,
            ..OpenOptions::default()
        }
    }

    fn volume(codec: Codec, dedup_cache_bytes: Option<u64>) -> (Arc<MemMedia>, Arc<Volume>) {
        let media = Arc::new(MemMedia::with_size(4096, 256 * 1024, 512).unwrap());
        let create = CreateOptions {
            codec,
            unit_blocks: crate::meta::default_unit_blocks(codec),
            dedup: true,
            ..CreateOptions::new(BLOCKS * BLOCK_SIZE_U64)
        };
        let volume = Volume::create(
            media.clone() as Arc<dyn Media>,
            create,
            open_options(dedup_cache_bytes),
        )
        .unwrap();
        (media, volume)
    }

    /// A compressible block unlike any other (`seed` says which).
    fn block(seed: u64) -> Vec<u8> {
        let text = format!("dedup test block {seed:>12}; ");
        text.bytes().cycle().take(BLOCK_SIZE).collect()
    }

    fn blocks(seeds: std::ops::Range<u64>) -> Vec<u8> {
        seeds.flat_map(block).collect()
    }

    struct Model(Vec<Vec<u8>>);

    impl Model {
        fn new() -> Model {
            Model(vec![vec![0u8; BLOCK_SIZE]; BLOCKS as usize])
        }

        fn write(&mut self, volume: &Volume, lba: u64, data: &[u8]) {
            volume.write(lba * BLOCK_SIZE_U64, data, false).unwrap();
            for (i, chunk) in data.chunks(BLOCK_SIZE).enumerate() {
                self.0[lba as usize + i] = chunk.to_vec();
            }
        }

        fn check(&self, volume: &Volume) {
            let mut buf = vec![0u8; BLOCKS as usize * BLOCK_SIZE];
            volume.read(0, &mut buf).unwrap();
            for (lba, want) in self.0.iter().enumerate() {
                let got = &buf[lba * BLOCK_SIZE..(lba + 1) * BLOCK_SIZE];
                assert!(got == &want[..], "block {lba} reads wrong");
            }
            let report = volume.check(true).unwrap();
            assert!(report.is_clean(), "{report:?}");
        }
    }

    #[test]
    fn copies_are_shared_at_any_shift_and_read_back_after_a_restart() {
        for codec in [Codec::Lz4, Codec::Zstd { level: 1 }] {
            let (media, volume) = volume(codec, None);
            let mut model = Model::new();
            let original = blocks(0..300);
            model.write(&volume, 0, &original);
            let before = volume.stats();
            // An aligned copy, and copies shifted by 1 and 3 blocks, so
            // that no unit of the copy matches a unit of the original.
            for at in [1000, 2001, 3003] {
                model.write(&volume, at, &original);
            }
            let after = volume.stats();
            let grown = after.stored_bytes - before.stored_bytes;
            assert!(
                grown < before.stored_bytes / 20,
                "{codec}: three copies stored {grown} bytes more than {}",
                before.stored_bytes
            );
            assert_eq!(after.counters.dedup_blocks, 900, "{codec}");
            assert!(after.counters.dedup_saved_bytes > 0);
            assert_eq!(after.dedup_lookups, 1200);
            assert_eq!(after.dedup_found, 900);
            assert_eq!(after.distinct_blocks, 300);
            assert_eq!(after.shared_contents, 300);
            assert_eq!(after.shared_blocks, 1200);
            model.check(&volume);
            // Overwriting the original leaves the copies whole.
            model.write(&volume, 0, &blocks(5000..5300));
            model.check(&volume);
            volume.close().unwrap();
            let volume = Volume::open(media as Arc<dyn Media>, open_options(None)).unwrap();
            model.check(&volume);
            assert_eq!(volume.stats().counters.dedup_blocks, 900);
        }
    }

    #[test]
    fn duplicates_within_one_request_and_rewrites_in_place() {
        let (_media, volume) = volume(Codec::Lz4, None);
        let mut model = Model::new();
        // Eight blocks, each four times in one request.
        let data: Vec<u8> = (0..32).flat_map(|i| block(i % 8)).collect();
        model.write(&volume, 100, &data);
        let stats = volume.stats();
        assert_eq!(stats.distinct_blocks, 8);
        assert_eq!(stats.dedup_found, 24);
        model.check(&volume);
        // The same bytes written again to the same blocks: nothing to do.
        let written = volume.stats().counters.media_write_bytes;
        model.write(&volume, 100, &data);
        let stats = volume.stats();
        assert_eq!(stats.distinct_blocks, 8);
        assert_eq!(
            volume.dedup_stats().unwrap().unchanged_blocks,
            32,
            "every block already held its content"
        );
        assert_eq!(stats.counters.media_write_bytes, written);
        model.check(&volume);
    }

    #[test]
    fn a_content_overwritten_since_it_was_indexed_is_stored_again() {
        let (_media, volume) = volume(Codec::Lz4, None);
        let mut model = Model::new();
        model.write(&volume, 0, &block(1));
        model.write(&volume, 0, &block(2));
        // The index still names block 0 for block(1)'s bytes.
        model.write(&volume, 50, &block(1));
        let dedup = volume.dedup_stats().unwrap();
        assert_eq!(dedup.index_hits, 1);
        assert_eq!(dedup.stale_hits, 1);
        assert_eq!(volume.stats().shared_blocks, 0);
        model.check(&volume);
        // And found again from there.
        model.write(&volume, 60, &block(1));
        assert_eq!(volume.stats().shared_blocks, 2);
        model.check(&volume);
    }

    #[test]
    fn chapters_evicted_from_ram_are_read_back_and_gone_ones_forgotten() {
        // The smallest index: four chapters cached, the rest on the medium.
        let (_media, volume) = volume(Codec::Lz4, Some(0));
        let mut model = Model::new();
        let original = blocks(0..4096);
        model.write(&volume, 0, &original);
        let dedup = volume.dedup_stats().unwrap();
        assert!(dedup.ram_bytes <= dedup.ram_bound_bytes, "{dedup:?}");
        assert!(volume.stats().counters.dedup_index_write_bytes > 0);
        // A copy in the original's order: each run is found from a hook
        // through chapters read back from the medium.
        model.write(&volume, 8192, &original);
        let dedup = volume.dedup_stats().unwrap();
        assert!(dedup.chapter_reads > 0, "{dedup:?}");
        assert_eq!(dedup.chapter_read_failures, 0, "{dedup:?}");
        let found = volume.stats().dedup_found;
        assert!(found >= 4096 * 95 / 100, "found {found} of 4096");
        model.check(&volume);
        // The original overwritten and its segments cleaned: the chapters
        // went with them, and a third copy is stored, not lost.
        model.write(&volume, 0, &blocks(10_000..14_096));
        model.write(&volume, 8192, &blocks(20_000..24_096));
        for _ in 0..512 {
            if !volume.clean_one(64 * 1024).unwrap() {
                break;
            }
        }
        model.write(&volume, 4096, &original);
        model.check(&volume);
        let dedup = volume.dedup_stats().unwrap();
        assert!(dedup.ram_bytes <= dedup.ram_bound_bytes, "{dedup:?}");
    }

    #[test]
    fn dedup_off_stores_every_copy() {
        let media = Arc::new(MemMedia::with_size(4096, 256 * 1024, 512).unwrap());
        let create = CreateOptions {
            dedup: false,
            ..CreateOptions::new(BLOCKS * BLOCK_SIZE_U64)
        };
        let volume =
            Volume::create(media.clone() as Arc<dyn Media>, create, open_options(None)).unwrap();
        let mut model = Model::new();
        model.write(&volume, 0, &blocks(0..64));
        model.write(&volume, 64, &blocks(0..64));
        let stats = volume.stats();
        assert_eq!(stats.dedup, "off");
        assert_eq!(stats.shared_blocks, 0);
        assert_eq!(stats.distinct_blocks, 128);
        assert!(volume.dedup_stats().is_none());
        model.check(&volume);
        // Turned on at open: new writes deduplicate.
        volume.close().unwrap();
        let options = OpenOptions {
            dedup: Some(true),
            ..open_options(None)
        };
        let volume = Volume::open(media as Arc<dyn Media>, options).unwrap();
        model.write(&volume, 200, &blocks(100..164));
        model.write(&volume, 300, &blocks(100..164));
        assert_eq!(volume.stats().shared_blocks, 128);
        assert!(volume.settings().dedup);
        model.check(&volume);
    }
}
