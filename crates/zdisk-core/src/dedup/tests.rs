//! Tests of the index as the engine will drive it: a `ChapterStore`
//! stands in for the medium (sealed chapters kept by number, handed back
//! when the index asks), fingerprints come from a seeded generator, and
//! every hit is checked against what was inserted for that fingerprint.
//! The found shares and RAM figures print with `--nocapture`.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use super::*;
use crate::fingerprint::{Fingerprint, FINGERPRINT_LEN};

/// SplitMix64: a seeded, portable source of test fingerprints.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn fingerprint(&mut self) -> Fingerprint {
        let mut bytes = [0u8; FINGERPRINT_LEN];
        bytes
            .chunks_exact_mut(8)
            .for_each(|chunk| chunk.copy_from_slice(&self.next().to_le_bytes()));
        Fingerprint::from_bytes(bytes)
    }

    fn below(&mut self, bound: u64) -> u64 {
        self.next() % bound
    }
}

fn fingerprints(seed: u64, count: usize) -> Vec<Fingerprint> {
    let mut rng = SplitMix(seed);
    (0..count).map(|_| rng.fingerprint()).collect()
}

/// The medium, for chapters: what was sealed, by number.
#[derive(Default)]
struct ChapterStore {
    chapters: HashMap<u64, Vec<u8>>,
    reads: u64,
}

impl ChapterStore {
    fn keep(&mut self, sealed: Option<SealedChapter>) {
        if let Some(sealed) = sealed {
            assert!(
                self.chapters.insert(sealed.id.0, sealed.bytes).is_none(),
                "chapter {} sealed twice",
                sealed.id.0
            );
        }
    }

    /// Reads chapter `id` for the index, as the engine will outside its
    /// lock; a chapter not on the medium is a failed read.
    fn feed(&mut self, index: &mut DedupIndex, id: ChapterId) {
        self.reads += 1;
        match self.chapters.get(&id.0) {
            Some(bytes) => {
                // A refused chapter is forgotten by the index itself.
                let _ = index.add_chapter(id, bytes);
            }
            None => index.invalidate_chapter(id),
        }
    }

    /// A lookup as the engine will drive it: chapters asked for are read
    /// and handed back, a prefetch too; at most two rounds.
    fn lookup(&mut self, index: &mut DedupIndex, fingerprint: &Fingerprint) -> Option<Hit> {
        let mut asked = None;
        loop {
            match index.lookup(fingerprint) {
                Lookup::Hit { hit, prefetch } => {
                    if let Some(next) = prefetch {
                        self.feed(index, next);
                    }
                    return Some(hit);
                }
                Lookup::Miss => return None,
                Lookup::NeedChapter(id) => {
                    assert!(
                        asked.is_none(),
                        "asked for chapter {id:?} after being handed {asked:?}"
                    );
                    asked = Some(id);
                    self.feed(index, id);
                }
            }
        }
    }
}

fn config(cache_bytes: u64, chapter_entries: u32, hook_bits: u32) -> DedupConfig {
    DedupConfig {
        cache_bytes,
        chapter_entries,
        hook_bits,
    }
}

fn expect_hit(index: &mut DedupIndex, fingerprint: &Fingerprint, content: u64, owner: u64) {
    match index.lookup(fingerprint) {
        Lookup::Hit { hit, .. } => assert_eq!(hit, Hit { content, owner }),
        other => panic!("{fingerprint:?}: {other:?}, wanted content {content}"),
    }
}

#[test]
fn bad_settings_are_refused() {
    assert!(matches!(
        DedupIndex::new(config(1 << 20, 0, 4)),
        Err(DedupError::InvalidConfig(_))
    ));
    assert!(matches!(
        DedupIndex::new(config(1 << 20, MAX_CHAPTER_ENTRIES + 1, 4)),
        Err(DedupError::InvalidConfig(_))
    ));
    assert!(matches!(
        DedupIndex::new(config(1 << 20, 256, MAX_HOOK_BITS + 1)),
        Err(DedupError::InvalidConfig(_))
    ));
    let index = DedupIndex::new(DedupConfig::with_cache_bytes(0)).unwrap();
    assert_eq!(index.sampling_bits(), DEFAULT_HOOK_BITS);
    assert_eq!(index.ram_bound_bytes(), index.floor_bytes());
    index.check();
}

