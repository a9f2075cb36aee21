//! The store: a key hashes straight to its home slot on the device; no
//! table in memory, no log, no compaction. Every operation reads the slots
//! it needs and writes back the ones it changed, whole.
//!
//! Overflow: linear probing. A key lives in the first slot of its probe
//! sequence `home, home+1, …, home+probe_slots-1` that had room when it was
//! put; every slot it passed carries the OVERFLOWED flag (format.rs). A
//! lookup walks from home and stops at the first slot without the flag.
//! The sequence never wraps: `probe_slots` spare slots follow the home
//! slots. When no slot in the sequence has room, `put` fails with
//! [`Error::Full`] and changes nothing.
//!
//! Invariants (checked by [`Store::check`]):
//! - every record lies in its key's probe sequence, and every slot between
//!   its home and it has OVERFLOWED;
//! - once a put or delete has returned, its key has at most one record.
//!
//! Crash consistency, given the device contract (device.rs: an unflushed
//! slot write survives whole or not at all, in any subset):
//! - a put or delete that returned and was followed by a returned
//!   [`Store::flush`] survives any crash;
//! - an unflushed put leaves its key with the old value or the new one.
//!   A put that changes one slot is one write. A put that sets OVERFLOWED
//!   flags flushes them before it writes the record they lead to.
//!   A put that moves a record
//!   (the new value no longer fits where the old one is) writes the new
//!   record and the flags that lead to it, flushes, and only then removes
//!   the old copy, so no crash loses both. A crash between the two leaves
//!   two copies; lookups take the first, and the next put or delete of the
//!   key removes the rest (both walk the whole sequence).
//!
//! Concurrency: each slot has a lock (striped, [`LOCK_STRIPES`]); an
//! operation takes the locks of the slots it visits in ascending order and
//! holds them until it is done, so operations on one key are serialised
//! and there is no deadlock while threads × probe_slots < LOCK_STRIPES.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::cache::SlotCache;
use crate::device::SlotDevice;
use crate::error::{Error, Result};
use crate::format::{check_record, record_bytes, Geometry, Slot, SLOT_BYTES};

/// Lock stripes over the slots.
pub const LOCK_STRIPES: usize = 1 << 16;
/// The longest probe sequence a store may be formatted with.
pub const PROBE_SLOTS_MAX: u32 = 256;
/// Zeroing the slot area at format time goes in requests of this size.
const ZERO_CHUNK_BYTES: u64 = 1 << 30;

/// How to lay out a new store.
#[derive(Debug, Clone, Copy)]
pub struct FormatConfig {
    pub home_slots: u64,
    pub probe_slots: u32,
}

impl FormatConfig {
    /// Enough home slots for `pairs` records of `record_payload_bytes`
    /// (key + value) each, filled to `fill` (0 < fill ≤ 1) of a slot on
    /// average. KallaxDB's point: a low fill costs logical space only,
    /// which the drive's compression gives back.
    pub fn for_pairs(pairs: u64, record_payload_bytes: usize, fill: f64) -> FormatConfig {
        assert!(fill > 0.0 && fill <= 1.0, "fill {fill} outside (0, 1]");
        let per_slot = (SLOT_BYTES - crate::format::SLOT_HEADER_BYTES) as f64 * fill
            / (record_payload_bytes + crate::format::RECORD_HEADER_BYTES) as f64;
        FormatConfig {
            home_slots: ((pairs as f64 / per_slot).ceil() as u64).max(1),
            probe_slots: 64,
        }
    }
}

/// Counts since the store was opened.
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct StoreStats {
    pub slot_reads: u64,
    pub slot_writes: u64,
    pub flushes: u64,
    /// Puts whose record went to a slot other than its home.
    pub overflow_puts: u64,
    /// Records moved to another slot because they grew.
    pub moves: u64,
}

#[derive(Default)]
struct Counters {
    slot_reads: AtomicU64,
    slot_writes: AtomicU64,
    flushes: AtomicU64,
    overflow_puts: AtomicU64,
    moves: AtomicU64,
}

