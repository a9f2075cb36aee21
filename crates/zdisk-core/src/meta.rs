//! The metadata slots: superblock, settings and checkpoint root.
//!
//! The medium has two slots, written alternately (generation `g` goes to
//! slot `g % 2`), each holding one self-checksummed [`Root`]. On open, the
//! valid root with the highest generation wins, so a torn slot write can
//! only ever cost the root being written, never the last good one.
//!
//! A root is small: the map itself lives in the log as checkpoint chunk
//! records (see `dump.rs`), and the root only lists the segments that
//! hold them. See docs/format.md for the byte layout.

use crate::bytes::{ByteReader, ByteWriter};
use crate::codec::Codec;
use crate::error::{Error, Result};
use crate::gc::GcPolicy;
use crate::media::MediaGeometry;
use crate::snapshots::Snapshots;
use crate::stats::Counters;
use crate::units::SegmentId;

pub use crate::media::META_MAGIC;
/// The format version this zdisk writes. Version 2 added compression
/// units and may leave flushed records in staging slots, which version 1
/// never reads, so a version-1 zdisk must refuse it. Version 3 writes the
/// map as pages behind a directory in the checkpoint dump (dump items 4
/// and 5), which version 2 cannot read. Version 4 keeps the pages of leaves
/// that did not change where an earlier checkpoint wrote them (dump item
/// 6), and a root lists the earlier dumps' segments it still needs, which
/// version 3 would free. Version 5 shares records between blocks: shared
/// map entries (page entry tag 4), the shared table's cells in the map,
/// and reference records (kind 7), none of which version 4 knows.
/// Version 6 adds the `dedup` setting to the root and writes chapters of
/// the deduplication index (record kind 8), which version 5 would refuse
/// to scan. Version 7 adds snapshots (the root's registry, record kind 9).
/// Version 8 adds clones: each snapshot in the registry names its volume,
/// clones follow the snapshots, and kind 9 records carry the changes 3 to
/// 5, which version 7 would refuse. Version 9 marks data and unit records
/// written at fast effort in their codec byte's high bit
/// (`record::CODEC_FAST_EFFORT`), which version 8 would take for an
/// unknown codec, and adds a dump item for segments holding them.
pub const FORMAT_VERSION: u32 = 9;
/// The oldest format this code still opens (and upgrades on its first
/// root; version 1 has no units, and its staging areas are zeros; a
/// version 1 or 2 dump loads into a map in RAM, which the first
/// checkpoint writes as pages).
pub const FORMAT_VERSION_MIN: u32 = 1;

/// What kind of medium an image lives on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MediaKind {
    File = 1,
    Memory = 2,
    Nand = 3,
    /// A local file caching a volume whose sealed segments live in an
    /// object store (the `zdisk-tier` crate; media_params name the bucket).
    Tiered = 4,
}

impl MediaKind {
    fn from_u8(value: u8) -> Option<MediaKind> {
        match value {
            1 => Some(MediaKind::File),
            2 => Some(MediaKind::Memory),
            3 => Some(MediaKind::Nand),
            4 => Some(MediaKind::Tiered),
            _ => None,
        }
    }
}

/// Fixed facts about a volume, set at creation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub uuid: [u8; 16],
    pub logical_size_bytes: u64,
    pub physical_size_bytes: u64,
    pub geometry: MediaGeometry,
    pub media_kind: MediaKind,
    /// Medium-specific parameters (e.g. an emulated NAND profile), opaque here.
    pub media_params: Vec<u8>,
    pub created_unix_secs: u64,
}

/// Settings that may change between runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    pub codec: Codec,
    pub gc_policy: GcPolicy,
    /// Most blocks a write compresses together as one unit (1: every block
    /// alone). Format 1 roots have none: they read as the codec's default.
    pub unit_blocks: u8,
    /// New writes look for their blocks among those stored already, and
    /// share them instead of storing them again. Roots before format 6
    /// have no such field: they read as off, what they did.
    pub dedup: bool,
}

