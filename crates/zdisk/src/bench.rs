//! `zdisk bench`: argument parsing and drive construction for the
//! benchmark in `zdisk-bench`.

use zdisk_bench::drive::{Drive, ImageDrive, NandDrive, RamDrive};
use zdisk_bench::pattern::Pattern;
use zdisk_bench::scenarios::Settings;
use zdisk_bench::{BenchConfig, Scenario};

use crate::args::BenchArgs;

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
    if !(0.0..=1e6).contains(&args.copy_source_mb_s) {
        return Err("--copy-source-mb-s must be between 0 (unlimited) and 1000000".into());
    }
    if args.spare.iter().any(|s| !(0.01..=10.0).contains(s)) {
        return Err("--spare values must be between 0.01 and 10".into());
    }
    if args.threads.iter().any(|&t| !(1..=1024).contains(&t)) {
        return Err("--threads values must be between 1 and 1024".into());
    }
    if !(0.01..=86_400.0).contains(&args.seconds) {
        return Err("--seconds must be between 0.01 and 86400".into());
    }
    if args.profile.is_none() && (args.plp || args.recycle_cap_mb_s.is_some()) {
        return Err("--plp and --recycle-cap-mb-s apply to emulated drives (--profile)".into());
    }
    let physical = args
        .physical
        .unwrap_or(args.logical + (args.logical / 8).max(64 << 20));
    let drive: Box<dyn Drive> = match (&args.profile, &args.image) {
        (Some(profile), _) => nand_drive(profile, args)?,
        (None, None) if args.memory => Box::new(RamDrive {
            logical_bytes: args.logical,
            physical_bytes: physical,
            segment_bytes: args.segment_size,
            codec: args.codec.unwrap_or_default(),
            gc_policy: args.gc_policy,
        }),
        (None, Some(path)) => Box::new(ImageDrive {
            path: path.clone(),
            logical_bytes: args.logical,
            physical_bytes: physical,
            segment_bytes: args.segment_size,
            codec: args.codec.unwrap_or_default(),
            gc_policy: args.gc_policy,
            force: args.force,
            created: Default::default(),
        }),
        (None, None) => return Err("give --profile NAME, --image PATH or --memory".into()),
    };
    let config = BenchConfig {
        scenarios,
        settings: Settings {
            size_bytes: args.size,
            patterns,
            dirty_fill_random: args.dirty_fill == "random",
            spares: args.spare.clone(),
            copy_source_bytes_per_sec: (args.copy_source_mb_s > 0.0)
                .then_some((args.copy_source_mb_s * 1e6) as u64),
            threads: args.threads.clone(),
            seconds: args.seconds,
            seed: args.seed,
        },
        json: args.json.clone(),
        plot: args.plot.clone(),
        progress: !args.quiet,
    };
    zdisk_bench::run(drive.as_ref(), &config).map(|_| ())
}

/// An emulated drive of the named profile, with the command line's overrides.
fn nand_drive(profile: &str, args: &BenchArgs) -> Result<Box<dyn Drive>, String> {
    let params = crate::nand::params(profile, args.physical, args.plp, args.recycle_cap_mb_s)?;
    Ok(Box::new(NandDrive {
        params,
        codec: args.codec,
        gc_policy: args.gc_policy,
    }))
}
