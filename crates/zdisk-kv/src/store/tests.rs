//! The store against a reference model (a HashMap) on a RAM device, its
//! overflow paths (probing, full, moves), and seeded power cuts that keep a
//! random subset of the unflushed slot writes. A failing seed is printed.

use std::collections::HashMap;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::device::MemDevice;

fn store(home_slots: u64, probe_slots: u32) -> Store<MemDevice> {
    let geometry_bytes = (2 + home_slots + u64::from(probe_slots)) as usize * SLOT_BYTES;
    Store::format(
        MemDevice::new(geometry_bytes),
        FormatConfig {
            home_slots,
            probe_slots,
        },
    )
    .expect("format")
}

fn assert_clean(store: &Store<MemDevice>) -> CheckReport {
    let report = store.check().expect("check reads every slot");
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(report.duplicate_keys, 0);
    report
}

#[test]
fn put_get_delete_overwrite() {
    let store = store(16, 4);
    assert_eq!(store.get(b"missing").unwrap(), None);
    store.put(b"a", b"1").unwrap();
    store.put(b"b", b"2").unwrap();
    store.put(b"a", b"one").unwrap();
    assert_eq!(store.get(b"a").unwrap().as_deref(), Some(&b"one"[..]));
    assert_eq!(store.get(b"b").unwrap().as_deref(), Some(&b"2"[..]));
    assert!(store.delete(b"a").unwrap());
    assert!(!store.delete(b"a").unwrap());
    assert_eq!(store.get(b"a").unwrap(), None);
    assert_eq!(assert_clean(&store).records, 1);
}

#[test]
fn reopen_finds_what_was_put() {
    let device = MemDevice::new(64 * SLOT_BYTES);
    let config = FormatConfig {
        home_slots: 32,
        probe_slots: 8,
    };
    let store = Store::format(device, config).unwrap();
    store.put(b"kept", b"value").unwrap();
    store.flush().unwrap();
    let device = store.device;
    let reopened = Store::open(device).unwrap();
    assert_eq!(reopened.geometry().home_slots, 32);
    assert_eq!(
        reopened.get(b"kept").unwrap().as_deref(),
        Some(&b"value"[..])
    );
}

#[test]
fn bad_input_is_refused_without_change() {
    let store = store(4, 4);
    store.put(b"k", b"v").unwrap();
    assert!(matches!(store.put(b"", b"v"), Err(Error::TooBig { .. })));
    assert!(matches!(
        store.put(&[1u8; 256], b"v"),
        Err(Error::TooBig { .. })
    ));
    assert!(matches!(
        store.put(b"k", &vec![0u8; SLOT_BYTES]),
        Err(Error::TooBig { .. })
    ));
    assert_eq!(store.get(b"").unwrap(), None);
    assert_eq!(store.get(b"k").unwrap().as_deref(), Some(&b"v"[..]));
    assert!(matches!(
        Store::open(MemDevice::new(8 * SLOT_BYTES)),
        Err(Error::NotAStore)
    ));
    let small = MemDevice::new(4 * SLOT_BYTES);
    let config = FormatConfig {
        home_slots: 10,
        probe_slots: 4,
    };
    assert!(matches!(
        Store::format(small, config),
        Err(Error::DeviceTooSmall { .. })
    ));
}

#[test]
fn full_slots_overflow_to_their_neighbours() {
    // 2 home slots of ~10 records of 400 B: 60 records must probe.
    let store = store(2, 16);
    let value = [9u8; 384];
    for i in 0..60u32 {
        store.put(format!("key-{i:08}").as_bytes(), &value).unwrap();
    }
    for i in 0..60u32 {
        let got = store.get(format!("key-{i:08}").as_bytes()).unwrap();
        assert_eq!(got.as_deref(), Some(&value[..]), "key {i}");
    }
    let report = assert_clean(&store);
    assert_eq!(report.records, 60);
    assert!(report.records_displaced >= 40, "{report:?}");
    assert!(report.slots_overflowed >= 2, "{report:?}");
    assert!(store.stats().overflow_puts >= 40);
    // Deleting a displaced key and a home key keeps the rest reachable.
    assert!(store.delete(b"key-00000059").unwrap());
    assert!(store.delete(b"key-00000000").unwrap());
    assert_eq!(assert_clean(&store).records, 58);
    assert_eq!(
        store.get(b"key-00000030").unwrap().as_deref(),
        Some(&value[..])
    );
}

#[test]
fn a_full_probe_sequence_is_an_error_that_changes_nothing() {
    let store = store(1, 2);
    let value = [3u8; 1000];
    let mut stored = 0;
    let error = loop {
        match store.put(format!("k{stored}").as_bytes(), &value) {
            Ok(()) => stored += 1,
            Err(error) => break error,
        }
    };
    assert!(
        matches!(
            error,
            Error::Full {
                home: 0,
                probe_slots: 2
            }
        ),
        "{error}"
    );
    assert_eq!(stored, 8, "two slots of four 1 KB records");
    let writes = store.stats().slot_writes;
    assert!(store.put(b"another", &value).is_err());
    assert_eq!(store.stats().slot_writes, writes, "a refused put wrote");
    for i in 0..stored {
        assert!(store.get(format!("k{i}").as_bytes()).unwrap().is_some());
    }
    assert_eq!(assert_clean(&store).records, 8);
}

