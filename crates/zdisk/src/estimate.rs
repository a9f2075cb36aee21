//! `zdisk estimate`: how much a file, disk image or block device would take
//! on a zdisk volume, per codec, before anything is copied.
//!
//! The input is opened read-only and read once, in 1 MiB writes at their
//! own offsets (a sample of them with `--sample`); every codec's
//! [`WriteEstimator`] runs the engine's write-path compression on each, so
//! the figures are what `serve` would store for the same writes, not a
//! model of it. Each codec runs on its own thread, and its speed is the
//! logical bytes it handled over that thread's CPU time, so a busy machine
//! slows the run but hardly moves the figure.
//!
//! With `--dedup on` (the default) each write's blocks are first told new,
//! duplicate or zero by one [`DedupIndex`] (BLAKE3 fingerprints, exact
//! within `--dedup-memory`, hash-sampled past it), and every codec also
//! adds up what the write would cost with deduplication: its new blocks
//! through the write path's compression, a reference record per run of
//! duplicates. Both figures are printed, without and with dedup.

use std::fs::File;
use std::io::{IsTerminal, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileTypeExt;
use std::time::{Duration, Instant};

use serde::Serialize;

use zdisk_core::units::{format_size, BLOCK_SIZE, BLOCK_SIZE_U64};
use zdisk_core::{BlockKind, Codec, DedupIndex, DedupSummary, Lba, WriteEstimate, WriteEstimator};

use crate::args::EstimateArgs;
use crate::output::say;

/// One write request: what a client copying the input would send.
const WRITE_BYTES: usize = 1 << 20;
/// Writes read before the codecs' threads take them.
const BATCH_WRITES: usize = 8;

/// The codecs compared when none are named: the server's default, zstd at
/// its default level, and what the idle pass rewrites cold data with.
const DEFAULT_CODECS: [&str; 4] = ["lz4", "zstd", "zstd:9", "deflate"];

/// One codec's prediction, as `--json` prints it.
#[derive(Debug, Clone, Serialize)]
pub struct Prediction {
    pub codec: String,
    /// Largest compression unit, as `serve` would use by default.
    pub unit_bytes: u64,
    /// Bytes of the input (rounded up to whole 4 KiB blocks).
    pub logical_bytes: u64,
    /// Bytes of it compressed (all of it unless `--sample`).
    pub sampled_bytes: u64,
    /// Predicted bytes of records on the medium: data, units and zero runs.
    pub physical_bytes: u64,
    /// `logical_bytes / physical_bytes`.
    pub ratio: Option<f64>,
    /// Share of the input the volume would not need: `1 - physical/logical`.
    pub savings_percent: f64,
    /// Logical bytes of all-zero blocks (they cost only a range record).
    pub zero_bytes: u64,
    /// Logical bytes stored raw because they did not compress enough.
    pub incompressible_bytes: u64,
    /// Logical bytes stored compressed.
    pub compressed_bytes: u64,
    /// Compression speed on this machine: sampled MB (10^6 bytes) per CPU second.
    pub compress_mb_s_per_core: Option<f64>,
    /// The same codec with 4 KiB deduplication (absent with `--dedup off`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dedup: Option<DedupPrediction>,
}

/// One codec's prediction with deduplication.
#[derive(Debug, Clone, Serialize)]
pub struct DedupPrediction {
    /// Predicted bytes of records: new blocks' data and units, zero runs,
    /// and a reference record per run of duplicate blocks.
    pub physical_bytes: u64,
    /// `logical_bytes / physical_bytes`.
    pub ratio: Option<f64>,
    /// `1 - physical/logical`.
    pub savings_percent: f64,
    /// What dedup saves: physical bytes without it less physical bytes with it.
    pub saved_bytes: u64,
    /// Distinct non-zero 4 KiB blocks (estimated when `sample_shift` > 0).
    pub distinct_blocks: u64,
    /// Non-zero blocks whose bytes came earlier: stored as references.
    pub duplicate_blocks: u64,
    /// Reference records: one per run of duplicate blocks within a write.
    pub ref_records: u64,
    /// 0: every fingerprint was kept; k: 1 in 2^k was (`--dedup-memory`
    /// was too small for all), and the figures are estimated from them.
    pub sample_shift: u32,
}

pub fn run(args: &EstimateArgs) -> Result<(), String> {
    if !(args.sample > 0.0 && args.sample <= 100.0) {
        return Err(format!(
            "--sample {} is not a percentage: use a number above 0 and at most 100",
            args.sample
        ));
    }
    let specs: Vec<Codec> = if args.codecs.is_empty() {
        DEFAULT_CODECS
            .iter()
            .map(|spec| Codec::parse(spec).expect("default codecs parse"))
            .collect()
    } else {
        args.codecs.clone()
    };
    let mut input = Input::open(&args.path)?;
    let mut codecs: Vec<CodecRun> = specs
        .iter()
        .map(|&codec| {
            let unit_blocks = args
                .unit_max
                .unwrap_or_else(|| zdisk_core::meta::default_unit_blocks(codec));
            CodecRun {
                codec,
                unit_blocks,
                estimator: WriteEstimator::new(codec, unit_blocks),
                cpu: Duration::ZERO,
            }
        })
        .collect();
    let mut dedup = args.dedup.then(|| DedupIndex::new(args.dedup_memory));
    let progress = Progress::new(input.size_bytes);
    let mut sampler = Sampler::new(args.sample);
    let mut offset = 0u64;
    let mut batch: Vec<(u64, Vec<u8>)> = Vec::with_capacity(BATCH_WRITES);
    loop {
        let take = sampler.next();
        let chunk = if take {
            input.read_chunk()?
        } else {
            input.skip_chunk()?
        };
        let Some(length) = chunk else { break };
        if take {
            let mut data = input.buffer[..length].to_vec();
            data.resize(length.div_ceil(BLOCK_SIZE) * BLOCK_SIZE, 0);
            batch.push((offset, data));
        }
        offset += length as u64;
        if batch.len() == BATCH_WRITES {
            compress_batch(&mut codecs, &batch, dedup.as_mut());
            batch.clear();
        }
        progress.update(offset);
    }
    compress_batch(&mut codecs, &batch, dedup.as_mut());
    progress.done();
    let logical_bytes = offset.div_ceil(BLOCK_SIZE_U64) * BLOCK_SIZE_U64;
    let summary = dedup.as_ref().map(DedupIndex::summary);
    let mut predictions: Vec<Prediction> = codecs
        .iter()
        .map(|run| run.prediction(logical_bytes, summary.as_ref()))
        .collect();
    predictions.sort_by_key(|p| p.physical_bytes);
    if args.json {
        for prediction in &predictions {
            say!(
                "{}",
                serde_json::to_string(prediction).map_err(|e| e.to_string())?
            )?;
        }
    } else {
        crate::output::write(format_args!(
            "{}",
            table(&args.path.display().to_string(), &predictions, args.sample)
        ))?;
    }
    Ok(())
}

/// One codec's estimator and the CPU time it has used.
struct CodecRun {
    codec: Codec,
    unit_blocks: u8,
    estimator: WriteEstimator,
    cpu: Duration,
}

impl CodecRun {
    fn prediction(&self, logical_bytes: u64, dedup: Option<&DedupSummary>) -> Prediction {
        let sampled = self.estimator.total();
        // A sample stands for the whole input in proportion to its size.
        let scale = |value: u64| -> u64 {
            if sampled.logical_bytes == 0 {
                0
            } else {
                (value as f64 * logical_bytes as f64 / sampled.logical_bytes as f64).round() as u64
            }
        };
        let physical_bytes = scale(sampled.stored_bytes);
        let savings_percent = |physical_bytes: u64| {
            if logical_bytes == 0 {
                0.0
            } else {
                100.0 * (1.0 - physical_bytes as f64 / logical_bytes as f64)
            }
        };
        let ratio = |physical_bytes: u64| {
            (physical_bytes > 0).then(|| logical_bytes as f64 / physical_bytes as f64)
        };
        let dedup = dedup.map(|summary| {
            let deduplicated = summary.corrected(&self.estimator.total_deduplicated());
            let physical = scale(deduplicated.stored_bytes);
            DedupPrediction {
                physical_bytes: physical,
                ratio: ratio(physical),
                savings_percent: savings_percent(physical),
                saved_bytes: physical_bytes.saturating_sub(physical),
                distinct_blocks: scale(summary.distinct_blocks),
                duplicate_blocks: scale(summary.duplicate_blocks),
                ref_records: scale(deduplicated.ref_records),
                sample_shift: summary.sample_shift,
            }
        });
        let seconds = self.cpu.as_secs_f64();
        Prediction {
            codec: self.codec.to_string(),
            unit_bytes: u64::from(self.unit_blocks) * BLOCK_SIZE_U64,
            logical_bytes,
            sampled_bytes: sampled.logical_bytes,
            physical_bytes,
            ratio: ratio(physical_bytes),
            savings_percent: savings_percent(physical_bytes),
            zero_bytes: scale(sampled.zero_bytes),
            incompressible_bytes: scale(sampled.incompressible_bytes),
            compressed_bytes: scale(sampled.compressed_bytes),
            compress_mb_s_per_core: (seconds > 0.0)
                .then(|| sampled.logical_bytes as f64 / 1e6 / seconds),
            dedup,
        }
    }
}

/// Runs every codec over the batch, each on its own thread, after `dedup`
/// (if on) has told each block's kind, in the order of the writes.
fn compress_batch(
    codecs: &mut [CodecRun],
    batch: &[(u64, Vec<u8>)],
    dedup: Option<&mut DedupIndex>,
) {
    if batch.is_empty() {
        return;
    }
    let kinds: Option<Vec<Vec<BlockKind>>> =
        dedup.map(|index| batch.iter().map(|(_, data)| index.classify(data)).collect());
    let kinds = kinds.as_deref();
    std::thread::scope(|scope| {
        for run in codecs.iter_mut() {
            scope.spawn(move || {
                let started = thread_cpu_time();
                let mut total = WriteEstimate::default();
                for (index, (offset, data)) in batch.iter().enumerate() {
                    let first = Lba(offset / BLOCK_SIZE_U64);
                    let write = match kinds {
                        Some(kinds) => {
                            run.estimator
                                .add_write_deduplicated(first, data, &kinds[index])
                                .0
                        }
                        None => run.estimator.add_write(first, data),
                    };
                    total.add(&write);
                }
                run.cpu += thread_cpu_time().saturating_sub(started);
                debug_assert!(total.logical_bytes > 0);
            });
        }
    });
}

/// CPU time this thread has used.
fn thread_cpu_time() -> Duration {
    let mut time = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `time` is a valid, writable timespec.
    let result = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut time) };
    if result != 0 {
        return Duration::ZERO;
    }
    Duration::new(time.tv_sec as u64, time.tv_nsec as u32)
}

