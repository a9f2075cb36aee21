//! zdisk-core: the engine of zdisk, a compressing log-structured block store.
//!
//! Start at [`Volume`]: it implements [`BlockDevice`] over a [`media::Media`].
//! docs/ARCHITECTURE.md walks through a write, a read, a flush and a
//! cleaning step; docs/format.md gives the byte layouts; docs/testing.md
//! says how all of it is tested.
//!
//! API boundary: the public modules are what other crates build on — the
//! medium contract ([`media`]), the on-disk formats a medium or a tool may
//! need to recognise ([`meta`], [`record`]), codecs, byte helpers and units.
//! Everything else is internal. The crash simulator (`sim`) and the
//! fuzzing entry points (`fuzz`) exist only with the `testing` feature,
//! which tests and the fuzz targets enable.

pub mod bytes;
pub mod clock;
pub mod codec;
pub mod dedup;
mod device;
mod dump;
mod error;
pub mod fingerprint;
#[cfg(any(test, feature = "testing"))]
pub mod fuzz;
mod gc;
#[cfg(test)]
mod golden_tests;
pub mod held;
mod map;
pub mod media;
pub mod meta;
pub mod record;
mod segments;
#[cfg(any(test, feature = "testing"))]
pub mod sim;
pub mod snapshots;
mod stats;
pub mod units;
mod volume;

pub use clock::{Clock, FixedClock, ManualClock, SystemClock};
pub use codec::Codec;
pub use device::{BlockDevice, Extent, ExtentState, Stored, StoredExtent};
pub use error::{Error, Result};
pub use fingerprint::Fingerprint;
pub use gc::GcPolicy;
pub use stats::{CloneStats, Counters, Field, Metric, SegmentCounts, Stats, Wear, FIELDS};
pub use units::{Lba, SegmentId, BLOCK_SIZE};
pub use volume::{
    default_dedup_cache_bytes, default_map_cache_bytes, BlockKind, CheckReport, CloneDevice,
    CloneInfo, CloneMapped, CloneVolume, Compacted, CreateOptions, DedupIndex, DedupRunStats,
    DedupSummary, DeletedClone, DeletedSnapshot, IdleBudget, LockProfile, OpenOptions, OpenReport,
    Random, Recompress, Snapshot, SnapshotDevice, SnapshotInfo, Volume, WriteEffort, WriteEstimate,
    WriteEstimator, DEFAULT_DEDUP,
};