/// Test 1: the open chapter and the cached chapters answer at once.
#[test]
fn insert_then_lookup_finds_recent_entries() {
    let mut index = DedupIndex::new(config(0, 16, 4)).unwrap();
    let prints = fingerprints(1, 16 * 3 + 5);
    let sealed: Vec<SealedChapter> = prints
        .iter()
        .enumerate()
        .filter_map(|(i, print)| index.insert(*print, i as u64 + 1, 1_000 + i as u64))
        .collect();
    assert_eq!(
        sealed.iter().map(|chapter| chapter.id).collect::<Vec<_>>(),
        vec![ChapterId(0), ChapterId(1), ChapterId(2)]
    );
    assert!(sealed
        .iter()
        .all(|chapter| chapter.bytes.len() == encoded_len(16)));
    assert_eq!(index.open_chapter(), ChapterId(3));
    // Three sealed chapters fit the four the floor caches; five entries
    // are in the open chapter. No lookup needs the medium.
    prints.iter().enumerate().for_each(|(i, print)| {
        expect_hit(&mut index, print, i as u64 + 1, 1_000 + i as u64);
    });
    let unknown = fingerprints(2, 1)[0];
    assert_eq!(index.lookup(&unknown), Lookup::Miss);
    // The same fingerprint stored again: the newer entry answers.
    index.insert(prints[3], 77, 78);
    expect_hit(&mut index, &prints[3], 77, 78);
    let stats = index.stats();
    assert_eq!(stats.lookups, prints.len() as u64 + 2);
    assert_eq!(stats.hits, prints.len() as u64 + 1);
    assert_eq!(stats.chapters_sealed, 3);
    assert_eq!(stats.cached_chapters, 3);
    assert_eq!(stats.chapter_loads_requested, 0);
    index.check();
}

/// Test 2: a copy of 200,000 distinct blocks, looked up in the order they
/// were written, on a budget of 2 bytes per distinct block: the hooks find
/// each run's chapter, prefetch follows the run.
#[test]
fn an_ordered_duplicate_run_is_found_on_two_bytes_per_block() {
    const N: usize = 200_000;
    let budget = 2 * N as u64;
    let mut index = DedupIndex::new(DedupConfig::with_cache_bytes(budget)).unwrap();
    let mut store = ChapterStore::default();
    let prints = fingerprints(42, N);
    let started = Instant::now();
    prints.iter().enumerate().for_each(|(i, print)| {
        store.keep(index.insert(*print, i as u64 + 1, i as u64));
        if i % 4096 == 0 {
            index.check();
        }
    });
    let insert_time = started.elapsed();
    let after_writes = index.stats();
    let started = Instant::now();
    // The copy: every block a duplicate; a miss is stored anew, as the
    // engine would.
    let found = prints
        .iter()
        .enumerate()
        .filter(|&(i, print)| {
            let hit = store.lookup(&mut index, print);
            if i % 4096 == 0 {
                index.check();
            }
            match hit {
                Some(hit) => {
                    assert_eq!(
                        hit,
                        Hit {
                            content: i as u64 + 1,
                            owner: i as u64
                        },
                        "block {i}"
                    );
                    true
                }
                None => {
                    store.keep(index.insert(*print, (N + i) as u64 + 1, (N + i) as u64));
                    false
                }
            }
        })
        .count();
    let lookup_time = started.elapsed();
    index.check();
    let stats = index.stats();
    let share = found as f64 / N as f64;
    println!(
        "ordered run: {N} distinct blocks, budget {budget} B: found {found} ({:.2}%), \
         RAM {} B = {:.2} B per distinct block (after writing: {} B, {:.2} B/block), \
         floor {} B, hooks {}, sampling 1/{}, cached chapters {}, chapter reads {}",
        100.0 * share,
        stats.ram_bytes,
        stats.ram_bytes as f64 / N as f64,
        after_writes.ram_bytes,
        after_writes.ram_bytes as f64 / N as f64,
        index.floor_bytes(),
        stats.hooks,
        1u64 << stats.sampling_bits,
        stats.cached_chapters,
        store.reads,
    );
    println!(
        "ordered run timing (a figure, not a target): insert {:.0} ns per block, \
         lookup {:.0} ns per block (chapter decoding and test checks included)",
        insert_time.as_nanos() as f64 / N as f64,
        lookup_time.as_nanos() as f64 / N as f64,
    );
    assert!(share >= 0.95, "found {found} of {N}");
    assert!(
        stats.ram_bytes <= budget,
        "RAM {} over {budget}",
        stats.ram_bytes
    );
    assert_eq!(stats.hits, found as u64);
    assert!(store.reads > 0, "the run's chapters came from the medium");
}

