//! `zdisk`: the command-line front end. Thin by design: argument parsing,
//! wiring and printing; everything else lives in `zdisk-core` (the engine)
//! and `zdisk-nbd` (the protocol server).

mod bench;
mod check;
mod image;
mod metrics;
mod nand;
mod serve;
mod stats;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use zdisk_core::units::parse_size;
use zdisk_core::{Codec, GcPolicy};

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
    Bench(bench::BenchArgs),
}

pub(crate) fn size_arg(text: &str) -> Result<u64, String> {
    parse_size(text)
}

pub(crate) fn codec_arg(text: &str) -> Result<Codec, String> {
    Codec::parse(text)
}

pub(crate) fn policy_arg(text: &str) -> Result<GcPolicy, String> {
    GcPolicy::parse(text)
}

#[derive(Args, Debug, Clone)]
pub struct LayoutArgs {
    /// Logical size exposed to clients (K, M, G, T suffixes); may exceed the physical size.
    #[arg(long, value_parser = size_arg)]
    pub logical: Option<u64>,
    /// Physical size of the image file; defaults to the logical size for a
    /// file, and to the whole device for a block device.
    #[arg(long, value_parser = size_arg)]
    pub physical: Option<u64>,
    /// Segment size: the unit of log writing and cleaning (default: scaled
    /// to the medium, at most 4M).
    #[arg(long, value_parser = size_arg)]
    pub segment_size: Option<u64>,
}

#[derive(Args, Debug)]
pub struct CreateArgs {
    /// Path of the image file or block device.
    pub image: PathBuf,
    #[command(flatten)]
    pub layout: LayoutArgs,
    /// Compression codec: lz4 (default), zstd[:LEVEL], deflate[:LEVEL] or
    /// none; an emulated drive defaults to its controller's codec.
    #[arg(long, value_parser = codec_arg)]
    pub codec: Option<Codec>,
    /// Cleaner victim policy: greedy or cost-benefit.
    #[arg(long, value_parser = policy_arg, default_value = "cost-benefit")]
    pub gc_policy: GcPolicy,
    /// Overwrite an existing image file.
    #[arg(long)]
    pub force: bool,
    /// Create an emulated NAND drive with this profile (see docs/emulation.md):
    /// plain-tlc, sf1200, sf2500, csd2000, femu-default or tiny.
    #[arg(long)]
    pub nand: Option<String>,
    /// Emulated drive: model power-loss protection (flushes cost no padding).
    #[arg(long, requires = "nand")]
    pub plp: bool,
    /// Emulated drive: cap the recycling bandwidth (MB/s), imitating SandForce's lazy recycling.
    #[arg(long = "recycle-cap-mb-s", requires = "nand")]
    pub recycle_cap_mb_s: Option<f64>,
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Path of the image; created with defaults (printed) if missing.
    pub image: PathBuf,
    /// TCP address to listen on.
    #[arg(long, default_value = "127.0.0.1:10809", conflicts_with = "socket")]
    pub listen: String,
    /// Listen on a Unix socket instead of TCP.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Codec for new writes (remembered in the image).
    #[arg(long, value_parser = codec_arg)]
    pub codec: Option<Codec>,
    /// Cleaner victim policy (remembered in the image).
    #[arg(long, value_parser = policy_arg)]
    pub gc_policy: Option<GcPolicy>,
    /// Serve read-only: write requests fail with EPERM.
    #[arg(long)]
    pub read_only: bool,
    /// Serve statistics over HTTP at ADDR: /stats (JSON) and /metrics (Prometheus).
    #[arg(long)]
    pub metrics: Option<String>,
    /// Export name offered to clients (the default export "" always works too).
    #[arg(long, default_value = "zdisk")]
    pub export_name: String,
    /// Emulated NAND images: run the drive model in virtual time, without
    /// sleeping (clients see the host's speed, not the drive's).
    #[arg(long)]
    pub virtual_time: bool,
    /// Layout used only when the image has to be created.
    #[command(flatten)]
    pub layout: LayoutArgs,
}

#[derive(Args, Debug)]
pub struct StatsArgs {
    pub image: PathBuf,
    /// Print JSON with the stable key names.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct CheckArgs {
    pub image: PathBuf,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Drop map entries whose data is damaged (they then read as zeros), after listing them.
    #[arg(long)]
    pub repair: bool,
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
    match result {
        Ok(code) => code,
        Err(message) => {
            eprintln!("zdisk: error: {message}");
            ExitCode::from(2)
        }
    }
}
