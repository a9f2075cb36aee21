//! `sparse-wal`: a write-ahead log in the packed and the sparse layout
//! (`crate::wal`), and what each costs the drive per commit.
//!
//! ScaleFlux (SDC 2020) measured on its CSD 2000 that giving every commit
//! a fresh 4 KiB block, the rest zeros, cuts the bytes written to flash by
//! 94 % at 128 bytes per transaction, against appending commits into the
//! current block and rewriting it at every flush. This scenario runs both
//! layouts per commit size, with a flush per commit and with group commit,
//! on a fresh drive each (with and without power-loss protection on an
//! emulated drive), and counts host and media bytes with the volume's own
//! counters. A second part runs the sparse log as a ring whose checkpoints
//! trim what they pass, next to one that never trims, and samples logical
//! bytes written, logical bytes in use and bytes stored as it goes.

use std::time::Instant;

use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};
use serde_json::{json, Value};

use zdisk_core::Stats;

use crate::drive::{Drive, DriveOptions};
use crate::driver::{Progress, Target};
use crate::wal::{
    Layout, TargetDevice, Wal, WalConfig, WalError, BLOCK_BYTES, RECORD_HEADER_BYTES,
};

use super::common::{count, logical_of, round_down, Outcome, Settings, KIB, MIB};

/// Bytes per commit, its header included (the published series).
pub const COMMIT_SIZES: [u64; 5] = [128, 256, 512, 1024, 2048];
/// Commits that share a flush with group commit on.
pub const GROUP_COMMITS: u64 = 8;

/// One layout at one commit size on one drive configuration.
#[derive(Debug, Clone, Copy)]
struct RunSpec {
    layout: Layout,
    commit_bytes: u64,
    commits_per_flush: u64,
    plp: Option<bool>,
    commits: u64,
}

/// What a run measured, from the volume's counters.
#[derive(Debug, Clone, Copy)]
struct RunFigures {
    commits: u64,
    flushes: u64,
    seconds: f64,
    host_bytes: u64,
    media_bytes: u64,
    padding_bytes: u64,
    staging_bytes: u64,
    meta_bytes: u64,
    gc_bytes: u64,
    /// NAND pages programmed, by the drive model (emulated drives only).
    pages_programmed: Option<u64>,
}

impl RunFigures {
    fn media_per_commit(&self) -> f64 {
        self.media_bytes as f64 / self.commits as f64
    }

    fn commits_per_s(&self) -> f64 {
        if self.seconds > 0.0 {
            self.commits as f64 / self.seconds
        } else {
            f64::INFINITY
        }
    }
}

/// Elapsed time on the target's clock: virtual, or the wall clock.
struct Stopwatch {
    wall: Instant,
    virtual_ns: u64,
}

impl Stopwatch {
    fn start(target: &Target) -> Stopwatch {
        Stopwatch {
            wall: Instant::now(),
            virtual_ns: target.now_ns,
        }
    }

    fn seconds(&self, target: &Target) -> f64 {
        if target.is_virtual() {
            (target.now_ns - self.virtual_ns) as f64 / 1e9
        } else {
            self.wall.elapsed().as_secs_f64()
        }
    }
}

fn pages_programmed(target: &Target) -> Option<u64> {
    let details = target.details.as_ref()?;
    details()["pages_programmed"].as_u64()
}

fn wal_error(error: WalError) -> String {
    format!("write-ahead log: {error}")
}

/// A commit's payload: fresh random bytes, so that the drive's compressor
/// finds nothing to remove but the zeros a layout leaves.
fn fill_payload(rng: &mut SmallRng, payload: &mut [u8]) {
    rng.fill_bytes(payload);
}

/// Appends a commit; a full ring is checkpointed first (the measured
/// runs' ring is the whole drive and holds them all, unless it is small).
fn append(wal: &mut Wal<TargetDevice<'_>>, payload: &[u8]) -> Result<u64, String> {
    match wal.append(payload) {
        Err(WalError::Full { .. }) => {
            wal.checkpoint().map_err(wal_error)?;
            wal.append(payload).map_err(wal_error)
        }
        other => other.map_err(wal_error),
    }
}