/// Blocks per compression unit for a new volume whose creator did not
/// choose: 8 KiB for LZ4, 32 KiB for zstd and DEFLATE, 4 KiB for none.
/// Measured on the /usr tar (README, "Performance"): LZ4 in 8 KiB units
/// serves 4 KiB random reads at 0.89x nbdkit memory against 0.51x in 32
/// KiB units, for 7% more stored bytes; zstd needs 32 KiB units to store
/// less than btrfs, whose zstd compresses up to 128 KiB at a time.
pub fn default_unit_blocks(codec: Codec) -> u8 {
    match codec {
        Codec::None => 1,
        Codec::Lz4 => 2,
        Codec::Zstd { .. } | Codec::Deflate { .. } => 8,
    }
}

/// Where an open segment's records stood when a checkpoint was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenSegmentPos {
    pub segment: SegmentId,
    pub seq: u64,
    pub offset_bytes: u64,
}

/// The segments holding a checkpoint's map dump, in two identical copies:
/// in each, the dump's own segments (its directory starts in the first),
/// then the segments of earlier dumps holding pages it keeps (format 4).
/// Position `i` of one copy and of the other hold the same records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DumpRef {
    pub copies: [Vec<SegmentId>; 2],
    pub record_count: u64,
    /// Generation of the root that wrote the dump; its chunk records carry it.
    pub generation: u64,
}

impl DumpRef {
    pub fn segments(&self) -> impl Iterator<Item = SegmentId> + '_ {
        self.copies.iter().flatten().copied()
    }

    /// Its segments as (copy 0, copy 1) pairs.
    pub(crate) fn pairs(&self) -> impl Iterator<Item = [SegmentId; 2]> + '_ {
        self.copies[0]
            .iter()
            .zip(&self.copies[1])
            .map(|(&first, &second)| [first, second])
    }
}

/// The state recovery starts from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointRoot {
    /// True only when written by a clean shutdown: nothing after it to replay.
    pub clean: bool,
    /// Segments whose sequence number is at least this were opened after
    /// the map snapshot; recovery replays them.
    pub seq_boundary: u64,
    pub next_seq: u64,
    pub next_version: u64,
    /// No segment incarnation with a sequence number at or above this, and
    /// no record with a version at or above `version_reserved`, was written
    /// before a newer root: recovery continues from here, so numbers are
    /// never reused even for records a crash left half-written.
    pub seq_reserved: u64,
    pub version_reserved: u64,
    /// The only free segments the run may allocate before it writes a newer
    /// root. After a crash, recovery erases those it did not adopt, so that
    /// half-written leftovers can never be replayed later.
    pub reserved_segments: Vec<SegmentId>,
    /// Segments that were open at the snapshot; recovery replays them from
    /// the recorded offset.
    pub open_segments: Vec<OpenSegmentPos>,
    pub dump: Option<DumpRef>,
    pub counters: Counters,
    /// The snapshots the dump's map keeps entries for (format 7; none
    /// before), oldest first.
    pub snapshots: Snapshots,
}

/// Everything in one metadata slot.
#[derive(Debug, Clone, PartialEq)]
pub struct Root {
    pub generation: u64,
    pub superblock: Superblock,
    pub settings: Settings,
    pub checkpoint: CheckpointRoot,
}

/// What a root in a metadata slot needs kept for recovery to start from
/// it: its dump, and the log it would replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RetainedRoot {
    pub generation: u64,
    /// Segments with a sequence number at least this are replayed.
    pub boundary: u64,
    /// Segments open at its snapshot, replayed from the recorded offset.
    pub open: Vec<OpenSegmentPos>,
    pub dump: Option<DumpRef>,
    /// The snapshots as the dump's map holds them: a replay starts from
    /// these (a newer registry would not match the dump's entries).
    pub snapshots: Snapshots,
}

impl RetainedRoot {
    /// The metadata slot the root lives in.
    pub(crate) fn slot(&self) -> usize {
        (self.generation % 2) as usize
    }

