//! Counters and the statistics snapshot that `zdisk stats`, `/stats` and
//! `/metrics` report.
//!
//! [`Counters`] are cumulative and persist in every checkpoint root, so they
//! survive restarts. After a crash, counts since the last checkpoint are
//! lost except for what recovery replays. Everything else in [`Stats`] is
//! derived from the map and the segment table at the time of the snapshot.

use serde::{Deserialize, Serialize};

use crate::bytes::{ByteReader, ByteWriter};

macro_rules! counters {
    ($($id:literal => $name:ident: $doc:literal,)*) => {
        /// Cumulative event counters, persisted in the checkpoint root.
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
        #[serde(default)]
        pub struct Counters {
            $(#[doc = $doc] pub $name: u64,)*
        }

        impl Counters {
            /// Every counter's name and one-line meaning.
            pub const DOCS: &'static [(&'static str, &'static str)] =
                &[$((stringify!($name), $doc)),*];

            /// The counter called `name`.
            pub fn get(&self, name: &str) -> Option<u64> {
                match name {
                    $(stringify!($name) => Some(self.$name),)*
                    _ => None,
                }
            }

            /// Encodes as a count followed by (id, value) pairs, so that
            /// older and newer versions can read each other's roots.
            pub fn encode(&self, out: &mut ByteWriter) {
                let pairs = [$(($id, self.$name)),*];
                out.u16(pairs.len() as u16);
                for (id, value) in pairs {
                    out.u16(id);
                    out.u64(value);
                }
            }

            pub fn decode(input: &mut ByteReader) -> Result<Counters, String> {
                let mut counters = Counters::default();
                let count = input.u16()?;
                for _ in 0..count {
                    let id = input.u16()?;
                    let value = input.u64()?;
                    match id {
                        $($id => counters.$name = value,)*
                        _ => {}
                    }
                }
                Ok(counters)
            }
        }
    };
}

counters! {
    1 => host_write_bytes: "Bytes the host wrote with WRITE.",
    2 => host_read_bytes: "Bytes the host read.",
    3 => media_write_bytes: "Bytes written to the medium: host, GC, metadata, padding and staging.",
    4 => padding_bytes: "Bytes of padding written to fill partial pages at flushes.",
    5 => gc_write_bytes: "Bytes the cleaner rewrote (relocated records).",
    6 => gc_read_bytes: "Bytes the cleaner read from victim segments.",
    7 => meta_write_bytes: "Bytes of checkpoints and metadata slots written.",
    8 => segments_cleaned: "Segments reclaimed by the cleaner.",
    9 => checkpoints: "Checkpoints written.",
    10 => flushes: "FLUSH requests and FUA writes served.",
    11 => media_read_bytes: "Bytes read from the medium for host reads.",
    12 => host_trim_bytes: "Bytes the host trimmed.",
    13 => host_zero_bytes: "Bytes the host zeroed with WRITE_ZEROES.",
    14 => recoveries: "Starts that replayed the log after an unclean stop.",
    15 => damaged_blocks_found: "Blocks found damaged by reads, the cleaner or check.",
    16 => host_write_requests: "WRITE requests served.",
    17 => segment_tail_bytes: "Bytes of padding completing a segment's last page when the next record did not fit.",
    18 => staging_bytes: "Bytes written to staging slots at flushes (partial sectors, instead of padding).",
    20 => recompressed_blocks: "Blocks the cold-data pass rewrote with the stronger codec.",
    21 => recompress_in_bytes: "Stored bytes those blocks took before the cold-data pass.",
    22 => recompress_out_bytes: "Stored bytes those blocks take after it.",
}

/// Number of segments in each state.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct SegmentCounts {
    pub free: u64,
    pub open: u64,
    pub sealed: u64,
    pub checkpoint: u64,
    pub reclaimable: u64,
}

/// Wear of an emulated NAND drive's erase blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Wear {
    /// Erase blocks erased since the image was created (a segment erase
    /// counts one per plane).
    pub blocks_erased: u64,
    /// Fewest, most and mean erases of any one erase block.
    pub erase_count_min: u32,
    pub erase_count_max: u32,
    pub erase_count_mean: f64,
}