/// How the copy in `ordered_runs_by_budget` is made.
#[derive(Clone, Copy, Debug)]
enum Copy {
    /// All blocks in their order.
    Plain,
    /// All blocks in their order, and after every 64, 16 new blocks.
    Edited,
    /// Runs of 64 blocks (256 KiB files) in a shuffled order.
    Files,
}

/// Figures for the report: found shares by budget and kind of copy.
/// Asserts only that hits are right and RAM stays bounded.
#[test]
fn ordered_runs_by_budget() {
    const N: usize = 200_000;
    const RUN: usize = 64;
    let prints = fingerprints(46, N);
    let new_blocks = fingerprints(47, N);
    let mut runs: Vec<usize> = (0..N / RUN).collect();
    let mut rng = SplitMix(48);
    (1..runs.len()).rev().for_each(|i| {
        let j = rng.below(i as u64 + 1) as usize;
        runs.swap(i, j);
    });
    let shuffled: Vec<usize> = runs
        .iter()
        .flat_map(|run| run * RUN..(run + 1) * RUN)
        .collect();
    [N as u64 / 2, N as u64, 2 * N as u64]
        .into_iter()
        .for_each(|budget| {
            [Copy::Plain, Copy::Edited, Copy::Files]
                .into_iter()
                .for_each(|copy| {
                    let mut index = DedupIndex::new(DedupConfig::with_cache_bytes(budget)).unwrap();
                    let mut store = ChapterStore::default();
                    prints.iter().enumerate().for_each(|(i, print)| {
                        store.keep(index.insert(*print, i as u64 + 1, i as u64));
                    });
                    let order: Vec<usize> = match copy {
                        Copy::Files => shuffled.clone(),
                        Copy::Plain | Copy::Edited => (0..N).collect(),
                    };
                    let mut fresh = new_blocks.iter();
                    let found = order
                        .iter()
                        .enumerate()
                        .filter(|&(at, &i)| {
                            if matches!(copy, Copy::Edited) && at % RUN == RUN - 1 {
                                (0..16).for_each(|_| {
                                    let print = fresh.next().expect("enough new blocks");
                                    assert_eq!(store.lookup(&mut index, print), None);
                                    store.keep(index.insert(*print, MAX_CONTENT, 0));
                                });
                            }
                            let hit = store.lookup(&mut index, &prints[i]);
                            if let Some(hit) = hit {
                                assert_eq!(hit.content, i as u64 + 1);
                            }
                            hit.is_some()
                        })
                        .count();
                    index.check();
                    assert!(index.ram_bytes() <= budget.max(index.floor_bytes()));
                    println!(
                        "budget {:.1} B per distinct block ({budget} B), {copy:?} copy: found \
                         {:.2}% of {N} duplicates, RAM {} B, sampling 1/{}, cached chapters {}",
                        budget as f64 / N as f64,
                        100.0 * found as f64 / N as f64,
                        index.ram_bytes(),
                        1u64 << index.sampling_bits(),
                        index.stats().cached_chapters,
                    );
                });
        });
}

/// Test 3: the same blocks looked up in random order find less, and
/// never a wrong block.
#[test]
fn random_order_duplicates_are_never_wrong() {
    const N: usize = 200_000;
    let budget = 2 * N as u64;
    let mut index = DedupIndex::new(DedupConfig::with_cache_bytes(budget)).unwrap();
    let mut store = ChapterStore::default();
    let prints = fingerprints(43, N);
    prints.iter().enumerate().for_each(|(i, print)| {
        store.keep(index.insert(*print, i as u64 + 1, i as u64));
    });
    let mut order: Vec<usize> = (0..N).collect();
    let mut rng = SplitMix(44);
    (1..N).rev().for_each(|i| {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    });
    // Unique data: fingerprints never stored, every lookup a miss.
    let unique = fingerprints(45, N);
    let started = Instant::now();
    let misses = unique
        .iter()
        .filter(|print| store.lookup(&mut index, print).is_none())
        .count();
    let miss_time = started.elapsed();
    assert_eq!(misses, N, "no fingerprint of unique data is found");
    let found = order
        .iter()
        .filter(|&&i| {
            let hit = store.lookup(&mut index, &prints[i]);
            if let Some(hit) = hit {
                assert_eq!(
                    hit,
                    Hit {
                        content: i as u64 + 1,
                        owner: i as u64
                    },
                    "block {i}"
                );
            }
            hit.is_some()
        })
        .count();
    index.check();
    println!(
        "random order: {N} distinct blocks, budget {budget} B: found {found} ({:.2}%), \
         RAM {:.2} B per distinct block, chapter reads {}; a lookup of unique data took \
         {:.0} ns (a figure, not a target)",
        100.0 * found as f64 / N as f64,
        index.ram_bytes() as f64 / N as f64,
        store.reads,
        miss_time.as_nanos() as f64 / N as f64,
    );
    // A lookup of a hook fingerprint reads its chapter, which holds it.
    assert!(found > 0);
}

