//! Charts of benchmark results, drawn with plotters: one panel per
//! scenario, PNG or SVG by the file's extension. Text needs a TrueType
//! font; the DejaVu Sans of Debian's fonts-dejavu-core is used when found.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;
use serde_json::Value;

use crate::scenarios::Outcome;
use crate::Scenario;

const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

/// Makes the DejaVu font the charts' "sans-serif" (once per process).
pub fn register_font() -> Result<(), String> {
    static REGISTERED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            let bytes = FONT_PATHS
                .iter()
                .find_map(|path| std::fs::read(path).ok())
                .ok_or("no TrueType font found for chart text: install fonts-dejavu-core")?;
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| "the DejaVu font could not be loaded".to_string())
        })
        .clone()
}

/// Refuses a chart path that is neither .png nor .svg.
pub fn check_extension(path: &Path) -> Result<(), String> {
    match extension(path).as_str() {
        "png" | "svg" => Ok(()),
        _ => Err(format!(
            "{}: the chart file must end in .png or .svg",
            path.display()
        )),
    }
}

fn extension(path: &Path) -> String {
    path.extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase()
}

/// Draws every outcome into one chart file.
pub fn plot(outcomes: &[(Scenario, Outcome)], title: &str, path: &Path) -> Result<(), String> {
    struct Outcomes<'a>(&'a [(Scenario, Outcome)], &'a str);
    impl Chart for Outcomes<'_> {
        fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<(), String> {
            draw(root, self.0, self.1)
        }
    }
    let panels = outcomes.len().max(1);
    render(path, (900, 420 * panels as u32), &Outcomes(outcomes, title))
}

/// A chart that can be drawn on any plotters backend.
trait Chart {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<(), String>;
}

/// Draws `chart` into a PNG or SVG file, by the file's extension.
fn render(path: &Path, size: (u32, u32), chart: &impl Chart) -> Result<(), String> {
    check_extension(path)?;
    let extension = extension(path);
    register_font()?;
    let written = |e: &dyn std::fmt::Display| format!("cannot write {}: {e}", path.display());
    if extension == "png" {
        let root = BitMapBackend::new(path, size).into_drawing_area();
        chart.draw(&root)?;
        root.present().map_err(|e| written(&e))
    } else {
        let root = SVGBackend::new(path, size).into_drawing_area();
        chart.draw(&root)?;
        root.present().map_err(|e| written(&e))
    }
}

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    outcomes: &[(Scenario, Outcome)],
    title: &str,
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| format!("drawing failed: {e}");
    root.fill(&WHITE).map_err(err)?;
    let root = root
        .titled(&format!("zdisk bench: {title}"), ("sans-serif", 22))
        .map_err(err)?;
    let areas = root.split_evenly((outcomes.len().max(1), 1));
    for ((scenario, outcome), area) in outcomes.iter().zip(areas.iter()) {
        match scenario {
            Scenario::Sweep => sweep(area, &outcome.json)?,
            Scenario::Dirty | Scenario::FileCopy => {
                let title = match scenario {
                    Scenario::Dirty => "dirty drive: sequential incompressible writes",
                    _ => "QD1 copy of incompressible data",
                };
                let json = &outcome.json;
                let states = [
                    ("clean", "clean_mb_s"),
                    ("dirty", "dirty_mb_s"),
                    ("after TRIM", "after_trim_mb_s"),
                ];
                let values: Vec<(String, f64)> = states
                    .iter()
                    .map(|(label, key)| ((*label).into(), number(&json[*key])))
                    .collect();
                bars(area, title, "MB/s", &values)?
            }
            Scenario::Flush => {
                let values: Vec<(String, f64)> = outcome.json["results"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|r| {
                        let label = if r["plp"].as_bool() == Some(true) {
                            "PLP on"
                        } else {
                            "PLP off"
                        };
                        (label.to_string(), number(&r["write_amplification"]))
                    })
                    .collect();
                bars(
                    area,
                    "4 KiB writes, each flushed",
                    "write amplification",
                    &values,
                )?
            }
            Scenario::QueueDepth => queue_depth(area, &outcome.json)?,
            Scenario::Threads => {
                let values: Vec<(String, f64)> = outcome.json["results"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|r| {
                        let label =
                            format!("{} x{}", r["op"].as_str().unwrap_or("?"), r["threads"]);
                        (label, number(&r["ops_per_s"]))
                    })
                    .collect();
                bars(
                    area,
                    "4 KiB random operations by thread count",
                    "ops/s",
                    &values,
                )?
            }
            Scenario::SparseWal => sparse_wal(area, &outcome.json)?,
            Scenario::Restart => bars(
                area,
                "restart time",
                "seconds",
                &[
                    (
                        "after clean shutdown".into(),
                        number(&outcome.json["clean_restart_seconds"]),
                    ),
                    (
                        "after crash".into(),
                        number(&outcome.json["crash_restart_seconds"]),
                    ),
                ],
            )?,
            Scenario::WriteAmplification => {
                let rows: Vec<&Value> = outcome.json["results"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|r| r["workload"] == "uniform")
                    .collect();
                let mut spares: Vec<String> = Vec::new();
                for r in &rows {
                    let spare = format!("ρ = {}", r["spare"]);
                    if !spares.contains(&spare) {
                        spares.push(spare);
                    }
                }
                let pick = |policy: &str, key: &str| -> Vec<f64> {
                    spares
                        .iter()
                        .map(|spare| {
                            rows.iter()
                                .find(|r| {
                                    r["gc_policy"] == policy
                                        && format!("ρ = {}", r["spare"]) == *spare
                                })
                                .map_or(0.0, |r| number(&r[key]))
                        })
                        .collect()
                };
                let series = vec![
                    (
                        "greedy, measured".to_string(),
                        pick("greedy", "write_amplification"),
                    ),
                    (
                        "cost-benefit, measured".to_string(),
                        pick("cost-benefit", "write_amplification"),
                    ),
                    (
                        "greedy, theory".to_string(),
                        pick("greedy", "greedy_theory"),
                    ),
                ];
                grouped_bars(
                    area,
                    "steady-state uniform random overwrites",
                    "write amplification",
                    &spares,
                    &series,
                )?
            }
        }
    }
    Ok(())
}

