//! Log records: the self-describing unit the log is made of.
//!
//! Every record starts with a 32-byte header and is padded to a multiple of
//! 16 bytes, so compressed extents pack byte-tight into segments. A record
//! names its block, its version and the segment incarnation (`seg_seq`) it
//! was written into, and carries a CRC32C over its payload and header. A
//! reader therefore never trusts a location alone: it checks that the record
//! there is the one it expected. See docs/format.md for the byte layout.
//!
//! Integers are little-endian. Lengths read from the medium are checked
//! against per-kind limits before anything is allocated.

use crate::units::{align_up, BLOCK_SIZE};

/// The first two bytes of every record: "ZR" read as little-endian u16.
pub const RECORD_MAGIC: u16 = u16::from_le_bytes(*b"ZR");
/// Size of a record header in bytes.
pub const HEADER_SIZE: usize = 32;
/// Records start at multiples of this many bytes within a segment.
pub const RECORD_ALIGN: u64 = 16;
/// Largest payload of a checkpoint chunk record.
pub const MAP_CHUNK_PAYLOAD_MAX: u32 = 1 << 20;
/// Largest payload of a dedup index chapter record.
pub const CHAPTER_PAYLOAD_MAX: u32 = 64 << 10;
/// Payload of a range record (Trim, Zero, Damaged): the block count.
pub const RANGE_PAYLOAD_LEN: u32 = 8;
/// On-disk size of a raw (uncompressed) data record.
pub const RAW_RECORD_LEN: u64 = (HEADER_SIZE + BLOCK_SIZE) as u64;
/// Most blocks one unit record holds (128 KiB).
pub const UNIT_BLOCKS_MAX: usize = 32;
/// Bytes before a unit's compressed data: block count u8, flags u8, 2
/// reserved bytes.
pub const UNIT_PREFIX_LEN: usize = 4;
/// Unit flag: block `i`'s version is `header.version - (count - 1) + i`,
/// so no version list follows the prefix.
pub const UNIT_CONSECUTIVE_VERSIONS: u8 = 1;
/// Unit flag: written by the cold-data pass (`volume/moves.rs`), which
/// compresses with a stronger codec: it is not worth recompressing again.
pub const UNIT_RECOMPRESSED: u8 = 2;
/// Blocks a unit may hold on a medium of `segment_size_bytes` segments:
/// a record never spans segments, and one that does not fit what is left
/// of the open segment leaves that rest unused, so units stay at most a
/// sixteenth of a segment (and at most [`UNIT_BLOCKS_MAX`]): 4 blocks in
/// 256 KiB segments, 32 in 2 MiB and up.
pub fn unit_blocks_for_segment(segment_size_bytes: u64) -> u8 {
    (segment_size_bytes / 16 / BLOCK_SIZE as u64).clamp(1, UNIT_BLOCKS_MAX as u64) as u8
}

/// The longest record a volume with `segment_size_bytes` segments can
/// hold: a raw block, or a unit as large as it may be (units must save a
/// sixteenth, see `codec::compress_unit`; a rewritten unit keeps its
/// versions, a u64 each).
pub fn max_record_len(segment_size_bytes: u64) -> u64 {
    let blocks = unit_blocks_for_segment(segment_size_bytes) as usize;
    if blocks < 2 {
        return RAW_RECORD_LEN;
    }
    let data = blocks * BLOCK_SIZE - blocks * BLOCK_SIZE / 16;
    RAW_RECORD_LEN.max(record_len_for_payload(UNIT_PREFIX_LEN + blocks * 8 + data))
}

/// Largest payload of a unit record: the prefix, a version per block, and
/// its compressed data (which is smaller than the blocks raw).
pub const UNIT_PAYLOAD_MAX: u32 =
    (UNIT_PREFIX_LEN + UNIT_BLOCKS_MAX * 8 + UNIT_BLOCKS_MAX * BLOCK_SIZE) as u32;

