//! The store's byte layout on the device. All integers little-endian.
//!
//! ```text
//! offset 0            superblock (one 4 KiB block)
//! offset 4096*(1+i)   slot i, for i in 0..total_slots
//!
//! superblock:  0  magic "ZDISKKV1"      8 bytes
//!              8  version (1)           u32
//!             12  slot_bytes (4096)     u32
//!             16  home_slots            u64   keys hash to 0..home_slots
//!             24  total_slots           u64   home_slots + probe_slots
//!             32  probe_slots           u32   longest probe sequence
//!             36  crc32c of bytes 0..36 u32
//!             (rest zeros)
//!
//! slot:        0  magic "KVS1"          u32   0 = never written (empty)
//!              4  crc32c                u32   of bytes 8..16+used_bytes
//!              8  record_count          u16
//!             10  used_bytes            u16   bytes of records after the header
//!             12  flags                 u8    bit 0: OVERFLOWED
//!             13  reserved (0)          3 bytes
//!             16  records, back to back:
//!                   key_len u8 (1..=255), value_len u16, key, value
//!             (rest zeros, which the drive's compression removes)
//! ```
//!
//! OVERFLOWED on slot s means some key whose probe sequence reached s found
//! it full and lives in a later slot; a lookup stops at the first slot
//! without the flag. The flag is never cleared (there is no compaction), so
//! a slot that once overflowed keeps costing lookups that pass it one more
//! read; the load factor keeps such slots rare.
//!
//! Records are not ordered; a slot never holds the same key twice, and
//! the store (not this module) keeps a key in at most one slot of its
//! probe sequence once a put or delete of it has returned.

use crate::error::{Error, Result};

/// Bytes per slot and per superblock: one zdisk block.
pub const SLOT_BYTES: usize = 4096;
/// Bytes of a slot's header.
pub const SLOT_HEADER_BYTES: usize = 16;
/// Bytes a record spends on lengths.
pub const RECORD_HEADER_BYTES: usize = 3;
/// The most key and value bytes one record may hold together.
pub const RECORD_PAYLOAD_MAX_BYTES: usize = SLOT_BYTES - SLOT_HEADER_BYTES - RECORD_HEADER_BYTES;
/// The longest key.
pub const KEY_MAX_BYTES: usize = 255;

const SUPERBLOCK_MAGIC: &[u8; 8] = b"ZDISKKV1";
const FORMAT_VERSION: u32 = 1;
const SLOT_MAGIC: u32 = u32::from_le_bytes(*b"KVS1");
const FLAG_OVERFLOWED: u8 = 1;

/// The store's geometry, as the superblock records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub home_slots: u64,
    pub probe_slots: u32,
}

impl Geometry {
    pub fn total_slots(&self) -> u64 {
        self.home_slots + u64::from(self.probe_slots)
    }

    /// Bytes of device the store occupies.
    pub fn device_bytes(&self) -> u64 {
        (1 + self.total_slots()) * SLOT_BYTES as u64
    }

