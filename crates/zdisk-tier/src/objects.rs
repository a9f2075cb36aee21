//! What the tier keeps in the bucket: object names and the root object's
//! byte format (docs/format.md, "The object-store tier").
//!
//! Under a volume's prefix:
//! - `seg/SSSSSSSS-QQQQQQQQ-WWWWWWWWWWWWWWWW`: a prefix of one segment
//!   incarnation's bytes (segment id, the low 32 bits of its sequence
//!   number, and the writer that wrote it, in hex). The writer is part of
//!   the name because a writer restored from an older root numbers its
//!   incarnations from that root, as a crashed writer may already have.
//!   Such an object may be replaced by a longer prefix of the same
//!   incarnation, never by different bytes, so any length a root names
//!   stays readable.
//! - `root/NNNNNNNNNNNNNNNN`: root object number N, written once with a
//!   conditional PUT (`If-None-Match: *`). It holds an engine root and the
//!   list of segment objects (with the length of each) that root needs.

use crate::error::{Result, TierError};

pub const ROOT_MAGIC: &[u8; 8] = b"ZDTROOT1";
/// Most segment entries a root object may list (16 Mi segments).
const MAX_ENTRIES: u32 = 1 << 24;
/// Largest engine root a root object may carry (a file slot holds less).
const MAX_ROOT_BYTES: u32 = 1 << 20;

/// An incarnation in the bucket: (segment, seq32, writer).
pub type Incarnation = (u32, u32, u64);

pub fn segment_key(prefix: &str, (segment, seq32, writer): Incarnation) -> String {
    format!("{prefix}seg/{segment:08x}-{seq32:08x}-{writer:016x}")
}

/// A writer's short id in object names: the first 8 bytes of its id.
pub fn short_writer(writer_id: &[u8; 16]) -> u64 {
    u64::from_le_bytes(writer_id[..8].try_into().expect("8 bytes"))
}

pub fn root_key(prefix: &str, number: u64) -> String {
    format!("{prefix}root/{number:016x}")
}

/// Parses the name of a segment object (the part after the prefix).
pub fn parse_segment_name(name: &str) -> Option<Incarnation> {
    let rest = name.strip_prefix("seg/")?;
    let mut parts = rest.split('-');
    let (segment, seq, writer) = (parts.next()?, parts.next()?, parts.next()?);
    if segment.len() != 8 || seq.len() != 8 || writer.len() != 16 || parts.next().is_some() {
        return None;
    }
    Some((
        u32::from_str_radix(segment, 16).ok()?,
        u32::from_str_radix(seq, 16).ok()?,
        u64::from_str_radix(writer, 16).ok()?,
    ))
}

/// Parses the name of a root object (the part after the prefix).
pub fn parse_root_name(name: &str) -> Option<u64> {
    let number = name.strip_prefix("root/")?;
    if number.len() != 16 {
        return None;
    }
    u64::from_str_radix(number, 16).ok()
}

/// One segment incarnation a root needs, and how much of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct SegmentEntry {
    pub segment: u32,
    pub seq32: u32,
    /// The writer whose object it is (`short_writer`).
    pub writer: u64,
    pub len_bytes: u64,
}

impl SegmentEntry {
    pub fn incarnation(&self) -> Incarnation {
        (self.segment, self.seq32, self.writer)
    }
}

/// A root object: everything a new cache needs to serve the volume as the
/// engine root it carries describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootObject {
    pub number: u64,
    /// The writer (a local image) that published it.
    pub writer_id: [u8; 16],
    /// True if the engine root is a clean stop's: its writer has let go.
    pub clean: bool,
    pub segments: Vec<SegmentEntry>,
    /// The engine root, as in a metadata slot (docs/format.md).
    pub engine_root: Vec<u8>,
}

