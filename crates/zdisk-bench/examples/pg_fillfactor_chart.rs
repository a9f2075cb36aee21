//! Draws the PostgreSQL fillfactor case study's chart from the JSON lines
//! `scripts/pg-fillfactor.py --json FILE` wrote:
//!
//! ```sh
//! cargo run --release -p zdisk-bench --example pg_fillfactor_chart -- runs.jsonl chart.png
//! ```
//!
//! The chart (PNG or SVG, by the extension) is `zdisk_bench::plot::pg_fillfactor`'s.

use std::path::Path;
use std::process::ExitCode;

use serde_json::Value;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [json, chart] = &args[..] else {
        eprintln!("usage: pg_fillfactor_chart RUNS.jsonl CHART.png|CHART.svg");
        return ExitCode::from(2);
    };
    match draw(Path::new(json), Path::new(chart)) {
        Ok(()) => {
            println!("chart written to {chart}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("pg_fillfactor_chart: {error}");
            ExitCode::FAILURE
        }
    }
}

fn draw(json: &Path, chart: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(json)
        .map_err(|e| format!("cannot read {}: {e}", json.display()))?;
    let runs = text
        .lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(index, line)| {
            serde_json::from_str::<Value>(line)
                .map_err(|e| format!("{} line {}: {e}", json.display(), index + 1))
        })
        .collect::<Result<Vec<Value>, String>>()?;
    zdisk_bench::plot::pg_fillfactor(&runs, chart)
}
