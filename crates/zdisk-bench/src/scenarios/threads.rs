//! `threads`: how the engine scales with threads, and how much of each
//! operation the state lock takes.
//!
//! On a real-time drive (meant for `--memory`, a RAM medium, so that the
//! engine is all there is): the first `size` bytes are filled with
//! 60 %-compressible data, then for 1, 2, 4 … threads up to the host's
//! CPUs (and 4 where it has fewer, marked oversubscribed), T threads issue
//! 4 KiB random reads over the filled region, back to back, for `seconds`
//! (after an untimed warm-up);
//! then the same thread counts issue 4 KiB random writes to it. Reads all
//! come before writes, so every read run sees the same volume.
//!
//! For each run, from `Volume::lock_profile` taken before and after (the
//! volume's own background work included): exclusive and shared lock
//! acquisitions, hold and wait nanoseconds per operation, and the
//! exclusive hold's share of an operation's time, where an operation's
//! time is thread-time per operation (T × seconds / ops). Exclusive holds
//! serialise everything; shared ones (reads whose map leaves are in RAM)
//! overlap one another. With a share s of every operation serialised,
//! Amdahl's law caps the speed-up at 1 / s however many threads run. The measured speed-up is ops/s against the
//! one-thread run of the same kind, in the same run of the benchmark.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use zdisk_core::{BlockDevice, LockProfile, Volume, BLOCK_SIZE};

use crate::drive::{Drive, DriveOptions};
use crate::driver::{self, Access, OpKind, Progress, Target, Workload};
use crate::pattern::Pattern;

use super::common::{count, logical_of, round_down, Outcome, Settings, KIB, MIB};

/// Percent of each block the writes fill with zeros.
const COMPRESSIBLE_PERCENT: u8 = 60;

/// The thread counts to run when none are given: 1, 2, then doubling up
/// to the host's CPUs, the CPU count itself, and 4 where there are fewer.
pub fn default_thread_counts(cpus: usize) -> Vec<usize> {
    let mut counts: Vec<usize> = std::iter::successors(Some(1usize), |n| Some(n * 2))
        .take_while(|&n| n <= cpus.max(2))
        .collect();
    counts.extend([cpus, 4]);
    counts.sort_unstable();
    counts.dedup();
    counts
}

fn host_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// One run's measurement.
struct Run {
    ops: u64,
    seconds: f64,
    lock: LockProfile,
}

pub fn threads(
    drive: &dyn Drive,
    settings: &Settings,
    progress: &Progress,
) -> Result<Outcome, String> {
    let mut target = drive.create(&DriveOptions::default())?;
    if target.is_virtual() {
        return Err(
            "threads measures the host's CPUs in real time: give --memory or --image, not --profile"
                .into(),
        );
    }
    let region = round_down(settings.size_bytes.min(logical_of(&target) / 2), MIB).max(MIB);
    let pattern = Pattern::Compressible {
        percent: COMPRESSIBLE_PERCENT,
    };
    let fill = Workload::new(OpKind::Write, Access::Sequential, 128 * KIB, &pattern)
        .region(0, region)
        .total(region)
        .queue_depth(4)
        .settle()
        .label("threads: fill")
        .seed(settings.seed);
    driver::run(&mut target, &fill, progress)?;
    let cpus = host_cpus();
    let counts = if settings.threads.is_empty() {
        default_thread_counts(cpus)
    } else {
        settings.threads.clone()
    };
    let seconds = settings.seconds;
    // Untimed: the first timed run must not pay for caches the fill left cold.
    measure(
        &target,
        OpKind::Read,
        1,
        region,
        (seconds / 4.0).min(1.0),
        settings.seed,
    )?;
    let mut lines = Vec::new();
    for kind in [OpKind::Read, OpKind::Write] {
        let mut one_thread_ops_s = None;
        for &threads in &counts {
            let run = measure(&target, kind, threads, region, seconds, settings.seed)?;
            let line = figures(kind, threads, cpus, &run, &mut one_thread_ops_s);
            lines.push(line);
        }
    }
    let table = table(&lines);
    let summary = summary(&lines);
    let mut json = json!({
        "scenario": "threads",
        "cpus": cpus,
        "region_bytes": region,
        "seconds": seconds,
        "results": lines,
    });
    json["summary"] = summary.clone();
    let mut out_lines: Vec<Value> = lines;
    out_lines.push(json!({
        "scenario": "threads",
        "cpus": cpus,
        "region_bytes": region,
        "seconds": seconds,
        "summary": summary,
    }));
    drop(target);
    Ok(Outcome {
        json,
        table,
        lines: out_lines,
        tables: Vec::new(),
    })
}

