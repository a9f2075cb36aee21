//! Running a workload against a drive, in real or virtual time.
//!
//! Real time: `queue_depth` threads issue operations back to back and the
//! wall clock is the measure; the volume's own background thread cleans.
//! A write phase runs between two flushes and the closing one is timed, so
//! its figure is durable throughput, not the host page cache's.
//!
//! Virtual time: one thread plays a closed queue of `queue_depth` slots.
//! Each operation is issued when a slot frees, at that slot's virtual
//! time, and the emulated drive says when it completes; its resources
//! (dies, channels, link, compressor) stay busy in between, so concurrency
//! and contention come out of the model. Between operations the harness
//! runs the volume's background work at the current virtual time, as a
//! drive's controller would. Host CPU speed never enters the figures.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};

use zdisk_core::clock::VirtualTime;
use zdisk_core::{BlockDevice, Stats, Volume, BLOCK_SIZE};

use crate::pattern::Pattern;

/// A volume under test, with its notion of time.
pub struct Target {
    pub volume: Arc<Volume>,
    /// The drive's virtual timeline, or `None` in real time.
    pub virtual_time: Option<Arc<dyn VirtualTime>>,
    /// Virtual time reached so far (virtual clock only).
    pub now_ns: u64,
    /// Extra figures a drive model reports (NAND counters), refreshed by `details`.
    pub details: Option<Box<dyn Fn() -> serde_json::Value + Send + Sync>>,
}

impl Target {
    /// A volume on a real medium, driven in real time.
    pub fn real(volume: Arc<Volume>) -> Target {
        Target {
            volume,
            virtual_time: None,
            now_ns: 0,
            details: None,
        }
    }

    pub fn is_virtual(&self) -> bool {
        self.virtual_time.is_some()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Write,
    Read,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Sequential,
    Random,
    /// `hot_percent` of the writes go to the first `hot_space_percent` of
    /// the region, the rest anywhere else in it (a skewed, hot/cold load).
    HotCold {
        hot_percent: u8,
        hot_space_percent: u8,
    },
}

/// What to run.
#[derive(Debug, Clone)]
pub struct Workload {
    pub kind: OpKind,
    pub access: Access,
    pub block_bytes: u64,
    /// Byte range the operations fall in.
    pub region_start: u64,
    pub region_bytes: u64,
    pub total_bytes: u64,
    pub queue_depth: usize,
    pub pattern: Pattern,
    /// Flush after every write (the flush belongs to the same operation).
    pub flush_each_write: bool,
    /// Real time: after the closing flush, run the volume's pending
    /// background work (cleaning up to its high watermark, a due
    /// checkpoint) to the end, timed, so that work a phase caused is
    /// charged to that phase and not to whatever runs next.
    pub settle: bool,
    /// Writes copy data from a source device read at QD1 at this rate
    /// (bytes per second), into `queue_depth + 1` buffers: a write waits
    /// until the source has read its block, and the source waits for a
    /// free buffer (`None`: the data is at hand, as from RAM).
    pub source_bytes_per_sec: Option<u64>,
    pub seed: u64,
    /// Shown in progress lines.
    pub label: String,
}

impl Workload {
    /// A workload of `kind` operations of `block_bytes` each; set the
    /// region, amount and queue depth with the builder methods.
    pub fn new(kind: OpKind, access: Access, block_bytes: u64, pattern: &Pattern) -> Workload {
        Workload {
            kind,
            access,
            block_bytes,
            region_start: 0,
            region_bytes: block_bytes,
            total_bytes: block_bytes,
            queue_depth: 1,
            pattern: pattern.clone(),
            flush_each_write: false,
            settle: false,
            source_bytes_per_sec: None,
            seed: 0,
            label: String::new(),
        }
    }

    /// Operations fall in `start..start + bytes`.
    pub fn region(mut self, start: u64, bytes: u64) -> Workload {
        self.region_start = start;
        self.region_bytes = bytes;
        self
    }

    pub fn total(mut self, bytes: u64) -> Workload {
        self.total_bytes = bytes;
        self
    }

    pub fn queue_depth(mut self, depth: usize) -> Workload {
        self.queue_depth = depth;
        self
    }

