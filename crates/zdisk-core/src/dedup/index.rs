//! [`DedupIndex`]: the open chapter, the chapter cache and the hooks, and
//! the one RAM budget they share (the module's doc says why).
//!
//! Invariants, checked by [`DedupIndex::check`] in tests:
//! - `ram_bytes() <= ram_bound_bytes()` after every call;
//! - every hook has its tag's low `sampling_bits` bits zero and names a
//!   chapter sealed or handed back;
//! - the hooks stay within their share of the budget;
//! - the cache is sorted by chapter number, holds each at most once and
//!   at most `cache_chapters` of them.

use std::mem::size_of;

use super::chapter::{decode_chapter, encode_chapter, CachedChapter, ChapterEntry, TagFilter};
use super::hooks::Hooks;
use super::{
    ChapterId, DedupConfig, DedupError, DedupIndexStats, Hit, Lookup, SealedChapter, MAX_CONTENT,
    MAX_OWNER,
};
use crate::fingerprint::Fingerprint;

/// The cache never holds fewer chapters than this, whatever the budget:
/// the chapter a hook named, the one prefetched after it, and room for a
/// second run.
pub const MIN_CACHED_CHAPTERS: usize = 4;
/// Nor more than this: every lookup looks into each cached chapter (one
/// filter bit, usually), so more would slow down writes of unique data.
/// Budget above goes to hooks.
pub const MAX_CACHED_CHAPTERS: usize = 64;
/// How far the index samples harder than configured: `k` stops at
/// `hook_bits + 16` (then the oldest chapters' hooks go first).
pub const MAX_EXTRA_SAMPLING_BITS: u32 = 16;
/// Hooks are always allowed this much, whatever the budget.
const HOOK_FLOOR_BYTES: u64 = 4096;
/// Chapters that failed to load, remembered so that prefetch does not ask
/// for them again and again.
const FAILED_REMEMBERED: usize = 16;
const NO_CHAPTER: u64 = u64::MAX;

/// The chapter being filled, in write order.
struct OpenChapter {
    id: u64,
    entries: Vec<ChapterEntry>,
    /// `entries[i].fingerprint.tag()`, scanned before any fingerprint is.
    tags: Vec<u64>,
    filter: TagFilter,
}

impl OpenChapter {
    fn push(&mut self, entry: ChapterEntry) {
        let tag = entry.fingerprint.tag();
        self.tags.push(tag);
        self.filter.insert(tag);
        self.entries.push(entry);
    }

    fn find(&self, fingerprint: &Fingerprint, tag: u64) -> Option<ChapterEntry> {
        if !self.filter.may_hold(tag) {
            return None;
        }
        self.tags
            .iter()
            .zip(&self.entries)
            .rev()
            .find(|(&t, entry)| t == tag && entry.fingerprint == *fingerprint)
            .map(|(_, entry)| *entry)
    }
}

/// The deduplication index. One owner (the engine's state, under its
/// lock) calls it; it does no I/O.
pub struct DedupIndex {
    config: DedupConfig,
    sampling_bits: u32,
    open: OpenChapter,
    /// Sorted by chapter number; capacity `cache_chapters`, allocated once.
    cache: Vec<CachedChapter>,
    cache_chapters: usize,
    hooks: Hooks,
    hook_budget_bytes: u64,
    floor_bytes: u64,
    /// A ring of chapter numbers that failed to load; `NO_CHAPTER` is an
    /// empty place.
    failed: [u64; FAILED_REMEMBERED],
    failed_next: usize,
    /// Ticks of the LRU clock.
    tick: u64,
    counts: DedupIndexStats,
}

impl DedupIndex {
    pub fn new(config: DedupConfig) -> Result<DedupIndex, DedupError> {
        config.validate()?;
        let entries = config.chapter_entries as usize;
        let fixed = size_of::<DedupIndex>() as u64;
        let open_bytes = (entries * (size_of::<ChapterEntry>() + size_of::<u64>())) as u64;
        let chapter_bytes = CachedChapter::ram_bytes_for(entries);
        let floor_bytes =
            fixed + open_bytes + MIN_CACHED_CHAPTERS as u64 * chapter_bytes + HOOK_FLOOR_BYTES;
        let above = config.cache_bytes.saturating_sub(floor_bytes);
        let extra_chapters =
            ((above / 4) / chapter_bytes).min((MAX_CACHED_CHAPTERS - MIN_CACHED_CHAPTERS) as u64);
        let cache_chapters = MIN_CACHED_CHAPTERS + extra_chapters as usize;
        let hook_budget_bytes = HOOK_FLOOR_BYTES + above - extra_chapters * chapter_bytes;
        assert!(Hooks::empty_ram_bytes() <= HOOK_FLOOR_BYTES);
        let index = DedupIndex {
            config,
            sampling_bits: config.hook_bits,
            open: OpenChapter {
                id: 0,
                entries: Vec::with_capacity(entries),
                tags: Vec::with_capacity(entries),
                filter: TagFilter::new(),
            },
            cache: Vec::with_capacity(cache_chapters),
            cache_chapters,
            hooks: Hooks::new(),
            hook_budget_bytes,
            floor_bytes,
            failed: [NO_CHAPTER; FAILED_REMEMBERED],
            failed_next: 0,
            tick: 0,
            counts: DedupIndexStats::default(),
        };
        debug_assert!(index.ram_bytes() <= index.ram_bound_bytes());
        Ok(index)
    }