/// Test 4: a chapter that reads back damaged, cut, empty, as another
/// chapter, or not at all, is forgotten: a miss, never a panic, and never
/// asked for again.
#[test]
fn corrupt_chapters_are_forgotten() {
    // Every fingerprint a hook, four cached chapters of 16.
    let mut index = DedupIndex::new(config(0, 16, 0)).unwrap();
    let mut store = ChapterStore::default();
    let prints = fingerprints(7, 16 * 12);
    prints.iter().enumerate().for_each(|(i, print)| {
        store.keep(index.insert(*print, i as u64 + 1, i as u64));
    });
    let first_of = |chapter: usize| &prints[16 * chapter];
    let bytes_of = |store: &ChapterStore, chapter: u64| store.chapters[&chapter].clone();

    let mut damaged = bytes_of(&store, 0);
    damaged[CHAPTER_HEADER_LEN + 5] ^= 0x40;
    let cut = bytes_of(&store, 3)[..100].to_vec();
    let other = bytes_of(&store, 1);
    let bad: [(usize, Vec<u8>); 4] = [(0, damaged), (2, other), (3, cut), (4, Vec::new())];
    bad.into_iter().for_each(|(chapter, bytes)| {
        let id = ChapterId(chapter as u64);
        assert_eq!(index.lookup(first_of(chapter)), Lookup::NeedChapter(id));
        assert!(index.add_chapter(id, &bytes).is_err(), "chapter {chapter}");
        assert_eq!(
            index.lookup(first_of(chapter)),
            Lookup::Miss,
            "chapter {chapter}"
        );
        // Its hooks are gone: no other entry of it asks again.
        assert_eq!(index.lookup(&prints[16 * chapter + 1]), Lookup::Miss);
        index.check();
    });
    // A read that failed.
    assert_eq!(index.lookup(first_of(5)), Lookup::NeedChapter(ChapterId(5)));
    index.invalidate_chapter(ChapterId(5));
    assert_eq!(index.lookup(first_of(5)), Lookup::Miss);
    assert_eq!(index.stats().chapters_rejected, 5);

    // Good chapters still load; a hit in chapter 1 does not prefetch the
    // chapter 2 that failed, a hit in chapter 6 prefetches 7.
    assert_eq!(index.lookup(first_of(1)), Lookup::NeedChapter(ChapterId(1)));
    store.feed(&mut index, ChapterId(1));
    assert!(matches!(
        index.lookup(first_of(1)),
        Lookup::Hit { prefetch: None, .. }
    ));
    assert_eq!(
        store.lookup(&mut index, first_of(6)),
        Some(Hit {
            content: 97,
            owner: 96
        })
    );
    assert!(matches!(
        index.lookup(&prints[16 * 6 + 1]),
        Lookup::Hit { prefetch: None, .. }
    ));
    expect_hit(&mut index, first_of(7), 16 * 7 + 1, 16 * 7);
    index.check();

    // A chapter larger than this index's chapters (written with other
    // settings) would break the RAM bound: refused.
    let big: Vec<ChapterEntry> = fingerprints(8, 17)
        .into_iter()
        .map(|fingerprint| ChapterEntry {
            fingerprint,
            content: 1,
            owner: 1,
        })
        .collect();
    assert_eq!(
        index.add_chapter(ChapterId(8), &encode_chapter(ChapterId(8), &big)),
        Err(DedupError::ChapterTooLarge {
            count: 17,
            limit: 16
        })
    );
    index.check();

    // A chapter handed back good after failing is used again.
    assert!(index
        .add_chapter(ChapterId(2), &bytes_of(&store, 2))
        .is_ok());
    expect_hit(&mut index, first_of(2), 33, 32);
}

