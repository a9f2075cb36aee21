//! What the write path would store for some data, without a volume.
//!
//! `zdisk estimate` predicts a codec's savings by running the host write
//! path's own compression step (`io::prepare`: zero detection, units
//! within aligned windows, the incompressibility probe, raw fallback) on
//! each request's blocks and adding up the records `write_blocks` would
//! append for them: one record per unit or block, and one range record
//! per run of zero blocks. Nothing here decides anything the write path
//! does not; the prediction can only drift from what a volume stores if
//! the write path changes without going through `prepare`.
//!
//! It also predicts what 4 KiB deduplication (issue #25) would save, on
//! the model the engine is to implement: a non-zero block whose bytes were
//! written before (at any offset, any whole-block shift) is neither
//! compressed nor stored again; the blocks of a request that are not
//! duplicates go through `prepare` as above, run by run; each maximal run
//! of duplicate blocks costs its reference records
//! ([`crate::record::ref_records_len`]: 48 bytes and 16 per block).
//! Zero blocks stay zero ranges and are never duplicates. [`DedupIndex`]
//! tells duplicates from new blocks by their [`Fingerprint`]s; see there
//! for how it stays within a memory budget, and what that approximates.

use std::collections::HashSet;

use serde::Serialize;

use crate::codec::{Codec, CodecId, Effort};
use crate::fingerprint::Fingerprint;
use crate::units::{Lba, BLOCK_SIZE, BLOCK_SIZE_U64};

use super::io::{is_zero, prepare, Prepared, RANGE_RECORD_LEN};

/// RAM one fingerprint takes in [`DedupIndex`]'s set, roughly: an 8-byte
/// tag, the hash table's control byte and its spare capacity.
const DEDUP_ENTRY_BYTES: u64 = 16;

/// What a run of writes would cost, as [`WriteEstimator`] adds it up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct WriteEstimate {
    /// Logical bytes written.
    pub logical_bytes: u64,
    /// Bytes of records the writes would append: data and unit records
    /// (headers and alignment included) and the range records of zero runs.
    pub stored_bytes: u64,
    /// Logical bytes of all-zero blocks (stored as range records).
    pub zero_bytes: u64,
    /// Logical bytes stored raw because they did not compress enough.
    pub incompressible_bytes: u64,
    /// Logical bytes stored compressed, alone or in units.
    pub compressed_bytes: u64,
    /// Records appended for data (units count once).
    pub data_records: u64,
    /// Range records appended for runs of zero blocks.
    pub zero_records: u64,
    /// Logical bytes of blocks stored as references to an earlier copy
    /// (always 0 without deduplication).
    pub duplicate_bytes: u64,
    /// Reference records appended, one per run of duplicate blocks (of
    /// up to 256), and the bytes they take.
    pub ref_records: u64,
    pub ref_bytes: u64,
}

impl WriteEstimate {
    /// Adds `other`'s figures to these.
    pub fn add(&mut self, other: &WriteEstimate) {
        self.logical_bytes += other.logical_bytes;
        self.stored_bytes += other.stored_bytes;
        self.zero_bytes += other.zero_bytes;
        self.incompressible_bytes += other.incompressible_bytes;
        self.compressed_bytes += other.compressed_bytes;
        self.data_records += other.data_records;
        self.zero_records += other.zero_records;
        self.duplicate_bytes += other.duplicate_bytes;
        self.ref_records += other.ref_records;
        self.ref_bytes += other.ref_bytes;
    }
}

/// Runs the write path's compression on writes and adds up what a
/// volume with `codec` and `unit_blocks` would store for them, without
/// deduplication and, for writes added with their blocks' kinds, with it.
#[derive(Debug, Clone)]
pub struct WriteEstimator {
    codec: Codec,
    effort: Effort,
    unit_blocks: u64,
    total: WriteEstimate,
    deduplicated: WriteEstimate,
}

