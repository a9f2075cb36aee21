//! A chapter's bytes on the medium, and a chapter as the cache holds it.
//!
//! Layout (docs/format.md, "Dedup index chapters"), little-endian:
//!
//! ```text
//! 0   magic "ZDDEDUP1"                         8 bytes
//! 8   chapter id                               u64
//! 16  count of entries                         u32
//! 20  CRC32C of bytes 0..20 then 24..end       u32
//! 24  count entries of 44 bytes each, in write order:
//!       fingerprint 32 bytes, content u48, owner u48
//! ```
//!
//! Decoding trusts nothing: the count is bounded before it sizes anything,
//! the length must match it exactly, and the checksum must match before an
//! entry is read.

use std::mem::size_of;

use super::{ChapterId, DedupError, MAX_CONTENT, MAX_OWNER};
use crate::fingerprint::{Fingerprint, FINGERPRINT_LEN};

pub const CHAPTER_MAGIC: [u8; 8] = *b"ZDDEDUP1";
pub const CHAPTER_HEADER_LEN: usize = 24;
pub const CHAPTER_ENTRY_LEN: usize = FINGERPRINT_LEN + 6 + 6;
/// The most entries a chapter may hold (and a decoder accepts).
pub const MAX_CHAPTER_ENTRIES: u32 = 65_536;

const CRC_AT: usize = 20;

/// One distinct block stored: its fingerprint, the content version it was
/// stored with and its block address then.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChapterEntry {
    pub fingerprint: Fingerprint,
    pub content: u64,
    pub owner: u64,
}

/// Bytes of a chapter of `count` entries.
pub fn encoded_len(count: usize) -> usize {
    CHAPTER_HEADER_LEN + count * CHAPTER_ENTRY_LEN
}

fn crc_of(bytes: &[u8]) -> u32 {
    crc32c::crc32c_append(
        crc32c::crc32c(&bytes[..CRC_AT]),
        &bytes[CHAPTER_HEADER_LEN..],
    )
}

fn put_u48(out: &mut Vec<u8>, value: u64) {
    out.extend_from_slice(&value.to_le_bytes()[..6]);
}

fn get_u48(bytes: &[u8]) -> u64 {
    let mut wide = [0u8; 8];
    wide[..6].copy_from_slice(&bytes[..6]);
    u64::from_le_bytes(wide)
}

