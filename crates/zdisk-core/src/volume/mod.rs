//! The volume: zdisk's engine, tying the map, the log writer, the cleaner,
//! checkpoints and recovery together behind [`BlockDevice`].
//!
//! Concurrency: one reader-writer lock guards [`State`] (map, free space,
//! stream buffers): a host read whose map leaves are in RAM takes it shared,
//! everything that changes the state exclusively (`guard.rs`). No medium
//! I/O happens under it (debug builds check, see
//! `held.rs`): compression, decompression, medium reads and map page
//! faults happen outside it (`fault.rs`), and what the medium must do is
//! queued under it and done by the log writer after it (`guard.rs`,
//! `outbound.rs`); appending records and updating the map happen inside,
//! through `State`'s mutation methods. Syncs are group-committed under their own
//! lock, so one `fdatasync` covers every flush waiting for it. The cleaner
//! and checkpoints are serialised by a maintenance lock and run on a
//! background thread, or in the writer's thread when a write finds no room
//! (which is how writes are throttled): every caller short of space climbs
//! one ladder, decided in `space.rs` and climbed in `room.rs`. The
//! cold-data pass, run by the same thread when the volume is idle, is
//! `cold.rs`'s.
//!
//! Lock order: maintenance → sync → state → the medium's own locks. The
//! stripe locks of read-modify-write come before all of them.

mod check;
mod checkpoint;
mod clean;
mod clone;
mod cold;
mod compressors;
mod dedup;
mod estimate;
mod fault;
mod guard;
mod io;
mod moves;
mod options;
mod outbound;
mod recovery;
mod room;
mod roots;
pub(crate) mod scan;
mod share;
mod snapshot;
#[cfg(test)]
mod snapshot_tests;
mod space;
pub(crate) mod staging;
mod state;
mod status;
mod tallies;
#[cfg(test)]
mod tests;

pub use crate::snapshots::{CloneVolume, Snapshot};
pub use check::CheckReport;
pub use clone::{CloneDevice, CloneInfo, CloneMapped, DeletedClone};
pub use cold::{IdleBudget, Recompress};
pub use compressors::WriteEffort;
pub use dedup::DedupRunStats;
pub use estimate::{BlockKind, DedupIndex, DedupSummary, WriteEstimate, WriteEstimator};
pub use guard::LockProfile;
pub use options::{
    default_dedup_cache_bytes, default_map_cache_bytes, CreateOptions, OpenOptions, Random,
    DEFAULT_DEDUP,
};
pub use recovery::OpenReport;
pub use snapshot::{Compacted, DeletedSnapshot, SnapshotDevice, SnapshotInfo};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::device::{BlockDevice, Extent, ExtentState, StoredExtent};
use crate::error::{Error, Result};
use crate::map::Slot;
use crate::media::{Media, MediaGeometry};
use crate::meta::{read_roots, MediaKind, RetainedRoot, Root, Settings, Superblock};
use crate::record::RecordKey;
use crate::segments::SegmentState;
use crate::stats::{Counters, SegmentCounts, Stats};
use crate::units::{Lba, BLOCK_SIZE_U64};

use recovery::Recovered;
use roots::{build_root, RootContents};
use space::{Ahead, Reservation, Space, Writer};
use state::{Start, State};

/// Number of stripe locks serialising read-modify-write of partial blocks.
const RMW_STRIPES: usize = 256;

pub struct Volume {
    media: Arc<dyn Media>,
    record_key: RecordKey,
    geometry: MediaGeometry,
    superblock: Superblock,
    settings: Settings,
    options: OpenOptions,
    read_only: bool,
    state: RwLock<State>,
    /// Highest barrier generation made durable; its lock serialises syncs.
    synced: Mutex<u64>,
    maintenance: Mutex<()>,
    stripes: Vec<Mutex<()>>,
    wake: Condvar,
    wake_lock: Mutex<bool>,
    /// Signalled (with the state lock) when queued pages were written.
    page_written: guard::Signal,
    /// Signalled (with the state lock) when work is queued for the log
    /// writer thread (`guard.rs`).
    log_work: guard::Signal,
    /// True while the log writer thread runs; changed under the state lock.
    log_writer_running: AtomicBool,
    log_writer: Mutex<Option<JoinHandle<()>>>,
    /// How much the state lock is used.
    lock_stats: guard::LockStats,
    /// The host I/O counters, bumped without the state lock (the state
    /// shares them).
    tallies: Arc<tallies::Tallies>,
    stop: AtomicBool,
    closed: AtomicBool,
    worker: Mutex<Option<JoinHandle<()>>>,
    open_report: Mutex<OpenReport>,
    gc_active: AtomicBool,
    /// The cold-data pass's state (`cold.rs`).
    cold: cold::ColdPass,
    gc_low_free_segments: u64,
    gc_high_free_segments: u64,
    /// Whether a large write may spread its compression over idle cores.
    compressors: compressors::Compressors,
    /// The dedup index, if new writes deduplicate (`dedup.rs`).
    dedup: Option<Mutex<dedup::Deduper>>,
}

