//! zdisk-kv: a table-less hash key-value store for compressing drives,
//! after KallaxDB (ScaleFlux, SDC 2020), and a YCSB-style driver that runs
//! it beside RocksDB.
//!
//! A key hashes straight to a 4 KiB slot on the device: there is no
//! in-memory index, no log and no compaction. Slots are filled loosely
//! (half full by default) and the drive's compression removes the empty
//! space, so the logical space spent buys one device read per lookup and
//! one read plus one write per update.
//!
//! Code map:
//! - [`format`]: the byte layout (superblock, slots, records).
//! - [`store`]: get, put, delete, overflow by linear probing, flush, the
//!   invariant checker.
//! - [`cache`]: an optional write-through cache of slots in RAM.
//! - [`device`]: the [`SlotDevice`] trait and its file and RAM devices.
//! - [`nbd`]: an NBD export as a [`SlotDevice`], through zdisk's one NBD
//!   client (`zdisk_nbd_wire::client`), so the store runs on a zdisk export.
//! - [`ycsb`]: the YCSB-style workloads (A, B, C, D, F; zipfian keys).
//! - [`rocks`]: RocksDB's C API, loaded at run time, for the comparison.
//!
//! API boundary: the store sees the medium only through [`SlotDevice`];
//! the CLI (`zdisk kv`, in the zdisk binary's `src/kv.rs`) parses
//! arguments and wires the parts.

pub mod cache;
pub mod device;
pub mod error;
pub mod format;
pub mod nbd;
pub mod rocks;
pub mod store;
pub mod ycsb;

pub use device::{FileDevice, MemDevice, SlotDevice};
pub use error::{Error, Result};
pub use nbd::NbdDevice;
pub use store::{CheckReport, FormatConfig, Store, StoreStats};

/// Opens `spec`: an NBD URI (`nbd://…`, `nbd+unix://…`, with
/// `connections` connections) or the path of a file or block device.
pub fn open_device(spec: &str, connections: usize) -> Result<Box<dyn SlotDevice>> {
    if spec.starts_with("nbd://") || spec.starts_with("nbd+unix://") {
        Ok(Box::new(NbdDevice::connect(spec, connections)?))
    } else {
        Ok(Box::new(FileDevice::open(std::path::Path::new(spec))?))
    }
}
