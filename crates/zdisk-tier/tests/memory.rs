//! The tier against object_store's in-memory store (no server): a volume
//! larger than its cache goes through the bucket and comes back whole on a
//! new cache; a second writer is refused; a crashed writer's volume needs
//! --take-over and then serves what its newest root covers.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use object_store::ObjectStore;
use zdisk_core::{BlockDevice, Codec, CreateOptions, OpenOptions, Volume};
use zdisk_tier::{TierConfig, TierError, TierLayout};

const MIB: u64 = 1 << 20;

struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let path = std::env::temp_dir().join(format!("zdisk-tier-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        Scratch(path)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn config() -> TierConfig {
    TierConfig {
        publish_interval: Duration::from_millis(0),
        fetch_cache_bytes: 4 * MIB,
        retry_timeout: Duration::from_secs(5),
        ..TierConfig::default()
    }
}

fn options() -> OpenOptions {
    OpenOptions {
        background: false,
        ..OpenOptions::default()
    }
}

/// Half-compressible data: a block of `seed`-dependent text-like bytes.
fn block(index: u64, round: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(4096);
    let mut state = (index + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ round;
    while out.len() < 4096 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let word = state % 64;
        out.extend_from_slice(format!("w{word} ").as_bytes());
    }
    out.truncate(4096);
    out
}

fn create(dir: &Scratch, url: &str, cache_bytes: u64) -> Arc<Volume> {
    let layout = TierLayout {
        url: url.to_string(),
        log_bytes: 96 * MIB,
        segment_size_bytes: 256 << 10,
        cache_bytes,
        create_bucket: false,
    };
    let mut create = CreateOptions::new(64 * MIB);
    create.codec = Codec::Lz4;
    zdisk_tier::create(&dir.0.join("a.img"), &layout, create, config(), options()).unwrap()
}

/// A new cache `name` in `dir` for the volume at `url`.
fn restore(
    dir: &Scratch,
    name: &str,
    url: &str,
    cache_bytes: u64,
    take_over: bool,
    options: OpenOptions,
) -> Result<Arc<Volume>, String> {
    zdisk_tier::restore(
        &dir.0.join(name),
        url,
        cache_bytes,
        take_over,
        config(),
        options,
    )
    .map_err(|e| e.to_string())
}

/// A writer that publishes a root at open and none for an hour, and
/// renews its sequence reservation often.
fn quiet_writer() -> (TierConfig, OpenOptions) {
    let quiet = TierConfig {
        publish_interval: Duration::from_secs(3600),
        ..config()
    };
    let options = OpenOptions {
        seq_reserve_ahead: 8,
        ..options()
    };
    (quiet, options)
}

fn stat(volume: &Volume, name: &str) -> u64 {
    *volume
        .stats()
        .media
        .get(name)
        .unwrap_or_else(|| panic!("no {name}"))
}

fn write_all(volume: &Volume, blocks: u64, round: u64) {
    for index in 0..blocks {
        volume
            .write(index * 4096, &block(index, round), false)
            .unwrap();
    }
    volume.flush().unwrap();
}

fn check_all(volume: &Volume, blocks: u64, round: u64) {
    let mut buf = vec![0u8; 4096];
    for index in 0..blocks {
        volume.read(index * 4096, &mut buf).unwrap();
        assert!(buf == block(index, round), "block {index} differs");
    }
}

#[test]
fn a_volume_larger_than_its_cache_comes_back_whole_on_a_new_cache() {
    let dir = Scratch::new("round-trip");
    let url = "memory://round-trip/vol";
    let volume = create(&dir, url, 2 * MIB);
    write_all(&volume, 8192, 1); // 32 MiB of data through a 2 MiB cache
    check_all(&volume, 8192, 1);
    assert!(
        stat(&volume, "tier_evicted_bytes") > 0,
        "nothing was evicted"
    );
    assert!(
        stat(&volume, "tier_cache_misses") > 0,
        "nothing was read back from the bucket"
    );
    volume.close().unwrap();
    assert_eq!(
        stat(&volume, "tier_lag_bytes"),
        0,
        "a clean close leaves nothing behind"
    );
    assert!(stat(&volume, "tier_resident_bytes") <= 3 * MIB);
    drop(volume);

    // The local image is gone; a new cache serves the same bytes.
    std::fs::remove_file(dir.0.join("a.img")).unwrap();
    std::fs::remove_file(dir.0.join("a.img.tier")).unwrap();
    let restored = restore(&dir, "b.img", url, 4 * MIB, false, options()).unwrap();
    check_all(&restored, 8192, 1);
    assert!(stat(&restored, "tier_fetched_bytes") > 0);
    // It writes, and a later cache sees that too.
    write_all(&restored, 1024, 2);
    restored.close().unwrap();
    drop(restored);
    let again = restore(&dir, "c.img", url, 4 * MIB, false, options()).unwrap();
    check_all(&again, 1024, 2);
    let mut buf = vec![0u8; 4096];
    again.read(5000 * 4096, &mut buf).unwrap();
    assert!(buf == block(5000, 1));
    again.close().unwrap();
}

#[test]
fn a_second_writer_is_refused() {
    let dir = Scratch::new("two-writers");
    let url = "memory://two-writers/vol";
    let first = create(&dir, url, 8 * MIB);
    write_all(&first, 256, 1);
    first.close().unwrap();
    drop(first);
    // Another machine attaches to the volume and writes.
    let second = restore(&dir, "b.img", url, 8 * MIB, false, options()).unwrap();
    write_all(&second, 16, 2);
    second.close().unwrap();
    drop(second);
    // The first image may no longer write it.
    let error = zdisk_tier::open(&dir.0.join("a.img"), config(), options())
        .err()
        .expect("the first writer must be refused");
    assert!(matches!(error, TierError::OtherWriter(_)), "{error:?}");
    assert!(error.to_string().contains("another writer"), "{error}");
    // Reading it is fine.
    let reader = zdisk_tier::open(
        &dir.0.join("a.img"),
        config(),
        OpenOptions {
            read_only: true,
            ..options()
        },
    )
    .unwrap();
    check_all(&reader, 256, 1);
}

#[test]
fn a_crashed_writers_volume_needs_take_over_and_serves_its_newest_root() {
    let dir = Scratch::new("crash");
    let url = "memory://crash/vol";
    let volume = create(&dir, url, 4 * MIB);
    write_all(&volume, 2048, 1);
    volume.close().unwrap();
    drop(volume);
    let volume = zdisk_tier::open(&dir.0.join("a.img"), config(), options()).unwrap();
    write_all(&volume, 2048, 2);
    // A checkpoint makes a root the uploader publishes; then the machine dies.
    volume.checkpoint().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while stat(&volume, "tier_roots_published") < 2 || stat(&volume, "tier_lag_bytes") > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the root was not published"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    volume.halt();
    drop(volume);
    std::fs::remove_file(dir.0.join("a.img")).unwrap();

    let error = restore(&dir, "b.img", url, 4 * MIB, false, options())
        .err()
        .expect("a dirty root needs --take-over");
    assert!(error.contains("--take-over"), "{error}");
    assert!(
        !dir.0.join("b.img").exists(),
        "a refused restore leaves nothing"
    );
    let restored = restore(&dir, "b.img", url, 4 * MIB, true, options()).unwrap();
    check_all(&restored, 2048, 2);
    restored.close().unwrap();
}

#[test]
fn a_new_cache_from_an_older_root_writes_past_a_crashed_writers_later_uploads() {
    let dir = Scratch::new("numbering");
    let url = "memory://numbering/vol";
    let volume = create(&dir, url, 2 * MIB);
    write_all(&volume, 1024, 1);
    volume.close().unwrap();
    drop(volume);
    // The writer publishes one root object at open and none after, while
    // it seals and uploads segments numbered past that root's reservation
    // (renewed often), then dies.
    let (quiet, options) = quiet_writer();
    let volume = zdisk_tier::open(&dir.0.join("a.img"), quiet, options.clone()).unwrap();
    write_all(&volume, 8192, 2);
    volume.halt();
    drop(volume);
    // A new cache from that root numbers its segments from there too; it
    // must read and write its own objects, never the dead writer's.
    let restored = restore(&dir, "b.img", url, 2 * MIB, true, options.clone()).unwrap();
    let mut buf = vec![0u8; 4096];
    for index in 0..1024 {
        restored.read(index * 4096, &mut buf).unwrap();
        assert!(
            buf == block(index, 1) || buf == block(index, 2),
            "block {index} holds neither write"
        );
    }
    write_all(&restored, 8192, 3);
    check_all(&restored, 8192, 3);
    restored.close().unwrap();
    drop(restored);
    let again = restore(&dir, "c.img", url, 2 * MIB, false, options).unwrap();
    check_all(&again, 8192, 3);
    again.close().unwrap();
}

/// Incompressible: the bytes of write `round` to block `index`.
fn noise(index: u64, round: u64) -> Vec<u8> {
    let mut state = (index + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ round.rotate_left(17);
    let mut out = Vec::with_capacity(4096);
    while out.len() < 4096 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(&state.to_le_bytes());
    }
    out
}

fn overwrite(volume: &Volume, blocks: u64, round: u64) {
    for index in 0..blocks {
        volume
            .write(index * 4096, &noise(index, round), false)
            .unwrap();
    }
    volume.flush().unwrap();
}

fn check_noise(volume: &Volume, blocks: u64, round: u64, who: &str) {
    let mut buf = vec![0u8; 4096];
    for index in 0..blocks {
        volume
            .read(index * 4096, &mut buf)
            .unwrap_or_else(|e| panic!("{who}: block {index}: {e}"));
        assert!(
            buf == noise(index, round),
            "{who}: block {index} does not hold round {round}"
        );
    }
}

/// The same hazard as above, made certain: in a small log both writers
/// reuse segments many times, and with the new cache's allocations
/// shifted by a few extra segments (found by trying shifts; 320 and 384
/// extra blocks gave about 30 collisions, 128 a few), its incarnations meet the
/// dead writer's uploads at the same segment and sequence number. Before
/// 8e00897 (objects without their writer) the new cache took such an
/// object for its own upload and served the dead writer's bytes. The test
/// checks that collisions happened with one shift at least (the dead
/// writer's crash point varies with timing), so it cannot go vacuous.
#[test]
fn a_new_cache_never_takes_a_dead_writers_object_of_the_same_segment_and_number() {
    let mut shared = Vec::new();
    for extra_blocks in [128, 320, 384] {
        let name = format!("same-numbers-{extra_blocks}");
        let store = zdisk_tier::faults::FaultStore::new(0);
        zdisk_tier::install_memory_store(&name, store.clone());
        same_numbers(&name, extra_blocks);
        // Every upload, including objects the collection deleted since.
        let mut writers: HashMap<(u32, u32), HashSet<u64>> = HashMap::new();
        for landed in store.landed() {
            let name = landed.key.strip_prefix("vol/").unwrap();
            if let Some((segment, seq32, writer)) = zdisk_tier::objects::parse_segment_name(name) {
                writers.entry((segment, seq32)).or_default().insert(writer);
            }
        }
        shared.push(writers.values().filter(|w| w.len() > 1).count());
    }
    assert!(
        shared.iter().any(|&n| n > 0),
        "no incarnation was written by two writers with any shift: {shared:?}"
    );
}

/// The scenario above under `memory://NAME/vol`.
fn same_numbers(name: &str, extra_blocks: u64) {
    let dir = Scratch::new(name);
    let url = format!("memory://{name}/vol");
    let layout = TierLayout {
        url: url.clone(),
        log_bytes: 16 * MIB,
        segment_size_bytes: 256 << 10,
        cache_bytes: MIB,
        create_bucket: false,
    };
    let blocks = 512; // 2 MiB, rewritten whole each round
    let mut create = CreateOptions::new(8 * MIB);
    create.codec = Codec::Lz4;
    let volume =
        zdisk_tier::create(&dir.0.join("a.img"), &layout, create, config(), options()).unwrap();
    overwrite(&volume, blocks, 1);
    volume.close().unwrap();
    drop(volume);
    let (quiet, options) = quiet_writer();
    // The first writer publishes a root at open, then cycles the log many
    // times, uploading every sealed segment, and dies.
    let volume = zdisk_tier::open(&dir.0.join("a.img"), quiet, options.clone()).unwrap();
    for round in 2..=24 {
        overwrite(&volume, blocks, round);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while stat(&volume, "tier_uploaded_bytes") < 32 * MIB {
        assert!(std::time::Instant::now() < deadline, "uploads stalled");
        std::thread::sleep(Duration::from_millis(10));
    }
    volume.halt();
    drop(volume);
    // A new cache from the root published at open does much the same.
    let restored = zdisk_tier::restore(
        &dir.0.join("b.img"),
        &url,
        MIB,
        true,
        config(),
        options.clone(),
    )
    .unwrap();
    // That root may cover some of the dead writer's first rounds.
    let mut buf = vec![0u8; 4096];
    for index in 0..blocks {
        restored.read(index * 4096, &mut buf).unwrap();
        assert!(
            (1..=24).any(|round| buf == noise(index, round)),
            "block {index} holds no write of the first writer"
        );
    }
    for index in 0..extra_blocks {
        restored
            .write((1024 + index) * 4096, &noise(index, 0), false)
            .unwrap();
    }
    for round in 102..=124 {
        overwrite(&restored, blocks, round);
        check_noise(&restored, blocks, round, "the new writer");
    }
    restored.close().unwrap();
    drop(restored);
    let again =
        zdisk_tier::restore(&dir.0.join("c.img"), &url, MIB, false, config(), options).unwrap();
    check_noise(&again, blocks, 124, "a restore of the new writer's volume");
    again.close().unwrap();
}

/// The segment objects and root numbers the store `name` holds under `vol/`.
fn bucket(name: &str) -> (Vec<(String, u64)>, Vec<u64>) {
    use futures::TryStreamExt;
    let store = zdisk_tier::memory_store(name);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let prefix = object_store::path::Path::from("vol");
    let listed: Vec<_> = runtime
        .block_on(store.list(Some(&prefix)).try_collect())
        .unwrap();
    let mut segments = Vec::new();
    let mut roots = Vec::new();
    for object in listed {
        let name = object.location.as_ref().strip_prefix("vol/").unwrap();
        if zdisk_tier::objects::parse_segment_name(name).is_some() {
            segments.push((name.to_string(), object.size));
        } else if let Some(number) = zdisk_tier::objects::parse_root_name(name) {
            roots.push(number);
        }
    }
    roots.sort_unstable();
    (segments, roots)
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what} did not happen in 90 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn with_tier_sync_a_flush_returns_only_once_the_bucket_covers_it() {
    for sync in [false, true] {
        let dir = Scratch::new(&format!("sync-{sync}"));
        let url = format!("memory://sync-{sync}/vol");
        let volume = create(&dir, &url, 8 * MIB);
        volume.close().unwrap();
        drop(volume);
        // Publication every hour: only --tier-sync makes the flush reach the bucket.
        let slow = TierConfig {
            publish_interval: Duration::from_secs(3600),
            sync,
            ..config()
        };
        let volume = zdisk_tier::open(&dir.0.join("a.img"), slow, options()).unwrap();
        write_all(&volume, 512, 1); // ends with a flush
        volume.halt();
        drop(volume);
        let restored = restore(&dir, "b.img", &url, 8 * MIB, true, options()).unwrap();
        let mut buf = vec![0u8; 4096];
        let mut found = 0;
        for index in 0..512 {
            restored.read(index * 4096, &mut buf).unwrap();
            if buf == block(index, 1) {
                found += 1;
            } else {
                assert!(
                    buf.iter().all(|&b| b == 0),
                    "block {index} holds a torn write"
                );
            }
        }
        if sync {
            assert_eq!(
                found, 512,
                "a flush with --tier-sync left blocks out of the bucket"
            );
        } else {
            assert_eq!(
                found, 0,
                "without --tier-sync the bucket was expected to lag an hour"
            );
        }
        restored.close().unwrap();
    }
}

#[test]
fn the_bucket_gives_space_back_and_never_names_a_missing_object() {
    let dir = Scratch::new("collect");
    let url = "memory://collect/vol";
    let volume = create(&dir, url, 4 * MIB);
    volume.close().unwrap();
    drop(volume);
    // What an interrupted collection, or a crashed upload, leaves behind:
    // an object no root names.
    let store = zdisk_tier::memory_store("collect");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let orphan = zdisk_tier::objects::segment_key("vol/", (7, 0xdead, 0xbeef));
    runtime
        .block_on(store.put(
            &object_store::path::Path::from(orphan.as_str()),
            vec![1u8; 4096].into(),
        ))
        .unwrap();
    let eager = TierConfig {
        keep_roots_for: Duration::ZERO,
        ..config()
    };
    // With the background thread: idle compaction rewrites mostly dead
    // segments, fetching the evicted ones from the bucket.
    let background = OpenOptions {
        background: true,
        ..options()
    };
    let volume = zdisk_tier::open(&dir.0.join("a.img"), eager, background).unwrap();
    // 3 × 32 MiB of writes into a 96 MiB log: most segments end mostly dead.
    for round in 1..=3 {
        write_all(&volume, 8192, round);
    }
    volume.checkpoint().unwrap();
    wait_until("a collection", || {
        stat(&volume, "tier_deleted_bytes") > 0 && stat(&volume, "tier_roots_deleted") > 0
    });
    let stored = volume.stats().stored_bytes;
    wait_until("the bucket shrinking to about the live data", || {
        let (segments, roots) = bucket("collect");
        let bytes: u64 = segments.iter().map(|s| s.1).sum();
        roots.len() == 1 && bytes < 2 * stored + 8 * MIB
    });
    let (segments, _) = bucket("collect");
    assert!(
        !segments
            .iter()
            .any(|(name, _)| orphan.ends_with(name.as_str())),
        "the orphan object was not deleted"
    );
    check_all(&volume, 8192, 3);
    volume.close().unwrap();
    drop(volume);
    // Every object the newest root names is there: a new cache serves it all.
    let (_, roots) = bucket("collect");
    assert_eq!(roots.len(), 1, "old roots were kept: {roots:?}");
    let restored = restore(&dir, "b.img", url, 4 * MIB, false, options()).unwrap();
    check_all(&restored, 8192, 3);
    restored.close().unwrap();
}

#[test]
fn segments_read_again_are_written_back_into_the_cache() {
    let dir = Scratch::new("write-back");
    let url = "memory://write-back/vol";
    let volume = create(&dir, url, 4 * MIB);
    write_all(&volume, 4096, 1); // 16 MiB through a 4 MiB cache
    volume.close().unwrap();
    drop(volume);
    std::fs::remove_file(dir.0.join("a.img")).unwrap();
    // A new cache: every segment is another writer's object.
    let restored = restore(&dir, "b.img", url, 12 * MIB, false, options()).unwrap();
    // Two passes over the first 2 MiB: the second miss on a segment writes it back.
    check_all(&restored, 512, 1);
    check_all(&restored, 512, 1);
    wait_until("a write-back", || {
        stat(&restored, "tier_written_back_bytes") > 0
    });
    let fetched = stat(&restored, "tier_fetched_bytes");
    check_all(&restored, 512, 1);
    restored.close().unwrap();
    drop(restored);
    // After a restart the written-back segments are read locally, under
    // their writer's object names, and nothing is uploaded again.
    let again = zdisk_tier::open(&dir.0.join("b.img"), config(), options()).unwrap();
    check_all(&again, 512, 1);
    assert_eq!(
        stat(&again, "tier_fetched_bytes"),
        0,
        "written-back segments were fetched again"
    );
    check_all(&again, 4096, 1);
    again.close().unwrap();
    assert!(fetched > 0);
}

#[test]
fn readers_attach_to_a_running_writers_volume_without_taking_it() {
    let dir = Scratch::new("reader");
    let url = "memory://reader/vol";
    let writer = create(&dir, url, 4 * MIB);
    write_all(&writer, 2048, 1);
    writer.checkpoint().unwrap();
    wait_until("a published root", || stat(&writer, "tier_lag_bytes") == 0);
    let read_only = OpenOptions {
        read_only: true,
        ..options()
    };
    // The newest root is not a clean stop's, and no --take-over is needed.
    let reader = restore(&dir, "r.img", url, 4 * MIB, false, read_only.clone()).unwrap();
    check_all(&reader, 2048, 1);
    assert!(
        reader.write(0, &block(0, 9), false).is_err(),
        "a reader wrote"
    );
    reader.close().unwrap();
    drop(reader);
    let error = zdisk_tier::open(&dir.0.join("r.img"), config(), options())
        .err()
        .expect("a reader's image must not open to write");
    assert!(matches!(error, TierError::ReaderOnly(_)), "{error:?}");
    assert!(error.to_string().contains("--read-only"), "{error}");
    let reader = zdisk_tier::open(&dir.0.join("r.img"), config(), read_only).unwrap();
    check_all(&reader, 2048, 1);
    drop(reader);
    // The writer keeps the volume.
    write_all(&writer, 2048, 2);
    writer.close().unwrap();
    drop(writer);
    let again = restore(&dir, "c.img", url, 4 * MIB, false, options()).unwrap();
    check_all(&again, 2048, 2);
    again.close().unwrap();
}