impl Volume {
    /// Writes a fresh, empty volume onto `media` and opens it.
    pub fn create(
        media: Arc<dyn Media>,
        create: CreateOptions,
        options: OpenOptions,
    ) -> Result<Arc<Volume>> {
        let geometry = media.geometry();
        geometry.validate()?;
        let logical = create.logical_size_bytes;
        if logical == 0 || !logical.is_multiple_of(BLOCK_SIZE_U64) {
            return Err(Error::InvalidArgument(format!(
                "logical size {logical} must be a positive multiple of {BLOCK_SIZE_U64} bytes"
            )));
        }
        if logical / BLOCK_SIZE_U64 > 1 << 40 {
            return Err(Error::InvalidArgument(format!(
                "logical size {logical} exceeds 4 EiB"
            )));
        }
        let mut uuid = [0u8; 16];
        options.random.fill(&mut uuid);
        let superblock = Superblock {
            uuid,
            logical_size_bytes: logical,
            physical_size_bytes: media.physical_size_bytes(),
            geometry,
            media_kind: create.media_kind,
            media_params: create.media_params,
            created_unix_secs: options.clock.unix_secs(),
        };
        let units = 1..=crate::record::UNIT_BLOCKS_MAX as u8;
        if !units.contains(&create.unit_blocks) {
            return Err(Error::InvalidArgument(format!(
                "compression units of {} blocks: 1 to {} are possible",
                create.unit_blocks,
                units.end()
            )));
        }
        let settings = Settings {
            codec: create.codec,
            gc_policy: create.gc_policy,
            unit_blocks: create.unit_blocks,
            dedup: create.dedup,
        };
        // An empty volume: nothing to replay, nothing reserved.
        let root = build_root(
            &superblock,
            settings,
            RootContents {
                generation: 1,
                clean: true,
                retained: &RetainedRoot {
                    generation: 1,
                    boundary: 1,
                    open: Vec::new(),
                    dump: None,
                    snapshots: Default::default(),
                },
                next_seq: 1,
                next_version: 1,
                reservation: &Reservation {
                    seq: 1,
                    version: 1,
                    segments: Vec::new(),
                },
                counters: Counters::default(),
            },
        );
        let bytes = root.encode();
        if bytes.len() > geometry.meta_slot_size_bytes as usize {
            return Err(Error::InvalidArgument(
                "the superblock does not fit a metadata slot".into(),
            ));
        }
        media.write_meta_slot(root.slot(), &bytes)?;
        media.write_meta_slot(1 - root.slot(), &[0u8; 64])?;
        media.sync()?;
        Volume::open(media, options)
    }

    /// Opens an existing volume, replaying the log if it was not shut down cleanly.
    pub fn open(media: Arc<dyn Media>, options: OpenOptions) -> Result<Arc<Volume>> {
        let started = options.clock.monotonic();
        // Debug builds check that no medium I/O runs under the state lock.
        let media = crate::media::LockChecked::wrap(media);
        let ahead = Ahead {
            seq: options.seq_reserve_ahead,
            version: options.version_reserve_ahead,
            segments: options.segment_reserve_ahead,
        };
        let (mut root, recovered) = recover_newest(
            media.as_ref(),
            !options.read_only,
            options.accept_lost_checkpoint,
            ahead,
        )?;
        if let Some(codec) = options.codec {
            root.settings.codec = codec;
        }
        if let Some(policy) = options.gc_policy {
            root.settings.gc_policy = policy;
        }
        if let Some(blocks) = options.unit_blocks {
            if !(1..=crate::record::UNIT_BLOCKS_MAX as u8).contains(&blocks) {
                return Err(Error::InvalidArgument(format!(
                    "compression units of {blocks} blocks: 1 to {} are possible",
                    crate::record::UNIT_BLOCKS_MAX
                )));
            }
            root.settings.unit_blocks = blocks;
        }
        if let Some(dedup) = options.dedup {
            root.settings.dedup = dedup;
        }
        let read_only = options.read_only;
        let (start, mut report, staged) = recovered;
        // A writable recovery wrote staged sectors back; a read-only one
        // reads them from RAM.
        let media = if read_only {
            staging::Overlaid::over(media, staged)
        } else {
            media
        };
        let volume = Arc::new(Volume::assemble(media, root, start, options));
        if !read_only {
            // First mark the volume dirty and reserve numbers for this run,
            // before anything is written.
            volume.write_root(false, 0, 0)?;
            if report.replayed_records > 0 || !report.clean {
                // Fold the replayed log into a checkpoint, so the next start
                // does not replay it again and its trims are safe to clean.
                // If even cleaning cannot make room for the dump, the volume
                // opens on the old checkpoint, marked dirty; a later
                // checkpoint catches up.
                match volume.checkpoint_making_room(false) {
                    Ok(()) | Err(Error::NoSpace { .. }) => {}
                    Err(other) => return Err(other),
                }
            }
            let free = volume.lock().all_free();
            for segment in free {
                volume.media.segment_freed(segment);
            }
        }
        report.duration = volume.options.clock.monotonic().saturating_sub(started);
        *volume.open_report.lock().expect("report lock") = report;
        if volume.options.background && !read_only {
            volume.start_background()?;
        }
        Ok(volume)
    }

