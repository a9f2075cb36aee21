//! What the map guards, and how it is tested here:
//! - entries pack and unpack exactly (every field at its limits);
//! - against a reference model (an interval map from blocks to entries),
//!   random sets, ranges, trims and zeroes, with and without tombstones,
//!   give the same entries, runs, counts, data and range-version answers,
//!   a dump of the map reads back as the same map, and `check_counts`
//!   (every leaf invariant and running total) holds after every batch;
//! - RAM per stored block stays under 16 bytes for dense data and under
//!   24 for sparse random blocks over 1 TiB, scattered small runs and
//!   trimmed dense data, counted by `memory_bytes`, which in turn is held
//!   to what a counting allocator sees;
//! - a huge WRITE_ZEROES or TRIM costs a leaf, not a leaf per chunk.
//!
//! `map_speed` (ignored; run it in release mode with `--ignored
//! --nocapture`) prints get and set throughput.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeMap;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::entry::{LEN_MAX, SEGMENTS_MAX};
use super::*;
use crate::error::Error;
use crate::units::SegmentId;

/// A medium for walks over a map whose leaves are all in RAM.
fn unused_media() -> crate::media::MemMedia {
    crate::media::MemMedia::with_size(4096, 64 * 1024, 8).unwrap()
}

// --- A counting allocator: heap bytes this thread holds, by glibc's rule.

struct Counting;

thread_local! {
    static HEAP_BYTES: Cell<i64> = const { Cell::new(0) };
}

fn note(delta: i64) {
    let _ = HEAP_BYTES.try_with(|heap| heap.set(heap.get() + delta));
}