/// `threads` threads doing 4 KiB `kind` operations at random in
/// `0..region` for `seconds`.
fn measure(
    target: &Target,
    kind: OpKind,
    threads: usize,
    region: u64,
    seconds: f64,
    seed: u64,
) -> Result<Run, String> {
    let volume: &Volume = &target.volume;
    let stop = AtomicBool::new(false);
    // The threads and the timer start together.
    let start = Barrier::new(threads + 1);
    let slots = region / BLOCK_SIZE as u64;
    let (ops, elapsed, before, after) = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|index| {
                let (stop, start) = (&stop, &start);
                let thread_seed = seed ^ (index as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                scope.spawn(move || -> Result<u64, String> {
                    let mut rng = rand::rngs::SmallRng::seed_from_u64(thread_seed);
                    let pattern = Pattern::Compressible {
                        percent: COMPRESSIBLE_PERCENT,
                    };
                    let mut source = pattern.source(thread_seed);
                    let mut buf = vec![0u8; BLOCK_SIZE];
                    let mut done = 0u64;
                    start.wait();
                    while !stop.load(Ordering::Relaxed) {
                        let offset = rng.gen_range(0..slots) * BLOCK_SIZE as u64;
                        match kind {
                            OpKind::Read => volume
                                .read(offset, &mut buf)
                                .map_err(|e| format!("read at {offset}: {e}"))?,
                            OpKind::Write => {
                                source.fill(&mut buf);
                                volume
                                    .write(offset, &buf, false)
                                    .map_err(|e| format!("write at {offset}: {e}"))?
                            }
                        }
                        done += 1;
                    }
                    Ok(done)
                })
            })
            .collect();
        let before = volume.lock_profile();
        start.wait();
        let started = Instant::now();
        std::thread::sleep(Duration::from_secs_f64(seconds));
        stop.store(true, Ordering::Relaxed);
        let mut ops = 0u64;
        let mut failure = None;
        for worker in workers {
            match worker.join() {
                Ok(Ok(done)) => ops += done,
                Ok(Err(error)) => failure = Some(error),
                Err(_) => failure = Some("a benchmark thread panicked".to_string()),
            }
        }
        let elapsed = started.elapsed().as_secs_f64();
        let after = volume.lock_profile();
        match failure {
            Some(error) => Err(error),
            None => Ok((ops, elapsed, before, after)),
        }
    })?;
    if kind == OpKind::Write {
        // What the writes left queued is written before the next run, so
        // no run inherits another's work.
        BlockDevice::flush(volume).map_err(|e| format!("flush: {e}"))?;
    }
    Ok(Run {
        ops,
        seconds: elapsed,
        lock: after.since(&before),
    })
}

/// One run as a JSON object; `one_thread_ops_s` is the one-thread run of
/// the same kind (set by it, if it comes first).
fn figures(
    kind: OpKind,
    threads: usize,
    cpus: usize,
    run: &Run,
    one_thread_ops_s: &mut Option<f64>,
) -> Value {
    let ops = run.ops.max(1) as f64;
    let ops_s = run.ops as f64 / run.seconds;
    if threads == 1 {
        *one_thread_ops_s = Some(ops_s);
    }
    let op_ns = threads as f64 * run.seconds * 1e9 / ops;
    let hold_ns_per_op = run.lock.hold_nanos as f64 / ops;
    // Only exclusive holds serialise; shared ones overlap one another.
    let share = hold_ns_per_op / op_ns;
    json!({
        "scenario": "threads",
        "op": match kind { OpKind::Read => "read", OpKind::Write => "write" },
        "block_bytes": BLOCK_SIZE,
        "threads": threads,
        "oversubscribed": threads > cpus,
        "ops": run.ops,
        "seconds": run.seconds,
        "ops_per_s": ops_s,
        "speedup": one_thread_ops_s.map(|one| ops_s / one),
        "op_ns": op_ns,
        "lock_acquisitions_per_op": run.lock.acquisitions as f64 / ops,
        "lock_hold_ns_per_op": hold_ns_per_op,
        "lock_wait_ns_per_op": run.lock.wait_nanos as f64 / ops,
        "shared_lock_acquisitions_per_op": run.lock.shared_acquisitions as f64 / ops,
        "shared_lock_hold_ns_per_op": run.lock.shared_hold_nanos as f64 / ops,
        "shared_lock_wait_ns_per_op": run.lock.shared_wait_nanos as f64 / ops,
        "lock_share": share,
        "amdahl_ceiling": (share > 0.0).then(|| 1.0 / share),
    })
}