/// A point-in-time view of a volume, with the stable key names scripts use.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Stats {
    pub logical_size_bytes: u64,
    pub physical_size_bytes: u64,
    /// Logical bytes holding data (not zeros, not holes).
    pub mapped_bytes: u64,
    /// Logical bytes in the allocated-zero state.
    pub zero_bytes: u64,
    /// Bytes of live extents on the medium, record headers included.
    pub stored_bytes: u64,
    /// Bytes of the medium in use: metadata area plus written parts of non-free segments.
    pub physical_used_bytes: u64,
    /// Of `physical_used_bytes`, what cleaning would give back: dead
    /// records, range records and padding in segments in use, and whole
    /// cleaned segments awaiting reuse.
    #[serde(default)]
    pub reclaimable_bytes: u64,
    /// Of `physical_used_bytes`, the metadata area and the checkpoints'
    /// segments.
    #[serde(default)]
    pub metadata_bytes: u64,
    /// Stored bytes that could still be added once dead space is cleaned:
    /// the medium less metadata, live data and the free segments the
    /// cleaner and the next checkpoint keep in reserve.
    #[serde(default)]
    pub available_bytes: u64,
    /// `mapped_bytes / stored_bytes`; null while nothing is stored.
    pub compression_ratio: Option<f64>,
    pub host_write_bytes: u64,
    pub media_write_bytes: u64,
    pub padding_bytes: u64,
    /// Zeros completing a segment's last page when the next record did
    /// not fit (not caused by flushes; counted in `media_write_bytes`).
    pub segment_tail_bytes: u64,
    /// Bytes flushes wrote to staging slots instead of padding partial
    /// pages, on a file or block device (counted in `media_write_bytes`).
    pub staging_bytes: u64,
    /// `media_write_bytes / host_write_bytes`; null before the first write.
    pub write_amplification: Option<f64>,
    pub gc_write_bytes: u64,
    pub gc_read_bytes: u64,
    pub free_segments: u64,
    pub segments_cleaned: u64,
    pub segment_count: u64,
    pub segment_size_bytes: u64,
    pub page_size_bytes: u64,
    pub codec: String,
    pub gc_policy: String,
    /// Largest compression unit new writes use.
    pub unit_max_bytes: u64,
    /// When cold data is recompressed: off, idle or gc.
    pub recompress: String,
    /// Logical bytes the cold-data pass has rewritten.
    pub recompressed_bytes: u64,
    /// Stored bytes the cold-data pass saved (before minus after, over
    /// everything it rewrote, some of which may since have been overwritten).
    pub recompress_saved_bytes: u64,
    pub damaged_blocks: u64,
    /// RAM used by the logical-to-physical map: its leaves in RAM, the
    /// tree over all leaves (evicted ones included) and the bookkeeping of
    /// their pages.
    pub map_memory_bytes: u64,
    /// The map cache's bound on its leaves in RAM (`serve --map-cache`).
    pub map_cache_bytes: u64,
    /// Heap bytes of the map's leaves in RAM: what the bound applies to
    /// (dirty leaves stay until the next checkpoint, whatever the bound).
    pub map_resident_bytes: u64,
    /// Leaves of the map, and how many of them are paged out.
    pub map_leaves: u64,
    pub map_paged_leaves: u64,
    /// Since the volume opened: map lookups that found every leaf they
    /// needed in RAM, pages read back (leaves faulted in, and lookups
    /// that read a page without keeping its leaf), those lookups alone,
    /// and pages checkpoints wrote (a page per leaf per checkpoint).
    pub map_cache_hits: u64,
    pub map_cache_misses: u64,
    pub map_cache_peeks: u64,
    pub map_pages_written: u64,
    /// Segments by state: free, open, sealed, checkpoint, awaiting reuse.
    pub segments_by_state: SegmentCounts,
    /// Sealed segments by live fraction: bucket i counts segments that are
    /// between 10·i % and 10·(i+1) % live (the last bucket is exactly full).
    pub sealed_utilization_histogram: [u64; 11],
    pub counters: Counters,
    /// Erase counts of an emulated NAND drive; null on other media.
    #[serde(default)]
    pub wear: Option<Wear>,
    /// The medium's own counters (`Media::media_stats`), e.g. an
    /// object-store tier's `tier_lag_bytes`; flattened into the JSON.
    #[serde(flatten)]
    pub media: std::collections::BTreeMap<String, u64>,
    /// Help texts of `media`, for the Prometheus exposition.
    #[serde(skip)]
    pub media_help: std::collections::BTreeMap<String, &'static str>,
}