    /// An index rebuilt from the chapters found on the medium, in any
    /// order: their hooks come back, the last ones fed stay cached, and the
    /// next chapter sealed is numbered after the highest. A chapter that
    /// does not decode is skipped and counted in `chapters_rejected`.
    pub fn rebuild<B: AsRef<[u8]>>(
        config: DedupConfig,
        chapters: impl IntoIterator<Item = (ChapterId, B)>,
    ) -> Result<DedupIndex, DedupError> {
        let mut index = DedupIndex::new(config)?;
        chapters.into_iter().for_each(|(id, bytes)| {
            // A bad chapter is forgotten; the error is in the counts.
            let _ = index.add_closed_chapter(id, bytes.as_ref());
        });
        Ok(index)
    }

    /// The earlier block with this fingerprint, if the index knows one; or
    /// the chapter to read before asking again.
    pub fn lookup(&mut self, fingerprint: &Fingerprint) -> Lookup {
        self.counts.lookups += 1;
        let tag = fingerprint.tag();
        if let Some(entry) = self.open.find(fingerprint, tag) {
            self.counts.hits += 1;
            return Lookup::Hit {
                hit: hit_of(&entry),
                prefetch: None,
            };
        }
        self.tick += 1;
        let tick = self.tick;
        // Newest chapter first: of two entries for one fingerprint, the
        // later one is likelier live.
        let found = self.cache.iter_mut().rev().find_map(|chapter| {
            let entry = chapter.find(fingerprint, tag)?;
            chapter.last_used = tick;
            Some((chapter.id, entry))
        });
        if let Some((id, entry)) = found {
            self.counts.hits += 1;
            let prefetch = self.wanted(id.saturating_add(1));
            if prefetch.is_some() {
                self.counts.chapter_loads_requested += 1;
            }
            return Lookup::Hit {
                hit: hit_of(&entry),
                prefetch,
            };
        }
        if !self.is_hook(tag) {
            return Lookup::Miss;
        }
        match self
            .hooks
            .get(self.fragment(tag))
            .and_then(|chapter| self.wanted(u64::from(chapter)))
        {
            Some(id) => {
                self.counts.chapter_loads_requested += 1;
                Lookup::NeedChapter(id)
            }
            None => Lookup::Miss,
        }
    }

    /// Records a new distinct block, stored with content version `content`
    /// at block `owner` (both below 2^48). When this fills the open
    /// chapter, it is sealed and its bytes returned, for the caller to
    /// write to the medium.
    pub fn insert(
        &mut self,
        fingerprint: Fingerprint,
        content: u64,
        owner: u64,
    ) -> Option<SealedChapter> {
        assert!(
            content <= MAX_CONTENT,
            "content version {content} over 48 bits"
        );
        assert!(owner <= MAX_OWNER, "owner {owner} over 48 bits");
        self.open.push(ChapterEntry {
            fingerprint,
            content,
            owner,
        });
        if self.open.entries.len() < self.config.chapter_entries as usize {
            return None;
        }
        self.seal_open_chapter()
    }

    /// Seals the open chapter now, however few entries it holds (at a
    /// clean close, so that they survive), and returns its bytes; `None`
    /// if it is empty.
    pub fn seal_open_chapter(&mut self) -> Option<SealedChapter> {
        if self.open.entries.is_empty() {
            return None;
        }
        let id = self.open.id;
        let bytes = encode_chapter(ChapterId(id), &self.open.entries);
        debug_assert_eq!(
            decode_chapter(&bytes).as_ref().map(|(_, entries)| entries),
            Ok(&self.open.entries),
            "a chapter decodes to what was encoded"
        );
        let entries: Vec<ChapterEntry> = self.open.entries.drain(..).collect();
        self.open.tags.clear();
        self.open.filter = TagFilter::new();
        self.open.id += 1;
        self.add_hooks(id, &entries);
        self.cache_insert(id, entries);
        self.counts.chapters_sealed += 1;
        debug_assert!(self.ram_bytes() <= self.ram_bound_bytes());
        Some(SealedChapter {
            id: ChapterId(id),
            bytes,
        })
    }

