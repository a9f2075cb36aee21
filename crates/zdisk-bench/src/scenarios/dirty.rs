//! `dirty`: clean, dirty and after-TRIM throughput, as in the SF-1200 review.

use serde_json::json;

use crate::drive::{Drive, DriveOptions};
use crate::driver::{self, Access, Measured, OpKind, Progress, Target, Workload};
use crate::pattern::Pattern;

use super::common::{
    incompressible_capacity, logical_of, mb, ratio, round_down, Outcome, Settings, KIB, MIB,
};

/// The sibling images the real-time dirty scenario makes beside its own.
pub const DIRTY_SIBLINGS: [&str; 2] = ["clean", "trimmed"];

/// What the dirty scenario writes, sized to the drive. The file-copy
/// scenario prepares its states with the same plan.
pub(super) struct DirtyPlan {
    /// Logical bytes the fill covers.
    pub(super) logical: u64,
    /// Bytes each state is measured with.
    pub(super) size: u64,
    /// Log capacity beyond the logical bytes filled.
    spare: u64,
    random_fill: bool,
    pub(super) seed: u64,
}

impl DirtyPlan {
    /// The plan for `target`, a fresh volume on `drive`.
    pub(super) fn new(drive: &dyn Drive, target: &Target, settings: &Settings) -> DirtyPlan {
        let (log_capacity, _) = drive.default_sizes();
        // "Every logical block": as many as incompressible data can occupy. A
        // small drive with little over-provisioning exposes more logical space
        // than the log can hold raw once zdisk's reserves are set aside (it is
        // thin by construction); the fill then covers what fits.
        let logical = round_down(
            logical_of(target).min(incompressible_capacity(drive, log_capacity)),
            MIB,
        );
        DirtyPlan {
            logical,
            size: round_down(settings.size_bytes.min(logical / 2), MIB).max(MIB),
            spare: log_capacity.saturating_sub(logical),
            random_fill: settings.dirty_fill_random,
            seed: settings.seed,
        }
    }

    /// `total` bytes of sequential incompressible 128 KiB writes at QD8
    /// over `start..start + bytes`.
    fn sequential(&self, label: &str, start: u64, bytes: u64, total: u64, seed: u64) -> Workload {
        Workload::new(
            OpKind::Write,
            Access::Sequential,
            128 * KIB,
            &Pattern::Random,
        )
        .region(start, bytes)
        .total(total)
        .queue_depth(8)
        .label(format!("dirty: {label}"))
        .seed(seed)
    }

    /// A measured pass over `start..start + bytes`, charged the background
    /// work it causes.
    fn measure(&self, label: &str, start: u64, bytes: u64, seed: u64) -> Workload {
        self.sequential(label, start, bytes, bytes, seed).settle()
    }

    /// Fills every logical block, then keeps writing until the spare area
    /// is used up too (the log's free space has run down to the cleaner's
    /// reserve). Returns the free segments left.
    pub(super) fn fill(&self, target: &mut Target, progress: &Progress) -> Result<u64, String> {
        let (logical, spare) = (self.logical, self.spare);
        let fill = if self.random_fill {
            let every_block =
                self.sequential("filling every block", 0, logical, logical, self.seed + 1);
            driver::run(target, &every_block, progress)?;
            Workload::new(OpKind::Write, Access::Random, 4 * KIB, &Pattern::Random)
                .region(0, logical)
                .total(spare + logical / 4)
                .queue_depth(32)
                .label("dirty: random fill of the spare area")
                .seed(self.seed + 2)
        } else {
            let label = "filling every block and the spare area";
            self.sequential(label, 0, logical, logical + spare, self.seed + 2)
        };
        driver::run(target, &fill, progress)?;
        Ok(target.volume.stats().free_segments)
    }

    /// TRIM of the whole volume; returns its time.
    pub(super) fn trim_all(&self, target: &mut Target) -> Result<f64, String> {
        let logical = logical_of(target);
        let real = !target.is_virtual();
        driver::run_command(target, |volume| {
            zdisk_core::BlockDevice::trim(volume, 0, logical, false).map_err(|e| e.to_string())?;
            // In real time the reclaiming it starts is part of its cost.
            if real {
                zdisk_core::BlockDevice::flush(volume).map_err(|e| e.to_string())?;
                driver::settle(volume)?;
            }
            Ok(())
        })
    }
}

