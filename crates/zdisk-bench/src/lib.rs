//! zdisk-bench: a storage microbenchmark with a few figures of merit that
//! anyone can rerun, on a real image in real time or on an emulated drive
//! in virtual time (`zdisk bench`).
//!
//! Scenarios (`scenarios/`, one file each): `sweep` (compressibility), `dirty` (clean /
//! dirty / after TRIM), `file-copy` (a QD1 copy of incompressible data
//! from a source drive in the same three states), `flush` (flush after every write, with and without
//! power-loss protection), `qd` (queue depth 1–32), `wa` (steady-state
//! write amplification under random overwrites, against theory),
//! `restart`, `sparse-wal` (a write-ahead log in the packed and the
//! sparse layout, `wal`), and `threads` (4 KiB reads and writes from 1,
//! 2, 4 … threads with the state lock's share of each operation, on a RAM
//! medium, `ram`). Results print as tables, and optionally as JSON
//! lines (one object per scenario, or per measurement for `sparse-wal`) and
//! a chart.

pub mod drive;
pub mod driver;
pub mod pattern;
pub mod plot;
pub mod ram;
pub mod scenarios;
pub mod wal;

use std::fmt;
use std::io::Write;
use std::path::PathBuf;

use drive::Drive;
use driver::Progress;
use scenarios::{Outcome, Settings};

/// A scenario by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    Sweep,
    Dirty,
    FileCopy,
    Flush,
    QueueDepth,
    WriteAmplification,
    Restart,
    SparseWal,
    Threads,
}

