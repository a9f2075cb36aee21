//! `qd`: 4 KiB random I/O at queue depths 1 to 32.

use serde_json::json;

use crate::drive::{Drive, DriveOptions};
use crate::driver::{self, Access, OpKind, Progress, Workload};
use crate::pattern::Pattern;

use super::common::{count, logical_of, round_down, Outcome, Settings, KIB, MIB};

/// 4 KiB random reads and writes at queue depths 1 to 32.
pub fn queue_depths(
    drive: &dyn Drive,
    settings: &Settings,
    progress: &Progress,
) -> Result<Outcome, String> {
    let mut target = drive.create(&DriveOptions::default())?;
    let region = round_down(settings.size_bytes.min(logical_of(&target) / 2), MIB).max(MIB);
    let random = Pattern::Random;
    let fill = Workload::new(OpKind::Write, Access::Sequential, 128 * KIB, &random)
        .region(0, region)
        .total(region)
        .queue_depth(8)
        .label("qd: preconditioning")
        .seed(settings.seed);
    driver::run(&mut target, &fill, progress)?;
    let modelled = drive.random_read_iops_model(1).is_some();
    let mut header = vec!["QD".to_string(), "read IOPS".into()];
    if modelled {
        header.extend(["model IOPS".into(), "Δ".into()]);
    }
    header.extend(["read µs".into(), "write IOPS".into(), "write µs".into()]);
    let mut table = vec![header];
    let mut results = Vec::new();
    let ops_bytes = (region / 8).clamp(4 * MIB, 256 * MIB);
    for qd in [1usize, 2, 4, 8, 16, 32] {
        let read = Workload::new(OpKind::Read, Access::Random, 4 * KIB, &random)
            .region(0, region)
            .total(ops_bytes)
            .queue_depth(qd)
            .label(format!("qd {qd} random read"))
            .seed(settings.seed + qd as u64);
        let read = driver::run(&mut target, &read, progress)?;
        let write = Workload::new(OpKind::Write, Access::Random, 4 * KIB, &random)
            .region(0, region)
            .total(ops_bytes)
            .queue_depth(qd)
            .label(format!("qd {qd} random write"))
            .seed(settings.seed + 100 + qd as u64);
        let write = driver::run(&mut target, &write, progress)?;
        let model = drive.random_read_iops_model(qd);
        let mut row = vec![qd.to_string(), count(read.iops)];
        if let Some(model) = model {
            row.push(format!("{model:.0}"));
            row.push(format!("{:+.1}%", (read.iops / model - 1.0) * 100.0));
        }
        row.extend([
            format!("{:.1}", read.latency_us),
            count(write.iops),
            format!("{:.1}", write.latency_us),
        ]);
        table.push(row);
        results.push(json!({
            "queue_depth": qd,
            "read_iops": read.iops,
            "read_iops_model": model,
            "read_latency_us": read.latency_us,
            "write_iops": write.iops,
            "write_latency_us": write.latency_us,
            "read_mb_s": read.mb_s,
            "write_mb_s": write.mb_s,
        }));
    }
    Ok(Outcome {
        json: json!({ "scenario": "qd", "results": results }),
        table,
        ..Outcome::default()
    })
}
