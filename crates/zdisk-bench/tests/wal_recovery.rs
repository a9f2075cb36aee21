//! The write-ahead log's recovery on real zdisk volumes.
//!
//! Power cuts: the log runs on a volume whose medium is zdisk-core's
//! `MemMedia`, which keeps a live and a durable image; a crash keeps each
//! pending medium write with probability 1/2 and tears one at 512-byte
//! sectors (`CrashConfig`), half the seeds reusing segments in place as a
//! file does. The volume recovers, then the log, and every commit a
//! returned flush covered must be found, in both layouts, with checkpoints
//! trimming and the ring wrapping under the engine's own cleaning.
//!
//! An emulated drive stopped dead (its image kept, its buffers lost: what
//! `kill -9` of `zdisk serve` leaves), with and without power-loss
//! protection: the same, through the drive's staged partial pages.
//!
//! A failing seed is printed; runs are deterministic per seed.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

use zdisk_bench::driver::Target;
use zdisk_bench::wal::{Layout, Recovered, TargetDevice, Wal, WalConfig, WalError, BLOCK_BYTES};
use zdisk_core::media::{CrashConfig, Media, MemMedia};
use zdisk_core::meta::MediaKind;
use zdisk_core::{Codec, CreateOptions, GcPolicy, OpenOptions, Volume};
use zdisk_nand::{NandMedia, NandParams};

/// What the log was told, to check what a recovery finds.
#[derive(Default)]
struct Model {
    appended: BTreeMap<u64, Vec<u8>>,
    /// The last commit a returned flush covered.
    acked: u64,
    /// The first commit after the last returned checkpoint.
    checkpointed: u64,
}

impl Model {
    fn check(&mut self, recovered: &Recovered, context: &str) {
        let first = recovered.anchor.start_seq;
        for (index, commit) in recovered.commits.iter().enumerate() {
            assert_eq!(commit.seq, first + index as u64, "{context}");
            assert_eq!(
                self.appended.get(&commit.seq),
                Some(&commit.payload),
                "{context}: commit {} is not what was appended",
                commit.seq
            );
        }
        assert!(
            (self.checkpointed..=self.acked + 1).contains(&first),
            "{context}: log starts at {first}, checkpointed {} acked {}",
            self.checkpointed,
            self.acked
        );
        assert!(
            recovered.last_seq() >= self.acked,
            "{context}: flushed through {}, found through {}",
            self.acked,
            recovered.last_seq()
        );
        self.appended.retain(|&seq, _| seq <= recovered.last_seq());
        self.acked = recovered.last_seq();
        self.checkpointed = first;
    }
}

fn payload(rng: &mut SmallRng) -> Vec<u8> {
    // The benchmark's sizes, header included, and some odd ones.
    let len = match rng.gen_range(0..8) {
        0 => rng.gen_range(1..3000),
        n => [128, 256, 512, 1024, 2048, 128, 128][n - 1] - 24,
    };
    let mut bytes = vec![0u8; len];
    rng.fill_bytes(&mut bytes);
    bytes
}

/// Appends, flushes and checkpoints until the step budget runs out, with
/// rounds of the volume's background work (cleaning, checkpoints) between.
fn write_log(
    wal: &mut Wal<TargetDevice<'_>>,
    model: &mut Model,
    rng: &mut SmallRng,
    steps: u32,
) -> Result<(), WalError> {
    let group = rng.gen_range(1..=8);
    for _ in 0..steps {
        let mut step = || -> Result<(), WalError> {
            for _ in 0..group {
                let bytes = payload(rng);
                let seq = match wal.append(&bytes) {
                    Err(WalError::Full { .. }) => {
                        wal.checkpoint()?;
                        wal.append(&bytes)?
                    }
                    other => other?,
                };
                model.appended.insert(seq, bytes);
            }
            wal.flush()?;
            if rng.gen_bool(0.05) {
                wal.checkpoint()?;
            }
            if rng.gen_bool(0.2) {
                let volume = wal.device().target().volume.clone();
                volume.maintenance_tick().expect("background work");
            }
            Ok(())
        };
        let result = step();
        model.acked = wal.flushed_seq();
        model.checkpointed = wal.tail_seq();
        result?;
    }
    Ok(())
}

fn mem_volume(media: &Arc<MemMedia>, create: bool) -> Arc<Volume> {
    let options = OpenOptions {
        background: false,
        // Small, so that checkpoints happen within a run.
        checkpoint_interval_bytes: 256 * 1024,
        ..OpenOptions::default()
    };
    let media = media.clone() as Arc<dyn Media>;
    if create {
        let create = CreateOptions {
            logical_size_bytes: 4 << 20,
            codec: Codec::Lz4,
            gc_policy: GcPolicy::Greedy,
            unit_blocks: 2,
            media_kind: MediaKind::Memory,
            media_params: Vec::new(),
            dedup: false,
        };
        Volume::create(media, create, options).unwrap()
    } else {
        Volume::open(media, options).unwrap()
    }
}

