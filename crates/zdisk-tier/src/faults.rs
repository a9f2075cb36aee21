//! A fault-injecting object store for tests: object_store's `InMemory`
//! behind an endpoint that a test can take down and bring back, that fails
//! a seeded fraction of requests, loses the reply to a PUT the server did
//! apply, delays requests, and holds one PUT in flight until the test
//! decides whether it reached the server (a writer killed mid-upload).
//! `install_memory_store` makes `memory://NAME/...` reach one, so
//! `create`, `open` and `restore` run the tier's real code against it.
//! Built only with the `testing` feature (the crate's tests turn it on).
//!
//! The fault model (what the tier must survive): a request that fails
//! either did nothing or, for a PUT with a lost reply, did everything (the
//! server's PUT is atomic, never partial); a GET never returns wrong bytes;
//! the store itself keeps everything that landed. Draws come from a
//! SplitMix64 generator seeded by the test, one per request, so the same
//! seed gives the same fault rates and choices in request order; which
//! request meets which draw depends on the tier's threads' timing.

use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::{self, BoxStream, StreamExt};
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{
    GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
};

/// Longest a PUT is held before it times out by itself (a writer may be
/// waiting for that upload to make room in its cache).
const HOLD_MAX: Duration = Duration::from_millis(500);

/// Random faults, in requests per thousand.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultRates {
    /// Requests that fail without reaching the server.
    pub fail_per_mille: u32,
    /// PUTs the server applies whose reply is lost (the client sees an error).
    pub lost_reply_per_mille: u32,
    /// Requests delayed by up to `delay_max` first.
    pub delay_per_mille: u32,
    pub delay_max: Duration,
}

/// Which PUT `FaultStore::park_put` holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutKind {
    Any,
    /// Keys with a `root/` part.
    Root,
    /// Keys with a `seg/` part.
    Segment,
}

impl PutKind {
    fn matches(self, key: &str) -> bool {
        match self {
            PutKind::Any => true,
            PutKind::Root => key.contains("root/"),
            PutKind::Segment => key.contains("seg/"),
        }
    }
}

/// A PUT that reached the server.
#[derive(Debug, Clone)]
pub struct Landed {
    pub key: String,
    /// Taken before the PUT was passed to the server: the object landed
    /// after this instant.
    pub sent_at: Instant,
}

/// What the store did, for tests to assert that faults really happened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultCounts {
    pub requests: u64,
    /// Failed because the endpoint was down.
    pub refused: u64,
    /// Failed at random.
    pub failed: u64,
    /// PUTs applied whose reply was lost.
    pub lost_replies: u64,
    pub delayed: u64,
    /// Parked PUTs let through, and dropped.
    pub parked_landed: u64,
    pub parked_dropped: u64,
    /// Held PUTs that timed out before the test let them go.
    pub parked_expired: u64,
}

#[derive(Debug)]
enum Park {
    /// Hold the PUT after skipping `skip` more that match.
    Armed { kind: PutKind, skip: u32 },
    /// A PUT of `key` is held, since an instant.
    Holding { key: String, since: Instant },
    /// The held PUT goes on (to the server, or nowhere).
    Released { land: bool },
}

#[derive(Debug)]
struct FaultState {
    rng: u64,
    down: Down,
    rates: FaultRates,
    park: Option<Park>,
    landed: Vec<Landed>,
    counts: FaultCounts,
}

/// Whether the endpoint is down.
#[derive(Debug, Clone, Copy)]
enum Down {
    No,
    Until(Instant),
    Forever,
}

impl Down {
    fn now(self) -> bool {
        match self {
            Down::No => false,
            Down::Until(until) => Instant::now() < until,
            Down::Forever => true,
        }
    }
}

/// What happens to one request.
enum Fate {
    Refuse(&'static str),
    Proceed { delay: Duration, lose_reply: bool },
}

/// The fault-injecting store (see the module comment).
pub struct FaultStore {
    inner: InMemory,
    state: Mutex<FaultState>,
}

impl fmt::Debug for FaultStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultStore").finish_non_exhaustive()
    }
}

impl fmt::Display for FaultStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FaultStore")
    }
}