fn number(value: &Value) -> f64 {
    value.as_f64().unwrap_or(0.0)
}

fn bars<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    caption: &str,
    unit: &str,
    values: &[(String, f64)],
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| format!("drawing failed: {e}");
    let top = values.iter().map(|(_, v)| *v).fold(0.0, f64::max).max(1e-9) * 1.15;
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..values.len().max(1) as f64, 0f64..top)
        .map_err(err)?;
    let labels: Vec<String> = values.iter().map(|(l, _)| l.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .y_desc(unit)
        .x_labels(values.len().max(1) * 2 + 1)
        .x_label_formatter(&|x| centred_label(&labels, *x))
        .draw()
        .map_err(err)?;
    for (index, (_, value)) in values.iter().enumerate() {
        let color = Palette99::pick(index).filled();
        let x = index as f64;
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(x + 0.15, 0.0), (x + 0.85, *value)],
                color,
            )))
            .map_err(err)?;
        chart
            .draw_series(std::iter::once(Text::new(
                format!("{value:.2}"),
                (x + 0.3, *value + top * 0.02),
                ("sans-serif", 14),
            )))
            .map_err(err)?;
    }
    Ok(())
}

fn sweep<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, json: &Value) -> Result<(), String> {
    let rows: Vec<&Value> = json["results"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["mb_s"].is_number())
        .collect();
    let mut directions: Vec<String> = Vec::new();
    let mut patterns: Vec<String> = Vec::new();
    for r in &rows {
        let direction = r["direction"].as_str().unwrap_or("?").to_string();
        let pattern = r["pattern"].as_str().unwrap_or("?").to_string();
        if !directions.contains(&direction) {
            directions.push(direction);
        }
        if !patterns.contains(&pattern) {
            patterns.push(pattern);
        }
    }
    let series: Vec<(String, Vec<f64>)> = patterns
        .iter()
        .map(|pattern| {
            let values = directions
                .iter()
                .map(|direction| {
                    rows.iter()
                        .find(|r| {
                            r["pattern"] == pattern.as_str() && r["direction"] == direction.as_str()
                        })
                        .map_or(0.0, |r| number(&r["mb_s"]))
                })
                .collect();
            (pattern.clone(), values)
        })
        .collect();
    grouped_bars(area, "compressibility sweep", "MB/s", &directions, &series)
}