/// What [`Store::check`] found.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct CheckReport {
    pub records: u64,
    pub slots_used: u64,
    pub slots_overflowed: u64,
    /// Records not at their home slot.
    pub records_displaced: u64,
    /// Keys with more than one record (only after a crash during a move).
    pub duplicate_keys: u64,
    /// Invariant violations, one line each.
    pub problems: Vec<String>,
}

/// A key-value store on a [`SlotDevice`]. See the module documentation.
pub struct Store<D> {
    device: D,
    geometry: Geometry,
    stripes: Box<[Mutex<()>]>,
    counters: Counters,
    cache: SlotCache,
}

/// The slots an operation has visited, locked, from its home on.
struct Chain<'a> {
    home: u64,
    slots: Vec<Slot>,
    _guards: Vec<MutexGuard<'a, ()>>,
}

/// The key's hash: FNV-1a, then a 64-bit finaliser to spread low bits.
pub fn key_hash(key: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &byte in key {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xff51_afd7_ed55_8ccd);
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    hash ^ (hash >> 33)
}

impl<D: SlotDevice> Store<D> {
    /// Lays out a new store at the start of `device`: a superblock, and
    /// the slot area zeroed (a TRIM-like write-zeroes on zdisk, which
    /// costs no space).
    pub fn format(device: D, config: FormatConfig) -> Result<Store<D>> {
        assert!(config.probe_slots >= 1, "probe_slots must be at least 1");
        assert!(
            config.probe_slots <= PROBE_SLOTS_MAX,
            "probe_slots {} above {PROBE_SLOTS_MAX}",
            config.probe_slots
        );
        let geometry = Geometry {
            home_slots: config.home_slots.max(1),
            probe_slots: config.probe_slots,
        };
        if device.size_bytes() < geometry.device_bytes() {
            return Err(Error::DeviceTooSmall {
                size_bytes: device.size_bytes(),
                slots: geometry.total_slots(),
            });
        }
        // Superblock gone first, so a format cut short is not a store.
        device.write_at(&[0u8; SLOT_BYTES], 0)?;
        device.flush()?;
        let mut offset = SLOT_BYTES as u64;
        while offset < geometry.device_bytes() {
            let len = ZERO_CHUNK_BYTES.min(geometry.device_bytes() - offset);
            device.write_zeroes(offset, len)?;
            offset += len;
        }
        device.flush()?;
        device.write_at(&geometry.encode(), 0)?;
        device.flush()?;
        Ok(Store::with_geometry(device, geometry))
    }

    /// Opens the store on `device`.
    pub fn open(device: D) -> Result<Store<D>> {
        let mut block = vec![0u8; SLOT_BYTES];
        device.read_at(&mut block, 0)?;
        let geometry = Geometry::decode(&block)?;
        if device.size_bytes() < geometry.device_bytes() {
            return Err(Error::DeviceTooSmall {
                size_bytes: device.size_bytes(),
                slots: geometry.total_slots(),
            });
        }
        Ok(Store::with_geometry(device, geometry))
    }

    fn with_geometry(device: D, geometry: Geometry) -> Store<D> {
        let stripes = (0..LOCK_STRIPES).map(|_| Mutex::new(())).collect();
        Store {
            device,
            geometry,
            stripes,
            counters: Counters::default(),
            cache: SlotCache::new(0),
        }
    }

    /// Gives the store a cache of slots in RAM (write-through; see
    /// cache.rs). Without one, every slot visited is a device read.
    pub fn with_cache(mut self, cache_bytes: u64) -> Store<D> {
        self.cache = SlotCache::new(cache_bytes);
        self
    }

    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    pub fn device(&self) -> &D {
        &self.device
    }

