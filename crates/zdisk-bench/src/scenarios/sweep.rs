//! `sweep`: sequential and random writes and reads for each data pattern.

use serde_json::json;

use crate::drive::{Drive, DriveOptions};
use crate::driver::{self, Access, OpKind, Progress, Workload};

use super::common::{count, logical_of, mb, ratio, round_down, Outcome, Settings, KIB, MIB};

/// Sequential and 4 KiB random writes, then reads, for each pattern.
pub fn sweep(
    drive: &dyn Drive,
    settings: &Settings,
    progress: &Progress,
) -> Result<Outcome, String> {
    let mut results = Vec::new();
    let mut table = vec![vec![
        "pattern".into(),
        "direction".into(),
        "MB/s".into(),
        "IOPS".into(),
        "latency µs".into(),
        "WA".into(),
    ]];
    for (index, pattern) in settings.patterns.iter().enumerate() {
        let mut target = drive.create(&DriveOptions::default())?;
        let region = round_down(settings.size_bytes.min(logical_of(&target) / 2), MIB).max(MIB);
        let random_total = (region / 4).max(MIB);
        let seed = settings.seed + index as u64 * 1000;
        let runs = [
            (
                "seq_write",
                Workload::new(OpKind::Write, Access::Sequential, 128 * KIB, pattern)
                    .region(0, region)
                    .total(region)
                    .queue_depth(8)
                    .label(format!("sweep {pattern} sequential write"))
                    .seed(seed),
            ),
            (
                "rand_write_4k",
                Workload::new(OpKind::Write, Access::Random, 4 * KIB, pattern)
                    .region(0, region)
                    .total(random_total)
                    .queue_depth(32)
                    .label(format!("sweep {pattern} random write"))
                    .seed(seed + 1),
            ),
            (
                "seq_read",
                Workload::new(OpKind::Read, Access::Sequential, 128 * KIB, pattern)
                    .region(0, region)
                    .total(region)
                    .queue_depth(8)
                    .label(format!("sweep {pattern} sequential read"))
                    .seed(seed + 2),
            ),
            (
                "rand_read_4k",
                Workload::new(OpKind::Read, Access::Random, 4 * KIB, pattern)
                    .region(0, region)
                    .total(random_total)
                    .queue_depth(32)
                    .label(format!("sweep {pattern} random read"))
                    .seed(seed + 3),
            ),
        ];
        for (direction, run) in runs {
            let measured = driver::run(&mut target, &run, progress)?;
            table.push(vec![
                pattern.to_string(),
                direction.into(),
                mb(measured.mb_s),
                count(measured.iops),
                format!("{:.0}", measured.latency_us),
                ratio(measured.write_amplification),
            ]);
            results.push(json!({
                "pattern": pattern.to_string(),
                "direction": direction,
                "block_bytes": run.block_bytes,
                "queue_depth": run.queue_depth,
                "mb_s": measured.mb_s,
                "iops": measured.iops,
                "latency_us": measured.latency_us,
                "write_amplification": measured.write_amplification,
            }));
        }
        let stats = target.volume.stats();
        results.push(json!({
            "pattern": pattern.to_string(),
            "direction": "stored",
            "compression_ratio": stats.compression_ratio,
        }));
    }
    Ok(Outcome {
        json: json!({ "scenario": "sweep", "results": results }),
        table,
        ..Outcome::default()
    })
}
