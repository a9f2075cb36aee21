//! Why a request to the store failed, in words an operator can act on.
//!
//! object_store reports a refused connection after its retries as a long
//! line about the request; an S3 gateway's refusal as an HTTP status with
//! an XML body naming an error code (`<Code>NoSuchBucket</Code>`). This
//! module turns either into a [`StoreCause`]: the endpoint unreachable or
//! silent, the bucket missing, the key or secret refused, the clock
//! skewed, the gateway failing. It is the one place that reads those
//! errors; `store_error` (medium/bucket.rs), the first probe (reach.rs) and the
//! bucket creation all go through it.

use std::error::Error as StdError;
use std::fmt;

use object_store::client::{HttpError, HttpErrorKind};

/// What a request was sent to, for the messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// `AWS_ENDPOINT_URL`, or a phrase saying that AWS's own is used.
    pub endpoint: String,
    pub bucket: String,
    /// `AWS_ACCESS_KEY_ID` (never the secret).
    pub key_id: String,
}

/// Why a request to the store failed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreCause {
    /// Nothing accepts connections at the endpoint.
    Refused {
        endpoint: String,
    },
    /// The endpoint's host name does not resolve.
    UnknownHost {
        endpoint: String,
    },
    /// No answer in time.
    NoAnswer {
        endpoint: String,
    },
    /// The connection broke mid-request.
    Dropped {
        endpoint: String,
        detail: String,
    },
    NoSuchBucket {
        bucket: String,
        endpoint: String,
    },
    /// `InvalidAccessKeyId`: the gateway knows no such key.
    UnknownKey {
        key_id: String,
    },
    /// `SignatureDoesNotMatch`: the key is known, the secret is not its.
    WrongSecret {
        key_id: String,
    },
    /// `AccessDenied` (or a 403 without a code): the key may not do this.
    AccessDenied {
        key_id: String,
        bucket: String,
    },
    /// `RequestTimeTooSkewed`; the gateway's time when its body says it.
    ClockSkew {
        server_time: Option<String>,
    },
    /// A redirect or `AuthorizationHeaderMalformed`: the bucket is in
    /// another region than `AWS_REGION` says.
    WrongRegion {
        detail: String,
    },
    /// A 5xx answer: the gateway is up but failing (e.g. Ceph not ready).
    ServerError {
        status: u16,
        code: Option<String>,
    },
    /// Anything else, as object_store says it.
    Other(String),
}