/// What a record describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum RecordKind {
    /// One block's (possibly compressed) contents.
    Data = 1,
    /// A run of blocks became holes.
    Trim = 2,
    /// A run of blocks became allocated zeros.
    Zero = 3,
    /// A part of a checkpoint's map dump.
    MapChunk = 4,
    /// A run of blocks whose data was found damaged and can no longer be read.
    Damaged = 5,
    /// Several consecutive blocks' contents, compressed together (a unit).
    Unit = 6,
    /// Consecutive blocks that now share contents stored earlier (format
    /// 5): each names the content version it shares and the block that
    /// held it (see [`encode_ref`]).
    Ref = 7,
    /// A chapter of the deduplication index (format 6): fingerprints of
    /// blocks stored, in write order (`dedup::encode_chapter`). Advisory:
    /// never live, never replayed, never relocated; header `lba` is the
    /// chapter's number and `version` is 0.
    Chapter = 8,
    /// A snapshot taken or deleted (format 7), a clone made or deleted
    /// (format 8): `snapshots::encode_change`.
    /// Header `lba` is 0 and `version` the change's own (a snapshot sees
    /// entries older than it).
    Snapshot = 9,
}

/// The largest snapshot record payload: a snapshot taken, or a clone
/// made, with the longest name (`snapshots::encode_change`; its tests hold the two together).
pub const SNAPSHOT_PAYLOAD_MAX: u32 = 1 + 2 + 2 + 8 + 8 + 1 + 64;

impl RecordKind {
    pub fn from_u8(value: u8) -> Option<RecordKind> {
        match value {
            1 => Some(RecordKind::Data),
            2 => Some(RecordKind::Trim),
            3 => Some(RecordKind::Zero),
            4 => Some(RecordKind::MapChunk),
            5 => Some(RecordKind::Damaged),
            6 => Some(RecordKind::Unit),
            7 => Some(RecordKind::Ref),
            8 => Some(RecordKind::Chapter),
            9 => Some(RecordKind::Snapshot),
            _ => None,
        }
    }

    /// True for records that describe a run of blocks with a block count payload.
    pub fn is_range(self) -> bool {
        matches!(
            self,
            RecordKind::Trim | RecordKind::Zero | RecordKind::Damaged
        )
    }
}

/// The codec byte's high bit (format 9): the data or unit record was
/// written below full effort (issue #27): compressed at fast effort, or
/// stored raw with its compression deferred; the cold-data pass rewrites
/// it first. The low seven bits are the [`crate::codec::CodecId`].
pub const CODEC_FAST_EFFORT: u8 = 0x80;

/// A decoded record header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    pub kind: RecordKind,
    /// A [`crate::codec::CodecId`] for data records, with
    /// [`CODEC_FAST_EFFORT`] set if written below full effort; 0 otherwise.
    pub codec: u8,
    /// Low 32 bits of the sequence number of the segment incarnation.
    pub seg_seq: u32,
    /// Block number (Data), first block (range records) or chunk index (MapChunk).
    pub lba: u64,
    /// Write version (Data and range records) or checkpoint generation (MapChunk).
    pub version: u64,
    pub payload_len: u32,
    pub crc: u32,
}

/// Why bytes could not be decoded as a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordError {
    /// Fewer bytes than a header or than the header says.
    Truncated,
    /// All-zero header: padding or never-written space.
    Empty,
    BadMagic,
    BadKind(u8),
    BadLength(u32),
    /// The record belongs to another incarnation of the segment.
    WrongSegment {
        expected: u32,
        found: u32,
    },
    Checksum {
        expected: u32,
        actual: u32,
    },
}

impl std::fmt::Display for RecordError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecordError::Truncated => write!(f, "record truncated"),
            RecordError::Empty => write!(f, "no record (empty space)"),
            RecordError::BadMagic => write!(f, "bad record magic"),
            RecordError::BadKind(kind) => write!(f, "unknown record kind {kind}"),
            RecordError::BadLength(len) => write!(f, "impossible payload length {len}"),
            RecordError::WrongSegment { expected, found } => {
                write!(
                    f,
                    "record from segment incarnation {found}, expected {expected}"
                )
            }
            RecordError::Checksum { expected, actual } => {
                write!(
                    f,
                    "checksum mismatch: stored {expected:#010x}, computed {actual:#010x}"
                )
            }
        }
    }
}