    pub fn stats(&self) -> StoreStats {
        let c = &self.counters;
        StoreStats {
            slot_reads: c.slot_reads.load(Ordering::Relaxed),
            slot_writes: c.slot_writes.load(Ordering::Relaxed),
            flushes: c.flushes.load(Ordering::Relaxed),
            overflow_puts: c.overflow_puts.load(Ordering::Relaxed),
            moves: c.moves.load(Ordering::Relaxed),
        }
    }

    /// The home slot of `key`.
    pub fn home_slot(&self, key: &[u8]) -> u64 {
        key_hash(key) % self.geometry.home_slots
    }

    /// Reads a slot; the caller holds its lock (or the store is quiet).
    fn read_slot(&self, slot: u64) -> Result<Slot> {
        if let Some(bytes) = self.cache.get(slot) {
            return Slot::decode(bytes, slot);
        }
        let mut bytes = Box::new([0u8; SLOT_BYTES]);
        self.device
            .read_at(&mut bytes[..], self.geometry.slot_offset(slot))?;
        self.counters.slot_reads.fetch_add(1, Ordering::Relaxed);
        let decoded = Slot::decode(bytes, slot)?;
        self.cache.put(slot, decoded.bytes());
        Ok(decoded)
    }

    fn write_slot(&self, slot_no: u64, slot: &mut Slot) -> Result<()> {
        let bytes = slot.seal();
        // Pair the checksum with decode's: what goes out must read back.
        debug_assert!(Slot::decode(Box::new(*bytes), slot_no).is_ok());
        self.device
            .write_at(bytes, self.geometry.slot_offset(slot_no))?;
        self.cache.put(slot_no, bytes);
        self.counters.slot_writes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn chain(&self, key: &[u8]) -> Chain<'_> {
        Chain {
            home: self.home_slot(key),
            slots: Vec::new(),
            _guards: Vec::new(),
        }
    }