/// Commits per measured run: `--size` over 32 KiB (8192 for the default
/// 256 MiB), a whole number of groups.
fn commits_for(settings: &Settings) -> u64 {
    let commits = (settings.size_bytes / (32 * KIB)).clamp(256, 1 << 20);
    round_down(commits, GROUP_COMMITS)
}

/// The bytes a flush leaves on a compressing drive that stores each block
/// as its non-zero bytes and packs them without padding, by layout
/// arithmetic alone: a block takes `n` flushes of `g·c` bytes, packed
/// rewrites it `n` times at an average `(n + 1) / 2` flushes' worth, sparse
/// writes each flush once. Reduction `1 − 2 / (n + 1)`: 93.9 % at 128 B.
pub fn layout_model_reduction(commit_bytes: u64, commits_per_flush: u64) -> f64 {
    let flushes_per_block = BLOCK_BYTES as f64 / (commit_bytes * commits_per_flush) as f64;
    if flushes_per_block <= 1.0 {
        0.0
    } else {
        1.0 - 2.0 / (flushes_per_block + 1.0)
    }
}

/// Runs one layout on a fresh drive: a warm-up, then `commits` commits,
/// `commits_per_flush` to a flush, measured.
fn run_one(
    drive: &dyn Drive,
    spec: RunSpec,
    settings: &Settings,
    progress: &Progress,
) -> Result<RunFigures, String> {
    let mut target = drive.create(&DriveOptions {
        plp: spec.plp,
        ..DriveOptions::default()
    })?;
    let area_bytes = round_down(logical_of(&target), BLOCK_BYTES) - 2 * BLOCK_BYTES;
    let config = WalConfig {
        layout: spec.layout,
        base_offset: 0,
        area_bytes,
        log_id: settings.seed,
    };
    let mut wal = Wal::create(TargetDevice::new(&mut target), config).map_err(wal_error)?;
    // The same commits for both layouts.
    let mut rng = SmallRng::seed_from_u64(settings.seed ^ spec.commit_bytes);
    let mut payload = vec![0u8; (spec.commit_bytes as usize) - RECORD_HEADER_BYTES];
    // A warm-up, so that the measured commits start with a drive already
    // holding some log (and a PLP buffer holding a partial page).
    let warmup = (spec.commits / 16).max(2 * GROUP_COMMITS);
    let label = format!(
        "sparse-wal {} {} B{}{}",
        spec.layout,
        spec.commit_bytes,
        match spec.plp {
            Some(true) => ", PLP",
            _ => "",
        },
        if spec.commits_per_flush > 1 {
            ", group commit"
        } else {
            ""
        }
    );
    let mut commit = |wal: &mut Wal<TargetDevice<'_>>, index: u64| -> Result<(), String> {
        fill_payload(&mut rng, &mut payload);
        append(wal, &payload)?;
        if (index + 1).is_multiple_of(spec.commits_per_flush) {
            wal.flush().map_err(wal_error)?;
        }
        Ok(())
    };
    for index in 0..round_down(warmup, spec.commits_per_flush) {
        commit(&mut wal, index)?;
    }
    let before = wal.device().target().volume.stats();
    let pages_before = pages_programmed(wal.device().target());
    let flushes_before = wal.counters().flushes;
    let clock = Stopwatch::start(wal.device().target());
    let started = Instant::now();
    for index in 0..spec.commits {
        commit(&mut wal, index)?;
        progress.update(&label, index + 1, spec.commits, started);
    }
    wal.flush().map_err(wal_error)?;
    progress.done(started);
    let flushes = wal.counters().flushes - flushes_before;
    let target = wal.device().target();
    let seconds = clock.seconds(target);
    let after = target.volume.stats();
    let pages_after = pages_programmed(target);
    let delta = |f: fn(&Stats) -> u64| f(&after) - f(&before);
    Ok(RunFigures {
        commits: spec.commits,
        flushes,
        seconds,
        host_bytes: delta(|s| s.host_write_bytes),
        media_bytes: delta(|s| s.media_write_bytes),
        padding_bytes: delta(|s| s.padding_bytes),
        staging_bytes: delta(|s| s.staging_bytes),
        meta_bytes: delta(|s| s.counters.meta_write_bytes),
        gc_bytes: delta(|s| s.gc_write_bytes),
        pages_programmed: pages_before.zip(pages_after).map(|(b, a)| a - b),
    })
}

