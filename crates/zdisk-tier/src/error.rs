//! The tier's errors: values, turned into engine I/O errors at the `Media`
//! boundary and into one-line messages by the binary.

use std::fmt;

#[derive(Debug)]
#[non_exhaustive]
pub enum TierError {
    /// An `s3://BUCKET/PREFIX` that does not parse, or missing settings.
    BadLocation(String),
    /// The object store failed (after its retries).
    Store(String),
    /// An object that does not decode.
    BadObject(String),
    /// Another writer holds or took the volume.
    OtherWriter(String),
    /// The local state file or cache.
    Local(String),
    /// An object the bucket does not hold.
    Missing(String),
}

pub type Result<T> = std::result::Result<T, TierError>;

impl fmt::Display for TierError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TierError::BadLocation(m)
            | TierError::Store(m)
            | TierError::BadObject(m)
            | TierError::Missing(m)
            | TierError::OtherWriter(m)
            | TierError::Local(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for TierError {}

impl From<TierError> for zdisk_core::Error {
    fn from(error: TierError) -> Self {
        zdisk_core::Error::io(
            "object-store tier",
            std::io::Error::other(error.to_string()),
        )
    }
}
