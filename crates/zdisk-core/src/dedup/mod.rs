//! The deduplication index of issue #25: which earlier block, if any, has
//! the fingerprint of a block being written. Not wired into the engine
//! yet; docs/sharing.md ("The index") gives the plan it belongs to.
//!
//! # Design
//!
//! - **Chapters in write order.** Every distinct block stored is appended,
//!   with its content version and its block address, to the *open
//!   chapter*. When it holds [`DedupConfig::chapter_entries`] entries it is
//!   sealed: [`DedupIndex::insert`] hands back its bytes
//!   ([`SealedChapter`]) for the engine to write to the medium, and the
//!   index numbers the next chapter one higher. Blocks written together
//!   thus sit in the same or in neighbouring chapters.
//! - **Sampled hooks.** For a sealed chapter the index keeps in RAM only
//!   its *hooks*: the fingerprints whose tag has its low `k` bits zero (1
//!   in 16 by default), as 32 bits of the tag naming the chapter, 8 bytes
//!   each. A lookup of a hook fingerprint finds the chapter even after the
//!   chapter itself left RAM.
//! - **A chapter cache.** A small LRU cache of decoded chapters (at least
//!   [`MIN_CACHED_CHAPTERS`]) is searched for every fingerprint, hook or
//!   not, so a duplicate whose chapter is cached is found whatever its
//!   tag.
//! - **Prefetch of the next chapter.** Duplicates come in ordered runs: a
//!   copied image or file is written in the original's order. A hit in
//!   chapter `c` asks the caller for chapter `c + 1` too, so the
//!   non-hook fingerprints later in the run are found in the cache; one
//!   hook near the start of a run is enough to follow the whole run.
//! - **No I/O.** The index never touches the medium. A lookup that needs a
//!   chapter answers [`Lookup::NeedChapter`]; the caller reads it without
//!   holding its state lock, hands the bytes back with
//!   [`DedupIndex::add_chapter`] and looks up again. A chapter that fails
//!   to read or to decode is forgotten ([`DedupIndex::invalidate_chapter`]).
//! - **Advisory.** The index may forget (hooks sampled away, chapters
//!   evicted or lost) and may be stale (a hit names a content version that
//!   may no longer be live): the engine checks that the content version
//!   is still live before it shares it. What the index must never do is
//!   name a content version that was not inserted with that fingerprint;
//!   every hit is an exact compare of all 32 bytes.
//! - **Bounded RAM.** [`DedupIndex::ram_bytes`] counts the hooks, the
//!   cached chapters and the open chapter, and never exceeds
//!   `max(cache_bytes, floor)`, where the floor
//!   ([`DedupIndex::floor_bytes`]) is the open chapter, four cached
//!   chapters and 4 KiB of hooks (about 69 KB with 256-entry chapters).
//!   Above the floor, a quarter of the budget goes to more cached chapters
//!   (up to [`MAX_CACHED_CHAPTERS`]) and the rest to hooks. When the hooks
//!   outgrow their share the index samples harder: `k` grows by one and
//!   the hooks whose next tag bit is set are dropped, halving them. `k`
//!   never shrinks while the index lives.
//!
//! # Against UDS (dm-vdo's index)
//!
//! UDS also files fingerprints into chapters in arrival order. Its dense
//! index keeps a RAM entry for every fingerprint of its window, about 4
//! bytes each, which is why it asks for about 1 GB of RAM per TB of data
//! it can remember; its sparse index keeps RAM entries only for sampled
//! fingerprints and relies on runs to find the rest in cached chapters,
//! remembering about ten times as much data for the same RAM at the cost
//! of finding somewhat less (its documentation says 97–99% of what dense
//! finds). This index is a sparse index only: a hook costs 8 bytes, so at
//! 1/16 sampling the hooks cost half a byte per distinct block, and the
//! window is bounded by the RAM budget through the sampling rate instead
//! of a fixed window size. Unlike UDS it does no I/O of its own, keeps
//! no volume index pages on the medium (hooks are rebuilt from the
//! chapters at open, [`DedupIndex::rebuild`]) and adapts its sampling to
//! the budget as it grows.

mod chapter;
mod hooks;
mod index;
#[cfg(test)]
mod tests;

pub use chapter::{
    decode_chapter, encode_chapter, encoded_len, ChapterEntry, CHAPTER_ENTRY_LEN,
    CHAPTER_HEADER_LEN, CHAPTER_MAGIC, MAX_CHAPTER_ENTRIES,
};
pub use index::{DedupIndex, MAX_CACHED_CHAPTERS, MAX_EXTRA_SAMPLING_BITS, MIN_CACHED_CHAPTERS};

/// Content versions and block addresses are stored in 48 bits.
pub const MAX_CONTENT: u64 = (1 << 48) - 1;
/// The largest owner (block address) a chapter entry can hold.
pub const MAX_OWNER: u64 = (1 << 48) - 1;

/// Entries per chapter unless configured otherwise.
pub const DEFAULT_CHAPTER_ENTRIES: u32 = 256;
/// A fingerprint is a hook if its tag's low 4 bits are zero: 1 in 16.
pub const DEFAULT_HOOK_BITS: u32 = 4;
/// The largest initial sampling: 1 fingerprint in 65,536 is a hook.
pub const MAX_HOOK_BITS: u32 = 16;

