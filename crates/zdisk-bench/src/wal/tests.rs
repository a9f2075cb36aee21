//! The log against a device that can lose and tear what was not flushed.
//!
//! `MemDevice` keeps what a reader sees now and what a power cut would
//! leave: each write or trim since the last flush survives or not, and a
//! surviving write may tear at 512-byte sectors. The seeded runs drive the
//! writer through appends, group flushes, checkpoints and ring wrap-around
//! until an injected device failure, crash, recover, and check the result
//! against a model: every commit a returned `flush` covered is found, with
//! its payload, and nothing is found that this log did not append at that
//! sequence number. A failing seed is printed and replays exactly.

use std::collections::BTreeMap;

use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

use super::format::next_multiple;
use super::*;

const SECTOR: usize = 512;

/// A RAM block device with power-cut simulation.
#[derive(Clone)]
pub(super) struct MemDevice {
    live: Vec<u8>,
    durable: Vec<u8>,
    /// Writes and trims (as zeros) since the last flush, in order.
    pending: Vec<(u64, Vec<u8>)>,
    /// Mutating operations left before every operation fails.
    fail_after: Option<u64>,
    pub writes: Vec<(u64, u64)>,
}

impl MemDevice {
    pub(super) fn new(size: u64) -> MemDevice {
        MemDevice {
            live: vec![0; size as usize],
            durable: vec![0; size as usize],
            pending: Vec::new(),
            fail_after: None,
            writes: Vec::new(),
        }
    }

    fn mutate(&mut self) -> Result<(), String> {
        match &mut self.fail_after {
            Some(0) => Err("injected failure".into()),
            Some(left) => {
                *left -= 1;
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// What a restart after a power cut now finds: each pending operation
    /// survives with probability 1/2, and a survivor is torn (each sector
    /// old or new) with probability 1/4.
    fn crash(&self, rng: &mut SmallRng) -> MemDevice {
        let mut image = self.durable.clone();
        for (offset, data) in &self.pending {
            if !rng.gen_bool(0.5) {
                continue;
            }
            let torn = rng.gen_bool(0.25);
            for (index, sector) in data.chunks(SECTOR).enumerate() {
                if torn && rng.gen_bool(0.5) {
                    continue;
                }
                let at = *offset as usize + index * SECTOR;
                image[at..at + sector.len()].copy_from_slice(sector);
            }
        }
        MemDevice::restarted(image)
    }

    /// A crash keeping exactly the pending operations `keep` picks.
    fn crash_keeping(&self, keep: impl Fn(usize, u64) -> bool) -> MemDevice {
        let mut image = self.durable.clone();
        for (index, (offset, data)) in self.pending.iter().enumerate() {
            if keep(index, *offset) {
                image[*offset as usize..*offset as usize + data.len()].copy_from_slice(data);
            }
        }
        MemDevice::restarted(image)
    }

    fn restarted(image: Vec<u8>) -> MemDevice {
        MemDevice {
            live: image.clone(),
            durable: image,
            pending: Vec::new(),
            fail_after: None,
            writes: Vec::new(),
        }
    }

    fn nonzero_blocks(&self) -> usize {
        self.live
            .chunks(BLOCK_BYTES as usize)
            .filter(|b| b.iter().any(|&x| x != 0))
            .count()
    }
}

impl LogDevice for MemDevice {
    fn size_bytes(&self) -> u64 {
        self.live.len() as u64
    }

    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), String> {
        let at = offset as usize;
        let bytes = self
            .live
            .get(at..at + buf.len())
            .ok_or("read past the end")?;
        buf.copy_from_slice(bytes);
        Ok(())
    }

    fn write_at(&mut self, offset: u64, data: &[u8]) -> Result<(), String> {
        self.mutate()?;
        assert!(
            offset.is_multiple_of(BLOCK_BYTES) && (data.len() as u64).is_multiple_of(BLOCK_BYTES)
        );
        let at = offset as usize;
        self.live[at..at + data.len()].copy_from_slice(data);
        self.pending.push((offset, data.to_vec()));
        self.writes.push((offset, data.len() as u64));
        Ok(())
    }

    fn flush(&mut self) -> Result<(), String> {
        self.mutate()?;
        for (offset, data) in self.pending.drain(..) {
            let at = offset as usize;
            self.durable[at..at + data.len()].copy_from_slice(&data);
        }
        Ok(())
    }

    fn trim(&mut self, offset: u64, len: u64) -> Result<(), String> {
        self.mutate()?;
        let zeros = vec![0u8; len as usize];
        let at = offset as usize;
        self.live[at..at + zeros.len()].copy_from_slice(&zeros);
        self.pending.push((offset, zeros));
        Ok(())
    }
}

fn config(layout: Layout, area_blocks: u64) -> WalConfig {
    WalConfig {
        layout,
        base_offset: 2 * BLOCK_BYTES,
        area_bytes: area_blocks * BLOCK_BYTES,
        log_id: 0x5eed,
    }
}

fn payload(rng: &mut SmallRng) -> Vec<u8> {
    let len = match rng.gen_range(0..10) {
        0 => rng.gen_range(2000..6000),
        1 => 0,
        _ => rng.gen_range(1..400),
    };
    let mut bytes = vec![0u8; len];
    rng.fill_bytes(&mut bytes);
    bytes
}

/// What the writer was told, for checking what a recovery finds.
struct Model {
    /// Every commit appended in this log's history that a recovery has not
    /// dropped, by sequence number.
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
            assert_eq!(commit.seq, first + index as u64, "{context}: a gap");
            let expected = self.appended.get(&commit.seq);
            assert_eq!(
                expected,
                Some(&commit.payload),
                "{context}: commit {} is not what was appended",
                commit.seq
            );
        }
        // A checkpoint flushes before its anchor: the log starts at the
        // last returned checkpoint, or at a later one whose anchor landed.
        assert!(
            (self.checkpointed..=self.acked + 1).contains(&first),
            "{context}: the log starts at {first}, not in {}..={}",
            self.checkpointed,
            self.acked + 1
        );
        assert!(
            recovered.last_seq() >= self.acked,
            "{context}: flushed through {} but found only through {}",
            self.acked,
            recovered.last_seq()
        );
        // What survived is now the log; what did not is gone for good.
        self.appended.retain(|&seq, _| seq <= recovered.last_seq());
        self.acked = recovered.last_seq();
        self.checkpointed = first;
    }
}

