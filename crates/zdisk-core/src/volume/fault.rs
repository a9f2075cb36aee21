//! Map page faults read outside the state lock (issue #23).
//!
//! [`Volume::lock_resident`] returns the state lock with every map leaf of
//! a range in RAM, without holding the lock while a page is read: under
//! the lock it lists the range's paged-out leaves and pins the range (its
//! leaves stay in RAM and the dump it reads stays on the medium:
//! `map/fault.rs`), lets the lock go while it reads and verifies the
//! pages, then takes the lock again, installs them and looks again. The
//! caller goes on under the lock it gets back, so nothing it looks up can
//! be evicted meanwhile: eviction only runs as a guard is dropped.
//!
//! A page that fails to verify is reported only if it is still where it
//! was read from. One that a checkpoint moved meanwhile is read again from
//! its new place, never taken for damage.
//!
//! The range's leaves are all in RAM at once, past the cache if the cache
//! is smaller (until the caller lets the lock go), so any range ends up
//! resident whatever the cache; the cost is RAM for its leaves. A request
//! (at most 32 MiB, 8,192 blocks: 32 chunks) touches at most 33 leaves of
//! at most about 4 KiB each. A longer walk (block status of a whole
//! device) holds its range's leaves in RAM until it lets the lock go, as
//! loading them under the lock always did.

use std::collections::HashSet;

use crate::error::{Error, Result};
use crate::map::{Fault, FaultPin};
use crate::units::Lba;

use super::guard::StateGuard;
use super::Volume;

/// Rounds of faults after which `lock_resident` gives up. A round after
/// the first only happens when a page failed to read and a checkpoint
/// had moved it meanwhile (a page that only moved is installed from
/// where it was read: `Map::install`; the pin keeps every other leaf of
/// the range in RAM), and a checkpoint takes far longer than a page read.
const FAULT_ROUNDS_MAX: u32 = 16;

impl Volume {
    /// The state lock, with every map leaf of blocks `first..first+count`
    /// in RAM: pages are read without the lock (see the module docs).
    pub(crate) fn lock_resident(&self, first: Lba, count: u64) -> Result<StateGuard<'_>> {
        self.make_resident(self.lock(), &[(first, count)])
    }

    /// `state`, or the lock taken again, with every map leaf of each of
    /// `ranges` in RAM. Pages are read with the lock released; whoever
    /// goes on under the returned guard finds the leaves there, as leaves
    /// are only evicted when a guard is dropped.
    ///
    /// The pins of every round are kept until the last: a leaf installed
    /// in one round stays in RAM through the next (another thread's guard
    /// drop would otherwise evict it while this one reads the rest, and
    /// with a small cache and many ranges, such as the cleaner's, the
    /// rounds would never end).
    pub(crate) fn make_resident<'a>(
        &'a self,
        mut state: StateGuard<'a>,
        ranges: &[(Lba, u64)],
    ) -> Result<StateGuard<'a>> {
        let mut pins: Vec<FaultPin> = Vec::new();
        let mut rounds = 0;
        let result = loop {
            let mut seen = HashSet::new();
            // The same blocks in every snapshot's key space come too (a
            // change there may keep an entry for a snapshot, the cleaner
            // may find a member kept), and the cells of the shared
            // entries in all of them.
            let kept = state.kept_ranges(ranges);
            let mut all: Vec<(Lba, u64)> = ranges.iter().chain(&kept).copied().collect();
            // A snapshot's read names every newer snapshot's space, and so
            // does each range's kept set: look at each range once.
            all.sort_unstable();
            all.dedup();
            let cells = state.map().paged_cells(&all);
            let wanted: Vec<(Lba, u64, Vec<Fault>)> = all
                .iter()
                .chain(&cells)
                .filter_map(|&(first, count)| {
                    let mut faults = state.map().faults(first, count);
                    // A leaf shared by two ranges is read once.
                    faults.retain(|fault| seen.insert(fault.start()));
                    (!faults.is_empty()).then_some((first, count, faults))
                })
                .collect();
            if wanted.is_empty() {
                if rounds == 0 {
                    state.note_map_hit();
                }
                break Ok(());
            }
            if rounds == FAULT_ROUNDS_MAX {
                let (first, count, _) = wanted[0];
                break Err(Error::io(
                    format!("reading the map pages of blocks {first}+{count}"),
                    std::io::Error::other(format!(
                        "checkpoints moved them {rounds} times while they were read"
                    )),
                ));
            }
            rounds += 1;
            pins.extend(
                wanted
                    .iter()
                    .map(|(first, count, faults)| state.pin_map_faults(*first, *count, faults)),
            );
            drop(state);
            let read: Vec<_> = wanted
                .iter()
                .flat_map(|(_, _, faults)| faults.iter())
                .map(|fault| fault.read(&*self.media))
                .collect();
            state = self.lock();
            let mut failure = None;
            let faults = wanted.iter().flat_map(|(_, _, faults)| faults.iter());
            for (fault, leaf) in faults.zip(read) {
                match leaf {
                    Ok(leaf) => drop(state.install_map_fault(fault, leaf)),
                    // A page that moved meanwhile is read again from its
                    // new place; one still there is damaged.
                    Err(error) if state.map().fault_is_current(fault) => {
                        failure.get_or_insert(error);
                    }
                    Err(_) => {}
                }
            }
            if let Some(error) = failure {
                break Err(error);
            }
        };
        for pin in pins {
            state.unpin_map_faults(pin);
        }
        result.map(|()| state)
    }
}