    /// The bytes the caller read for chapter `id`, after `NeedChapter(id)`
    /// or a prefetch. Bytes that are not chapter `id` are refused, and the
    /// chapter is forgotten as if invalidated.
    pub fn add_chapter(&mut self, id: ChapterId, bytes: &[u8]) -> Result<(), DedupError> {
        let entries = self.decode_as(id, bytes)?;
        self.counts.chapters_loaded += 1;
        self.cache_insert(id.0, entries);
        debug_assert!(self.ram_bytes() <= self.ram_bound_bytes());
        Ok(())
    }

    /// A chapter found on the medium at open (see [`DedupIndex::rebuild`]):
    /// its hooks are added as when it was sealed, and chapters sealed later
    /// are numbered after it. A chapter that does not decode is forgotten, but its number is
    /// still never reused.
    pub fn add_closed_chapter(&mut self, id: ChapterId, bytes: &[u8]) -> Result<(), DedupError> {
        self.open.id = self.open.id.max(id.0.saturating_add(1));
        let entries = self.decode_as(id, bytes)?;
        self.counts.chapters_loaded += 1;
        self.add_hooks(id.0, &entries);
        self.cache_insert(id.0, entries);
        debug_assert!(self.ram_bytes() <= self.ram_bound_bytes());
        Ok(())
    }

    /// Forgets chapter `id`: its hooks, its cached copy, and asking for it
    /// (until it is handed back). For a chapter whose read failed or whose
    /// segment is lost.
    pub fn invalidate_chapter(&mut self, id: ChapterId) {
        self.counts.chapters_rejected += 1;
        if let Ok(chapter) = u32::try_from(id.0) {
            self.hooks.retain(|hook| hook.chapter != chapter);
        }
        self.cache.retain(|cached| cached.id != id.0);
        if !self.failed.contains(&id.0) {
            self.failed[self.failed_next] = id.0;
            self.failed_next = (self.failed_next + 1) % FAILED_REMEMBERED;
        }
        debug_assert!(self.ram_bytes() <= self.ram_bound_bytes());
    }

    /// RAM held: the index itself, the open chapter, the cache and the
    /// hooks.
    pub fn ram_bytes(&self) -> u64 {
        let fixed = size_of::<DedupIndex>() as u64;
        let open = (self.open.entries.capacity() * size_of::<ChapterEntry>()
            + self.open.tags.capacity() * size_of::<u64>()) as u64;
        let slots = (self.cache.capacity() * size_of::<CachedChapter>()) as u64;
        let chapters: u64 = self.cache.iter().map(CachedChapter::heap_bytes).sum();
        fixed + open + slots + chapters + self.hooks.ram_bytes()
    }

    /// What `ram_bytes` never exceeds: the budget, or the floor if that is
    /// higher.
    pub fn ram_bound_bytes(&self) -> u64 {
        self.config.cache_bytes.max(self.floor_bytes)
    }

    /// The RAM held whatever the budget: the open chapter, four cached
    /// chapters and 4 KiB of hooks.
    pub fn floor_bytes(&self) -> u64 {
        self.floor_bytes
    }

    /// Hooks now have their tag's low `sampling_bits()` bits zero.
    pub fn sampling_bits(&self) -> u32 {
        self.sampling_bits
    }

    /// The number the open chapter will have when sealed.
    pub fn open_chapter(&self) -> ChapterId {
        ChapterId(self.open.id)
    }

    pub fn stats(&self) -> DedupIndexStats {
        DedupIndexStats {
            hooks: self.hooks.len() as u64,
            cached_chapters: self.cache.len() as u64,
            sampling_bits: self.sampling_bits,
            ram_bytes: self.ram_bytes(),
            ram_bound_bytes: self.ram_bound_bytes(),
            ..self.counts
        }
    }