/// Bars grouped along x (one group per label), one colour per series.
pub fn grouped_bars<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    caption: &str,
    unit: &str,
    groups: &[String],
    series: &[(String, Vec<f64>)],
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| format!("drawing failed: {e}");
    let top = series
        .iter()
        .flat_map(|(_, values)| values.iter().copied())
        .fold(0.0, f64::max)
        .max(1e-9)
        // Room above the bars for the legend, which grows with the series.
        * (1.15 + 0.05 * series.len() as f64);
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..groups.len().max(1) as f64, 0f64..top)
        .map_err(err)?;
    let labels = groups.to_vec();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .y_desc(unit)
        .x_labels(groups.len().max(1) * 2 + 1)
        .x_label_formatter(&|x| centred_label(&labels, *x))
        .draw()
        .map_err(err)?;
    let width = 0.8 / series.len().max(1) as f64;
    for (s, (name, values)) in series.iter().enumerate() {
        let color = Palette99::pick(s);
        chart
            .draw_series(values.iter().enumerate().map(|(g, value)| {
                let x = g as f64 + 0.1 + s as f64 * width;
                Rectangle::new([(x, 0.0), (x + width * 0.9, *value)], color.filled())
            }))
            .map_err(err)?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}

fn queue_depth<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    json: &Value,
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| format!("drawing failed: {e}");
    let rows: Vec<&Value> = json["results"].as_array().into_iter().flatten().collect();
    let series = |key: &str| -> Vec<(f64, f64)> {
        rows.iter()
            .map(|r| (number(&r["queue_depth"]).log2(), number(&r[key])))
            .collect()
    };
    let reads = series("read_iops");
    let writes = series("write_iops");
    let top = reads
        .iter()
        .chain(&writes)
        .map(|p| p.1)
        .fold(0.0, f64::max)
        .max(1.0)
        * 1.1;
    let mut chart = ChartBuilder::on(area)
        .caption("4 KiB random I/O by queue depth", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..5.2, 0f64..top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("queue depth")
        .y_desc("IOPS")
        .x_labels(6)
        .x_label_formatter(&|x| format!("{}", 2f64.powf(x.round()) as u64))
        .draw()
        .map_err(err)?;
    for (name, points, color) in [("read", reads, BLUE), ("write", writes, RED)] {
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
            .map_err(err)?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        chart
            .draw_series(
                points
                    .into_iter()
                    .map(|p| Circle::new(p, 4, color.filled())),
            )
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}

/// Left: media bytes the sparse layout saves per commit size, for each
/// drive configuration, beside the layout arithmetic. Right: the reclaim
/// run, logical bytes against stored bytes as commits go (log scale).
fn sparse_wal<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    json: &Value,
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| format!("drawing failed: {e}");
    let (width, _) = area.dim_in_pixel();
    let (left, right) = area.split_horizontally(width / 2);
    let rows: Vec<&Value> = json["results"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["layout"] == "sparse")
        .collect();
    let mut sizes: Vec<u64> = rows
        .iter()
        .filter_map(|r| r["commit_bytes"].as_u64())
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut configs: Vec<(bool, u64)> = Vec::new();
    for r in &rows {
        let config = (
            r["plp"] == true,
            r["commits_per_flush"].as_u64().unwrap_or(1),
        );
        if !configs.contains(&config) {
            configs.push(config);
        }
    }
    let pick = |plp: bool, per_flush: u64, key: &str| -> Vec<f64> {
        sizes
            .iter()
            .map(|&size| {
                rows.iter()
                    .find(|r| {
                        r["plp"] == plp
                            && r["commits_per_flush"] == per_flush
                            && r["commit_bytes"] == size
                    })
                    .map_or(0.0, |r| number(&r[key]).max(0.0))
            })
            .collect()
    };
    let mut series: Vec<(String, Vec<f64>)> = configs
        .iter()
        .map(|&(plp, per_flush)| {
            (
                format!("PLP {}, {per_flush}/flush", if plp { "on" } else { "off" }),
                pick(plp, per_flush, "reduction_percent"),
            )
        })
        .collect();
    if let Some(&(plp, _)) = configs.first() {
        series.push((
            "layout arithmetic, 1/flush".into(),
            pick(plp, 1, "model_reduction_percent"),
        ));
    }
    let groups: Vec<String> = sizes.iter().map(|s| format!("{s} B")).collect();
    grouped_bars(
        &left,
        "sparse vs packed WAL: media bytes saved",
        "% fewer media bytes",
        &groups,
        &series,
    )?;

    let runs: Vec<&Value> = json["reclaim"].as_array().into_iter().flatten().collect();
    // (name, points, colour) per line.
    type Line = (String, Vec<(f64, f64)>, RGBColor);
    let mut lines: Vec<Line> = Vec::new();
    for run in &runs {
        let trim = run["trim"] == true;
        let samples: Vec<&Value> = run["samples"].as_array().into_iter().flatten().collect();
        let points = |key: &str| -> Vec<(f64, f64)> {
            samples
                .iter()
                .map(|s| (number(&s["commits"]), number(&s[key]) / 1024.0))
                .filter(|p| p.1 > 0.0)
                .collect()
        };
        let (tag, in_use, stored) = if trim {
            ("trim", RED, RGBColor(230, 140, 0))
        } else {
            ("no trim", BLUE, RGBColor(0, 170, 200))
        };
        if trim {
            lines.push((
                "logical written".into(),
                points("logical_written_bytes"),
                BLACK,
            ));
        }
        lines.push((format!("{tag}: in use"), points("mapped_bytes"), in_use));
        lines.push((format!("{tag}: stored"), points("stored_bytes"), stored));
    }
    let all = lines.iter().flat_map(|(_, points, _)| points.iter());
    let (x_max, y_min, y_max) = all.fold((1.0f64, f64::MAX, 1.0f64), |(x, lo, hi), p| {
        (x.max(p.0), lo.min(p.1), hi.max(p.1))
    });
    let y_min = if y_min == f64::MAX { 1.0 } else { y_min / 2.0 };
    let mut chart = ChartBuilder::on(&right)
        .caption(
            "sparse WAL space: TRIM of checkpointed ranges",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        // Headroom for the legend.
        .build_cartesian_2d(0f64..x_max, (y_min..y_max * 40.0).log_scale())
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("commits")
        .y_desc("KiB (log scale)")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(err)?;
    for (name, points, colour) in lines {
        chart
            .draw_series(LineSeries::new(points, colour.stroke_width(2)))
            .map_err(err)?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}

/// The label of bar `i` at x = i + 0.5 (the bar's centre); other ticks are blank.
fn centred_label(labels: &[String], x: f64) -> String {
    let index = x.floor() as usize;
    if (x - index as f64 - 0.5).abs() < 0.01 {
        labels.get(index).cloned().unwrap_or_default()
    } else {
        String::new()
    }
}

/// One panel of grouped bars for [`plot_grouped_panels`].
pub struct BarPanel {
    pub caption: String,
    pub unit: String,
    pub groups: Vec<String>,
    pub series: Vec<(String, Vec<f64>)>,
}

/// Draws panels of grouped bars, one under the other, into one chart file
/// (PNG or SVG by extension): for results that come from outside
/// `zdisk bench`, such as the key-value comparison's JSON lines.
pub fn plot_grouped_panels(panels: &[BarPanel], title: &str, path: &Path) -> Result<(), String> {
    struct Panels<'a>(&'a [BarPanel], &'a str);
    impl Chart for Panels<'_> {
        fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<(), String> {
            draw_panels(root, self.0, self.1)
        }
    }
    let size = (900u32, 380 * panels.len().max(1) as u32);
    render(path, size, &Panels(panels, title))
}

fn draw_panels<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    panels: &[BarPanel],
    title: &str,
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| format!("drawing failed: {e}");
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(title, ("sans-serif", 22)).map_err(err)?;
    let areas = root.split_evenly((panels.len().max(1), 1));
    for (panel, area) in panels.iter().zip(areas.iter()) {
        grouped_bars(
            area,
            &panel.caption,
            &panel.unit,
            &panel.groups,
            &panel.series,
        )?;
    }
    Ok(())
}