/// Which 1 MiB writes a `--sample` of PERCENT takes: evenly spread, so
/// that a sample of 10% takes one in ten wherever the data lies.
struct Sampler {
    percent: f64,
    index: u64,
}

impl Sampler {
    fn new(percent: f64) -> Sampler {
        Sampler { percent, index: 0 }
    }

    fn next(&mut self) -> bool {
        let index = self.index as f64;
        self.index += 1;
        if self.percent >= 100.0 {
            return true;
        }
        ((index + 1.0) * self.percent / 100.0).floor() > (index * self.percent / 100.0).floor()
    }
}

/// The input: a file or block device (seekable, size known) or stdin.
struct Input {
    reader: Box<dyn Read>,
    file: Option<File>,
    size_bytes: Option<u64>,
    buffer: Vec<u8>,
    name: String,
}

impl Input {
    fn open(path: &std::path::Path) -> Result<Input, String> {
        let name = path.display().to_string();
        if name == "-" {
            return Ok(Input {
                reader: Box::new(std::io::stdin()),
                file: None,
                size_bytes: None,
                buffer: vec![0u8; WRITE_BYTES],
                name: "standard input".into(),
            });
        }
        let mut file = File::open(path).map_err(|e| format!("cannot open {name}: {e}"))?;
        let metadata = file
            .metadata()
            .map_err(|e| format!("cannot read {name}: {e}"))?;
        if metadata.is_dir() {
            return Err(format!(
                "{name} is a directory: estimate a file, a disk image or a block device \
                 (for a directory, pipe a tar of it: tar -cf - DIR | zdisk estimate -)"
            ));
        }
        // A pipe or other stream (`<(tar -cf - DIR)`) is read to its end.
        let file_type = metadata.file_type();
        if !file_type.is_file() && !file_type.is_block_device() {
            return Ok(Input {
                reader: Box::new(file),
                file: None,
                size_bytes: None,
                buffer: vec![0u8; WRITE_BYTES],
                name,
            });
        }
        // A block device's size is where its end is.
        let size = file
            .seek(SeekFrom::End(0))
            .and_then(|end| file.seek(SeekFrom::Start(0)).map(|_| end))
            .map_err(|e| format!("cannot read {name}: {e}"))?;
        let reader = file
            .try_clone()
            .map_err(|e| format!("cannot read {name}: {e}"))?;
        Ok(Input {
            reader: Box::new(reader),
            file: Some(file),
            size_bytes: Some(size),
            buffer: vec![0u8; WRITE_BYTES],
            name,
        })
    }

