//! `zdisk bench`: argument parsing and drive construction for the
//! benchmark in `zdisk-bench`.

use std::path::PathBuf;

use clap::Args;

use zdisk_bench::drive::{Drive, ImageDrive};
use zdisk_bench::pattern::Pattern;
use zdisk_bench::scenarios::Settings;
use zdisk_bench::{BenchConfig, Scenario};
use zdisk_core::{Codec, GcPolicy};

use crate::{codec_arg, policy_arg, size_arg};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Emulated drive profile, run in virtual time (see docs/emulation.md).
    #[arg(long, conflicts_with = "image", required_unless_present = "image")]
    pub profile: Option<String>,
    /// A real image (file or block device) to benchmark in real time. It is
    /// recreated for every scenario: its contents are lost.
    #[arg(long)]
    pub image: Option<PathBuf>,
    /// Scenarios, comma-separated: sweep, dirty, flush, qd, wa, restart.
    #[arg(long, value_delimiter = ',', required = true)]
    pub scenario: Vec<String>,
    /// Write one JSON object per scenario (JSON lines) to FILE.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw a chart to FILE (.png or .svg).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Bytes moved per measurement (scaled down to fit the drive).
    #[arg(long, value_parser = size_arg, default_value = "256M")]
    pub size: u64,
    /// Data patterns for the sweep: zeros, random, compressible:N, file:PATH (repeatable).
    #[arg(long = "pattern")]
    pub patterns: Vec<String>,
    /// Emulated drives: model power-loss protection.
    #[arg(long)]
    pub plp: bool,
    /// Emulated drives: cap the recycling bandwidth, imitating SandForce's lazy recycling.
    #[arg(long = "recycle-cap-mb-s")]
    pub recycle_cap_mb_s: Option<f64>,
    /// Dirty the drive with random 4 KiB writes instead of sequential ones.
    #[arg(long, default_value = "sequential", value_parser = ["sequential", "random"])]
    pub dirty_fill: String,
    /// Spare factors for the wa scenario (physical space / live data − 1).
    #[arg(long, value_delimiter = ',', default_value = "0.28,0.07")]
    pub spare: Vec<f64>,
    /// Logical size of an image drive.
    #[arg(long, value_parser = size_arg, default_value = "1G")]
    pub logical: u64,
    /// Physical size of an image drive (or of the emulated NAND).
    #[arg(long, value_parser = size_arg)]
    pub physical: Option<u64>,
    /// Segment size of an image drive.
    #[arg(long, value_parser = size_arg, default_value = "1M")]
    pub segment_size: u64,
    /// Codec (image drives; emulated drives use their controller's).
    #[arg(long, value_parser = codec_arg)]
    pub codec: Option<Codec>,
    #[arg(long, value_parser = policy_arg, default_value = "cost-benefit")]
    pub gc_policy: GcPolicy,
    /// Seed for data and offsets.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Do not print progress.
    #[arg(long)]
    pub quiet: bool,
}

pub fn run(args: &BenchArgs) -> Result<(), String> {
    let scenarios = args
        .scenario
        .iter()
        .map(|s| Scenario::parse(s.trim()))
        .collect::<Result<Vec<_>, _>>()?;
    let mut patterns = args
        .patterns
        .iter()
        .map(|p| Pattern::parse(p))
        .collect::<Result<Vec<_>, _>>()?;
    if patterns.is_empty() {
        patterns = vec![
            Pattern::Zeros,
            Pattern::Random,
            Pattern::Compressible { percent: 50 },
            Pattern::Compressible { percent: 75 },
        ];
    }
    if args.spare.iter().any(|s| !(0.01..=10.0).contains(s)) {
        return Err("--spare values must be between 0.01 and 10".into());
    }
    let drive: Box<dyn Drive> = match (&args.profile, &args.image) {
        (Some(profile), _) => crate::nand::bench_drive(profile, args)?,
        (None, Some(path)) => {
            if args.plp || args.recycle_cap_mb_s.is_some() {
                return Err(
                    "--plp and --recycle-cap-mb-s apply to emulated drives (--profile)".into(),
                );
            }
            Box::new(ImageDrive {
                path: path.clone(),
                logical_bytes: args.logical,
                physical_bytes: args
                    .physical
                    .unwrap_or(args.logical + (args.logical / 8).max(64 << 20)),
                segment_bytes: args.segment_size,
                codec: args.codec.unwrap_or_default(),
                gc_policy: args.gc_policy,
            })
        }
        (None, None) => return Err("give --profile NAME or --image PATH".into()),
    };
    let config = BenchConfig {
        scenarios,
        settings: Settings {
            size_bytes: args.size,
            patterns,
            dirty_fill_random: args.dirty_fill == "random",
            spares: args.spare.clone(),
            seed: args.seed,
        },
        json: args.json.clone(),
        plot: args.plot.clone(),
        progress: !args.quiet,
    };
    zdisk_bench::run(drive.as_ref(), &config).map(|_| ())
}