/// Test 5: a million distinct blocks on a budget below 1 byte per block:
/// the index samples harder and its RAM stays bounded, and the hooks it
/// kept still find their chapters.
#[test]
fn sampling_grows_when_the_budget_is_small() {
    const N: usize = 1_000_000;
    let budget = 100_000;
    let mut index = DedupIndex::new(DedupConfig::with_cache_bytes(budget)).unwrap();
    let mut store = ChapterStore::default();
    let mut rng = SplitMix(5);
    (0..N).for_each(|i| {
        let sealed = index.insert(rng.fingerprint(), i as u64 + 1, i as u64);
        if sealed.is_some() {
            assert!(index.ram_bytes() <= index.ram_bound_bytes());
        }
        store.keep(sealed);
    });
    index.check();
    let stats = index.stats();
    println!(
        "1M inserts, budget {budget} B (floor {} B): RAM {} B, hooks {}, sampling 1/{} ({} bits)",
        index.floor_bytes(),
        stats.ram_bytes,
        stats.hooks,
        1u64 << stats.sampling_bits,
        stats.sampling_bits,
    );
    assert!(stats.sampling_bits > DEFAULT_HOOK_BITS);
    assert!(stats.ram_bytes <= budget);
    assert!(stats.hooks > 0);
    // The fingerprints of the first half that are hooks at the final
    // sampling: their chapters were evicted long ago, the hooks find them.
    let mask = (1u64 << stats.sampling_bits) - 1;
    let mut rng = SplitMix(5);
    let hooks: Vec<(usize, Fingerprint)> = (0..N / 2)
        .map(|i| (i, rng.fingerprint()))
        .filter(|(_, print)| print.tag() & mask == 0)
        .collect();
    let found = hooks
        .iter()
        .filter(|(i, print)| {
            let hit = store.lookup(&mut index, print);
            if let Some(hit) = hit {
                assert_eq!(hit.content, *i as u64 + 1);
            }
            hit.is_some()
        })
        .count();
    println!("hooks of the first half found: {found} of {}", hooks.len());
    assert!(
        found * 100 >= hooks.len() * 99,
        "{found} of {} hooks found",
        hooks.len()
    );
    index.check();
}

/// Test 6: an index rebuilt from the chapters on the medium (in any
/// order) has the same hooks, and finds an old ordered run again.
#[test]
fn rebuild_from_chapters_restores_hooks() {
    const N: usize = 20_000;
    let cache_bytes = 2 * N as u64;
    let mut index = DedupIndex::new(DedupConfig::with_cache_bytes(cache_bytes)).unwrap();
    let mut store = ChapterStore::default();
    let prints = fingerprints(6, N);
    prints.iter().enumerate().for_each(|(i, print)| {
        store.keep(index.insert(*print, i as u64 + 1, i as u64));
    });
    store.keep(index.seal_open_chapter());
    assert_eq!(index.seal_open_chapter(), None, "nothing left to seal");
    let before = index.stats();
    let mut ids: Vec<u64> = store.chapters.keys().copied().collect();
    ids.sort_unstable();

    let orders: [Vec<u64>; 2] = [ids.clone(), ids.iter().rev().copied().collect()];
    orders.into_iter().for_each(|order| {
        let chapters = order
            .iter()
            .map(|id| (ChapterId(*id), store.chapters[id].as_slice()));
        let mut rebuilt =
            DedupIndex::rebuild(DedupConfig::with_cache_bytes(cache_bytes), chapters).unwrap();
        rebuilt.check();
        let stats = rebuilt.stats();
        assert_eq!(rebuilt.open_chapter(), index.open_chapter());
        assert_eq!(stats.hooks, before.hooks);
        assert_eq!(stats.sampling_bits, before.sampling_bits);
        assert_eq!(stats.chapters_loaded, ids.len() as u64);
        assert_eq!(stats.chapters_rejected, 0);
        let found = prints
            .iter()
            .enumerate()
            .filter(|&(i, print)| {
                let hit = store.lookup(&mut rebuilt, print);
                if let Some(hit) = hit {
                    assert_eq!(
                        hit,
                        Hit {
                            content: i as u64 + 1,
                            owner: i as u64
                        }
                    );
                }
                hit.is_some()
            })
            .count();
        println!("after a rebuild: found {found} of {N}");
        assert!(found * 100 >= N * 95, "found {found} of {N}");
    });

    // A damaged chapter is skipped and counted, the others come back.
    let chapters = ids.iter().map(|id| {
        let mut bytes = store.chapters[id].clone();
        if *id == 3 {
            bytes[30] ^= 1;
        }
        (ChapterId(*id), bytes)
    });
    let rebuilt =
        DedupIndex::rebuild(DedupConfig::with_cache_bytes(cache_bytes), chapters).unwrap();
    assert_eq!(rebuilt.stats().chapters_rejected, 1);
    assert_eq!(rebuilt.stats().chapters_loaded, ids.len() as u64 - 1);
    rebuilt.check();
}