    /// The volume over what recovery found, before anything is written.
    fn assemble(
        media: Arc<dyn Media>,
        root: Root,
        recovered: Start,
        mut options: OpenOptions,
    ) -> Volume {
        if root.superblock.media_kind == MediaKind::Nand {
            // The drive an emulated image models compresses each block
            // alone, once.
            options.recompress = Recompress::Off;
            options.idle_compact = false;
            // It compresses in hardware at line rate: always full effort.
            options.write_effort = WriteEffort::Full;
        }
        // Fast writes are a loan the cold-data pass pays back; without
        // the pass, adaptive writes keep full effort.
        let write_effort = match (options.write_effort, options.recompress) {
            (WriteEffort::Adaptive, Recompress::Off) => WriteEffort::Full,
            (policy, _) => policy,
        };
        let geometry = media.geometry();
        let segment_count = geometry.segment_count as u64;
        let gc_low = options
            .gc_low_free_segments
            .unwrap_or_else(|| (segment_count / 50).clamp(4, 64));
        let gc_high = options
            .gc_high_free_segments
            .unwrap_or_else(|| gc_low + (segment_count / 50).clamp(2, 64))
            .max(gc_low + 1);
        let record_key = RecordKey(root.superblock.uuid);
        let logical_blocks = root.superblock.logical_size_bytes / BLOCK_SIZE_U64;
        let mut state = State::new(
            media.clone(),
            record_key,
            logical_blocks,
            options.write_batch_bytes,
            recovered,
        );
        let compressors = compressors::Compressors::new(write_effort);
        compressors.note_room(state.free_segment_count(), segment_count);
        state.set_map_cache_bytes(options.map_cache_bytes.unwrap_or_else(|| {
            options::default_map_cache_bytes(root.superblock.logical_size_bytes)
        }));
        let read_only = options.read_only;
        let tallies = state.tallies().clone();
        let dedup = dedup::deduper_for(
            root.settings.dedup,
            read_only,
            options.dedup_cache_bytes.unwrap_or_else(|| {
                options::default_dedup_cache_bytes(root.superblock.logical_size_bytes)
            }),
            geometry.segment_size_bytes,
        );
        Volume {
            media,
            record_key,
            geometry,
            superblock: root.superblock,
            settings: root.settings,
            read_only,
            state: RwLock::new(state),
            synced: Mutex::new(0),
            maintenance: Mutex::new(()),
            stripes: (0..RMW_STRIPES).map(|_| Mutex::new(())).collect(),
            wake: Condvar::new(),
            wake_lock: Mutex::new(false),
            page_written: guard::Signal::default(),
            log_work: guard::Signal::default(),
            log_writer_running: AtomicBool::new(false),
            log_writer: Mutex::new(None),
            lock_stats: guard::LockStats::default(),
            tallies,
            stop: AtomicBool::new(false),
            closed: AtomicBool::new(read_only),
            worker: Mutex::new(None),
            open_report: Mutex::new(OpenReport::default()),
            gc_active: AtomicBool::new(false),
            cold: cold::ColdPass::new(geometry.segment_count, options.clock.monotonic()),
            gc_low_free_segments: gc_low,
            gc_high_free_segments: gc_high,
            compressors,
            dedup,
            options,
        }
    }