impl RootObject {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.segments.len() * 16 + self.engine_root.len());
        out.extend_from_slice(ROOT_MAGIC);
        out.extend_from_slice(&self.number.to_le_bytes());
        out.extend_from_slice(&self.writer_id);
        out.push(self.clean as u8);
        out.extend_from_slice(&(self.segments.len() as u32).to_le_bytes());
        for entry in &self.segments {
            out.extend_from_slice(&entry.segment.to_le_bytes());
            out.extend_from_slice(&entry.seq32.to_le_bytes());
            out.extend_from_slice(&entry.writer.to_le_bytes());
            out.extend_from_slice(&entry.len_bytes.to_le_bytes());
        }
        out.extend_from_slice(&(self.engine_root.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.engine_root);
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<RootObject> {
        let bad = |why: &str| TierError::BadObject(format!("root object: {why}"));
        if bytes.len() < 4 {
            return Err(bad("too short"));
        }
        let (body, crc) = bytes.split_at(bytes.len() - 4);
        if crc32c::crc32c(body).to_le_bytes() != crc {
            return Err(bad("checksum mismatch"));
        }
        let mut input = Reader { bytes: body, at: 0 };
        if input.take(8).ok_or_else(|| bad("too short"))? != ROOT_MAGIC {
            return Err(bad("not a zdisk root object"));
        }
        let number = input.u64().ok_or_else(|| bad("truncated"))?;
        let writer_id: [u8; 16] = input
            .take(16)
            .ok_or_else(|| bad("truncated"))?
            .try_into()
            .expect("16 bytes");
        let clean = match input.take(1).ok_or_else(|| bad("truncated"))?[0] {
            0 => false,
            1 => true,
            _ => return Err(bad("clean flag is neither 0 nor 1")),
        };
        let count = input.u32().ok_or_else(|| bad("truncated"))?;
        if count > MAX_ENTRIES || count as usize * 24 > body.len() {
            return Err(bad("segment count out of range"));
        }
        let mut segments = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let segment = input.u32().ok_or_else(|| bad("truncated"))?;
            let seq32 = input.u32().ok_or_else(|| bad("truncated"))?;
            let writer = input.u64().ok_or_else(|| bad("truncated"))?;
            let len_bytes = input.u64().ok_or_else(|| bad("truncated"))?;
            segments.push(SegmentEntry {
                segment,
                seq32,
                writer,
                len_bytes,
            });
        }
        let root_len = input.u32().ok_or_else(|| bad("truncated"))?;
        if root_len > MAX_ROOT_BYTES {
            return Err(bad("engine root too large"));
        }
        let engine_root = input
            .take(root_len as usize)
            .ok_or_else(|| bad("truncated"))?
            .to_vec();
        if input.at != body.len() {
            return Err(bad("trailing bytes"));
        }
        Ok(RootObject {
            number,
            writer_id,
            clean,
            segments,
            engine_root,
        })
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, len: usize) -> Option<&[u8]> {
        let end = self.at.checked_add(len)?;
        let out = self.bytes.get(self.at..end)?;
        self.at = end;
        Some(out)
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> RootObject {
        RootObject {
            number: 7,
            writer_id: [3; 16],
            clean: true,
            segments: vec![
                SegmentEntry {
                    segment: 1,
                    seq32: 9,
                    writer: 77,
                    len_bytes: 4096,
                },
                SegmentEntry {
                    segment: 40,
                    seq32: 2,
                    writer: u64::MAX,
                    len_bytes: 1 << 20,
                },
            ],
            engine_root: vec![1, 2, 3, 4, 5],
        }
    }

    #[test]
    fn root_objects_round_trip() {
        let root = sample();
        assert_eq!(RootObject::decode(&root.encode()).unwrap(), root);
    }

    #[test]
    fn any_damage_to_a_root_object_is_detected() {
        let bytes = sample().encode();
        for at in 0..bytes.len() {
            let mut damaged = bytes.clone();
            damaged[at] ^= 0x10;
            assert!(RootObject::decode(&damaged).is_err(), "flip at {at} passed");
        }
        for len in 0..bytes.len() {
            assert!(
                RootObject::decode(&bytes[..len]).is_err(),
                "cut at {len} passed"
            );
        }
    }

    #[test]
    fn names_round_trip() {
        let key = segment_key("vol/", (0x1234, 0xdead_beef, 0x42));
        assert_eq!(key, "vol/seg/00001234-deadbeef-0000000000000042");
        assert_eq!(
            parse_segment_name(key.strip_prefix("vol/").unwrap()),
            Some((0x1234, 0xdead_beef, 0x42))
        );
        assert_eq!(parse_segment_name("seg/00001234-deadbeef"), None);
        let key = root_key("", 5);
        assert_eq!(parse_root_name(&key), Some(5));
        assert_eq!(parse_root_name("root/5"), None);
        assert_eq!(parse_segment_name("seg/1-2"), None);
    }
}