    pub fn label(mut self, label: impl Into<String>) -> Workload {
        self.label = label.into();
        self
    }

    pub fn seed(mut self, seed: u64) -> Workload {
        self.seed = seed;
        self
    }

    pub fn flush_each_write(mut self) -> Workload {
        self.flush_each_write = true;
        self
    }

    pub fn settle(mut self) -> Workload {
        self.settle = true;
        self
    }

    /// Writes copy from a source read at `bytes_per_sec` (`None`: unlimited).
    pub fn source(mut self, bytes_per_sec: Option<u64>) -> Workload {
        self.source_bytes_per_sec = bytes_per_sec;
        self
    }

    /// Nanoseconds the source takes to read one block (0: no source).
    fn source_block_ns(&self) -> u64 {
        self.source_bytes_per_sec.map_or(0, |rate| {
            (self.block_bytes as u128 * 1_000_000_000).div_ceil(rate.max(1) as u128) as u64
        })
    }
}

/// The source of a copy: reads blocks one at a time (QD1) into a ring of
/// buffers, each freed when the write of its block completes.
struct Source {
    block_ns: u64,
    buffers: usize,
    /// Completion times of the last `buffers` writes, oldest first.
    written: VecDeque<u64>,
    /// When the source finished reading its latest block.
    read_done: u64,
}

impl Source {
    fn new(workload: &Workload, start: u64) -> Source {
        Source {
            block_ns: workload.source_block_ns(),
            buffers: workload.queue_depth.max(1) + 1,
            written: VecDeque::new(),
            read_done: start,
        }
    }

    /// When the next block is in a buffer, ready to be written.
    fn next_ready(&mut self) -> u64 {
        if self.block_ns == 0 {
            return self.read_done;
        }
        let buffer_free = if self.written.len() == self.buffers {
            self.written.pop_front().expect("a full ring")
        } else {
            self.read_done
        };
        self.read_done = self.read_done.max(buffer_free) + self.block_ns;
        self.read_done
    }

    /// The write of the block handed out by the matching `next_ready` ended.
    fn written(&mut self, done: u64) {
        if self.block_ns > 0 {
            self.written.push_back(done);
        }
    }
}

/// What a run measured.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Measured {
    pub ops: u64,
    pub bytes: u64,
    pub seconds: f64,
    pub mb_s: f64,
    pub iops: f64,
    /// Mean latency of an operation (queueing included).
    pub latency_us: f64,
    pub host_write_bytes: u64,
    pub media_write_bytes: u64,
    pub padding_bytes: u64,
    pub gc_write_bytes: u64,
    /// media / host write bytes during the run.
    pub write_amplification: Option<f64>,
}

impl Measured {
    /// Several runs taken together: amounts and times add up, rates and
    /// the write amplification are those of the whole.
    pub fn sum(parts: &[Measured]) -> Measured {
        let mut total = Measured::default();
        let mut latency_total_ns = 0.0;
        for part in parts {
            total.ops += part.ops;
            total.bytes += part.bytes;
            total.seconds += part.seconds;
            latency_total_ns += part.latency_us * 1e3 * part.ops as f64;
            total.host_write_bytes += part.host_write_bytes;
            total.media_write_bytes += part.media_write_bytes;
            total.padding_bytes += part.padding_bytes;
            total.gc_write_bytes += part.gc_write_bytes;
        }
        total.rates(latency_total_ns)
    }

    fn finish(mut self, before: &Stats, after: &Stats, latency_total_ns: f64) -> Measured {
        self.host_write_bytes = after.host_write_bytes - before.host_write_bytes;
        self.media_write_bytes = after.media_write_bytes - before.media_write_bytes;
        self.padding_bytes = after.padding_bytes - before.padding_bytes;
        self.gc_write_bytes = after.gc_write_bytes - before.gc_write_bytes;
        self.rates(latency_total_ns)
    }