    fn start_background(self: &Arc<Self>) -> Result<()> {
        let weak = Arc::downgrade(self);
        let handle = std::thread::Builder::new()
            .name("zdisk-maintenance".into())
            .spawn(move || maintenance_loop(weak))
            .map_err(|e| Error::io("starting the maintenance thread", e))?;
        *self.worker.lock().expect("worker lock") = Some(handle);
        self.start_log_writer()
    }

    pub fn superblock(&self) -> &Superblock {
        &self.superblock
    }

    pub fn settings(&self) -> Settings {
        self.settings
    }

    pub fn geometry(&self) -> MediaGeometry {
        self.geometry
    }

    pub fn media(&self) -> &Arc<dyn Media> {
        &self.media
    }

    /// What happened when the volume was opened (recovery, damaged slots).
    pub fn open_report(&self) -> OpenReport {
        self.open_report.lock().expect("report lock").clone()
    }

    pub fn logical_blocks(&self) -> u64 {
        self.superblock.logical_size_bytes / BLOCK_SIZE_U64
    }

    /// Makes every acknowledged write, trim and zero durable.
    pub fn flush(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.tally(state::Tally::Flush);
        let gen = self.lock().barrier()?;
        self.sync_to(gen)
    }

    /// Waits until barrier generation `gen` is durable, syncing if needed.
    /// Concurrent callers share one sync (group commit).
    fn sync_to(&self, gen: u64) -> Result<()> {
        let mut synced = self.synced.lock().expect("sync lock poisoned");
        if *synced >= gen {
            return Ok(());
        }
        let target = self.lock().space().barrier_gen();
        self.sync_media()?;
        *synced = target;
        self.lock().note_synced(target);
        Ok(())
    }

    /// Writes a checkpoint now (the background thread does this periodically).
    pub fn checkpoint(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.checkpoint_making_room(false)
    }

    /// Stops background work, writes a clean checkpoint and stops accepting writes.
    pub fn close(&self) -> Result<()> {
        self.stop_background();
        if self.read_only || self.closed.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        // Refuse new writes first: one acknowledged after the clean
        // checkpoint's snapshot would be lost, as recovery skips the log.
        self.lock().set_closing();
        self.checkpoint_making_room(true)?;
        self.lock().set_closed();
        self.media.close()
    }

    /// Stops everything without flushing or checkpointing, as a crash
    /// would: buffered writes are lost, the log is left for recovery. For
    /// tests and benchmarks that measure recovery in-process.
    pub fn halt(&self) {
        self.stop_background();
        self.closed.store(true, Ordering::SeqCst);
        self.lock().halt("the volume was halted");
    }

    fn stop_background(&self) {
        self.stop.store(true, Ordering::SeqCst);
        self.poke();
        let handle = self.worker.lock().expect("worker lock").take();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
        self.stop_log_writer();
    }

    /// Wakes the background thread (space is short or a checkpoint is due).
    fn poke(&self) {
        *self.wake_lock.lock().expect("wake lock") = true;
        self.wake.notify_all();
    }

    fn gc_active(&self) -> bool {
        self.gc_active.load(Ordering::Relaxed)
    }

    fn set_gc_active(&self, active: bool) {
        self.gc_active.store(active, Ordering::Relaxed);
    }

    /// A one-line description of a block's map entry and its segment, for
    /// diagnosing simulation failures.
    #[doc(hidden)]
    pub fn describe_block(&self, lba: u64) -> String {
        let state = match self.lock_resident(Lba(lba), 1) {
            Ok(state) => state,
            Err(error) => return format!("block {lba}: its map page is unreadable: {error}"),
        };
        let entry = state.map().get(Lba(lba));
        let segment = match entry.slot() {
            Slot::Data(loc) => format!("{:?}", state.space().segment(loc.segment)),
            Slot::Shared { content } => {
                let cell = crate::map::table_key(content);
                match state.map().is_resident(cell, 1) {
                    true => format!(
                        "(cell {:?} v{}, {} references)",
                        state.map().get(cell).slot(),
                        state.map().get(cell).version(),
                        state.shared().count(content)
                    ),
                    false => "(cell paged out)".into(),
                }
            }
            _ => String::new(),
        };
        format!(
            "block {lba}: {:?} v{} {segment}; roots {:?}",
            entry.slot(),
            entry.version(),
            state.roots()
        )
    }

