//! Operating errors of the engine.
//!
//! Everything a client, an operator or the medium can cause is a value of
//! [`Error`]; programmer errors panic instead. The NBD layer maps these to
//! protocol errno values at its boundary (see `zdisk-nbd`), nowhere else.

use std::io;

/// Result alias used across the engine.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Operating errors: I/O failures, damaged data, full media, bad requests.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The medium reported an I/O error.
    #[error("I/O error while {context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    /// A stored extent failed verification when it was read.
    #[error("block {lba} is damaged: {reason} (segment {segment}, offset {offset})")]
    DamagedBlock {
        lba: u64,
        segment: u32,
        offset: u32,
        reason: String,
    },
    /// A stored extent's CRC32C did not match its contents.
    #[error(
        "checksum mismatch in block {lba}: expected {expected:#010x}, computed {actual:#010x} \
         (segment {segment}, offset {offset})"
    )]
    ChecksumMismatch {
        lba: u64,
        segment: u32,
        offset: u32,
        expected: u32,
        actual: u32,
    },
    /// The medium has no free space left for this write.
    #[error("no space left on the medium: {free_segments} free segments, {reserved_segments} reserved for cleaning and checkpoints")]
    NoSpace {
        free_segments: u64,
        reserved_segments: u64,
    },
    /// The request addresses bytes outside the logical volume.
    #[error(
        "request out of range: offset {offset} + length {length} exceeds the volume size {size}"
    )]
    OutOfRange { offset: u64, length: u64, size: u64 },
    /// A write-type request on a read-only volume.
    #[error("the volume is read-only")]
    ReadOnly,
    /// A malformed argument or request.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The image's metadata is unreadable or inconsistent.
    #[error("corrupt image: {0}")]
    CorruptImage(String),
    /// The file or device holds no zdisk image at all (the message says
    /// what it seems to hold instead, if that is known).
    #[error("{0}")]
    NotAnImage(String),
    /// The image was made by an incompatible version of zdisk.
    #[error("unsupported image: {0}")]
    Unsupported(String),
    /// Another process holds the image.
    #[error("{path} is in use by another zdisk process (its lock is held); stop that process or use another image")]
    Locked { path: String },
    /// The engine stopped accepting requests (shutdown or a fatal medium error).
    #[error("the volume is shut down")]
    ShutDown,
}

impl Error {
    /// Wraps an `io::Error` with a description of what was being done.
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// True for errors that mean stored data could not be returned intact.
    pub fn is_data_error(&self) -> bool {
        matches!(
            self,
            Error::Io { .. } | Error::DamagedBlock { .. } | Error::ChecksumMismatch { .. }
        )
    }
}
