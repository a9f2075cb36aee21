//! ycsb-plot: charts the JSON lines of `scripts/kv-vs-rocksdb.sh` (one
//! object per engine and phase) with the bench's plotting: ops/s and p99
//! latency per workload, and zdisk's stored bytes and the driver's RSS
//! per engine, one colour per engine.
//!
//! Usage: ycsb-plot RESULTS.json CHART.png|svg [TITLE]

use std::path::Path;
use std::process::ExitCode;

use serde_json::Value;
use zdisk_bench::plot::{plot_grouped_panels, BarPanel};

fn run(args: &[String]) -> Result<(), String> {
    let [input, output, rest @ ..] = args else {
        return Err("usage: ycsb-plot RESULTS.json CHART.png|svg [TITLE]".into());
    };
    let title = rest
        .first()
        .cloned()
        .unwrap_or_else(|| "table-less hash store vs RocksDB on zdisk".into());
    let text = std::fs::read_to_string(input).map_err(|e| format!("{input}: {e}"))?;
    let rows: Vec<Value> = text
        .lines()
        .filter(|line| !line.trim().is_empty())
        .enumerate()
        .map(|(n, line)| serde_json::from_str(line).map_err(|e| format!("{input}:{}: {e}", n + 1)))
        .collect::<Result<_, _>>()?;
    if rows.is_empty() {
        return Err(format!("{input}: no results"));
    }
    let mut engines: Vec<String> = Vec::new();
    let mut workloads: Vec<String> = Vec::new();
    for row in &rows {
        let engine = row["engine"]
            .as_str()
            .ok_or("a row without engine")?
            .to_string();
        let workload = row["workload"]
            .as_str()
            .ok_or("a row without workload")?
            .to_string();
        if !engines.contains(&engine) {
            engines.push(engine);
        }
        if !workloads.contains(&workload) {
            workloads.push(workload);
        }
    }
    let value = |engine: &str, workload: &str, key: &str| -> f64 {
        rows.iter()
            .find(|r| r["engine"] == engine && r["workload"] == workload)
            .and_then(|r| r[key].as_f64())
            .unwrap_or(0.0)
    };
    let per_workload = |key: &str, scale: f64| -> Vec<(String, Vec<f64>)> {
        engines
            .iter()
            .map(|engine| {
                let values = workloads
                    .iter()
                    .map(|w| value(engine, w, key) * scale)
                    .collect();
                (engine.clone(), values)
            })
            .collect()
    };
    let last = workloads.last().cloned().unwrap_or_default();
    let first = workloads.first().cloned().unwrap_or_default();
    let space_groups = vec![
        format!("stored, after {first}"),
        format!("stored, after {last}"),
        "driver RSS, max".to_string(),
    ];
    let space = engines
        .iter()
        .map(|engine| {
            let rss = workloads
                .iter()
                .map(|w| value(engine, w, "rss_bytes"))
                .fold(0.0, f64::max);
            (
                engine.clone(),
                vec![
                    value(engine, &first, "stored_bytes") / 1e6,
                    value(engine, &last, "stored_bytes") / 1e6,
                    rss / 1e6,
                ],
            )
        })
        .collect();
    let panels = vec![
        BarPanel {
            caption: "throughput per workload".into(),
            unit: "ops/s".into(),
            groups: workloads.clone(),
            series: per_workload("ops_per_s", 1.0),
        },
        BarPanel {
            caption: "p99 latency per workload".into(),
            unit: "µs".into(),
            groups: workloads.clone(),
            series: per_workload("p99_us", 1.0),
        },
        BarPanel {
            caption: "zdisk stored bytes (physical) and driver RSS".into(),
            unit: "MB".into(),
            groups: space_groups,
            series: space,
        },
    ];
    plot_grouped_panels(&panels, &title, Path::new(output))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("ycsb-plot: {message}");
            ExitCode::FAILURE
        }
    }
}
