//! A YCSB-style driver: the core workloads A, B, C, D and F over any
//! [`Engine`], with YCSB's key choosers (scrambled zipfian, latest), so
//! the store and RocksDB see the same keys, values, mix and threads.
//!
//! - Keys: 16 bytes, `user` and 12 hex digits of a bijection of the record
//!   number on 48 bits (inserts scatter over the key space, as YCSB's
//!   hashed inserts do).
//! - Values: 384 bytes (pairs of 400 B): 192 random bytes and the same 192
//!   again, so a compressor can halve them, as db_bench's default
//!   `--compression_ratio=0.5` values can be. Fresh random bytes per write.
//! - A: 50 % read, 50 % update. B: 95/5. C: 100 % read. D: 95 % read,
//!   5 % insert, reads favour the newest records. F: 50 % read, 50 %
//!   read-modify-write. Zipfian constant 0.99; A, B, C and F scramble
//!   the zipfian rank over the key space as YCSB does.
//! - Latency per operation (a read-modify-write counts once), into a
//!   log-linear histogram (1/64 relative precision).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

/// Bytes of a key.
pub const KEY_BYTES: usize = 16;
/// Bytes of a value.
pub const VALUE_BYTES: usize = 384;
/// YCSB's zipfian constant.
pub const ZIPFIAN_THETA: f64 = 0.99;

/// What the driver runs against.
pub trait Engine: Sync {
    /// The value of `key`, whether found.
    fn read(&self, key: &[u8]) -> Result<bool, String>;
    fn write(&self, key: &[u8], value: &[u8]) -> Result<(), String>;
    /// Makes what was written durable and lets background work settle
    /// before space is measured (the store flushes; RocksDB flushes its
    /// memtable).
    fn settle(&self) -> Result<(), String>;
    /// The engine's own counters, cumulative, for the report.
    fn counters(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
}

impl<D: crate::device::SlotDevice> Engine for crate::store::Store<D> {
    fn read(&self, key: &[u8]) -> Result<bool, String> {
        self.get(key)
            .map(|value| value.is_some())
            .map_err(|e| e.to_string())
    }

    fn write(&self, key: &[u8], value: &[u8]) -> Result<(), String> {
        self.put(key, value).map_err(|e| e.to_string())
    }

    fn settle(&self) -> Result<(), String> {
        self.flush().map_err(|e| e.to_string())
    }

    fn counters(&self) -> serde_json::Value {
        serde_json::to_value(self.stats()).unwrap_or_default()
    }
}

/// The workloads, by YCSB's letters, plus the initial load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    Load,
    A,
    B,
    C,
    D,
    F,
}

impl Workload {
    pub fn parse(name: &str) -> Option<Workload> {
        match name.to_ascii_uppercase().as_str() {
            "LOAD" => Some(Workload::Load),
            "A" => Some(Workload::A),
            "B" => Some(Workload::B),
            "C" => Some(Workload::C),
            "D" => Some(Workload::D),
            "F" => Some(Workload::F),
            _ => None,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Workload::Load => "load",
            Workload::A => "A",
            Workload::B => "B",
            Workload::C => "C",
            Workload::D => "D",
            Workload::F => "F",
        }
    }

    /// Share of reads; the rest are updates (A, B), inserts (D) or
    /// read-modify-writes (F).
    fn read_share(&self) -> f64 {
        match self {
            Workload::Load => 0.0,
            Workload::A | Workload::F => 0.5,
            Workload::B | Workload::D => 0.95,
            Workload::C => 1.0,
        }
    }
}

/// A bijection on 48 bits (xorshift-multiply steps with odd multipliers).
fn mix48(mut x: u64) -> u64 {
    const MASK: u64 = (1 << 48) - 1;
    x &= MASK;
    x ^= x >> 23;
    x = x.wrapping_mul(0x9E37_79B9_7F4B) & MASK;
    x ^= x >> 21;
    x = x.wrapping_mul(0xC2B2_AE3D_27D5) & MASK;
    x ^ (x >> 24)
}