    /// Reads the next write's bytes into `buffer`: their length, or `None` at the end.
    fn read_chunk(&mut self) -> Result<Option<usize>, String> {
        let mut filled = 0;
        while filled < self.buffer.len() {
            match self.reader.read(&mut self.buffer[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("cannot read {}: {e}", self.name)),
            }
        }
        Ok((filled > 0).then_some(filled))
    }

    /// Passes over the next write: seeks on a file, reads and drops on a pipe.
    fn skip_chunk(&mut self) -> Result<Option<usize>, String> {
        match (&mut self.file, self.size_bytes) {
            (Some(file), Some(size)) => {
                let at = file
                    .stream_position()
                    .map_err(|e| format!("cannot read {}: {e}", self.name))?;
                let length = (size.saturating_sub(at)).min(WRITE_BYTES as u64);
                if length == 0 {
                    return Ok(None);
                }
                file.seek(SeekFrom::Current(length as i64))
                    .map_err(|e| format!("cannot read {}: {e}", self.name))?;
                Ok(Some(length as usize))
            }
            _ => self.read_chunk(),
        }
    }
}

/// Progress on stderr, only when it is a terminal.
struct Progress {
    tty: bool,
    total: Option<u64>,
    started: Instant,
    last: std::cell::Cell<Instant>,
}

