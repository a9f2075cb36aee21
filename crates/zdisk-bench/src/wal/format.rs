//! The log's byte format: commit records, the anchor, and where a log
//! position lands on the device.
//!
//! All integers are little-endian. Decoders never trust a length read from
//! the device: a record's payload must fit in what is left of its lap.
//!
//! **Commit record** (`RECORD_HEADER_BYTES` of header, then the payload):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `RECORD_MAGIC` |
//! | 4 | 4 | payload length in bytes |
//! | 8 | 8 | sequence number (the first commit of a log is 1) |
//! | 16 | 4 | CRC32C, chained (below) |
//! | 20 | 4 | epoch: the anchor generation the writer opened the log with |
//!
//! The CRC of commit `s` is CRC32C over the header without its CRC field,
//! then the payload, starting from the CRC of commit `s − 1` (for the first
//! commit after the anchor's start, the anchor's `chain_crc`). A record
//! therefore only passes if it follows, byte for byte, the commit the reader
//! accepted just before it: a stale record left by an earlier lap or by a
//! crashed writer whose predecessor differs can never be taken for the
//! next commit, even with the right sequence number. The epoch keeps a new
//! writer's commits distinct from an old one's even when the payloads are
//! identical.
//!
//! **Anchor** (two slots of one block each, at the log's base; the valid
//! one with the higher generation counts): where the live log starts.
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `ANCHOR_MAGIC` |
//! | 8 | 4 | format version (1) |
//! | 12 | 4 | layout: 1 packed, 2 sparse |
//! | 16 | 8 | generation (slot = generation mod 2) |
//! | 24 | 8 | log id (random; seeds the first chain CRC) |
//! | 32 | 8 | area bytes (a multiple of the block size) |
//! | 40 | 8 | start position (a log position, below) |
//! | 48 | 8 | start sequence number |
//! | 56 | 4 | chain CRC (of commit `start − 1`) |
//! | 60 | 4 | block bytes (4096) |
//! | 64 | 4 | CRC32C of bytes 0..64 |
//!
//! **Positions.** The log is a ring of `area bytes` after the two anchor
//! blocks. A *position* counts bytes from the start of the log and never
//! wraps; position `p` is at device offset `base + 2 blocks + p mod area`.
//! A record never crosses the end of the ring (a lap): one that would
//! starts at the next lap instead.

use std::fmt;

/// The device block the layouts are built around.
pub const BLOCK_BYTES: u64 = 4096;
pub const RECORD_HEADER_BYTES: usize = 24;
pub const RECORD_MAGIC: u32 = u32::from_le_bytes(*b"WALr");
pub const ANCHOR_MAGIC: [u8; 8] = *b"zdiskWAL";
pub const ANCHOR_VERSION: u32 = 1;
const ANCHOR_BYTES: usize = 68;
/// Anchor slots, each one block, before the ring.
pub const ANCHOR_SLOTS: u64 = 2;

/// Where commits go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Layout {
    /// Commits follow each other; a flush rewrites the partly filled block
    /// it ends in, so a block is written again at every flush until full.
    Packed,
    /// Every flush starts a fresh block; the rest of its last block is
    /// zeros, which a compressing drive stores in no space.
    Sparse,
}

impl Layout {
    pub fn name(self) -> &'static str {
        match self {
            Layout::Packed => "packed",
            Layout::Sparse => "sparse",
        }
    }

    fn code(self) -> u32 {
        match self {
            Layout::Packed => 1,
            Layout::Sparse => 2,
        }
    }

    fn from_code(code: u32) -> Option<Layout> {
        match code {
            1 => Some(Layout::Packed),
            2 => Some(Layout::Sparse),
            _ => None,
        }
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The log's place on the device: the anchor slots at `base_offset`, then
/// a ring of `area_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ring {
    pub base_offset: u64,
    pub area_bytes: u64,
}

impl Ring {
    pub fn new(base_offset: u64, area_bytes: u64) -> Ring {
        assert!(
            base_offset.is_multiple_of(BLOCK_BYTES),
            "log base {base_offset} is not block-aligned"
        );
        assert!(
            area_bytes >= BLOCK_BYTES && area_bytes.is_multiple_of(BLOCK_BYTES),
            "log area of {area_bytes} bytes is not a positive number of blocks"
        );
        Ring {
            base_offset,
            area_bytes,
        }
    }

    /// Bytes of device the log occupies, anchors included.
    pub fn device_bytes(&self) -> u64 {
        ANCHOR_SLOTS * BLOCK_BYTES + self.area_bytes
    }

    pub fn area_blocks(&self) -> u64 {
        self.area_bytes / BLOCK_BYTES
    }

    pub fn anchor_offset(&self, slot: u64) -> u64 {
        assert!(slot < ANCHOR_SLOTS);
        self.base_offset + slot * BLOCK_BYTES
    }

    /// Device offset of log position `position`.
    pub fn device_offset(&self, position: u64) -> u64 {
        self.base_offset + ANCHOR_SLOTS * BLOCK_BYTES + position % self.area_bytes
    }