/// One writer's life until the device fails (or `steps` run out).
fn run_until_failure(wal: &mut Wal<MemDevice>, model: &mut Model, rng: &mut SmallRng, steps: u32) {
    let group = rng.gen_range(1..=4);
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
            if rng.gen_bool(0.1) {
                wal.checkpoint()?;
            }
            Ok(())
        };
        let result = step();
        // Only what returned counts: a flush or an anchor that failed may
        // or may not have reached the device.
        model.acked = wal.flushed_seq();
        model.checkpointed = wal.tail_seq();
        match result {
            Ok(()) => {}
            Err(WalError::Device { .. }) => return,
            Err(other) => panic!("unexpected error {other}"),
        }
    }
}

fn crash_runs(layout: Layout) {
    for seed in 0..300u64 {
        let mut rng = SmallRng::seed_from_u64(seed);
        let area_blocks = rng.gen_range(8..24);
        let config = config(layout, area_blocks);
        let size = config.base_offset + (2 + area_blocks) * BLOCK_BYTES;
        let mut wal = Wal::create(MemDevice::new(size), config).unwrap();
        let mut model = Model {
            appended: BTreeMap::new(),
            acked: 0,
            checkpointed: 1,
        };
        for round in 0..4 {
            let context = format!("{layout} seed {seed} round {round}");
            wal.device().fail_after = Some(rng.gen_range(0..120));
            run_until_failure(&mut wal, &mut model, &mut rng, 200);
            let crashed = wal.device().crash(&mut rng);
            let (reopened, recovered) = match Wal::open(crashed, config.base_offset) {
                Ok(opened) => opened,
                Err(error) => panic!("{context}: {error}"),
            };
            model.check(&recovered, &context);
            wal = reopened;
        }
    }
}

#[test]
fn packed_every_flushed_commit_survives_random_crashes() {
    crash_runs(Layout::Packed);
}

#[test]
fn sparse_every_flushed_commit_survives_random_crashes() {
    crash_runs(Layout::Sparse);
}