    /// Where slot `slot` starts on the device.
    pub fn slot_offset(&self, slot: u64) -> u64 {
        assert!(slot < self.total_slots(), "slot {slot} out of range");
        (1 + slot) * SLOT_BYTES as u64
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut block = vec![0u8; SLOT_BYTES];
        block[0..8].copy_from_slice(SUPERBLOCK_MAGIC);
        block[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        block[12..16].copy_from_slice(&(SLOT_BYTES as u32).to_le_bytes());
        block[16..24].copy_from_slice(&self.home_slots.to_le_bytes());
        block[24..32].copy_from_slice(&self.total_slots().to_le_bytes());
        block[32..36].copy_from_slice(&self.probe_slots.to_le_bytes());
        let crc = crc32c::crc32c(&block[0..36]);
        block[36..40].copy_from_slice(&crc.to_le_bytes());
        block
    }

    pub fn decode(block: &[u8]) -> Result<Geometry> {
        assert_eq!(block.len(), SLOT_BYTES);
        if &block[0..8] != SUPERBLOCK_MAGIC {
            return Err(Error::NotAStore);
        }
        let u32_at = |at: usize| u32::from_le_bytes(block[at..at + 4].try_into().expect("4 bytes"));
        let u64_at = |at: usize| u64::from_le_bytes(block[at..at + 8].try_into().expect("8 bytes"));
        let bad = |why: String| Err(Error::BadSuperblock(why));
        let crc = crc32c::crc32c(&block[0..36]);
        if u32_at(36) != crc {
            return bad(format!("checksum {:#x}, computed {crc:#x}", u32_at(36)));
        }
        if u32_at(8) != FORMAT_VERSION {
            return bad(format!(
                "format version {}, this build reads {FORMAT_VERSION}",
                u32_at(8)
            ));
        }
        if u32_at(12) as usize != SLOT_BYTES {
            return bad(format!(
                "slot size {}, this build uses {SLOT_BYTES}",
                u32_at(12)
            ));
        }
        let geometry = Geometry {
            home_slots: u64_at(16),
            probe_slots: u32_at(32),
        };
        if geometry.home_slots == 0 || geometry.probe_slots == 0 {
            return bad("no slots".into());
        }
        if geometry
            .home_slots
            .checked_add(u64::from(geometry.probe_slots))
            != Some(u64_at(24))
        {
            return bad(format!(
                "total slots {} is not home {} + probe {}",
                u64_at(24),
                geometry.home_slots,
                geometry.probe_slots
            ));
        }
        Ok(geometry)
    }
}

/// Checks a key and value against the record limits.
pub fn check_record(key: &[u8], value: &[u8]) -> Result<()> {
    if key.is_empty()
        || key.len() > KEY_MAX_BYTES
        || key.len() + value.len() > RECORD_PAYLOAD_MAX_BYTES
    {
        return Err(Error::TooBig {
            key_bytes: key.len(),
            value_bytes: value.len(),
            max_bytes: RECORD_PAYLOAD_MAX_BYTES,
        });
    }
    Ok(())
}

/// Bytes a record of this key and value takes in a slot.
pub fn record_bytes(key: &[u8], value: &[u8]) -> usize {
    RECORD_HEADER_BYTES + key.len() + value.len()
}

/// One slot's bytes, edited in place. [`Slot::decode`] validates; every
/// other method assumes a valid slot.
pub struct Slot {
    bytes: Box<[u8; SLOT_BYTES]>,
}

/// Where a record sits in a slot.
#[derive(Debug, Clone, Copy)]
pub struct RecordAt {
    start: usize,
    len: usize,
    value_start: usize,
}

impl Slot {
    pub fn empty() -> Slot {
        Slot {
            bytes: Box::new([0u8; SLOT_BYTES]),
        }
    }

    /// Takes a slot read from the device and checks it: magic, checksum,
    /// and that every record lies inside the used bytes.
    pub fn decode(bytes: Box<[u8; SLOT_BYTES]>, slot: u64) -> Result<Slot> {
        let slot_view = Slot { bytes };
        let magic = slot_view.u32_at(0);
        if magic == 0 {
            // Never written: must be all zeros, as a fresh device reads.
            if slot_view.bytes.iter().any(|&b| b != 0) {
                return Err(Error::BadSlot {
                    slot,
                    why: "no magic but not all zeros".into(),
                });
            }
            return Ok(slot_view);
        }
        let bad = |why: String| Err(Error::BadSlot { slot, why });
        if magic != SLOT_MAGIC {
            return bad(format!("magic {magic:#x}"));
        }
        let used = slot_view.used_bytes();
        if SLOT_HEADER_BYTES + used > SLOT_BYTES {
            return bad(format!("{used} used bytes"));
        }
        let crc = crc32c::crc32c(&slot_view.bytes[8..SLOT_HEADER_BYTES + used]);
        if crc != slot_view.u32_at(4) {
            return bad(format!(
                "checksum {:#x}, computed {crc:#x}",
                slot_view.u32_at(4)
            ));
        }
        let mut count = 0usize;
        let mut at = SLOT_HEADER_BYTES;
        while at < SLOT_HEADER_BYTES + used {
            match slot_view.record_at(at) {
                Some(record) if record.start + record.len <= SLOT_HEADER_BYTES + used => {
                    at += record.len;
                    count += 1;
                }
                _ => return bad(format!("record at byte {at} runs past the used bytes")),
            }
        }
        if count != slot_view.record_count() {
            return bad(format!(
                "{count} records, header says {}",
                slot_view.record_count()
            ));
        }
        Ok(slot_view)
    }