impl WriteEstimator {
    /// `unit_blocks` is the volume's unit setting (see
    /// [`crate::meta::default_unit_blocks`]); 1 compresses every block alone.
    pub fn new(codec: Codec, unit_blocks: u8) -> WriteEstimator {
        assert!(unit_blocks >= 1, "a unit holds at least one block");
        WriteEstimator {
            codec,
            effort: Effort::Full,
            unit_blocks: unit_blocks.into(),
            total: WriteEstimate::default(),
            deduplicated: WriteEstimate::default(),
        }
    }

    /// Estimates writes at `effort` (issue #27) instead of full effort.
    pub fn with_effort(self, effort: Effort) -> WriteEstimator {
        WriteEstimator { effort, ..self }
    }

    /// Adds one write request of whole blocks at block `first`, as
    /// `Volume::write_blocks` would store it, and returns its figures.
    pub fn add_write(&mut self, first: Lba, data: &[u8]) -> WriteEstimate {
        let write = self.cost(first, data);
        self.total.add(&write);
        write
    }

    /// Adds one write request as [`add_write`](Self::add_write) does, and
    /// also what it would cost with deduplication, given each block's kind
    /// from [`DedupIndex::classify`]: runs of blocks that are not duplicates
    /// cost what `prepare` makes of them, each run of duplicates one
    /// reference record. Returns the figures without and with.
    pub fn add_write_deduplicated(
        &mut self,
        first: Lba,
        data: &[u8],
        kinds: &[BlockKind],
    ) -> (WriteEstimate, WriteEstimate) {
        assert_eq!(kinds.len() * BLOCK_SIZE, data.len(), "one kind per block");
        let plain = self.add_write(first, data);
        let deduplicated = if kinds.contains(&BlockKind::Duplicate) {
            let mut write = WriteEstimate::default();
            let mut start = 0;
            while start < kinds.len() {
                let duplicate = kinds[start] == BlockKind::Duplicate;
                let end = kinds[start..]
                    .iter()
                    .position(|&kind| (kind == BlockKind::Duplicate) != duplicate)
                    .map_or(kinds.len(), |length| start + length);
                let bytes = &data[start * BLOCK_SIZE..end * BLOCK_SIZE];
                if duplicate {
                    let blocks = (end - start) as u64;
                    let ref_bytes = crate::record::ref_records_len(blocks);
                    write.add(&WriteEstimate {
                        logical_bytes: bytes.len() as u64,
                        stored_bytes: ref_bytes,
                        duplicate_bytes: bytes.len() as u64,
                        ref_records: blocks.div_ceil(crate::record::REF_MEMBERS_MAX as u64),
                        ref_bytes,
                        ..WriteEstimate::default()
                    });
                } else {
                    write.add(&self.cost(Lba(first.0 + start as u64), bytes));
                }
                start = end;
            }
            write
        } else {
            plain
        };
        debug_assert_eq!(deduplicated.logical_bytes, plain.logical_bytes);
        debug_assert_eq!(
            deduplicated.zero_bytes
                + deduplicated.incompressible_bytes
                + deduplicated.compressed_bytes
                + deduplicated.duplicate_bytes,
            deduplicated.logical_bytes,
            "every block is counted once"
        );
        self.deduplicated.add(&deduplicated);
        (plain, deduplicated)
    }

    /// What `Volume::write_blocks` would store for one request.
    fn cost(&self, first: Lba, data: &[u8]) -> WriteEstimate {
        assert!(
            data.len().is_multiple_of(BLOCK_SIZE),
            "a write of whole blocks"
        );
        let batch = prepare(
            self.codec,
            self.effort,
            data,
            first.0,
            self.unit_blocks,
            &[],
        );
        let mut write = WriteEstimate {
            logical_bytes: data.len() as u64,
            ..WriteEstimate::default()
        };
        let mut in_zero_run = false;
        for prepared in &batch.blocks {
            let bytes = prepared.blocks() as u64 * BLOCK_SIZE_U64;
            match prepared {
                Prepared::Zero => {
                    write.zero_bytes += bytes;
                    if !in_zero_run {
                        write.zero_records += 1;
                        write.stored_bytes += RANGE_RECORD_LEN;
                    }
                    in_zero_run = true;
                    continue;
                }
                Prepared::Raw { .. }
                | Prepared::Data {
                    codec: CodecId::Raw,
                    ..
                } => write.incompressible_bytes += bytes,
                Prepared::Data { .. } | Prepared::Unit { .. } => write.compressed_bytes += bytes,
                Prepared::Found => unreachable!("the estimator looks for nothing stored"),
            }
            in_zero_run = false;
            write.data_records += 1;
            write.stored_bytes += prepared.record_len();
        }
        debug_assert_eq!(
            write.zero_bytes + write.incompressible_bytes + write.compressed_bytes,
            write.logical_bytes,
            "every block is counted once"
        );
        write
    }