    /// True if a recovery from this root would replay records of
    /// incarnation `seq` of `segment`.
    pub(crate) fn replays(&self, segment: SegmentId, seq: u64) -> bool {
        seq >= self.boundary
            || self
                .open
                .iter()
                .any(|open| open.segment == segment && open.seq == seq)
    }
}

impl Root {
    pub fn slot(&self) -> usize {
        (self.generation % 2) as usize
    }

    /// What must be kept for recovery to start from this root.
    pub(crate) fn retained(&self) -> RetainedRoot {
        RetainedRoot {
            generation: self.generation,
            boundary: self.checkpoint.seq_boundary,
            open: self.checkpoint.open_segments.clone(),
            dump: self.checkpoint.dump.clone(),
            snapshots: self.checkpoint.snapshots.clone(),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = ByteWriter::new();
        out.bytes(META_MAGIC);
        out.u32(FORMAT_VERSION);
        out.u32(0); // total length, patched below
        out.u64(self.generation);

        let sb = &self.superblock;
        out.bytes(&sb.uuid);
        out.u64(sb.logical_size_bytes);
        out.u64(sb.physical_size_bytes);
        out.u32(sb.geometry.page_size_bytes);
        out.u64(sb.geometry.segment_size_bytes);
        out.u32(sb.geometry.segment_count);
        out.u32(sb.geometry.meta_slot_size_bytes);
        out.u8(sb.media_kind as u8);
        out.u32(sb.media_params.len() as u32);
        out.bytes(&sb.media_params);
        out.u64(sb.created_unix_secs);

        let (codec_id, codec_level) = self.settings.codec.to_parts();
        out.u8(codec_id as u8);
        out.i32(codec_level);
        out.u8(self.settings.gc_policy.to_u8());
        out.u8(self.settings.unit_blocks);
        out.u8(self.settings.dedup as u8);

        let cp = &self.checkpoint;
        out.u8(cp.clean as u8);
        out.u64(cp.seq_boundary);
        out.u64(cp.next_seq);
        out.u64(cp.next_version);
        out.u64(cp.seq_reserved);
        out.u64(cp.version_reserved);
        out.u32(cp.reserved_segments.len() as u32);
        for segment in &cp.reserved_segments {
            out.u32(segment.0);
        }
        out.u32(cp.open_segments.len() as u32);
        for open in &cp.open_segments {
            out.u32(open.segment.0);
            out.u64(open.seq);
            out.u64(open.offset_bytes);
        }
        match &cp.dump {
            None => out.u8(0),
            Some(dump) => {
                out.u8(1);
                out.u64(dump.record_count);
                out.u64(dump.generation);
                for copy in &dump.copies {
                    out.u32(copy.len() as u32);
                    for segment in copy {
                        out.u32(segment.0);
                    }
                }
            }
        }
        cp.counters.encode(&mut out);
        cp.snapshots.encode(&mut out);

        let total = out.buf.len() as u32 + 4;
        out.buf[12..16].copy_from_slice(&total.to_le_bytes());
        let crc = crc32c::crc32c(&out.buf);
        out.u32(crc);
        out.buf
    }

    /// Decodes a slot. Any damage, including a torn write, is an error.
    pub fn decode(bytes: &[u8]) -> Result<Root, String> {
        let mut header = ByteReader::new(bytes);
        if header.take(8)? != META_MAGIC {
            return Err("no zdisk metadata magic".into());
        }
        let version = header.u32()?;
        if !(FORMAT_VERSION_MIN..=FORMAT_VERSION).contains(&version) {
            return Err(format!(
                "format version {version}, this zdisk reads versions {FORMAT_VERSION_MIN} to {FORMAT_VERSION}"
            ));
        }
        let total = header.u32()? as usize;
        if total < 24 || total > bytes.len() {
            return Err(format!("impossible root length {total}"));
        }
        let stored_crc = u32::from_le_bytes(bytes[total - 4..total].try_into().expect("4 bytes"));
        let actual_crc = crc32c::crc32c(&bytes[..total - 4]);
        if stored_crc != actual_crc {
            return Err(format!(
                "root checksum mismatch ({stored_crc:#010x} != {actual_crc:#010x})"
            ));
        }
        let mut input = ByteReader::new(&bytes[16..total - 4]);
        let generation = input.u64()?;
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(input.take(16)?);
        let logical_size_bytes = input.u64()?;
        let physical_size_bytes = input.u64()?;
        let geometry = MediaGeometry {
            page_size_bytes: input.u32()?,
            segment_size_bytes: input.u64()?,
            segment_count: input.u32()?,
            meta_slot_size_bytes: input.u32()?,
        };
        let media_kind = MediaKind::from_u8(input.u8()?).ok_or("unknown media kind")?;
        let params_len = input.u32()? as usize;
        if params_len > 64 * 1024 {
            return Err(format!("media parameters of {params_len} bytes"));
        }
        let media_params = input.take(params_len)?.to_vec();
        let created_unix_secs = input.u64()?;
        let codec_id = input.u8()?;
        let codec_level = input.i32()?;
        let codec = Codec::from_parts(codec_id, codec_level)
            .ok_or_else(|| format!("unknown codec {codec_id} level {codec_level}"))?;
        let gc_policy = GcPolicy::from_u8(input.u8()?).ok_or("unknown GC policy")?;
        let unit_blocks = if version >= 2 {
            let blocks = input.u8()?;
            if !(1..=crate::record::UNIT_BLOCKS_MAX as u8).contains(&blocks) {
                return Err(format!("compression units of {blocks} blocks"));
            }
            blocks
        } else {
            default_unit_blocks(codec)
        };
        let dedup = if version >= 6 {
            match input.u8()? {
                0 => false,
                1 => true,
                other => return Err(format!("dedup setting {other}")),
            }
        } else {
            false
        };

        let clean = input.u8()? != 0;
        let seq_boundary = input.u64()?;
        let next_seq = input.u64()?;
        let next_version = input.u64()?;
        let seq_reserved = input.u64()?;
        let version_reserved = input.u64()?;
        let version_end = crate::map::VERSION_MAX + 1;
        if next_version > version_end || version_reserved > version_end {
            return Err(format!(
                "versions {next_version}/{version_reserved} exceed the 48-bit version space"
            ));
        }
        let reserved_count = input.u32()? as usize;
        if reserved_count > input.remaining() / 4 {
            return Err(format!(
                "{reserved_count} reserved segments overrun the root"
            ));
        }
        let mut reserved_segments = Vec::with_capacity(reserved_count);
        for _ in 0..reserved_count {
            reserved_segments.push(SegmentId(input.u32()?));
        }
        let open_count = input.u32()? as usize;
        if open_count > 16 {
            return Err(format!("{open_count} open segments"));
        }
        let mut open_segments = Vec::with_capacity(open_count);
        for _ in 0..open_count {
            open_segments.push(OpenSegmentPos {
                segment: SegmentId(input.u32()?),
                seq: input.u64()?,
                offset_bytes: input.u64()?,
            });
        }
        let dump = match input.u8()? {
            0 => None,
            1 => {
                let record_count = input.u64()?;
                let generation = input.u64()?;
                let mut copies = [Vec::new(), Vec::new()];
                for copy in copies.iter_mut() {
                    let count = input.u32()? as usize;
                    if count > input.remaining() / 4 {
                        return Err(format!("dump list of {count} segments overruns the root"));
                    }
                    for _ in 0..count {
                        copy.push(SegmentId(input.u32()?));
                    }
                }
                Some(DumpRef {
                    copies,
                    record_count,
                    generation,
                })
            }
            other => return Err(format!("bad dump marker {other}")),
        };
        let counters = Counters::decode(&mut input)?;
        let snapshots = if version >= 7 {
            Snapshots::decode(&mut input, version)?
        } else {
            Snapshots::default()
        };
        Ok(Root {
            generation,
            superblock: Superblock {
                uuid,
                logical_size_bytes,
                physical_size_bytes,
                geometry,
                media_kind,
                media_params,
                created_unix_secs,
            },
            settings: Settings {
                codec,
                gc_policy,
                unit_blocks,
                dedup,
            },
            checkpoint: CheckpointRoot {
                clean,
                seq_boundary,
                next_seq,
                next_version,
                seq_reserved,
                version_reserved,
                reserved_segments,
                open_segments,
                dump,
                counters,
                snapshots,
            },
        })
    }
}

/// The geometry recorded by the newest valid root among the raw contents
/// of the metadata slots. A medium that must know its layout before the
/// engine opens it (a file, whose size alone does not say how it is cut
/// into segments) is handed this, so that it never decodes a root itself.
pub fn geometry_in_slots(slots: &[Vec<u8>; 2]) -> Option<MediaGeometry> {
    slots
        .iter()
        .filter_map(|bytes| Root::decode(bytes).ok())
        .max_by_key(|root| root.generation)
        .map(|root| root.superblock.geometry)
}

/// True for bytes that were never written: all zeros (a sparse file) or
/// all ones (erased flash).
pub(crate) fn is_blank(bytes: &[u8]) -> bool {
    bytes.iter().all(|&b| b == 0) || bytes.iter().all(|&b| b == 0xFF)
}

/// Reads both slots and returns the valid roots, newest first, with the
/// error of each slot that did not decode (for diagnostics).
pub fn read_roots(media: &dyn crate::media::Media) -> Result<(Vec<Root>, Vec<String>)> {
    let mut roots: Vec<Root> = Vec::new();
    let mut problems = Vec::new();
    for slot in 0..2 {
        let bytes = media.read_meta_slot(slot)?;
        if is_blank(&bytes[..bytes.len().min(4096)]) {
            // Never written (a new image has one root): not a problem.
            continue;
        }
        match Root::decode(&bytes) {
            Ok(root) if root.slot() != slot => {
                problems.push(format!(
                    "slot {slot}: holds generation {} of the other slot",
                    root.generation
                ));
            }
            Ok(root) => roots.push(root),
            Err(problem) => problems.push(format!("slot {slot}: {problem}")),
        }
    }
    roots.sort_by_key(|root| std::cmp::Reverse(root.generation));
    if roots.is_empty() {
        return Err(Error::CorruptImage(format!(
            "no valid superblock in either metadata slot ({})",
            problems.join("; ")
        )));
    }
    Ok((roots, problems))
}

#[cfg(test)]
pub(crate) mod tests_support {
    use super::*;