fn held(size: usize) -> i64 {
    alloc_bytes(size) as i64
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(held(layout.size()));
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(held(layout.size()));
        System.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note(-held(layout.size()));
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(held(new_size) - held(layout.size()));
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

fn heap_held() -> i64 {
    HEAP_BYTES.with(Cell::get)
}

// --- Helpers.

fn loc(segment: u32, offset: u32, len: u32) -> Slot {
    Slot::Data(Location::record(SegmentId(segment), offset, len))
}

/// A distinct data location for the `n`th write.
fn data(n: u64) -> Slot {
    let members = (n % 5) as u8 + 1;
    Slot::Data(Location::unit_member(
        SegmentId((n % 1000) as u32),
        ((n * 16) % (1 << 30)) as u32,
        16 * (1 + (n % 300) as u32),
        (n % members as u64) as u8,
        members,
    ))
}

// --- The tests that came with the chunked map.

#[test]
fn entries_pack_and_unpack() {
    for slot in [
        Slot::Hole,
        Slot::Zero,
        Slot::Damaged,
        loc(7, 123_456, 4128),
        loc(SEGMENTS_MAX - 2, u32::MAX - 15, 48),
        Slot::Data(Location::unit_member(
            SegmentId(3),
            1 << 20,
            LEN_MAX,
            31,
            32,
        )),
        Slot::Data(Location::unit_member(SegmentId(0), 0, 16, 0, 2)),
        Slot::Shared { content: 0 },
        Slot::Shared {
            content: (1 << 40) + 5,
        },
        Slot::Shared {
            content: VERSION_MAX,
        },
    ] {
        let entry = Entry::new(slot, VERSION_MAX);
        assert_eq!(entry.slot(), slot);
        assert_eq!(entry.version(), VERSION_MAX);
        assert!(entry.is_well_formed());
    }
}

#[test]
fn unit_shares_add_up_to_the_record() {
    for (len, members) in [(4128u32, 1u8), (16, 2), (30_000, 7), (LEN_MAX, 32)] {
        let total: u64 = (0..members)
            .map(|m| Location::unit_member(SegmentId(1), 0, len, m, members).share())
            .sum();
        assert_eq!(total, len as u64, "{len} bytes over {members}");
    }
}

#[test]
fn unwritten_space_costs_no_memory() {
    let map = Map::new(false);
    assert_eq!(map.get(Lba(1 << 40)).slot(), Slot::Hole);
    assert_eq!(map.memory_bytes(), 0);
    assert_eq!(map.runs(Lba(0), 1 << 40, 10), vec![(Slot::Hole, 1 << 40)]);
}

#[test]
fn set_and_trim_keep_counts_and_free_chunks() {
    let mut map = Map::new(false);
    map.set(Lba(5), loc(1, 0, 112), 1);
    map.set(Lba(6), Slot::Zero, 2);
    assert_eq!(map.counts().data_blocks, 1);
    assert_eq!(map.counts().stored_bytes, 112);
    assert_eq!(map.counts().zero_blocks, 1);
    let mut freed = Vec::new();
    map.set_range(Lba(0), 10, RangeState::Hole, 3, false, &mut |l| {
        freed.push(l)
    });
    assert_eq!(freed.len(), 1);
    assert_eq!(map.counts(), MapCounts::default());
    assert_eq!(map.chunk_count(), 0, "an all-hole chunk is dropped");
    assert_eq!(map.memory_bytes(), 0, "and its memory with it");
    map.check_counts().unwrap();
}

#[test]
fn whole_chunk_ranges_are_stored_compactly() {
    let mut map = Map::new(false);
    map.set(Lba(300), loc(2, 16, 64), 1);
    let mut freed = Vec::new();
    map.set_range(Lba(0), 1 << 20, RangeState::Zero, 2, false, &mut |l| {
        freed.push(l)
    });
    assert_eq!(freed.len(), 1);
    assert_eq!(map.counts().zero_blocks, 1 << 20);
    assert_eq!(map.chunk_count(), (1 << 20) / CHUNK_BLOCKS as usize);
    assert!(map.memory_bytes() < 1024, "{} bytes", map.memory_bytes());
    assert_eq!(map.runs(Lba(10), 100, 10), vec![(Slot::Zero, 100)]);
    map.check_counts().unwrap();
}

#[test]
fn recovery_keeps_the_highest_version() {
    let mut map = Map::new(true);
    map.set_if_newer(Lba(1), loc(1, 0, 48), 10);
    assert!(map.set_if_newer(Lba(1), loc(2, 0, 48), 9).is_none());
    map.set_range(Lba(0), 4, RangeState::Hole, 12, true, &mut |_| {});
    assert_eq!(map.get(Lba(1)).slot(), Slot::Hole);
    assert_eq!(
        map.get(Lba(1)).version(),
        12,
        "the tombstone keeps its version"
    );
    assert!(
        map.set_if_newer(Lba(1), loc(3, 0, 48), 11).is_none(),
        "an older write cannot resurrect"
    );
    assert!(
        map.set_if_newer(Lba(1), loc(3, 0, 48), 12).is_some(),
        "equal versions: later copy wins"
    );
    map.compact();
    map.check_counts().unwrap();
}

#[test]
fn runs_merge_equal_states() {
    let mut map = Map::new(false);
    for lba in 10..20 {
        map.set(Lba(lba), loc(1, lba as u32 * 64, 64), lba);
    }
    map.set(Lba(20), Slot::Zero, 50);
    let runs = map.runs(Lba(0), 1000, 100);
    let kinds: Vec<u64> = runs.iter().map(|r| r.1).collect();
    assert_eq!(kinds, vec![10, 10, 1, 979]);
    assert_eq!(map.runs(Lba(0), 1000, 2).len(), 2);
}

// --- The leaf forms.

#[test]
fn a_huge_zero_or_trim_costs_one_leaf() {
    for keep_tombstones in [false, true] {
        let mut map = Map::new(keep_tombstones);
        let tib_blocks = 1u64 << 28;
        map.set_range(Lba(5), tib_blocks, RangeState::Zero, 1, false, &mut |_| {});
        assert!(map.memory_bytes() < 4 * 4096, "{}", map.memory_bytes());
        assert_eq!(map.counts().zero_blocks, tib_blocks);
        map.set(Lba(1 << 27), data(1), 2);
        map.set_range(Lba(1000), 1 << 26, RangeState::Hole, 3, false, &mut |_| {});
        assert!(map.memory_bytes() < 8 * 4096, "{}", map.memory_bytes());
        assert_eq!(map.chunk_count() as u64, map.chunk_items);
        map.check_counts().unwrap();
        let mut copy = Map::new(keep_tombstones);
        map.for_each_chunk(|index, chunk| copy.insert_chunk(index, chunk.clone()).unwrap());
        assert_eq!(copy.counts(), map.counts());
        assert_eq!(
            copy.leaves.len(),
            map.leaves.len(),
            "a dump's runs join again"
        );
        map.set_range(Lba(0), 1 << 40, RangeState::Hole, 4, false, &mut |_| {});
        map.check_counts().unwrap();
        assert_eq!(map.counts(), MapCounts::default());
        if !keep_tombstones {
            assert_eq!(map.memory_bytes(), 0);
        }
    }
}

#[test]
fn dense_chunks_become_sparse_when_trimmed_and_back() {
    let mut map = Map::new(false);
    for lba in 0..CHUNK_BLOCKS {
        map.set(Lba(lba), data(lba), lba + 1);
    }
    assert!(matches!(map.leaves.get(&0), Some(Leaf::Dense { .. })));
    for lba in 0..CHUNK_BLOCKS - DENSE_KEEP as u64 + 1 {
        map.set(Lba(lba), Slot::Hole, 1000 + lba);
    }
    assert!(matches!(map.leaves.get(&0), Some(Leaf::Sparse { .. })));
    for lba in 0..CHUNK_BLOCKS {
        map.set(Lba(lba), data(lba), 2000 + lba);
    }
    assert!(matches!(map.leaves.get(&0), Some(Leaf::Dense { .. })));
    map.check_counts().unwrap();
}

#[test]
fn versions_far_apart_widen_a_leaf() {
    let mut map = Map::new(false);
    map.set(Lba(3), data(1), 1);
    map.set(Lba(4), data(2), VERSION_MAX);
    for lba in 0..CHUNK_BLOCKS {
        map.set(
            Lba(CHUNK_BLOCKS + lba),
            data(lba),
            if lba % 2 == 0 { 5 } else { 1 << 47 },
        );
    }
    assert_eq!(map.get(Lba(3)).version(), 1);
    assert_eq!(map.get(Lba(4)).version(), VERSION_MAX);
    assert_eq!(map.get(Lba(CHUNK_BLOCKS + 1)).version(), 1 << 47);
    let wide = |start: u64| match map.leaves.get(&start) {
        Some(Leaf::Sparse { column, .. } | Leaf::Dense { column, .. }) => column.is_wide(),
        _ => false,
    };
    assert!(wide(0) && wide(CHUNK_BLOCKS), "no narrow cell holds both");
    map.check_counts().unwrap();
}

// --- Against a reference model.

/// The reference: intervals of blocks, each holding one entry; blocks
/// outside them are holes at version 0.
#[derive(Default)]
struct Model {
    intervals: BTreeMap<u64, (u64, Entry)>,
}

impl Model {
    fn get(&self, lba: u64) -> Entry {
        match self.intervals.range(..=lba).next_back() {
            Some((_, &(end, entry))) if lba < end => entry,
            _ => Entry::default(),
        }
    }

    /// Splits intervals at `at`.
    fn cut(&mut self, at: u64) {
        if let Some((&start, &(end, entry))) = self.intervals.range(..at).next_back() {
            if at < end {
                self.intervals.insert(start, (at, entry));
                self.intervals.insert(at, (end, entry));
            }
        }
    }

    /// Replaces each part of `from..to` by `f` of what it held; returns
    /// the data entries replaced.
    fn update(&mut self, from: u64, to: u64, f: impl Fn(Entry) -> Entry) -> Vec<Entry> {
        self.cut(from);
        self.cut(to);
        let mut parts = Vec::new();
        let mut cursor = from;
        for (&start, &(end, entry)) in self.intervals.range(from..to) {
            if start > cursor {
                parts.push((cursor, start, Entry::default()));
            }
            parts.push((start, end, entry));
            cursor = end;
        }
        if cursor < to {
            parts.push((cursor, to, Entry::default()));
        }
        let mut replaced = Vec::new();
        for (start, end, old) in parts {
            let new = f(old);
            if new != old && old.is_data() {
                assert_eq!(end - start, 1, "data is set block by block");
                replaced.push(old);
            }
            self.intervals.remove(&start);
            if new != Entry::default() {
                self.intervals.insert(start, (end, new));
            }
        }
        replaced
    }

    fn counts(&self) -> MapCounts {
        let mut counts = MapCounts::default();
        for (&start, &(end, entry)) in &self.intervals {
            counts.add(entry.slot(), end - start);
        }
        counts
    }

    fn runs(&self, first: u64, count: u64, max_runs: usize) -> Vec<(Slot, u64)> {
        let mut runs: Vec<(Slot, u64)> = Vec::new();
        let mut push = |slot: Slot, blocks: u64| {
            let kind = match slot {
                Slot::Data(_) => Slot::Data(Location::record(SegmentId(0), 0, 16)),
                other => other,
            };
            match runs.last_mut() {
                Some((last, n)) if *last == kind => *n += blocks,
                _ => runs.push((kind, blocks)),
            }
        };
        let end = first + count;
        let mut cursor = first;
        let from = match self.intervals.range(..=first).next_back() {
            Some((&start, &(stop, _))) if first < stop => start,
            _ => first,
        };
        for (&start, &(stop, entry)) in self.intervals.range(from..end) {
            if start > cursor {
                push(Slot::Hole, start - cursor);
            }
            let (low, high) = (start.max(first), stop.min(end));
            push(entry.slot(), high - low);
            cursor = high;
        }
        if cursor < end {
            push(Slot::Hole, end - cursor);
        }
        runs.truncate(max_runs);
        runs
    }
}

struct Trial {
    rng: SmallRng,
    map: Map,
    model: Model,
    tombstones: bool,
    version: u64,
    writes: u64,
    /// How far block numbers reach.
    reach: u64,
}

impl Trial {
    fn new(seed: u64, tombstones: bool) -> Trial {
        let mut rng = SmallRng::seed_from_u64(seed);
        let reach = [1 << 12, 1 << 20, 1 << 34][rng.gen_range(0..3)];
        Trial {
            rng,
            map: Map::new(tombstones),
            model: Model::default(),
            tombstones,
            version: 1,
            writes: 0,
            reach,
        }
    }

    /// The next version: increasing in normal operation (now and then by
    /// 2^41, which narrow cells cannot span), anything during recovery.
    fn next_version(&mut self) -> u64 {
        if self.tombstones {
            return self.rng.gen_range(1..1000) << self.rng.gen_range(0..36);
        }
        self.version += if self.rng.gen_ratio(1, 500) {
            1 << 41
        } else {
            1
        };
        self.version
    }

    fn lba(&mut self) -> u64 {
        match self.rng.gen_range(0..4) {
            // Near something already there.
            0 if !self.model.intervals.is_empty() => {
                let index = self.rng.gen_range(0..self.model.intervals.len());
                let (&start, _) = self.model.intervals.iter().nth(index).expect("in range");
                (start + self.rng.gen_range(0..600)).saturating_sub(300) % self.reach
            }
            1 => self.rng.gen_range(0..self.reach.min(1 << 14)),
            _ => self.rng.gen_range(0..self.reach),
        }
    }

    fn step(&mut self) {
        let version = self.next_version();
        let roll = self.rng.gen_range(0..100);
        if roll < 70 {
            let lba = self.lba();
            let slot = match self.rng.gen_range(0..20) {
                0 => Slot::Zero,
                1 => Slot::Damaged,
                2 => Slot::Hole,
                3 => Slot::Shared {
                    content: self.rng.gen_range(0..=VERSION_MAX),
                },
                _ => {
                    self.writes += 1;
                    data(self.writes)
                }
            };
            let new = Entry::new(slot, version);
            let old_model = self.model.get(lba);
            if self.tombstones {
                let replaced = self.map.set_if_newer(Lba(lba), slot, version);
                let applied = old_model.version() <= version;
                assert_eq!(replaced.is_some(), applied, "block {lba}");
                if applied {
                    self.model.update(lba, lba + 1, |_| new);
                }
            } else {
                let old = self.map.set(Lba(lba), slot, version);
                assert_eq!(old.slot(), old_model.slot(), "block {lba}");
                self.model.update(lba, lba + 1, |_| new);
            }
        } else {
            let first = self.lba();
            let count = match self.rng.gen_range(0..10) {
                0 => {
                    let bits = self.rng.gen_range(1..=self.reach.ilog2());
                    self.rng.gen_range(1..=1 << bits)
                }
                1..=3 => self.rng.gen_range(1..4 * CHUNK_BLOCKS),
                _ => self.rng.gen_range(1..40),
            }
            .min(self.reach * 2);
            let state = match self.rng.gen_range(0..5) {
                0 | 1 => RangeState::Hole,
                2 | 3 => RangeState::Zero,
                _ => RangeState::Damaged,
            };
            let new = Entry::new(state.slot(), version);
            let only_newer = self.tombstones;
            let mut displaced = Vec::new();
            self.map.set_range(
                Lba(first),
                count,
                state,
                version,
                only_newer,
                &mut |slot| match slot {
                    Slot::Data(loc) => displaced.push(loc),
                    Slot::Shared { .. } => {}
                    other => panic!("displaced {other:?}"),
                },
            );
            let mut replaced: Vec<Location> = self
                .model
                .update(first, first + count, |old| {
                    if only_newer && old.version() > version {
                        old
                    } else {
                        new
                    }
                })
                .into_iter()
                .filter_map(|entry| match entry.slot() {
                    Slot::Data(loc) => Some(loc),
                    _ => None,
                })
                .collect();
            let key = |l: &Location| (l.segment, l.offset, l.len, l.member, l.members);
            displaced.sort_by_key(key);
            replaced.sort_by_key(key);
            assert_eq!(displaced, replaced, "range {first}+{count}");
        }
    }

    /// The leaf forms the map holds now: run, dense, sparse, wide column.
    fn forms(&self) -> [bool; 4] {
        let mut seen = [false; 4];
        for leaf in self.map.leaves.values() {
            match leaf {
                Leaf::Run { .. } => seen[0] = true,
                Leaf::Dense { column, .. } => {
                    seen[1] = true;
                    seen[3] |= column.is_wide();
                }
                Leaf::Sparse { column, .. } => {
                    seen[2] = true;
                    seen[3] |= column.is_wide();
                }
                Leaf::Paged { .. } => {}
            }
        }
        seen
    }

    /// Compares everything the map answers with the model.
    fn check(&mut self) {
        self.map.check_counts().unwrap();
        assert_eq!(self.map.counts(), self.model.counts());
        let mut probes: Vec<u64> = Vec::new();
        for (&start, &(end, _)) in &self.model.intervals {
            probes.extend([start.saturating_sub(1), start, end - 1, end]);
        }
        for _ in 0..200 {
            probes.push(self.lba());
        }
        for &lba in &probes {
            let (got, want) = (self.map.get(Lba(lba)), self.model.get(lba));
            assert_eq!(got.slot(), want.slot(), "block {lba}");
            if self.tombstones || !want.is_hole() {
                assert_eq!(got.version(), want.version(), "block {lba}");
            } else {
                assert!(got.version() == 0 || got.version() == want.version());
            }
        }
        for _ in 0..20 {
            let first = self.lba();
            let count = self.rng.gen_range(1..3 * CHUNK_BLOCKS);
            let max_runs = self.rng.gen_range(1..20);
            let got = self.map.runs(Lba(first), count, max_runs);
            assert_eq!(
                got,
                self.model.runs(first, count, max_runs),
                "{first}+{count}"
            );
            let mut blocks = Vec::new();
            self.map.for_each_in(Lba(first), count, |lba, entry| {
                blocks.push((lba.0, entry.slot()))
            });
            let want: Vec<(u64, Slot)> = (first..first + count)
                .map(|lba| (lba, self.model.get(lba).slot()))
                .collect();
            assert_eq!(blocks, want);
            let version = self.model.get(first).version();
            let model_any =
                (first..first + count).any(|lba| self.model.get(lba).version() == version);
            let model_all_newer =
                (first..first + count).all(|lba| self.model.get(lba).version() > version);
            if self.tombstones {
                assert_eq!(
                    self.map.any_at_version(Lba(first), count, version),
                    model_any
                );
                assert_eq!(
                    self.map.all_newer_than(Lba(first), count, version),
                    model_all_newer
                );
            } else if self.map.all_newer_than(Lba(first), count, version) {
                assert!(model_all_newer, "a trim record dropped too early");
            }
        }
        let mut data_blocks = Vec::new();
        let media = unused_media();
        self.map
            .for_each_data(&media, |lba, loc, version| {
                data_blocks.push((lba.0, Slot::Data(loc), version))
            })
            .unwrap();
        let want: Vec<(u64, Slot, u64)> = self
            .model
            .intervals
            .iter()
            .filter(|(_, (_, entry))| matches!(entry.slot(), Slot::Data(_)))
            .map(|(&start, &(_, entry))| (start, entry.slot(), entry.version()))
            .collect();
        assert_eq!(data_blocks, want);
        let damaged_want = self.model.counts().damaged_blocks;
        if damaged_want < 1 << 20 {
            let mut damaged = Vec::new();
            self.map
                .for_each_damaged(&unused_media(), |lba| damaged.push(lba.0))
                .unwrap();
            assert_eq!(damaged.len() as u64, damaged_want);
            assert!(damaged.windows(2).all(|pair| pair[0] < pair[1]));
            assert!(damaged
                .iter()
                .all(|&lba| self.model.get(lba).slot() == Slot::Damaged));
        }
        if self.map.chunk_count() < 1 << 16 {
            self.check_dump();
        }
    }

    /// A dump of the map reads back as the same map.
    fn check_dump(&self) {
        let mut copy = Map::new(true);
        let mut chunks = 0;
        self.map.for_each_chunk(|index, chunk| {
            chunks += 1;
            copy.insert_chunk(index, chunk.clone()).unwrap();
        });
        assert_eq!(chunks, self.map.chunk_count());
        copy.check_counts().unwrap();
        if !self.tombstones {
            copy.compact();
            copy.check_counts().unwrap();
        }
        assert_eq!(copy.counts(), self.map.counts());
        for (&start, &(end, want)) in &self.model.intervals {
            for lba in [start, end - 1] {
                let got = copy.get(Lba(lba));
                assert_eq!(got.slot(), want.slot(), "block {lba} after a dump");
                if !want.is_hole() {
                    assert_eq!(got.version(), want.version(), "block {lba} after a dump");
                }
            }
        }
    }
}

/// Runs a trial per seed; every leaf form must have been met.
fn run_trials(tombstones: bool, seeds: std::ops::Range<u64>, steps: usize) {
    let mut seen = [false; 4];
    for seed in seeds {
        let mut trial = Trial::new(seed, tombstones);
        for step in 0..steps {
            trial.step();
            if step % 97 == 96 {
                trial.check();
                let forms = trial.forms();
                seen.iter_mut()
                    .zip(forms)
                    .for_each(|(seen, form)| *seen |= form);
            }
        }
        trial.check();
        if tombstones {
            trial.map.compact();
            trial.tombstones = false;
            trial.check();
        }
    }
    assert_eq!(seen, [true; 4], "leaf forms met: run, dense, sparse, wide");
}

#[test]
fn the_map_agrees_with_a_model() {
    run_trials(false, 0..40, 2000);
}

#[test]
fn the_map_agrees_with_a_model_during_recovery() {
    run_trials(true, 100..140, 2000);
}

#[test]
fn a_dump_inserted_twice_is_refused() {
    let mut map = Map::new(true);
    map.insert_chunk(
        3,
        Chunk::Uniform {
            state: RangeState::Zero,
            version: 1,
        },
    )
    .unwrap();
    let mut mixed = Box::new([Entry::default(); CHUNK_BLOCKS as usize]);
    mixed[7] = Entry::new(data(1), 2);
    map.insert_chunk(9, Chunk::Mixed(mixed.clone())).unwrap();
    assert!(map.insert_chunk(3, Chunk::Mixed(mixed.clone())).is_err());
    assert!(map
        .insert_chunk(
            9,
            Chunk::Uniform {
                state: RangeState::Zero,
                version: 1
            }
        )
        .is_err());
    assert!(map.insert_chunk(u64::MAX, Chunk::Mixed(mixed)).is_err());
    map.check_counts().unwrap();
}

// --- RAM per stored block.

fn stored_blocks(map: &Map) -> u64 {
    let counts = map.counts();
    counts.data_blocks + counts.zero_blocks + counts.damaged_blocks
}

/// Bytes per stored block by `memory_bytes`, checked against what the
/// allocator saw the map take.
fn bytes_per_block(fill: impl FnOnce(&mut Map)) -> f64 {
    let before = heap_held();
    let mut map = Map::new(false);
    fill(&mut map);
    let seen = (heap_held() - before) as f64;
    let claimed = map.memory_bytes() as f64;
    map.check_counts().unwrap();
    assert!(
        (claimed - seen).abs() <= seen * 0.05 + 256.0,
        "memory_bytes says {claimed}, the allocator saw {seen}"
    );
    claimed / stored_blocks(&map) as f64
}

const TIB_BLOCKS: u64 = 1 << 28;
const FILL_BLOCKS: u64 = 262_144;

#[test]
fn dense_data_costs_at_most_16_bytes_a_block() {
    let per_block = bytes_per_block(|map| {
        for lba in 0..FILL_BLOCKS {
            let member = (lba % 8) as u8;
            let slot = Slot::Data(Location::unit_member(
                SegmentId((lba / 4096) as u32),
                ((lba / 8) * 8192 % (1 << 22)) as u32,
                8192,
                member,
                8,
            ));
            map.set(Lba(lba), slot, lba + 1);
        }
    });
    println!("dense: {per_block:.2} bytes a block");
    assert!(per_block <= 16.0, "{per_block}");
}

#[test]
fn sparse_blocks_over_a_tebibyte_cost_at_most_24_bytes_each() {
    let mut rng = SmallRng::seed_from_u64(12);
    let per_block = bytes_per_block(|map| {
        while stored_blocks(map) < FILL_BLOCKS {
            let lba = rng.gen_range(0..TIB_BLOCKS);
            map.set(Lba(lba), data(lba), lba + 1);
        }
    });
    println!("sparse: {per_block:.2} bytes a block");
    assert!(per_block <= 24.0, "{per_block}");
}

#[test]
fn scattered_small_runs_cost_at_most_24_bytes_a_block() {
    let mut rng = SmallRng::seed_from_u64(13);
    let mut version = 0;
    let per_block = bytes_per_block(|map| {
        while stored_blocks(map) < FILL_BLOCKS {
            let first = rng.gen_range(0..TIB_BLOCKS);
            for lba in first..first + rng.gen_range(1..=16) {
                version += 1;
                map.set(Lba(lba), data(version), version);
            }
        }
    });
    println!("small runs: {per_block:.2} bytes a block");
    assert!(per_block <= 24.0, "{per_block}");
}

#[test]
fn random_fills_and_trims_cost_at_most_24_bytes_a_block() {
    let mut rng = SmallRng::seed_from_u64(14);
    for region in [1 << 16, 1 << 20] {
        let mut version = 0;
        let per_block = bytes_per_block(|map| {
            for _ in 0..region / 2 {
                version += 1;
                let lba = rng.gen_range(0..region);
                map.set(Lba(lba), data(version), version);
            }
            for _ in 0..region / 4 {
                version += 1;
                let lba = rng.gen_range(0..region);
                map.set(Lba(lba), Slot::Hole, version);
            }
        });
        println!("random over {region} blocks, then trims: {per_block:.2} bytes a block");
        assert!(per_block <= 24.0, "{per_block}");
    }
}

#[test]
fn trimmed_dense_data_costs_at_most_24_bytes_a_block() {
    let mut rng = SmallRng::seed_from_u64(15);
    let per_block = bytes_per_block(|map| {
        for lba in 0..FILL_BLOCKS {
            map.set(Lba(lba), data(lba), lba + 1);
        }
        for n in 0..FILL_BLOCKS * 2 / 5 {
            let lba = rng.gen_range(0..FILL_BLOCKS);
            map.set(Lba(lba), Slot::Hole, FILL_BLOCKS + n + 1);
        }
    });
    println!("dense, then random trims: {per_block:.2} bytes a block");
    assert!(per_block <= 24.0, "{per_block}");
}

// --- Speed.

#[test]
#[ignore = "a benchmark: run in release mode with --ignored --nocapture"]
fn map_speed() {
    use std::time::Instant;
    /// The best of five timings of `f`, in ns per op.
    fn best(ops: u64, mut f: impl FnMut()) -> f64 {
        (0..5)
            .map(|_| {
                let start = Instant::now();
                f();
                start.elapsed().as_nanos() as f64 / ops as f64
            })
            .fold(f64::MAX, f64::min)
    }
    let mut rng = SmallRng::seed_from_u64(1);
    let dense_blocks = 4 * FILL_BLOCKS;
    let fill_dense = |map: &mut Map| {
        for lba in 0..dense_blocks {
            map.set(Lba(lba), data(lba), lba + 1);
        }
    };
    let lbas: Vec<u64> = (0..FILL_BLOCKS)
        .map(|_| rng.gen_range(0..TIB_BLOCKS))
        .collect();
    let fill_sparse = |map: &mut Map| {
        for (n, &lba) in lbas.iter().enumerate() {
            map.set(Lba(lba), data(lba), n as u64 + 1);
        }
    };
    let report = |what: &str, ns: f64| println!("{what:<40} {ns:7.1} ns/op");
    report(
        "set, sequential (1 Mi blocks)",
        best(dense_blocks, || fill_dense(&mut Map::new(false))),
    );
    report(
        "set, random over 1 TiB (256 Ki blocks)",
        best(FILL_BLOCKS, || fill_sparse(&mut Map::new(false))),
    );
    let mut dense = Map::new(false);
    fill_dense(&mut dense);
    let mut sparse = Map::new(false);
    fill_sparse(&mut sparse);
    let lookups = 2_000_000u64;
    let probes: Vec<u64> = (0..lookups)
        .map(|_| rng.gen_range(0..dense_blocks))
        .collect();
    let mut sum = 0u64;
    report(
        "get, random, dense",
        best(lookups, || {
            probes.iter().for_each(|&lba| sum += dense.get(Lba(lba)).w0)
        }),
    );
    report(
        "get, random, dense, one after another",
        best(lookups, || {
            let mut last = 0;
            for &lba in &probes {
                // `last` is 0 (no segment reaches bit 23), but, hidden
                // from the compiler, it makes each lookup wait for the
                // one before: latency, not throughput.
                last = std::hint::black_box(dense.get(Lba(lba ^ last)).w0 >> 63);
                sum += last;
            }
        }),
    );
    let mut version = dense_blocks;
    report(
        "set, random overwrite, dense",
        best(lookups, || {
            for &lba in &probes {
                version += 1;
                dense.set(Lba(lba), data(lba), version);
            }
        }),
    );
    let probes: Vec<u64> = (0..lookups)
        .map(|n| lbas[n as usize % lbas.len()] ^ (n & 1))
        .collect();
    report(
        "get, random, sparse (half hit)",
        best(lookups, || {
            probes
                .iter()
                .for_each(|&lba| sum += sparse.get(Lba(lba)).w0)
        }),
    );
    report(
        "get, random, sparse, one after another",
        best(lookups, || {
            let mut last = 0;
            for &lba in &probes {
                last = std::hint::black_box(sparse.get(Lba(lba ^ last)).w0 >> 63);
                sum += last;
            }
        }),
    );
    report(
        "for_each_in, one block, sparse",
        best(lookups, || {
            for &lba in &probes {
                sparse.for_each_in(Lba(lba), 1, |_, entry| sum += entry.w0);
            }
        }),
    );
    println!(
        "(checksum {sum}, {} + {} bytes)",
        dense.memory_bytes(),
        sparse.memory_bytes()
    );
}

// --- Paging: leaves written as pages, evicted, read back.

/// Writes `map`'s pages the way a checkpoint does (both copies, each in
/// its own segments of `media`) and commits them as generation
/// `generation`; every page moves (evicted leaves' pages are copied from
/// where they are). Returns the store.
fn checkpoint_pages(map: &mut Map, media: &crate::media::MemMedia, generation: u64) -> PageStore {
    checkpoint_pages_moving(map, media, generation, |_| true)
}

/// [`checkpoint_pages`], moving only the clean leaves' pages `moves` picks
/// (the others are kept where they are, as a format 4 checkpoint keeps
/// them); returns the store.
fn checkpoint_pages_moving(
    map: &mut Map,
    media: &crate::media::MemMedia,
    generation: u64,
    moves: impl Fn(&PageLoc) -> bool,
) -> PageStore {
    use crate::record::{encode_record, record_len_for_payload, RecordHeader, RecordKind};
    let geometry = media.geometry();
    let segment_size = geometry.segment_size_bytes;
    let key = crate::record::RecordKey([7; 16]);
    let store = PageStore {
        key,
        // The entries name segments of a larger medium than the pages'.
        segment_count: 1 << 20,
        segment_size_bytes: segment_size,
    };
    let pages = map.snapshot_pages(moves);
    // Each page where the last ended, or at the start of the next segment.
    let mut images: Vec<Vec<u8>> = vec![Vec::new()];
    let mut placed: Vec<(u64, usize, u32, u32)> = Vec::new();
    for page in pages.iter().filter(|page| page.is_written()) {
        let payload = match &page.source {
            PageSource::Encoded(payload) => payload.clone(),
            PageSource::Stored(loc) => read_page_payload(media, &store, page.start, *loc).unwrap(),
            PageSource::Kept(_) => unreachable!("filtered out"),
        };
        let len = record_len_for_payload(payload.len());
        if images.last().unwrap().len() as u64 + len > segment_size {
            images.push(Vec::new());
        }
        let image = images.last_mut().unwrap();
        let offset = image.len();
        image.resize(offset + len as usize, 0);
        let header = RecordHeader {
            kind: RecordKind::MapChunk,
            codec: 1,
            seg_seq: 0,
            lba: page.start,
            version: generation,
            payload_len: payload.len() as u32,
            crc: 0,
        };
        encode_record(
            &mut image[offset..],
            header,
            &payload,
            crc32c::crc32c(&payload),
            &key,
        );
        placed.push((page.start, images.len() - 1, offset as u32, len as u32));
    }
    // Generations take turns over three parts of the medium, as a
    // checkpoint's dump never overwrites the one it copies from.
    let part = geometry.segment_count / 3;
    let base = (generation as u32 % 3) * part;
    let segments = images.len() as u32;
    assert!(2 * segments <= part, "the test medium is too small");
    let copies = [
        (0..segments)
            .map(|i| SegmentId(base + i))
            .collect::<Vec<_>>(),
        (0..segments)
            .map(|i| SegmentId(base + segments + i))
            .collect::<Vec<_>>(),
    ];
    let page_size = geometry.page_size_bytes as usize;
    for copy in &copies {
        for (position, image) in images.iter().enumerate() {
            let mut image = image.clone();
            image.resize(image.len().div_ceil(page_size).max(1) * page_size, 0);
            media.erase_segment(copy[position]).unwrap();
            media
                .write_pages(copy[position], crate::units::PageIndex(0), &image)
                .unwrap();
        }
    }
    let placed: Vec<(u64, PageLoc)> = placed
        .into_iter()
        .map(|(start, position, offset, len)| {
            let loc = PageLoc {
                segments: [copies[0][position], copies[1][position]],
                offset,
                len,
                generation,
            };
            (start, loc)
        })
        .collect();
    map.commit_pages(&placed, 0, store.clone());
    store
}

/// Every block of `blocks` reads the same from `map` (loading what it
/// needs) as from `reference` (all in RAM).
fn assert_same(map: &mut Map, reference: &Map, media: &dyn Media, blocks: &[u64]) {
    for &lba in blocks {
        map.load(media, Lba(lba), 1).unwrap();
        assert_eq!(map.get(Lba(lba)), reference.get(Lba(lba)), "block {lba}");
    }
}

/// A map of every leaf form, paged out through a small cache and read
/// back, leaf by leaf and while it changes, equals the same map kept in
/// RAM; dirty leaves are never evicted; evicted pages are checked; a page
/// damaged in one copy is read from the other, and in both is an error.
#[test]
fn pages_evict_and_read_back_unchanged() {
    let media = crate::media::MemMedia::with_size(4096, 256 * 1024, 64).unwrap();
    let mut rng = SmallRng::seed_from_u64(12);
    let (mut map, mut reference) = (Map::new(false), Map::new(false));
    let mut version = 0;
    let mut touched = Vec::new();
    let set = |map: &mut Map, reference: &mut Map, lba: u64, slot: Slot, version: u64| {
        map.load(&media, Lba(lba), 1).unwrap();
        map.set(Lba(lba), slot, version);
        reference.set(Lba(lba), slot, version);
    };
    // Dense chunks, sparse blocks over 2^36 blocks, a zero run, damage.
    for lba in 0..2048u64 {
        version += 1;
        set(&mut map, &mut reference, lba, data(lba), version);
        touched.push(lba);
    }
    for _ in 0..3000 {
        let lba = rng.gen_range(0..1u64 << 36);
        version += 1;
        set(&mut map, &mut reference, lba, data(lba), version);
        touched.push(lba);
    }
    version += 1;
    for target in [&mut map, &mut reference] {
        target.set_range(
            Lba(1 << 20),
            4096,
            RangeState::Zero,
            version,
            false,
            &mut |_| {},
        );
        target.set(Lba(5000), Slot::Damaged, version);
    }
    touched.extend([1 << 20, (1 << 20) + 4095, 5000, 7, 1 << 40]);

    checkpoint_pages(&mut map, &media, 1);
    let all_in_ram = map.resident_bytes();
    map.set_cache_bytes(all_in_ram / 10);
    map.evict();
    assert!(
        map.resident_bytes() <= all_in_ram / 10,
        "the cache bound holds"
    );
    let (leaves, paged) = map.leaf_counts();
    assert!(paged > leaves / 2, "{paged} of {leaves} leaves paged out");
    map.check_counts_with(Some(&media)).unwrap();
    assert_eq!(map.counts(), reference.counts());
    assert_same(&mut map, &reference, &media, &touched);
    assert!(map.cache_counts().misses > 0);

    // Changes to leaves read back make them dirty: they stay in RAM.
    let changed: Vec<u64> = touched.iter().copied().step_by(7).collect();
    for &lba in &changed {
        version += 1;
        set(&mut map, &mut reference, lba, data(lba + 1), version);
    }
    map.set_cache_bytes(0);
    map.evict();
    for &lba in &changed {
        assert!(
            map.leaf_at(lba).unwrap().1.is_resident(),
            "dirty leaf of {lba} evicted"
        );
    }
    // The next checkpoint copies evicted pages and writes dirty leaves;
    // then everything may go.
    checkpoint_pages(&mut map, &media, 2);
    map.evict();
    assert_eq!(map.resident_bytes(), 0);
    map.check_counts_with(Some(&media)).unwrap();
    assert_same(&mut map, &reference, &media, &touched);
    let mut data_blocks = (0, 0);
    map.for_each_data(&media, |_, _, _| data_blocks.0 += 1)
        .unwrap();
    reference
        .for_each_data(&media, |_, _, _| data_blocks.1 += 1)
        .unwrap();
    assert_eq!(data_blocks.0, data_blocks.1);

    // Damage: one copy of a page, then both.
    map.evict();
    let (&start, _) = map
        .leaves
        .iter()
        .find(|(_, leaf)| !leaf.is_resident())
        .unwrap();
    let loc = map.written[&start].unwrap();
    let flip = |copy: usize| {
        let segment = loc.segments[copy];
        let mut bytes = vec![0u8; 256 * 1024];
        media.read(segment, 0, &mut bytes).unwrap();
        bytes[loc.offset as usize + loc.len as usize / 2] ^= 0x40;
        media.erase_segment(segment).unwrap();
        media
            .write_pages(segment, crate::units::PageIndex(0), &bytes)
            .unwrap();
    };
    flip(0);
    map.check_counts_with(Some(&media)).unwrap();
    flip(1);
    let error = map.check_counts_with(Some(&media)).unwrap_err();
    assert!(error.contains("damaged in both"), "{error}");
    let error = map.load(&media, Lba(start), 1).unwrap_err();
    assert!(matches!(error, Error::CorruptImage(_)), "{error}");
}

/// Garbage never decodes into a leaf that panics later: a page either
/// fails to decode or gives a leaf that passes the map's own leaf check
/// (so a page whose checksum was forged still cannot plant a malformed
/// leaf). Both outcomes must occur, or the test proves nothing.
#[test]
fn random_pages_decode_or_fail_cleanly() {
    let mut rng = SmallRng::seed_from_u64(5);
    let mut map = Map::new(false);
    for lba in (0..4000u64).step_by(3) {
        map.set(Lba(lba), data(lba), lba + 1);
    }
    let valid: Vec<Vec<u8>> = map.leaves.values().map(page::encode_page).collect();
    let (mut decoded, mut refused) = (0, 0);
    for round in 0..20_000 {
        let mut payload = valid[round % valid.len()].clone();
        let raw_len = u32::from_le_bytes(payload[..4].try_into().unwrap()) as usize;
        let mut raw = crate::codec::lz4_decompress(&payload[4..], raw_len).unwrap();
        for _ in 0..rng.gen_range(1..4) {
            let at = rng.gen_range(0..raw.len());
            raw[at] = rng.gen();
        }
        payload.truncate(4);
        payload.extend(crate::codec::lz4_compress(&raw));
        let decoded_leaf = page::decode_page(&payload, 1 << 20);
        match &decoded_leaf {
            Ok(leaf) => {
                decoded += 1;
                if let Err(problem) = check_leaf(0, leaf, false) {
                    panic!("round {round}: a decoded page gives a leaf that {problem}");
                }
            }
            Err(_) => refused += 1,
        }
        // A lookup's partial decode of the same page never panics, and
        // where both decode they agree.
        let blocks = map
            .leaves
            .values()
            .nth(round % valid.len())
            .unwrap()
            .blocks();
        let offset = rng.gen_range(0..blocks);
        let count = rng.gen_range(1..=(blocks - offset).min(64));
        let range = page::decode_page_range(&payload, 1 << 20, blocks, offset, count);
        if let (Ok(leaf), Ok(entries)) = (&decoded_leaf, &range) {
            if leaf.blocks() == blocks {
                for (at, entry) in (offset..).zip(entries) {
                    assert_eq!(*entry, leaf.get(at), "round {round}: block {at}");
                }
            }
        }
    }
    assert!(decoded > 0, "no damaged page decoded: the check never ran");
    assert!(refused > 0, "every damaged page decoded");
}

// --- Faults: leaves read back without the map borrowed (`fault.rs`).

/// A map of dense chunks and scattered blocks with its reference in RAM,
/// checkpointed as generation 1 and then paged out whole.
fn paged_map(media: &crate::media::MemMedia) -> (Map, Map, Vec<u64>) {
    let mut rng = SmallRng::seed_from_u64(21);
    let (mut map, mut reference) = (Map::new(false), Map::new(false));
    let mut touched = Vec::new();
    let mut version = 0;
    for lba in (0..1024u64).chain((0..400).map(|_| rng.gen_range(1024..1u64 << 30))) {
        version += 1;
        map.set(Lba(lba), data(lba), version);
        reference.set(Lba(lba), data(lba), version);
        touched.push(lba);
    }
    checkpoint_pages(&mut map, media, 1);
    map.set_cache_bytes(0);
    map.evict();
    let (leaves, paged) = map.leaf_counts();
    assert_eq!(paged, leaves, "a cache of zero evicts every clean leaf");
    assert!(leaves > 4, "only {leaves} leaves");
    (map, reference, touched)
}

/// Faults list what `load` would read; installing what they read gives
/// the same leaves with the same bookkeeping; a fault whose leaf another
/// reader installed first, or whose page a checkpoint moved, is stale and
/// installs nothing; a read that fails where the page still is is damage,
/// and where the page moved (its segments reused) is not.
#[test]
fn faults_install_what_load_would_and_go_stale() {
    let media = crate::media::MemMedia::with_size(4096, 256 * 1024, 64).unwrap();
    let (mut map, reference, touched) = paged_map(&media);
    let (leaves, _) = map.leaf_counts();

    // Nothing paged out in the range: no fault (a hole past every leaf).
    assert!(map.faults(Lba(1 << 40), 4096).is_empty());
    // Every fault of a range, read and installed, in one round.
    let faults = map.faults(Lba(100), 2000);
    let starts: Vec<u64> = faults.iter().map(|f| f.start().0).collect();
    assert_eq!(starts, map.paged_in(Lba(100), 2000));
    assert!(faults.len() >= 4, "{} faults", faults.len());
    let misses = map.cache_counts().misses;
    for fault in &faults {
        assert!(map.fault_is_current(fault));
        let leaf = fault.read(&media).unwrap();
        assert!(map.install(fault, leaf));
    }
    assert!(map.faults(Lba(100), 2000).is_empty());
    assert_eq!(map.cache_counts().misses, misses + faults.len() as u64);
    assert_eq!(map.leaf_counts(), (leaves, leaves - faults.len() as u64));
    map.check_counts_with(Some(&media)).unwrap();
    for lba in 100..2100 {
        assert_eq!(map.get(Lba(lba)), reference.get(Lba(lba)), "block {lba}");
    }
    // Installed leaves are clean: they go again.
    map.evict();
    assert_eq!(map.leaf_counts(), (leaves, leaves));

    // Installed first by another reader: stale, nothing changes.
    let faults = map.faults(Lba(0), 1 << 30);
    let read: Vec<ReadLeaf> = faults.iter().map(|f| f.read(&media).unwrap()).collect();
    map.load(&media, Lba(0), 1).unwrap();
    let (first, rest) = faults.split_first().unwrap();
    let mut read = read.into_iter();
    assert!(!map.fault_is_current(first));
    assert!(!map.install(first, read.next().unwrap()));
    map.check_counts_with(Some(&media)).unwrap();

    // A checkpoint moved every page: the same leaf, no longer current.
    checkpoint_pages(&mut map, &media, 2);
    map.evict();
    for (fault, leaf) in rest.iter().zip(read) {
        assert!(!map.fault_is_current(fault), "leaf at {}", fault.start());
        assert!(!map.install(fault, leaf));
    }
    assert_eq!(map.leaf_counts(), (leaves, leaves));
    // A later checkpoint reuses generation 1's segments (this test
    // medium takes turns over three parts; generation 4 has generation
    // 1's): a read of the old place fails, and is not current, so it is
    // retried, not reported.
    checkpoint_pages(&mut map, &media, 4);
    let stale = rest.iter().find(|f| f.read(&media).is_err());
    let stale = stale.expect("generation 1's pages were overwritten");
    assert!(!map.fault_is_current(stale));
    let again = map.faults(stale.start(), 1);
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].generation(), 4);
    let leaf = again[0].read(&media).unwrap();
    assert!(map.install(&again[0], leaf));
    assert_same(&mut map, &reference, &media, &touched);

    // Damaged in both copies where it still is: the error is real.
    map.evict();
    let fault = map.faults(Lba(0), 1).pop().unwrap();
    let loc = map.written[&0].unwrap();
    for copy in 0..2 {
        let segment = loc.segments[copy];
        let mut bytes = vec![0u8; 256 * 1024];
        media.read(segment, 0, &mut bytes).unwrap();
        bytes[loc.offset as usize + loc.len as usize / 2] ^= 0x40;
        media.erase_segment(segment).unwrap();
        media
            .write_pages(segment, crate::units::PageIndex(0), &bytes)
            .unwrap();
    }
    let error = fault.read(&media).err().expect("a damaged page reads");
    assert!(matches!(error, Error::CorruptImage(_)), "{error}");
    assert!(
        map.fault_is_current(&fault),
        "damage where the page still is"
    );
}

