//! An optional cache of slots in RAM, so the store can be given the same
//! memory for caching as RocksDB's block cache in a comparison.
//!
//! Write-through and per slot: the store fills it on every slot read and
//! write while it holds that slot's lock, so an entry always equals the
//! slot on the device (what a read would return). Eviction is CLOCK per
//! shard. A cache of 0 bytes holds nothing.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::format::SLOT_BYTES;

const SHARDS: usize = 64;

struct Entry {
    slot: u64,
    bytes: Box<[u8; SLOT_BYTES]>,
    referenced: bool,
}

#[derive(Default)]
struct Shard {
    index: HashMap<u64, usize>,
    entries: Vec<Entry>,
    hand: usize,
}

/// See the module documentation.
pub struct SlotCache {
    shards: Vec<Mutex<Shard>>,
    slots_per_shard: usize,
}

impl SlotCache {
    pub fn new(capacity_bytes: u64) -> SlotCache {
        let slots = (capacity_bytes / SLOT_BYTES as u64) as usize;
        SlotCache {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            slots_per_shard: slots / SHARDS,
        }
    }

    fn shard(&self, slot: u64) -> std::sync::MutexGuard<'_, Shard> {
        self.shards[(slot % SHARDS as u64) as usize]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A copy of the slot's bytes, if cached.
    pub fn get(&self, slot: u64) -> Option<Box<[u8; SLOT_BYTES]>> {
        if self.slots_per_shard == 0 {
            return None;
        }
        let mut shard = self.shard(slot);
        let at = *shard.index.get(&slot)?;
        let entry = &mut shard.entries[at];
        entry.referenced = true;
        Some(entry.bytes.clone())
    }

    /// Records the slot's current bytes.
    pub fn put(&self, slot: u64, bytes: &[u8; SLOT_BYTES]) {
        if self.slots_per_shard == 0 {
            return;
        }
        let capacity = self.slots_per_shard;
        let mut shard = self.shard(slot);
        if let Some(&at) = shard.index.get(&slot) {
            shard.entries[at].bytes.copy_from_slice(bytes);
            return;
        }
        if shard.entries.len() < capacity {
            let at = shard.entries.len();
            shard.entries.push(Entry {
                slot,
                bytes: Box::new(*bytes),
                referenced: false,
            });
            shard.index.insert(slot, at);
            return;
        }
        loop {
            let hand = shard.hand;
            shard.hand = (hand + 1) % capacity;
            let entry = &mut shard.entries[hand];
            if entry.referenced {
                entry.referenced = false;
                continue;
            }
            let old = entry.slot;
            entry.slot = slot;
            entry.bytes.copy_from_slice(bytes);
            shard.index.remove(&old);
            shard.index.insert(slot, hand);
            return;
        }
    }

    /// Slots held now.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|shard| {
                shard
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entries
                    .len()
            })
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_at_most_its_capacity_and_the_latest_bytes() {
        let cache = SlotCache::new((SHARDS * 2 * SLOT_BYTES) as u64);
        for slot in 0..1000u64 {
            let mut bytes = [0u8; SLOT_BYTES];
            bytes[0] = slot as u8;
            cache.put(slot, &bytes);
        }
        assert_eq!(cache.len(), SHARDS * 2);
        let mut newer = [0u8; SLOT_BYTES];
        newer[0] = 0xAA;
        cache.put(999, &newer);
        assert_eq!(cache.get(999).expect("recently put")[0], 0xAA);
        assert_eq!(cache.len(), SHARDS * 2);
    }

    #[test]
    fn zero_capacity_holds_nothing() {
        let cache = SlotCache::new(0);
        cache.put(1, &[1u8; SLOT_BYTES]);
        assert!(cache.get(1).is_none());
        assert!(cache.is_empty());
    }
}