#[test]
fn a_value_that_outgrows_its_slot_moves() {
    let store = store(1, 4);
    store.put(b"a", &[1u8; 2000]).unwrap();
    store.put(b"b", &[2u8; 2000]).unwrap();
    store.put(b"a", &[3u8; 3000]).unwrap();
    assert_eq!(store.stats().moves, 1);
    assert_eq!(store.get(b"a").unwrap().as_deref(), Some(&[3u8; 3000][..]));
    assert_eq!(store.get(b"b").unwrap().as_deref(), Some(&[2u8; 2000][..]));
    assert_eq!(assert_clean(&store).records, 2);
    // Shrunk, it moves back to the first slot with room: its home.
    store.put(b"a", &[4u8; 10]).unwrap();
    assert_eq!(store.stats().moves, 2);
    let report = assert_clean(&store);
    assert_eq!(report.records, 2);
    assert_eq!(report.records_displaced, 0);
    assert_eq!(store.get(b"a").unwrap().as_deref(), Some(&[4u8; 10][..]));
}

fn random_value(rng: &mut SmallRng) -> Vec<u8> {
    let len = if rng.gen_bool(0.2) {
        rng.gen_range(500..1800)
    } else {
        rng.gen_range(0..400)
    };
    let byte: u8 = rng.gen();
    vec![byte; len]
}

#[test]
fn random_operations_match_a_model() {
    for seed in 0..20u64 {
        let mut rng = SmallRng::seed_from_u64(seed);
        // Half the seeds with a slot cache smaller than the store.
        let store = if seed % 2 == 0 {
            store(8, 16)
        } else {
            store(8, 16).with_cache(64 * 4 * SLOT_BYTES as u64)
        };
        let mut model: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
        for _ in 0..2000 {
            let key = format!("k{}", rng.gen_range(0..120)).into_bytes();
            match rng.gen_range(0..10) {
                0..=4 => {
                    let value = random_value(&mut rng);
                    match store.put(&key, &value) {
                        Ok(()) => {
                            model.insert(key, value);
                        }
                        Err(Error::Full { .. }) => {}
                        Err(error) => panic!("seed {seed}: {error}"),
                    }
                }
                5..=6 => {
                    let existed = store.delete(&key).unwrap();
                    assert_eq!(existed, model.remove(&key).is_some(), "seed {seed}");
                }
                _ => {
                    assert_eq!(
                        store.get(&key).unwrap(),
                        model.get(&key).cloned(),
                        "seed {seed}"
                    );
                }
            }
        }
        let report = assert_clean(&store);
        assert_eq!(report.records, model.len() as u64, "seed {seed}");
    }
}

/// What a key may read as after a crash: its value at the last flush, or
/// any value it was given since.
#[derive(Default, Clone)]
struct Allowed {
    durable: Option<Vec<u8>>,
    since: Vec<Option<Vec<u8>>>,
}

#[test]
fn flushed_puts_survive_power_cuts() {
    for seed in 0..200u64 {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut store = store(6, 16);
        let mut allowed: HashMap<Vec<u8>, Allowed> = HashMap::new();
        for round in 0..4 {
            for _ in 0..rng.gen_range(20..200) {
                let key = format!("k{}", rng.gen_range(0..80)).into_bytes();
                if rng.gen_bool(0.8) {
                    let value = random_value(&mut rng);
                    if store.put(&key, &value).is_ok() {
                        allowed.entry(key).or_default().since.push(Some(value));
                    }
                } else if store.delete(&key).unwrap() {
                    allowed.entry(key).or_default().since.push(None);
                }
                if rng.gen_bool(0.05) {
                    store.flush().unwrap();
                    for entry in allowed.values_mut() {
                        if let Some(last) = entry.since.pop() {
                            entry.durable = last;
                        }
                        entry.since.clear();
                    }
                }
            }
            let device = store.device;
            let pending = device.pending_writes();
            let keep_share: f64 = rng.gen();
            device.crash(|_| rng.gen_bool(keep_share));
            store = Store::open(device).unwrap();
            let report = store.check().unwrap();
            assert!(
                report.problems.is_empty(),
                "seed {seed} round {round}: {:?}",
                report.problems
            );
            for (key, entry) in allowed.iter_mut() {
                let got = store.get(key).unwrap();
                let ok = got == entry.durable || entry.since.contains(&got);
                assert!(
                    ok,
                    "seed {seed} round {round}: key {} reads {:?} bytes after a crash with {pending} writes pending",
                    String::from_utf8_lossy(key),
                    got.as_ref().map(|v| v.len())
                );
                entry.durable = got;
                entry.since.clear();
            }
        }
    }
}

/// The write-through cache must hold what the device holds, always.
#[test]
fn the_cache_always_equals_the_device() {
    let mut rng = SmallRng::seed_from_u64(1);
    let store = store(8, 16).with_cache(64 * 4 * SLOT_BYTES as u64);
    for step in 0..2000 {
        let key = format!("k{}", rng.gen_range(0..120)).into_bytes();
        match rng.gen_range(0..10) {
            0..=4 => {
                let value = random_value(&mut rng);
                if let Err(error) = store.put(&key, &value) {
                    panic!("step {step}: put failed: {error}");
                }
            }
            5..=6 => {
                store.delete(&key).unwrap();
            }
            _ => {
                store.get(&key).unwrap();
            }
        }
        for slot in 0..store.geometry.total_slots() {
            if let Some(cached) = store.cache.get(slot) {
                let mut bytes = [0u8; SLOT_BYTES];
                store
                    .device
                    .read_at(&mut bytes, store.geometry.slot_offset(slot))
                    .unwrap();
                assert!(
                    bytes[..] == cached[..],
                    "step {step} slot {slot}: device {:?} cache {:?}",
                    &bytes[..16],
                    &cached[..16]
                );
            }
        }
    }
}