/// The key of record number `id`.
pub fn key_of(id: u64) -> [u8; KEY_BYTES] {
    let mut key = [0u8; KEY_BYTES];
    let text = format!("user{:012x}", mix48(id));
    key.copy_from_slice(text.as_bytes());
    key
}

/// A fresh value: half random, half its repeat.
pub fn fill_value(rng: &mut SmallRng, value: &mut [u8; VALUE_BYTES]) {
    let (first, second) = value.split_at_mut(VALUE_BYTES / 2);
    rng.fill_bytes(first);
    second.copy_from_slice(first);
}

/// YCSB's zipfian generator over ranks 0..items (Gray et al.'s method).
pub struct Zipfian {
    items: u64,
    alpha: f64,
    zeta_n: f64,
    eta: f64,
    half_pow_theta: f64,
}

impl Zipfian {
    pub fn new(items: u64) -> Zipfian {
        assert!(items >= 1);
        let theta = ZIPFIAN_THETA;
        let zeta = |n: u64| (1..=n).map(|i| 1.0 / (i as f64).powf(theta)).sum::<f64>();
        let zeta_n = zeta(items);
        let zeta_2 = zeta(2.min(items));
        Zipfian {
            items,
            alpha: 1.0 / (1.0 - theta),
            zeta_n,
            eta: (1.0 - (2.0 / items as f64).powf(1.0 - theta)) / (1.0 - zeta_2 / zeta_n),
            half_pow_theta: 1.0 + 0.5f64.powf(theta),
        }
    }

    /// A rank; 0 is the most popular.
    pub fn next(&self, rng: &mut SmallRng) -> u64 {
        let u: f64 = rng.gen();
        let uz = u * self.zeta_n;
        if uz < 1.0 {
            return 0;
        }
        if uz < self.half_pow_theta {
            return 1.min(self.items - 1);
        }
        let rank = (self.items as f64 * (self.eta * u - self.eta + 1.0).powf(self.alpha)) as u64;
        rank.min(self.items - 1)
    }
}

/// A log-linear latency histogram in nanoseconds.
#[derive(Clone)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
    sum_ns: u128,
}

const SUB_BUCKETS: u64 = 64;

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: vec![0; 64 * SUB_BUCKETS as usize],
            total: 0,
            sum_ns: 0,
        }
    }
}

impl Histogram {
    fn bucket(ns: u64) -> usize {
        if ns < SUB_BUCKETS {
            return ns as usize;
        }
        let magnitude = 63 - ns.leading_zeros() as u64; // >= 6
        let shift = magnitude - 6;
        let sub = (ns >> shift) - SUB_BUCKETS; // 0..64
        ((magnitude - 5) * SUB_BUCKETS + sub) as usize
    }

    /// The upper end of a bucket, in nanoseconds.
    fn bucket_top(index: usize) -> u64 {
        let index = index as u64;
        if index < SUB_BUCKETS {
            return index;
        }
        let magnitude = index / SUB_BUCKETS + 5;
        let sub = index % SUB_BUCKETS;
        let shift = magnitude - 6;
        ((SUB_BUCKETS + sub + 1) << shift) - 1
    }

    pub fn record(&mut self, elapsed: Duration) {
        let ns = elapsed.as_nanos().min(u64::MAX as u128) as u64;
        self.counts[Self::bucket(ns)] += 1;
        self.total += 1;
        self.sum_ns += u128::from(ns);
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (mine, theirs) in self.counts.iter_mut().zip(&other.counts) {
            *mine += theirs;
        }
        self.total += other.total;
        self.sum_ns += other.sum_ns;
    }

    pub fn count(&self) -> u64 {
        self.total
    }