    /// Locks and reads the next slot of the chain; false past the probe limit.
    fn extend<'a>(&'a self, chain: &mut Chain<'a>) -> Result<bool> {
        let index = chain.slots.len() as u64;
        if index >= u64::from(self.geometry.probe_slots) {
            return Ok(false);
        }
        let slot_no = chain.home + index;
        let guard = self.stripes[(slot_no % LOCK_STRIPES as u64) as usize]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        chain._guards.push(guard);
        chain.slots.push(self.read_slot(slot_no)?);
        Ok(true)
    }

    /// The value of `key`, if it has one.
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        if key.is_empty() || key.len() > crate::format::KEY_MAX_BYTES {
            return Ok(None);
        }
        let mut chain = self.chain(key);
        while self.extend(&mut chain)? {
            let slot = chain.slots.last().expect("just extended");
            if let Some(record) = slot.find(key) {
                return Ok(Some(slot.value(record).to_vec()));
            }
            if !slot.overflowed() {
                break;
            }
        }
        Ok(None)
    }

    /// Sets `key` to `value`. Durable once a later [`Store::flush`] returns.
    pub fn put(&self, key: &[u8], value: &[u8]) -> Result<()> {
        check_record(key, value)?;
        let needed = record_bytes(key, value);
        let mut chain = self.chain(key);
        let mut target = None;
        let mut copies = Vec::new();
        // Walk the whole chain (to remove stale copies) and past its end if
        // no slot in it has room.
        while self.extend(&mut chain)? {
            let index = chain.slots.len() - 1;
            let slot = &chain.slots[index];
            let own = slot.find(key).map(|record| {
                copies.push(index);
                record_bytes(key, slot.value(record))
            });
            if target.is_none() && slot.free_bytes() + own.unwrap_or(0) >= needed {
                target = Some(index);
            }
            if !slot.overflowed() && target.is_some() {
                break;
            }
        }
        let Some(target) = target else {
            return Err(Error::Full {
                home: chain.home,
                probe_slots: u64::from(self.geometry.probe_slots),
            });
        };
        let home = chain.home;
        // 1. Flags on the slots passed on the way to the target, durable
        //    before the record: a record that survived a crash without its
        //    flags would be unreachable now but could surface, stale, once
        //    another key set them. Flags are never cleared, so this flush
        //    happens once per slot that overflows, not once per put.
        let mut flagged = false;
        for index in 0..target {
            if !chain.slots[index].overflowed() {
                chain.slots[index].set_overflowed();
                self.write_slot(home + index as u64, &mut chain.slots[index])?;
                flagged = true;
            }
        }
        if flagged {
            self.flush()?;
        }
        // 2. The record in its slot (replacing a copy there).
        let slot = &mut chain.slots[target];
        if let Some(record) = slot.find(key) {
            slot.remove(record);
        }
        assert!(slot.append(key, value), "the target slot has room");
        self.write_slot(home + target as u64, slot)?;
        if target != 0 {
            self.counters.overflow_puts.fetch_add(1, Ordering::Relaxed);
        }
        // 3. Other copies go only once the new record is durable.
        let stale: Vec<usize> = copies
            .into_iter()
            .filter(|&index| index != target)
            .collect();
        if !stale.is_empty() {
            self.counters.moves.fetch_add(1, Ordering::Relaxed);
            self.flush()?;
            for index in stale {
                let slot = &mut chain.slots[index];
                let record = slot.find(key).expect("found on the walk");
                slot.remove(record);
                self.write_slot(home + index as u64, slot)?;
            }
        }
        Ok(())
    }

    /// Removes `key`; true if it had a value. Durable once a later
    /// [`Store::flush`] returns.
    pub fn delete(&self, key: &[u8]) -> Result<bool> {
        if key.is_empty() || key.len() > crate::format::KEY_MAX_BYTES {
            return Ok(false);
        }
        let mut chain = self.chain(key);
        let mut existed = false;
        while self.extend(&mut chain)? {
            let index = chain.slots.len() - 1;
            let slot = &mut chain.slots[index];
            if let Some(record) = slot.find(key) {
                slot.remove(record);
                self.write_slot(chain.home + index as u64, slot)?;
                existed = true;
            }
            if !chain.slots[index].overflowed() {
                break;
            }
        }
        Ok(existed)
    }

    /// Makes every put and delete that returned before this call durable.
    pub fn flush(&self) -> Result<()> {
        self.device.flush()?;
        self.counters.flushes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Reads every slot and checks the invariants (module documentation).
    /// Takes no locks: run it on a quiet store.
    pub fn check(&self) -> Result<CheckReport> {
        let mut report = CheckReport::default();
        let total = self.geometry.total_slots();
        let mut overflowed = Vec::with_capacity(total as usize);
        let mut seen = std::collections::HashMap::<Vec<u8>, u32>::new();
        let mut placements = Vec::new();
        for slot_no in 0..total {
            let slot = self.read_slot(slot_no)?;
            overflowed.push(slot.overflowed());
            if slot.record_count() > 0 {
                report.slots_used += 1;
            }
            if slot.overflowed() {
                report.slots_overflowed += 1;
            }
            for (key, _) in slot.records() {
                report.records += 1;
                *seen.entry(key.to_vec()).or_default() += 1;
                placements.push((self.home_slot(key), slot_no));
            }
        }
        for (home, slot_no) in placements {
            if slot_no < home || slot_no >= home + u64::from(self.geometry.probe_slots) {
                report
                    .problems
                    .push(format!("a record with home {home} lies in slot {slot_no}"));
                continue;
            }
            if slot_no != home {
                report.records_displaced += 1;
            }
            if let Some(gap) = (home..slot_no).find(|&s| !overflowed[s as usize]) {
                report.problems.push(format!(
                    "a record with home {home} in slot {slot_no} is unreachable: slot {gap} lacks OVERFLOWED"
                ));
            }
        }
        report.duplicate_keys = seen.values().filter(|&&count| count > 1).count() as u64;
        Ok(report)
    }
}

#[cfg(test)]
mod tests;