    /// Segments the engine keeps from data for a volume with
    /// `mapped_blocks` blocks on `segment_count` segments of
    /// `segment_size` bytes: the two open streams, the free segments host
    /// writes leave to the cleaner and the next checkpoint, and the dumps
    /// of the two retained checkpoints (each dump is two copies). What is
    /// left is the space data and its garbage can use.
    pub fn overhead_segments_for(mapped_blocks: u64, segment_count: u64, segment_size: u64) -> u64 {
        // At most a leaf, so a page, per chunk.
        let pages = mapped_blocks.div_ceil(crate::map::CHUNK_BLOCKS);
        let dump = crate::dump::dump_segments_for(pages, segment_count, segment_size);
        2 + space::GC_RESERVE_SEGMENTS + dump + 2 * dump
    }

    /// A snapshot of the volume's statistics.
    pub fn stats(&self) -> Stats {
        // Outside the state lock: a medium may take locks of its own.
        let media_stats = self.media.media_stats();
        let dedup = self.dedup_stats().unwrap_or_default();
        let state = self.lock();
        let counts = state.map().block_counts();
        // What clones wrote, and what snapshots keep: the map's kept
        // entries, split by key space.
        let mut cloned = crate::map::MapCounts::default();
        for clone in state.snapshots().clones() {
            cloned.merge(state.map().space_counts(clone.space));
        }
        let kept = state.map().kept_counts().without(cloned);
        let cache = state.map().cache_counts();
        let (map_leaves, map_paged_leaves) = state.map().leaf_counts();
        let segment_size = self.geometry.segment_size_bytes;
        let usage = segment_usage(&state, segment_size);
        let pending = cold::pending(&state, self.options.recompress != Recompress::Off);
        let meta_bytes = self
            .media
            .physical_size_bytes()
            .saturating_sub(self.geometry.log_capacity_bytes());
        let counters = state.counters();
        let metadata_bytes = meta_bytes + usage.checkpoint_bytes;
        let reserve_bytes = state.floor(Writer::Host { blocks: 0 }) * segment_size;
        let ratio = |num: u64, den: u64| {
            if den == 0 {
                None
            } else {
                Some(num as f64 / den as f64)
            }
        };
        Stats {
            logical_size_bytes: self.superblock.logical_size_bytes,
            physical_size_bytes: self.media.physical_size_bytes(),
            mapped_bytes: counts.data_blocks * BLOCK_SIZE_U64,
            zero_bytes: counts.zero_blocks * BLOCK_SIZE_U64,
            stored_bytes: counts.stored_bytes,
            physical_used_bytes: meta_bytes + usage.used_bytes,
            reclaimable_bytes: usage.dead_bytes,
            metadata_bytes,
            available_bytes: self
                .media
                .physical_size_bytes()
                .saturating_sub(metadata_bytes + counts.stored_bytes + reserve_bytes),
            compression_ratio: ratio(counts.data_blocks * BLOCK_SIZE_U64, counts.stored_bytes),
            host_write_bytes: counters.host_write_bytes,
            media_write_bytes: counters.media_write_bytes,
            padding_bytes: counters.padding_bytes,
            segment_tail_bytes: counters.segment_tail_bytes,
            staging_bytes: counters.staging_bytes,
            write_amplification: ratio(counters.media_write_bytes, counters.host_write_bytes),
            gc_write_bytes: counters.gc_write_bytes,
            gc_read_bytes: counters.gc_read_bytes,
            free_segments: state.space().free_count(),
            segments_cleaned: counters.segments_cleaned,
            segment_count: self.geometry.segment_count as u64,
            segment_size_bytes: segment_size,
            page_size_bytes: self.geometry.page_size_bytes as u64,
            codec: self.settings.codec.to_string(),
            gc_policy: self.settings.gc_policy.to_string(),
            unit_max_bytes: self.unit_blocks() as u64 * BLOCK_SIZE_U64,
            recompress: self.options.recompress.to_string(),
            recompressed_bytes: counters.recompressed_blocks * BLOCK_SIZE_U64,
            recompress_saved_bytes: counters
                .recompress_in_bytes
                .saturating_sub(counters.recompress_out_bytes),
            write_effort: self.compressors.policy().to_string(),
            host_write_fast_bytes: counters.host_write_fast_bytes,
            recompress_pending_bytes: pending.bytes,
            fast_stored_bytes: pending.fast_bytes,
            recompress_expected_saving_bytes: (counters.recompress_in_bytes > 0).then(|| {
                let saved = counters
                    .recompress_in_bytes
                    .saturating_sub(counters.recompress_out_bytes);
                (pending.bytes as u128 * saved as u128 / counters.recompress_in_bytes as u128)
                    as u64
            }),
            damaged_blocks: counts.damaged_blocks,
            // The references to shared contents count as the map's.
            map_memory_bytes: state.map().memory_bytes() + state.shared().heap_bytes(),
            map_cache_bytes: state.map().cache_bytes(),
            map_resident_bytes: state.map().resident_bytes(),
            map_leaves,
            map_paged_leaves,
            map_cache_hits: cache.hits,
            map_cache_misses: cache.misses + cache.peeks,
            map_cache_peeks: cache.peeks,
            map_pages_written: cache.pages_written,
            map_pages_kept: cache.pages_kept,
            shared_blocks: state.shared().references(),
            shared_contents: state.shared().contents(),
            distinct_blocks: (counts.data_blocks
                + state.map().kept_counts().data_blocks
                + state.shared().contents())
            .saturating_sub(state.shared().references()),
            snapshots: state.snapshots().len() as u64,
            snapshot_kept_blocks: kept.data_blocks + kept.damaged_blocks,
            snapshot_kept_bytes: kept.stored_bytes,
            clones: state.snapshots().clones().len() as u64,
            clone_volumes: state
                .snapshots()
                .clones()
                .iter()
                .map(|clone| {
                    let counts = state.map().space_counts(clone.space);
                    crate::stats::CloneStats {
                        name: clone.name.clone(),
                        snapshot: state
                            .snapshots()
                            .by_space(clone.base)
                            .map_or_else(String::new, |s| s.name.clone()),
                        own_blocks: counts.data_blocks + counts.damaged_blocks + counts.zero_blocks,
                        own_zero_blocks: counts.zero_blocks,
                        own_bytes: counts.stored_bytes,
                    }
                })
                .collect(),
            clone_blocks: cloned.data_blocks + cloned.damaged_blocks + cloned.zero_blocks,
            clone_bytes: cloned.stored_bytes,
            dedup: if self.settings.dedup { "on" } else { "off" }.to_string(),
            dedup_index_bytes: dedup.ram_bytes,
            dedup_index_bound_bytes: dedup.ram_bound_bytes,
            dedup_lookups: dedup.lookups,
            dedup_found: dedup.index_hits + dedup.request_hits,
            dedup_stale: dedup.stale_hits,
            dedup_chapter_reads: dedup.chapter_reads,
            segments_by_state: usage.by_state,
            sealed_utilization_histogram: usage.histogram,
            counters,
            wear: self.media.drive().map(|drive| drive.wear()),
            media: media_stats
                .iter()
                .map(|stat| (stat.name.to_string(), stat.value))
                .collect(),
            media_help: media_stats
                .iter()
                .map(|stat| (stat.name.to_string(), stat.help))
                .collect(),
        }
    }