    /// The slot's bytes as they are (sealed if it came from decode or seal).
    pub fn bytes(&self) -> &[u8; SLOT_BYTES] {
        &self.bytes
    }

    /// The bytes to write, with the checksum computed.
    pub fn seal(&mut self) -> &[u8; SLOT_BYTES] {
        let used = self.used_bytes();
        self.bytes[0..4].copy_from_slice(&SLOT_MAGIC.to_le_bytes());
        let crc = crc32c::crc32c(&self.bytes[8..SLOT_HEADER_BYTES + used]);
        self.bytes[4..8].copy_from_slice(&crc.to_le_bytes());
        &self.bytes
    }

    fn u32_at(&self, at: usize) -> u32 {
        u32::from_le_bytes(self.bytes[at..at + 4].try_into().expect("4 bytes"))
    }

    fn u16_at(&self, at: usize) -> usize {
        u16::from_le_bytes([self.bytes[at], self.bytes[at + 1]]) as usize
    }

    fn set_u16(&mut self, at: usize, value: usize) {
        let value = u16::try_from(value).expect("fits a slot");
        self.bytes[at..at + 2].copy_from_slice(&value.to_le_bytes());
    }

    pub fn record_count(&self) -> usize {
        self.u16_at(8)
    }

    pub fn used_bytes(&self) -> usize {
        self.u16_at(10)
    }

    pub fn free_bytes(&self) -> usize {
        SLOT_BYTES - SLOT_HEADER_BYTES - self.used_bytes()
    }

    pub fn overflowed(&self) -> bool {
        self.bytes[12] & FLAG_OVERFLOWED != 0
    }

    pub fn set_overflowed(&mut self) {
        self.bytes[12] |= FLAG_OVERFLOWED;
    }

    /// The record starting at byte `at`, if its lengths stay inside the slot.
    fn record_at(&self, at: usize) -> Option<RecordAt> {
        if at + RECORD_HEADER_BYTES > SLOT_BYTES {
            return None;
        }
        let key_len = self.bytes[at] as usize;
        let value_len = self.u16_at(at + 1);
        let len = RECORD_HEADER_BYTES + key_len + value_len;
        if key_len == 0 || at + len > SLOT_BYTES {
            return None;
        }
        Some(RecordAt {
            start: at,
            len,
            value_start: at + RECORD_HEADER_BYTES + key_len,
        })
    }

    /// Finds `key`'s record.
    pub fn find(&self, key: &[u8]) -> Option<RecordAt> {
        let end = SLOT_HEADER_BYTES + self.used_bytes();
        let mut at = SLOT_HEADER_BYTES;
        while at < end {
            let record = self.record_at(at).expect("a decoded slot");
            if &self.bytes[at + RECORD_HEADER_BYTES..record.value_start] == key {
                return Some(record);
            }
            at += record.len;
        }
        None
    }

    pub fn value(&self, record: RecordAt) -> &[u8] {
        &self.bytes[record.value_start..record.start + record.len]
    }

    /// Removes a record found by [`Slot::find`], closing the gap.
    pub fn remove(&mut self, record: RecordAt) {
        let end = SLOT_HEADER_BYTES + self.used_bytes();
        self.bytes
            .copy_within(record.start + record.len..end, record.start);
        self.bytes[end - record.len..end].fill(0);
        self.set_u16(10, self.used_bytes() - record.len);
        self.set_u16(8, self.record_count() - 1);
    }

    /// Appends a record if it fits; false if not.
    pub fn append(&mut self, key: &[u8], value: &[u8]) -> bool {
        let len = record_bytes(key, value);
        if len > self.free_bytes() {
            return false;
        }
        let at = SLOT_HEADER_BYTES + self.used_bytes();
        self.bytes[at] = u8::try_from(key.len()).expect("checked key length");
        self.bytes[at + 1..at + 3].copy_from_slice(&(value.len() as u16).to_le_bytes());
        self.bytes[at + 3..at + 3 + key.len()].copy_from_slice(key);
        self.bytes[at + 3 + key.len()..at + len].copy_from_slice(value);
        self.set_u16(10, self.used_bytes() + len);
        self.set_u16(8, self.record_count() + 1);
        true
    }

