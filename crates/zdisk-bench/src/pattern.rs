//! Data patterns for benchmark writes.
//!
//! - `zeros`;
//! - `random`: fresh random bytes for every block (incompressible);
//! - `compressible:N`: fio's `buffer_compress_percentage=N` with
//!   `buffer_compress_chunk=512`: each 512-byte chunk is random bytes
//!   followed by N % zeros, so it compresses to about (100 − N) %;
//! - `file:PATH`: 4 KiB blocks taken in turn from a file, or from every
//!   regular file under a directory (real data).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};

use zdisk_core::BLOCK_SIZE;

/// Bytes per compressibility chunk, as fio's default `buffer_compress_chunk`.
pub const COMPRESS_CHUNK_BYTES: usize = 512;
/// At most this much file data is loaded for `file:` patterns.
const FILE_POOL_MAX_BYTES: usize = 512 << 20;

#[derive(Clone)]
pub enum Pattern {
    Zeros,
    Random,
    Compressible { percent: u8 },
    File { path: PathBuf, blocks: Arc<Vec<u8>> },
}

impl fmt::Debug for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Pattern::Zeros => write!(f, "zeros"),
            Pattern::Random => write!(f, "random"),
            Pattern::Compressible { percent } => write!(f, "compressible:{percent}"),
            Pattern::File { path, .. } => write!(f, "file:{}", path.display()),
        }
    }
}

impl Pattern {
    /// Parses `zeros`, `random`, `compressible:N` or `file:PATH`.
    pub fn parse(text: &str) -> Result<Pattern, String> {
        match text.split_once(':') {
            None if text == "zeros" => Ok(Pattern::Zeros),
            None if text == "random" => Ok(Pattern::Random),
            Some(("compressible", n)) => {
                let percent: u8 = n
                    .parse()
                    .ok()
                    .filter(|p| *p <= 100)
                    .ok_or_else(|| format!("compressible:{n}: N must be 0..=100"))?;
                Ok(Pattern::Compressible { percent })
            }
            Some(("file", path)) => Pattern::from_path(Path::new(path)),
            _ => Err(format!(
                "unknown pattern {text:?}: use zeros, random, compressible:N or file:PATH"
            )),
        }
    }

    fn from_path(path: &Path) -> Result<Pattern, String> {
        let mut pool = Vec::new();
        collect_files(path, &mut pool)?;
        // Whole blocks of real data; all-zero blocks are dropped (zeros is its own pattern).
        let mut blocks = Vec::with_capacity(pool.len());
        for block in pool.chunks_exact(BLOCK_SIZE) {
            if block.iter().any(|&b| b != 0) {
                blocks.extend_from_slice(block);
            }
        }
        if blocks.is_empty() {
            return Err(format!(
                "{} holds no non-zero 4 KiB block of data",
                path.display()
            ));
        }
        Ok(Pattern::File {
            path: path.to_path_buf(),
            blocks: Arc::new(blocks),
        })
    }

    /// A generator of blocks; `seed` makes streams independent and repeatable.
    pub fn source(&self, seed: u64) -> BlockSource {
        BlockSource {
            pattern: self.clone(),
            rng: SmallRng::seed_from_u64(seed),
            next_file_block: (seed as usize).wrapping_mul(7919),
        }
    }
}

fn collect_files(path: &Path, pool: &mut Vec<u8>) -> Result<(), String> {
    if pool.len() >= FILE_POOL_MAX_BYTES {
        return Ok(());
    }
    let metadata = std::fs::symlink_metadata(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if metadata.is_file() {
        if let Ok(bytes) = std::fs::read(path) {
            let room = FILE_POOL_MAX_BYTES - pool.len();
            pool.extend_from_slice(&bytes[..bytes.len().min(room)]);
            // Keep each file's data block-aligned, as a filesystem would.
            let pad = (BLOCK_SIZE - pool.len() % BLOCK_SIZE) % BLOCK_SIZE;
            pool.resize(pool.len() + pad, 0);
        }
    } else if metadata.is_dir() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|e| format!("cannot list {}: {e}", path.display()))?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .collect();
        entries.sort();
        for entry in entries {
            collect_files(&entry, pool)?;
        }
    }
    Ok(())
}

/// Produces blocks of one pattern.
pub struct BlockSource {
    pattern: Pattern,
    rng: SmallRng,
    next_file_block: usize,
}

impl BlockSource {
    /// Fills `buf` (a whole number of blocks).
    pub fn fill(&mut self, buf: &mut [u8]) {
        debug_assert_eq!(buf.len() % BLOCK_SIZE, 0);
        match &self.pattern {
            Pattern::Zeros => buf.fill(0),
            Pattern::Random => self.rng.fill_bytes(buf),
            Pattern::Compressible { percent } => {
                let random = COMPRESS_CHUNK_BYTES * (100 - *percent as usize) / 100;
                for chunk in buf.chunks_mut(COMPRESS_CHUNK_BYTES) {
                    let cut = random.min(chunk.len());
                    self.rng.fill_bytes(&mut chunk[..cut]);
                    chunk[cut..].fill(0);
                }
            }
            Pattern::File { blocks, .. } => {
                let count = blocks.len() / BLOCK_SIZE;
                for block in buf.chunks_mut(BLOCK_SIZE) {
                    let index = self.next_file_block % count;
                    block.copy_from_slice(&blocks[index * BLOCK_SIZE..(index + 1) * BLOCK_SIZE]);
                    self.next_file_block = self.next_file_block.wrapping_add(1);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_parse_and_fill() {
        assert!(matches!(Pattern::parse("zeros"), Ok(Pattern::Zeros)));
        assert!(matches!(
            Pattern::parse("compressible:75"),
            Ok(Pattern::Compressible { percent: 75 })
        ));
        assert!(Pattern::parse("compressible:101").is_err());
        assert!(Pattern::parse("bogus").is_err());
        let mut buf = vec![1u8; 2 * BLOCK_SIZE];
        Pattern::parse("compressible:75")
            .unwrap()
            .source(1)
            .fill(&mut buf);
        for chunk in buf.chunks(COMPRESS_CHUNK_BYTES) {
            assert!(
                chunk[128..].iter().all(|&b| b == 0),
                "the last 75 % of each chunk is zeros"
            );
        }
        let mut a = vec![0u8; BLOCK_SIZE];
        let mut b = vec![0u8; BLOCK_SIZE];
        let mut random = Pattern::Random.source(5);
        random.fill(&mut a);
        random.fill(&mut b);
        assert_ne!(a, b, "random data is fresh for every block");
    }

    #[test]
    fn compressible_percentages_compress_as_advertised() {
        use zdisk_core::codec::{compress_block, CodecId};
        for percent in [0u8, 50, 90] {
            let mut source = Pattern::Compressible { percent }.source(3);
            let mut block = vec![0u8; BLOCK_SIZE];
            let mut total = 0;
            for _ in 0..64 {
                source.fill(&mut block);
                let mut out = Vec::new();
                let id = compress_block(zdisk_core::Codec::Zstd { level: 1 }, &block, &mut out);
                total += if id == CodecId::Raw {
                    BLOCK_SIZE
                } else {
                    out.len()
                };
            }
            let ratio = total as f64 / (64 * BLOCK_SIZE) as f64;
            let expected = (100 - percent) as f64 / 100.0;
            assert!(
                (ratio - expected).abs() < 0.08,
                "compressible:{percent} stored {ratio:.2} of its size"
            );
        }
    }
}