    /// Bytes from `position` to the end of its lap.
    pub fn left_in_lap(&self, position: u64) -> u64 {
        self.area_bytes - position % self.area_bytes
    }

    /// Where a record of `len` bytes that would start at `position` starts:
    /// there, or at the next lap if it would cross the end of the ring.
    pub fn place(&self, position: u64, len: u64) -> u64 {
        assert!(
            len <= self.area_bytes,
            "a record of {len} bytes cannot fit a ring of {}",
            self.area_bytes
        );
        if len <= self.left_in_lap(position) {
            position
        } else {
            next_multiple(position, self.area_bytes)
        }
    }
}

/// `value` rounded up to a multiple of `unit`.
pub fn round_up(value: u64, unit: u64) -> u64 {
    value.div_ceil(unit) * unit
}

/// The next multiple of `unit` strictly after `value`.
pub fn next_multiple(value: u64, unit: u64) -> u64 {
    (value / unit + 1) * unit
}

/// A decoded record header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    pub payload_bytes: u32,
    pub seq: u64,
    pub crc: u32,
    pub epoch: u32,
}

impl RecordHeader {
    pub fn record_bytes(&self) -> u64 {
        RECORD_HEADER_BYTES as u64 + self.payload_bytes as u64
    }
}

/// Encodes a whole record (header and payload) following the commit whose
/// CRC is `prev_crc`; returns the record and its CRC.
pub fn encode_record(seq: u64, epoch: u32, payload: &[u8], prev_crc: u32) -> (Vec<u8>, u32) {
    let payload_bytes = u32::try_from(payload.len()).expect("payload under 4 GiB");
    let mut record = Vec::with_capacity(RECORD_HEADER_BYTES + payload.len());
    record.extend_from_slice(&RECORD_MAGIC.to_le_bytes());
    record.extend_from_slice(&payload_bytes.to_le_bytes());
    record.extend_from_slice(&seq.to_le_bytes());
    record.extend_from_slice(&[0; 4]);
    record.extend_from_slice(&epoch.to_le_bytes());
    record.extend_from_slice(payload);
    let crc = record_crc(prev_crc, &record[..RECORD_HEADER_BYTES], payload);
    record[16..20].copy_from_slice(&crc.to_le_bytes());
    debug_assert_eq!(
        decode_header(&record[..RECORD_HEADER_BYTES]).map(|h| h.crc),
        Some(crc)
    );
    (record, crc)
}

fn record_crc(prev_crc: u32, header: &[u8], payload: &[u8]) -> u32 {
    let crc = crc32c::crc32c_append(prev_crc, &header[..16]);
    let crc = crc32c::crc32c_append(crc, &header[20..RECORD_HEADER_BYTES]);
    crc32c::crc32c_append(crc, payload)
}

/// Decodes a header's fields if its magic is right; says nothing yet about
/// whether the record is intact (see [`verify_record`]).
pub fn decode_header(bytes: &[u8]) -> Option<RecordHeader> {
    let bytes: &[u8; RECORD_HEADER_BYTES] = bytes.get(..RECORD_HEADER_BYTES)?.try_into().ok()?;
    if u32::from_le_bytes(bytes[0..4].try_into().ok()?) != RECORD_MAGIC {
        return None;
    }
    Some(RecordHeader {
        payload_bytes: u32::from_le_bytes(bytes[4..8].try_into().ok()?),
        seq: u64::from_le_bytes(bytes[8..16].try_into().ok()?),
        crc: u32::from_le_bytes(bytes[16..20].try_into().ok()?),
        epoch: u32::from_le_bytes(bytes[20..24].try_into().ok()?),
    })
}

/// Whether `record` (header and payload) is intact and follows the commit
/// whose CRC is `prev_crc`.
pub fn verify_record(record: &[u8], prev_crc: u32) -> bool {
    let Some(header) = decode_header(record) else {
        return false;
    };
    if record.len() as u64 != header.record_bytes() {
        return false;
    }
    let (head, payload) = record.split_at(RECORD_HEADER_BYTES);
    record_crc(prev_crc, head, payload) == header.crc
}

/// The chain CRC the first commit of a new log follows.
pub fn initial_chain_crc(log_id: u64) -> u32 {
    crc32c::crc32c(&log_id.to_le_bytes())
}

/// What an anchor records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Anchor {
    pub layout: Layout,
    pub generation: u64,
    pub log_id: u64,
    pub area_bytes: u64,
    pub start_position: u64,
    pub start_seq: u64,
    pub chain_crc: u32,
}

impl Anchor {
    pub fn slot(&self) -> u64 {
        self.generation % ANCHOR_SLOTS
    }

