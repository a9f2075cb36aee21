//! The store's operating errors, as values.

/// What can go wrong opening or using a store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("cannot open {what}: {source}")]
    Open {
        what: String,
        source: std::io::Error,
    },
    #[error("I/O error: {0}")]
    Io(#[source] std::io::Error),
    #[error("{0}")]
    Nbd(#[from] zdisk_nbd_wire::client::ClientError),
    #[error("{length} bytes at offset {offset} are past the device's end ({size_bytes} bytes)")]
    OutOfRange {
        offset: u64,
        length: u64,
        size_bytes: u64,
    },
    #[error("not a zdisk-kv store (no superblock at offset 0)")]
    NotAStore,
    #[error("the superblock is damaged: {0}")]
    BadSuperblock(String),
    #[error("slot {slot} is damaged: {why}")]
    BadSlot { slot: u64, why: String },
    #[error("a key of {key_bytes} bytes and a value of {value_bytes} bytes do not fit in a slot (at most {max_bytes} together, keys 1..=255 bytes)")]
    TooBig {
        key_bytes: usize,
        value_bytes: usize,
        max_bytes: usize,
    },
    #[error("no room within {probe_slots} slots of the key's home slot {home}: the store is too full (format it with more slots)")]
    Full { home: u64, probe_slots: u64 },
    #[error("the device holds {size_bytes} bytes, too small for {slots} slots")]
    DeviceTooSmall { size_bytes: u64, slots: u64 },
}

pub type Result<T> = std::result::Result<T, Error>;