    /// Fills in the rates from the amounts and the time.
    fn rates(mut self, latency_total_ns: f64) -> Measured {
        // An emulated drive may do work in no modelled time at all (FEMU's
        // profile has no link and no command cost, and zeros need no
        // programs): that rate is unbounded, not zero. JSON shows it as null.
        let per_second = |amount: f64| {
            if self.seconds > 0.0 {
                amount / self.seconds
            } else if amount > 0.0 {
                f64::INFINITY
            } else {
                0.0
            }
        };
        self.mb_s = per_second(self.bytes as f64) / 1e6;
        self.iops = per_second(self.ops as f64);
        self.latency_us = if self.ops > 0 {
            latency_total_ns / self.ops as f64 / 1e3
        } else {
            0.0
        };
        self.write_amplification = (self.host_write_bytes > 0)
            .then(|| self.media_write_bytes as f64 / self.host_write_bytes as f64);
        self
    }
}

/// Prints progress for runs longer than a second, on one line on a terminal.
pub struct Progress {
    started: Instant,
    last: Mutex<Instant>,
    tty: bool,
    enabled: bool,
}

impl Progress {
    pub fn new(enabled: bool) -> Progress {
        Progress {
            started: Instant::now(),
            last: Mutex::new(Instant::now()),
            tty: std::io::stderr().is_terminal(),
            enabled,
        }
    }

    pub fn update(&self, label: &str, done: u64, total: u64, run_started: Instant) {
        if !self.enabled {
            return;
        }
        let mut last = self.last.lock().expect("progress lock");
        let now = Instant::now();
        let interval = if self.tty {
            Duration::from_millis(200)
        } else {
            Duration::from_secs(5)
        };
        if now.duration_since(run_started) < Duration::from_secs(1)
            || now.duration_since(*last) < interval
        {
            return;
        }
        *last = now;
        let percent = 100.0 * done as f64 / total.max(1) as f64;
        let mut err = std::io::stderr();
        if self.tty {
            let _ = write!(
                err,
                "\r  {label}: {percent:5.1}% ({:.0} s elapsed)   ",
                self.started.elapsed().as_secs_f64()
            );
        } else {
            let _ = writeln!(err, "  {label}: {percent:.0}%");
        }
    }

    pub fn done(&self, run_started: Instant) {
        if self.enabled && self.tty && run_started.elapsed() >= Duration::from_secs(1) {
            let _ = write!(std::io::stderr(), "\r{:70}\r", "");
        }
    }
}

fn offset_of(workload: &Workload, index: u64, rng: &mut rand::rngs::SmallRng) -> u64 {
    let slots = (workload.region_bytes / workload.block_bytes).max(1);
    let slot = match workload.access {
        Access::Sequential => index % slots,
        Access::Random => rng.gen_range(0..slots),
        Access::HotCold {
            hot_percent,
            hot_space_percent,
        } => {
            let hot = (slots * hot_space_percent as u64 / 100).clamp(1, slots - 1);
            if rng.gen_range(0..100) < hot_percent as u32 {
                rng.gen_range(0..hot)
            } else {
                rng.gen_range(hot..slots)
            }
        }
    };
    workload.region_start + slot * workload.block_bytes
}

fn do_op(
    volume: &Volume,
    workload: &Workload,
    offset: u64,
    buf: &mut [u8],
    source: &mut crate::pattern::BlockSource,
) -> Result<(), String> {
    match workload.kind {
        OpKind::Write => {
            source.fill(buf);
            volume
                .write(offset, buf, false)
                .map_err(|e| format!("write at {offset}: {e}"))?;
            if workload.flush_each_write {
                BlockDevice::flush(volume).map_err(|e| format!("flush: {e}"))?;
            }
        }
        OpKind::Read => volume
            .read(offset, buf)
            .map_err(|e| format!("read at {offset}: {e}"))?,
    }
    Ok(())
}

/// Runs `workload` on `target` and measures it.
pub fn run(
    target: &mut Target,
    workload: &Workload,
    progress: &Progress,
) -> Result<Measured, String> {
    assert!(workload.block_bytes > 0 && workload.block_bytes.is_multiple_of(BLOCK_SIZE as u64));
    let ops = (workload.total_bytes / workload.block_bytes).max(1);
    let before = target.volume.stats();
    let started = Instant::now();
    let (seconds, latency_total_ns) = match &target.virtual_time {
        Some(clock) => run_virtual(
            target.volume.clone(),
            clock.clone(),
            &mut target.now_ns,
            workload,
            ops,
            progress,
        )?,
        None => run_real(&target.volume, workload, ops, progress)?,
    };
    progress.done(started);
    let after = target.volume.stats();
    let measured = Measured {
        ops,
        bytes: ops * workload.block_bytes,
        seconds,
        ..Measured::default()
    };
    Ok(measured.finish(&before, &after, latency_total_ns))
}

