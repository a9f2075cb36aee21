//! `zdisk stats`: an image's statistics, at rest or while it is served.
//!
//! A served image is locked, so its statistics come from its server,
//! through the control socket (`control.rs`); an image nobody serves is
//! opened read-only. The human output leads with what a person asks
//! first (how big, how much is stored, how much room is used and left,
//! what compression saves), then lists every key with its unit, and with
//! `--explain` what it means. The keys, units and meanings are
//! `zdisk_core::FIELDS`, which `/metrics` is generated from too: a test
//! holds it to the JSON and to the README's table.

use serde_json::Value;
use zdisk_core::units::format_size;
use zdisk_core::{Counters, Field, OpenOptions, Stats, FIELDS};

use crate::args::StatsArgs;
use crate::control::{self, AskError};
use crate::output::say;

pub fn run(args: &StatsArgs) -> Result<(), String> {
    let (stats, source) = match control::ask_stats(&args.image) {
        Ok(stats) => (stats, Source::Server),
        Err(AskError::Failed(message)) => return Err(message),
        Err(AskError::NotServed(why)) => (at_rest(args, &why)?, Source::Image),
    };
    if args.json {
        say!(
            "{}",
            serde_json::to_string_pretty(&stats).map_err(|e| e.to_string())?
        )?;
    } else {
        let header = match source {
            Source::Server => format!(
                "{}: being served; figures from its server",
                args.image.display()
            ),
            Source::Image => format!(
                "{}: not being served; figures from the image",
                args.image.display()
            ),
        };
        crate::output::write(format_args!("{header}\n{}", human(&stats, args.explain)))?;
    }
    Ok(())
}

/// Where the figures came from.
enum Source {
    Server,
    Image,
}

/// Reads the statistics of an image nobody serves through its control
/// socket (`why` says what the socket said).
fn at_rest(args: &StatsArgs, why: &str) -> Result<Stats, String> {
    let options = OpenOptions {
        read_only: true,
        background: false,
        ..OpenOptions::default()
    };
    let volume = crate::image::open(&args.image, options).map_err(|e| {
        if e.contains("in use by another zdisk process") {
            format!(
                "{e}, which answers no statistics ({why}): a server older than this zdisk, \
                 or a check, create or bench; a server started with --metrics ADDR answers \
                 at http://ADDR/stats"
            )
        } else {
            e
        }
    })?;
    Ok(volume.stats())
}

fn percent(part: u64, whole: u64) -> String {
    if whole == 0 {
        "-".to_string()
    } else {
        format!("{:.0}%", part as f64 * 100.0 / whole as f64)
    }
}

/// The summary a person reads first, then every key with its unit (and,
/// with `explain`, its meaning).
pub fn human(stats: &Stats, explain: bool) -> String {
    let size = format_size;
    let data = stats.mapped_bytes + stats.zero_bytes;
    let mut out = String::new();
    let mut line = |label: &str, text: String| out.push_str(&format!("{label:<16}{text}\n"));
    line("logical size", size(stats.logical_size_bytes));
    line(
        "data stored",
        format!(
            "{} written by clients ({} of data, {} of zeros), taking {}",
            size(data),
            size(stats.mapped_bytes),
            size(stats.zero_bytes),
            size(stats.stored_bytes)
        ),
    );
    line(
        "physical used",
        format!(
            "{} of {}: {} live, {} reclaimable, {} metadata",
            size(stats.physical_used_bytes),
            size(stats.physical_size_bytes),
            size(stats.stored_bytes),
            size(stats.reclaimable_bytes),
            size(stats.metadata_bytes)
        ),
    );
    line("available", size(stats.available_bytes));
    let savings = if data == 0 {
        "- (nothing written yet)".to_string()
    } else {
        format!(
            "{} ({} of data and zeros take {}; compression ratio {})",
            percent(data.saturating_sub(stats.stored_bytes), data),
            size(data),
            size(stats.stored_bytes),
            stats
                .compression_ratio
                .map_or("-".to_string(), |r| format!("{r:.2}"))
        )
    };
    line("savings", savings);
    out.push('\n');
    let json = serde_json::to_value(stats).unwrap_or(Value::Null);
    let mut entry = |key: &str, value: String, unit: &str, meaning: &str| {
        out.push_str(&format!("{key:<30} {value:<28} {unit}\n"));
        if explain {
            out.push_str(&format!("{:<4}{meaning}\n", ""));
        }
    };
    for field in FIELDS {
        if field.key == "counters" {
            continue;
        }
        let value = render(field, json.get(field.key).unwrap_or(&Value::Null));
        entry(field.key, value, field.unit, field.meaning);
    }
    for (name, doc) in Counters::DOCS {
        let value = stats.counters.get(name).unwrap_or(0);
        let unit = if name.ends_with("_bytes") {
            "bytes"
        } else {
            "count"
        };
        let value = if unit == "bytes" {
            format!("{value} ({})", size(value))
        } else {
            value.to_string()
        };
        entry(&format!("counters.{name}"), value, unit, doc);
    }
    // The medium's own counters (an object-store tier's, say).
    for (name, value) in &stats.media {
        let meaning = stats
            .media_help
            .get(name)
            .copied()
            .unwrap_or("a counter of the medium");
        let unit = if name.ends_with("_bytes") {
            "bytes"
        } else {
            "count"
        };
        entry(name, value.to_string(), unit, meaning);
    }
    if !explain {
        out.push_str("\n(zdisk stats --explain says what each key means)\n");
    }
    out
}

