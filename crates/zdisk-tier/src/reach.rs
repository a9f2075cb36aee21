//! The first contact with a bucket, before a volume is made or opened: one
//! LIST of the volume's prefix (its first page) through a store with a
//! short timeout, so a wrong endpoint, a missing bucket, refused
//! credentials or a skewed clock is one line naming the cause within a few
//! seconds, instead of a long line after the long retry policy
//! (`--tier-timeout`, 30 s by default) gave up. Only once the probe got
//! through does the caller use its store with that policy.
//!
//! A gateway that answers slowly or with a server error is not refused
//! here: the long policy may still get through, so the probe warns and
//! lets it try. When opening an image the caller may wait for the bucket
//! (`serve --tier-wait`): a cause that may pass by itself (see
//! `StoreCause::is_transient`) is then probed again every 2 s until the
//! wait is over; any other fails at once.
//!
//! `create --tier --create-bucket` makes a missing bucket with a PUT to a
//! URL that object_store presigns (it has no call for bucket creation).

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::path::Path as ObjectPath;
use object_store::signer::Signer;
use object_store::{BackoffConfig, ClientConfigKey, ObjectStore, RetryConfig};

use crate::cause::{StoreCause, Target};
use crate::error::{Result, TierError};
use crate::location::Location;

/// How long the probe waits for a connection, for an answer, and in all
/// (with up to two retries of a refused connection).
const PROBE_CONNECT: Duration = Duration::from_millis(1500);
const PROBE_ANSWER: Duration = Duration::from_secs(3);
const PROBE_TOTAL: Duration = Duration::from_millis(2500);
/// How long a bucket creation may take.
const MAKE_BUCKET_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause between probes while waiting for the bucket.
const WAIT_PAUSE: Duration = Duration::from_secs(2);

/// Why the bucket is being contacted, which decides what a failure says.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Contact {
    /// `create --tier`: makes a missing bucket if `make_bucket`.
    Create { make_bucket: bool },
    /// `create --from`: the volume must be there already.
    Attach,
    /// Opening an image: waits up to `wait` for a transient cause to pass.
    Open { wait: Duration },
}

impl Location {
    /// Checks within a few seconds that the bucket answers to these
    /// credentials (see the module comment); a no-op for `memory://`.
    pub(crate) fn reach(&self, runtime: &tokio::runtime::Runtime, contact: Contact) -> Result<()> {
        if !self.is_s3() {
            return Ok(());
        }
        self.reach_with(self.s3_builder(), runtime, contact)
    }

    /// `reach` with these S3 settings (tests give their own, not the
    /// process's environment).
    pub(crate) fn reach_with(
        &self,
        settings: AmazonS3Builder,
        runtime: &tokio::runtime::Runtime,
        contact: Contact,
    ) -> Result<()> {
        let target = Target::of(&settings, self.bucket());
        let store = probe_store(settings.clone()).map_err(|e| self.bad_settings(e))?;
        let started = Instant::now();
        let wait = match contact {
            Contact::Open { wait } => wait,
            Contact::Create { .. } | Contact::Attach => Duration::ZERO,
        };
        let mut make_bucket = matches!(contact, Contact::Create { make_bucket: true });
        loop {
            let cause = match runtime.block_on(probe(&store, self)) {
                Ok(()) => {
                    if started.elapsed() >= WAIT_PAUSE {
                        log::info!(
                            "{}: the bucket answers after {} s",
                            self.url,
                            started.elapsed().as_secs()
                        );
                    }
                    return Ok(());
                }
                Err(error) => StoreCause::of(&error, &target),
            };
            if make_bucket && matches!(cause, StoreCause::NoSuchBucket { .. }) {
                make_bucket = false;
                runtime
                    .block_on(make_bucket_at(settings.clone(), &target))
                    .map_err(|cause| {
                        self.failed(
                            &format!("making bucket {:?}", self.bucket()),
                            cause,
                            String::new(),
                        )
                    })?;
                log::info!(
                    "{}: made bucket {:?} at {}",
                    self.url,
                    self.bucket(),
                    target.endpoint
                );
                continue;
            }
            let left = wait.saturating_sub(started.elapsed());
            if cause.is_transient() && !left.is_zero() {
                log::warn!(
                    "{}: waiting for the bucket ({:.0} s left): {cause}",
                    self.url,
                    left.as_secs_f64().ceil()
                );
                std::thread::sleep(WAIT_PAUSE.min(left));
                continue;
            }
            if cause.is_slow() {
                log::warn!(
                    "{}: {cause}; trying for up to the retry timeout (--tier-timeout)",
                    self.url
                );
                return Ok(());
            }
            let note = match (contact, &cause) {
                (Contact::Create { .. }, StoreCause::NoSuchBucket { .. }) => {
                    ", or add --create-bucket to make it".to_string()
                }
                (Contact::Open { wait }, cause) if cause.is_transient() => {
                    if wait.is_zero() {
                        " (`zdisk serve --tier-wait SECONDS` waits for it)".to_string()
                    } else {
                        format!(" (waited {} s)", started.elapsed().as_secs())
                    }
                }
                _ => String::new(),
            };
            return Err(self.failed("", cause, note));
        }
    }