#[test]
fn packed_rewrites_the_last_block_and_sparse_takes_a_fresh_one() {
    for layout in [Layout::Packed, Layout::Sparse] {
        let config = config(layout, 64);
        let mut wal = Wal::create(MemDevice::new(80 * BLOCK_BYTES), config).unwrap();
        wal.device().writes.clear();
        let payload = [7u8; 128 - RECORD_HEADER_BYTES];
        for _ in 0..32 {
            wal.append(&payload).unwrap();
            wal.flush().unwrap();
        }
        let writes = &wal.device().writes;
        assert_eq!(writes.len(), 32, "{layout}: one block per flush");
        let ring_start = config.base_offset + 2 * BLOCK_BYTES;
        for (index, &(offset, len)) in writes.iter().enumerate() {
            assert_eq!(len, BLOCK_BYTES);
            let block = match layout {
                // 32 commits of 128 bytes fill one block, written 32 times.
                Layout::Packed => 0,
                Layout::Sparse => index as u64,
            };
            assert_eq!(
                offset,
                ring_start + block * BLOCK_BYTES,
                "{layout} write {index}"
            );
        }
        assert_eq!(wal.counters().written_bytes, 32 * BLOCK_BYTES);
        let (_, recovered) = Wal::open(wal.into_device(), config.base_offset).unwrap();
        assert_eq!(recovered.commits.len(), 32);
        let expected_end = match layout {
            Layout::Packed => BLOCK_BYTES,
            Layout::Sparse => 31 * BLOCK_BYTES + 128,
        };
        assert_eq!(recovered.end_position, expected_end);
    }
}

#[test]
fn a_group_shares_one_flush_and_sparse_starts_each_group_in_a_fresh_block() {
    let config = config(Layout::Sparse, 64);
    let mut wal = Wal::create(MemDevice::new(80 * BLOCK_BYTES), config).unwrap();
    for _ in 0..3 {
        for _ in 0..8 {
            wal.append(&[1u8; 1000]).unwrap();
        }
        wal.flush().unwrap();
    }
    // 8 × 1024 bytes: two full blocks per group, then a fresh one.
    assert_eq!(wal.counters().flushes, 3);
    let (_, recovered) = Wal::open(wal.into_device(), config.base_offset).unwrap();
    let positions: Vec<u64> = recovered.commits.iter().map(|c| c.position).collect();
    assert_eq!(positions.len(), 24);
    assert_eq!(positions[8], 2 * BLOCK_BYTES);
    assert_eq!(positions[16], 4 * BLOCK_BYTES);
    assert_eq!(positions[9], 2 * BLOCK_BYTES + 1024);
}

/// A crashed writer leaves an intact commit `s + 2` after a torn `s + 1`.
/// The next writer appends its own `s + 1` with the very same payload in
/// the same place and crashes before `s + 2`: the old `s + 2` was never
/// acknowledged and must not come back.
#[test]
fn a_crashed_writers_leftovers_never_come_back() {
    let config = config(Layout::Sparse, 64);
    let mut wal = Wal::create(MemDevice::new(80 * BLOCK_BYTES), config).unwrap();
    wal.append(b"one").unwrap();
    wal.flush().unwrap();
    // Commit two fills a block exactly, commit three starts the next; one
    // write of both, never flushed: the device fails at the flush.
    let two = vec![2u8; (BLOCK_BYTES as usize) - RECORD_HEADER_BYTES];
    wal.append(&two).unwrap();
    wal.append(b"three").unwrap();
    wal.device().fail_after = Some(1);
    assert!(matches!(wal.flush(), Err(WalError::Device { .. })));
    // The write landed, except the sector with commit two's header.
    let device = wal.into_device();
    let (offset, _) = device.pending.last().cloned().unwrap();
    let mut crashed = device.crash_keeping(|_, _| true);
    let at = offset as usize;
    crashed.live[at..at + SECTOR].fill(0);
    crashed.durable = crashed.live.clone();

    let (mut wal, recovered) = Wal::open(crashed, config.base_offset).unwrap();
    assert_eq!(
        recovered.last_seq(),
        1,
        "commit two is torn, three unreachable"
    );
    // The same commit two again, in the same block, and a crash that loses
    // nothing but the flush after it.
    wal.append(&two).unwrap();
    wal.device().fail_after = Some(1);
    assert!(wal.flush().is_err());
    assert_eq!(wal.device().writes.last(), Some(&(offset, BLOCK_BYTES)));
    let crashed = wal.device().crash_keeping(|_, _| true);
    let (_, recovered) = Wal::open(crashed, config.base_offset).unwrap();
    let seqs: Vec<u64> = recovered.commits.iter().map(|c| c.seq).collect();
    assert_eq!(seqs, vec![1, 2], "the old commit three came back");
    assert_eq!(recovered.commits[1].payload, two);
    assert_ne!(
        recovered.commits[1].epoch, 1,
        "commit two is the new writer's"
    );
}

