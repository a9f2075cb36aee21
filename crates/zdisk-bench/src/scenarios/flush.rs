//! `flush`: a flush after every 4 KiB write, with and without power-loss protection.

use serde_json::json;

use crate::drive::{Drive, DriveOptions};
use crate::driver::{self, Access, OpKind, Progress, Workload};
use crate::pattern::Pattern;

use super::common::{count, logical_of, ratio, Outcome, Settings, KIB, MIB};

/// 4 KiB writes, each followed by a flush, without and with power-loss protection.
pub fn flush(
    drive: &dyn Drive,
    settings: &Settings,
    progress: &Progress,
) -> Result<Outcome, String> {
    let mut table = vec![vec![
        "PLP".into(),
        "WA".into(),
        "padding MiB".into(),
        "IOPS".into(),
        "latency µs".into(),
    ]];
    let mut results = Vec::new();
    let variants: Vec<bool> = if drive.supports_plp() {
        vec![false, true]
    } else {
        vec![false]
    };
    let (_, page) = drive.segment_and_page();
    for plp in variants {
        let mut target = drive.create(&DriveOptions {
            plp: Some(plp),
            ..DriveOptions::default()
        })?;
        let logical = logical_of(&target);
        let total = (settings.size_bytes / 16)
            .clamp(256 * KIB, 64 * MIB)
            .min(logical / 2);
        let run = Workload::new(
            OpKind::Write,
            Access::Sequential,
            4 * KIB,
            &Pattern::Compressible { percent: 50 },
        )
        .region(0, logical / 2)
        .total(total)
        .queue_depth(1)
        .label(format!(
            "flush after each write (PLP {})",
            if plp { "on" } else { "off" }
        ))
        .seed(settings.seed)
        .flush_each_write();
        let measured = driver::run(&mut target, &run, progress)?;
        table.push(vec![
            if plp { "on" } else { "off" }.into(),
            ratio(measured.write_amplification),
            format!("{:.1}", measured.padding_bytes as f64 / MIB as f64),
            count(measured.iops),
            format!("{:.0}", measured.latency_us),
        ]);
        results.push(json!({
            "plp": plp,
            "write_amplification": measured.write_amplification,
            "padding_bytes": measured.padding_bytes,
            "host_write_bytes": measured.host_write_bytes,
            "media_write_bytes": measured.media_write_bytes,
            "iops": measured.iops,
            "latency_us": measured.latency_us,
        }));
    }
    if !drive.supports_plp() {
        table.push(vec![
            "on".into(),
            "n/a: this medium has no power-loss protection".into(),
            String::new(),
            String::new(),
            String::new(),
        ]);
    }
    Ok(Outcome {
        json: json!({
            "scenario": "flush",
            "page_size_bytes": page,
            "write_bytes": 4096,
            "results": results,
        }),
        table,
        ..Outcome::default()
    })
}