impl RecordHeader {
    /// The codec a data or unit record's payload is compressed with.
    pub fn codec_id(&self) -> Option<crate::codec::CodecId> {
        crate::codec::CodecId::from_u8(self.codec & !CODEC_FAST_EFFORT)
    }

    /// True if this data or unit record was written below full effort.
    pub fn fast_effort(&self) -> bool {
        self.codec & CODEC_FAST_EFFORT != 0
            && matches!(self.kind, RecordKind::Data | RecordKind::Unit)
    }

    /// Total bytes the record occupies, alignment padding included.
    pub fn record_len(&self) -> u64 {
        record_len_for_payload(self.payload_len as usize)
    }

    /// Encodes the header into `out`, with `self.crc` as the checksum field.
    pub fn encode(&self, out: &mut [u8]) {
        assert!(out.len() >= HEADER_SIZE);
        out[0..2].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
        out[2] = self.kind as u8;
        out[3] = self.codec;
        out[4..8].copy_from_slice(&self.seg_seq.to_le_bytes());
        out[8..16].copy_from_slice(&self.lba.to_le_bytes());
        out[16..24].copy_from_slice(&self.version.to_le_bytes());
        out[24..28].copy_from_slice(&self.payload_len.to_le_bytes());
        out[28..32].copy_from_slice(&self.crc.to_le_bytes());
    }

    /// Decodes and sanity-checks a header without verifying the checksum.
    pub fn decode(bytes: &[u8]) -> Result<RecordHeader, RecordError> {
        if bytes.len() < HEADER_SIZE {
            return Err(RecordError::Truncated);
        }
        let word = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
        let dword = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        let magic = u16::from_le_bytes([bytes[0], bytes[1]]);
        if magic != RECORD_MAGIC {
            if bytes[..HEADER_SIZE].iter().all(|&b| b == 0) {
                return Err(RecordError::Empty);
            }
            return Err(RecordError::BadMagic);
        }
        let kind = RecordKind::from_u8(bytes[2]).ok_or(RecordError::BadKind(bytes[2]))?;
        let payload_len = word(24);
        let length_ok = match kind {
            RecordKind::Data => payload_len >= 1 && payload_len as usize <= BLOCK_SIZE,
            RecordKind::Trim | RecordKind::Zero | RecordKind::Damaged => {
                payload_len == RANGE_PAYLOAD_LEN
            }
            RecordKind::MapChunk => (1..=MAP_CHUNK_PAYLOAD_MAX).contains(&payload_len),
            RecordKind::Unit => {
                (UNIT_PREFIX_LEN as u32 + 1..=UNIT_PAYLOAD_MAX).contains(&payload_len)
            }
            RecordKind::Ref => {
                let members = REF_MEMBER_LEN..=REF_MEMBER_LEN * REF_MEMBERS_MAX;
                members.contains(&payload_len.saturating_sub(REF_PREFIX_LEN))
                    && (payload_len - REF_PREFIX_LEN).is_multiple_of(REF_MEMBER_LEN)
            }
            RecordKind::Chapter => (crate::dedup::CHAPTER_HEADER_LEN as u32..=CHAPTER_PAYLOAD_MAX)
                .contains(&payload_len),
            RecordKind::Snapshot => (3..=SNAPSHOT_PAYLOAD_MAX).contains(&payload_len),
        };
        if !length_ok {
            return Err(RecordError::BadLength(payload_len));
        }
        Ok(RecordHeader {
            kind,
            codec: bytes[3],
            seg_seq: word(4),
            lba: dword(8),
            version: dword(16),
            payload_len,
            crc: word(28),
        })
    }
}

/// Bytes a record with `payload_len` bytes of payload occupies.
pub fn record_len_for_payload(payload_len: usize) -> u64 {
    align_up((HEADER_SIZE + payload_len) as u64, RECORD_ALIGN)
}