    /// The figures of every write added so far, without deduplication.
    pub fn total(&self) -> WriteEstimate {
        self.total
    }

    /// The figures with deduplication of every write added with
    /// [`add_write_deduplicated`](Self::add_write_deduplicated), as
    /// classified; [`DedupSummary::corrected`] turns them into the
    /// prediction when the index sampled.
    pub fn total_deduplicated(&self) -> WriteEstimate {
        self.deduplicated
    }
}

/// What deduplication makes of one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    /// All zeros: a zero range, never a duplicate.
    Zero,
    /// Bytes not written before: compressed and stored.
    New,
    /// Bytes written before: a reference to the earlier copy.
    Duplicate,
}

/// Which blocks of a stream of writes are duplicates of earlier ones,
/// within a memory budget.
///
/// While the set of fingerprints seen fits the budget, it is exact: every
/// non-zero block's fingerprint is looked up and added (by its 64-bit
/// [`Fingerprint::tag`]; two distinct blocks share a tag with odds of about
/// n²/2^65 for n blocks, nothing an estimate notices). When the set would
/// outgrow the budget, the index turns to adaptive hash sampling: it keeps
/// only fingerprints whose tag has its `shift` low bits zero, raising
/// `shift` by one (and dropping the entries that no longer qualify) each
/// time the set outgrows the budget again. Which blocks qualify depends on
/// their bytes alone, so every copy of a block is either tracked or not,
/// and the tracked set's size times 2^shift is an unbiased estimate of the
/// distinct blocks. A block that does not qualify takes the kind of the
/// last block that did: duplicates come in runs (copied files, images), so
/// the runs, and so the reference records and the units the write path
/// would make, are approximated; [`DedupSummary::corrected`] scales the
/// stored data to the estimated distinct blocks.
#[derive(Debug, Clone)]
pub struct DedupIndex {
    tags: HashSet<u64>,
    entries_max: usize,
    shift: u32,
    nonzero_blocks: u64,
    new_blocks: u64,
    last_tracked_duplicate: bool,
}

impl DedupIndex {
    /// An empty index whose set may take about `memory_bytes` of RAM.
    pub fn new(memory_bytes: u64) -> DedupIndex {
        DedupIndex {
            tags: HashSet::new(),
            entries_max: (memory_bytes / DEDUP_ENTRY_BYTES).max(1) as usize,
            shift: 0,
            nonzero_blocks: 0,
            new_blocks: 0,
            last_tracked_duplicate: false,
        }
    }

    /// The kind of each block of `data` (whole blocks), in order: a block
    /// is a duplicate of any block before it, in this write or an earlier one.
    pub fn classify(&mut self, data: &[u8]) -> Vec<BlockKind> {
        assert!(
            data.len().is_multiple_of(BLOCK_SIZE),
            "a write of whole blocks"
        );
        data.chunks_exact(BLOCK_SIZE)
            .map(|block| self.classify_block(block))
            .collect()
    }

    fn classify_block(&mut self, block: &[u8]) -> BlockKind {
        if is_zero(block) {
            return BlockKind::Zero;
        }
        self.nonzero_blocks += 1;
        let tag = Fingerprint::of(block).tag();
        let duplicate = if tag & self.mask() == 0 {
            let duplicate = !self.tags.insert(tag);
            self.last_tracked_duplicate = duplicate;
            if !duplicate {
                self.keep_to_budget();
            }
            duplicate
        } else {
            self.last_tracked_duplicate
        };
        if duplicate {
            BlockKind::Duplicate
        } else {
            self.new_blocks += 1;
            BlockKind::New
        }
    }

