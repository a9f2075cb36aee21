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
    23 => dedup_blocks: "Blocks written whose content was stored already: shared, not stored again.",
    24 => dedup_saved_bytes: "Stored bytes those blocks did not take: the stored share of each content they share.",
    25 => dedup_index_write_bytes: "Bytes of dedup index chapters written to the medium (counted in media_write_bytes too).",
    26 => host_write_fast_bytes: "Of host_write_bytes, the bytes written below full effort (compressed fast, or stored raw for the idle pass) because compression could not keep up (issue #27).",
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

/// What one clone wrote, from the map's counts of its key space (O(1)).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CloneStats {
    pub name: String,
    /// The snapshot it was made from.
    pub snapshot: String,
    /// Blocks it wrote since it was made (data, damage and zeros), the
    /// zeros among them, and the stored bytes of their records.
    pub own_blocks: u64,
    pub own_zero_blocks: u64,
    pub own_bytes: u64,
}

/// A point-in-time view of a volume, with the stable key names scripts use.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
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
    /// How hard host writes compress: adaptive, full, fast or deferred
    /// (issue #27).
    pub write_effort: String,
    /// Of `host_write_bytes`, the bytes written below full effort (fast,
    /// or raw for the idle pass).
    pub host_write_fast_bytes: u64,
    /// Stored bytes the cold-data pass has yet to rewrite.
    pub recompress_pending_bytes: u64,
    /// Of those, bytes written below full effort (estimated per segment): the
    /// pass rewrites them first.
    pub fast_stored_bytes: u64,
    /// What rewriting `recompress_pending_bytes` is expected to save, at
    /// the ratio the pass's rewrites have had so far; `None` until it has
    /// rewritten something.
    pub recompress_expected_saving_bytes: Option<u64>,
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
    /// and pages checkpoints wrote (a page per changed or moved leaf per
    /// checkpoint) and kept where an earlier checkpoint wrote them.
    pub map_cache_hits: u64,
    pub map_cache_misses: u64,
    pub map_cache_peeks: u64,
    pub map_pages_written: u64,
    pub map_pages_kept: u64,
    /// Blocks that share their stored content with other blocks (a
    /// reference each), and the contents they share (docs/sharing.md).
    pub shared_blocks: u64,
    pub shared_contents: u64,
    /// Stored contents: blocks holding data, counting each shared content
    /// once.
    pub distinct_blocks: u64,
    /// Snapshots of the volume, and the entries they keep that the volume
    /// has changed since (blocks, and the stored bytes of those not
    /// shared): what the snapshots cost beyond the volume.
    pub snapshots: u64,
    pub snapshot_kept_blocks: u64,
    pub snapshot_kept_bytes: u64,
    /// Clones (writable volumes made from snapshots), and the blocks they
    /// wrote since (data, damage and zeros: their own entries) with the
    /// stored bytes of those not shared: what the clones cost beyond the
    /// snapshots they share the rest with. Counted as the map changes, so
    /// reading them costs nothing.
    pub clones: u64,
    pub clone_blocks: u64,
    pub clone_bytes: u64,
    /// The same per clone, oldest first.
    #[serde(default)]
    pub clone_volumes: Vec<CloneStats>,
    /// Deduplication of new writes: on or off; the index's RAM and its
    /// bound (`--dedup-cache`); since the volume opened, the non-zero
    /// blocks written that were looked up, those found stored already
    /// (by the index or earlier in their own request), those whose
    /// content was gone by the time they were written, and chapters of
    /// the index read back from the medium.
    pub dedup: String,
    pub dedup_index_bytes: u64,
    pub dedup_index_bound_bytes: u64,
    pub dedup_lookups: u64,
    pub dedup_found: u64,
    pub dedup_stale: u64,
    pub dedup_chapter_reads: u64,
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