impl StoreCause {
    /// True for a cause that may go away by itself (the gateway starting,
    /// the network coming back): worth waiting for, not worth refusing at
    /// once when the caller said to wait.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            StoreCause::Refused { .. }
                | StoreCause::UnknownHost { .. }
                | StoreCause::NoAnswer { .. }
                | StoreCause::Dropped { .. }
                | StoreCause::ServerError { .. }
        )
    }

    /// True if the store answered slowly or with a server error, where the
    /// long retry policy may still get through.
    pub fn is_slow(&self) -> bool {
        matches!(
            self,
            StoreCause::NoAnswer { .. } | StoreCause::ServerError { .. }
        )
    }

    /// The cause of an HTTP answer with status `status` and body `body`.
    pub fn of_answer(status: u16, body: &str, target: &Target) -> StoreCause {
        let code = xml_field(body, "Code");
        match code.as_deref() {
            Some("NoSuchBucket") => StoreCause::NoSuchBucket {
                bucket: target.bucket.clone(),
                endpoint: target.endpoint.clone(),
            },
            Some("InvalidAccessKeyId") => StoreCause::UnknownKey {
                key_id: target.key_id.clone(),
            },
            Some("SignatureDoesNotMatch") => StoreCause::WrongSecret {
                key_id: target.key_id.clone(),
            },
            Some("AccessDenied") | Some("AllAccessDisabled") => StoreCause::AccessDenied {
                key_id: target.key_id.clone(),
                bucket: target.bucket.clone(),
            },
            Some("RequestTimeTooSkewed") => StoreCause::ClockSkew {
                server_time: xml_field(body, "ServerTime"),
            },
            Some("AuthorizationHeaderMalformed") | Some("PermanentRedirect") => {
                StoreCause::WrongRegion {
                    detail: xml_field(body, "Message")
                        .unwrap_or_else(|| code.clone().unwrap_or_default()),
                }
            }
            _ if status >= 500 => StoreCause::ServerError { status, code },
            None if status == 403 => StoreCause::AccessDenied {
                key_id: target.key_id.clone(),
                bucket: target.bucket.clone(),
            },
            None if status == 401 => StoreCause::WrongSecret {
                key_id: target.key_id.clone(),
            },
            _ => StoreCause::Other(match code {
                Some(code) => format!("the gateway answered HTTP {status} {code}"),
                None => format!("the gateway answered HTTP {status}"),
            }),
        }
    }

    /// The cause of an error from object_store (or from the HTTP client
    /// that makes a bucket), read from its whole chain of sources.
    pub fn of(error: &(dyn StdError + 'static), target: &Target) -> StoreCause {
        let mut chain = String::new();
        let mut http_kind = None;
        let mut io_kind = None;
        let mut source: Option<&(dyn StdError + 'static)> = Some(error);
        while let Some(current) = source {
            if let Some(http) = current.downcast_ref::<HttpError>() {
                http_kind.get_or_insert(http.kind());
            }
            if let Some(io) = current.downcast_ref::<std::io::Error>() {
                io_kind.get_or_insert(io.kind());
            }
            chain.push_str(&current.to_string());
            chain.push('\n');
            source = current.source();
        }
        // object_store's words for an answer that was not a success
        // ("Server returned non-2xx status code: 404 Not Found: <body>").
        if let Some(status) = status_in(&chain) {
            return StoreCause::of_answer(status, &chain, target);
        }
        if chain.contains("Received redirect without LOCATION") {
            return StoreCause::WrongRegion {
                detail: "the gateway redirected without saying where".into(),
            };
        }
        let endpoint = target.endpoint.clone();
        let lower = chain.to_ascii_lowercase();
        match http_kind {
            _ if lower.contains("dns error") || lower.contains("failed to lookup address") => {
                StoreCause::UnknownHost { endpoint }
            }
            _ if io_kind == Some(std::io::ErrorKind::ConnectionRefused)
                || lower.contains("connection refused") =>
            {
                StoreCause::Refused { endpoint }
            }
            Some(HttpErrorKind::Timeout) => StoreCause::NoAnswer { endpoint },
            _ if io_kind == Some(std::io::ErrorKind::TimedOut) || lower.contains("timed out") => {
                StoreCause::NoAnswer { endpoint }
            }
            Some(HttpErrorKind::Connect)
            | Some(HttpErrorKind::Request)
            | Some(HttpErrorKind::Interrupted) => StoreCause::Dropped {
                endpoint,
                detail: innermost(error),
            },
            _ => StoreCause::Other(error.to_string()),
        }
    }
}

impl fmt::Display for StoreCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreCause::Refused { endpoint } => write!(
                f,
                "the S3 gateway at {endpoint} refuses connections: is it running, and is \
                 AWS_ENDPOINT_URL right?"
            ),
            StoreCause::UnknownHost { endpoint } => write!(
                f,
                "the host of {endpoint} does not resolve: check AWS_ENDPOINT_URL and DNS"
            ),
            StoreCause::NoAnswer { endpoint } => write!(
                f,
                "the S3 gateway at {endpoint} does not answer in time: is it up, and is \
                 AWS_ENDPOINT_URL right?"
            ),
            StoreCause::Dropped { endpoint, detail } => write!(
                f,
                "the connection to the S3 gateway at {endpoint} failed ({detail}): is it up, \
                 and does AWS_ENDPOINT_URL name it (http or https)?"
            ),
            StoreCause::NoSuchBucket { bucket, endpoint } => write!(
                f,
                "bucket {bucket:?} does not exist at {endpoint}: check the bucket's name and \
                 AWS_ENDPOINT_URL"
            ),
            StoreCause::UnknownKey { key_id } => write!(
                f,
                "the gateway knows no access key {key_id:?} (InvalidAccessKeyId): check \
                 AWS_ACCESS_KEY_ID"
            ),
            StoreCause::WrongSecret { key_id } => write!(
                f,
                "the gateway refused the signature of access key {key_id:?} \
                 (SignatureDoesNotMatch): check AWS_SECRET_ACCESS_KEY"
            ),
            StoreCause::AccessDenied { key_id, bucket } => write!(
                f,
                "access key {key_id:?} may not use bucket {bucket:?} (AccessDenied): grant it \
                 read and write on the bucket, or use the bucket owner's key"
            ),
            StoreCause::ClockSkew { server_time } => {
                write!(
                    f,
                    "this machine's clock is too far from the gateway's (RequestTimeTooSkewed"
                )?;
                if let Some(time) = server_time {
                    write!(f, "; the gateway's time is {time}")?;
                }
                write!(f, "): set the clock (NTP)")
            }
            StoreCause::WrongRegion { detail } => write!(
                f,
                "the bucket is in another region ({detail}): set AWS_REGION to its region"
            ),
            StoreCause::ServerError { status, code } => {
                write!(f, "the S3 gateway fails (HTTP {status}")?;
                if let Some(code) = code {
                    write!(f, " {code}")?;
                }
                write!(f, "): see its log; a Ceph cluster may still be starting")
            }
            StoreCause::Other(text) => f.write_str(text),
        }
    }
}

