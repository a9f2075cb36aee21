//! The object-store tier (issue #15): a volume's segments in a bucket (S3,
//! Ceph's radosgw, or an in-memory store for tests), a local image as the
//! cache. See `medium/mod.rs` for how segments travel and docs/format.md
//! for what the bucket holds.
//!
//! The `testing` feature adds what tests need and a normal build leaves
//! out: `memory://` stores (`memory_store`, `install_memory_store`) and
//! the fault-injecting store (`faults`). The crate's own tests get it
//! through its dev-dependency on itself.
//!
//! This crate knows the engine only through `zdisk_core::media::Media` and
//! the root's public format; the engine knows nothing of it.

mod cause;
mod error;
/// The fault-injecting store (tests only: the `testing` feature).
#[cfg(feature = "testing")]
pub mod faults;
mod image;
mod location;
mod medium;
pub mod objects;
mod reach;
mod sidecar;

pub use cause::StoreCause;
pub use error::TierError;
pub use image::{create, is_tiered, open, restore, TierLayout};
pub use location::Location;
/// The `memory://` stores (tests only: the `testing` feature).
#[cfg(feature = "testing")]
pub use location::{install_memory_store, memory_store};
pub use medium::{TierConfig, TieredMedia};
pub use sidecar::{sidecar_path, Sidecar};
