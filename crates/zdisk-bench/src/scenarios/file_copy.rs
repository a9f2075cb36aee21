//! `file-copy`: a QD1 copy of an already-compressed file (H.264 video)
//! onto the drive, clean, dirty and after TRIM, as in AnandTech's
//! SF-2500 preview.
//!
//! The file comes from another drive: after a TRIM of the whole volume
//! there is nothing left on this one to copy from. The source is read
//! one chunk at a time (QD1) at `--copy-source-mb-s` into two buffers,
//! and each chunk is written at QD1 as soon as it has been read and the
//! previous write is done, so reading the next chunk overlaps writing
//! this one, as a copy program does. The figure is the write side's:
//! bytes written over the time from the first read to the last write
//! made durable, with the background work the copy caused charged to it.
//! The states are prepared as the `dirty` scenario prepares them, and
//! run in sequence on one drive (on an image too).

use serde_json::json;

use crate::drive::{Drive, DriveOptions};
use crate::driver::{self, Access, Measured, OpKind, Progress, Workload};
use crate::pattern::Pattern;

use super::common::{mb, ratio, Outcome, Settings, MIB};
use super::dirty::DirtyPlan;

/// Bytes per read and per write of the copy. The review does not say what
/// its copy program used; 1 MiB is a guess of a 2011 copy engine's buffer.
pub const COPY_CHUNK_BYTES: u64 = MIB;

/// Default source rate, MB/s: fitted to the SF-2500 copy (157.5-158.2 MB/s
/// in every state while the same drive's AS-SSD writes ran at 198-230
/// MB/s), which only a ceiling outside the drive's write path explains.
pub const COPY_SOURCE_MB_S: f64 = 160.0;

/// Clean, dirty and after TRIM: a QD1 copy of incompressible data from a
/// source drive, measured on the write side.
pub fn file_copy(
    drive: &dyn Drive,
    settings: &Settings,
    progress: &Progress,
) -> Result<Outcome, String> {
    let mut target = drive.create(&DriveOptions::default())?;
    let plan = DirtyPlan::new(drive, &target, settings);
    let source = settings.copy_source_bytes_per_sec;
    let chunk = COPY_CHUNK_BYTES.min(plan.size);
    let copy = |label: &str, seed: u64| {
        Workload::new(OpKind::Write, Access::Sequential, chunk, &Pattern::Random)
            .region(0, plan.size)
            .total(plan.size)
            .queue_depth(1)
            .source(source)
            .settle()
            .label(format!("file-copy: {label}"))
            .seed(seed)
    };
    let clean = driver::run(&mut target, &copy("clean drive", plan.seed), progress)?;
    plan.fill(&mut target, progress)?;
    let dirty = driver::run(&mut target, &copy("dirty drive", plan.seed + 3), progress)?;
    plan.trim_all(&mut target)?;
    let after_trim = driver::run(&mut target, &copy("after TRIM", plan.seed + 4), progress)?;

    let source_mb_s = source.map(|rate| rate as f64 / 1e6);
    let states: [(&str, &Measured); 3] = [
        ("clean", &clean),
        ("dirty", &dirty),
        ("after TRIM", &after_trim),
    ];
    let mut table = vec![vec![
        "state".to_string(),
        "MB/s".into(),
        "% of source".into(),
        "write latency µs".into(),
        "WA".into(),
    ]];
    for (name, measured) in states {
        table.push(vec![
            name.to_string(),
            mb(measured.mb_s),
            source_mb_s.map_or("-".into(), |rate| {
                format!("{:.1}", 100.0 * measured.mb_s / rate)
            }),
            format!("{:.0}", measured.latency_us),
            ratio(measured.write_amplification),
        ]);
    }
    Ok(Outcome {
        json: json!({
            "scenario": "file-copy",
            "clean_mb_s": clean.mb_s,
            "dirty_mb_s": dirty.mb_s,
            "after_trim_mb_s": after_trim.mb_s,
            "source_mb_s": source_mb_s,
            "chunk_bytes": chunk,
            "copied_bytes": clean.bytes,
            "filled_logical_bytes": plan.logical,
            "write_latency_us": {
                "clean": clean.latency_us,
                "dirty": dirty.latency_us,
                "after_trim": after_trim.latency_us,
            },
            "clean_write_amplification": clean.write_amplification,
            "write_amplification": dirty.write_amplification,
            "after_trim_write_amplification": after_trim.write_amplification,
        }),
        table,
        ..Outcome::default()
    })
}