#[derive(Clone, Debug)]
enum Op {
    Insert { print: u8, content: u64 },
    Lookup { print: u8 },
    Seal,
    Invalidate { chapter: u8 },
    Corrupt { chapter: u8, at: u16 },
    Restart,
}

fn op_strategy() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        4 => (0u8..40, 0u64..=MAX_CONTENT).prop_map(|(print, content)| Op::Insert { print, content }),
        4 => (0u8..40).prop_map(|print| Op::Lookup { print }),
        1 => Just(Op::Seal),
        1 => (0u8..16).prop_map(|chapter| Op::Invalidate { chapter }),
        1 => (0u8..16, any::<u16>()).prop_map(|(chapter, at)| Op::Corrupt { chapter, at }),
        1 => Just(Op::Restart),
    ]
}

/// Random operations against a model (every (content, owner) each
/// fingerprint was ever inserted with): a hit is always one of them, and
/// the last insert is found right after it.
fn run_against_model(config: DedupConfig, ops: &[Op]) {
    // Half the fingerprints share one tag (their first 8 bytes), so tags,
    // filter bits and hook fragments collide and only the full compare
    // tells them apart.
    let mut prints = fingerprints(99, 40);
    let shared_head = *prints[0].as_bytes();
    prints[20..].iter_mut().for_each(|print| {
        let mut bytes = *print.as_bytes();
        bytes[..8].copy_from_slice(&shared_head[..8]);
        *print = Fingerprint::from_bytes(bytes);
    });
    let mut index = DedupIndex::new(config).unwrap();
    let mut store = ChapterStore::default();
    let mut model: HashMap<u8, HashSet<Hit>> = HashMap::new();
    let owner_of = |print: u8, content: u64| (content ^ u64::from(print)) & MAX_OWNER;
    ops.iter().for_each(|op| {
        match *op {
            Op::Insert { print, content } => {
                let fingerprint = &prints[usize::from(print)];
                let owner = owner_of(print, content);
                store.keep(index.insert(*fingerprint, content, owner));
                model
                    .entry(print)
                    .or_default()
                    .insert(Hit { content, owner });
                expect_hit(&mut index, fingerprint, content, owner);
            }
            Op::Lookup { print } => {
                if let Some(hit) = store.lookup(&mut index, &prints[usize::from(print)]) {
                    assert!(
                        model.get(&print).is_some_and(|hits| hits.contains(&hit)),
                        "fingerprint {print} answered {hit:?}, never inserted so"
                    );
                }
            }
            Op::Seal => store.keep(index.seal_open_chapter()),
            Op::Invalidate { chapter } => index.invalidate_chapter(ChapterId(chapter.into())),
            Op::Corrupt { chapter, at } => {
                if let Some(bytes) = store.chapters.get_mut(&u64::from(chapter)) {
                    let at = usize::from(at) % bytes.len();
                    bytes[at] ^= 0x01;
                }
            }
            Op::Restart => {
                let chapters = store
                    .chapters
                    .iter()
                    .map(|(id, bytes)| (ChapterId(*id), bytes.as_slice()));
                index = DedupIndex::rebuild(config, chapters).unwrap();
                // Chapters sealed after a restart take new numbers, even
                // past a damaged chapter.
                let next = store.chapters.keys().map(|id| id + 1).max().unwrap_or(0);
                assert_eq!(index.open_chapter().0, next);
            }
        }
        index.check();
    });
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]
    #[test]
    fn random_operations_never_answer_a_wrong_block(
        ops in proptest::collection::vec(op_strategy(), 1..200),
        chapter_entries in 1u32..8,
        hook_bits in 0u32..3,
        cache_bytes in 0u64..200_000,
    ) {
        run_against_model(config(cache_bytes, chapter_entries, hook_bits), &ops);
    }
}