/// The PostgreSQL fillfactor case study from the JSON lines of
/// `scripts/pg-fillfactor.py`, one object per run: left, by fillfactor, the
/// database's logical size beside the bytes each export keeps after the
/// timed run; right, pgbench's TPS on each export. A run without
/// `fillfactor`, `baseline`, `db_bytes`, `mapped_bytes`, `physical_bytes`
/// or `tps` is an error naming it.
pub fn pg_fillfactor(runs: &[Value], path: &Path) -> Result<(), String> {
    let runs = PgRuns::new(runs)?;
    render(path, (1200, 480), &runs)
}

/// One run of the fillfactor script: its keys, checked.
struct PgRun {
    fillfactor: u64,
    baseline: bool,
    db_bytes: f64,
    mapped_bytes: f64,
    physical_bytes: f64,
    tps: f64,
}

struct PgRuns {
    runs: Vec<PgRun>,
    /// Fillfactors in the order they first appear (the script's: 100 first).
    fillfactors: Vec<u64>,
    title: String,
}

impl PgRuns {
    fn new(json: &[Value]) -> Result<Self, String> {
        let mut runs = Vec::new();
        for (index, run) in json.iter().enumerate() {
            let key = |name: &str| -> Result<f64, String> {
                run[name]
                    .as_f64()
                    .ok_or_else(|| format!("run {}: no number `{name}`", index + 1))
            };
            runs.push(PgRun {
                fillfactor: run["fillfactor"]
                    .as_u64()
                    .ok_or_else(|| format!("run {}: no whole number `fillfactor`", index + 1))?,
                baseline: run["baseline"]
                    .as_bool()
                    .ok_or_else(|| format!("run {}: no true or false `baseline`", index + 1))?,
                db_bytes: key("db_bytes")?,
                mapped_bytes: key("mapped_bytes")?,
                physical_bytes: key("physical_bytes")?,
                tps: key("tps")?,
            });
        }
        let mut fillfactors: Vec<u64> = Vec::new();
        for run in &runs {
            if !fillfactors.contains(&run.fillfactor) {
                fillfactors.push(run.fillfactor);
            }
        }
        if fillfactors.is_empty() {
            return Err("no runs to draw".into());
        }
        let first = &json[0];
        let title = format!(
            "PostgreSQL fillfactor: pgbench scale {}, {} clients, {} s",
            first["scale"], first["clients"], first["seconds"]
        );
        Ok(PgRuns {
            runs,
            fillfactors,
            title,
        })
    }