/// Secret bytes every record's checksum covers: the volume's UUID, which
/// never leaves the image. A client cannot see it, so data it writes can
/// never pass for a log record, even when a scan resynchronises after
/// damage and lands inside a stored block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordKey(pub [u8; 16]);

/// The record checksum: CRC32C over the payload, continued over header
/// bytes 0..28 and then over the volume's key. Payload first, so that part
/// can be computed before the header fields assigned at append time are
/// known.
pub fn record_crc(payload_crc: u32, header: &[u8], key: &RecordKey) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c_append(payload_crc, &header[..28]), &key.0)
}

/// A record's header bytes with its checksum filled in. Encoded and
/// checksummed on the stack: reading them back from the buffer they were
/// just stored into stalled the CRC's loads (3% of a write's CPU).
fn sealed_header(
    mut header: RecordHeader,
    payload: &[u8],
    payload_crc: u32,
    key: &RecordKey,
) -> [u8; HEADER_SIZE] {
    debug_assert_eq!(payload_crc, crc32c::crc32c(payload));
    assert_eq!(header.payload_len as usize, payload.len());
    header.crc = 0;
    let mut bytes = [0u8; HEADER_SIZE];
    header.encode(&mut bytes);
    let crc = record_crc(payload_crc, &bytes, key);
    bytes[28..32].copy_from_slice(&crc.to_le_bytes());
    bytes
}

/// Writes a complete record (header, payload, zero padding) into `out`,
/// which must be exactly `record_len_for_payload(payload.len())` bytes.
/// `payload_crc` must be `crc32c(payload)`.
pub fn encode_record(
    out: &mut [u8],
    header: RecordHeader,
    payload: &[u8],
    payload_crc: u32,
    key: &RecordKey,
) {
    assert_eq!(out.len() as u64, record_len_for_payload(payload.len()));
    out[..HEADER_SIZE].copy_from_slice(&sealed_header(header, payload, payload_crc, key));
    out[HEADER_SIZE..HEADER_SIZE + payload.len()].copy_from_slice(payload);
    out[HEADER_SIZE + payload.len()..].fill(0);
}

/// Appends a complete record to `out`, as [`encode_record`] writes it,
/// without first zeroing the room it takes.
pub fn append_record(
    out: &mut Vec<u8>,
    header: RecordHeader,
    payload: &[u8],
    payload_crc: u32,
    key: &RecordKey,
) {
    let len = record_len_for_payload(payload.len()) as usize;
    let end = out.len() + len;
    out.reserve(len);
    out.extend_from_slice(&sealed_header(header, payload, payload_crc, key));
    out.extend_from_slice(payload);
    out.resize(end, 0);
}

/// Decodes and verifies the record at the start of `bytes`. With
/// `expected_seq`, a record from another segment incarnation is rejected.
pub fn decode_record<'a>(
    bytes: &'a [u8],
    key: &RecordKey,
    expected_seq: Option<u32>,
) -> Result<(RecordHeader, &'a [u8]), RecordError> {
    let header = RecordHeader::decode(bytes)?;
    if let Some(expected) = expected_seq {
        if header.seg_seq != expected {
            return Err(RecordError::WrongSegment {
                expected,
                found: header.seg_seq,
            });
        }
    }
    let end = HEADER_SIZE + header.payload_len as usize;
    if bytes.len() < end {
        return Err(RecordError::Truncated);
    }
    let payload = &bytes[HEADER_SIZE..end];
    let actual = record_crc(crc32c::crc32c(payload), &bytes[..HEADER_SIZE], key);
    if actual != header.crc {
        return Err(RecordError::Checksum {
            expected: header.crc,
            actual,
        });
    }
    Ok((header, payload))
}

/// A unit record's payload, decoded: which blocks it holds at which
/// versions, and their compressed data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitPayload<'a> {
    /// Version of block `header.lba + i`.
    pub versions: Vec<u64>,
    /// Written by the cold-data pass.
    pub recompressed: bool,
    /// The blocks, compressed with the header's codec.
    pub data: &'a [u8],
}

impl UnitPayload<'_> {
    pub fn count(&self) -> usize {
        self.versions.len()
    }
}