    /// Counts `tally`, without the state lock if it is a host I/O counter.
    pub(crate) fn tally(&self, tally: state::Tally) {
        if !self.tallies.add(tally) {
            self.lock().tally(tally);
        }
    }

    fn check_access(&self, offset: u64, len: u64, write: bool) -> Result<()> {
        if write && self.read_only {
            return Err(Error::ReadOnly);
        }
        let size = self.superblock.logical_size_bytes;
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(Error::OutOfRange {
                offset,
                length: len,
                size,
            }),
        }
    }
}

impl Drop for Volume {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Recovers from the newest root; if its checkpoint cannot be read, from
/// the older one, whose dump and log are kept for exactly this. Returns
/// the root recovered from, the state to start from, what happened and
/// the staged sectors laid over the medium.
fn recover_newest(
    media: &dyn Media,
    writable: bool,
    accept_lost: bool,
    ahead: Ahead,
) -> Result<(Root, Opened)> {
    let (roots, mut slot_problems) = read_roots(media)?;
    let mut lost_checkpoints = Vec::new();
    let geometry = media.geometry();
    for (index, candidate) in roots.iter().enumerate() {
        if candidate.superblock.geometry != geometry {
            slot_problems.push(format!(
                "generation {}: geometry {:?} does not match the medium {:?}",
                candidate.generation, candidate.superblock.geometry, geometry
            ));
            continue;
        }
        let older = roots.get(index + 1).filter(|_| index == 0);
        // A damaged slot may have held a newer root: then this root's
        // clean flag says nothing about what came after it.
        let trust_clean = slot_problems.is_empty() && index == 0;
        match recovery::recover(media, candidate, older, trust_clean, writable) {
            Ok(mut recovered) => {
                if !slot_problems.is_empty() {
                    // The damaged slot may have held the next root, whose
                    // run numbered segments and versions up to a
                    // reservation this root does not know, and wrote
                    // records under them into segments this root
                    // calls free. Numbering on from this root's
                    // reservation would reuse them, and a later recovery
                    // would take those leftovers for this run's records.
                    // That root reserved at most a reservation's worth
                    // beyond this one's: start past it.
                    recovered.next_seq += ahead.seq.max(space::SEQ_RESERVE_AHEAD);
                    recovered.next_version = (recovered.next_version
                        + ahead.version.max(space::VERSION_RESERVE_AHEAD))
                    .min(crate::map::VERSION_MAX + 1);
                }
                let (start, mut report, staged) = start_from(recovered, candidate, geometry, ahead);
                report.slot_problems = slot_problems;
                report.lost_checkpoints = lost_checkpoints;
                return Ok((candidate.clone(), (start, report, staged)));
            }
            Err(Error::CorruptImage(problem)) => {
                let problem = format!("generation {}: {problem}", candidate.generation);
                if writable && !accept_lost {
                    // Recovering from the older root for writing would
                    // erase what it did not reserve, and the next root
                    // would hide the loss: stop before touching anything.
                    return Err(Error::CorruptImage(format!(
                        "{problem}; blocks written before that checkpoint may be lost. \
                         `zdisk check` lists what remains; serve it --read-only to copy data \
                         out, or `zdisk check --repair` to accept the loss"
                    )));
                }
                slot_problems.push(problem.clone());
                lost_checkpoints.push(problem);
            }
            Err(other) => return Err(other),
        }
    }
    Err(Error::CorruptImage(format!(
        "no usable checkpoint: {}",
        slot_problems.join("; ")
    )))
}

/// What recovery hands a volume: the state to start from, what happened,
/// and the staged sectors it laid over the medium.
type Opened = (Start, OpenReport, Vec<staging::Staged>);

/// What a volume opens with after recovering from `root`.
fn start_from(recovered: Recovered, root: &Root, geometry: MediaGeometry, ahead: Ahead) -> Opened {
    let Recovered {
        roots,
        map,
        shared,
        snapshots,
        segments,
        next_seq,
        next_version,
        counters,
        report,
        staged,
    } = recovered;
    let space = Space::new(
        segments,
        geometry.segment_size_bytes,
        next_seq,
        next_version,
        ahead,
    );
    let start = Start {
        map,
        shared,
        snapshots,
        space,
        counters,
        generation: root.generation,
        roots,
    };
    (start, report, staged)
}

/// How the segments are used.
struct SegmentUsage {
    by_state: SegmentCounts,
    /// Sealed segments by live tenth.
    histogram: [u64; 11],
    /// Bytes written in segments that are not free.
    used_bytes: u64,
    /// Of those, bytes no live record holds, in segments holding data
    /// (open, sealed, or cleaned and awaiting reuse).
    dead_bytes: u64,
    /// Of those, bytes in checkpoint segments.
    checkpoint_bytes: u64,
}

/// Segments by state, the utilisation histogram of sealed ones, and the
/// bytes written in segments that are not free, live, dead or metadata.
fn segment_usage(state: &State, segment_size: u64) -> SegmentUsage {
    let mut usage = SegmentUsage {
        by_state: SegmentCounts::default(),
        histogram: [0; 11],
        used_bytes: 0,
        dead_bytes: 0,
        checkpoint_bytes: 0,
    };
    for (_, info) in state.space().table().iter() {
        let fill = info.fill_bytes.min(segment_size);
        if info.state != SegmentState::Free {
            usage.used_bytes += fill;
        }
        match info.state {
            SegmentState::Free => usage.by_state.free += 1,
            SegmentState::Open => {
                usage.by_state.open += 1;
                usage.dead_bytes += fill.saturating_sub(info.live_bytes);
            }
            SegmentState::Sealed => {
                usage.by_state.sealed += 1;
                usage.histogram[(info.live_bytes * 10 / segment_size).min(10) as usize] += 1;
                usage.dead_bytes += fill.saturating_sub(info.live_bytes);
            }
            SegmentState::Dump => {
                usage.by_state.checkpoint += 1;
                usage.checkpoint_bytes += fill;
            }
            SegmentState::Reclaimable { .. } => {
                usage.by_state.reclaimable += 1;
                usage.dead_bytes += fill;
            }
        }
    }
    usage
}

fn maintenance_loop(volume: Weak<Volume>) {
    loop {
        let Some(strong) = volume.upgrade() else {
            return;
        };
        if strong.stop.load(Ordering::SeqCst) {
            return;
        }
        // Errors are visible to the next writer through `failed` or as
        // NoSpace; the loop backs off instead of spinning.
        let mut worked = strong.maintenance_tick().unwrap_or(false);
        let mut pause = Duration::from_millis(100);
        if !worked {
            (worked, pause) = strong.cold_turn();
        }
        if !worked {
            let guard = strong.wake_lock.lock().expect("wake lock");
            let (mut guard, _) = strong
                .wake
                .wait_timeout_while(guard, pause, |poked| {
                    !*poked && !strong.stop.load(Ordering::SeqCst)
                })
                .expect("wake lock");
            *guard = false;
        }
    }
}

/// Block status as extents of `offset..offset+len`, from runs of blocks
/// (state, count) starting at the block holding `offset` (they may cover
/// less than the range: a reply may say less than asked).
pub(super) fn extents_of(
    offset: u64,
    len: u64,
    runs: impl IntoIterator<Item = (ExtentState, u64)>,
) -> Vec<Extent> {
    clip_runs(offset, len, runs)
        .map(|(length_bytes, state)| Extent {
            length_bytes,
            state,
        })
        .collect()
}

/// Runs of blocks (what, count) starting at the block holding `offset`,
/// as byte lengths clipped to `offset..offset+len`: the one rule both
/// block status and stored status reply by.
pub(super) fn clip_runs<T>(
    offset: u64,
    len: u64,
    runs: impl IntoIterator<Item = (T, u64)>,
) -> impl Iterator<Item = (u64, T)> {
    let limit = offset + len;
    let mut position = offset;
    let mut run_start = offset / BLOCK_SIZE_U64 * BLOCK_SIZE_U64;
    runs.into_iter().filter_map(move |(what, blocks)| {
        let run_end = (run_start + blocks * BLOCK_SIZE_U64).min(limit);
        run_start += blocks * BLOCK_SIZE_U64;
        (run_end > position).then(|| {
            let length = run_end - position;
            position = run_end;
            (length, what)
        })
    })
}

impl BlockDevice for Volume {
    fn size_bytes(&self) -> u64 {
        self.superblock.logical_size_bytes
    }