/// One SplitMix64 step.
fn next_random(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn injected(message: &'static str) -> object_store::Error {
    object_store::Error::Generic {
        store: "FaultStore",
        source: message.into(),
    }
}

impl FaultStore {
    /// An empty store, up, with no random faults.
    pub fn new(seed: u64) -> Arc<FaultStore> {
        Arc::new(FaultStore {
            inner: InMemory::new(),
            state: Mutex::new(FaultState {
                rng: seed,
                down: Down::No,
                rates: FaultRates::default(),
                park: None,
                landed: Vec::new(),
                counts: FaultCounts::default(),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, FaultState> {
        self.state.lock().expect("fault store lock")
    }

    /// While down, every request fails at once (a refused connection).
    pub fn set_down(&self, down: bool) {
        self.lock().down = if down { Down::Forever } else { Down::No };
    }

    /// Takes the endpoint down for `duration` from now (an outage that
    /// ends by itself, whatever the test's thread is waiting for).
    pub fn set_down_for(&self, duration: Duration) {
        self.lock().down = Down::Until(Instant::now() + duration);
    }

    pub fn is_down(&self) -> bool {
        self.lock().down.now()
    }

    pub fn set_rates(&self, rates: FaultRates) {
        self.lock().rates = rates;
    }

    /// Holds a coming PUT of `kind` (after skipping `skip` that match) in
    /// flight until `release_parked`, or for `HOLD_MAX` at most. While a
    /// PUT is held already, does nothing.
    pub fn park_put(&self, kind: PutKind, skip: u32) {
        let mut state = self.lock();
        if !matches!(state.park, Some(Park::Holding { .. })) {
            state.park = Some(Park::Armed { kind, skip });
        }
    }

    /// The key of the PUT held in flight, if one is.
    pub fn parked(&self) -> Option<String> {
        match &self.lock().park {
            Some(Park::Holding { key, .. }) => Some(key.clone()),
            _ => None,
        }
    }

    /// Waits up to `timeout` for a PUT to be held; returns its key.
    pub fn wait_parked(&self, timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(key) = self.parked() {
                return Some(key);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Lets the held PUT go on: to the server (`land`) or nowhere (it
    /// fails, as a request from a killed client that never arrived), then
    /// parks nothing more. Without a held PUT, just disarms. Returns true
    /// if a PUT was held.
    pub fn release_parked(&self, land: bool) -> bool {
        let mut state = self.lock();
        let held = matches!(state.park, Some(Park::Holding { .. }));
        state.park = held.then_some(Park::Released { land });
        held
    }

    /// True while a PUT is to be held and none is yet.
    pub fn is_armed(&self) -> bool {
        matches!(self.lock().park, Some(Park::Armed { .. }))
    }

    /// Every PUT that reached the server, in order.
    pub fn landed(&self) -> Vec<Landed> {
        self.lock().landed.clone()
    }

    pub fn counts(&self) -> FaultCounts {
        self.lock().counts
    }

    /// The objects the server holds, bypassing every fault.
    pub fn server(&self) -> &InMemory {
        &self.inner
    }

    /// Draws the fate of one request.
    fn fate(&self, is_put: bool) -> Fate {
        let mut state = self.lock();
        state.counts.requests += 1;
        if state.down.now() {
            state.counts.refused += 1;
            return Fate::Refuse("the endpoint is down (injected)");
        }
        let rates = state.rates;
        let mut draw = |per_mille: u32| next_random(&mut state.rng) % 1000 < per_mille as u64;
        let fail = draw(rates.fail_per_mille);
        let lose_reply = is_put && draw(rates.lost_reply_per_mille);
        let delayed = draw(rates.delay_per_mille);
        let delay_us = next_random(&mut state.rng) % (rates.delay_max.as_micros() as u64 + 1);
        if fail {
            state.counts.failed += 1;
            return Fate::Refuse("the request failed (injected)");
        }
        if delayed {
            state.counts.delayed += 1;
        }
        Fate::Proceed {
            delay: if delayed {
                Duration::from_micros(delay_us)
            } else {
                Duration::ZERO
            },
            lose_reply,
        }
    }

    /// Runs a request that is not a PUT through the faults.
    async fn admit(&self) -> Result<()> {
        match self.fate(false) {
            Fate::Refuse(why) => Err(injected(why)),
            Fate::Proceed { delay, .. } => {
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                Ok(())
            }
        }
    }

    /// Holds a PUT of `key` if one is to be parked; returns false if it
    /// must not reach the server.
    async fn maybe_park(&self, key: &str) -> bool {
        {
            let mut state = self.lock();
            match &mut state.park {
                Some(Park::Armed { kind, skip }) if kind.matches(key) => {
                    if *skip > 0 {
                        *skip -= 1;
                        return true;
                    }
                    state.park = Some(Park::Holding {
                        key: key.to_string(),
                        since: Instant::now(),
                    });
                }
                _ => return true,
            }
        }
        loop {
            {
                let mut state = self.lock();
                if let Some(Park::Released { land }) = state.park {
                    state.park = None;
                    if land {
                        state.counts.parked_landed += 1;
                    } else {
                        state.counts.parked_dropped += 1;
                    }
                    return land;
                }
                if let Some(Park::Holding { since, .. }) = state.park {
                    if since.elapsed() > HOLD_MAX {
                        // Nobody came for it: it times out, and nothing
                        // more is held (the writer may be waiting on it).
                        state.park = None;
                        state.counts.parked_expired += 1;
                        return false;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

#[async_trait]
impl ObjectStore for FaultStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        let (delay, lose_reply) = match self.fate(true) {
            Fate::Refuse(why) => return Err(injected(why)),
            Fate::Proceed { delay, lose_reply } => (delay, lose_reply),
        };
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if !self.maybe_park(location.as_ref()).await {
            return Err(injected(
                "the client died before the PUT arrived (injected)",
            ));
        }
        let sent_at = Instant::now();
        let result = self.inner.put_opts(location, payload, opts).await?;
        let mut state = self.lock();
        state.landed.push(Landed {
            key: location.to_string(),
            sent_at,
        });
        if lose_reply {
            state.counts.lost_replies += 1;
            return Err(injected(
                "the connection dropped after the PUT was applied (injected)",
            ));
        }
        Ok(result)
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.admit().await?;
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        self.admit().await?;
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(&self, location: &Path, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        self.admit().await?;
        self.inner.get_ranges(location, ranges).await
    }

    async fn delete(&self, location: &Path) -> Result<()> {
        self.admit().await?;
        self.inner.delete(location).await
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        match self.fate(false) {
            Fate::Refuse(why) => stream::once(async move { Err(injected(why)) }).boxed(),
            Fate::Proceed { .. } => self.inner.list(prefix),
        }
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.admit().await?;
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy(&self, from: &Path, to: &Path) -> Result<()> {
        self.admit().await?;
        self.inner.copy(from, to).await
    }

    async fn copy_if_not_exists(&self, from: &Path, to: &Path) -> Result<()> {
        self.admit().await?;
        self.inner.copy_if_not_exists(from, to).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn down_refuses_everything_and_up_serves_what_landed() {
        let store = FaultStore::new(1);
        let rt = runtime();
        let key = Path::from("a/seg/1");
        rt.block_on(store.put(&key, PutPayload::from_static(b"abc")))
            .unwrap();
        store.set_down(true);
        assert!(rt.block_on(store.get(&key)).is_err());
        assert!(rt
            .block_on(store.put(&key, PutPayload::from_static(b"x")))
            .is_err());
        assert!(rt.block_on(store.delete(&key)).is_err());
        let listed: Vec<_> = rt.block_on(store.list(None).collect::<Vec<_>>());
        assert!(listed.len() == 1 && listed[0].is_err());
        store.set_down(false);
        let bytes = rt.block_on(store.get_range(&key, 1..3)).unwrap();
        assert_eq!(&bytes[..], b"bc");
        assert_eq!(store.counts().refused, 4);
        assert_eq!(store.landed().len(), 1);
        store.set_down_for(Duration::from_millis(50));
        assert!(store.is_down());
        assert!(rt.block_on(store.get(&key)).is_err());
        std::thread::sleep(Duration::from_millis(60));
        assert!(!store.is_down());
        assert!(rt.block_on(store.get(&key)).is_ok());
    }

    #[test]
    fn a_lost_reply_still_lands_and_a_conditional_retry_finds_it() {
        let store = FaultStore::new(2);
        store.set_rates(FaultRates {
            lost_reply_per_mille: 1000,
            ..FaultRates::default()
        });
        let rt = runtime();
        let key = Path::from("root/1");
        let create = || PutOptions {
            mode: object_store::PutMode::Create,
            ..PutOptions::default()
        };
        let first = rt.block_on(store.put_opts(&key, PutPayload::from_static(b"r"), create()));
        assert!(first.is_err(), "the reply must be lost");
        store.set_rates(FaultRates::default());
        let retry = rt.block_on(store.put_opts(&key, PutPayload::from_static(b"r"), create()));
        assert!(
            matches!(retry, Err(object_store::Error::AlreadyExists { .. })),
            "{retry:?}"
        );
        assert_eq!(store.counts().lost_replies, 1);
    }

    #[test]
    fn a_parked_put_waits_and_lands_or_vanishes_as_released() {
        let store = FaultStore::new(3);
        for land in [true, false] {
            store.park_put(PutKind::Root, 1);
            let rt = runtime();
            let worker = {
                let store = store.clone();
                std::thread::spawn(move || {
                    let rt = runtime();
                    for number in 0..2 {
                        let key = Path::from(format!("v{land}/root/{number}"));
                        let _ = rt.block_on(store.put(&key, PutPayload::from_static(b"r")));
                    }
                })
            };
            let key = store.wait_parked(Duration::from_secs(10)).unwrap();
            assert_eq!(key, format!("v{land}/root/1"));
            assert!(store.release_parked(land));
            worker.join().unwrap();
            let there = rt
                .block_on(store.server().head(&Path::from(key.as_str())))
                .is_ok();
            assert_eq!(there, land);
        }
        let counts = store.counts();
        assert_eq!((counts.parked_landed, counts.parked_dropped), (1, 1));
    }

    #[test]
    fn random_faults_follow_the_seed() {
        let outcomes = |seed| {
            let store = FaultStore::new(seed);
            store.set_rates(FaultRates {
                fail_per_mille: 300,
                ..FaultRates::default()
            });
            let rt = runtime();
            (0..64)
                .map(|i| {
                    let key = Path::from(format!("k{i}"));
                    rt.block_on(store.put(&key, PutPayload::from_static(b"x")))
                        .is_ok()
                })
                .collect::<Vec<_>>()
        };
        let first = outcomes(7);
        assert_eq!(first, outcomes(7));
        assert_ne!(first, outcomes(8));
        let failed = first.iter().filter(|ok| !**ok).count();
        assert!((5..40).contains(&failed), "{failed} of 64 failed");
    }
}