/// True if the record is a unit written by the cold-data pass (its
/// payload already verified).
pub fn is_cold_unit(header: &RecordHeader, payload: &[u8]) -> bool {
    header.kind == RecordKind::Unit
        && payload
            .get(1)
            .is_some_and(|flags| flags & UNIT_RECOMPRESSED != 0)
}

/// The first [`UNIT_PREFIX_LEN`] bytes of a unit's payload: its block
/// count and flags. A host write, whose versions are numbered consecutively
/// under the state lock after it compressed, writes this alone.
pub fn unit_prefix_head(
    count: usize,
    consecutive: bool,
    recompressed: bool,
) -> [u8; UNIT_PREFIX_LEN] {
    assert!(
        (2..=UNIT_BLOCKS_MAX).contains(&count),
        "a unit holds 2 to {UNIT_BLOCKS_MAX} blocks, not {count}"
    );
    let mut flags = if consecutive {
        UNIT_CONSECUTIVE_VERSIONS
    } else {
        0
    };
    if recompressed {
        flags |= UNIT_RECOMPRESSED;
    }
    [count as u8, flags, 0, 0]
}

/// Encodes a unit's prefix (and version list, unless the versions are
/// consecutive up to the highest, which goes in the header) for blocks at
/// `versions`; `recompressed` marks a cold-data rewrite. Returns the bytes
/// to put before the compressed data.
pub fn encode_unit_prefix(versions: &[u64], recompressed: bool) -> Vec<u8> {
    let count = versions.len();
    let consecutive = versions.windows(2).all(|pair| pair[1] == pair[0] + 1);
    let mut out = Vec::with_capacity(UNIT_PREFIX_LEN + if consecutive { 0 } else { count * 8 });
    out.extend_from_slice(&unit_prefix_head(count, consecutive, recompressed));
    if !consecutive {
        for version in versions {
            out.extend_from_slice(&version.to_le_bytes());
        }
    }
    out
}

/// The version a unit record's header carries: the highest of its blocks'.
pub fn unit_header_version(versions: &[u64]) -> u64 {
    versions.iter().copied().max().expect("a unit has blocks")
}

/// Decodes a unit record's payload, checking every length against the
/// payload and every version against the header's.
pub fn decode_unit<'a>(
    header: &RecordHeader,
    payload: &'a [u8],
) -> Result<UnitPayload<'a>, String> {
    if header.kind != RecordKind::Unit {
        return Err(format!("a {:?} record is not a unit", header.kind));
    }
    let (&count, rest) = payload.split_first().ok_or("empty unit payload")?;
    let count = count as usize;
    if !(2..=UNIT_BLOCKS_MAX).contains(&count) {
        return Err(format!("unit of {count} blocks"));
    }
    let (&flags, rest) = rest.split_first().ok_or("unit prefix truncated")?;
    if flags & !(UNIT_CONSECUTIVE_VERSIONS | UNIT_RECOMPRESSED) != 0 {
        return Err(format!("unknown unit flags {flags:#x}"));
    }
    let rest = rest.get(2..).ok_or("unit prefix truncated")?;
    let (versions, data) = if flags & UNIT_CONSECUTIVE_VERSIONS != 0 {
        let first = header
            .version
            .checked_sub(count as u64 - 1)
            .ok_or("unit versions below zero")?;
        ((first..=header.version).collect::<Vec<u64>>(), rest)
    } else {
        let list = rest.get(..count * 8).ok_or("unit version list truncated")?;
        let versions: Vec<u64> = list
            .chunks_exact(8)
            .map(|v| u64::from_le_bytes(v.try_into().expect("8 bytes")))
            .collect();
        if unit_header_version(&versions) != header.version {
            return Err("unit versions disagree with its header".into());
        }
        (versions, &rest[count * 8..])
    };
    if data.is_empty() {
        return Err("unit without data".into());
    }
    Ok(UnitPayload {
        versions,
        recompressed: flags & UNIT_RECOMPRESSED != 0,
        data,
    })
}

