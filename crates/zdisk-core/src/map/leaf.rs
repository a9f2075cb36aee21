//! A leaf of the map: the entries of one range of blocks, in the form that
//! costs least for what the range holds.
//!
//! - A *run*: any number of whole chunks in one state at one version (a
//!   large WRITE_ZEROES or, during recovery, a large TRIM): 16 bytes.
//! - A *dense* leaf: one chunk, a narrow cell per block (15 bytes).
//! - A *sparse* leaf: a range of whole chunks holding at most
//!   [`SPARSE_MAX`] entries, each a 4-byte offset from the leaf's start and
//!   a narrow cell (19 bytes); blocks not listed are holes at version 0.
//!
//! The thresholds keep the cost per stored entry under 24 bytes in every
//! form, allocator and tree overhead included, and near 15 bytes for
//! dense data: a chunk whose entries in a sparse leaf reach
//! [`DENSE_FROM`] (where a dense leaf costs less per entry) becomes dense;
//! a dense leaf with fewer than [`DENSE_KEEP`] blocks that are not holes
//! (3,856 bytes over 176 blocks: 22 bytes each) becomes sparse again.
//! Between the two, neither conversion happens, so a block toggled at the
//! boundary does not convert the leaf back and forth.
//!
//! A leaf is also the unit the paged map reads and writes (`page.rs`): a
//! dense or full sparse leaf is about 4 KiB of cells. A leaf the cache
//! evicted stays in the tree as [`Leaf::Paged`], its range and chunk count
//! only; nothing reads or changes its entries until the map has read it
//! back (`Map::load`).

use std::ops::ControlFlow;

use super::column::{alloc_bytes, Column};
use super::entry::{Entry, CHUNK_BLOCKS, CHUNK_MASK, CHUNK_SHIFT};

/// Most entries a sparse leaf holds; a full one splits at a chunk boundary.
pub(super) const SPARSE_MAX: usize = 256;
/// A chunk with this many entries in a sparse leaf becomes a dense leaf.
pub(super) const DENSE_FROM: usize = 208;
/// In normal operation, a dense leaf keeps at least this many blocks that
/// are not holes; with fewer it becomes sparse.
pub(super) const DENSE_KEEP: u32 = 176;
/// A sparse leaf with fewer entries merges with a neighbouring sparse
/// leaf, if the two together hold at most [`MERGED_MAX`].
pub(super) const SPARSE_MIN: usize = 32;
pub(super) const MERGED_MAX: usize = 192;
/// Blocks a sparse leaf may span: its keys are 32-bit offsets.
pub(super) const SPAN_MAX: u64 = 1 << 32;

/// What a walk over a range meets, in block order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Piece {
    /// Blocks `start..end` are unwritten: holes at version 0.
    Gap(u64, u64),
    /// Blocks `start..end` all hold this entry.
    Same(u64, u64, Entry),
    /// One block's entry.
    One(u64, Entry),
}

#[derive(Debug, Clone)]
pub(super) enum Leaf {
    /// `blocks` blocks (whole chunks), all holding `entry`, which is not data.
    Run { blocks: u64, entry: Entry },
    /// One chunk, a cell per block; `stored` counts those that are not holes.
    Dense { stored: u32, column: Column },
    /// `blocks` blocks (whole chunks, at most [`SPAN_MAX`]); the entry of
    /// block `start + keys[i]` is `column[i]`, keys strictly increasing.
    Sparse {
        blocks: u64,
        keys: Vec<u32>,
        column: Column,
    },
    /// Evicted: the entries of `blocks` blocks are in a map page on the
    /// medium; `chunk_items` is what [`Leaf::chunk_items`] said in RAM.
    Paged { blocks: u64, chunk_items: u64 },
}

impl Leaf {
    /// A dense leaf of `entries`.
    pub(super) fn dense(entries: &[Entry; CHUNK_BLOCKS as usize]) -> Leaf {
        Leaf::Dense {
            stored: entries.iter().filter(|entry| !entry.is_hole()).count() as u32,
            column: Column::from_entries(entries, CHUNK_BLOCKS as usize),
        }
    }

    /// A sparse leaf of `blocks` blocks holding `entries` at `keys`, with
    /// a sixteenth to spare.
    pub(super) fn sparse(blocks: u64, keys: Vec<u32>, entries: &[Entry]) -> Leaf {
        debug_assert_eq!(keys.len(), entries.len());
        let room = entries.len() + entries.len() / 16;
        let mut keys = keys;
        keys.reserve_exact(room.saturating_sub(keys.len()));
        Leaf::Sparse {
            blocks,
            keys,
            column: Column::from_entries(entries, room),
        }
    }

    /// An empty sparse leaf of one chunk, about to receive an entry.
    pub(super) fn empty_sparse() -> Leaf {
        Leaf::Sparse {
            blocks: CHUNK_BLOCKS,
            keys: Vec::new(),
            column: Column::from_entries(&[], 0),
        }
    }

    /// Blocks covered.
    #[inline]
    pub(super) fn blocks(&self) -> u64 {
        match self {
            Leaf::Run { blocks, .. } | Leaf::Sparse { blocks, .. } | Leaf::Paged { blocks, .. } => {
                *blocks
            }
            Leaf::Dense { .. } => CHUNK_BLOCKS,
        }
    }

    /// The entry of the block `offset` blocks into the leaf.
    #[inline(always)]
    pub(super) fn get(&self, offset: u64) -> Entry {
        match self {
            Leaf::Run { entry, .. } => *entry,
            Leaf::Dense { column, .. } => column.get(offset as usize),
            Leaf::Sparse { keys, column, .. } => match keys.binary_search(&(offset as u32)) {
                Ok(index) => column.get(index),
                Err(_) => Entry::default(),
            },
            Leaf::Paged { .. } => panic!("reading a map leaf that is paged out"),
        }
    }