    /// Every record's key and value, in slot order.
    pub fn records(&self) -> Vec<(&[u8], &[u8])> {
        let end = SLOT_HEADER_BYTES + self.used_bytes();
        let mut out = Vec::with_capacity(self.record_count());
        let mut at = SLOT_HEADER_BYTES;
        while at < end {
            let record = self.record_at(at).expect("a decoded slot");
            out.push((
                &self.bytes[at + RECORD_HEADER_BYTES..record.value_start],
                self.value(record),
            ));
            at += record.len;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(slot: &mut Slot) -> Slot {
        let bytes = Box::new(*slot.seal());
        Slot::decode(bytes, 0).expect("a sealed slot decodes")
    }

    #[test]
    fn records_survive_encode_and_decode() {
        let mut slot = Slot::empty();
        assert!(slot.append(b"alpha", b"one"));
        assert!(slot.append(b"beta", &[7u8; 300]));
        slot.set_overflowed();
        let decoded = round_trip(&mut slot);
        assert_eq!(decoded.record_count(), 2);
        assert!(decoded.overflowed());
        let beta = decoded.find(b"beta").expect("beta");
        assert_eq!(decoded.value(beta), &[7u8; 300][..]);
        assert!(decoded.find(b"gamma").is_none());
    }

    #[test]
    fn remove_closes_the_gap_and_zeroes_the_tail() {
        let mut slot = Slot::empty();
        for key in [b"a", b"b", b"c"] {
            assert!(slot.append(key, b"value"));
        }
        let b = slot.find(b"b").unwrap();
        slot.remove(b);
        let decoded = round_trip(&mut slot);
        let keys: Vec<&[u8]> = decoded.records().iter().map(|(k, _)| *k).collect();
        assert_eq!(keys, vec![&b"a"[..], &b"c"[..]]);
        let used = decoded.used_bytes();
        assert!(decoded.bytes[SLOT_HEADER_BYTES + used..]
            .iter()
            .all(|&b| b == 0));
    }

    #[test]
    fn append_refuses_what_does_not_fit() {
        let mut slot = Slot::empty();
        let value = vec![1u8; 1000];
        let mut stored = 0;
        while slot.append(format!("k{stored}").as_bytes(), &value) {
            stored += 1;
        }
        assert_eq!(stored, 4, "4 records of ~1 KB fit in 4080 bytes");
        assert!(slot.free_bytes() < 1000 + 5);
    }

    #[test]
    fn damaged_slots_are_refused() {
        let mut slot = Slot::empty();
        assert!(slot.append(b"key", b"value"));
        let sealed = *slot.seal();
        let mut flipped = sealed;
        flipped[20] ^= 1;
        assert!(matches!(
            Slot::decode(Box::new(flipped), 3),
            Err(Error::BadSlot { slot: 3, .. })
        ));
        let mut lying = sealed;
        lying[10] = 0xff; // used_bytes far past the records
        assert!(Slot::decode(Box::new(lying), 3).is_err());
        let mut junk = [0u8; SLOT_BYTES];
        junk[100] = 1;
        assert!(Slot::decode(Box::new(junk), 3).is_err());
    }

    #[test]
    fn superblock_round_trips_and_checks() {
        let geometry = Geometry {
            home_slots: 1000,
            probe_slots: 64,
        };
        let block = geometry.encode();
        assert_eq!(Geometry::decode(&block).unwrap(), geometry);
        let mut damaged = block.clone();
        damaged[17] ^= 1;
        assert!(matches!(
            Geometry::decode(&damaged),
            Err(Error::BadSuperblock(_))
        ));
        assert!(matches!(
            Geometry::decode(&vec![0u8; SLOT_BYTES]),
            Err(Error::NotAStore)
        ));
    }

    #[test]
    fn record_limits() {
        assert!(check_record(b"", b"v").is_err());
        assert!(check_record(&[1u8; 256], b"v").is_err());
        assert!(check_record(b"k", &vec![0u8; RECORD_PAYLOAD_MAX_BYTES]).is_err());
        assert!(check_record(b"k", &vec![0u8; RECORD_PAYLOAD_MAX_BYTES - 1]).is_ok());
    }
}