fn run_virtual(
    volume: Arc<Volume>,
    clock: Arc<dyn VirtualTime>,
    now_ns: &mut u64,
    workload: &Workload,
    ops: u64,
    progress: &Progress,
) -> Result<(f64, f64), String> {
    let started = Instant::now();
    let start = *now_ns;
    let mut slots: BinaryHeap<Reverse<u64>> = (0..workload.queue_depth.max(1))
        .map(|_| Reverse(start))
        .collect();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(workload.seed);
    let mut source = workload.pattern.source(workload.seed);
    let mut buf = vec![0u8; workload.block_bytes as usize];
    let mut last = start;
    let mut latency_total = 0.0;
    let mut copy_source = Source::new(workload, start);
    for index in 0..ops {
        let Reverse(slot_free) = slots.pop().expect("queue depth is at least 1");
        let issue = slot_free.max(copy_source.next_ready());
        // The controller's background work runs when it has a moment.
        clock.begin_op(issue);
        let _ = volume.maintenance_tick();
        clock.end_op();
        clock.begin_op(issue);
        let offset = offset_of(workload, index, &mut rng);
        let result = do_op(&volume, workload, offset, &mut buf, &mut source);
        let done = clock.end_op().max(issue);
        result?;
        latency_total += (done - issue) as f64;
        last = last.max(done);
        copy_source.written(done);
        slots.push(Reverse(done));
        progress.update(&workload.label, index + 1, ops, started);
    }
    *now_ns = last;
    Ok(((last - start) as f64 / 1e9, latency_total))
}

fn run_real(
    volume: &Arc<Volume>,
    workload: &Workload,
    ops: u64,
    progress: &Progress,
) -> Result<(f64, f64), String> {
    // The host page cache holds gigabytes where a drive's write buffer
    // holds megabytes. So a write phase starts clean (an untimed flush
    // writes back what earlier phases left) and ends durable (its closing
    // flush is timed): no phase is flattered by the cache or charged for
    // another's writeback.
    let writes = workload.kind == OpKind::Write;
    if writes {
        BlockDevice::flush(volume.as_ref()).map_err(|e| format!("flush: {e}"))?;
    }
    let started = Instant::now();
    let latency_ns = if workload.source_bytes_per_sec.is_some() {
        copy_real(volume, workload, ops, progress, started)?
    } else {
        run_real_threads(volume, workload, ops, progress, started)?
    };
    if writes {
        BlockDevice::flush(volume.as_ref()).map_err(|e| format!("flush: {e}"))?;
    }
    if workload.settle {
        settle(volume)?;
    }
    Ok((started.elapsed().as_secs_f64(), latency_ns as f64))
}

/// A copy in real time: one thread writes each block once the source
/// would have read it, sleeping until then. No thread plays the source:
/// its schedule follows from its rate and the writes' completion times.
/// The writes run at QD1 whatever `queue_depth` says.
fn copy_real(
    volume: &Volume,
    workload: &Workload,
    ops: u64,
    progress: &Progress,
    started: Instant,
) -> Result<u64, String> {
    let one = Workload {
        queue_depth: 1,
        ..workload.clone()
    };
    let mut copy_source = Source::new(&one, 0);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(workload.seed);
    let mut source = workload.pattern.source(workload.seed);
    let mut buf = vec![0u8; workload.block_bytes as usize];
    let mut latency_ns = 0;
    for index in 0..ops {
        let ready = Duration::from_nanos(copy_source.next_ready());
        if let Some(wait) = ready.checked_sub(started.elapsed()) {
            std::thread::sleep(wait);
        }
        let offset = offset_of(workload, index, &mut rng);
        let op_started = Instant::now();
        do_op(volume, workload, offset, &mut buf, &mut source)?;
        latency_ns += op_started.elapsed().as_nanos() as u64;
        copy_source.written(started.elapsed().as_nanos() as u64);
        progress.update(&workload.label, index + 1, ops, started);
    }
    Ok(latency_ns)
}