/// The block count carried by a range record's payload; 0 (which no valid
/// range record carries) if the payload is not 8 bytes.
pub fn range_count(payload: &[u8]) -> u64 {
    match payload.try_into() {
        Ok(bytes) => u64::from_le_bytes(bytes),
        Err(_) => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: RecordKey = RecordKey([9; 16]);

    #[test]
    fn another_volumes_key_rejects_the_record() {
        let bytes = sample(RecordKind::Data, &[1, 2, 3]);
        assert!(decode_record(&bytes, &KEY, None).is_ok());
        assert!(matches!(
            decode_record(&bytes, &RecordKey([8; 16]), None),
            Err(RecordError::Checksum { .. })
        ));
    }

    fn sample(kind: RecordKind, payload: &[u8]) -> Vec<u8> {
        let header = RecordHeader {
            kind,
            codec: 1,
            seg_seq: 77,
            lba: 123_456,
            version: 9_000_000_001,
            payload_len: payload.len() as u32,
            crc: 0,
        };
        let mut out = vec![0xEE; record_len_for_payload(payload.len()) as usize];
        encode_record(&mut out, header, payload, crc32c::crc32c(payload), &KEY);
        out
    }

    #[test]
    fn records_round_trip_and_align() {
        let payload = b"hello, compressed world".to_vec();
        let bytes = sample(RecordKind::Data, &payload);
        assert_eq!(bytes.len() % RECORD_ALIGN as usize, 0);
        let (header, body) = decode_record(&bytes, &KEY, Some(77)).unwrap();
        assert_eq!(header.lba, 123_456);
        assert_eq!(header.version, 9_000_000_001);
        assert_eq!(body, &payload[..]);
        assert_eq!(header.record_len(), bytes.len() as u64);
    }

    #[test]
    fn every_flipped_bit_is_detected() {
        let bytes = sample(RecordKind::Data, &[0x5a; 100]);
        for bit in 0..(HEADER_SIZE + 100) * 8 {
            let mut damaged = bytes.clone();
            damaged[bit / 8] ^= 1 << (bit % 8);
            assert!(
                decode_record(&damaged, &KEY, Some(77)).is_err(),
                "bit {bit} went unnoticed"
            );
        }
    }

    #[test]
    fn wrong_incarnation_and_empty_space_are_told_apart() {
        let bytes = sample(RecordKind::Trim, &5u64.to_le_bytes());
        assert!(matches!(
            decode_record(&bytes, &KEY, Some(78)),
            Err(RecordError::WrongSegment {
                expected: 78,
                found: 77
            })
        ));
        assert_eq!(
            decode_record(&[0u8; 64], &KEY, None),
            Err(RecordError::Empty)
        );
        assert_eq!(
            decode_record(&[0xFFu8; 64], &KEY, None),
            Err(RecordError::BadMagic)
        );
        assert_eq!(
            decode_record(&bytes[..20], &KEY, None),
            Err(RecordError::Truncated)
        );
    }

    #[test]
    fn unit_prefixes_round_trip_with_and_without_a_version_list() {
        for versions in [vec![7, 8, 9, 10], vec![40, 3, 41]] {
            let mut payload = encode_unit_prefix(&versions, versions.len() == 3);
            let consecutive = payload[1] & UNIT_CONSECUTIVE_VERSIONS != 0;
            assert_eq!(consecutive, versions == [7, 8, 9, 10]);
            payload.extend_from_slice(b"compressed");
            let header = RecordHeader {
                kind: RecordKind::Unit,
                codec: 1,
                seg_seq: 1,
                lba: 100,
                version: unit_header_version(&versions),
                payload_len: payload.len() as u32,
                crc: 0,
            };
            let unit = decode_unit(&header, &payload).unwrap();
            assert_eq!(unit.versions, versions);
            assert_eq!(unit.recompressed, versions.len() == 3);
            assert_eq!(unit.data, b"compressed");
        }
        let header = RecordHeader {
            kind: RecordKind::Unit,
            codec: 1,
            seg_seq: 1,
            lba: 0,
            version: 5,
            payload_len: 8,
            crc: 0,
        };
        for (bad, why) in [
            (vec![1, 1, 0, 0, 9], "unit of 1"),
            (vec![33, 1, 0, 0, 9], "unit of 33"),
            (vec![2, 8, 0, 0, 9], "flags"),
            (vec![2, 0, 0, 0, 9], "truncated"),
            (vec![2, 1, 0, 0], "without data"),
            (vec![9, 1, 0, 0, 1], "below zero"),
        ] {
            let error = decode_unit(&header, &bad).unwrap_err();
            assert!(error.contains(why), "{bad:?}: {error}");
        }
    }

    #[test]
    fn impossible_lengths_are_rejected_before_use() {
        let mut bytes = sample(RecordKind::Data, &[1; 16]);
        bytes[24..28].copy_from_slice(&(BLOCK_SIZE as u32 + 1).to_le_bytes());
        assert_eq!(
            decode_record(&bytes, &KEY, None),
            Err(RecordError::BadLength(4097))
        );
        let mut range = sample(RecordKind::Zero, &3u64.to_le_bytes());
        range[24..28].copy_from_slice(&9u32.to_le_bytes());
        assert_eq!(
            decode_record(&range, &KEY, None),
            Err(RecordError::BadLength(9))
        );
    }
}

/// Bytes before a reference record's members: their count (u32).
const REF_PREFIX_LEN: u32 = 4;
/// Bytes of each member of a reference record: content version and owner.
const REF_MEMBER_LEN: u32 = 16;
/// The most blocks one reference record names.
pub const REF_MEMBERS_MAX: u32 = 256;
/// The owner of a member whose content was already shared: none.
pub const REF_NO_OWNER: u64 = u64::MAX;

/// One block of a reference record: the content version it shares, and
/// the block whose entry held that content directly when it was first
/// shared ([`REF_NO_OWNER`] if it was shared already).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefMember {
    pub content: u64,
    pub owner: u64,
}