    fn failed(&self, doing: &str, cause: StoreCause, note: String) -> TierError {
        TierError::Bucket {
            url: self.url.clone(),
            doing: doing.to_string(),
            cause: Box::new(cause),
            note,
        }
    }
}

impl Target {
    /// What requests made with `settings` go to.
    pub(crate) fn of(settings: &AmazonS3Builder, bucket: &str) -> Target {
        let region = settings
            .get_config_value(&AmazonS3ConfigKey::Region)
            .unwrap_or_else(|| "us-east-1".into());
        Target {
            endpoint: settings
                .get_config_value(&AmazonS3ConfigKey::Endpoint)
                .unwrap_or_else(|| {
                    format!("AWS's endpoint for region {region} (AWS_ENDPOINT_URL is not set)")
                }),
            bucket: bucket.to_string(),
            key_id: settings
                .get_config_value(&AmazonS3ConfigKey::AccessKeyId)
                .unwrap_or_default(),
        }
    }
}

/// A store that tries a request for at most `PROBE_TOTAL` (a refused
/// connection three times), each try for at most `PROBE_ANSWER`.
fn probe_store(settings: AmazonS3Builder) -> object_store::Result<Arc<dyn ObjectStore>> {
    let retry = RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(500),
            base: 2.0,
        },
        max_retries: 2,
        retry_timeout: PROBE_TOTAL,
    };
    let millis = |d: Duration| format!("{}ms", d.as_millis());
    let store = settings
        .with_retry(retry)
        .with_config(
            AmazonS3ConfigKey::Client(ClientConfigKey::ConnectTimeout),
            millis(PROBE_CONNECT),
        )
        .with_config(
            AmazonS3ConfigKey::Client(ClientConfigKey::Timeout),
            millis(PROBE_ANSWER),
        )
        .build()?;
    Ok(Arc::new(store))
}

/// Lists the first page of the volume's prefix.
async fn probe(store: &Arc<dyn ObjectStore>, location: &Location) -> object_store::Result<()> {
    let prefix = ObjectPath::from(location.prefix.trim_end_matches('/'));
    let prefix = (!location.prefix.is_empty()).then_some(&prefix);
    match store.list(prefix).next().await {
        Some(Err(error)) => Err(error),
        Some(Ok(_)) | None => Ok(()),
    }
}

/// Makes the bucket `target` names: a PUT of the bucket's URL, presigned
/// with the same credentials. A bucket this key already owns counts as made.
async fn make_bucket_at(
    settings: AmazonS3Builder,
    target: &Target,
) -> std::result::Result<(), StoreCause> {
    let region = settings
        .get_config_value(&AmazonS3ConfigKey::Region)
        .unwrap_or_else(|| "us-east-1".into());
    let s3 = settings.build().map_err(|e| StoreCause::of(&e, target))?;
    let url = s3
        .signed_url(
            reqwest::Method::PUT,
            &ObjectPath::from(""),
            MAKE_BUCKET_TIMEOUT * 6,
        )
        .await
        .map_err(|e| StoreCause::of(&e, target))?;
    // us-east-1 is the default region, which S3 wants left unsaid.
    let body = if region == "us-east-1" {
        String::new()
    } else {
        format!(
            "<CreateBucketConfiguration xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">\
             <LocationConstraint>{region}</LocationConstraint></CreateBucketConfiguration>"
        )
    };
    let client = reqwest::Client::builder()
        .connect_timeout(PROBE_CONNECT)
        .timeout(MAKE_BUCKET_TIMEOUT)
        .build()
        .map_err(|e| StoreCause::Other(format!("cannot make an HTTP client: {e}")))?;
    let answer = client
        .put(url)
        .body(body)
        .send()
        .await
        .map_err(|e| StoreCause::of(&e, target))?;
    let status = answer.status().as_u16();
    let text = answer.text().await.unwrap_or_default();
    if (200..300).contains(&status) || text.contains("<Code>BucketAlreadyOwnedByYou</Code>") {
        Ok(())
    } else {
        Err(StoreCause::of_answer(status, &text, target))
    }
}

