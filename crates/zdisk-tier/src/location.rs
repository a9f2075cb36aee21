//! Where a tiered volume lives: `s3://BUCKET/PREFIX` (endpoint and
//! credentials from the standard `AWS_*` environment variables, as every
//! S3 tool reads them), or, in a build with the `testing` feature,
//! `memory://NAME/PREFIX`, an in-memory store shared within the process,
//! for tests that need no server.

use std::sync::Arc;
use std::time::Duration;

use object_store::aws::AmazonS3Builder;
use object_store::{BackoffConfig, ObjectStore, RetryConfig};

use crate::cause::Target;
use crate::error::{Result, TierError};

/// A parsed tier URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub url: String,
    scheme: Scheme,
    bucket: String,
    /// Empty, or ending in `/`.
    pub prefix: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scheme {
    S3,
    #[cfg(feature = "testing")]
    Memory,
}

impl Location {
    pub fn parse(url: &str) -> Result<Location> {
        let bad = |why: &str| {
            TierError::BadLocation(format!("tier {url:?}: {why} (expected s3://BUCKET/PREFIX)"))
        };
        let (scheme, rest) = if let Some(rest) = url.strip_prefix("s3://") {
            (Scheme::S3, rest)
        } else if let Some(rest) = url.strip_prefix("memory://") {
            (memory_scheme(url)?, rest)
        } else {
            return Err(bad("unknown scheme"));
        };
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(bad("no bucket"));
        }
        let prefix = prefix.trim_matches('/');
        if prefix.split('/').any(|part| part == "." || part == "..")
            || prefix.contains("//")
            || prefix.chars().any(|c| c.is_control())
        {
            return Err(bad("the prefix has an empty, '.' or '..' part"));
        }
        let prefix = if prefix.is_empty() {
            String::new()
        } else {
            format!("{prefix}/")
        };
        Ok(Location {
            url: url.to_string(),
            scheme,
            bucket: bucket.to_string(),
            prefix,
        })
    }

    /// Opens the store. S3 requests are retried with exponential backoff
    /// for at most `retry_timeout`, then fail.
    pub fn open_store(&self, retry_timeout: Duration) -> Result<Arc<dyn ObjectStore>> {
        match self.scheme {
            #[cfg(feature = "testing")]
            Scheme::Memory => Ok(memory_store(&self.bucket)),
            Scheme::S3 => {
                // A wait between tries never more than a quarter of the
                // timeout, so a request fails soon after it.
                let retry = RetryConfig {
                    backoff: BackoffConfig {
                        init_backoff: Duration::from_millis(100),
                        max_backoff: Duration::from_secs(5).min(retry_timeout / 4),
                        base: 2.0,
                    },
                    max_retries: usize::MAX,
                    retry_timeout,
                };
                let store = self
                    .s3_builder()
                    .with_retry(retry)
                    .build()
                    .map_err(|e| self.bad_settings(e))?;
                Ok(Arc::new(store))
            }
        }
    }

    /// True for an S3 location (one that a network stands between).
    pub(crate) fn is_s3(&self) -> bool {
        self.scheme == Scheme::S3
    }

    pub(crate) fn bucket(&self) -> &str {
        &self.bucket
    }

    /// The S3 settings from the `AWS_*` variables, for this bucket.
    pub(crate) fn s3_builder(&self) -> AmazonS3Builder {
        AmazonS3Builder::from_env().with_bucket_name(&self.bucket)
    }

    /// The error for S3 settings object_store refuses.
    pub(crate) fn bad_settings(&self, error: object_store::Error) -> TierError {
        TierError::BadLocation(format!(
            "tier {}: {error} (set AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, \
             AWS_SECRET_ACCESS_KEY, AWS_REGION, and AWS_ALLOW_HTTP=true \
             for a plain-HTTP endpoint)",
            self.url
        ))
    }

    /// What requests to this location go to, for the messages.
    pub(crate) fn target(&self) -> Target {
        #[cfg(feature = "testing")]
        if self.scheme == Scheme::Memory {
            return Target {
                endpoint: "memory".into(),
                bucket: self.bucket.clone(),
                key_id: String::new(),
            };
        }
        Target::of(&self.s3_builder(), &self.bucket)
    }
}

/// The error for a `memory://` URL where there is no such store.
#[cfg_attr(feature = "testing", allow(dead_code))]
fn no_memory_store(url: &str) -> TierError {
    TierError::BadLocation(format!(
        "tier {url:?}: memory:// is the tests' in-process store; this build has no \
         `testing` feature (expected s3://BUCKET/PREFIX)"
    ))
}

#[cfg(feature = "testing")]
fn memory_scheme(_url: &str) -> Result<Scheme> {
    Ok(Scheme::Memory)
}

#[cfg(not(feature = "testing"))]
fn memory_scheme(url: &str) -> Result<Scheme> {
    Err(no_memory_store(url))
}

#[cfg(feature = "testing")]
pub use memory::{install_memory_store, memory_store};

/// The tests' in-process stores (the `testing` feature).
#[cfg(feature = "testing")]
mod memory {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};

    use object_store::memory::InMemory;
    use object_store::ObjectStore;

    /// The stores `memory://NAME/...` names, one per name per process.
    fn memory_stores() -> &'static Mutex<HashMap<String, Arc<dyn ObjectStore>>> {
        static STORES: OnceLock<Mutex<HashMap<String, Arc<dyn ObjectStore>>>> = OnceLock::new();
        STORES.get_or_init(Default::default)
    }

    /// The in-memory store named `name`, as `memory://NAME/...` reaches it:
    /// the one a test installed under that name, else a fresh `InMemory` made
    /// on first use. Tests look into it through this.
    pub fn memory_store(name: &str) -> Arc<dyn ObjectStore> {
        memory_stores()
            .lock()
            .expect("memory stores lock")
            .entry(name.to_string())
            .or_insert_with(|| Arc::new(InMemory::new()))
            .clone()
    }

    /// Makes `memory://NAME/...` reach `store` from now on in this process
    /// (tests: a fault-injecting store, see `faults.rs`). Volumes already open
    /// keep the store they opened.
    pub fn install_memory_store(name: &str, store: Arc<dyn ObjectStore>) {
        memory_stores()
            .lock()
            .expect("memory stores lock")
            .insert(name.to_string(), store);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_and_bad_ones_say_why() {
        let location = Location::parse("s3://bucket/a/b/").unwrap();
        assert_eq!(location.bucket, "bucket");
        assert_eq!(location.prefix, "a/b/");
        assert_eq!(Location::parse("s3://bucket").unwrap().prefix, "");
        for bad in ["http://x/y", "s3:///p", "s3://b/a/../c", "s3://b/a//c"] {
            let error = Location::parse(bad).unwrap_err().to_string();
            assert!(error.contains("s3://BUCKET/PREFIX"), "{bad}: {error}");
        }
    }

    #[test]
    fn a_memory_url_without_the_testing_feature_says_why() {
        let error = no_memory_store("memory://b/p").to_string();
        assert!(error.contains("tests' in-process store"), "{error}");
        assert!(error.contains("no `testing` feature"), "{error}");
        #[cfg(not(feature = "testing"))]
        assert_eq!(
            Location::parse("memory://b/p").unwrap_err().to_string(),
            error
        );
        #[cfg(feature = "testing")]
        assert!(Location::parse("memory://b/p").is_ok());
    }
}
