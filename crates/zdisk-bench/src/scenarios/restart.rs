//! `restart`: restart time after a clean stop and after a crash.

use serde_json::json;

use crate::drive::{Drive, DriveOptions};
use crate::driver::{self, Access, OpKind, Progress, Workload};
use crate::pattern::Pattern;

use super::common::{logical_of, round_down, Outcome, Settings, KIB, MIB};

/// Restart time with data on the drive: after a clean shutdown, and after
/// a crash (the volume dropped without flushing or checkpointing, as
/// `kill -9` leaves it), with up to one checkpoint interval of log to replay.
pub fn restart(
    drive: &dyn Drive,
    settings: &Settings,
    progress: &Progress,
) -> Result<Outcome, String> {
    let reopen = drive
        .reopener()
        .ok_or("the restart scenario needs a drive that can be reopened (an image)")?;
    let mut target = drive.create(&DriveOptions::default())?;
    let logical = round_down(logical_of(&target), MIB);
    let size = round_down(settings.size_bytes.min(logical * 3 / 4), MIB).max(MIB);
    let pattern = Pattern::Compressible { percent: 50 };
    let fill = Workload::new(OpKind::Write, Access::Sequential, 128 * KIB, &pattern)
        .region(0, logical)
        .total(size)
        .queue_depth(8)
        .label("restart: writing data")
        .seed(settings.seed);
    driver::run(&mut target, &fill, progress)?;
    let stored = target.volume.stats();
    target.volume.close().map_err(|e| e.to_string())?;
    drop(target);

    let started = std::time::Instant::now();
    let target = reopen()?;
    let clean_seconds = started.elapsed().as_secs_f64();
    let clean_report = target.volume.open_report();

    // Write more, then crash: no flush, no checkpoint, buffers lost.
    let mut target = target;
    let more = (size / 4).max(MIB);
    let tail = Workload::new(OpKind::Write, Access::Random, 64 * KIB, &pattern)
        .region(0, logical)
        .total(more)
        .queue_depth(8)
        .label("restart: writing before the crash")
        .seed(settings.seed + 1);
    driver::run(&mut target, &tail, progress)?;
    target.volume.halt();
    drop(target);
    let started = std::time::Instant::now();
    let target = reopen()?;
    let crash_seconds = started.elapsed().as_secs_f64();
    let crash_report = target.volume.open_report();
    target.volume.close().map_err(|e| e.to_string())?;

    let table = vec![
        vec![
            "restart".into(),
            "seconds".into(),
            "segments replayed".into(),
            "records replayed".into(),
        ],
        vec![
            "after clean shutdown".into(),
            format!("{clean_seconds:.3}"),
            clean_report.replayed_segments.to_string(),
            clean_report.replayed_records.to_string(),
        ],
        vec![
            "after crash".into(),
            format!("{crash_seconds:.3}"),
            crash_report.replayed_segments.to_string(),
            crash_report.replayed_records.to_string(),
        ],
    ];
    Ok(Outcome {
        json: json!({
            "scenario": "restart",
            "data_bytes": stored.mapped_bytes,
            "stored_bytes": stored.stored_bytes,
            "clean_restart_seconds": clean_seconds,
            "crash_restart_seconds": crash_seconds,
            "written_after_checkpoint_bytes": more,
            "crash_replayed_segments": crash_report.replayed_segments,
            "crash_replayed_records": crash_report.replayed_records,
        }),
        table,
        ..Outcome::default()
    })
}
