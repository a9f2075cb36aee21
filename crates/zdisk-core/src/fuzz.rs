//! Entry points for fuzzers (the targets in `fuzz/`):
//!
//! - [`fuzz_decoders`]: everything the engine decodes from the medium —
//!   record headers, whole segments, metadata roots, staging slots and
//!   checkpoint chunks.
//!   For any input they must return without panicking and without
//!   allocating more than the input's size justifies.
//! - [`fuzz_engine`]: sequences of engine operations with power cuts,
//!   through the crash simulator, checked against its reference model.

use crate::dump::decode_chunk_payload;
use crate::map::Map;
use crate::meta::Root;
use crate::record::{decode_record, RecordKey};
use crate::volume::scan::scan_segment;
use crate::volume::staging::{Staged, STAGED_HEADER_BYTES};

/// The key fuzzed records are checked with.
const KEY: RecordKey = RecordKey([0x5A; 16]);

/// Runs the operations `bytes` choose against a volume on a simulated
/// medium that loses and tears writes at power cuts (see `sim::run_input`);
/// panics if a block reads back anything a client could not have written,
/// or the invariant checker finds anything wrong.
pub fn fuzz_engine(bytes: &[u8]) {
    if let Err(failure) = crate::sim::run_input(bytes) {
        panic!("{failure}");
    }
}

/// Decodes `bytes` every way the engine reads the medium.
pub fn fuzz_decoders(bytes: &[u8]) {
    let seq = bytes
        .get(4..8)
        .map_or(0, |b| u32::from_le_bytes(b.try_into().expect("4 bytes")));
    let _ = decode_record(bytes, &KEY, None);
    let _ = decode_record(bytes, &KEY, Some(seq));
    for page_size in [512u64, 4096] {
        let scan = scan_segment(bytes, 0, seq, page_size, &KEY);
        for record in &scan.records {
            assert!(
                record.payload.end <= bytes.len(),
                "scan returned a payload past the input"
            );
        }
    }
    let _ = Root::decode(bytes);
    // Reach the field parsers behind the checksums too: fix up the CRCs.
    if bytes.len() >= 16 {
        let mut root = bytes.to_vec();
        let total = u32::from_le_bytes(root[12..16].try_into().expect("4 bytes")) as usize;
        if (20..=root.len()).contains(&total) {
            let crc = crc32c::crc32c(&root[..total - 4]);
            root[total - 4..total].copy_from_slice(&crc.to_le_bytes());
            let _ = Root::decode(&root);
        }
    }
    if bytes.len() >= crate::record::HEADER_SIZE {
        let mut record = bytes.to_vec();
        if let Ok(header) = crate::record::RecordHeader::decode(&record) {
            let end = crate::record::HEADER_SIZE + header.payload_len as usize;
            if end <= record.len() {
                let payload_crc = crc32c::crc32c(&record[crate::record::HEADER_SIZE..end]);
                let crc = crate::record::record_crc(
                    payload_crc,
                    &record[..crate::record::HEADER_SIZE],
                    &KEY,
                );
                record[28..32].copy_from_slice(&crc.to_le_bytes());
                let decoded = decode_record(&record, &KEY, Some(header.seg_seq));
                assert!(decoded.is_ok(), "a record with a fixed-up CRC must decode");
                // The payload parsers behind the checksum.
                if let Ok((header, payload)) = decoded {
                    match header.kind {
                        crate::record::RecordKind::Ref => {
                            let _ = crate::record::decode_ref(payload);
                        }
                        crate::record::RecordKind::Unit => {
                            let _ = crate::record::decode_unit(&header, payload);
                        }
                        crate::record::RecordKind::Chapter => {
                            let _ = crate::dedup::decode_chapter(payload);
                        }
                        crate::record::RecordKind::Snapshot => {
                            let _ = crate::snapshots::decode_change(payload);
                        }
                        _ => {}
                    }
                }
            }
        }
    }
    let _ = Staged::decode(bytes, &KEY);
    // A staging slot with its fields and CRC fixed up decodes to what
    // re-encodes to it.
    if bytes.len() > STAGED_HEADER_BYTES {
        let mut slot = bytes.to_vec();
        slot[..4].copy_from_slice(b"ZSTG");
        let offset = u32::from_le_bytes(slot[16..20].try_into().expect("4 bytes"));
        slot[16..20].copy_from_slice(&(offset / 512 * 512).to_le_bytes());
        let len = 1 + (u16::from_le_bytes([slot[20], slot[21]]) % 511) as usize;
        slot[20..22].copy_from_slice(&(len as u16).to_le_bytes());
        slot[22..24].fill(0);
        slot[28..32].fill(0);
        if let Some(data) = slot.get(STAGED_HEADER_BYTES..STAGED_HEADER_BYTES + len) {
            let crc = crc32c::crc32c_append(
                crc32c::crc32c_append(crc32c::crc32c(data), &slot[..24]),
                &KEY.0,
            );
            slot[24..28].copy_from_slice(&crc.to_le_bytes());
            let staged = Staged::decode(&slot, &KEY).expect("a fixed-up staging record decodes");
            let end = STAGED_HEADER_BYTES + len;
            assert_eq!(&staged.encode(&KEY)[..end], &slot[..end], "it re-encodes");
        }
    }
    let mut map = Map::new(true);
    let mut segments = vec![None; 64];
    let _ = decode_chunk_payload(
        bytes,
        &mut map,
        &mut crate::dump::Directory::default(),
        &mut segments,
        1 << 20,
    );
    map.compact();
    map.check_counts_with(None)
        .expect("counts stay consistent on any input");
}

