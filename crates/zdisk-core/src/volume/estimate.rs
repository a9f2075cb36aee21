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

use serde::Serialize;

use crate::codec::{Codec, CodecId};
use crate::units::{Lba, BLOCK_SIZE, BLOCK_SIZE_U64};

use super::io::{prepare, Prepared, RANGE_RECORD_LEN};

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
    }
}

/// Runs the write path's compression on writes and adds up what a
/// volume with `codec` and `unit_blocks` would store for them.
#[derive(Debug, Clone)]
pub struct WriteEstimator {
    codec: Codec,
    unit_blocks: u64,
    total: WriteEstimate,
}

impl WriteEstimator {
    /// `unit_blocks` is the volume's unit setting (see
    /// [`crate::meta::default_unit_blocks`]); 1 compresses every block alone.
    pub fn new(codec: Codec, unit_blocks: u8) -> WriteEstimator {
        assert!(unit_blocks >= 1, "a unit holds at least one block");
        WriteEstimator {
            codec,
            unit_blocks: unit_blocks.into(),
            total: WriteEstimate::default(),
        }
    }

    /// Adds one write request of whole blocks at block `first`, as
    /// `Volume::write_blocks` would store it, and returns its figures.
    pub fn add_write(&mut self, first: Lba, data: &[u8]) -> WriteEstimate {
        assert!(
            data.len().is_multiple_of(BLOCK_SIZE),
            "a write of whole blocks"
        );
        let batch = prepare(self.codec, data, first.0, self.unit_blocks);
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
                Prepared::Data {
                    codec: CodecId::Raw,
                    ..
                } => write.incompressible_bytes += bytes,
                Prepared::Data { .. } | Prepared::Unit { .. } => write.compressed_bytes += bytes,
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
        self.total.add(&write);
        write
    }

    /// The figures of every write added so far.
    pub fn total(&self) -> WriteEstimate {
        self.total
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
}
