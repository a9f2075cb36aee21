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
    /// Something is already where a new image or volume was to be made.
    Exists(String),
    /// An image made to read a volume (`create --from --read-only`) was
    /// opened to write.
    ReaderOnly(String),
    /// The engine refused or failed (making or opening the volume, the
    /// local image); its own error.
    Engine(zdisk_core::Error),
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
            | TierError::Exists(m)
            | TierError::ReaderOnly(m)
            | TierError::Local(m) => f.write_str(m),
            TierError::Engine(error) => write!(f, "{error}"),
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

impl std::error::Error for TierError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            // Transparent: its message is the engine error's own.
            TierError::Engine(error) => std::error::Error::source(error),
            _ => None,
        }
    }
}

impl From<zdisk_core::Error> for TierError {
    fn from(error: zdisk_core::Error) -> Self {
        TierError::Engine(error)
    }
}

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
        match error {
            TierError::Engine(error) => error,
            error => zdisk_core::Error::io(
                "object-store tier",
                std::io::Error::other(error.to_string()),
            ),
        }
    }
}
