//! The tier's errors: values, turned into engine I/O errors at the `Media`
//! boundary and into one-line messages by the binary.

use std::fmt;

use crate::cause::StoreCause;

#[derive(Debug)]
#[non_exhaustive]
pub enum TierError {
    /// An `s3://BUCKET/PREFIX` that does not parse, or missing settings.
    BadLocation(String),
    /// The object store failed (after its retries).
    Store(String),
    /// A request to the store failed for a cause named in words: the
    /// volume's URL, what was being done (may be empty), the cause, and
    /// a note on the fix that only the caller knows (may be empty).
    Bucket {
        url: String,
        doing: String,
        cause: Box<StoreCause>,
        note: String,
    },
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
            TierError::Bucket {
                url,
                doing,
                cause,
                note,
            } => {
                write!(f, "{url}: ")?;
                if !doing.is_empty() {
                    write!(f, "{doing}: ")?;
                }
                write!(f, "{cause}{note}")
            }
        }
    }
}

impl std::error::Error for TierError {}

impl TierError {
    /// The store's cause, if this is a failed request to it.
    pub fn cause(&self) -> Option<&StoreCause> {
        match self {
            TierError::Bucket { cause, .. } => Some(cause),
            _ => None,
        }
    }
}

impl From<TierError> for zdisk_core::Error {
    fn from(error: TierError) -> Self {
        zdisk_core::Error::io(
            "object-store tier",
            std::io::Error::other(error.to_string()),
        )
    }
}