/// A reference record's payload: the count (u32 LE), then per block its
/// content version and owner (u64 LE each). The header names the first
/// block (`lba`) and its version; block `lba + i` has version `version + i`.
pub fn encode_ref(members: &[RefMember]) -> Vec<u8> {
    assert!(
        (1..=REF_MEMBERS_MAX as usize).contains(&members.len()),
        "{} members in a reference record",
        members.len()
    );
    let mut payload = Vec::with_capacity(REF_PREFIX_LEN as usize + members.len() * 16);
    payload.extend_from_slice(&(members.len() as u32).to_le_bytes());
    for member in members {
        payload.extend_from_slice(&member.content.to_le_bytes());
        payload.extend_from_slice(&member.owner.to_le_bytes());
    }
    payload
}

/// Bytes the reference records for a run of `blocks` blocks take in the
/// log: one record per `REF_MEMBERS_MAX` blocks, 36 bytes of header and
/// count, then 16 per block, to a multiple of 16.
pub fn ref_records_len(blocks: u64) -> u64 {
    let max = REF_MEMBERS_MAX as u64;
    let record = |count: u64| {
        record_len_for_payload((REF_PREFIX_LEN as u64 + REF_MEMBER_LEN as u64 * count) as usize)
    };
    let rest = match blocks.is_multiple_of(max) {
        true => 0,
        false => record(blocks % max),
    };
    blocks / max * record(max) + rest
}

/// The members of a reference record's payload (whose length the header
/// check bounded).
pub fn decode_ref(payload: &[u8]) -> std::result::Result<Vec<RefMember>, String> {
    let count = u32::from_le_bytes(payload[..4].try_into().map_err(|_| "short reference")?);
    let body = &payload[REF_PREFIX_LEN as usize..];
    if count as usize * REF_MEMBER_LEN as usize != body.len() {
        return Err(format!(
            "reference record of {count} blocks has {} bytes of members",
            body.len()
        ));
    }
    Ok(body
        .chunks_exact(REF_MEMBER_LEN as usize)
        .map(|member| RefMember {
            content: u64::from_le_bytes(member[..8].try_into().expect("8 bytes")),
            owner: u64::from_le_bytes(member[8..].try_into().expect("8 bytes")),
        })
        .collect())
}