    /// The latency below which `quantile` of operations fell, in µs.
    pub fn quantile_us(&self, quantile: f64) -> f64 {
        if self.total == 0 {
            return 0.0;
        }
        let wanted = ((self.total as f64 * quantile).ceil() as u64).max(1);
        let mut seen = 0;
        for (index, &count) in self.counts.iter().enumerate() {
            seen += count;
            if seen >= wanted {
                return Self::bucket_top(index) as f64 / 1000.0;
            }
        }
        unreachable!("the counts sum to the total")
    }

    pub fn mean_us(&self) -> f64 {
        if self.total == 0 {
            return 0.0;
        }
        self.sum_ns as f64 / self.total as f64 / 1000.0
    }
}

/// How a phase runs.
#[derive(Debug, Clone, Copy)]
pub struct PhaseConfig {
    pub workload: Workload,
    /// Records loaded (ids 0..records) before the run phases.
    pub records: u64,
    pub threads: usize,
    /// Run phases stop after this long (the load runs to its end).
    pub duration: Duration,
    pub seed: u64,
}

/// What a phase did.
#[derive(Clone)]
pub struct PhaseResult {
    pub operations: u64,
    pub reads: u64,
    pub reads_found: u64,
    pub elapsed: Duration,
    pub latency: Histogram,
}

/// Records inserted so far (grows in D); shared across phases.
pub struct KeySpace {
    inserted: AtomicU64,
}

impl KeySpace {
    pub fn new(records: u64) -> KeySpace {
        KeySpace {
            inserted: AtomicU64::new(records),
        }
    }

    pub fn inserted(&self) -> u64 {
        self.inserted.load(Ordering::Relaxed)
    }
}

