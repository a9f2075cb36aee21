//! `zdisk`: the command-line front end. Thin by design: argument parsing,
//! wiring and printing; everything else lives in `zdisk-core` (the engine)
//! and `zdisk-nbd` (the protocol server).

mod args;
mod bench;
mod check;
mod control;
mod estimate;
mod image;
mod kv;
mod logging;
mod map;
mod metrics;
mod nand;
mod output;
mod serve;
mod snapshot;
mod stats;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

use crate::args::{
    BenchArgs, CheckArgs, CloneArgs, CompactArgs, CreateArgs, DeleteArgs, EstimateArgs, MapArgs,
    ServeArgs, SnapshotArgs, StatsArgs, VolumesArgs,
};

/// A software compressing drive, served over NBD.
#[derive(Parser, Debug)]
#[command(name = "zdisk", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Create a new image (a sparse file, or an existing block device).
    Create(CreateArgs),
    /// Serve an image over NBD, creating it with defaults if it does not exist.
    Serve(ServeArgs),
    /// Print an image's statistics (asking its server while it is served).
    Stats(StatsArgs),
    /// Take a read-only, crash-consistent snapshot of an image's volume (or of a clone).
    Snapshot(SnapshotArgs),
    /// Make a writable clone of a snapshot, in the same image.
    Clone(CloneArgs),
    /// List an image's volume, its snapshots and its clones.
    Volumes(VolumesArgs),
    /// Delete a snapshot or a clone; what it alone held becomes free.
    Delete(DeleteArgs),
    /// Reclaim every free byte now: clean segments until none has garbage worth it.
    Compact(CompactArgs),
    /// Verify an image's invariants and every stored extent's checksum.
    Check(CheckArgs),
    /// Predict what a file, disk image or block device would take on a volume, per codec.
    Estimate(EstimateArgs),
    /// Show how a volume's space is used: a table per region, and a picture with --png.
    Map(MapArgs),
    /// Run storage benchmarks on an emulated drive (virtual time) or an image (real time).
    Bench(BenchArgs),
    /// A table-less hash key-value store on an NBD export or a device, and
    /// its YCSB driver (case study 2 in docs/case-studies.md).
    Kv(kv::KvArgs),
}

/// Parses the command line. Help and version print as clap renders them;
/// any other mistake is one line on stderr and exit status 2, as every
/// other error is.
fn parse() -> Result<Cli, ExitCode> {
    use clap::error::ErrorKind;
    Cli::try_parse().map_err(|error| match error.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = error.print();
            ExitCode::SUCCESS
        }
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = error.print();
            ExitCode::from(2)
        }
        _ => {
            // clap's message: "error: ..." and maybe indented details and a
            // tip, then usage. Keep the message and details on one line.
            let text = error.render().to_string();
            let mut message = Vec::new();
            let mut tip = String::new();
            for line in text.lines().map(str::trim) {
                if line.is_empty() || line.starts_with("Usage:") {
                    break;
                }
                match line.strip_prefix("tip: ") {
                    Some(t) => tip = format!(" ({t})"),
                    None => message.push(line.trim_start_matches("error: ")),
                }
            }
            let message = message.join(" ");
            logging::line(format!("zdisk: error: {message}{tip}; see zdisk --help\n"));
            ExitCode::from(2)
        }
    })
}

fn main() -> ExitCode {
    let cli = match parse() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    let result = match cli.command {
        Command::Create(args) => image::create_command(&args).map(|_| ExitCode::SUCCESS),
        Command::Serve(args) => serve::run(args).map(|_| ExitCode::SUCCESS),
        Command::Stats(args) => stats::run(&args).map(|_| ExitCode::SUCCESS),
        Command::Snapshot(args) => snapshot::snapshot(&args).map(|_| ExitCode::SUCCESS),
        Command::Clone(args) => snapshot::clone(&args).map(|_| ExitCode::SUCCESS),
        Command::Volumes(args) => snapshot::volumes(&args).map(|_| ExitCode::SUCCESS),
        Command::Delete(args) => snapshot::delete(&args).map(|_| ExitCode::SUCCESS),
        Command::Compact(args) => snapshot::compact(&args).map(|_| ExitCode::SUCCESS),
        Command::Check(args) => check::run(&args),
        Command::Estimate(args) => estimate::run(&args).map(|_| ExitCode::SUCCESS),
        Command::Map(args) => map::run(&args).map(|_| ExitCode::SUCCESS),
        Command::Bench(args) => bench::run(&args).map(|_| ExitCode::SUCCESS),
        Command::Kv(args) => kv::run(args),
    };
    let code = match result {
        Ok(code) => code,
        Err(message) => {
            logging::line(format!("zdisk: error: {message}\n"));
            ExitCode::from(2)
        }
    };
    // A stuck stderr does not hold the exit for long.
    logging::finish(Duration::from_secs(2));
    code
}