#[cfg(test)]
mod tests {
    //! The probe against a fake gateway on a loopback port that answers
    //! every request with one canned HTTP answer, or against a port where
    //! nothing listens: real object_store errors, classified.

    use std::io::{Read, Write};
    use std::net::TcpListener;

    use super::*;

    /// Serves `answers` HTTP answers, one per connection, of `status` and
    /// `body`; returns its endpoint. Ends after its answers, or after 20 s.
    fn fake_gateway(status: u16, body: &'static str, answers: usize) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        let endpoint = format!("http://{}", listener.local_addr().expect("address"));
        listener.set_nonblocking(true).expect("nonblocking");
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(20);
            let mut served = 0;
            while served < answers && Instant::now() < deadline {
                let Ok((mut stream, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                stream.set_nonblocking(false).expect("blocking");
                stream
                    .set_read_timeout(Some(Duration::from_secs(5)))
                    .expect("timeout");
                let mut request = Vec::new();
                let mut buffer = [0u8; 4096];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buffer) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => request.extend_from_slice(&buffer[..n]),
                    }
                }
                let answer = format!(
                    "HTTP/1.1 {status} Canned\r\nContent-Type: application/xml\r\n\
                     Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(answer.as_bytes());
                served += 1;
            }
        });
        endpoint
    }

    fn settings(endpoint: &str) -> AmazonS3Builder {
        AmazonS3Builder::new()
            .with_endpoint(endpoint)
            .with_allow_http(true)
            .with_region("us-east-1")
            .with_access_key_id("KEY")
            .with_secret_access_key("SECRET")
            .with_bucket_name("nob")
    }

    fn reach(endpoint: &str, contact: Contact) -> Result<()> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let location = Location::parse("s3://nob/vol").expect("a good URL");
        location.reach_with(settings(endpoint), &runtime, contact)
    }

    fn error_body(code: &'static str) -> &'static str {
        match code {
            "NoSuchBucket" => "<?xml version=\"1.0\"?><Error><Code>NoSuchBucket</Code></Error>",
            "SignatureDoesNotMatch" => "<Error><Code>SignatureDoesNotMatch</Code></Error>",
            "InvalidAccessKeyId" => "<Error><Code>InvalidAccessKeyId</Code></Error>",
            "RequestTimeTooSkewed" => "<Error><Code>RequestTimeTooSkewed</Code></Error>",
            "AccessDenied" => "<Error><Code>AccessDenied</Code></Error>",
            _ => "",
        }
    }

    #[test]
    fn gateway_refusals_are_named() {
        let cases = [
            (404, "NoSuchBucket", "does not exist"),
            (403, "SignatureDoesNotMatch", "AWS_SECRET_ACCESS_KEY"),
            (403, "InvalidAccessKeyId", "AWS_ACCESS_KEY_ID"),
            (403, "RequestTimeTooSkewed", "clock"),
            (403, "AccessDenied", "may not use bucket"),
        ];
        for (status, code, words) in cases {
            let endpoint = fake_gateway(status, error_body(code), 1);
            let error = reach(&endpoint, Contact::Attach).unwrap_err();
            let text = error.to_string();
            assert!(text.contains(words), "{code}: {text}");
            assert!(text.starts_with("s3://nob/vol: "), "{code}: {text}");
            assert!(!text.contains('\n'), "{code}: {text}");
        }
    }

    #[test]
    fn a_missing_bucket_at_create_points_to_create_bucket() {
        let endpoint = fake_gateway(404, error_body("NoSuchBucket"), 1);
        let error = reach(&endpoint, Contact::Create { make_bucket: false }).unwrap_err();
        assert!(matches!(
            error.cause(),
            Some(StoreCause::NoSuchBucket { bucket, .. }) if bucket == "nob"
        ));
        assert!(error.to_string().contains("--create-bucket"), "{error}");
    }

    #[test]
    fn create_bucket_makes_it_then_probes_again() {
        // The LIST finds no bucket, the PUT makes it, the LIST gets through.
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let endpoint = format!("http://{}", listener.local_addr().expect("address"));
        let log = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = log.clone();
        std::thread::spawn(move || {
            let answers = [
                (404, error_body("NoSuchBucket")),
                (200, ""),
                (
                    200,
                    "<ListBucketResult><KeyCount>0</KeyCount></ListBucketResult>",
                ),
            ];
            for (status, body) in answers {
                let Ok((mut stream, _)) = listener.accept() else {
                    return;
                };
                stream
                    .set_read_timeout(Some(Duration::from_secs(5)))
                    .expect("timeout");
                let mut request = Vec::new();
                let mut buffer = [0u8; 4096];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buffer) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => request.extend_from_slice(&buffer[..n]),
                    }
                }
                let line = String::from_utf8_lossy(&request)
                    .lines()
                    .next()
                    .unwrap_or("")
                    .to_string();
                seen.lock().unwrap().push(line);
                let answer = format!(
                    "HTTP/1.1 {status} Canned\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(answer.as_bytes());
            }
        });
        reach(&endpoint, Contact::Create { make_bucket: true }).expect("made and reached");
        let requests = log.lock().unwrap().clone();
        assert_eq!(requests.len(), 3, "{requests:?}");
        assert!(
            requests[0].starts_with("GET /nob?list-type=2"),
            "{requests:?}"
        );
        assert!(requests[1].starts_with("PUT /nob/?"), "{requests:?}");
        assert!(requests[1].contains("X-Amz-Signature="), "{requests:?}");
        assert!(
            requests[2].starts_with("GET /nob?list-type=2"),
            "{requests:?}"
        );
    }

    #[test]
    fn nothing_listening_is_named_and_waiting_is_suggested() {
        // A port just bound and released: nothing listens there.
        let port = TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("address")
            .port();
        let endpoint = format!("http://127.0.0.1:{port}");
        let started = Instant::now();
        let error = reach(
            &endpoint,
            Contact::Open {
                wait: Duration::ZERO,
            },
        )
        .unwrap_err();
        let text = error.to_string();
        assert!(
            matches!(error.cause(), Some(StoreCause::Refused { .. })),
            "{text}"
        );
        assert!(text.contains("refuses connections"), "{text}");
        assert!(text.contains(&endpoint), "{text}");
        assert!(text.contains("--tier-wait"), "{text}");
        eprintln!("refused in {:?}: {text}", started.elapsed());
    }

    #[test]
    fn a_server_error_leaves_it_to_the_long_policy() {
        let endpoint = fake_gateway(503, "<Error><Code>ServiceUnavailable</Code></Error>", 3);
        assert!(reach(&endpoint, Contact::Attach).is_ok());
    }

    #[test]
    fn a_silent_gateway_is_named_then_left_to_the_long_policy() {
        // Accepts connections, never answers.
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let endpoint = format!("http://{}", listener.local_addr().expect("address"));
        std::thread::spawn(move || {
            let held: Vec<_> = listener.incoming().take(3).collect();
            std::thread::sleep(Duration::from_secs(10));
            drop(held);
        });
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let store = probe_store(settings(&endpoint)).expect("a store");
        let location = Location::parse("s3://nob/vol").expect("a good URL");
        let error = runtime
            .block_on(probe(&store, &location))
            .expect_err("no answer");
        let cause = StoreCause::of(&error, &Target::of(&settings(&endpoint), "nob"));
        assert!(matches!(cause, StoreCause::NoAnswer { .. }), "{cause:?}");
        assert!(cause.is_slow());
        assert!(
            cause.to_string().contains("does not answer in time"),
            "{cause}"
        );
    }

    #[test]
    fn waiting_ends_once_the_gateway_answers() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        drop(listener);
        let endpoint = format!("http://{address}");
        let opener = std::thread::spawn(move || {
            // Up in about 3 s: the waiting probe gets through.
            std::thread::sleep(Duration::from_secs(3));
            let listener = TcpListener::bind(address).expect("rebind");
            let (mut stream, _) = listener.accept().expect("accept");
            let mut buffer = [0u8; 4096];
            let _ = stream.read(&mut buffer);
            let body = "<ListBucketResult><KeyCount>0</KeyCount></ListBucketResult>";
            let answer = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(answer.as_bytes());
        });
        let result = reach(
            &endpoint,
            Contact::Open {
                wait: Duration::from_secs(30),
            },
        );
        opener.join().expect("gateway thread");
        assert!(result.is_ok(), "{result:?}");
    }
}