/// The bytes of a chapter holding `entries` in the order given.
pub fn encode_chapter(id: ChapterId, entries: &[ChapterEntry]) -> Vec<u8> {
    assert!(
        entries.len() <= MAX_CHAPTER_ENTRIES as usize,
        "a chapter holds at most {MAX_CHAPTER_ENTRIES} entries"
    );
    let mut out = Vec::with_capacity(encoded_len(entries.len()));
    out.extend_from_slice(&CHAPTER_MAGIC);
    out.extend_from_slice(&id.0.to_le_bytes());
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    out.extend_from_slice(&[0u8; 4]);
    entries.iter().for_each(|entry| {
        assert!(entry.content <= MAX_CONTENT, "content version over 48 bits");
        assert!(entry.owner <= MAX_OWNER, "owner over 48 bits");
        out.extend_from_slice(entry.fingerprint.as_bytes());
        put_u48(&mut out, entry.content);
        put_u48(&mut out, entry.owner);
    });
    let crc = crc_of(&out);
    out[CRC_AT..CHAPTER_HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
    debug_assert_eq!(out.len(), encoded_len(entries.len()));
    out
}

/// A chapter's id and entries (in write order), or why its bytes are not
/// a chapter.
pub fn decode_chapter(bytes: &[u8]) -> Result<(ChapterId, Vec<ChapterEntry>), DedupError> {
    if bytes.len() < CHAPTER_HEADER_LEN {
        return Err(DedupError::ChapterTruncated {
            len: bytes.len(),
            needed: CHAPTER_HEADER_LEN,
        });
    }
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    if bytes[..8] != CHAPTER_MAGIC {
        return Err(DedupError::ChapterMagic { found: u64_at(0) });
    }
    let id = u64_at(8);
    let count = u32_at(16);
    if count > MAX_CHAPTER_ENTRIES {
        return Err(DedupError::ChapterTooLarge {
            count,
            limit: MAX_CHAPTER_ENTRIES,
        });
    }
    let expected = encoded_len(count as usize);
    if bytes.len() != expected {
        return Err(DedupError::ChapterLength {
            expected,
            actual: bytes.len(),
        });
    }
    let stored = u32_at(CRC_AT);
    let computed = crc_of(bytes);
    if stored != computed {
        return Err(DedupError::ChapterChecksum {
            expected: stored,
            actual: computed,
        });
    }
    let entries = bytes[CHAPTER_HEADER_LEN..]
        .chunks_exact(CHAPTER_ENTRY_LEN)
        .map(|raw| {
            let mut fingerprint = [0u8; FINGERPRINT_LEN];
            fingerprint.copy_from_slice(&raw[..FINGERPRINT_LEN]);
            ChapterEntry {
                fingerprint: Fingerprint::from_bytes(fingerprint),
                content: get_u48(&raw[FINGERPRINT_LEN..]),
                owner: get_u48(&raw[FINGERPRINT_LEN + 6..]),
            }
        })
        .collect::<Vec<_>>();
    debug_assert_eq!(entries.len(), count as usize);
    Ok((ChapterId(id), entries))
}

/// Words of a chapter's tag filter (512 bytes).
const FILTER_WORDS: usize = 64;

/// A blocked two-hash filter of a chapter's tags: a tag sets two bits of
/// one 64-bit word, so a test reads one word. A lookup of a fingerprint a
/// chapter of 256 entries does not hold usually costs that one test
/// instead of a search: about 2% of such lookups search (12% with the one
/// hash over 2048 bits this replaced, which made the searches of the 64
/// cached chapters a twentieth of a write's CPU).
#[derive(Clone, Copy)]
pub(super) struct TagFilter([u64; FILTER_WORDS]);

impl TagFilter {
    pub fn new() -> TagFilter {
        TagFilter([0; FILTER_WORDS])
    }

    /// The word and the two bits: from the tag's top 18 bits, as the low
    /// ones decide sampling and the hook fragment.
    fn place(tag: u64) -> (usize, u64) {
        let word = (tag >> 58) as usize % FILTER_WORDS;
        let bits = (1u64 << ((tag >> 52) & 63)) | (1u64 << ((tag >> 46) & 63));
        (word, bits)
    }

    pub fn insert(&mut self, tag: u64) {
        let (word, bits) = TagFilter::place(tag);
        self.0[word] |= bits;
    }

    pub fn may_hold(&self, tag: u64) -> bool {
        let (word, bits) = TagFilter::place(tag);
        self.0[word] & bits == bits
    }
}

/// A sealed chapter in RAM: its entries sorted by fingerprint (equal
/// fingerprints stay in write order) and a filter of their tags.
pub(super) struct CachedChapter {
    pub id: u64,
    pub last_used: u64,
    entries: Box<[ChapterEntry]>,
    filter: TagFilter,
}

impl CachedChapter {
    pub fn new(id: u64, mut entries: Vec<ChapterEntry>, last_used: u64) -> CachedChapter {
        // Stable: of equal fingerprints, the last written stays last.
        entries.sort_by_key(|entry| entry.fingerprint);
        let mut filter = TagFilter::new();
        entries
            .iter()
            .for_each(|entry| filter.insert(entry.fingerprint.tag()));
        CachedChapter {
            id,
            last_used,
            entries: entries.into_boxed_slice(),
            filter,
        }
    }

    /// RAM a cached chapter of `entries` entries takes, its slot in the
    /// cache included.
    pub fn ram_bytes_for(entries: usize) -> u64 {
        (entries * size_of::<ChapterEntry>() + size_of::<CachedChapter>()) as u64
    }

    /// RAM outside the cache's slot: the entries.
    pub fn heap_bytes(&self) -> u64 {
        (self.entries.len() * size_of::<ChapterEntry>()) as u64
    }

    /// The last written entry with this fingerprint.
    pub fn find(&self, fingerprint: &Fingerprint, tag: u64) -> Option<ChapterEntry> {
        if !self.filter.may_hold(tag) {
            return None;
        }
        // The first eight bytes, big-endian, order as the fingerprints
        // do: most steps of the search compare one word, not 32 bytes.
        let head = tag.swap_bytes();
        let end = self.entries.partition_point(|entry| {
            let other = entry.fingerprint.tag().swap_bytes();
            other < head || (other == head && entry.fingerprint <= *fingerprint)
        });
        let entry = self.entries[..end].last()?;
        (entry.fingerprint == *fingerprint).then_some(*entry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fingerprint(first: u8) -> Fingerprint {
        let mut bytes = [0u8; FINGERPRINT_LEN];
        bytes
            .iter_mut()
            .enumerate()
            .for_each(|(i, byte)| *byte = first.wrapping_add(i as u8));
        Fingerprint::from_bytes(bytes)
    }

    /// Chapter 5 holding two entries, written by hand from the layout. The
    /// CRC was computed apart from this code, by a bitwise CRC32C
    /// (reflected polynomial 0x82f63b78) over bytes 0..20 then 24..112.
    #[rustfmt::skip]
    const GOLDEN: &[u8] = &[
        b'Z', b'D', b'D', b'E', b'D', b'U', b'P', b'1', // magic
        0x05, 0, 0, 0, 0, 0, 0, 0,                      // chapter id 5
        0x02, 0, 0, 0,                                  // count 2
        0x5d, 0x8d, 0x34, 0x95,                         // CRC32C 0x95348d5d
        // entry 0: fingerprint 00 01 .. 1f
        0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07,
        0x08, 0x09, 0x0a, 0x0b, 0x0c, 0x0d, 0x0e, 0x0f,
        0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17,
        0x18, 0x19, 0x1a, 0x1b, 0x1c, 0x1d, 0x1e, 0x1f,
        0x06, 0x05, 0x04, 0x03, 0x02, 0x01,             // content 0x010203040506
        0x2a, 0, 0, 0, 0, 0,                            // owner 42
        // entry 1: fingerprint 80 81 .. 9f
        0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87,
        0x88, 0x89, 0x8a, 0x8b, 0x8c, 0x8d, 0x8e, 0x8f,
        0x90, 0x91, 0x92, 0x93, 0x94, 0x95, 0x96, 0x97,
        0x98, 0x99, 0x9a, 0x9b, 0x9c, 0x9d, 0x9e, 0x9f,
        0xff, 0xff, 0xff, 0xff, 0xff, 0xff,             // content 2^48 - 1
        0x00, 0x00, 0x00, 0x00, 0x01, 0x00,             // owner 2^32
    ];

    fn golden_entries() -> Vec<ChapterEntry> {
        vec![
            ChapterEntry {
                fingerprint: fingerprint(0x00),
                content: 0x0102_0304_0506,
                owner: 42,
            },
            ChapterEntry {
                fingerprint: fingerprint(0x80),
                content: MAX_CONTENT,
                owner: 1 << 32,
            },
        ]
    }

    #[test]
    fn golden_chapter_decodes_and_encodes() {
        assert_eq!(GOLDEN.len(), encoded_len(2));
        let (id, entries) = decode_chapter(GOLDEN).unwrap();
        assert_eq!(id, ChapterId(5));
        assert_eq!(entries, golden_entries());
        assert_eq!(encode_chapter(ChapterId(5), &golden_entries()), GOLDEN);
    }

    #[test]
    fn an_empty_chapter_round_trips() {
        let bytes = encode_chapter(ChapterId(0), &[]);
        assert_eq!(bytes.len(), CHAPTER_HEADER_LEN);
        assert_eq!(decode_chapter(&bytes).unwrap(), (ChapterId(0), vec![]));
    }

    #[test]
    fn every_flipped_byte_and_every_truncation_is_refused() {
        (0..GOLDEN.len()).for_each(|at| {
            let mut bad = GOLDEN.to_vec();
            bad[at] ^= 0x10;
            assert!(decode_chapter(&bad).is_err(), "byte {at} flipped");
        });
        (0..GOLDEN.len()).for_each(|len| {
            assert!(decode_chapter(&GOLDEN[..len]).is_err(), "cut at {len}");
        });
        let mut longer = GOLDEN.to_vec();
        longer.push(0);
        assert_eq!(
            decode_chapter(&longer),
            Err(DedupError::ChapterLength {
                expected: GOLDEN.len(),
                actual: GOLDEN.len() + 1
            })
        );
    }

    #[test]
    fn each_header_fault_has_its_own_error() {
        assert_eq!(
            decode_chapter(&GOLDEN[..10]),
            Err(DedupError::ChapterTruncated {
                len: 10,
                needed: CHAPTER_HEADER_LEN
            })
        );
        let mut magic = GOLDEN.to_vec();
        magic[7] = b'9';
        assert!(matches!(
            decode_chapter(&magic),
            Err(DedupError::ChapterMagic { .. })
        ));
        let mut huge = GOLDEN.to_vec();
        huge[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            decode_chapter(&huge),
            Err(DedupError::ChapterTooLarge {
                count: u32::MAX,
                limit: MAX_CHAPTER_ENTRIES
            })
        );
        let mut content = GOLDEN.to_vec();
        content[CHAPTER_HEADER_LEN + 32] ^= 1;
        assert!(matches!(
            decode_chapter(&content),
            Err(DedupError::ChapterChecksum {
                expected: 0x9534_8d5d,
                ..
            })
        ));
    }

    #[test]
    fn cached_chapter_finds_the_last_written_of_equal_fingerprints() {
        let mut entries = golden_entries();
        entries.push(ChapterEntry {
            fingerprint: fingerprint(0x00),
            content: 7,
            owner: 8,
        });
        let chapter = CachedChapter::new(1, entries, 0);
        let first = fingerprint(0x00);
        assert_eq!(chapter.find(&first, first.tag()).unwrap().content, 7);
        let second = fingerprint(0x80);
        assert_eq!(chapter.find(&second, second.tag()).unwrap().owner, 1 << 32);
        let absent = fingerprint(0x40);
        assert_eq!(chapter.find(&absent, absent.tag()), None);
    }

    /// Fingerprints from BLAKE3 of a counter: as random as real ones.
    fn hashed(seed: u64) -> Fingerprint {
        Fingerprint::from_bytes(*blake3::hash(&seed.to_le_bytes()).as_bytes())
    }

    /// The search compares the first eight bytes as a word before the
    /// rest: fingerprints that share those bytes, or differ only in the
    /// last one, are still told apart, and the last written of equal ones
    /// is the one found.
    #[test]
    fn cached_chapter_search_tells_apart_fingerprints_sharing_their_first_bytes() {
        let with_head = |head: &Fingerprint, tail_from: &Fingerprint| {
            let mut bytes = *tail_from.as_bytes();
            bytes[..8].copy_from_slice(&head.as_bytes()[..8]);
            Fingerprint::from_bytes(bytes)
        };
        let last_byte = |print: &Fingerprint, value: u8| {
            let mut bytes = *print.as_bytes();
            bytes[FINGERPRINT_LEN - 1] = value;
            Fingerprint::from_bytes(bytes)
        };
        let mut prints: Vec<Fingerprint> = (0..200).map(hashed).collect();
        let head = prints[0];
        prints.extend((200..240).map(|seed| with_head(&head, &hashed(seed))));
        prints.extend(
            (0..=255u8)
                .step_by(17)
                .filter(|&value| value != head.as_bytes()[FINGERPRINT_LEN - 1])
                .map(|value| last_byte(&head, value)),
        );
        // Every fifth fingerprint is written twice; the second write wins.
        let mut entries: Vec<ChapterEntry> = prints
            .iter()
            .enumerate()
            .map(|(i, print)| ChapterEntry {
                fingerprint: *print,
                content: i as u64,
                owner: 1,
            })
            .collect();
        entries.extend(
            prints
                .iter()
                .enumerate()
                .step_by(5)
                .map(|(i, print)| ChapterEntry {
                    fingerprint: *print,
                    content: i as u64,
                    owner: 2,
                }),
        );
        let chapter = CachedChapter::new(3, entries, 0);
        for (i, print) in prints.iter().enumerate() {
            let found = chapter.find(print, print.tag()).expect("held");
            assert_eq!(found.content, i as u64, "fingerprint {i}");
            assert_eq!(found.owner, if i % 5 == 0 { 2 } else { 1 });
        }
        for seed in 1_000..1_200 {
            let absent = hashed(seed);
            assert_eq!(chapter.find(&absent, absent.tag()), None);
            let beside = with_head(&head, &absent);
            assert_eq!(chapter.find(&beside, beside.tag()), None);
        }
    }

    /// A chapter of 256 random fingerprints passes few it does not hold to
    /// a search (2% expected of the blocked two-bit filter; the one-bit
    /// filter before it passed 12%), and never misses one it holds.
    #[test]
    fn tag_filter_passes_few_absent_tags_and_every_present_one() {
        let mut filter = TagFilter::new();
        let held: Vec<u64> = (0..256).map(|seed| hashed(seed).tag()).collect();
        held.iter().for_each(|&tag| filter.insert(tag));
        assert!(held.iter().all(|&tag| filter.may_hold(tag)));
        let tries = 100_000;
        let passed = (1_000_000..1_000_000 + tries)
            .filter(|&seed| filter.may_hold(hashed(seed).tag()))
            .count();
        let rate = passed as f64 / tries as f64;
        assert!(rate < 0.04, "{passed} of {tries} absent tags passed");
    }

    proptest::proptest! {
        /// Whatever the bytes, decoding answers and never panics.
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400)) {
            let _ = decode_chapter(&bytes);
        }

        /// Garbage behind a plausible header (the golden one's, with
        /// another count) is refused: by its length or by its checksum.
        #[test]
        fn garbage_behind_a_header_is_refused(count in 0u32..8, tail in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400)) {
            let mut bytes = GOLDEN[..CHAPTER_HEADER_LEN].to_vec();
            bytes[16..20].copy_from_slice(&count.to_le_bytes());
            bytes.extend_from_slice(&tail);
            proptest::prop_assert!(decode_chapter(&bytes).is_err());
        }
    }
}