/// How a key of [`Stats`] appears in the Prometheus exposition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    /// Not exported: a name, a geometry figure, a structure, or a copy of
    /// a counter that [`Counters`] exports.
    None,
    /// A gauge `zdisk_KEY`, with its HELP text.
    Gauge(&'static str),
    /// A counter `zdisk_KEY_total`, with its HELP text.
    Counter(&'static str),
}

/// One top-level key of [`Stats`]: its unit and meaning (for `zdisk stats`,
/// its `--explain` and the README's table) and its Prometheus metric. This
/// table is the one place a statistic is described: the JSON is [`Stats`]'
/// own serialisation, and `zdisk stats` and [`Stats::to_prometheus`] are
/// generated from it. A counter of [`Counters`] is described once, in the
/// `counters!` list.
pub struct Field {
    pub key: &'static str,
    pub unit: &'static str,
    pub meaning: &'static str,
    pub metric: Metric,
    /// The value exported, for keys with a metric (NaN: none yet).
    pub value: fn(&Stats) -> f64,
}

/// A field that is exported: `metric` with `value`.
const fn field(
    key: &'static str,
    unit: &'static str,
    meaning: &'static str,
    metric: Metric,
    value: fn(&Stats) -> f64,
) -> Field {
    Field {
        key,
        unit,
        meaning,
        metric,
        value,
    }
}

/// A field that is not exported to Prometheus.
const fn shown(key: &'static str, unit: &'static str, meaning: &'static str) -> Field {
    Field {
        key,
        unit,
        meaning,
        metric: Metric::None,
        value: |_| f64::NAN,
    }
}

fn or_nan(ratio: Option<f64>) -> f64 {
    ratio.unwrap_or(f64::NAN)
}

use Metric::{Counter, Gauge};

/// Every top-level key of [`Stats`]' JSON, in the order `zdisk stats`
/// prints them (the medium's own counters, flattened in, excepted).
#[rustfmt::skip]
pub const FIELDS: &[Field] = &[
    field("logical_size_bytes", "bytes", "size clients see",
        Gauge("Logical size of the volume."), |s| s.logical_size_bytes as f64),
    field("physical_size_bytes", "bytes", "size of the image file or device",
        Gauge("Size of the medium."), |s| s.physical_size_bytes as f64),
    field("mapped_bytes", "bytes", "logical bytes holding data (not holes, not zeros)",
        Gauge("Logical bytes holding data."), |s| s.mapped_bytes as f64),
    field("zero_bytes", "bytes", "logical bytes allocated as zeros (written zeros, WRITE_ZEROES with NO_HOLE); they take no space",
        Gauge("Logical bytes allocated as zeros."), |s| s.zero_bytes as f64),
    field("stored_bytes", "bytes", "bytes of live extents on the medium, record headers included: the space the data takes",
        Gauge("Bytes of live extents including headers."), |s| s.stored_bytes as f64),
    field("physical_used_bytes", "bytes", "allocated: metadata area plus the written part of every segment in use (live and dead data)",
        Gauge("Bytes of the medium in use."), |s| s.physical_used_bytes as f64),
    field("reclaimable_bytes", "bytes", "of the allocated bytes, what cleaning gives back: dead records and padding, and cleaned segments awaiting reuse",
        Gauge("Bytes in use that cleaning would give back."), |s| s.reclaimable_bytes as f64),
    field("metadata_bytes", "bytes", "of the allocated bytes, the metadata area and the checkpoints",
        Gauge("Bytes in use by metadata and checkpoints."), |s| s.metadata_bytes as f64),
    field("available_bytes", "bytes", "stored bytes that still fit once dead space is cleaned (the medium less metadata, live data and the cleaner's reserve)",
        Gauge("Stored bytes that could still be added."), |s| s.available_bytes as f64),
    field("compression_ratio", "ratio", "mapped_bytes / stored_bytes; null while nothing is stored",
        Gauge("mapped_bytes / stored_bytes."), |s| or_nan(s.compression_ratio)),
    shown("host_write_bytes", "bytes", "bytes clients wrote"),
    shown("media_write_bytes", "bytes", "bytes written to the medium: host data after compression, cleaning, checkpoints, padding, staging"),
    shown("padding_bytes", "bytes", "zeros written to complete partial pages at flushes (emulated drives without power-loss protection, and at a clean shutdown)"),
    shown("segment_tail_bytes", "bytes", "zeros completing a segment's last page when the next record did not fit"),
    shown("staging_bytes", "bytes", "bytes flushes wrote to staging slots on a file or block device: the partial last sector, instead of padding a page"),
    field("write_amplification", "ratio", "media_write_bytes / host_write_bytes; below 1 when compression stores less than the host wrote (0.13-0.23 under pgbench), above 1 from cleaning, checkpoints and padding; null before the first write",
        Gauge("media_write_bytes / host_write_bytes."), |s| or_nan(s.write_amplification)),
    shown("gc_write_bytes", "bytes", "bytes the cleaner and the idle pass relocated"),
    shown("gc_read_bytes", "bytes", "bytes the cleaner and the idle pass read"),
    field("free_segments", "segments", "segments ready for writing",
        Gauge("Segments free for writing."), |s| s.free_segments as f64),
    shown("segments_cleaned", "segments", "segments the cleaner and the idle pass have reclaimed"),
    field("segment_count", "segments", "segments on the medium",
        Gauge("Segments on the medium."), |s| s.segment_count as f64),
    shown("segment_size_bytes", "bytes", "size of a segment, the unit of log writing and cleaning"),
    shown("page_size_bytes", "bytes", "size of a page, the unit the medium is written in"),
    shown("codec", "name", "codec new writes use"),
    shown("gc_policy", "name", "how the cleaner picks victims: cost-benefit or greedy"),
    field("unit_max_bytes", "bytes", "the largest compression unit new writes use",
        Gauge("Largest compression unit new writes use."), |s| s.unit_max_bytes as f64),
    shown("recompress", "name", "the cold-data pass's mode: off, idle or gc"),
    shown("recompressed_bytes", "bytes", "logical bytes the cold-data pass has rewritten"),
    shown("recompress_saved_bytes", "bytes", "stored bytes the cold-data pass saved (before minus after)"),
    shown("write_effort", "name", "how hard host writes compress (serve --write-effort): adaptive (full effort while a core is idle, fast while every core is compressing, raw for the idle pass while twice as many requests are and a quarter of the medium is free), full, fast or deferred; emulated drives and --recompress off keep full"),
    shown("host_write_fast_bytes", "bytes", "of host_write_bytes, the bytes written below full effort: compressed at fast effort (lz4 at a higher acceleration, zstd at a negative level) or stored raw for the idle pass, which rewrites them first"),
    field("recompress_pending_bytes", "bytes", "stored bytes the cold-data pass has yet to rewrite: live data in segments it has not recompressed (0 with --recompress off)",
        Gauge("Stored bytes the cold-data pass has yet to rewrite."), |s| s.recompress_pending_bytes as f64),
    field("fast_stored_bytes", "bytes", "of those, the bytes written below full effort (estimated per segment from its live share), which the pass rewrites first",
        Gauge("Stored bytes written below full effort and not yet rewritten."), |s| s.fast_stored_bytes as f64),
    field("recompress_expected_saving_bytes", "bytes", "what rewriting recompress_pending_bytes should save, at the ratio the pass's rewrites have had so far (recompress_saved_bytes over what they took before); null until it has rewritten something",
        Gauge("Stored bytes the cold-data pass is expected to save still."), |s| s.recompress_expected_saving_bytes.map_or(f64::NAN, |b| b as f64)),
    field("damaged_blocks", "blocks", "blocks whose data is damaged: reads fail with EIO until they are rewritten, trimmed or repaired",
        Gauge("Blocks currently marked damaged."), |s| s.damaged_blocks as f64),
    field("map_memory_bytes", "bytes", "RAM the block map holds: its leaves in RAM, the tree over all leaves, page bookkeeping, the counts of shared contents' references",
        Gauge("RAM used by the block map."), |s| s.map_memory_bytes as f64),
    field("map_cache_bytes", "bytes", "the map cache's bound (--map-cache): RAM for map leaves beyond which clean leaves are paged out",
        Gauge("Bound on the block map's leaves in RAM."), |s| s.map_cache_bytes as f64),
    field("map_resident_bytes", "bytes", "RAM the map's leaves in memory take now (dirty leaves stay until a checkpoint writes them; one is due once they pass twice the cache)",
        Gauge("Heap bytes of the block map's leaves in RAM."), |s| s.map_resident_bytes as f64),
    field("map_leaves", "leaves", "leaves of the block map, each a page on the medium",
        Gauge("Leaves of the block map."), |s| s.map_leaves as f64),
    field("map_paged_leaves", "leaves", "leaves paged out: on the medium only, read back on demand",
        Gauge("Leaves of the block map paged out to the medium."), |s| s.map_paged_leaves as f64),
    field("map_cache_hits", "loads", "map range loads that found their leaves in RAM, since the volume opened",
        Counter("Map lookups that found their leaves in RAM, since the volume opened."), |s| s.map_cache_hits as f64),
    field("map_cache_misses", "pages", "map pages read back from the medium, since the volume opened",
        Counter("Map pages read back, since the volume opened."), |s| s.map_cache_misses as f64),
    field("map_cache_peeks", "pages", "of those, pages read for one lookup with the cache full, their leaves not kept (a leaf looked up again soon is kept)",
        Counter("Map pages read back for one lookup, their leaves not kept in the cache, since the volume opened."), |s| s.map_cache_peeks as f64),
    field("map_pages_written", "pages", "map pages checkpoints wrote, since the volume opened",
        Counter("Map pages written by checkpoints, since the volume opened."), |s| s.map_pages_written as f64),
    field("map_pages_kept", "pages", "map pages of unchanged leaves checkpoints kept where an earlier one wrote them, since the volume opened",
        Counter("Map pages of unchanged leaves that checkpoints kept in place, since the volume opened."), |s| s.map_pages_kept as f64),
    field("shared_blocks", "blocks", "blocks that share their stored content with other blocks (clones, and duplicates found by deduplication)",
        Gauge("Blocks that share their stored content with other blocks."), |s| s.shared_blocks as f64),
    field("shared_contents", "contents", "the stored contents they share: each is stored once however many blocks name it",
        Gauge("Stored contents shared by several blocks."), |s| s.shared_contents as f64),
    field("distinct_blocks", "blocks", "blocks of data stored: mapped blocks, each shared content counted once",
        Gauge("Blocks of data stored, each shared content once."), |s| s.distinct_blocks as f64),
    field("snapshots", "snapshots", "snapshots of the volume (zdisk snapshot)",
        Gauge("Snapshots of the volume."), |s| s.snapshots as f64),
    field("snapshot_kept_blocks", "blocks", "blocks whose old entries snapshots keep because the volume changed them since",
        Gauge("Blocks snapshots keep that the volume changed since."), |s| s.snapshot_kept_blocks as f64),
    field("snapshot_kept_bytes", "bytes", "stored bytes only snapshots hold (their kept blocks that share nothing)",
        Gauge("Stored bytes only snapshots hold."), |s| s.snapshot_kept_bytes as f64),
    field("clones", "clones", "clones of snapshots: writable volumes in the image (zdisk clone)",
        Gauge("Clones of snapshots."), |s| s.clones as f64),
    field("clone_blocks", "blocks", "blocks clones wrote since they were made (data and zeros), shared with nothing",
        Gauge("Blocks clones wrote since they were made."), |s| s.clone_blocks as f64),
    field("clone_bytes", "bytes", "stored bytes only clones hold (the blocks they wrote)",
        Gauge("Stored bytes only clones hold."), |s| s.clone_bytes as f64),
    shown("clone_volumes", "clones", "per clone: its name, its snapshot, the blocks it wrote (own_blocks, zeros among them own_zero_blocks) and their stored bytes (own_bytes); /metrics has zdisk_clone_own_blocks and zdisk_clone_own_bytes labelled clone=NAME"),
    shown("dedup", "name", "whether new writes are deduplicated: on or off (create --dedup, serve --dedup)"),
    field("dedup_index_bytes", "bytes", "RAM the dedup index takes: sampled hooks, cached chapters, the open chapter, where chapters were written",
        Gauge("RAM used by the dedup index."), |s| s.dedup_index_bytes as f64),
    field("dedup_index_bound_bytes", "bytes", "the most RAM the dedup index may take (--dedup-cache)",
        Gauge("Bound on the dedup index's RAM."), |s| s.dedup_index_bound_bytes as f64),
    field("dedup_lookups", "blocks", "non-zero blocks written and looked up in the dedup index, since the volume opened",
        Counter("Blocks looked up for deduplication, since the volume opened."), |s| s.dedup_lookups as f64),
    field("dedup_found", "blocks", "of those, blocks found stored already (by the index, or earlier in the same request); dedup_found / dedup_lookups is the hit rate",
        Counter("Blocks found stored already, since the volume opened."), |s| s.dedup_found as f64),
    field("dedup_stale", "blocks", "of those, blocks whose content was overwritten or trimmed by the time they were written, and so stored after all",
        Counter("Blocks found whose content was gone, since the volume opened."), |s| s.dedup_stale as f64),
    field("dedup_chapter_reads", "chapters", "chapters of the dedup index read back from the medium, since the volume opened",
        Counter("Dedup index chapters read back, since the volume opened."), |s| s.dedup_chapter_reads as f64),
    shown("segments_by_state", "segments", "segments free, open for writing, sealed, holding checkpoints, and cleaned awaiting reuse"),
    shown("sealed_utilization_histogram", "segments", "sealed segments by the share of them that lives, in tenths (0-10% ... 90-100%, full)"),
    shown("counters", "various", "cumulative counters, persisted across restarts (listed below); each is exported as zdisk_NAME_total"),
    shown("wear", "erases", "emulated NAND drives: erase blocks erased, and the fewest, most and mean erases of one block; null on other media; exported as zdisk_blocks_erased_total and zdisk_erase_count_max"),
];

impl Stats {
    /// Prometheus text exposition, generated from [`FIELDS`], the
    /// [`Counters`] list, the wear of an emulated drive and the medium's
    /// own counters.
    pub fn to_prometheus(&self) -> String {
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
            out.push_str(&format!(
                "# HELP zdisk_{name} {help}\n# TYPE zdisk_{name} {kind}\nzdisk_{name} {value}\n"
            ));
        };
        for field in FIELDS {
            match field.metric {
                Metric::None => {}
                Metric::Gauge(help) => metric(field.key, "gauge", help, (field.value)(self)),
                Metric::Counter(help) => metric(
                    &format!("{}_total", field.key),
                    "counter",
                    help,
                    (field.value)(self),
                ),
            }
        }
        for (name, help) in Counters::DOCS {
            let value = self.counters.get(name).unwrap_or(0);
            metric(&format!("{name}_total"), "counter", help, value as f64);
        }
        if let Some(wear) = &self.wear {
            metric(
                "blocks_erased_total",
                "counter",
                "Erase blocks erased.",
                wear.blocks_erased as f64,
            );
            metric(
                "erase_count_max",
                "gauge",
                "Most erases of one erase block.",
                wear.erase_count_max as f64,
            );
        }
        for (name, value) in &self.media {
            let help = self
                .media_help
                .get(name)
                .copied()
                .unwrap_or("A counter of the medium.");
            metric(name, "gauge", help, *value as f64);
        }
        // Per clone, one sample each, labelled with its name (names need
        // no escaping: letters, digits, '.', '_' and '-').
        type PerClone = fn(&CloneStats) -> u64;
        let per_clone: [(&str, &str, PerClone); 2] = [
            (
                "clone_own_blocks",
                "Blocks a clone wrote since it was made.",
                |c| c.own_blocks,
            ),
            (
                "clone_own_bytes",
                "Stored bytes of the blocks a clone wrote.",
                |c| c.own_bytes,
            ),
        ];
        if !self.clone_volumes.is_empty() {
            for (name, help, value) in per_clone {
                out.push_str(&format!(
                    "# HELP zdisk_{name} {help}\n# TYPE zdisk_{name} gauge\n"
                ));
                for clone in &self.clone_volumes {
                    out.push_str(&format!(
                        "zdisk_{name}{{clone=\"{}\"}} {}\n",
                        clone.name,
                        value(clone)
                    ));
                }
            }
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