impl Stats {
    /// Prometheus text exposition of every numeric field.
    pub fn to_prometheus(&self) -> String {
        let mut out = String::new();
        let mut gauge = |name: &str, help: &str, value: f64| {
            out.push_str(&format!(
                "# HELP zdisk_{name} {help}\n# TYPE zdisk_{name} gauge\nzdisk_{name} {value}\n"
            ));
        };
        let ratio = |value: Option<f64>| value.unwrap_or(f64::NAN);
        gauge(
            "logical_size_bytes",
            "Logical size of the volume.",
            self.logical_size_bytes as f64,
        );
        gauge(
            "physical_size_bytes",
            "Size of the medium.",
            self.physical_size_bytes as f64,
        );
        gauge(
            "mapped_bytes",
            "Logical bytes holding data.",
            self.mapped_bytes as f64,
        );
        gauge(
            "zero_bytes",
            "Logical bytes allocated as zeros.",
            self.zero_bytes as f64,
        );
        gauge(
            "stored_bytes",
            "Bytes of live extents including headers.",
            self.stored_bytes as f64,
        );
        gauge(
            "physical_used_bytes",
            "Bytes of the medium in use.",
            self.physical_used_bytes as f64,
        );
        gauge(
            "reclaimable_bytes",
            "Bytes in use that cleaning would give back.",
            self.reclaimable_bytes as f64,
        );
        gauge(
            "metadata_bytes",
            "Bytes in use by metadata and checkpoints.",
            self.metadata_bytes as f64,
        );
        gauge(
            "available_bytes",
            "Stored bytes that could still be added.",
            self.available_bytes as f64,
        );
        gauge(
            "compression_ratio",
            "mapped_bytes / stored_bytes.",
            ratio(self.compression_ratio),
        );
        gauge(
            "write_amplification",
            "media_write_bytes / host_write_bytes.",
            ratio(self.write_amplification),
        );
        gauge(
            "unit_max_bytes",
            "Largest compression unit new writes use.",
            self.unit_max_bytes as f64,
        );
        gauge(
            "free_segments",
            "Segments free for writing.",
            self.free_segments as f64,
        );
        gauge(
            "segment_count",
            "Segments on the medium.",
            self.segment_count as f64,
        );
        gauge(
            "damaged_blocks",
            "Blocks currently marked damaged.",
            self.damaged_blocks as f64,
        );
        gauge(
            "map_memory_bytes",
            "RAM used by the block map.",
            self.map_memory_bytes as f64,
        );
        gauge(
            "map_cache_bytes",
            "Bound on the block map's leaves in RAM.",
            self.map_cache_bytes as f64,
        );
        gauge(
            "map_resident_bytes",
            "Heap bytes of the block map's leaves in RAM.",
            self.map_resident_bytes as f64,
        );
        gauge(
            "map_leaves",
            "Leaves of the block map.",
            self.map_leaves as f64,
        );
        gauge(
            "map_paged_leaves",
            "Leaves of the block map paged out to the medium.",
            self.map_paged_leaves as f64,
        );
        let mut counter = |name: &str, help: &str, value: u64| {
            out.push_str(&format!(
                "# HELP zdisk_{name} {help}\n# TYPE zdisk_{name} counter\nzdisk_{name} {value}\n"
            ));
        };
        counter(
            "map_cache_hits_total",
            "Map lookups that found their leaves in RAM, since the volume opened.",
            self.map_cache_hits,
        );
        counter(
            "map_cache_misses_total",
            "Map pages read back, since the volume opened.",
            self.map_cache_misses,
        );
        counter(
            "map_cache_peeks_total",
            "Map pages read back for one lookup, their leaves not kept in the cache, since the volume opened.",
            self.map_cache_peeks,
        );
        counter(
            "map_pages_written_total",
            "Map pages written by checkpoints, since the volume opened.",
            self.map_pages_written,
        );
        let c = &self.counters;
        counter(
            "host_write_bytes_total",
            "Bytes written by the host.",
            c.host_write_bytes,
        );
        counter(
            "host_read_bytes_total",
            "Bytes read by the host.",
            c.host_read_bytes,
        );
        counter(
            "media_write_bytes_total",
            "Bytes written to the medium.",
            c.media_write_bytes,
        );
        counter(
            "padding_bytes_total",
            "Padding bytes written at flushes.",
            c.padding_bytes,
        );
        counter(
            "segment_tail_bytes_total",
            "Padding bytes completing the last page of a segment.",
            c.segment_tail_bytes,
        );
        counter(
            "staging_bytes_total",
            "Bytes written to staging slots at flushes.",
            c.staging_bytes,
        );
        counter(
            "gc_write_bytes_total",
            "Bytes relocated by the cleaner.",
            c.gc_write_bytes,
        );
        counter(
            "gc_read_bytes_total",
            "Bytes read by the cleaner.",
            c.gc_read_bytes,
        );
        counter(
            "meta_write_bytes_total",
            "Checkpoint and metadata bytes written.",
            c.meta_write_bytes,
        );
        counter(
            "segments_cleaned_total",
            "Segments reclaimed by the cleaner.",
            c.segments_cleaned,
        );
        counter("checkpoints_total", "Checkpoints written.", c.checkpoints);
        counter("flushes_total", "Flushes served.", c.flushes);
        counter(
            "host_trim_bytes_total",
            "Bytes trimmed by the host.",
            c.host_trim_bytes,
        );
        counter(
            "host_zero_bytes_total",
            "Bytes zeroed by the host.",
            c.host_zero_bytes,
        );
        if let Some(wear) = &self.wear {
            counter(
                "blocks_erased_total",
                "Erase blocks erased.",
                wear.blocks_erased,
            );
            out.push_str(&format!(
                "# HELP zdisk_erase_count_max Most erases of one erase block.\n# TYPE zdisk_erase_count_max gauge\nzdisk_erase_count_max {}\n",
                wear.erase_count_max
            ));
        }
        for (name, value) in &self.media {
            let help = self
                .media_help
                .get(name)
                .copied()
                .unwrap_or("A counter of the medium.");
            out.push_str(&format!(
                "# HELP zdisk_{name} {help}\n# TYPE zdisk_{name} gauge\nzdisk_{name} {value}\n"
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_round_trip_and_skip_unknown_ids() {
        let counters = Counters {
            host_write_bytes: 10,
            padding_bytes: 3,
            segments_cleaned: 99,
            ..Counters::default()
        };
        let mut writer = ByteWriter::new();
        counters.encode(&mut writer);
        let decoded = Counters::decode(&mut ByteReader::new(&writer.buf)).unwrap();
        assert_eq!(decoded, counters);

        let mut future = ByteWriter::new();
        future.u16(2);
        future.u16(1);
        future.u64(5);
        future.u16(999);
        future.u64(6);
        let decoded = Counters::decode(&mut ByteReader::new(&future.buf)).unwrap();
        assert_eq!(decoded.host_write_bytes, 5);
    }

    #[test]
    fn every_counter_has_a_meaning_and_a_value_by_name() {
        let counters = Counters {
            flushes: 7,
            ..Counters::default()
        };
        assert_eq!(counters.get("flushes"), Some(7));
        assert_eq!(counters.get("nonsense"), None);
        let json = serde_json::to_value(counters).unwrap();
        let keys = json.as_object().unwrap();
        assert_eq!(keys.len(), Counters::DOCS.len());
        for (name, doc) in Counters::DOCS {
            assert!(keys.contains_key(*name), "{name}");
            assert!(doc.ends_with('.'), "{name}: {doc}");
        }
    }
}