/// One key's value, readable.
fn render(field: &Field, value: &Value) -> String {
    match (field.key, value) {
        (_, Value::Null) => "-".to_string(),
        ("sealed_utilization_histogram", Value::Array(buckets)) => buckets
            .iter()
            .map(|count| count.to_string())
            .collect::<Vec<_>>()
            .join(" "),
        (_, Value::Object(members)) => members
            .iter()
            .map(|(name, value)| match value.as_f64() {
                Some(x) if value.is_f64() => format!("{name} {x:.2}"),
                _ => format!("{name} {value}"),
            })
            .collect::<Vec<_>>()
            .join(", "),
        (_, Value::String(text)) => text.clone(),
        (_, Value::Number(number)) => match (field.unit, number.as_u64()) {
            ("bytes", Some(bytes)) => format!("{bytes} ({})", format_size(bytes)),
            ("ratio", _) => number
                .as_f64()
                .map_or(number.to_string(), |r| format!("{r:.3}")),
            _ => number.to_string(),
        },
        (_, other) => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use zdisk_core::SegmentCounts;

    use super::*;

    /// A snapshot with the figures the tests read; every other key at its
    /// default, so that a new key needs nothing here.
    fn sample() -> Stats {
        Stats {
            logical_size_bytes: 8 << 30,
            physical_size_bytes: 4 << 30,
            mapped_bytes: 1 << 30,
            zero_bytes: 1 << 28,
            stored_bytes: 1 << 29,
            physical_used_bytes: 700 << 20,
            reclaimable_bytes: 180 << 20,
            metadata_bytes: 8 << 20,
            available_bytes: 3 << 30,
            compression_ratio: Some(2.0),
            host_write_bytes: 5 << 30,
            media_write_bytes: 1 << 30,
            write_amplification: Some(0.2),
            free_segments: 900,
            segments_cleaned: 3,
            segment_count: 1024,
            segment_size_bytes: 4 << 20,
            page_size_bytes: 4096,
            codec: "lz4".to_string(),
            gc_policy: "cost-benefit".to_string(),
            unit_max_bytes: 8192,
            recompress: "idle".to_string(),
            write_effort: "adaptive".to_string(),
            map_memory_bytes: 1234,
            map_cache_bytes: 64 << 20,
            map_resident_bytes: 1000,
            map_leaves: 3,
            map_cache_hits: 10,
            map_pages_written: 3,
            segments_by_state: SegmentCounts {
                free: 900,
                open: 2,
                sealed: 120,
                checkpoint: 2,
                reclaimable: 0,
            },
            sealed_utilization_histogram: [93, 0, 0, 0, 0, 0, 0, 0, 0, 27, 0],
            counters: Counters {
                host_write_bytes: 5 << 30,
                ..Counters::default()
            },
            ..Stats::default()
        }
    }

    #[test]
    fn every_key_has_a_unit_and_a_meaning_and_no_field_is_stale() {
        let json = serde_json::to_value(sample()).unwrap();
        let keys = json.as_object().unwrap();
        for key in keys.keys() {
            assert!(
                FIELDS.iter().any(|field| field.key == key),
                "{key} has no meaning in FIELDS"
            );
        }
        for field in FIELDS {
            assert!(keys.contains_key(field.key), "{} is not a key", field.key);
            assert!(!field.unit.is_empty() && !field.meaning.is_empty());
        }
    }

    /// `/metrics` keeps every metric it had before it was generated from
    /// `FIELDS`, under the same name and type, and exports every counter;
    /// no name comes twice, and each has its help and one sample.
    #[test]
    fn metrics_are_generated_from_the_schema_under_their_names() {
        let text = sample().to_prometheus();
        let gauges = [
            "logical_size_bytes",
            "physical_size_bytes",
            "mapped_bytes",
            "zero_bytes",
            "stored_bytes",
            "physical_used_bytes",
            "reclaimable_bytes",
            "metadata_bytes",
            "available_bytes",
            "compression_ratio",
            "write_amplification",
            "unit_max_bytes",
            "free_segments",
            "segment_count",
            "damaged_blocks",
            "map_memory_bytes",
            "map_cache_bytes",
            "map_resident_bytes",
            "map_leaves",
            "map_paged_leaves",
            "shared_blocks",
            "shared_contents",
            "distinct_blocks",
            "snapshots",
            "snapshot_kept_blocks",
            "snapshot_kept_bytes",
            "clones",
            "clone_blocks",
            "clone_bytes",
            "dedup_index_bytes",
            "dedup_index_bound_bytes",
            "recompress_pending_bytes",
            "fast_stored_bytes",
            "recompress_expected_saving_bytes",
        ];
        // Counted since the volume opened, not persisted.
        let since_open = [
            "map_cache_hits",
            "map_cache_misses",
            "map_cache_peeks",
            "map_pages_written",
            "map_pages_kept",
            "dedup_lookups",
            "dedup_found",
            "dedup_stale",
            "dedup_chapter_reads",
        ];
        let counters = [
            "host_write_bytes",
            "host_read_bytes",
            "media_write_bytes",
            "padding_bytes",
            "segment_tail_bytes",
            "staging_bytes",
            "gc_write_bytes",
            "gc_read_bytes",
            "meta_write_bytes",
            "segments_cleaned",
            "checkpoints",
            "flushes",
            "host_trim_bytes",
            "host_zero_bytes",
        ];
        let typed = |name: &str, kind: &str| format!("# TYPE zdisk_{name} {kind}\n");
        for name in gauges {
            assert!(text.contains(&typed(name, "gauge")), "{name}");
        }
        for name in since_open
            .iter()
            .chain(&counters)
            .chain(Counters::DOCS.iter().map(|(name, _)| name))
        {
            assert!(
                text.contains(&typed(&format!("{name}_total"), "counter")),
                "{name}"
            );
        }
        assert!(text.contains("zdisk_compression_ratio 2\n"));
        assert!(text.contains(&format!("zdisk_host_write_bytes_total {}\n", 5u64 << 30)));
        let mut seen = std::collections::HashSet::new();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len() % 3, 0);
        for triple in lines.chunks(3) {
            let name = triple[0]
                .strip_prefix("# HELP zdisk_")
                .unwrap()
                .split(' ')
                .next()
                .unwrap();
            assert!(seen.insert(name), "{name} twice");
            assert!(
                triple[0].len() > "# HELP zdisk_ ".len() + name.len(),
                "{name} has no help"
            );
            assert!(triple[1].starts_with(&format!("# TYPE zdisk_{name} ")));
            assert!(triple[2].starts_with(&format!("zdisk_{name} ")));
        }
        assert_eq!(
            seen.len(),
            gauges.len() + since_open.len() + Counters::DOCS.len(),
            "one metric per exported key and counter"
        );
    }

    #[test]
    fn the_readme_lists_every_key() {
        let readme = include_str!("../../../README.md");
        let table = &readme[readme.find("## Statistics").expect("a Statistics section")..];
        for field in FIELDS {
            assert!(
                table.contains(&format!("`{}`", field.key)),
                "README's statistics table lacks {}",
                field.key
            );
        }
    }

    #[test]
    fn the_summary_comes_first_and_explain_adds_meanings() {
        let stats = sample();
        let plain = human(&stats, false);
        let lines: Vec<&str> = plain.lines().collect();
        assert!(lines[0].starts_with("logical size") && lines[0].contains("8 GiB"));
        assert!(lines[1].starts_with("data stored") && lines[1].contains("1.25 GiB"));
        assert!(lines[2].starts_with("physical used") && lines[2].contains("180 MiB reclaimable"));
        assert!(lines[3].starts_with("available") && lines[3].contains("3 GiB"));
        // 1.25 GiB of data and zeros in 512 MiB: 60% saved.
        assert!(
            lines[4].starts_with("savings") && lines[4].contains("60%"),
            "{}",
            lines[4]
        );
        assert!(plain.contains("write_amplification"));
        assert!(!plain.contains("below 1 when compression"));
        let explained = human(&stats, true);
        assert!(explained.contains("below 1 when compression stores less"));
        assert!(explained.contains("counters.flushes"));
        assert!(explained.contains("93 0 0 0 0 0 0 0 0 27 0"));
    }
}