impl Progress {
    fn new(total: Option<u64>) -> Progress {
        Progress {
            tty: std::io::stderr().is_terminal(),
            total,
            started: Instant::now(),
            last: std::cell::Cell::new(Instant::now()),
        }
    }

    fn update(&self, done: u64) {
        if !self.tty || self.last.get().elapsed() < Duration::from_millis(200) {
            return;
        }
        self.last.set(Instant::now());
        let rate = done as f64 / 1e6 / self.started.elapsed().as_secs_f64().max(1e-3);
        let line = match self.total {
            Some(total) if total > 0 => format!(
                "estimate: {} of {} ({:.0}%), {rate:.0} MB/s",
                format_size(done),
                format_size(total),
                100.0 * done as f64 / total as f64
            ),
            _ => format!("estimate: {} read, {rate:.0} MB/s", format_size(done)),
        };
        let _ = write!(std::io::stderr(), "\r{line:<72}");
    }

    fn done(&self) {
        if self.tty {
            let _ = write!(std::io::stderr(), "\r{:72}\r", "");
        }
    }
}

/// The ranked table and the recommendation.
fn table(name: &str, predictions: &[Prediction], sample: f64) -> String {
    let mut out = String::new();
    let Some(first) = predictions.first() else {
        return out;
    };
    let sampled = if sample < 100.0 {
        format!(", {} sampled ({sample}%)", format_size(first.sampled_bytes))
    } else {
        String::new()
    };
    out.push_str(&format!(
        "{name}: {} logical{sampled}, {} zeros\n\n",
        format_size(first.logical_bytes),
        format_size(first.zero_bytes)
    ));
    if first.dedup.is_some() {
        out.push_str("without dedup:\n");
    }
    out.push_str(&format!(
        "{:<4} {:<11} {:>5} {:>11} {:>7} {:>7} {:>11} {:>11} {:>11}\n",
        "rank", "codec", "unit", "physical", "ratio", "saved", "raw", "compressed", "MB/s/core"
    ));
    for (rank, p) in predictions.iter().enumerate() {
        out.push_str(&format!(
            "{:<4} {:<11} {:>5} {:>11} {:>7} {:>6.1}% {:>11} {:>11} {:>11}\n",
            rank + 1,
            p.codec,
            format!("{}K", p.unit_bytes / 1024),
            format_size(p.physical_bytes),
            p.ratio.map_or("-".into(), |r| format!("{r:.2}x")),
            p.savings_percent,
            format_size(p.incompressible_bytes),
            format_size(p.compressed_bytes),
            p.compress_mb_s_per_core
                .map_or("-".into(), |s| format!("{s:.0}")),
        ));
    }
    out.push('\n');
    out.push_str(&recommendation(predictions));
    out.push_str(&dedup_table(predictions));
    out.push_str(
        "physical: predicted bytes of records (headers included), as stored_bytes counts \
         them; a new image adds its metadata and checkpoints.\n",
    );
    out
}

