//! The byte-addressed block device contract that protocol servers build on.
//!
//! [`BlockDevice`] is the engine's public API boundary: the NBD server
//! (`zdisk-nbd`) only ever talks to a `dyn BlockDevice`, so it can be tested
//! against a trivial RAM device and the engine can be tested without sockets.
//!
//! Contract, for every implementation:
//! - Offsets and lengths are in bytes and need no alignment; implementations
//!   do read-modify-write where their granularity requires it.
//! - A range past the end of the device fails with [`Error::OutOfRange`]
//!   and changes nothing.
//! - A successful `write`, `write_zeroes` or `trim` is visible to every later
//!   `read` on any thread. It is durable once a later `flush` returns, or at
//!   once when `fua` is set.
//! - `block_status` describes `offset..offset+len` as consecutive extents
//!   starting at `offset`. It may stop early (at `max_extents`), but returns
//!   at least one extent for a non-empty, in-range request. `stored_status`
//!   does the same for how the bytes are stored, and may also stop early
//!   after describing as much as it cheaply can.

use crate::codec::CodecId;
use crate::error::Result;

/// Allocation state of a run of bytes, as reported by [`BlockDevice::block_status`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExtentState {
    /// Never written, or trimmed: not allocated, reads as zeros.
    Hole,
    /// Allocated and known to read as zeros, but takes no payload space.
    Zero,
    /// Holds data.
    Data,
}

/// A run of bytes in one allocation state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub length_bytes: u64,
    pub state: ExtentState,
}

/// How a run of bytes is stored, as reported by [`BlockDevice::stored_status`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stored {
    /// Never written, or trimmed: takes nothing.
    Hole,
    /// Allocated zeros: takes nothing but a range record.
    Zero,
    /// Stored as written, because it did not compress enough.
    Raw {
        /// Stored bytes per logical block, in sixteenths of a block, rounded up (1 to 16).
        size_sixteenths: u8,
        /// Its stored content is shared with other blocks (cloned or
        /// deduplicated): stored once for all of them.
        shared: bool,
    },
    /// Stored compressed.
    Compressed {
        /// The codec the record names; `None` if it could not be read.
        codec: Option<CodecId>,
        /// Compressed together with neighbouring blocks, as one unit.
        unit: bool,
        /// Stored bytes per logical block (its share of its record, header
        /// included), in sixteenths of a block, rounded up (1 to 16).
        size_sixteenths: u8,
        /// As for `Raw`.
        shared: bool,
    },
    /// Found damaged: reads fail until it is rewritten.
    Damaged,
}

impl Stored {
    /// Stored bytes per logical block in sixteenths of a block (0 for
    /// holes, zeros and damaged blocks).
    pub fn size_sixteenths(self) -> u8 {
        match self {
            Stored::Raw {
                size_sixteenths, ..
            }
            | Stored::Compressed {
                size_sixteenths, ..
            } => size_sixteenths,
            Stored::Hole | Stored::Zero | Stored::Damaged => 0,
        }
    }
}

/// A run of bytes stored alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredExtent {
    pub length_bytes: u64,
    pub stored: Stored,
}

/// A byte-addressed virtual disk. See the module documentation for the contract.
pub trait BlockDevice: Send + Sync {
    /// The logical size in bytes.
    fn size_bytes(&self) -> u64;

    /// True if every write-type call fails with [`crate::Error::ReadOnly`].
    fn is_read_only(&self) -> bool;

    /// Fills `buf` with the bytes at `offset`.
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()>;

    /// Stores `data` at `offset`; durable before returning when `fua`.
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()>;

    /// Makes `offset..offset+len` read as zeros. With `may_punch` the range
    /// may become a hole; without it, it stays allocated (NBD's NO_HOLE).
    fn write_zeroes(&self, offset: u64, len: u64, may_punch: bool, fua: bool) -> Result<()>;

    /// Discards `offset..offset+len`. Whole blocks in the range become holes
    /// that read as zeros; partial blocks at the edges are left unchanged.
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()>;

    /// Makes every write, zero and trim that returned before this call durable.
    fn flush(&self) -> Result<()>;

    /// A hint that `offset..offset+len` will be read soon.
    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        let _ = (offset, len);
        Ok(())
    }

    /// Describes the allocation of `offset..offset+len`, at most `max_extents` runs.
    fn block_status(&self, offset: u64, len: u64, max_extents: usize) -> Result<Vec<Extent>>;

    /// Describes how `offset..offset+len` is stored, at most `max_extents`
    /// runs. A device that does not compress stores data raw, which is
    /// what this default says.
    fn stored_status(
        &self,
        offset: u64,
        len: u64,
        max_extents: usize,
    ) -> Result<Vec<StoredExtent>> {
        let extents = self.block_status(offset, len, max_extents)?;
        Ok(extents
            .into_iter()
            .map(|extent| StoredExtent {
                length_bytes: extent.length_bytes,
                stored: match extent.state {
                    ExtentState::Hole => Stored::Hole,
                    ExtentState::Zero => Stored::Zero,
                    ExtentState::Data => Stored::Raw {
                        size_sixteenths: 16,
                        shared: false,
                    },
                },
            })
            .collect())
    }
}