fn table(lines: &[Value]) -> Vec<Vec<String>> {
    let header = [
        "op",
        "threads",
        "ops/s",
        "speed-up",
        "excl/op",
        "hold ns",
        "wait ns",
        "shared/op",
        "hold ns",
        "wait ns",
        "op ns",
        "excl share",
        "ceiling",
    ];
    let mut rows = vec![header.iter().map(|s| s.to_string()).collect::<Vec<_>>()];
    for line in lines {
        let float = |key: &str| line[key].as_f64().unwrap_or(f64::NAN);
        let threads = line["threads"].as_u64().unwrap_or(0);
        let oversubscribed = line["oversubscribed"].as_bool() == Some(true);
        rows.push(vec![
            line["op"].as_str().unwrap_or("?").to_string(),
            if oversubscribed {
                format!("{threads} (oversubscribed)")
            } else {
                threads.to_string()
            },
            count(float("ops_per_s")),
            line["speedup"]
                .as_f64()
                .map_or("-".into(), |v| format!("{v:.2}x")),
            format!("{:.2}", float("lock_acquisitions_per_op")),
            format!("{:.0}", float("lock_hold_ns_per_op")),
            format!("{:.0}", float("lock_wait_ns_per_op")),
            format!("{:.2}", float("shared_lock_acquisitions_per_op")),
            format!("{:.0}", float("shared_lock_hold_ns_per_op")),
            format!("{:.0}", float("shared_lock_wait_ns_per_op")),
            format!("{:.0}", float("op_ns")),
            format!("{:.1}%", float("lock_share") * 100.0),
            line["amdahl_ceiling"].as_f64().map_or("-".into(), |v| {
                if v >= 1000.0 {
                    ">999x".into()
                } else {
                    format!("{v:.1}x")
                }
            }),
        ]);
    }
    rows
}

/// The figures: per kind, the speed-up from 1 to 2 threads and the
/// ceiling the one-thread run's lock share implies.
fn summary(lines: &[Value]) -> Value {
    let find = |op: &str, threads: u64| {
        lines
            .iter()
            .find(|l| l["op"] == op && l["threads"].as_u64() == Some(threads))
    };
    let mut summary = serde_json::Map::new();
    for op in ["read", "write"] {
        let one = find(op, 1);
        let two = find(op, 2);
        summary.insert(
            format!("{op}_speedup_1_to_2"),
            two.map_or(Value::Null, |two| two["speedup"].clone()),
        );
        summary.insert(
            format!("{op}_amdahl_ceiling_1_thread"),
            one.map_or(Value::Null, |one| one["amdahl_ceiling"].clone()),
        );
    }
    Value::Object(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_counts_double_to_the_cpus_and_reach_four() {
        assert_eq!(default_thread_counts(1), vec![1, 2, 4]);
        assert_eq!(default_thread_counts(2), vec![1, 2, 4]);
        assert_eq!(default_thread_counts(6), vec![1, 2, 4, 6]);
        assert_eq!(default_thread_counts(16), vec![1, 2, 4, 8, 16]);
    }

    #[test]
    fn share_and_ceiling_follow_from_the_counters() {
        let run = Run {
            ops: 1_000,
            seconds: 1.0,
            lock: LockProfile {
                acquisitions: 1_000,
                hold_nanos: 50_000_000,
                wait_nanos: 0,
                shared_acquisitions: 1_000,
                shared_hold_nanos: 400_000_000,
                shared_wait_nanos: 0,
            },
        };
        let mut one = None;
        let line = figures(OpKind::Read, 1, 2, &run, &mut one);
        // 1 ms of thread time per op, 50 µs of it under the lock: 5 %.
        assert_eq!(line["op_ns"].as_f64(), Some(1e6));
        assert_eq!(line["lock_share"].as_f64(), Some(0.05));
        assert_eq!(line["amdahl_ceiling"].as_f64(), Some(20.0));
        // Shared holds are shown, but do not count towards the share.
        assert_eq!(line["shared_lock_hold_ns_per_op"].as_f64(), Some(400_000.0));
        assert_eq!(line["speedup"].as_f64(), Some(1.0));
        let two = figures(OpKind::Read, 2, 2, &run, &mut one);
        assert_eq!(two["speedup"].as_f64(), Some(1.0));
        assert_eq!(two["lock_share"].as_f64(), Some(0.025));
    }
}