/// With the cache full, a lookup within one paged-out leaf reads its
/// entries from the page (`peek_fault`, `Fault::peek`) and they are the
/// leaf's, in every form (dense, sparse, run, holes between); the same
/// leaf met again soon is faulted in instead (the ghost list); a range
/// over two leaves, or a cache with room, always faults in.
#[test]
fn peeks_read_what_the_leaf_holds_and_a_leaf_met_twice_is_kept() {
    let media = crate::media::MemMedia::with_size(4096, 256 * 1024, 64).unwrap();
    let (mut map, mut reference, mut touched) = paged_map(&media);
    // A run leaf too: a large zeroed range, paged out with the rest.
    let zeroed = 1u64 << 31;
    for m in [&mut map, &mut reference] {
        m.set_range(
            Lba(zeroed),
            1 << 20,
            RangeState::Zero,
            5000,
            false,
            &mut |_| {},
        );
    }
    touched.extend([zeroed, zeroed + 777]);
    // Every form decodes in part as it does whole.
    map.load(&media, Lba(0), 1 << 32).unwrap();
    let mut forms = std::collections::HashSet::new();
    for (&start, leaf) in &map.leaves {
        forms.insert(std::mem::discriminant(leaf));
        let page = page::encode_page(leaf);
        let blocks = leaf.blocks();
        for (offset, count) in [
            (0, 1),
            (blocks - 1, 1),
            (blocks / 2, 5),
            (0, blocks.min(300)),
        ] {
            let entries = page::decode_page_range(&page, 1 << 20, blocks, offset, count).unwrap();
            for (at, entry) in (offset..).zip(entries) {
                assert_eq!(entry, leaf.get(at), "leaf {start}, block {at}");
            }
        }
        assert!(page::decode_page_range(&page, 1 << 20, blocks, blocks - 1, 2).is_err());
        assert!(page::decode_page_range(&page, 1 << 20, blocks + 256, 0, 1).is_err());
    }
    assert_eq!(forms.len(), 3, "dense, sparse and run leaves");
    checkpoint_pages(&mut map, &media, 2);
    map.evict();
    let (leaves, paged) = map.leaf_counts();
    // A run leaf holds no heap: the cache does not evict it.
    assert_eq!(paged, leaves - 1);

    let mut peeked = 0;
    for &lba in &touched {
        let (start, leaf) = map.leaf_at(lba).unwrap();
        let count = (start + leaf.blocks() - lba).min(3);
        let Some(fault) = map.peek_fault(Lba(lba), count) else {
            // In RAM (the run), or a leaf peeked a moment ago (a
            // neighbour's): faulted in.
            continue;
        };
        peeked += 1;
        assert!(map.fault_is_current(&fault));
        let entries = fault.peek(&media, Lba(lba), count).unwrap();
        for (at, entry) in (lba..).zip(entries) {
            assert_eq!(entry, reference.get(Lba(at)), "block {at}");
        }
        assert!(
            map.peek_fault(Lba(lba), 1).is_none(),
            "the leaf at {start}, met twice, is faulted in"
        );
        assert!(
            map.peek_fault(Lba(lba), 1).is_some(),
            "and then peeked again"
        );
    }
    // Of two blocks of one leaf in a row, the second finds the ghost.
    assert!(peeked * 3 > touched.len(), "only {peeked} peeks");
    assert_eq!(map.leaf_counts(), (leaves, paged), "a peek keeps no leaf");

    // Two leaves (the first two dense chunks): no peek.
    assert!(map.peek_fault(Lba(255), 2).is_none());
    // A cache with room: no peek.
    map.set_cache_bytes(u64::MAX);
    assert!(map.peek_fault(Lba(0), 1).is_none());
    map.set_cache_bytes(0);
    // Installed: in RAM, no peek.
    map.load(&media, Lba(0), 1).unwrap();
    assert!(map.peek_fault(Lba(0), 1).is_none());
}