fn plp_name(plp: Option<bool>) -> &'static str {
    match plp {
        Some(true) => "on",
        _ => "off",
    }
}

fn run_json(spec: &RunSpec, figures: &RunFigures, reduction: f64, page_bytes: u64) -> Value {
    json!({
        "scenario": "sparse-wal",
        "phase": "sizes",
        "layout": spec.layout.name(),
        "commit_bytes": spec.commit_bytes,
        "plp": spec.plp == Some(true),
        "group_commit": spec.commits_per_flush > 1,
        "commits_per_flush": spec.commits_per_flush,
        "commits": figures.commits,
        "flushes": figures.flushes,
        "host_bytes": figures.host_bytes,
        "media_bytes": figures.media_bytes,
        "padding_bytes": figures.padding_bytes,
        "staging_bytes": figures.staging_bytes,
        "meta_write_bytes": figures.meta_bytes,
        "gc_write_bytes": figures.gc_bytes,
        "host_bytes_per_commit": figures.host_bytes as f64 / figures.commits as f64,
        "media_bytes_per_commit": figures.media_per_commit(),
        "commits_per_s": figures.commits_per_s(),
        "seconds": figures.seconds,
        "reduction": reduction,
        "reduction_percent": reduction * 100.0,
        "model_reduction_percent":
            layout_model_reduction(spec.commit_bytes, spec.commits_per_flush) * 100.0,
        "nand_pages_programmed": figures.pages_programmed,
        "page_bytes": page_bytes,
    })
}

