//! zdisk-core: the engine of zdisk, a compressing log-structured block store.
//!
//! Start at [`Volume`]: it implements [`BlockDevice`] over a [`media::Media`].
//! docs/ARCHITECTURE.md walks through a write, a read, a flush and a
//! cleaning step; docs/format.md gives the byte layouts.

pub mod bytes;
pub mod codec;
pub mod device;
mod dump;
pub mod error;
pub mod fuzz;
pub mod gc;
pub mod map;
pub mod media;
pub mod meta;
pub mod record;
pub(crate) mod segments;
pub mod sim;
pub mod stats;
pub mod units;
pub mod volume;

pub use codec::Codec;
pub use device::{BlockDevice, Extent, ExtentState};
pub use error::{Error, Result};
pub use gc::GcPolicy;
pub use stats::Stats;
pub use units::{Lba, SegmentId, BLOCK_SIZE};
pub use volume::{CheckReport, CreateOptions, OpenOptions, OpenReport, Volume};