    pub(crate) fn sample_root() -> Root {
        Root {
            generation: 7,
            superblock: Superblock {
                uuid: [3; 16],
                logical_size_bytes: 1 << 40,
                physical_size_bytes: 1 << 30,
                geometry: MediaGeometry {
                    page_size_bytes: 4096,
                    segment_size_bytes: 4 << 20,
                    segment_count: 255,
                    meta_slot_size_bytes: 512 * 1024,
                },
                media_kind: MediaKind::File,
                media_params: vec![1, 2, 3],
                created_unix_secs: 1_700_000_000,
            },
            settings: Settings {
                codec: Codec::Zstd { level: -3 },
                gc_policy: GcPolicy::Greedy,
                unit_blocks: 16,
                dedup: true,
            },
            checkpoint: CheckpointRoot {
                clean: true,
                seq_boundary: 40,
                next_seq: 45,
                next_version: 123_456,
                seq_reserved: 1045,
                version_reserved: 1_123_456,
                reserved_segments: vec![SegmentId(20), SegmentId(21)],
                open_segments: vec![OpenSegmentPos {
                    segment: SegmentId(9),
                    seq: 39,
                    offset_bytes: 8192,
                }],
                dump: Some(DumpRef {
                    copies: [
                        vec![SegmentId(1), SegmentId(2)],
                        vec![SegmentId(3), SegmentId(4)],
                    ],
                    record_count: 17,
                    generation: 6,
                }),
                counters: Counters {
                    host_write_bytes: 5,
                    ..Counters::default()
                },
                snapshots: {
                    let mut snapshots = Snapshots::default();
                    snapshots.apply(&crate::snapshots::SnapshotChange::Take(
                        crate::snapshots::Snapshot {
                            space: 3,
                            volume: 0,
                            version: 1_000,
                            name: "before-upgrade".into(),
                            created_unix_secs: 1_790_000_000,
                        },
                    ));
                    snapshots.apply(&crate::snapshots::SnapshotChange::Clone(
                        crate::snapshots::CloneVolume {
                            space: 4,
                            base: 3,
                            version: 1_001,
                            name: "test-vm".into(),
                            created_unix_secs: 1_790_000_001,
                        },
                    ));
                    snapshots
                },
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::tests_support::sample_root;
    use super::*;

    #[test]
    fn roots_round_trip() {
        let root = sample_root();
        let bytes = root.encode();
        assert_eq!(Root::decode(&bytes).unwrap(), root);
        let mut padded = bytes.clone();
        padded.resize(4096, 0xAA);
        assert_eq!(Root::decode(&padded).unwrap(), root);
    }

    /// Version 1 roots (no staging) still open; a version this zdisk does
    /// not know, such as the next one, does not. Roots before version 6
    /// have no `dedup` byte and read as dedup off; before version 7, no
    /// snapshot list (no snapshots); before version 8, no clone list.
    #[test]
    fn roots_of_versions_2_to_7_decode_and_unknown_versions_do_not() {
        // Version 1 roots lack fields version 2 added (`unit_blocks`):
        // tests/format_v1.rs opens real version 1 images.
        let sample = sample_root();
        let root = Root {
            settings: Settings {
                dedup: false,
                ..sample.settings
            },
            checkpoint: CheckpointRoot {
                snapshots: Snapshots::default(),
                ..sample.checkpoint
            },
            ..sample
        };
        // Where the dedup byte is: the one byte the setting changes.
        let on = Root {
            settings: Settings {
                dedup: true,
                ..root.settings
            },
            ..root.clone()
        }
        .encode();
        let dedup_at = (0..on.len())
            .find(|&at| on[at] != root.encode()[at])
            .expect("the setting is encoded");
        let with_version = |version: u32| {
            let mut bytes = root.encode();
            if version < 8 {
                // The empty clone list: two bytes before the CRC.
                let end = bytes.len() - 4;
                bytes.drain(end - 2..end);
                let total = bytes.len() as u32;
                bytes[12..16].copy_from_slice(&total.to_le_bytes());
            }
            if version < 7 {
                // The empty snapshot list: two bytes before the CRC.
                let end = bytes.len() - 4;
                bytes.drain(end - 2..end);
                let total = bytes.len() as u32;
                bytes[12..16].copy_from_slice(&total.to_le_bytes());
            }
            if version < 6 {
                bytes.remove(dedup_at);
                let total = bytes.len() as u32;
                bytes[12..16].copy_from_slice(&total.to_le_bytes());
            }
            bytes[8..12].copy_from_slice(&version.to_le_bytes());
            let total = bytes.len();
            let crc = crc32c::crc32c(&bytes[..total - 4]);
            bytes[total - 4..].copy_from_slice(&crc.to_le_bytes());
            Root::decode(&bytes)
        };
        assert_eq!(FORMAT_VERSION, 9);
        assert_eq!(with_version(9).unwrap(), root);
        for version in [2, 3, 4, 5, 6, 7, 8] {
            assert_eq!(with_version(version).unwrap(), root, "version {version}");
        }
        for version in [0, 10] {
            let error = with_version(version).unwrap_err();
            assert!(error.contains("format version"), "{error}");
        }
    }

    #[test]
    fn any_damage_to_a_root_is_detected() {
        let bytes = sample_root().encode();
        for at in 0..bytes.len() {
            let mut damaged = bytes.clone();
            damaged[at] ^= 0x10;
            assert!(
                Root::decode(&damaged).is_err(),
                "flip at byte {at} went unnoticed"
            );
        }
        for len in 0..bytes.len() {
            assert!(
                Root::decode(&bytes[..len]).is_err(),
                "truncation to {len} went unnoticed"
            );
        }
    }
}