#[cfg(test)]
mod tests {
    //! `lock_resident` against a map paged out through a cache of zero:
    //! every lookup it allows finds the entry written, no medium read runs
    //! while the state lock is held, a dump released while a fault reads
    //! it waits for the fault, and readers racing a checkpoint loop never
    //! fail nor find damage.

    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, OnceLock, Weak};
    use std::time::Duration;

    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    use crate::device::BlockDevice;
    use crate::error::Result;
    use crate::map::{Entry, Slot};
    use crate::media::{Media, MediaGeometry, MemMedia};
    use crate::units::{Lba, PageIndex, SegmentId, BLOCK_SIZE};
    use crate::{CreateOptions, OpenOptions, Volume};

    /// A medium that counts reads made while the volume's state mutex is
    /// held (only meaningful with one thread using the volume), and can
    /// slow reads down to widen races.
    struct Watched {
        inner: MemMedia,
        volume: OnceLock<Weak<Volume>>,
        watching: AtomicBool,
        reads_under_lock: AtomicU64,
        reads: AtomicU64,
        read_delay_us: AtomicU64,
    }

    thread_local! {
        /// Set on a thread whose reads `read_delay_us` slows: the readers',
        /// so that their faults span whole checkpoints, which run at full
        /// speed beside them.
        static SLOWED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    impl Watched {
        fn note_read(&self) {
            self.reads.fetch_add(1, Ordering::Relaxed);
            if self.watching.load(Ordering::Relaxed) {
                let volume = self.volume.get().and_then(Weak::upgrade);
                if volume.is_some_and(|volume| volume.state.try_write().is_err()) {
                    self.reads_under_lock.fetch_add(1, Ordering::Relaxed);
                }
            }
            let delay = self.read_delay_us.load(Ordering::Relaxed);
            if delay > 0 && SLOWED.get() {
                std::thread::sleep(Duration::from_micros(delay));
            }
        }
    }

    impl Media for Watched {
        fn geometry(&self) -> MediaGeometry {
            self.inner.geometry()
        }
        fn physical_size_bytes(&self) -> u64 {
            self.inner.physical_size_bytes()
        }
        fn write_pages(&self, segment: SegmentId, first: PageIndex, data: &[u8]) -> Result<()> {
            self.inner.write_pages(segment, first, data)
        }
        fn read(&self, segment: SegmentId, offset_bytes: u64, buf: &mut [u8]) -> Result<()> {
            self.note_read();
            self.inner.read(segment, offset_bytes, buf)
        }
        fn erase_segment(&self, segment: SegmentId) -> Result<()> {
            self.inner.erase_segment(segment)
        }
        fn prepare_segment(&self, segment: SegmentId) -> Result<()> {
            self.inner.prepare_segment(segment)
        }
        fn sync(&self) -> Result<()> {
            self.inner.sync()
        }
        fn write_meta_slot(&self, slot: usize, data: &[u8]) -> Result<()> {
            self.inner.write_meta_slot(slot, data)
        }
        fn read_meta_slot(&self, slot: usize) -> Result<Vec<u8>> {
            self.inner.read_meta_slot(slot)
        }
        fn describe(&self) -> String {
            self.inner.describe()
        }
    }

    const SEGMENT_BYTES: u64 = 256 * 1024;

    /// A volume whose map leaves are all paged out at every release of the
    /// state lock (a cache of zero), over a watched medium, with
    /// `written` blocks of data in a mix of leaf forms: dense chunks,
    /// scattered blocks, a zeroed range.
    fn paged_volume(seed: u64) -> (Arc<Watched>, Arc<Volume>, Vec<(u64, Entry)>) {
        let media = Arc::new(Watched {
            inner: MemMedia::with_size(4096, SEGMENT_BYTES, 256).unwrap(),
            volume: OnceLock::new(),
            watching: AtomicBool::new(false),
            reads_under_lock: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            read_delay_us: AtomicU64::new(0),
        });
        let options = OpenOptions {
            background: false,
            map_cache_bytes: Some(0),
            ..OpenOptions::default()
        };
        let volume = Volume::create(
            media.clone() as Arc<dyn Media>,
            CreateOptions::new(4 << 30),
            options,
        )
        .unwrap();
        media.volume.set(Arc::downgrade(&volume)).unwrap();
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut block = vec![0u8; BLOCK_SIZE];
        let mut put = |lba: u64| {
            block[..8].copy_from_slice(&lba.to_le_bytes());
            volume
                .write(lba * BLOCK_SIZE as u64, &block, false)
                .unwrap();
        };
        for lba in 0..768 {
            put(lba);
        }
        for _ in 0..600 {
            put(rng.gen_range(768..200_000));
        }
        volume
            .write_zeroes(
                300_000 * BLOCK_SIZE as u64,
                4096 * BLOCK_SIZE as u64,
                false,
                false,
            )
            .unwrap();
        volume.checkpoint().unwrap();
        // Every leaf is clean now, and went as the checkpoint let go of
        // the lock; the map as written, read back the old way.
        let expected: Vec<(u64, Entry)> = {
            // Under the checker's lock, which may read under it.
            let mut state = volume.lock_frozen();
            let total = 310_000;
            state.load_map(Lba(0), total).unwrap();
            (0..total)
                .map(|lba| (lba, state.map().get(Lba(lba))))
                .collect()
        };
        let stats = volume.stats();
        assert_eq!(
            stats.map_paged_leaves, stats.map_leaves,
            "a cache of zero pages every clean leaf out"
        );
        assert!(stats.map_leaves > 8, "only {} leaves", stats.map_leaves);
        (media, volume, expected)
    }

    /// Looks `first..first+count` up through `lock_resident` and compares
    /// with `expected`.
    fn check_range(volume: &Volume, expected: &[(u64, Entry)], first: u64, count: u64) {
        let state = volume.lock_resident(Lba(first), count).unwrap();
        for &(lba, entry) in &expected[first as usize..(first + count) as usize] {
            let found = state.map().get(Lba(lba));
            assert_eq!(found.version(), entry.version(), "block {lba}");
            assert_eq!(
                std::mem::discriminant(&found.slot()),
                std::mem::discriminant(&entry.slot()),
                "block {lba}: {:?}, expected {:?}",
                found.slot(),
                entry.slot()
            );
        }
    }

    #[test]
    fn lock_resident_finds_every_entry_and_reads_nothing_under_the_lock() {
        let (media, volume, expected) = paged_volume(1);
        let data = expected
            .iter()
            .filter(|(_, e)| matches!(e.slot(), Slot::Data(_)))
            .count();
        assert!(data >= 768 + 500, "{data} blocks of data");
        media.watching.store(true, Ordering::Relaxed);
        let before = volume.stats();
        let reads = media.reads.load(Ordering::Relaxed);
        let mut rng = SmallRng::seed_from_u64(2);
        let mut ranges: Vec<(u64, u64)> = vec![(0, 768), (0, 1), (767, 2), (299_990, 4200)];
        // Ranges spanning many leaves, and single blocks.
        ranges.extend((0..200).map(|_| (rng.gen_range(0..300_000), rng.gen_range(1..9000))));
        ranges.extend((0..200).map(|_| (rng.gen_range(0..310_000 - 1), 1)));
        for &(first, count) in &ranges {
            let count = count.min(expected.len() as u64 - first);
            // All of them, in one round: one miss per leaf read, a hit
            // when none is paged out.
            let faults = volume.lock().map().faults(Lba(first), count).len() as u64;
            let cache = volume.stats();
            check_range(&volume, &expected, first, count);
            let now = volume.stats();
            assert_eq!(now.map_cache_misses - cache.map_cache_misses, faults);
            assert_eq!(
                now.map_cache_hits - cache.map_cache_hits,
                u64::from(faults == 0)
            );
        }
        media.watching.store(false, Ordering::Relaxed);
        let after = volume.stats();
        assert!(
            media.reads.load(Ordering::Relaxed) > reads,
            "no page was read: the test proves nothing"
        );
        assert_eq!(
            media.reads_under_lock.load(Ordering::Relaxed),
            0,
            "a map page was read under the state lock"
        );
        assert!(after.map_cache_misses > before.map_cache_misses);
        assert_eq!(
            after.map_paged_leaves, after.map_leaves,
            "all paged out again"
        );
        let report = volume.check(true).unwrap();
        assert!(report.is_clean(), "{report:?}");
    }

    /// A fault pinned on the newest dump while two checkpoints go by: the
    /// second releases that dump, which must wait for the pin; the read
    /// still verifies and is installed (the leaf is unchanged, only its
    /// page moved), and the dump's segments are freed when the pin goes.
    #[test]
    fn a_dump_released_under_a_pinned_fault_waits_for_it() {
        let (_media, volume, expected) = paged_volume(3);
        let (faults, pin) = {
            let mut state = volume.lock();
            let faults = state.map().faults(Lba(0), 768);
            assert!(!faults.is_empty());
            let pin = state.pin_map_faults(Lba(0), 768, &faults);
            (faults, pin)
        };
        let generation = faults[0].generation();
        volume.checkpoint().unwrap();
        volume.checkpoint().unwrap();
        {
            let state = volume.lock();
            assert!(
                state.map().deferred_dump_segments().count() > 0,
                "the dump of generation {generation} was released under a pin"
            );
            assert!(faults.iter().all(|f| !state.map().fault_is_current(f)));
        }
        // The deferred segments count as a dump's, not as leaked.
        let report = volume.check(false).unwrap();
        assert!(report.is_clean(), "{report:?}");
        let read: Vec<_> = faults
            .iter()
            .map(|f| f.read(&*volume.media).unwrap())
            .collect();
        let mut state = volume.lock();
        // The leaves stayed paged out under the pin: only their pages
        // moved, and what was read from the old ones is installed.
        for (fault, leaf) in faults.iter().zip(read) {
            assert!(
                state.install_map_fault(fault, leaf),
                "a leaf whose page only moved was not installed"
            );
        }
        let free_pinned = state.space().free_count();
        let deferred = state.map().deferred_dump_segments().count() as u64;
        state.unpin_map_faults(pin);
        assert_eq!(state.map().deferred_dump_segments().count(), 0);
        assert_eq!(state.space().free_count(), free_pinned + deferred);
        drop(state);
        check_range(&volume, &expected, 0, 768);
        let report = volume.check(true).unwrap();
        assert!(report.is_clean(), "{report:?}");
    }

    /// Readers fault leaves in through `lock_resident` (their reads slowed
    /// so that checkpoints overtake them) while another thread checkpoints in a
    /// loop, moving every page and releasing the dumps they are read from.
    /// The readers go on until the checkpointer has seen a released dump
    /// wait for a pin, so the race is known to have happened.
    #[test]
    fn readers_racing_checkpoints_never_fail() {
        let (media, volume, expected) = paged_volume(4);
        let expected = Arc::new(expected);
        media.read_delay_us.store(200, Ordering::Relaxed);
        let stop = Arc::new(AtomicBool::new(false));
        let deferrals_seen = Arc::new(AtomicU64::new(0));
        let checkpointer = {
            let (volume, stop, seen) = (volume.clone(), stop.clone(), deferrals_seen.clone());
            std::thread::spawn(move || {
                let mut checkpoints = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    volume.checkpoint().unwrap();
                    checkpoints += 1;
                    if volume
                        .lock()
                        .map()
                        .deferred_dump_segments()
                        .next()
                        .is_some()
                    {
                        seen.fetch_add(1, Ordering::Relaxed);
                    }
                }
                checkpoints
            })
        };
        let readers: Vec<_> = (0..3)
            .map(|reader| {
                let (volume, expected) = (volume.clone(), expected.clone());
                let seen = deferrals_seen.clone();
                std::thread::spawn(move || {
                    let mut rng = SmallRng::seed_from_u64(10 + reader);
                    SLOWED.set(true);
                    let mut ranges = 0;
                    while ranges < 150 || (seen.load(Ordering::Relaxed) == 0 && ranges < 20_000) {
                        let first = rng.gen_range(0..305_000);
                        let count = rng.gen_range(1..600);
                        check_range(&volume, &expected, first, count);
                        ranges += 1;
                    }
                })
            })
            .collect();
        for reader in readers {
            reader.join().expect("a reader failed");
        }
        stop.store(true, Ordering::Relaxed);
        let checkpoints = checkpointer.join().expect("the checkpointer failed");
        media.read_delay_us.store(0, Ordering::Relaxed);
        assert!(checkpoints >= 2, "only {checkpoints} checkpoints ran");
        assert!(
            deferrals_seen.load(Ordering::Relaxed) > 0,
            "no dump release ever waited for a fault: the race never happened"
        );
        let stats = volume.stats();
        assert_eq!(stats.counters.damaged_blocks_found, 0);
        assert_eq!(stats.damaged_blocks, 0);
        assert_eq!(
            volume.lock().map().deferred_dump_segments().count(),
            0,
            "a deferred dump outlived its pins"
        );
        let report = volume.check(true).unwrap();
        assert!(report.is_clean(), "{report:?}");
    }

    /// Reads through the volume (peeks, with a cache of zero always full,
    /// and faults for a leaf met twice) while another thread checkpoints
    /// in a loop, moving every page and reusing the dumps' segments, and a
    /// writer rewrites blocks, its garbage cleaned: a peek reads without a
    /// pin, so its page may move or be overwritten under it, and its leaf
    /// may change. Every read returns what was written, none reports
    /// damage.
    #[test]
    fn peeks_racing_checkpoints_read_what_was_written() {
        let (media, volume, expected) = paged_volume(5);
        media.read_delay_us.store(100, Ordering::Relaxed);
        let stop = Arc::new(AtomicBool::new(false));
        let checkpointer = {
            let (volume, stop) = (volume.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut checkpoints = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    volume.checkpoint().unwrap();
                    checkpoints += 1;
                }
                checkpoints
            })
        };
        let expected = Arc::new(expected);
        // Rewrites blocks with what they hold: every rewrite leaves garbage
        // behind, which the cleaner reclaims, reusing segments a stale
        // lookup could still name.
        let writer = {
            let (volume, stop, expected) = (volume.clone(), stop.clone(), expected.clone());
            std::thread::spawn(move || {
                let data: Vec<u64> = expected
                    .iter()
                    .filter(|(_, entry)| matches!(entry.slot(), Slot::Data(_)))
                    .map(|&(lba, _)| lba)
                    .collect();
                let mut rng = SmallRng::seed_from_u64(30);
                let mut block = vec![0u8; BLOCK_SIZE];
                let mut writes = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let lba = data[rng.gen_range(0..data.len())];
                    // Incompressible past its tag, so rewrites fill segments.
                    rng.fill(&mut block[..]);
                    block[..8].copy_from_slice(&lba.to_le_bytes());
                    volume
                        .write(lba * BLOCK_SIZE as u64, &block, false)
                        .unwrap();
                    writes += 1;
                    if writes.is_multiple_of(64) {
                        while volume.maintenance_tick().unwrap() {}
                    }
                }
                writes
            })
        };
        let before = volume.stats();
        let readers: Vec<_> = (0..3)
            .map(|reader| {
                let (volume, expected) = (volume.clone(), expected.clone());
                std::thread::spawn(move || {
                    SLOWED.set(true);
                    let mut rng = SmallRng::seed_from_u64(20 + reader);
                    let mut block = vec![0u8; BLOCK_SIZE];
                    let mut reads = 0;
                    // Until the cleaner has run a while, so reads race it.
                    while reads < 1500
                        || (volume.stats().counters.segments_cleaned < 20 && reads < 200_000)
                    {
                        reads += 1;
                        let lba = rng.gen_range(0..expected.len() as u64);
                        volume.read(lba * BLOCK_SIZE as u64, &mut block).unwrap();
                        match expected[lba as usize].1.slot() {
                            Slot::Data(_) => assert_eq!(block[..8], lba.to_le_bytes()),
                            _ => assert!(block.iter().all(|&b| b == 0), "block {lba}"),
                        }
                    }
                })
            })
            .collect();
        for reader in readers {
            reader.join().expect("a reader failed");
        }
        stop.store(true, Ordering::Relaxed);
        let checkpoints = checkpointer.join().expect("the checkpointer failed");
        let writes = writer.join().expect("the writer failed");
        media.read_delay_us.store(0, Ordering::Relaxed);
        let stats = volume.stats();
        assert!(checkpoints >= 5, "only {checkpoints} checkpoints ran");
        assert!(
            stats.counters.segments_cleaned > before.counters.segments_cleaned,
            "{writes} rewrites cleaned no segment"
        );
        assert!(
            stats.map_cache_peeks > before.map_cache_peeks,
            "no read peeked"
        );
        assert_eq!(stats.counters.damaged_blocks_found, 0);
        assert_eq!(stats.damaged_blocks, 0);
        let report = volume.check(true).unwrap();
        assert!(report.is_clean(), "{report:?}");
    }
}
