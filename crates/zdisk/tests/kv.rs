//! `kill -9` of `zdisk serve` under the table-less key-value store
//! (zdisk-kv), over NBD with the store's own client.
//!
//! Two writer threads put and delete 400-byte pairs in a store small
//! enough that slots overflow, flushing every few operations; each records
//! in a shared model what its returned flushes covered. Once enough is
//! flushed the server is killed with SIGKILL, restarted (it recovers), and
//! every key must read back as the value its last returned flush covered
//! or one written after it (never anything else, never lost), and the
//! store's invariant checker must find no problem. Three rounds on one
//! image, each continuing the store the last one left.
//!
//! Also: the YCSB driver's RocksDB engine (skipped when RocksDB's shared
//! library is absent; .ci/run installs rocksdb-tools, which brings it).

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Trial};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use support::*;
use zdisk_kv::{FormatConfig, NbdDevice, Store};

/// How long a round may take to flush its operations before the test
/// calls the server stuck (a liveness bound, not a speed floor).
const LIVENESS: Duration = Duration::from_secs(600);

fn main() {
    let args = Arguments::from_args();
    let trials = vec![
        Trial::test("kv_store_survives_kill_9_of_the_server", kill9),
        Trial::ignorable_test("rocksdb_engine_of_the_ycsb_driver_round_trips", || {
            if let Some(skipped) = skip_unless(zdisk_kv::rocks::available()) {
                return skipped;
            }
            rocksdb_round_trip().map(|()| Completion::Completed)
        }),
    ];
    libtest_mimic::run(&args, trials).exit();
}

/// What a key may read as after a crash.
#[derive(Default, Clone)]
struct Allowed {
    /// Its value when the last returned flush covered it.
    durable: Option<Vec<u8>>,
    /// Values given since (None: deleted).
    since: Vec<Option<Vec<u8>>>,
}

#[derive(Default)]
struct Model {
    keys: HashMap<Vec<u8>, Allowed>,
    flushed_ops: u64,
}

fn value_for(rng: &mut SmallRng) -> Vec<u8> {
    // Like the benchmark's values: half random, half a repeat.
    let mut half = vec![0u8; 192];
    rng.fill(&mut half[..]);
    let mut value = half.clone();
    value.extend_from_slice(&half);
    value
}

/// One writer: operations on its own keys (so the model needs no order
/// between threads), a flush every few, until the device fails.
fn write_until_killed(
    store: &Store<NbdDevice>,
    model: &Mutex<Model>,
    thread: u64,
    round: u64,
) -> String {
    let mut rng = SmallRng::seed_from_u64(round * 100 + thread);
    let mut pending: Vec<(Vec<u8>, Option<Vec<u8>>)> = Vec::new();
    loop {
        let key = format!("t{thread}-key-{:06}", rng.gen_range(0..1500)).into_bytes();
        let change = rng.gen_bool(0.9).then(|| value_for(&mut rng));
        // Recorded before it is sent: a write the server applied but did
        // not answer (killed in between) may survive.
        model
            .lock()
            .unwrap()
            .keys
            .entry(key.clone())
            .or_default()
            .since
            .push(change.clone());
        let result = match &change {
            Some(value) => store.put(&key, value),
            None => store.delete(&key).map(|_| ()),
        };
        if let Err(error) = result {
            return error.to_string();
        }
        pending.push((key, change));
        if pending.len() >= rng.gen_range(1..8) {
            if let Err(error) = store.flush() {
                return error.to_string();
            }
            let mut model = model.lock().unwrap();
            model.flushed_ops += pending.len() as u64;
            for (key, change) in pending.drain(..) {
                let entry = model.keys.get_mut(&key).expect("recorded");
                // Later changes to the key stay possible; this one and
                // everything before it are now the floor.
                let at = entry
                    .since
                    .iter()
                    .position(|c| *c == change)
                    .expect("recorded change");
                entry.since.drain(..=at);
                entry.durable = change;
            }
        }
    }
}

