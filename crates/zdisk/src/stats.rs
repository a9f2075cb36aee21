//! `zdisk stats`: statistics of an image at rest.

use zdisk_core::units::format_size;
use zdisk_core::{OpenOptions, Stats};

use crate::args::StatsArgs;
use crate::output::say;

pub fn run(args: &StatsArgs) -> Result<(), String> {
    let options = OpenOptions {
        read_only: true,
        background: false,
        ..OpenOptions::default()
    };
    let volume = crate::image::open(&args.image, options).map_err(|e| {
        if e.contains("in use by another zdisk process") {
            format!("{e}; while it is served, ask the server instead: curl http://ADDR/stats (start it with --metrics ADDR)")
        } else {
            e
        }
    })?;
    let stats = volume.stats();
    if args.json {
        say!(
            "{}",
            serde_json::to_string_pretty(&stats).map_err(|e| e.to_string())?
        )?;
    } else {
        crate::output::write(format_args!("{}", human(&stats)))?;
    }
    Ok(())
}

fn ratio(value: Option<f64>) -> String {
    value.map_or("-".to_string(), |v| format!("{v:.3}"))
}

/// A readable rendering of the stats, one `key: value` per line.
pub fn human(stats: &Stats) -> String {
    let size = |bytes: u64| format!("{bytes} ({})", format_size(bytes));
    let lines = [
        ("logical_size_bytes", size(stats.logical_size_bytes)),
        ("physical_size_bytes", size(stats.physical_size_bytes)),
        ("mapped_bytes", size(stats.mapped_bytes)),
        ("zero_bytes", size(stats.zero_bytes)),
        ("stored_bytes", size(stats.stored_bytes)),
        ("physical_used_bytes", size(stats.physical_used_bytes)),
        ("compression_ratio", ratio(stats.compression_ratio)),
        ("host_write_bytes", size(stats.host_write_bytes)),
        ("media_write_bytes", size(stats.media_write_bytes)),
        ("padding_bytes", size(stats.padding_bytes)),
        ("segment_tail_bytes", size(stats.segment_tail_bytes)),
        ("staging_bytes", size(stats.staging_bytes)),
        ("write_amplification", ratio(stats.write_amplification)),
        ("gc_write_bytes", size(stats.gc_write_bytes)),
        ("gc_read_bytes", size(stats.gc_read_bytes)),
        (
            "free_segments",
            format!("{} of {}", stats.free_segments, stats.segment_count),
        ),
        ("segments_cleaned", stats.segments_cleaned.to_string()),
        ("damaged_blocks", stats.damaged_blocks.to_string()),
        ("codec", stats.codec.clone()),
        ("gc_policy", stats.gc_policy.clone()),
        ("unit_max_bytes", size(stats.unit_max_bytes)),
        ("recompress", stats.recompress.clone()),
        ("recompressed_bytes", size(stats.recompressed_bytes)),
        ("recompress_saved_bytes", size(stats.recompress_saved_bytes)),
        ("map_memory_bytes", size(stats.map_memory_bytes)),
        ("map_cache_bytes", size(stats.map_cache_bytes)),
        ("map_resident_bytes", size(stats.map_resident_bytes)),
        (
            "map_leaves",
            format!(
                "{} ({} paged out)",
                stats.map_leaves, stats.map_paged_leaves
            ),
        ),
        ("map_cache_hits", stats.map_cache_hits.to_string()),
        ("map_cache_misses", stats.map_cache_misses.to_string()),
        ("map_pages_written", stats.map_pages_written.to_string()),
    ];
    let mut out = String::new();
    for (key, value) in lines {
        out.push_str(&format!("{key:<24}{value}\n"));
    }
    out
}