/// Runs one phase on `threads` threads.
pub fn run_phase(
    engine: &dyn Engine,
    keys: &KeySpace,
    zipfian: &Zipfian,
    config: PhaseConfig,
) -> Result<PhaseResult, String> {
    let start = Instant::now();
    let deadline = start + config.duration;
    let next_load = AtomicU64::new(0);
    let results: Vec<Result<(Histogram, u64, u64), String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..config.threads)
            .map(|thread| {
                let next_load = &next_load;
                scope.spawn(move || {
                    let mut rng =
                        SmallRng::seed_from_u64(config.seed ^ ((thread as u64 + 1) * 0x9E37_79B9));
                    let mut histogram = Histogram::default();
                    let mut value = [0u8; VALUE_BYTES];
                    let (mut reads, mut found) = (0u64, 0u64);
                    if config.workload == Workload::Load {
                        loop {
                            let id = next_load.fetch_add(1, Ordering::Relaxed);
                            if id >= config.records {
                                break;
                            }
                            fill_value(&mut rng, &mut value);
                            let began = Instant::now();
                            engine.write(&key_of(id), &value)?;
                            histogram.record(began.elapsed());
                        }
                        return Ok((histogram, 0, 0));
                    }
                    while Instant::now() < deadline {
                        let read = rng.gen_bool(config.workload.read_share());
                        let inserted = keys.inserted();
                        let rank = zipfian.next(&mut rng);
                        let id = if config.workload == Workload::D {
                            // Latest: rank 0 is the newest record.
                            inserted - 1 - rank.min(inserted - 1)
                        } else {
                            mix48(rank) % config.records
                        };
                        let key = key_of(id);
                        let began = Instant::now();
                        if read {
                            reads += 1;
                            found += u64::from(engine.read(&key)?);
                        } else {
                            fill_value(&mut rng, &mut value);
                            match config.workload {
                                Workload::D => {
                                    let id = keys.inserted.fetch_add(1, Ordering::Relaxed);
                                    engine.write(&key_of(id), &value)?;
                                }
                                Workload::F => {
                                    reads += 1;
                                    found += u64::from(engine.read(&key)?);
                                    engine.write(&key, &value)?;
                                }
                                _ => engine.write(&key, &value)?,
                            }
                        }
                        histogram.record(began.elapsed());
                    }
                    Ok((histogram, reads, found))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| {
                handle
                    .join()
                    .unwrap_or_else(|_| Err("a client thread panicked".into()))
            })
            .collect()
    });
    let elapsed = start.elapsed();
    let mut latency = Histogram::default();
    let (mut reads, mut reads_found) = (0, 0);
    for result in results {
        let (histogram, r, f) = result?;
        latency.merge(&histogram);
        reads += r;
        reads_found += f;
    }
    Ok(PhaseResult {
        operations: latency.count(),
        reads,
        reads_found,
        elapsed,
        latency,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::Mutex;

    #[test]
    fn keys_are_distinct_and_sixteen_bytes() {
        let mut seen = std::collections::HashSet::new();
        for id in 0..200_000 {
            assert!(seen.insert(key_of(id)), "key {id} repeats");
        }
        assert_eq!(&key_of(0)[..4], b"user");
    }

    #[test]
    fn zipfian_favours_low_ranks() {
        let zipfian = Zipfian::new(100_000);
        let mut rng = SmallRng::seed_from_u64(1);
        let draws = 200_000;
        let mut top10 = 0;
        for _ in 0..draws {
            let rank = zipfian.next(&mut rng);
            assert!(rank < 100_000);
            if rank < 10 {
                top10 += 1;
            }
        }
        // With theta 0.99 over 1e5 items the top 10 take about 24 %.
        let share = top10 as f64 / draws as f64;
        assert!((0.18..0.30).contains(&share), "top-10 share {share}");
    }

    #[test]
    fn histogram_quantiles_are_within_its_precision() {
        let mut histogram = Histogram::default();
        for us in 1..=1000u64 {
            histogram.record(Duration::from_micros(us));
        }
        let p99 = histogram.quantile_us(0.99);
        assert!((990.0..=990.0 * 1.02).contains(&p99), "p99 {p99}");
        let p50 = histogram.quantile_us(0.5);
        assert!((500.0..=510.0).contains(&p50), "p50 {p50}");
        assert!((histogram.mean_us() - 500.5).abs() < 0.01);
    }

    struct MapEngine(Mutex<HashMap<Vec<u8>, Vec<u8>>>);

    impl Engine for MapEngine {
        fn read(&self, key: &[u8]) -> Result<bool, String> {
            Ok(self.0.lock().unwrap().contains_key(key))
        }
        fn write(&self, key: &[u8], value: &[u8]) -> Result<(), String> {
            assert_eq!(value.len(), VALUE_BYTES);
            self.0.lock().unwrap().insert(key.to_vec(), value.to_vec());
            Ok(())
        }
        fn settle(&self) -> Result<(), String> {
            Ok(())
        }
    }

    #[test]
    fn phases_load_then_read_what_was_loaded() {
        let engine = MapEngine(Mutex::new(HashMap::new()));
        let keys = KeySpace::new(5000);
        let zipfian = Zipfian::new(5000);
        let mut config = PhaseConfig {
            workload: Workload::Load,
            records: 5000,
            threads: 2,
            duration: Duration::from_millis(50),
            seed: 7,
        };
        let load = run_phase(&engine, &keys, &zipfian, config).unwrap();
        assert_eq!(load.operations, 5000);
        assert_eq!(engine.0.lock().unwrap().len(), 5000);
        for workload in [Workload::C, Workload::D, Workload::F] {
            config.workload = workload;
            let run = run_phase(&engine, &keys, &zipfian, config).unwrap();
            assert!(run.operations > 0);
            // D may read a record another thread has numbered but not yet
            // written: allow a sliver.
            assert!(
                run.reads_found * 100 >= run.reads * 99,
                "{workload:?} missed keys"
            );
        }
        assert!(keys.inserted() > 5000, "D inserted nothing");
        assert_eq!(engine.0.lock().unwrap().len() as u64, keys.inserted());
    }
}