    /// The anchor as a whole block (the rest zeros).
    pub fn encode(&self) -> Vec<u8> {
        let mut block = vec![0u8; BLOCK_BYTES as usize];
        let b = &mut block[..ANCHOR_BYTES];
        b[0..8].copy_from_slice(&ANCHOR_MAGIC);
        b[8..12].copy_from_slice(&ANCHOR_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.layout.code().to_le_bytes());
        b[16..24].copy_from_slice(&self.generation.to_le_bytes());
        b[24..32].copy_from_slice(&self.log_id.to_le_bytes());
        b[32..40].copy_from_slice(&self.area_bytes.to_le_bytes());
        b[40..48].copy_from_slice(&self.start_position.to_le_bytes());
        b[48..56].copy_from_slice(&self.start_seq.to_le_bytes());
        b[56..60].copy_from_slice(&self.chain_crc.to_le_bytes());
        b[60..64].copy_from_slice(&(BLOCK_BYTES as u32).to_le_bytes());
        let crc = crc32c::crc32c(&b[..64]);
        b[64..68].copy_from_slice(&crc.to_le_bytes());
        debug_assert_eq!(Anchor::decode(&block).as_ref(), Some(self));
        block
    }

    /// The anchor in `bytes`, if it is one and intact.
    pub fn decode(bytes: &[u8]) -> Option<Anchor> {
        let b = bytes.get(..ANCHOR_BYTES)?;
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        if b[0..8] != ANCHOR_MAGIC || crc32c::crc32c(&b[..64]) != u32_at(64) {
            return None;
        }
        if u32_at(8) != ANCHOR_VERSION || u32_at(60) as u64 != BLOCK_BYTES {
            return None;
        }
        let area_bytes = u64_at(32);
        if area_bytes == 0 || !area_bytes.is_multiple_of(BLOCK_BYTES) {
            return None;
        }
        Some(Anchor {
            layout: Layout::from_code(u32_at(12))?,
            generation: u64_at(16),
            log_id: u64_at(24),
            area_bytes,
            start_position: u64_at(40),
            start_seq: u64_at(48),
            chain_crc: u32_at(56),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_verifies_only_after_its_predecessor() {
        let (record, crc) = encode_record(7, 3, b"payload", 0xABCD);
        assert_eq!(record.len(), RECORD_HEADER_BYTES + 7);
        let header = decode_header(&record).unwrap();
        assert_eq!((header.seq, header.epoch, header.crc), (7, 3, crc));
        assert_eq!(header.payload_bytes, 7);
        assert!(verify_record(&record, 0xABCD));
        assert!(!verify_record(&record, 0xABCE), "wrong predecessor");
        // The same commit from another epoch is another record.
        let (other, other_crc) = encode_record(7, 4, b"payload", 0xABCD);
        assert_ne!(other_crc, crc);
        assert!(!verify_record(&other[..other.len() - 1], 0xABCD), "short");
        for at in 0..record.len() {
            let mut damaged = record.clone();
            damaged[at] ^= 0x40;
            assert!(!verify_record(&damaged, 0xABCD), "bit flip at {at}");
        }
    }

    #[test]
    fn zeros_and_garbage_are_not_headers() {
        assert_eq!(decode_header(&[0u8; RECORD_HEADER_BYTES]), None);
        assert_eq!(decode_header(&[0u8; 3]), None);
        assert!(!verify_record(&[0u8; 64], 0));
    }

    #[test]
    fn anchors_round_trip_and_reject_damage() {
        let anchor = Anchor {
            layout: Layout::Sparse,
            generation: 5,
            log_id: 0x1234_5678_9abc,
            area_bytes: 64 * BLOCK_BYTES,
            start_position: 3 * BLOCK_BYTES,
            start_seq: 42,
            chain_crc: 0xdead_beef,
        };
        let block = anchor.encode();
        assert_eq!(block.len() as u64, BLOCK_BYTES);
        assert_eq!(Anchor::decode(&block), Some(anchor));
        assert_eq!(anchor.slot(), 1);
        for at in 0..ANCHOR_BYTES {
            let mut damaged = block.clone();
            damaged[at] ^= 1;
            assert_eq!(Anchor::decode(&damaged), None, "bit flip at {at}");
        }
        assert_eq!(Anchor::decode(&[0u8; 4096]), None);
    }

    #[test]
    fn positions_wrap_on_the_ring_and_records_never_cross_a_lap() {
        let ring = Ring::new(8 * BLOCK_BYTES, 4 * BLOCK_BYTES);
        assert_eq!(ring.device_bytes(), 6 * BLOCK_BYTES);
        assert_eq!(ring.device_offset(0), 10 * BLOCK_BYTES);
        assert_eq!(
            ring.device_offset(4 * BLOCK_BYTES + 5),
            10 * BLOCK_BYTES + 5
        );
        assert_eq!(ring.place(100, 200), 100);
        let near_end = 4 * BLOCK_BYTES - 100;
        assert_eq!(ring.left_in_lap(near_end), 100);
        assert_eq!(ring.place(near_end, 100), near_end);
        assert_eq!(ring.place(near_end, 101), 4 * BLOCK_BYTES);
        assert_eq!(round_up(4096, 4096), 4096);
        assert_eq!(round_up(4097, 4096), 8192);
        assert_eq!(next_multiple(4096, 4096), 8192);
    }
}
