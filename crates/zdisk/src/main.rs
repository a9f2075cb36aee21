//! `zdisk`: the command-line front end. Thin by design: argument parsing,
//! wiring and printing; everything else lives in `zdisk-core` (the engine)
//! and `zdisk-nbd` (the protocol server).

mod args;
mod bench;
mod check;
mod image;
mod logging;
mod metrics;
mod nand;
mod output;
mod serve;
mod stats;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

use crate::args::{BenchArgs, CheckArgs, CreateArgs, ServeArgs, StatsArgs};

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
    /// Print an image's statistics.
    Stats(StatsArgs),
    /// Verify an image's invariants and every stored extent's checksum.
    Check(CheckArgs),
    /// Run storage benchmarks on an emulated drive (virtual time) or an image (real time).
    Bench(BenchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Create(args) => image::create_command(&args).map(|_| ExitCode::SUCCESS),
        Command::Serve(args) => serve::run(args).map(|_| ExitCode::SUCCESS),
        Command::Stats(args) => stats::run(&args).map(|_| ExitCode::SUCCESS),
        Command::Check(args) => check::run(&args),
        Command::Bench(args) => bench::run(&args).map(|_| ExitCode::SUCCESS),
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