/// Checks the committed seed inputs of a fuzz target (`fuzz/seeds/TARGET`,
/// which `fuzz/run` passes to the target beside the corpus) against
/// what its generator makes: the same files, byte for byte, each small,
/// and no stray ones. With `ZDISK_WRITE_FUZZ_SEEDS=1` it writes them anew
/// first (after a format change); `regenerate` is the test command to say
/// so with. Panics on a difference: for tests.
pub fn check_committed_seeds(target: &str, seeds: &[(&str, Vec<u8>)], regenerate: &str) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/seeds")
        .join(target);
    let write = std::env::var_os("ZDISK_WRITE_FUZZ_SEEDS").is_some();
    if write {
        std::fs::create_dir_all(&dir).unwrap();
    }
    for (name, bytes) in seeds {
        let path = dir.join(name);
        if write {
            std::fs::write(&path, bytes).unwrap();
        }
        let committed = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (ZDISK_WRITE_FUZZ_SEEDS=1 writes it)",
                path.display()
            )
        });
        assert!(
            committed == *bytes,
            "{} is not what the generator makes: run ZDISK_WRITE_FUZZ_SEEDS=1 {regenerate} and commit",
            path.display()
        );
        assert!(
            committed.len() <= 8192,
            "{}: keep seeds small",
            path.display()
        );
    }
    let on_disk = std::fs::read_dir(&dir).unwrap().count();
    assert_eq!(on_disk, seeds.len(), "{}: stray files", dir.display());
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, RngCore, SeedableRng};

    /// A quick, always-on stand-in for the cargo-fuzz targets: random and
    /// mutated-valid inputs through every decoder.
    #[test]
    fn decoders_survive_random_and_mutated_inputs() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(17);
        let valid_root =
            crate::meta::Root::decode(&crate::meta::tests_support::sample_root().encode())
                .expect("sample root decodes")
                .encode();
        for round in 0..20_000 {
            let len = rng.gen_range(0..9000);
            let mut bytes = vec![0u8; len];
            if round % 2 == 0 {
                rng.fill_bytes(&mut bytes);
            } else {
                bytes = valid_root.clone();
                for _ in 0..rng.gen_range(1..4) {
                    let at = rng.gen_range(0..bytes.len());
                    bytes[at] = rng.gen();
                }
                bytes.truncate(rng.gen_range(0..=bytes.len()));
            }
            fuzz_decoders(&bytes);
        }
    }

    /// The seed inputs of `record_decoder`: one valid instance of each
    /// structure it decodes (a root, a segment of records, a staging slot,
    /// a checkpoint directory), keyed with the fuzz key so that they pass
    /// their checksums and reach the field parsers.
    fn decoder_seeds() -> Vec<(&'static str, Vec<u8>)> {
        use crate::record::{encode_record, record_len_for_payload, RecordHeader, RecordKind};
        let root = crate::meta::tests_support::sample_root().encode();
        let mut segment = Vec::new();
        let mut unit = crate::record::encode_unit_prefix(&[7, 8, 9], false);
        unit.extend_from_slice(&crate::codec::lz4_compress(&[b'u'; 3 * 4096]));
        let records: Vec<(RecordKind, u8, u64, u64, Vec<u8>)> = vec![
            (
                RecordKind::Data,
                1,
                5,
                3,
                crate::codec::lz4_compress(&[b'a'; 4096]),
            ),
            (RecordKind::Trim, 0, 64, 4, 16u64.to_le_bytes().to_vec()),
            (RecordKind::Zero, 0, 80, 5, 8u64.to_le_bytes().to_vec()),
            (RecordKind::Unit, 1, 96, 9, unit),
            (RecordKind::Damaged, 0, 200, 10, 1u64.to_le_bytes().to_vec()),
            (
                RecordKind::Ref,
                0,
                300,
                11,
                crate::record::encode_ref(&[crate::record::RefMember {
                    content: 3,
                    owner: 5,
                }]),
            ),
            (
                RecordKind::Chapter,
                0,
                2,
                0,
                crate::dedup::encode_chapter(
                    crate::dedup::ChapterId(2),
                    &[crate::dedup::ChapterEntry {
                        fingerprint: crate::Fingerprint::of(&[b'a'; 4096]),
                        content: 3,
                        owner: 5,
                    }],
                ),
            ),
            (
                RecordKind::Snapshot,
                0,
                0,
                11,
                crate::snapshots::encode_change(&crate::snapshots::SnapshotChange::Take(
                    crate::snapshots::Snapshot {
                        space: 1,
                        volume: 0,
                        version: 11,
                        name: "nightly".into(),
                        created_unix_secs: 1_700_000_000,
                    },
                )),
            ),
        ];
        for (kind, codec, lba, version, payload) in records {
            let mut out = vec![0u8; record_len_for_payload(payload.len()) as usize];
            let header = RecordHeader {
                kind,
                codec,
                seg_seq: 41,
                lba,
                version,
                payload_len: payload.len() as u32,
                crc: 0,
            };
            encode_record(&mut out, header, &payload, crc32c::crc32c(&payload), &KEY);
            segment.extend_from_slice(&out);
        }
        let staging = Staged {
            segment: crate::units::SegmentId(3),
            seq: 41,
            offset_bytes: 1024,
            data: segment[..100].to_vec(),
        }
        .encode(&KEY);
        let page = |start, blocks, chunk_items| crate::map::SnapshotPage {
            start,
            blocks,
            chunk_items,
            source: crate::map::PageSource::Encoded(vec![0; 40]),
        };
        let segments = [(
            crate::units::SegmentId(3),
            crate::dump::DumpedSegment {
                seq: 41,
                fill_bytes: 8192,
                max_version: 10,
                cold_bytes: 0,
                fast_bytes: 0,
            },
        )];
        let directory = crate::dump::encode_directory(
            &[page(0, 256, 1), page(1024, 512, 2)],
            crate::map::MapCounts {
                data_blocks: 5,
                zero_blocks: 8,
                damaged_blocks: 1,
                stored_bytes: 900,
            },
            segments.into_iter(),
            1 << 20,
        )
        .remove(0);
        vec![
            ("root", root),
            ("segment", segment),
            ("staging", staging),
            ("directory", directory),
        ]
    }

    /// The seed inputs of `engine_ops`: a few operation sequences over
    /// different drive shapes (the first byte) and crash models.
    fn engine_seeds() -> Vec<(&'static str, Vec<u8>)> {
        let names = ["ops-a", "ops-b", "ops-c", "ops-d", "ops-e", "ops-f"];
        names
            .iter()
            .enumerate()
            .map(|(index, name)| {
                let mut rng = rand::rngs::SmallRng::seed_from_u64(100 + index as u64);
                let mut input = vec![0u8; 512];
                rng.fill_bytes(&mut input);
                input[0] = (index as u8).wrapping_mul(43);
                (*name, input)
            })
            .collect()
    }

    /// The committed seeds (fuzz/seeds/TARGET, which `fuzz/run` passes to
    /// the target beside the corpus) are exactly what the functions
    /// above make, each runs clean through its target's function, and each
    /// is small. `ZDISK_WRITE_FUZZ_SEEDS=1` writes them anew (after a
    /// format change).
    #[test]
    fn committed_fuzz_seeds_are_current_and_run_clean() {
        for (target, seeds) in [
            ("record_decoder", decoder_seeds()),
            ("engine_ops", engine_seeds()),
        ] {
            super::check_committed_seeds(
                target,
                &seeds,
                "cargo test -p zdisk-core --release --lib fuzz_seeds",
            );
        }
        for (name, bytes) in decoder_seeds() {
            fuzz_decoders(&bytes);
            let decoded = match name {
                "root" => crate::meta::Root::decode(&bytes).is_ok(),
                "segment" => scan_segment(&bytes, 0, 41, 4096, &KEY).records.len() == 8,
                "staging" => Staged::decode(&bytes, &KEY).is_some(),
                _ => true,
            };
            assert!(decoded, "seed {name} is a valid instance");
        }
        let mut operations = 0;
        for (name, bytes) in engine_seeds() {
            let stats = crate::sim::run_input(&bytes).unwrap_or_else(|f| panic!("{name}: {f}"));
            operations += stats.operations;
        }
        assert!(
            operations > 100,
            "the engine seeds drive operations: {operations}"
        );
    }
}