/// The scenario: both layouts at every commit size, group commit off and
/// on, with and without PLP where the drive has it; then the reclaim run.
pub fn sparse_wal(
    drive: &dyn Drive,
    settings: &Settings,
    progress: &Progress,
) -> Result<Outcome, String> {
    let (_, page_bytes) = drive.segment_and_page();
    let commits = commits_for(settings);
    // PLP first: it is the CSD 2000's configuration and the published one.
    let plps: Vec<Option<bool>> = if drive.supports_plp() {
        vec![Some(true), Some(false)]
    } else {
        vec![None]
    };
    let mut table = vec![vec![
        "PLP".to_string(),
        "commits/flush".into(),
        "commit B".into(),
        "packed media B/commit".into(),
        "sparse media B/commit".into(),
        "reduction".into(),
        "layout model".into(),
        "packed host B/commit".into(),
        "sparse host B/commit".into(),
        "packed commits/s".into(),
        "sparse commits/s".into(),
    ]];
    let mut results = Vec::new();
    for &plp in &plps {
        for commits_per_flush in [1, GROUP_COMMITS] {
            for commit_bytes in COMMIT_SIZES {
                let spec = |layout| RunSpec {
                    layout,
                    commit_bytes,
                    commits_per_flush,
                    plp,
                    commits,
                };
                let packed_spec = spec(Layout::Packed);
                let sparse_spec = spec(Layout::Sparse);
                let packed = run_one(drive, packed_spec, settings, progress)?;
                let sparse = run_one(drive, sparse_spec, settings, progress)?;
                let reduction = 1.0 - sparse.media_per_commit() / packed.media_per_commit();
                table.push(vec![
                    plp_name(plp).into(),
                    commits_per_flush.to_string(),
                    commit_bytes.to_string(),
                    format!("{:.0}", packed.media_per_commit()),
                    format!("{:.0}", sparse.media_per_commit()),
                    format!("{:.1}%", reduction * 100.0),
                    format!(
                        "{:.1}%",
                        layout_model_reduction(commit_bytes, commits_per_flush) * 100.0
                    ),
                    format!("{:.0}", packed.host_bytes as f64 / commits as f64),
                    format!("{:.0}", sparse.host_bytes as f64 / commits as f64),
                    count(packed.commits_per_s()),
                    count(sparse.commits_per_s()),
                ]);
                results.push(run_json(&packed_spec, &packed, reduction, page_bytes));
                results.push(run_json(&sparse_spec, &sparse, reduction, page_bytes));
            }
        }
    }
    let plp = plps[0];
    let mut reclaim_table = vec![vec![
        "commits".to_string(),
        "logical written MiB".into(),
        "trim: in use MiB".into(),
        "trim: stored KiB".into(),
        "no trim: in use MiB".into(),
        "no trim: stored KiB".into(),
    ]];
    let trimmed = reclaim(drive, settings, progress, plp, commits, true)?;
    let kept = reclaim(drive, settings, progress, plp, commits, false)?;
    let rows = trimmed.samples.len().min(kept.samples.len());
    let every = (rows / 8).max(1);
    for index in (every - 1..rows).step_by(every) {
        let (t, k) = (&trimmed.samples[index], &kept.samples[index]);
        reclaim_table.push(vec![
            t.commits.to_string(),
            format!("{:.1}", t.logical_written_bytes as f64 / MIB as f64),
            format!("{:.2}", t.mapped_bytes as f64 / MIB as f64),
            format!("{:.0}", t.stored_bytes as f64 / KIB as f64),
            format!("{:.2}", k.mapped_bytes as f64 / MIB as f64),
            format!("{:.0}", k.stored_bytes as f64 / KIB as f64),
        ]);
    }
    let reclaim_lines = vec![trimmed.json(plp), kept.json(plp)];
    let lines = results.iter().chain(&reclaim_lines).cloned().collect();
    let json = json!({
        "scenario": "sparse-wal",
        "commits_per_run": commits,
        "group_commits": GROUP_COMMITS,
        "results": results,
        "reclaim": reclaim_lines,
    });
    Ok(Outcome {
        json,
        table,
        lines,
        tables: vec![(
            format!(
                "sparse log, 128 B commits, ring of {} KiB checkpointed every {} commits, \
                 against a log that never trims",
                trimmed.ring_bytes / KIB,
                trimmed.checkpoint_every
            ),
            reclaim_table,
        )],
    })
}

/// One point of the reclaim run.
#[derive(Debug, Clone, Copy, serde::Serialize)]
struct ReclaimSample {
    commits: u64,
    /// Bytes the host has written since the log was created.
    logical_written_bytes: u64,
    /// Logical bytes holding data (`Stats::mapped_bytes`).
    mapped_bytes: u64,
    /// Bytes of live records on the medium (`Stats::stored_bytes`).
    stored_bytes: u64,
    /// Medium in use, garbage the cleaner has not reclaimed yet included.
    physical_used_bytes: u64,
    trimmed_bytes: u64,
}

struct ReclaimRun {
    trim: bool,
    ring_bytes: u64,
    checkpoint_every: u64,
    figures: RunFigures,
    samples: Vec<ReclaimSample>,
}

impl ReclaimRun {
    fn json(&self, plp: Option<bool>) -> Value {
        let f = &self.figures;
        json!({
            "scenario": "sparse-wal",
            "phase": "reclaim",
            "trim": self.trim,
            "layout": Layout::Sparse.name(),
            "commit_bytes": 128,
            "plp": plp == Some(true),
            "group_commit": false,
            "commits_per_flush": 1,
            "ring_bytes": self.ring_bytes,
            "checkpoint_every_commits": self.trim.then_some(self.checkpoint_every),
            "commits": f.commits,
            "host_bytes": f.host_bytes,
            "media_bytes": f.media_bytes,
            "media_bytes_per_commit": f.media_per_commit(),
            "commits_per_s": f.commits_per_s(),
            "samples": self.samples,
        })
    }
}