/// A pin spares its range's leaves from eviction and holds back the
/// release of the dump its faults read, until the last pin on that dump
/// goes; other dumps are released at once.
#[test]
fn pins_spare_their_leaves_and_hold_back_their_dump() {
    let media = crate::media::MemMedia::with_size(4096, 256 * 1024, 64).unwrap();
    let (mut map, _, _) = paged_map(&media);
    let faults = map.faults(Lba(0), 1024);
    assert_eq!(faults.len(), 4, "four dense chunks");
    let pin = map.pin_faults(Lba(0), 1024, &faults);
    let other_faults = map.faults(Lba(512), 1);
    let other = map.pin_faults(Lba(512), 1, &other_faults);
    for fault in &faults {
        let leaf = fault.read(&media).unwrap();
        assert!(map.install(fault, leaf));
    }
    map.load(&media, Lba(5000), 1 << 30).unwrap();
    map.evict();
    assert!(map.faults(Lba(0), 1024).is_empty(), "a pinned leaf evicted");
    assert!(
        !map.faults(Lba(5000), 1 << 30).is_empty(),
        "nothing evicted"
    );

    // The pins read the pair of segments the first leaves' pages are in.
    let pinned = map.written[&0].unwrap().segments;
    let unpinned = [SegmentId(60), SegmentId(61)];
    assert_eq!(
        map.defer_dump_release([unpinned, pinned].into_iter()),
        unpinned.to_vec(),
        "a pair no pin reads goes at once"
    );
    assert_eq!(map.deferred_dump_segments().collect::<Vec<_>>(), pinned);
    // The other pin reads the same pair: it waits for both.
    assert_eq!(map.unpin_faults(pin), Vec::<SegmentId>::new());
    assert_eq!(map.deferred_dump_segments().count(), 2);
    assert_eq!(map.unpin_faults(other), pinned.to_vec());
    assert_eq!(map.deferred_dump_segments().count(), 0);
    // Unpinned, the range's leaves go again.
    map.evict();
    assert_eq!(map.faults(Lba(0), 1024).len(), 4);
    // A pin of a range with no fault pins no dump.
    let none = map.pin_faults(Lba(1 << 40), 1, &[]);
    assert_eq!(
        map.defer_dump_release([pinned].into_iter()),
        pinned.to_vec()
    );
    assert!(map.unpin_faults(none).is_empty());
}
