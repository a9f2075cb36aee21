//! The object-store tier (issue #15): a volume's segments in a bucket (S3,
//! Ceph's radosgw, or an in-memory store for tests), a local image as the
//! cache. See `medium.rs` for how segments travel and docs/format.md for
//! what the bucket holds.
//!
//! This crate knows the engine only through `zdisk_core::media::Media` and
//! the root's public format; the engine knows nothing of it.

mod cause;
mod error;
#[doc(hidden)]
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
#[doc(hidden)]
pub use location::{install_memory_store, memory_store};
pub use medium::{TierConfig, TieredMedia};
pub use sidecar::{sidecar_path, Sidecar};