    /// Heap bytes of its cells and keys, allocator overhead included.
    pub(super) fn heap_bytes(&self) -> u64 {
        match self {
            Leaf::Run { .. } | Leaf::Paged { .. } => 0,
            Leaf::Dense { column, .. } => column.heap_bytes(),
            Leaf::Sparse { keys, column, .. } => sparse_heap_bytes(keys, column),
        }
    }

    /// Chunks a checkpoint dump records for this leaf: every chunk of a
    /// run or dense leaf, and those of a sparse leaf that hold an entry.
    pub(super) fn chunk_items(&self) -> u64 {
        match self {
            Leaf::Run { blocks, .. } => blocks >> CHUNK_SHIFT,
            Leaf::Dense { .. } => 1,
            Leaf::Sparse { keys, .. } => (0..keys.len())
                .filter(|&i| i == 0 || !same_chunk(keys[i - 1], keys[i]))
                .count() as u64,
            Leaf::Paged { chunk_items, .. } => *chunk_items,
        }
    }

    /// Calls `f` with the pieces of blocks `from..to` (within this leaf,
    /// which starts at `start`), in order; stops when `f` breaks.
    pub(super) fn visit(
        &self,
        start: u64,
        from: u64,
        to: u64,
        f: &mut impl FnMut(Piece) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        debug_assert!(start <= from && from < to && to <= start + self.blocks());
        match self {
            Leaf::Run { entry, .. } => f(Piece::Same(from, to, *entry)),
            Leaf::Dense { column, .. } => {
                for lba in from..to {
                    f(Piece::One(lba, column.get((lba - start) as usize)))?;
                }
                ControlFlow::Continue(())
            }
            Leaf::Sparse { keys, column, .. } => {
                let mut cursor = from;
                let first = keys.partition_point(|&key| start + (key as u64) < from);
                for (index, &key) in keys.iter().enumerate().skip(first) {
                    let lba = start + key as u64;
                    if lba >= to {
                        break;
                    }
                    if lba > cursor {
                        f(Piece::Gap(cursor, lba))?;
                    }
                    f(Piece::One(lba, column.get(index)))?;
                    cursor = lba + 1;
                }
                if cursor < to {
                    f(Piece::Gap(cursor, to))?;
                }
                ControlFlow::Continue(())
            }
            Leaf::Paged { .. } => panic!("visiting a map leaf that is paged out at {start}"),
        }
    }
}

impl Leaf {
    /// True if the leaf's entries are in RAM.
    #[inline]
    pub(super) fn is_resident(&self) -> bool {
        !matches!(self, Leaf::Paged { .. })
    }
}

/// True if two offsets lie in the same chunk.
#[inline]
pub(super) fn same_chunk(a: u32, b: u32) -> bool {
    a >> CHUNK_SHIFT == b >> CHUNK_SHIFT
}

/// True if the key at `index` shares its chunk with a neighbouring key.
pub(super) fn shares_chunk(keys: &[u32], index: usize) -> bool {
    (index > 0 && same_chunk(keys[index - 1], keys[index]))
        || (index + 1 < keys.len() && same_chunk(keys[index + 1], keys[index]))
}

/// The positions of the keys in the chunk of `key`.
pub(super) fn chunk_positions(keys: &[u32], key: u32) -> (usize, usize) {
    let chunk = key as u64 & !CHUNK_MASK;
    let low = keys.partition_point(|&k| (k as u64) < chunk);
    let high = keys.partition_point(|&k| (k as u64) < chunk + CHUNK_BLOCKS);
    (low, high)
}

pub(super) fn sparse_heap_bytes(keys: &Vec<u32>, column: &Column) -> u64 {
    alloc_bytes(keys.capacity() * size_of::<u32>()) + column.heap_bytes()
}

/// Room for one more entry in a sparse leaf: full vectors grow by a
/// sixteenth (at least 8), exactly, so that slack stays small (3% on
/// average; the copies it costs are a sixteenth of a leaf per insert).
pub(super) fn grow_sparse(keys: &mut Vec<u32>, column: &mut Column) {
    let more = (keys.len() / 16).max(8);
    if keys.len() == keys.capacity() {
        keys.reserve_exact(more);
    }
    if column.len() == column.capacity() {
        column.reserve_exact(more);
    }
}

/// After a removal: gives back capacity beyond an eighth (and 4) spare,
/// keeping a thirty-second.
pub(super) fn shrink_sparse(keys: &mut Vec<u32>, column: &mut Column) {
    let len = keys.len();
    let (most, room) = (len + len / 8 + 4, len + len / 32);
    if keys.capacity() > most {
        keys.shrink_to(room);
    }
    if column.capacity() > most {
        column.shrink_to(room);
    }
}

/// The sparse leaf of `blocks` blocks holding the entries at `positions`
/// of a sparse leaf's `keys` and `column`, their keys less `shift`.
pub(super) fn sparse_part(
    keys: &[u32],
    column: &Column,
    positions: std::ops::Range<usize>,
    shift: u64,
    blocks: u64,
) -> Leaf {
    let part: Vec<u32> = keys[positions.clone()]
        .iter()
        .map(|&key| (key as u64 - shift) as u32)
        .collect();
    let entries: Vec<Entry> = positions.map(|index| column.get(index)).collect();
    debug_assert!(part.last().is_none_or(|&key| (key as u64) < blocks));
    Leaf::sparse(blocks, part, &entries)
}