    /// The low bits a tracked tag has zero.
    fn mask(&self) -> u64 {
        (1u64 << self.shift) - 1
    }

    fn keep_to_budget(&mut self) {
        while self.tags.len() > self.entries_max {
            assert!(self.shift < 63, "a budget of at least one entry");
            self.shift += 1;
            let mask = self.mask();
            self.tags.retain(|tag| tag & mask == 0);
        }
    }

    /// The figures so far.
    pub fn summary(&self) -> DedupSummary {
        let distinct_blocks = ((self.tags.len() as u64) << self.shift).min(self.nonzero_blocks);
        DedupSummary {
            nonzero_blocks: self.nonzero_blocks,
            distinct_blocks,
            duplicate_blocks: self.nonzero_blocks - distinct_blocks,
            classified_new_blocks: self.new_blocks,
            sample_shift: self.shift,
        }
    }
}

/// What [`DedupIndex`] found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct DedupSummary {
    /// Non-zero blocks seen.
    pub nonzero_blocks: u64,
    /// Distinct non-zero blocks: exact while `sample_shift` is 0, else
    /// estimated (tracked fingerprints × 2^sample_shift).
    pub distinct_blocks: u64,
    /// `nonzero_blocks - distinct_blocks`: blocks deduplication would not store.
    pub duplicate_blocks: u64,
    /// Blocks classified as new; equal to `distinct_blocks` while exact.
    pub classified_new_blocks: u64,
    /// 0 while every fingerprint is tracked; else 1 in 2^sample_shift is.
    pub sample_shift: u32,
}