    fn is_read_only(&self) -> bool {
        self.read_only
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check_access(offset, buf.len() as u64, false)?;
        self.note_host_io(false);
        self.read_bytes(offset, buf)
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.check_access(offset, data.len() as u64, true)?;
        self.note_host_io(true);
        self.write_bytes(io::Target::VOLUME, offset, data, fua)
    }

    fn write_zeroes(&self, offset: u64, len: u64, may_punch: bool, fua: bool) -> Result<()> {
        self.check_access(offset, len, true)?;
        self.note_host_io(true);
        let mode = if may_punch {
            io::Discard::ZeroPunch
        } else {
            io::Discard::Zero
        };
        self.discard(io::Target::VOLUME, offset, len, mode, fua)
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.check_access(offset, len, true)?;
        self.note_host_io(true);
        self.discard(io::Target::VOLUME, offset, len, io::Discard::Trim, fua)
    }

    fn flush(&self) -> Result<()> {
        self.media
            .host_transfer(crate::media::HostDirection::Write, 0);
        Volume::flush(self)
    }

    fn block_status(&self, offset: u64, len: u64, max_extents: usize) -> Result<Vec<Extent>> {
        self.check_access(offset, len, false)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        let first = offset / BLOCK_SIZE_U64;
        let end = (offset + len).div_ceil(BLOCK_SIZE_U64);
        let runs = {
            let state = self.lock_resident(Lba(first), end - first)?;
            state
                .map()
                .runs(Lba(first), end - first, max_extents.max(1))
        };
        let runs = runs.into_iter().map(|(slot, blocks)| {
            let state = match slot {
                Slot::Hole => ExtentState::Hole,
                Slot::Zero => ExtentState::Zero,
                Slot::Data(_) | Slot::Shared { .. } | Slot::Damaged => ExtentState::Data,
            };
            (state, blocks)
        });
        Ok(extents_of(offset, len, runs))
    }

    fn stored_status(
        &self,
        offset: u64,
        len: u64,
        max_extents: usize,
    ) -> Result<Vec<StoredExtent>> {
        self.check_access(offset, len, false)?;
        self.stored_runs(status::View::Volume, offset, len, max_extents)
    }
}