impl Scenario {
    pub fn parse(text: &str) -> Result<Scenario, String> {
        match text {
            "sweep" => Ok(Scenario::Sweep),
            "dirty" => Ok(Scenario::Dirty),
            "file-copy" => Ok(Scenario::FileCopy),
            "flush" => Ok(Scenario::Flush),
            "qd" => Ok(Scenario::QueueDepth),
            "wa" => Ok(Scenario::WriteAmplification),
            "restart" => Ok(Scenario::Restart),
            "sparse-wal" => Ok(Scenario::SparseWal),
            "threads" => Ok(Scenario::Threads),
            other => Err(format!(
                "unknown scenario {other:?}: use sweep, dirty, file-copy, flush, qd, wa, restart, \
                 sparse-wal or threads"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Scenario::Sweep => "sweep",
            Scenario::Dirty => "dirty",
            Scenario::FileCopy => "file-copy",
            Scenario::Flush => "flush",
            Scenario::QueueDepth => "qd",
            Scenario::WriteAmplification => "wa",
            Scenario::Restart => "restart",
            Scenario::SparseWal => "sparse-wal",
            Scenario::Threads => "threads",
        }
    }
}

pub struct BenchConfig {
    pub scenarios: Vec<Scenario>,
    pub settings: Settings,
    pub json: Option<PathBuf>,
    pub plot: Option<PathBuf>,
    pub progress: bool,
}

/// Checks, before a run that may take long, that its output files can be
/// written: a result lost at the end of a long run is the worst kind.
pub fn check_outputs(config: &BenchConfig) -> Result<(), String> {
    if let Some(path) = &config.plot {
        plot::check_extension(path)?;
    }
    for (flag, path) in [("--json", &config.json), ("--plot", &config.plot)] {
        if let Some(path) = path {
            check_writable(path).map_err(|e| format!("{flag} {}: {e}", path.display()))?;
        }
    }
    Ok(())
}

/// True if `path` can be written, without changing what is there: an
/// existing file is opened for writing (not truncated), a new one is
/// probed with a scratch file beside it.
fn check_writable(path: &std::path::Path) -> Result<(), String> {
    match std::fs::metadata(path) {
        Ok(metadata) if metadata.is_dir() => Err("is a directory".into()),
        Ok(_) => std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .map(|_| ())
            .map_err(|e| format!("cannot be written ({e})")),
        Err(_) => {
            let parent = match path.parent() {
                Some(parent) if !parent.as_os_str().is_empty() => parent,
                _ => std::path::Path::new("."),
            };
            if !parent.is_dir() {
                return Err(format!("{} is not a directory", parent.display()));
            }
            let probe = parent.join(format!(".zdisk-bench-probe-{}", std::process::id()));
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&probe)
                .map_err(|e| format!("cannot create a file in {} ({e})", parent.display()))?;
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
    }
}

/// Runs the scenarios on `drive`, printing tables to stdout.
pub fn run(drive: &dyn Drive, config: &BenchConfig) -> Result<Vec<(Scenario, Outcome)>, String> {
    check_outputs(config)?;
    let progress = Progress::new(config.progress);
    let mut outcomes = Vec::new();
    let siblings: &[&str] = if config.scenarios.contains(&Scenario::Dirty) {
        &scenarios::DIRTY_SIBLINGS
    } else {
        &[]
    };
    drive.preflight(siblings)?;
    say!("zdisk bench on {}", drive.describe())?;
    for &scenario in &config.scenarios {
        let started = std::time::Instant::now();
        let mut outcome = match scenario {
            Scenario::Sweep => scenarios::sweep(drive, &config.settings, &progress),
            Scenario::Dirty => scenarios::dirty(drive, &config.settings, &progress),
            Scenario::FileCopy => scenarios::file_copy(drive, &config.settings, &progress),
            Scenario::Flush => scenarios::flush(drive, &config.settings, &progress),
            Scenario::QueueDepth => scenarios::queue_depths(drive, &config.settings, &progress),
            Scenario::WriteAmplification => {
                scenarios::write_amplification(drive, &config.settings, &progress)
            }
            Scenario::Restart => scenarios::restart(drive, &config.settings, &progress),
            Scenario::SparseWal => scenarios::sparse_wal(drive, &config.settings, &progress),
            Scenario::Threads => scenarios::threads(drive, &config.settings, &progress),
        }
        .map_err(|e| format!("scenario {}: {e}", scenario.name()))?;
        let host_seconds = started.elapsed().as_secs_f64();
        for object in std::iter::once(&mut outcome.json)
            .chain(outcome.lines.iter_mut())
            .filter_map(|value| value.as_object_mut())
        {
            object.insert("drive".into(), drive.describe().into());
            object.insert("host_seconds".into(), host_seconds.into());
        }
        say!("\n{} ({host_seconds:.1} s)", scenario.name())?;
        print_out(format_args!("{}", render_table(&outcome.table)))?;
        for (caption, table) in &outcome.tables {
            say!("\n{caption}")?;
            print_out(format_args!("{}", render_table(table)))?;
        }
        outcomes.push((scenario, outcome));
    }
    if let Some(path) = &config.json {
        let mut file = std::fs::File::create(path)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        let mut objects = 0;
        for (_, outcome) in &outcomes {
            let lines = if outcome.lines.is_empty() {
                std::slice::from_ref(&outcome.json)
            } else {
                &outcome.lines[..]
            };
            for line in lines {
                writeln!(file, "{line}").map_err(|e| e.to_string())?;
                objects += 1;
            }
        }
        say!(
            "\nJSON written to {} ({objects} objects, one per line: one per scenario, \
             or per measurement for sparse-wal and threads)",
            path.display()
        )?;
    }
    if let Some(path) = &config.plot {
        plot::plot(&outcomes, &drive.describe(), path)?;
        say!("chart written to {}", path.display())?;
    }
    for path in drive.files_left() {
        say!(
            "bench: left {} (the image of the last scenario)",
            path.display()
        )?;
    }
    Ok(outcomes)
}

/// Writes to standard output; a failed write (a closed pipe, a full disk)
/// is an error for the caller, never a panic.
pub(crate) fn print_out(args: fmt::Arguments<'_>) -> Result<(), String> {
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_fmt(args)
        .and_then(|()| stdout.flush())
        .map_err(|e| format!("cannot write to standard output: {e}"))
}

/// `println!` through [`print_out`].
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::print_out(format_args!("{}\n", format_args!($($arg)*)))
    };
}
pub(crate) use say;

/// Renders rows as an aligned text table (first row is the header).
pub fn render_table(rows: &[Vec<String>]) -> String {
    let columns = rows.iter().map(|r| r.len()).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for (index, row) in rows.iter().enumerate() {
        let line: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(c, cell)| format!("{cell:>width$}", width = widths[c]))
            .collect();
        out.push_str(&format!("  {}\n", line.join("  ")));
        if index == 0 {
            let total: usize = widths.iter().sum::<usize>() + 2 * columns.saturating_sub(1);
            out.push_str(&format!("  {}\n", "-".repeat(total)));
        }
    }
    out
}