/// The number of a chapter: 0 for the first one sealed, then one more
/// for each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChapterId(pub u64);

/// How a [`DedupIndex`] is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DedupConfig {
    /// The RAM budget (`--dedup-cache`): hooks, cached chapters and the
    /// open chapter. Below [`DedupIndex::floor_bytes`] the floor holds.
    pub cache_bytes: u64,
    /// Entries per chapter, 1 to [`MAX_CHAPTER_ENTRIES`].
    pub chapter_entries: u32,
    /// The initial sampling: a fingerprint is a hook if its tag's low
    /// `hook_bits` bits are zero. 0 to [`MAX_HOOK_BITS`].
    pub hook_bits: u32,
}

impl DedupConfig {
    /// The default chapter size and sampling with this RAM budget.
    pub fn with_cache_bytes(cache_bytes: u64) -> DedupConfig {
        DedupConfig {
            cache_bytes,
            chapter_entries: DEFAULT_CHAPTER_ENTRIES,
            hook_bits: DEFAULT_HOOK_BITS,
        }
    }

    pub fn validate(&self) -> Result<(), DedupError> {
        if self.chapter_entries == 0 || self.chapter_entries > MAX_CHAPTER_ENTRIES {
            return Err(DedupError::InvalidConfig(format!(
                "chapter_entries {} is not between 1 and {MAX_CHAPTER_ENTRIES}",
                self.chapter_entries
            )));
        }
        if self.hook_bits > MAX_HOOK_BITS {
            return Err(DedupError::InvalidConfig(format!(
                "hook_bits {} is above {MAX_HOOK_BITS}",
                self.hook_bits
            )));
        }
        Ok(())
    }
}

/// A block stored earlier with the fingerprint looked up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Hit {
    /// The content version the block was stored with (48 bits).
    pub content: u64,
    /// The block address it was stored at (48 bits).
    pub owner: u64,
}

/// The answer of [`DedupIndex::lookup`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// Found. The caller must still check that `hit.content` is live. If
    /// `prefetch` names a chapter, the run continues there: the caller
    /// should read it (outside its lock) and hand it to
    /// [`DedupIndex::add_chapter`], so that the next lookups find it.
    Hit {
        hit: Hit,
        prefetch: Option<ChapterId>,
    },
    /// Not found, and no chapter on the medium is known to hold it.
    Miss,
    /// A hook names this chapter, which is not in RAM: read it, hand it to
    /// [`DedupIndex::add_chapter`] (or, if the read failed, call
    /// [`DedupIndex::invalidate_chapter`]) and look up again. The index
    /// never asks twice in a row for a chapter it was handed, so the
    /// second lookup answers `Hit` or `Miss` unless other chapters were
    /// added in between; a caller should still stop after two rounds.
    NeedChapter(ChapterId),
}

/// A chapter just sealed: the caller writes `bytes` to the medium, where
/// [`DedupIndex::add_chapter`] and [`DedupIndex::rebuild`] will want them
/// back under `id`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SealedChapter {
    pub id: ChapterId,
    pub bytes: Vec<u8>,
}

/// What a [`DedupIndex`] did and holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DedupIndexStats {
    /// Lookups answered.
    pub lookups: u64,
    /// Lookups answered with a hit.
    pub hits: u64,
    /// Hooks held in RAM.
    pub hooks: u64,
    /// Chapters sealed and handed out to be written.
    pub chapters_sealed: u64,
    /// Chapters asked of the caller: `NeedChapter` answers and prefetches.
    pub chapter_loads_requested: u64,
    /// Chapters handed back and accepted (`add_chapter`,
    /// `add_closed_chapter`).
    pub chapters_loaded: u64,
    /// Chapters handed back that did not decode, or were invalidated.
    pub chapters_rejected: u64,
    /// Chapters in the cache now.
    pub cached_chapters: u64,
    /// The current sampling: hooks have their tag's low `sampling_bits`
    /// bits zero.
    pub sampling_bits: u32,
    /// RAM held now, as [`DedupIndex::ram_bytes`].
    pub ram_bytes: u64,
    /// The bound `ram_bytes` stays under: `max(cache_bytes, floor)`.
    pub ram_bound_bytes: u64,
}

/// Bad settings, and the ways a chapter's bytes can be wrong. A bad chapter
/// is forgotten, never trusted.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DedupError {
    #[error("invalid dedup index setting: {0}")]
    InvalidConfig(String),
    #[error("dedup chapter truncated: {len} bytes, a header needs {needed}")]
    ChapterTruncated { len: usize, needed: usize },
    #[error("dedup chapter has bad magic {found:#018x}")]
    ChapterMagic { found: u64 },
    #[error("dedup chapter holds {count} entries, more than {limit}")]
    ChapterTooLarge { count: u32, limit: u32 },
    #[error("dedup chapter is {actual} bytes, its header says {expected}")]
    ChapterLength { expected: usize, actual: usize },
    #[error("dedup chapter checksum mismatch: stored {expected:#010x}, computed {actual:#010x}")]
    ChapterChecksum { expected: u32, actual: u32 },
    #[error("dedup chapter {found} was handed over as chapter {wanted}")]
    ChapterIdMismatch { wanted: u64, found: u64 },
}