/// The sparse log at 128 B for `commits` commits: as a ring of an eighth
/// of them, checkpointed (and so trimmed) every quarter ring, or, with
/// `trim` off, in a ring that holds them all and never checkpoints.
fn reclaim(
    drive: &dyn Drive,
    settings: &Settings,
    progress: &Progress,
    plp: Option<bool>,
    commits: u64,
    trim: bool,
) -> Result<ReclaimRun, String> {
    let commit_bytes = 128u64;
    let mut target = drive.create(&DriveOptions {
        plp,
        ..DriveOptions::default()
    })?;
    let room = round_down(logical_of(&target), BLOCK_BYTES) - 2 * BLOCK_BYTES;
    let ring_bytes = if trim {
        (commits / 8).max(16) * BLOCK_BYTES
    } else {
        commits * BLOCK_BYTES
    }
    .min(room);
    let checkpoint_every = (ring_bytes / BLOCK_BYTES / 4).max(1);
    let sample_every = (commits / 32).max(1);
    let config = WalConfig {
        layout: Layout::Sparse,
        base_offset: 0,
        area_bytes: ring_bytes,
        log_id: settings.seed,
    };
    let start_stats = target.volume.stats();
    let mut wal = Wal::create(TargetDevice::new(&mut target), config).map_err(wal_error)?;
    let mut rng = SmallRng::seed_from_u64(settings.seed ^ 0x5ca1e);
    let mut payload = vec![0u8; commit_bytes as usize - RECORD_HEADER_BYTES];
    let clock = Stopwatch::start(wal.device().target());
    let started = Instant::now();
    let label = format!(
        "sparse-wal reclaim ({})",
        if trim { "trim" } else { "no trim" }
    );
    let mut samples = Vec::new();
    for index in 1..=commits {
        fill_payload(&mut rng, &mut payload);
        append(&mut wal, &payload)?;
        wal.flush().map_err(wal_error)?;
        // Sampled before a checkpoint that falls on the same commit: the
        // most the log holds.
        if index.is_multiple_of(sample_every) {
            let trimmed_bytes = wal.counters().trimmed_bytes;
            let stats = wal.device().target().volume.stats();
            samples.push(ReclaimSample {
                commits: index,
                logical_written_bytes: stats.host_write_bytes - start_stats.host_write_bytes,
                mapped_bytes: stats.mapped_bytes,
                stored_bytes: stats.stored_bytes,
                physical_used_bytes: stats.physical_used_bytes,
                trimmed_bytes,
            });
        }
        if trim && index.is_multiple_of(checkpoint_every) {
            wal.checkpoint().map_err(wal_error)?;
        }
        progress.update(&label, index, commits, started);
    }
    progress.done(started);
    let target = wal.device().target();
    let seconds = clock.seconds(target);
    let end = target.volume.stats();
    Ok(ReclaimRun {
        trim,
        ring_bytes,
        checkpoint_every,
        figures: RunFigures {
            commits,
            flushes: wal.counters().flushes,
            seconds,
            host_bytes: end.host_write_bytes - start_stats.host_write_bytes,
            media_bytes: end.media_write_bytes - start_stats.media_write_bytes,
            padding_bytes: end.padding_bytes - start_stats.padding_bytes,
            staging_bytes: end.staging_bytes - start_stats.staging_bytes,
            meta_bytes: end.counters.meta_write_bytes - start_stats.counters.meta_write_bytes,
            gc_bytes: end.gc_write_bytes - start_stats.gc_write_bytes,
            pages_programmed: None,
        },
        samples,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layout_model_gives_the_published_figure_at_128_bytes() {
        let at_128 = layout_model_reduction(128, 1);
        assert!((at_128 - 0.9394).abs() < 1e-3, "{at_128}");
        assert!(layout_model_reduction(2048, 1) < layout_model_reduction(256, 1));
        assert_eq!(layout_model_reduction(512, 8), 0.0);
        assert!((layout_model_reduction(128, 8) - 0.6).abs() < 1e-9);
    }
}