#[test]
fn checkpoints_trim_what_they_pass_and_the_ring_wraps() {
    for layout in [Layout::Packed, Layout::Sparse] {
        let area_blocks = 16;
        let config = config(layout, area_blocks);
        let mut wal = Wal::create(MemDevice::new(40 * BLOCK_BYTES), config).unwrap();
        let mut rng = SmallRng::seed_from_u64(9);
        let mut most_blocks = 0;
        for commit in 1..=2000u64 {
            let mut bytes = vec![0u8; rng.gen_range(100..300)];
            rng.fill_bytes(&mut bytes);
            wal.append(&bytes).unwrap();
            wal.flush().unwrap();
            if commit % 4 == 0 {
                wal.checkpoint().unwrap();
            }
            most_blocks = most_blocks.max(wal.device().nonzero_blocks());
        }
        let laps = wal.end_position() / (area_blocks * BLOCK_BYTES);
        assert!(laps >= 2, "{layout}: only {laps} laps");
        // Two anchor blocks, and the blocks of at most 4 commits (packed:
        // plus the block the next commit joins).
        assert!(
            most_blocks <= 2 + 5,
            "{layout}: {most_blocks} blocks held data"
        );
        assert!(wal.counters().trimmed_bytes > 0);
        let (_, recovered) = Wal::open(wal.into_device(), config.base_offset).unwrap();
        assert_eq!(recovered.last_seq(), 2000, "{layout}");
        assert!(recovered.commits.is_empty(), "{layout}: all checkpointed");
    }
}

#[test]
fn a_full_ring_refuses_until_a_checkpoint() {
    let config = config(Layout::Sparse, 4);
    let mut wal = Wal::create(MemDevice::new(16 * BLOCK_BYTES), config).unwrap();
    for _ in 0..4 {
        wal.append(&[5u8; 100]).unwrap();
        wal.flush().unwrap();
    }
    assert!(matches!(
        wal.append(&[5u8; 100]),
        Err(WalError::Full { .. })
    ));
    wal.checkpoint().unwrap();
    let seq = wal.append(&[6u8; 100]).unwrap();
    wal.flush().unwrap();
    assert_eq!(seq, 5);
    assert_eq!(
        wal.end_position(),
        next_multiple(3 * BLOCK_BYTES, 4 * BLOCK_BYTES) + 124
    );
}

#[test]
fn a_new_log_replaces_an_old_one_and_no_anchor_is_an_error() {
    let mut device = MemDevice::new(32 * BLOCK_BYTES);
    assert!(matches!(
        read_log(&mut device, 0),
        Err(WalError::NoAnchor { base_offset: 0 })
    ));
    let old = WalConfig {
        log_id: 1,
        ..config(Layout::Packed, 8)
    };
    let mut wal = Wal::create(device, old).unwrap();
    for _ in 0..5 {
        wal.append(b"old").unwrap();
        wal.flush().unwrap();
        wal.checkpoint().unwrap();
    }
    let new = WalConfig {
        log_id: 2,
        ..config(Layout::Sparse, 8)
    };
    let wal = Wal::create(wal.into_device(), new).unwrap();
    let (_, recovered) = Wal::open(wal.into_device(), new.base_offset).unwrap();
    assert_eq!(recovered.anchor.log_id, 2);
    assert_eq!(recovered.anchor.layout, Layout::Sparse);
    assert!(recovered.commits.is_empty());
    assert!(matches!(
        Wal::create(MemDevice::new(4 * BLOCK_BYTES), new),
        Err(WalError::DoesNotFit { .. })
    ));
}