impl DedupSummary {
    /// The prediction from what the estimator added up for the classified
    /// blocks: as it is while the index was exact; when it sampled, the new
    /// blocks' figures (data records, compressed and raw bytes, the bytes
    /// they take) scaled by distinct / classified-new blocks, so that they
    /// stand for the estimated distinct blocks.
    pub fn corrected(&self, deduplicated: &WriteEstimate) -> WriteEstimate {
        if self.sample_shift == 0 || self.classified_new_blocks == 0 {
            return *deduplicated;
        }
        let factor = self.distinct_blocks as f64 / self.classified_new_blocks as f64;
        let scale = |value: u64| (value as f64 * factor).round() as u64;
        let records = deduplicated.zero_records * RANGE_RECORD_LEN + deduplicated.ref_bytes;
        WriteEstimate {
            stored_bytes: records + scale(deduplicated.stored_bytes - records),
            incompressible_bytes: scale(deduplicated.incompressible_bytes),
            compressed_bytes: scale(deduplicated.compressed_bytes),
            data_records: scale(deduplicated.data_records),
            duplicate_bytes: self.duplicate_blocks * BLOCK_SIZE_U64,
            ..*deduplicated
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::BlockDevice;
    use crate::media::{Media, MemMedia};
    use crate::volume::{CreateOptions, OpenOptions, Volume};
    use rand::{RngCore, SeedableRng};
    use std::sync::Arc;

    /// Mixed data: text-like blocks, random blocks and zero blocks, in
    /// runs of different lengths so units are cut at zeros and windows.
    fn mixed(blocks: usize, seed: u64) -> Vec<u8> {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        let mut data = vec![0u8; blocks * BLOCK_SIZE];
        let mut at = 0;
        while at < blocks {
            let run = 1 + (rng.next_u32() % 11) as usize;
            let kind = rng.next_u32() % 3;
            for block in at..(at + run).min(blocks) {
                let out = &mut data[block * BLOCK_SIZE..(block + 1) * BLOCK_SIZE];
                match kind {
                    0 => {}
                    1 => rng.fill_bytes(out),
                    _ => {
                        for (i, byte) in out.iter_mut().enumerate() {
                            *byte = b"zdisk estimates what it stores; "[(i + block) % 32];
                        }
                        out[..8].copy_from_slice(&(block as u64).to_le_bytes());
                    }
                }
            }
            at += run;
        }
        data
    }

    /// The estimate of a run of writes equals the stored bytes a fresh
    /// volume reports after the same writes, for every codec.
    #[test]
    fn estimate_equals_what_a_volume_stores() {
        let data = mixed(1500, 5);
        for codec in [
            Codec::Lz4,
            Codec::Zstd { level: 1 },
            Codec::Deflate { level: 1 },
            Codec::None,
        ] {
            let unit_blocks = crate::meta::default_unit_blocks(codec);
            let media: Arc<dyn Media> = Arc::new(MemMedia::with_size(4096, 1 << 20, 32).unwrap());
            let create = CreateOptions {
                codec,
                unit_blocks,
                ..CreateOptions::new(64 << 20)
            };
            let options = OpenOptions {
                background: false,
                ..OpenOptions::default()
            };
            let volume = Volume::create(media, create, options).unwrap();
            let mut estimator = WriteEstimator::new(codec, unit_blocks);
            // Requests of 100 blocks from block 3: not aligned to units.
            let request = 100 * BLOCK_SIZE;
            for (index, chunk) in data.chunks(request).enumerate() {
                let offset = 3 * BLOCK_SIZE_U64 + (index * request) as u64;
                volume.write(offset, chunk, false).unwrap();
                estimator.add_write(Lba(offset / BLOCK_SIZE_U64), chunk);
            }
            let estimate = estimator.total();
            let stats = volume.stats();
            let zero_range_bytes = estimate.zero_records * RANGE_RECORD_LEN;
            assert_eq!(
                estimate.stored_bytes - zero_range_bytes,
                stats.stored_bytes,
                "{codec}: data records"
            );
            assert_eq!(estimate.zero_bytes, stats.zero_bytes, "{codec}: zeros");
            assert_eq!(
                estimate.logical_bytes,
                data.len() as u64,
                "{codec}: logical"
            );
            if codec == Codec::None {
                assert_eq!(estimate.compressed_bytes, 0);
            } else {
                assert!(estimate.compressed_bytes > 0, "{codec} compresses text");
                assert!(
                    estimate.incompressible_bytes > 0,
                    "{codec}: random stays raw"
                );
            }
        }
    }

    /// `blocks` distinct non-zero blocks: each starts with `seed` and its
    /// index, the rest text, so they compress.
    fn distinct(blocks: usize, seed: u64) -> Vec<u8> {
        let mut data = vec![0u8; blocks * BLOCK_SIZE];
        for (index, block) in data.chunks_exact_mut(BLOCK_SIZE).enumerate() {
            for (i, byte) in block.iter_mut().enumerate() {
                *byte = b"blocks that a volume already holds "[i % 35];
            }
            block[..8].copy_from_slice(&seed.to_le_bytes());
            block[8..16].copy_from_slice(&(index as u64).to_le_bytes());
        }
        data
    }

    fn deduplicate(
        estimator: &mut WriteEstimator,
        index: &mut DedupIndex,
        first: u64,
        data: &[u8],
    ) -> (WriteEstimate, WriteEstimate) {
        let kinds = index.classify(data);
        estimator.add_write_deduplicated(Lba(first), data, &kinds)
    }

    #[test]
    fn a_second_identical_request_costs_only_references() {
        let data = mixed(300, 9);
        let codec = Codec::Zstd { level: 1 };
        let mut estimator = WriteEstimator::new(codec, crate::meta::default_unit_blocks(codec));
        let mut index = DedupIndex::new(64 << 20);
        let (plain, deduplicated) = deduplicate(&mut estimator, &mut index, 0, &data);
        // mixed() repeats no non-zero block: the first copy costs the same.
        assert_eq!(deduplicated, plain);
        assert_eq!(plain.duplicate_bytes, 0);
        let (again, second) = deduplicate(&mut estimator, &mut index, 1000, &data);
        assert!(again.data_records > 0, "without dedup it is stored again");
        assert_eq!(second.data_records, 0, "no data stored again");
        assert_eq!(second.zero_bytes, plain.zero_bytes, "zeros stay zeros");
        assert_eq!(
            second.duplicate_bytes,
            plain.compressed_bytes + plain.incompressible_bytes
        );
        assert_eq!(second.zero_records, plain.zero_records);
        // Zero runs and duplicate runs alternate: a reference per run between zeros.
        assert!(second.ref_records >= second.zero_records.saturating_sub(1));
        assert!(second.ref_records <= second.zero_records + 1);
        assert_eq!(
            second.stored_bytes,
            second.zero_records * RANGE_RECORD_LEN + second.ref_bytes
        );
        assert!(second.ref_bytes >= second.ref_records * 64);
        let summary = index.summary();
        assert_eq!(summary.sample_shift, 0);
        assert_eq!(summary.distinct_blocks, summary.classified_new_blocks);
        assert_eq!(
            summary.duplicate_blocks * BLOCK_SIZE_U64,
            second.duplicate_bytes
        );
        let total = estimator.total_deduplicated();
        assert_eq!(total.stored_bytes, plain.stored_bytes + second.stored_bytes);
        assert_eq!(estimator.total().stored_bytes, 2 * plain.stored_bytes);
        assert_eq!(
            summary.corrected(&total),
            total,
            "exact: nothing to correct"
        );
    }

    #[test]
    fn a_copy_shifted_by_three_blocks_deduplicates() {
        let data = distinct(200, 1);
        let codec = Codec::Lz4;
        let mut estimator = WriteEstimator::new(codec, crate::meta::default_unit_blocks(codec));
        let mut index = DedupIndex::new(64 << 20);
        let (first, _) = deduplicate(&mut estimator, &mut index, 0, &data);
        assert!(first.compressed_bytes > 0);
        // The same blocks three blocks further on, after three new ones.
        let mut shifted = distinct(3, 2);
        shifted.extend_from_slice(&data);
        let (plain, deduplicated) = deduplicate(&mut estimator, &mut index, 997, &shifted);
        assert_eq!(deduplicated.duplicate_bytes, 200 * BLOCK_SIZE_U64);
        assert_eq!(deduplicated.ref_records, 1, "one run of duplicates");
        assert_eq!(
            deduplicated.compressed_bytes + deduplicated.incompressible_bytes,
            3 * BLOCK_SIZE_U64,
            "the three new blocks"
        );
        // The three new blocks cost what they would cost written alone.
        let alone = WriteEstimator::new(codec, crate::meta::default_unit_blocks(codec))
            .add_write(Lba(997), &shifted[..3 * BLOCK_SIZE]);
        assert_eq!(
            deduplicated.stored_bytes,
            alone.stored_bytes + deduplicated.ref_bytes
        );
        assert_eq!(
            deduplicated.ref_bytes,
            48 + 16 * 200,
            "one record of 200 blocks"
        );
        assert!(
            plain.stored_bytes > 3 * deduplicated.stored_bytes,
            "{} against {}",
            plain.stored_bytes,
            deduplicated.stored_bytes
        );
        // Cut into other requests, it is still all duplicates.
        for (at, piece) in data.chunks(7 * BLOCK_SIZE).enumerate() {
            let (_, write) = deduplicate(&mut estimator, &mut index, 5000 + 7 * at as u64, piece);
            assert_eq!(write.duplicate_bytes, piece.len() as u64);
            let blocks = (piece.len() / BLOCK_SIZE) as u64;
            assert_eq!(write.stored_bytes, crate::record::ref_records_len(blocks));
            assert_eq!(
                write.ref_bytes,
                48 + 16 * blocks,
                "one record of {blocks} blocks"
            );
        }
        assert_eq!(index.summary().distinct_blocks, 203);
    }

    #[test]
    fn zero_blocks_are_never_duplicates() {
        let zeros = vec![0u8; 64 * BLOCK_SIZE];
        let mut estimator = WriteEstimator::new(Codec::Lz4, 1);
        let mut index = DedupIndex::new(64 << 20);
        for first in [0, 64, 1000] {
            let kinds = index.classify(&zeros);
            assert!(kinds.iter().all(|&kind| kind == BlockKind::Zero));
            let (plain, deduplicated) =
                estimator.add_write_deduplicated(Lba(first), &zeros, &kinds);
            assert_eq!(deduplicated, plain);
            assert_eq!(deduplicated.duplicate_bytes, 0);
            assert_eq!(deduplicated.ref_records, 0);
            assert_eq!(deduplicated.zero_records, 1);
            assert_eq!(deduplicated.stored_bytes, RANGE_RECORD_LEN);
        }
        assert_eq!(index.summary(), DedupSummary::default());
    }

    #[test]
    fn sampling_keeps_to_the_budget_and_estimates_distinct_blocks() {
        // 200,000 blocks: 100,000 distinct, then each of them again in a
        // shuffled order; a budget of 2,000 entries.
        let distinct_count = 100_000usize;
        let mut index = DedupIndex::new(2_000 * DEDUP_ENTRY_BYTES);
        let mut block = vec![0u8; BLOCK_SIZE];
        let mut classify = |index: &mut DedupIndex, number: u64| {
            block[..8].copy_from_slice(&number.wrapping_add(1).to_le_bytes());
            index.classify(&block)[0]
        };
        let first_pass: Vec<BlockKind> = (0..distinct_count as u64)
            .map(|number| classify(&mut index, number))
            .collect();
        let mut rng = rand::rngs::SmallRng::seed_from_u64(3);
        let mut order: Vec<u64> = (0..distinct_count as u64).collect();
        rand::seq::SliceRandom::shuffle(&mut order[..], &mut rng);
        for &number in &order {
            classify(&mut index, number);
        }
        let summary = index.summary();
        assert!(summary.sample_shift >= 5, "{summary:?}");
        assert!(index.tags.len() <= 2_000, "within the budget");
        assert_eq!(summary.nonzero_blocks, 2 * distinct_count as u64);
        let error = |estimate: u64| (estimate as f64 / distinct_count as f64 - 1.0).abs();
        assert!(error(summary.distinct_blocks) < 0.10, "{summary:?}");
        assert!(error(summary.duplicate_blocks) < 0.10, "{summary:?}");
        assert!(
            first_pass.iter().all(|&kind| kind == BlockKind::New),
            "nothing in the first pass repeats"
        );
    }

    #[test]
    fn sampled_figures_are_scaled_to_the_distinct_blocks() {
        let summary = DedupSummary {
            nonzero_blocks: 1000,
            distinct_blocks: 600,
            duplicate_blocks: 400,
            classified_new_blocks: 500,
            sample_shift: 3,
        };
        let classified = WriteEstimate {
            logical_bytes: 1100 * BLOCK_SIZE_U64,
            stored_bytes: 2 * RANGE_RECORD_LEN + 7 * 96 + 100_000,
            zero_bytes: 100 * BLOCK_SIZE_U64,
            incompressible_bytes: 100 * BLOCK_SIZE_U64,
            compressed_bytes: 400 * BLOCK_SIZE_U64,
            data_records: 50,
            zero_records: 2,
            duplicate_bytes: 500 * BLOCK_SIZE_U64,
            ref_records: 7,
            ref_bytes: 7 * 96,
        };
        let corrected = summary.corrected(&classified);
        assert_eq!(
            corrected.stored_bytes,
            2 * RANGE_RECORD_LEN + 7 * 96 + 120_000
        );
        assert_eq!(corrected.incompressible_bytes, 120 * BLOCK_SIZE_U64);
        assert_eq!(corrected.compressed_bytes, 480 * BLOCK_SIZE_U64);
        assert_eq!(corrected.duplicate_bytes, 400 * BLOCK_SIZE_U64);
        assert_eq!(corrected.data_records, 60);
        assert_eq!(
            corrected.zero_bytes
                + corrected.incompressible_bytes
                + corrected.compressed_bytes
                + corrected.duplicate_bytes,
            corrected.logical_bytes
        );
    }
}