/// The same codecs, in the same order, with deduplication; empty with `--dedup off`.
fn dedup_table(predictions: &[Prediction]) -> String {
    let Some(first) = predictions.first().and_then(|p| p.dedup.as_ref()) else {
        return String::new();
    };
    let sampling = match first.sample_shift {
        0 => "every block's fingerprint kept".to_string(),
        k => format!(
            "sampled 1/2^{k} of the fingerprints (--dedup-memory): distinct blocks estimated, \
             reference records and units approximated"
        ),
    };
    let nonzero = first.distinct_blocks + first.duplicate_blocks;
    let mut out = format!(
        "\nwith dedup (4 KiB blocks; {sampling}):\n{} distinct and {} duplicate non-zero blocks \
         ({:.1}% duplicates, {} of data)\n\n",
        first.distinct_blocks,
        first.duplicate_blocks,
        if nonzero == 0 {
            0.0
        } else {
            100.0 * first.duplicate_blocks as f64 / nonzero as f64
        },
        format_size(first.duplicate_blocks * BLOCK_SIZE_U64),
    );
    out.push_str(&format!(
        "{:<4} {:<11} {:>11} {:>7} {:>7} {:>11} {:>11}\n",
        "rank", "codec", "physical", "ratio", "saved", "dedup saves", "references"
    ));
    for (rank, p) in predictions.iter().enumerate() {
        let Some(d) = &p.dedup else { continue };
        out.push_str(&format!(
            "{:<4} {:<11} {:>11} {:>7} {:>6.1}% {:>11} {:>11}\n",
            rank + 1,
            p.codec,
            format_size(d.physical_bytes),
            d.ratio.map_or("-".into(), |r| format!("{r:.2}x")),
            d.savings_percent,
            format_size(d.saved_bytes),
            d.ref_records,
        ));
    }
    out.push_str(
        "dedup saves: physical without dedup less physical with it; a reference record \
         per run of up to 256 duplicate blocks within a write (48 bytes and 16 per block).\n",
    );
    out
}

/// Smallest first; then the fastest codec within 5% of the smallest.
fn recommendation(predictions: &[Prediction]) -> String {
    let Some(smallest) = predictions.first() else {
        return String::new();
    };
    let speed = |p: &Prediction| p.compress_mb_s_per_core.unwrap_or(0.0);
    let close = predictions
        .iter()
        .filter(|p| p.physical_bytes as f64 <= smallest.physical_bytes as f64 * 1.05)
        .max_by(|a, b| speed(a).total_cmp(&speed(b)))
        .unwrap_or(smallest);
    let fastest = predictions
        .iter()
        .max_by(|a, b| speed(a).total_cmp(&speed(b)))
        .unwrap_or(smallest);
    let describe = |p: &Prediction| {
        format!(
            "{} ({}, {:.0} MB/s per core)",
            p.codec,
            format_size(p.physical_bytes),
            speed(p)
        )
    };
    let mut out = format!("smallest: {}\n", describe(smallest));
    if close.codec != smallest.codec {
        out.push_str(&format!("fastest within 5% of it: {}\n", describe(close)));
    }
    if fastest.codec != close.codec {
        out.push_str(&format!("fastest: {}\n", describe(fastest)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_spread_evenly() {
        for (percent, expected) in [(100.0, 1000), (10.0, 100), (25.0, 250), (0.5, 5)] {
            let mut sampler = Sampler::new(percent);
            let taken = (0..1000).filter(|_| sampler.next()).count();
            assert_eq!(taken, expected, "{percent}%");
        }
        // One in four, not the first quarter.
        let mut sampler = Sampler::new(25.0);
        let taken: Vec<usize> = (0..8).filter(|_| sampler.next()).collect();
        assert_eq!(taken, vec![3, 7]);
    }

    fn prediction(codec: &str, physical_bytes: u64, speed: f64) -> Prediction {
        Prediction {
            codec: codec.into(),
            unit_bytes: 8192,
            logical_bytes: 1000,
            sampled_bytes: 1000,
            physical_bytes,
            ratio: Some(1000.0 / physical_bytes as f64),
            savings_percent: 0.0,
            zero_bytes: 0,
            incompressible_bytes: 0,
            compressed_bytes: 1000,
            compress_mb_s_per_core: Some(speed),
            dedup: None,
        }
    }

    #[test]
    fn recommendation_prefers_speed_within_five_percent() {
        let predictions = [
            prediction("zstd:9", 400, 50.0),
            prediction("zstd:1", 410, 400.0),
            prediction("lz4", 500, 900.0),
        ];
        let text = recommendation(&predictions);
        assert!(text.contains("smallest: zstd:9"), "{text}");
        assert!(text.contains("fastest within 5% of it: zstd:1"), "{text}");
        assert!(text.contains("fastest: lz4"), "{text}");
    }
}
