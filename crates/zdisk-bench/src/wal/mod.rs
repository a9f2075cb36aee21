//! A write-ahead log in two layouts, for measuring what a compressing
//! drive makes of them (`zdisk bench --scenario sparse-wal`, and
//! docs/case-studies.md).
//!
//! A database's log appends each commit and flushes. **Packed**, the
//! classic layout, appends commits back to back, so every flush rewrites
//! the partly filled block the log ends in: a block receiving 32 commits of
//! 128 bytes is written 32 times, on average half full. **Sparse** starts
//! every flush in a fresh block and leaves the rest of it zeros: 32 times
//! the logical space, but a compressing drive stores the zeros in nothing,
//! so each commit costs the drive about its own size once.
//!
//! Both layouts share one format (`format.rs`): records with a sequence
//! number, a length and a chained CRC, so that the reader (`reader.rs`)
//! finds every flushed commit after a crash, and an anchor that says where
//! the live log starts. The log is a ring; a checkpoint moves the anchor
//! and trims what it passed, which is how the sparse layout's logical
//! space comes back (`writer.rs`). The log runs on any [`LogDevice`]: a
//! benchmark target (an emulated drive in virtual time, or an image), an
//! NBD export, a test double.

mod device;
mod format;
mod reader;
mod writer;

#[cfg(test)]
mod golden_tests;
#[cfg(test)]
mod tests;

pub use device::{DeviceOp, LogDevice, TargetDevice, WalError};
pub use format::{Anchor, Layout, BLOCK_BYTES, RECORD_HEADER_BYTES};
pub use reader::{read_anchor, read_log, Commit, Recovered};
pub use writer::{Wal, WalConfig, WalCounters};