/// The comparison's RocksDB engine (its C API loaded at run time) stores
/// and finds what the driver gives it, and reports misses as misses.
fn rocksdb_round_trip() -> Result<(), Failed> {
    use zdisk_kv::rocks::{Compression, RocksDb};
    use zdisk_kv::ycsb::{fill_value, key_of, Engine, VALUE_BYTES};
    let dir = Scratch::new("kv-rocksdb");
    let path = dir.join("db");
    let db = RocksDb::open(path.to_str().unwrap(), Compression::Lz4, 1 << 20, false)?;
    let mut rng = SmallRng::seed_from_u64(3);
    let mut value = [0u8; VALUE_BYTES];
    for id in 0..2000 {
        fill_value(&mut rng, &mut value);
        db.write(&key_of(id), &value)?;
    }
    db.settle()?;
    for id in 0..2000 {
        ensure!(db.read(&key_of(id))?, "key {id} lost");
    }
    ensure!(!db.read(&key_of(5000))?, "a key never written was found");
    drop(db);
    let reopened = RocksDb::open(path.to_str().unwrap(), Compression::Lz4, 1 << 20, false)?;
    ensure!(reopened.read(&key_of(1999))?, "lost on reopen");
    Ok(())
}

fn kill9() -> Result<(), Failed> {
    let dir = Scratch::new("kv-kill9");
    let image = dir.join("kv.zdisk");
    let socket = dir.join("sock");
    let output = zdisk(&["create", image.to_str().unwrap(), "--logical", "64M"]);
    ensure!(
        output.status.success(),
        "zdisk create: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let model = Arc::new(Mutex::new(Model::default()));
    for round in 0..3u64 {
        let context = format!("round {round}");
        let mut server = Server::start(&image, &socket, &[])?;
        let device = NbdDevice::connect(&server.uri(), 2).map_err(|e| e.to_string())?;
        let store = if round == 0 {
            // Up to 3000 keys of 400 B in 350 slots of ~10: some fill up
            // and overflow to their neighbours.
            let config = FormatConfig {
                home_slots: 350,
                probe_slots: 32,
            };
            Store::format(device, config).map_err(|e| e.to_string())?
        } else {
            ensure!(
                server.log().contains("recovered after an unclean stop"),
                "{context}: no recovery reported:\n{}",
                server.log()
            );
            let store = Store::open(device).map_err(|e| format!("{context}: open: {e}"))?;
            let report = store.check().map_err(|e| e.to_string())?;
            ensure!(
                report.problems.is_empty(),
                "{context}: invariants broken: {:?}",
                report.problems
            );
            let mut model = model.lock().unwrap();
            let mut checked = 0;
            for (key, allowed) in model.keys.iter_mut() {
                let got = store.get(key).map_err(|e| e.to_string())?;
                ensure!(
                    got == allowed.durable || allowed.since.contains(&got),
                    "{context}: {} reads {} after kill -9",
                    String::from_utf8_lossy(key),
                    match &got {
                        Some(v) => format!("a {}-byte value it was never flushed with", v.len()),
                        None => "nothing".to_string(),
                    }
                );
                allowed.durable = got;
                allowed.since.clear();
                checked += 1;
            }
            println!(
                "{context}: {checked} keys as flushed; {} records, {} displaced, {} slots overflowed",
                report.records, report.records_displaced, report.slots_overflowed
            );
            store
        };
        let store = Arc::new(store);
        let start = model.lock().unwrap().flushed_ops;
        let writers: Vec<_> = (0..2u64)
            .map(|thread| {
                let store = store.clone();
                let model = model.clone();
                std::thread::spawn(move || write_until_killed(&store, &model, thread, round))
            })
            .collect();
        // Kill once 3000 operations are flushed, so recovery has something
        // to prove. The wait is for that event, not a speed floor: the
        // bound only stops a hung server from hanging the suite, and is
        // ten times what a loaded 2-core machine needs.
        let deadline = Instant::now() + LIVENESS;
        while model.lock().unwrap().flushed_ops < start + 3000 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let status = server.stop_with("KILL")?;
        ensure!(!status.success(), "{context}: the server survived SIGKILL");
        for writer in writers {
            let error = writer.join().map_err(|_| "a writer panicked")?;
            println!("{context}: a writer stopped on: {error}");
        }
        let flushed = model.lock().unwrap().flushed_ops - start;
        ensure!(
            flushed >= 3000,
            "{context}: only {flushed} operations flushed in {LIVENESS:?}: is the server stuck?"
        );
    }
    Ok(())
}