/// One state's figures, with the spread of its per-slice ratios to the
/// clean drive when the states were measured in interleaved slices.
struct DirtyState {
    name: &'static str,
    measured: Measured,
    /// Minimum, median, maximum of the per-round % of clean.
    slice_percent: Option<[f64; 3]>,
    /// Each round's slice time, when interleaved.
    slice_seconds: Vec<f64>,
}

/// Clean, dirty (every logical block and the spare area filled with
/// incompressible data), and after TRIM of the whole volume: sequential
/// incompressible write throughput in each state, as in the SF-1200 review.
///
/// An emulated drive runs the three states one after another on one drive,
/// in virtual time. A real image cannot: the host's speed drifts by more
/// than the differences being measured. So it gets three images on the
/// same medium (the named one ends dirty, two siblings are removed after),
/// and the states are measured in interleaved slices, each slice ending
/// durable with the background work it caused done. Drift then falls on
/// the three alike, and the ratio to clean is taken round by round.
pub fn dirty(
    drive: &dyn Drive,
    settings: &Settings,
    progress: &Progress,
) -> Result<Outcome, String> {
    let mut target = drive.create(&DriveOptions::default())?;
    let plan = DirtyPlan::new(drive, &target, settings);
    let siblings = if target.is_virtual() {
        None
    } else {
        let [clean, trimmed] = DIRTY_SIBLINGS;
        drive.sibling(clean).zip(drive.sibling(trimmed))
    };
    let (states, free_after_fill, trim_seconds, rounds) = match siblings {
        None => {
            let clean = driver::run(
                &mut target,
                &plan.measure("clean drive", 0, plan.size, plan.seed),
                progress,
            )?;
            let free_after_fill = plan.fill(&mut target, progress)?;
            let dirty = driver::run(
                &mut target,
                &plan.measure("dirty drive", 0, plan.size, plan.seed + 3),
                progress,
            )?;
            let trim_seconds = plan.trim_all(&mut target)?;
            let after_trim = driver::run(
                &mut target,
                &plan.measure("after TRIM", 0, plan.size, plan.seed + 4),
                progress,
            )?;
            let states = [
                ("clean", clean),
                ("dirty", dirty),
                ("after TRIM", after_trim),
            ]
            .map(|(name, measured)| DirtyState {
                name,
                measured,
                slice_percent: None,
                slice_seconds: Vec::new(),
            });
            (states, free_after_fill, trim_seconds, None)
        }
        Some((clean_drive, trimmed_drive)) => {
            let result = interleaved(&plan, &mut target, &*clean_drive, &*trimmed_drive, progress);
            clean_drive.discard();
            trimmed_drive.discard();
            result?
        }
    };

    let clean_mb_s = states[0].measured.mb_s;
    let percent = |m: &Measured| 100.0 * m.mb_s / clean_mb_s.max(f64::MIN_POSITIVE);
    let interleaved = rounds.is_some();
    let mut header = vec![
        "state".to_string(),
        "MB/s".into(),
        "% of clean".into(),
        "WA".into(),
    ];
    if interleaved {
        header.push("per round % (min / median / max)".into());
    }
    let mut table = vec![header];
    for state in &states {
        let mut row = vec![
            state.name.to_string(),
            mb(state.measured.mb_s),
            format!("{:.1}", percent(&state.measured)),
            ratio(state.measured.write_amplification),
        ];
        if interleaved {
            row.push(
                state
                    .slice_percent
                    .map_or("-".into(), |[low, median, high]| {
                        format!("{low:.1} / {median:.1} / {high:.1}")
                    }),
            );
        }
        table.push(row);
    }
    let spread = |state: &DirtyState| {
        state
            .slice_percent
            .map(|[min, median, max]| json!({"min": min, "median": median, "max": max}))
    };
    let [clean, dirty, after_trim] = &states;
    let stats = target.volume.stats();
    Ok(Outcome {
        json: json!({
            "scenario": "dirty",
            "method": if interleaved { "interleaved" } else { "sequential" },
            "clean_mb_s": clean.measured.mb_s,
            "dirty_mb_s": dirty.measured.mb_s,
            "after_trim_mb_s": after_trim.measured.mb_s,
            "dirty_percent_of_clean": percent(&dirty.measured),
            "after_trim_percent_of_clean": percent(&after_trim.measured),
            "dirty_percent_of_clean_per_round": spread(dirty),
            "after_trim_percent_of_clean_per_round": spread(after_trim),
            "write_amplification": dirty.measured.write_amplification,
            "clean_write_amplification": clean.measured.write_amplification,
            "after_trim_write_amplification": after_trim.measured.write_amplification,
            "fill": if settings.dirty_fill_random { "random" } else { "sequential" },
            "filled_logical_bytes": plan.logical,
            "measured_bytes": plan.size,
            "rounds": rounds,
            "round_seconds": interleaved.then(|| json!({
                "clean": clean.slice_seconds,
                "dirty": dirty.slice_seconds,
                "after_trim": after_trim.slice_seconds,
            })),
            "trim_seconds": trim_seconds,
            "free_segments_after_fill": free_after_fill,
            "segments_cleaned": stats.segments_cleaned,
        }),
        table,
        ..Outcome::default()
    })
}