    /// Panics if an invariant of the module's doc is broken (tests).
    pub fn check(&self) {
        assert!(
            self.ram_bytes() <= self.ram_bound_bytes(),
            "RAM {} over its bound {}",
            self.ram_bytes(),
            self.ram_bound_bytes()
        );
        assert!(self.hooks.ram_bytes() <= self.hook_budget_bytes);
        let extra_mask = (1u32 << (self.sampling_bits - self.config.hook_bits)) - 1;
        assert!(
            self.hooks.all(|hook| hook.fragment & extra_mask == 0),
            "a hook is not sampled at {} bits",
            self.sampling_bits
        );
        assert!(self
            .hooks
            .all(|hook| u64::from(hook.chapter) < self.open.id));
        assert!(self.cache.len() <= self.cache_chapters);
        assert_eq!(self.cache.capacity(), self.cache_chapters);
        assert!(self.cache.windows(2).all(|w| w[0].id < w[1].id));
        assert_eq!(self.open.tags.len(), self.open.entries.len());
    }

    fn decode_as(&mut self, id: ChapterId, bytes: &[u8]) -> Result<Vec<ChapterEntry>, DedupError> {
        // A chapter larger than this index's would break the RAM bound
        // (one written with other settings): it is forgotten too.
        let limit = self.config.chapter_entries;
        let decoded = decode_chapter(bytes).and_then(|(found, entries)| {
            if found != id {
                Err(DedupError::ChapterIdMismatch {
                    wanted: id.0,
                    found: found.0,
                })
            } else if entries.len() > limit as usize {
                Err(DedupError::ChapterTooLarge {
                    count: entries.len() as u32,
                    limit,
                })
            } else {
                Ok(entries)
            }
        });
        match decoded {
            Ok(entries) => {
                self.failed
                    .iter_mut()
                    .filter(|failed| **failed == id.0)
                    .for_each(|failed| *failed = NO_CHAPTER);
                Ok(entries)
            }
            Err(error) => {
                self.invalidate_chapter(id);
                Err(error)
            }
        }
    }

    /// `Some(id)` if chapter `id` is sealed, not cached and not known to
    /// fail: worth asking the caller for.
    fn wanted(&self, id: u64) -> Option<ChapterId> {
        let cached = self
            .cache
            .binary_search_by_key(&id, |chapter| chapter.id)
            .is_ok();
        (id < self.open.id && !cached && !self.failed.contains(&id)).then_some(ChapterId(id))
    }

    fn is_hook(&self, tag: u64) -> bool {
        tag & ((1u64 << self.sampling_bits) - 1) == 0
    }

    /// The 32 tag bits above the configured sampling bits. Sampling
    /// harder tests this fragment's low bits.
    fn fragment(&self, tag: u64) -> u32 {
        (tag >> self.config.hook_bits) as u32
    }

    fn add_hooks(&mut self, id: u64, entries: &[ChapterEntry]) {
        // Past 2^32 chapters (2^40 blocks with 256-entry chapters) hooks
        // are not kept; the cache still finds recent duplicates.
        let Ok(chapter) = u32::try_from(id) else {
            return;
        };
        let sample_mask = (1u64 << self.sampling_bits) - 1;
        let fragment_shift = self.config.hook_bits;
        entries
            .iter()
            .map(|entry| entry.fingerprint.tag())
            .filter(|&tag| tag & sample_mask == 0)
            .for_each(|tag| self.hooks.insert((tag >> fragment_shift) as u32, chapter));
        self.fit_hooks();
    }

    /// Samples harder (then drops the oldest chapters' hooks) until the
    /// hooks fit their budget.
    fn fit_hooks(&mut self) {
        while self.hooks.ram_bytes() > self.hook_budget_bytes {
            if self.sampling_bits < self.config.hook_bits + MAX_EXTRA_SAMPLING_BITS {
                let bit = self.sampling_bits - self.config.hook_bits;
                self.hooks.retain(|hook| (hook.fragment >> bit) & 1 == 0);
                self.sampling_bits += 1;
            } else if !self.hooks.drop_oldest_chapter() {
                break;
            }
        }
    }

    fn cache_insert(&mut self, id: u64, entries: Vec<ChapterEntry>) {
        self.tick += 1;
        let chapter = CachedChapter::new(id, entries, self.tick);
        if let Ok(at) = self.cache.binary_search_by_key(&id, |cached| cached.id) {
            self.cache[at] = chapter;
            return;
        }
        if self.cache.len() == self.cache_chapters {
            let coldest = self
                .cache
                .iter()
                .enumerate()
                .min_by_key(|(_, cached)| cached.last_used)
                .map(|(at, _)| at)
                .expect("the cache holds at least one chapter");
            self.cache.remove(coldest);
        }
        let at = self
            .cache
            .binary_search_by_key(&id, |cached| cached.id)
            .expect_err("not cached");
        self.cache.insert(at, chapter);
    }
}

fn hit_of(entry: &ChapterEntry) -> Hit {
    Hit {
        content: entry.content,
        owner: entry.owner,
    }
}