/// `queue_depth` threads issuing operations back to back; returns the
/// operations' summed latency.
fn run_real_threads(
    volume: &Arc<Volume>,
    workload: &Workload,
    ops: u64,
    progress: &Progress,
    started: Instant,
) -> Result<u64, String> {
    let next = AtomicU64::new(0);
    let failure: Mutex<Option<String>> = Mutex::new(None);
    let latency_ns = AtomicU64::new(0);
    std::thread::scope(|scope| {
        for thread in 0..workload.queue_depth.max(1) {
            let (next, failure, latency_ns) = (&next, &failure, &latency_ns);
            scope.spawn(move || {
                let seed = workload.seed.wrapping_add(thread as u64 * 0x9E37_79B9);
                let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
                let mut source = workload.pattern.source(seed);
                let mut buf = vec![0u8; workload.block_bytes as usize];
                loop {
                    let index = next.fetch_add(1, Ordering::Relaxed);
                    if index >= ops || failure.lock().expect("lock").is_some() {
                        break;
                    }
                    let offset = offset_of(workload, index, &mut rng);
                    let op_started = Instant::now();
                    if let Err(error) = do_op(volume, workload, offset, &mut buf, &mut source) {
                        *failure.lock().expect("lock") = Some(error);
                        break;
                    }
                    latency_ns.fetch_add(op_started.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    if thread == 0 {
                        progress.update(&workload.label, index + 1, ops, started);
                    }
                }
            });
        }
    });
    if let Some(error) = failure.into_inner().expect("lock") {
        return Err(error);
    }
    Ok(latency_ns.into_inner())
}

/// Runs the volume's pending background work to the end in this thread
/// (the background thread may take some of it meanwhile).
pub fn settle(volume: &Volume) -> Result<(), String> {
    // Each round cleans one segment or writes one checkpoint; far more
    // rounds than segments means the work never ends, which is a bug to
    // report rather than a benchmark to hang.
    let limit = 4 * volume.geometry().segment_count + 16;
    for _ in 0..limit {
        if !volume
            .maintenance_tick()
            .map_err(|e| format!("background work: {e}"))?
        {
            return Ok(());
        }
    }
    Err(format!(
        "background work did not settle after {limit} rounds (free segments: {})",
        volume.stats().free_segments
    ))
}

/// Virtual time: runs one round of the volume's background work at the
/// current time, as `run` does before each operation. It occupies the
/// drive's resources, which the next command may have to wait for, but not
/// the caller's clock. Real time: nothing (the volume's own thread does it).
pub fn background_tick(target: &mut Target) -> Result<(), String> {
    if let Some(clock) = &target.virtual_time {
        clock.begin_op(target.now_ns);
        let result = target.volume.maintenance_tick();
        clock.end_op();
        result.map_err(|e| format!("background work: {e}"))?;
    }
    Ok(())
}

/// Runs a single host command (trim, flush) at the current time.
pub fn run_command(
    target: &mut Target,
    command: impl FnOnce(&Volume) -> Result<(), String>,
) -> Result<f64, String> {
    match &target.virtual_time {
        None => {
            let started = Instant::now();
            command(&target.volume)?;
            Ok(started.elapsed().as_secs_f64())
        }
        Some(clock) => {
            let issue = target.now_ns;
            clock.begin_op(issue);
            let result = command(&target.volume);
            let done = clock.end_op().max(issue);
            result?;
            target.now_ns = done;
            Ok((done - issue) as f64 / 1e9)
        }
    }
}

/// Lets the drive's background work catch up (virtual: `seconds` of idle
/// time; real: sleeps).
pub fn idle(target: &mut Target, seconds: f64) {
    match &target.virtual_time {
        None => std::thread::sleep(Duration::from_secs_f64(seconds)),
        Some(clock) => {
            let end = target.now_ns + (seconds * 1e9) as u64;
            let mut now = target.now_ns;
            while now < end {
                clock.begin_op(now);
                let worked = target.volume.maintenance_tick().unwrap_or(false);
                let done = clock.end_op().max(now);
                if !worked {
                    break;
                }
                now = done.max(now + 1);
            }
            target.now_ns = end.max(now);
        }
    }
}