fn power_cuts(layout: Layout) {
    for seed in 0..40u64 {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut media = {
            let media = MemMedia::with_size(4096, 64 * 1024, 96).unwrap();
            Arc::new(if seed % 2 == 0 {
                media
            } else {
                media.reusing_in_place()
            })
        };
        let config = WalConfig {
            layout,
            base_offset: 8 * BLOCK_BYTES,
            area_bytes: rng.gen_range(64..512) * BLOCK_BYTES,
            log_id: seed,
        };
        let mut model = Model {
            checkpointed: 1,
            ..Model::default()
        };
        for round in 0..4 {
            let context = format!("{layout} seed {seed} round {round}");
            let mut target = Target::real(mem_volume(&media, round == 0));
            let steps = rng.gen_range(1..200);
            {
                let device = TargetDevice::new(&mut target);
                let mut wal = if round == 0 {
                    Wal::create(device, config).unwrap()
                } else {
                    let (wal, recovered) = Wal::open(device, config.base_offset)
                        .unwrap_or_else(|e| panic!("{context}: {e}"));
                    model.check(&recovered, &context);
                    wal
                };
                write_log(&mut wal, &mut model, &mut rng, steps).unwrap();
                // Appended, not flushed: a crash may keep any of it.
                for _ in 0..rng.gen_range(0..4) {
                    let bytes = payload(&mut rng);
                    if let Ok(seq) = wal.append(&bytes) {
                        model.appended.insert(seq, bytes);
                    }
                }
            }
            target.volume.halt();
            media = Arc::new(media.crash(&mut rng, CrashConfig::default()));
        }
        let mut target = Target::real(mem_volume(&media, false));
        let (_, recovered) = Wal::open(TargetDevice::new(&mut target), config.base_offset).unwrap();
        model.check(&recovered, &format!("{layout} seed {seed} final"));
    }
}

#[test]
fn packed_log_finds_every_flushed_commit_after_power_cuts() {
    power_cuts(Layout::Packed);
}

#[test]
fn sparse_log_finds_every_flushed_commit_after_power_cuts() {
    power_cuts(Layout::Sparse);
}

struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn nand_volume(path: &std::path::Path, plp: bool, create: bool) -> Arc<Volume> {
    let clock = zdisk_core::clock::Timing::Virtual;
    let options = OpenOptions {
        background: false,
        ..OpenOptions::default()
    };
    if create {
        let mut params = NandParams::named("csd2000").unwrap();
        params.profile = params.profile.clone().with_physical_bytes(1 << 30);
        params.config.power_loss_protection = plp;
        let media = NandMedia::create(path, params.clone(), clock, true).unwrap();
        let create = CreateOptions {
            logical_size_bytes: 256 << 20,
            codec: Codec::parse(&params.profile.codec).unwrap(),
            gc_policy: GcPolicy::CostBenefit,
            unit_blocks: 1,
            media_kind: MediaKind::Nand,
            media_params: params.encode_params(),
            dedup: false,
        };
        Volume::create(Arc::new(media) as Arc<dyn Media>, create, options).unwrap()
    } else {
        let media = NandMedia::open(path, clock).unwrap();
        Volume::open(Arc::new(media) as Arc<dyn Media>, options).unwrap()
    }
}

/// An emulated csd2000 image, stopped dead three times mid-log.
#[test]
fn emulated_drive_stopped_dead_keeps_every_flushed_commit() {
    for plp in [true, false] {
        for layout in [Layout::Packed, Layout::Sparse] {
            let file = TempFile(std::env::temp_dir().join(format!(
                "zdisk-wal-{}-{plp}-{layout}.nand",
                std::process::id()
            )));
            let mut rng = SmallRng::seed_from_u64(plp as u64);
            let config = WalConfig {
                layout,
                base_offset: 0,
                area_bytes: 1024 * BLOCK_BYTES,
                log_id: 7,
            };
            let mut model = Model {
                checkpointed: 1,
                ..Model::default()
            };
            for round in 0..3 {
                let context = format!("{layout} PLP {plp} round {round}");
                let mut target = Target::real(nand_volume(&file.0, plp, round == 0));
                {
                    let device = TargetDevice::new(&mut target);
                    let mut wal = if round == 0 {
                        Wal::create(device, config).unwrap()
                    } else {
                        let (wal, recovered) = Wal::open(device, 0).unwrap();
                        model.check(&recovered, &context);
                        println!(
                            "{context}: {} commits since the last checkpoint, through commit {}",
                            recovered.commits.len(),
                            model.acked
                        );
                        wal
                    };
                    write_log(&mut wal, &mut model, &mut rng, 300).unwrap();
                    let bytes = payload(&mut rng);
                    let seq = wal.append(&bytes).unwrap();
                    model.appended.insert(seq, bytes);
                }
                // kill -9: the engine's buffers are gone, the image stays.
                target.volume.halt();
            }
            let mut target = Target::real(nand_volume(&file.0, plp, false));
            let (_, recovered) = Wal::open(TargetDevice::new(&mut target), 0).unwrap();
            model.check(&recovered, &format!("{layout} PLP {plp} final"));
        }
    }
}