/// The real-time dirty scenario: `target` is dirtied, a sibling is
/// dirtied and trimmed, another stays clean, and then all three are
/// measured in rounds of one slice each, in rotating order.
fn interleaved(
    plan: &DirtyPlan,
    target: &mut Target,
    clean_drive: &dyn Drive,
    trimmed_drive: &dyn Drive,
    progress: &Progress,
) -> Result<([DirtyState; 3], u64, f64, Option<u64>), String> {
    let mut clean = clean_drive.create(&DriveOptions::default())?;
    let mut trimmed = trimmed_drive.create(&DriveOptions::default())?;
    let free_after_fill = plan.fill(target, progress)?;
    plan.fill(&mut trimmed, progress)?;
    let trim_seconds = plan.trim_all(&mut trimmed)?;

    // Slices of at least 1 MiB, whole 128 KiB writes, 32 rounds at most.
    let rounds = (plan.size / MIB).clamp(1, 32);
    let slice = round_down(plan.size / rounds, 128 * KIB);
    let names = ["clean", "dirty", "after TRIM"];
    let mut parts: [Vec<Measured>; 3] = Default::default();
    let started = std::time::Instant::now();
    for round in 0..rounds {
        for turn in 0..3 {
            let state = (round as usize + turn) % 3;
            let drive = match state {
                0 => &mut clean,
                1 => &mut *target,
                _ => &mut trimmed,
            };
            let workload = plan.measure(
                names[state],
                round * slice,
                slice,
                plan.seed + 3 + round * 3 + state as u64,
            );
            parts[state].push(driver::run(drive, &workload, progress)?);
        }
        progress.update("dirty: interleaved rounds", round + 1, rounds, started);
    }
    progress.done(started);
    let _ = clean.volume.close();
    let _ = trimmed.volume.close();

    let spread = |state: usize| {
        let mut percents: Vec<f64> = parts[state]
            .iter()
            .zip(&parts[0])
            .map(|(m, base)| 100.0 * base.seconds / m.seconds.max(f64::MIN_POSITIVE))
            .collect();
        percents.sort_by(f64::total_cmp);
        [
            percents[0],
            percents[percents.len() / 2],
            percents[percents.len() - 1],
        ]
    };
    let states = [0, 1, 2].map(|state| DirtyState {
        name: names[state],
        measured: Measured::sum(&parts[state]),
        slice_percent: (state > 0).then(|| spread(state)),
        slice_seconds: parts[state].iter().map(|m| m.seconds).collect(),
    });
    Ok((states, free_after_fill, trim_seconds, Some(rounds)))
}