/// The text of `<NAME>...</NAME>` in `text`, if any.
fn xml_field(text: &str, name: &str) -> Option<String> {
    let open = format!("<{name}>");
    let close = format!("</{name}>");
    let start = text.find(&open)? + open.len();
    let len = text[start..].find(&close)?;
    let value = text[start..start + len].trim();
    (!value.is_empty()).then(|| value.to_string())
}

/// The status in object_store's "status code: NNN" or an error body's
/// HTTP status, if the chain names one.
fn status_in(chain: &str) -> Option<u16> {
    let marks = ["status code: ", "error response: "];
    marks.iter().find_map(|mark| {
        let at = chain.find(mark)? + mark.len();
        let digits: String = chain[at..]
            .chars()
            .take_while(|c| c.is_ascii_digit())
            .collect();
        (digits.len() == 3).then(|| digits.parse().ok()).flatten()
    })
}

/// The last error in `error`'s chain: the one nearest the cause.
fn innermost(error: &(dyn StdError + 'static)) -> String {
    let mut current = error;
    while let Some(next) = current.source() {
        current = next;
    }
    current.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> Target {
        Target {
            endpoint: "http://127.0.0.1:9".into(),
            bucket: "nob".into(),
            key_id: "KEY".into(),
        }
    }

    fn body(code: &str) -> String {
        format!(
            "<?xml version=\"1.0\"?><Error><Code>{code}</Code><BucketName>nob</BucketName></Error>"
        )
    }

    #[test]
    fn s3_error_codes_name_their_cause() {
        let t = target();
        let cases = [
            (404, "NoSuchBucket", "does not exist"),
            (403, "InvalidAccessKeyId", "AWS_ACCESS_KEY_ID"),
            (403, "SignatureDoesNotMatch", "AWS_SECRET_ACCESS_KEY"),
            (403, "AccessDenied", "may not use bucket"),
            (403, "RequestTimeTooSkewed", "clock"),
            (400, "AuthorizationHeaderMalformed", "AWS_REGION"),
            (503, "SlowDown", "HTTP 503 SlowDown"),
        ];
        for (status, code, words) in cases {
            let cause = StoreCause::of_answer(status, &body(code), &t);
            let text = cause.to_string();
            assert!(text.contains(words), "{code}: {text}");
            assert!(!text.contains('\n'), "{code}: {text}");
        }
        assert_eq!(
            StoreCause::of_answer(403, "", &t),
            StoreCause::AccessDenied {
                key_id: "KEY".into(),
                bucket: "nob".into()
            }
        );
        assert!(matches!(
            StoreCause::of_answer(409, &body("BucketAlreadyExists"), &t),
            StoreCause::Other(text) if text.contains("409 BucketAlreadyExists")
        ));
    }

    #[test]
    fn the_gateways_time_is_quoted_on_clock_skew() {
        let text = "<Error><Code>RequestTimeTooSkewed</Code>\
                    <ServerTime>2026-11-25T18:00:00Z</ServerTime></Error>";
        let cause = StoreCause::of_answer(403, text, &target());
        assert_eq!(
            cause,
            StoreCause::ClockSkew {
                server_time: Some("2026-11-25T18:00:00Z".into())
            }
        );
        assert!(cause.to_string().contains("2026-11-25T18:00:00Z"));
    }

    #[test]
    fn transient_causes_are_the_network_and_server_ones() {
        let t = target();
        assert!(StoreCause::Refused {
            endpoint: t.endpoint.clone()
        }
        .is_transient());
        assert!(StoreCause::of_answer(503, "", &t).is_transient());
        assert!(!StoreCause::of_answer(404, &body("NoSuchBucket"), &t).is_transient());
        assert!(!StoreCause::of_answer(403, &body("SignatureDoesNotMatch"), &t).is_transient());
    }

    #[test]
    fn object_store_status_lines_are_read() {
        let chain = "Generic S3 error: Error performing list request: Error performing GET \
                     http://x/nob?list-type=2 in 2ms - Server returned non-2xx status code: \
                     404 Not Found: <Error><Code>NoSuchBucket</Code></Error>";
        assert_eq!(status_in(chain), Some(404));
        assert_eq!(status_in("no status here"), None);
        assert_eq!(xml_field(chain, "Code").as_deref(), Some("NoSuchBucket"));
        assert_eq!(xml_field("<Code></Code>", "Code"), None);
    }
}