    /// `value` of the run on the given export at each fillfactor; 0 where
    /// there is none (a run with `--no-baseline`, say).
    fn series(&self, baseline: bool, value: fn(&PgRun) -> f64) -> Vec<f64> {
        self.fillfactors
            .iter()
            .map(|&ff| {
                self.runs
                    .iter()
                    .find(|r| r.fillfactor == ff && r.baseline == baseline)
                    .map_or(0.0, value)
            })
            .collect()
    }
}

impl Chart for PgRuns {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<(), String> {
        let err = |e: DrawingAreaErrorKind<DB::ErrorType>| format!("drawing failed: {e}");
        root.fill(&WHITE).map_err(err)?;
        let root = root.titled(&self.title, ("sans-serif", 22)).map_err(err)?;
        let (width, _) = root.dim_in_pixel();
        let (left, right) = root.split_horizontally(width * 3 / 5);
        let groups: Vec<String> = self.fillfactors.iter().map(|f| format!("FF {f}")).collect();
        const MIB: f64 = (1u64 << 20) as f64;
        // The database is the same on both exports; zdisk's runs name it.
        let database = if self.runs.iter().any(|r| !r.baseline) {
            self.series(false, |r| r.db_bytes / MIB)
        } else {
            self.series(true, |r| r.db_bytes / MIB)
        };
        grouped_bars(
            &left,
            "sizes after the timed run",
            "MiB",
            &groups,
            &[
                ("database (pg_database_size)".into(), database),
                (
                    "plain export: allocated".into(),
                    self.series(true, |r| r.physical_bytes / MIB),
                ),
                (
                    "zdisk: mapped".into(),
                    self.series(false, |r| r.mapped_bytes / MIB),
                ),
                (
                    "zdisk: physical (stored)".into(),
                    self.series(false, |r| r.physical_bytes / MIB),
                ),
            ],
        )?;
        grouped_bars(
            &right,
            "pgbench TPC-B-like throughput",
            "transactions/s",
            &groups,
            &[
                ("zdisk".into(), self.series(false, |r| r.tps)),
                ("plain export".into(), self.series(true, |r| r.tps)),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fillfactor_run_without_a_key_is_an_error_naming_it() {
        let good = serde_json::json!({"fillfactor": 100, "baseline": false, "db_bytes": 1,
            "mapped_bytes": 2, "physical_bytes": 3, "tps": 4.5});
        let mut bad = good.clone();
        bad.as_object_mut().unwrap().remove("tps");
        let error =
            pg_fillfactor(&[good, bad], Path::new("unused.svg")).expect_err("a run without tps");
        assert_eq!(error, "run 2: no number `tps`");
        assert_eq!(
            pg_fillfactor(&[], Path::new("unused.svg")).expect_err("no runs"),
            "no runs to draw"
        );
    }
}
