//! Compression of blocks and of units.
//!
//! A block written alone is compressed on its own, so it can be read
//! without touching its neighbours. A run of consecutive blocks written
//! together may be compressed as one unit ([`compress_unit`]), which
//! finds more redundancy across the larger window; a read of one of its
//! blocks then decompresses the unit. The codec that produced an extent is
//! recorded in the extent's header ([`CodecId`]), so a volume can switch
//! codecs between runs without rewriting old data.
//!
//! Incompressible data must cost little: before spending a zstd or DEFLATE
//! pass, [`compress_block`] estimates the block's order-0 entropy from a byte
//! histogram and, when that looks random, tries a fast LZ4 probe. Only if the
//! probe finds redundancy does the real codec run. Blocks that do not shrink
//! enough to save at least one 16-byte alignment unit are stored raw.

use std::cell::RefCell;
use std::fmt;

use crate::units::BLOCK_SIZE;

/// The codec identifier stored in each extent header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum CodecId {
    /// Stored as is.
    Raw = 0,
    Lz4 = 1,
    Zstd = 2,
    /// Raw DEFLATE (RFC 1951), the zlib family.
    Deflate = 3,
}

impl CodecId {
    pub fn from_u8(value: u8) -> Option<CodecId> {
        match value {
            0 => Some(CodecId::Raw),
            1 => Some(CodecId::Lz4),
            2 => Some(CodecId::Zstd),
            3 => Some(CodecId::Deflate),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CodecId::Raw => "raw",
            CodecId::Lz4 => "lz4",
            CodecId::Zstd => "zstd",
            CodecId::Deflate => "deflate",
        }
    }
}

/// A volume's codec setting: which compressor new writes use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Codec {
    /// No compression: every block is stored raw.
    None,
    #[default]
    Lz4,
    /// zstd at a level from the negative fast levels up to 22.
    Zstd { level: i32 },
    /// DEFLATE via libdeflate, level 1 to 12.
    Deflate { level: i32 },
}

/// Lowest zstd level accepted (zstd's fast levels go down to -131072; below
/// -100 nothing is gained).
pub const ZSTD_LEVEL_MIN: i32 = -100;
pub const ZSTD_LEVEL_MAX: i32 = 22;
pub const ZSTD_LEVEL_DEFAULT: i32 = 1;
pub const DEFLATE_LEVEL_MIN: i32 = 1;
pub const DEFLATE_LEVEL_MAX: i32 = 12;
pub const DEFLATE_LEVEL_DEFAULT: i32 = 1;

impl Codec {
    /// Parses `lz4`, `none`, `zstd`, `zstd:LEVEL` (LEVEL may be negative),
    /// `deflate` or `deflate:LEVEL`.
    pub fn parse(spec: &str) -> Result<Codec, String> {
        let spec = spec.trim().to_ascii_lowercase();
        let (name, level) = match spec.split_once(':') {
            Some((name, level)) => {
                let level: i32 = level
                    .parse()
                    .map_err(|_| format!("invalid codec level {level:?} in {spec:?}"))?;
                (name.to_string(), Some(level))
            }
            None => (spec.clone(), None),
        };
        match (name.as_str(), level) {
            ("none" | "raw", None) => Ok(Codec::None),
            ("lz4", None) => Ok(Codec::Lz4),
            ("zstd", level) => {
                let level = level.unwrap_or(ZSTD_LEVEL_DEFAULT);
                if !(ZSTD_LEVEL_MIN..=ZSTD_LEVEL_MAX).contains(&level) || level == 0 {
                    return Err(format!(
                        "zstd level {level} is out of range: use {ZSTD_LEVEL_MIN}..=-1 or 1..={ZSTD_LEVEL_MAX}"
                    ));
                }
                Ok(Codec::Zstd { level })
            }
            ("deflate" | "zlib", level) => {
                let level = level.unwrap_or(DEFLATE_LEVEL_DEFAULT);
                if !(DEFLATE_LEVEL_MIN..=DEFLATE_LEVEL_MAX).contains(&level) {
                    return Err(format!(
                        "deflate level {level} is out of range: use {DEFLATE_LEVEL_MIN}..={DEFLATE_LEVEL_MAX}"
                    ));
                }
                Ok(Codec::Deflate { level })
            }
            ("none" | "raw" | "lz4", Some(_)) => Err(format!("codec {name:?} takes no level")),
            _ => Err(format!(
                "unknown codec {spec:?}: use lz4, zstd[:LEVEL], deflate[:LEVEL] or none"
            )),
        }
    }

    /// The on-disk encoding of this setting: (codec id, level).
    pub fn to_parts(self) -> (CodecId, i32) {
        match self {
            Codec::None => (CodecId::Raw, 0),
            Codec::Lz4 => (CodecId::Lz4, 0),
            Codec::Zstd { level } => (CodecId::Zstd, level),
            Codec::Deflate { level } => (CodecId::Deflate, level),
        }
    }

    /// The inverse of [`Codec::to_parts`], validating the level.
    pub fn from_parts(id: u8, level: i32) -> Option<Codec> {
        let codec = match CodecId::from_u8(id)? {
            CodecId::Raw => Codec::None,
            CodecId::Lz4 => Codec::Lz4,
            CodecId::Zstd => Codec::Zstd { level },
            CodecId::Deflate => Codec::Deflate { level },
        };
        Codec::parse(&codec.to_string()).ok()
    }
}

/// What a write at some effort compresses with: a codec's setting plus
/// liblz4's acceleration where LZ4 runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Method {
    None,
    Lz4 { acceleration: i32 },
    Zstd { level: i32 },
    Deflate { level: i32 },
}

impl Codec {
    /// What a write at `effort` compresses with. Full effort is the codec
    /// itself. Fast effort: lz4 and DEFLATE take LZ4 at
    /// [`LZ4_FAST_ACCELERATION`] (DEFLATE's fastest level is no match for
    /// it), zstd takes level [`ZSTD_FAST_LEVEL`], none stays none.
    /// Deferred: none, whatever the codec.
    fn method(self, effort: Effort) -> Method {
        match (self, effort) {
            (Codec::None, _) | (_, Effort::Deferred) => Method::None,
            (Codec::Lz4, Effort::Full) => Method::Lz4 {
                acceleration: LZ4_ACCELERATION,
            },
            (Codec::Lz4 | Codec::Deflate { .. }, Effort::Fast) => Method::Lz4 {
                acceleration: LZ4_FAST_ACCELERATION,
            },
            (Codec::Zstd { level }, Effort::Full) => Method::Zstd { level },
            (Codec::Zstd { level }, Effort::Fast) => Method::Zstd {
                level: level.min(ZSTD_FAST_LEVEL),
            },
            (Codec::Deflate { level }, Effort::Full) => Method::Deflate { level },
        }
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Codec::None => write!(f, "none"),
            Codec::Lz4 => write!(f, "lz4"),
            Codec::Zstd { level } => write!(f, "zstd:{level}"),
            Codec::Deflate { level } => write!(f, "deflate:{level}"),
        }
    }
}

/// Order-0 entropy above which a block is treated as probably random
/// (bits per byte). A random 4 KiB block measures about 7.95 because of the
/// small sample; English text about 4.5; x86 code about 6.
const ENTROPY_RANDOM_BITS: f64 = 7.5;

/// An LZ4 probe must save at least this fraction for the real codec to run.
const PROBE_MIN_SAVING: f64 = 0.03;

/// The largest compressed payload worth storing: anything larger would not
/// save a 16-byte alignment unit over the raw record.
pub const COMPRESSED_PAYLOAD_MAX: usize = BLOCK_SIZE - 16;

struct Contexts {
    zstd: Option<(i32, zstd::bulk::Compressor<'static>)>,
    zstd_dec: Option<zstd::bulk::Decompressor<'static>>,
    zstd_stream: Option<zstd::stream::raw::Decoder<'static>>,
    deflate: Option<(i32, libdeflater::Compressor)>,
    deflate_dec: Option<libdeflater::Decompressor>,
    probe: Vec<u8>,
}

thread_local! {
    static CONTEXTS: RefCell<Contexts> = const { RefCell::new(Contexts {
        zstd: None,
        zstd_dec: None,
        zstd_stream: None,
        deflate: None,
        deflate_dec: None,
        probe: Vec::new(),
    }) };
}

/// `c * log2(c)` for every count a block's byte histogram can hold.
fn count_log_table() -> &'static [f32] {
    static TABLE: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=BLOCK_SIZE)
            .map(|c| {
                if c == 0 {
                    0.0
                } else {
                    (c as f64 * (c as f64).log2()) as f32
                }
            })
            .collect()
    })
}

/// Estimated order-0 entropy of `data` in bits per byte:
/// `log2(n) - sum(c * log2 c) / n` over the byte histogram.
pub fn entropy_bits_per_byte(data: &[u8]) -> f64 {
    if data.is_empty() {
        return 0.0;
    }
    // Four interleaved histograms avoid store-to-load stalls on runs.
    let mut counts = [[0u32; 256]; 4];
    let mut quads = data.chunks_exact(4);
    for quad in &mut quads {
        counts[0][quad[0] as usize] += 1;
        counts[1][quad[1] as usize] += 1;
        counts[2][quad[2] as usize] += 1;
        counts[3][quad[3] as usize] += 1;
    }
    for &byte in quads.remainder() {
        counts[0][byte as usize] += 1;
    }
    let n = data.len() as f64;
    let table = count_log_table();
    let mut sum = 0.0f64;
    for symbol in 0..256 {
        let count = counts.iter().map(|c| c[symbol]).sum::<u32>() as usize;
        sum += if count < table.len() {
            table[count] as f64
        } else {
            count as f64 * (count as f64).log2()
        };
    }
    (n.log2() - sum / n).max(0.0)
}

/// How hard a host write compresses (issue #27). A volume's codec says
/// what its data is compressed with at `Full` effort; at `Fast` effort a
/// write takes a cheaper setting of LZ4 or zstd (`Codec::method`); a
/// `Deferred` write is stored raw, its compression left to the idle pass.
/// Records written below full effort are marked
/// (`record::CODEC_FAST_EFFORT`) so that the cold-data pass rewrites them
/// first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum Effort {
    #[default]
    Full,
    Fast,
    Deferred,
}

impl Effort {
    pub fn name(self) -> &'static str {
        match self {
            Effort::Full => "full",
            Effort::Fast => "fast",
            Effort::Deferred => "deferred",
        }
    }
}

/// LZ4's own effort (liblz4's acceleration 1).
const LZ4_ACCELERATION: i32 = 1;

/// liblz4's acceleration at fast effort, for lz4 and DEFLATE volumes.
pub const LZ4_FAST_ACCELERATION: i32 = 32;

/// The zstd level of a zstd volume's writes at fast effort (or the
/// volume's own level, if that is lower still).
pub const ZSTD_FAST_LEVEL: i32 = -5;

/// LZ4-compresses `input` into `output` with liblz4, the library that
/// decodes it too; None if the result would not fit in `limit` bytes.
/// liblz4 gives up as soon as it would pass the limit, so a block that is
/// stored raw anyway costs less than a whole compression, and the output
/// is written into reserved capacity, never zeroed first.
fn lz4_into(input: &[u8], output: &mut Vec<u8>, limit: usize, acceleration: i32) -> Option<usize> {
    let source_len = i32::try_from(input.len()).ok()?;
    let capacity = i32::try_from(limit).ok()?;
    output.clear();
    output.reserve(limit);
    // SAFETY: liblz4 reads `source_len` bytes from `input` and writes at
    // most `capacity` bytes at `output`'s start, whose capacity is at least
    // `limit`; it returns how many it wrote, or 0 if they would not fit.
    let written = unsafe {
        lz4::liblz4::LZ4_compress_fast(
            input.as_ptr().cast(),
            output.as_mut_ptr().cast(),
            source_len,
            capacity,
            acceleration,
        )
    };
    let written = usize::try_from(written).ok().filter(|&n| n > 0)?;
    debug_assert!(written <= limit);
    // SAFETY: liblz4 initialised these `written` bytes.
    unsafe { output.set_len(written) };
    Some(written)
}

/// Compresses one block with `codec`, writing the payload to `output`.
///
/// Returns the codec actually used: [`CodecId::Raw`] (and a copy of the
/// input) when the block does not compress enough to be worth it.
pub fn compress_block(codec: Codec, input: &[u8], output: &mut Vec<u8>) -> CodecId {
    compress_block_with(codec, Effort::Full, input, output, true)
}

/// [`compress_block`] with the incompressibility probe switchable, so that
/// benchmarks can measure what it saves.
pub fn compress_block_with(
    codec: Codec,
    effort: Effort,
    input: &[u8],
    output: &mut Vec<u8>,
    probe: bool,
) -> CodecId {
    assert_eq!(input.len(), BLOCK_SIZE, "compress_block takes one block");
    let method = codec.method(effort);
    match compress_limited(method, input, output, COMPRESSED_PAYLOAD_MAX, probe) {
        Some(id) => {
            debug_assert!(output.len() <= COMPRESSED_PAYLOAD_MAX);
            id
        }
        None => {
            output.clear();
            output.extend_from_slice(input);
            CodecId::Raw
        }
    }
}

/// Compresses a unit of several consecutive blocks as one input, for the
/// better ratio a larger window gives. Returns `None` (and leaves
/// `output` unspecified) if it does not save at least a sixteenth: such
/// data is stored block by block, raw, so that a read of one block never
/// has to fetch its neighbours for nothing.
pub fn compress_unit(codec: Codec, input: &[u8], output: &mut Vec<u8>) -> Option<CodecId> {
    compress_unit_at(codec.method(Effort::Full), input, output)
}

fn compress_unit_at(method: Method, input: &[u8], output: &mut Vec<u8>) -> Option<CodecId> {
    assert!(
        input.len() >= 2 * BLOCK_SIZE && input.len().is_multiple_of(BLOCK_SIZE),
        "a unit is two blocks or more"
    );
    let limit = input.len() - input.len() / 16;
    let used = compress_limited(method, input, output, limit, true)?;
    debug_assert!(output.len() <= limit);
    Some(used)
}

/// A piece of a run of whole blocks, as [`compress_whole_blocks`]
/// compressed it.
pub enum RunPiece<'a> {
    /// The whole run as one unit: its blocks' compressed bytes (the
    /// unit's prefix is the caller's to write).
    Unit { codec: CodecId, data: &'a [u8] },
    /// Block `index` of the run, compressed alone (or, raw, the block
    /// itself).
    Block {
        index: usize,
        codec: CodecId,
        data: &'a [u8],
    },
}

/// The one rule for compressing a run of whole blocks, which host writes
/// and the cleaner's and cold pass's rewrites both follow: two or more
/// blocks are one unit if that saves at least a sixteenth
/// ([`compress_unit`]); otherwise each block is compressed alone
/// ([`compress_block`]), all at `effort`. `emit` gets the unit, or every
/// block in order.
pub fn compress_whole_blocks(
    codec: Codec,
    effort: Effort,
    run: &[u8],
    scratch: &mut Vec<u8>,
    mut emit: impl FnMut(RunPiece<'_>),
) {
    assert!(
        !run.is_empty() && run.len().is_multiple_of(BLOCK_SIZE),
        "a run of whole blocks"
    );
    if run.len() >= 2 * BLOCK_SIZE {
        if let Some(id) = compress_unit_at(codec.method(effort), run, scratch) {
            emit(RunPiece::Unit {
                codec: id,
                data: scratch,
            });
            return;
        }
    }
    let method = codec.method(effort);
    for (index, block) in run.chunks_exact(BLOCK_SIZE).enumerate() {
        // A block stored raw is handed over as it came, not copied.
        let (codec, data) =
            match compress_limited(method, block, scratch, COMPRESSED_PAYLOAD_MAX, true) {
                Some(id) => (id, &scratch[..]),
                None => (CodecId::Raw, block),
            };
        emit(RunPiece::Block { index, codec, data });
    }
}

/// Compresses `input` by `method` into `output` if the result is at most
/// `limit` bytes. With `probe`, a zstd or DEFLATE pass is skipped when the
/// first block looks random and a fast LZ4 probe finds nothing to save.
fn compress_limited(
    method: Method,
    input: &[u8],
    output: &mut Vec<u8>,
    limit: usize,
    probe: bool,
) -> Option<CodecId> {
    CONTEXTS.with(|contexts| {
        let mut contexts = contexts.borrow_mut();
        let contexts = &mut *contexts;
        match method {
            Method::None => None,
            Method::Lz4 { acceleration } => {
                lz4_into(input, output, limit, acceleration).map(|len| {
                    output.truncate(len);
                    CodecId::Lz4
                })
            }
            Method::Zstd { .. } | Method::Deflate { .. } => {
                let sample = &input[..BLOCK_SIZE];
                if probe && entropy_bits_per_byte(sample) >= ENTROPY_RANDOM_BITS {
                    let probe_limit = ((1.0 - PROBE_MIN_SAVING) * BLOCK_SIZE as f64) as usize;
                    lz4_into(sample, &mut contexts.probe, probe_limit, LZ4_ACCELERATION)?;
                }
                match method {
                    Method::Zstd { level } => compress_zstd(contexts, level, input, output, limit),
                    Method::Deflate { level } => {
                        compress_deflate(contexts, level, input, output, limit)
                    }
                    Method::None | Method::Lz4 { .. } => unreachable!(),
                }
            }
        }
    })
}

fn compress_zstd(
    contexts: &mut Contexts,
    level: i32,
    input: &[u8],
    output: &mut Vec<u8>,
    limit: usize,
) -> Option<CodecId> {
    if contexts.zstd.as_ref().map(|(l, _)| *l) != Some(level) {
        let compressor = zstd::bulk::Compressor::new(level).ok()?;
        contexts.zstd = Some((level, compressor));
    }
    let (_, compressor) = contexts.zstd.as_mut()?;
    output.clear();
    output.reserve(limit);
    match compressor.compress_to_buffer(input, output) {
        Ok(len) if len <= limit => Some(CodecId::Zstd),
        _ => None,
    }
}

fn compress_deflate(
    contexts: &mut Contexts,
    level: i32,
    input: &[u8],
    output: &mut Vec<u8>,
    limit: usize,
) -> Option<CodecId> {
    if contexts.deflate.as_ref().map(|(l, _)| *l) != Some(level) {
        let lvl = libdeflater::CompressionLvl::new(level).ok()?;
        contexts.deflate = Some((level, libdeflater::Compressor::new(lvl)));
    }
    let (_, compressor) = contexts.deflate.as_mut()?;
    output.resize(limit, 0);
    match compressor.deflate_compress(input, output) {
        Ok(len) => {
            output.truncate(len);
            Some(CodecId::Deflate)
        }
        Err(_) => None,
    }
}

/// Decompresses one block's payload into `output` (exactly one block).
pub fn decompress_block(id: CodecId, payload: &[u8], output: &mut [u8]) -> Result<(), String> {
    assert_eq!(output.len(), BLOCK_SIZE, "decompress_block fills one block");
    decompress_exact(id, payload, output)
}

/// Decompresses a payload into `output`, which it must fill exactly (one
/// block, or a unit of several).
pub fn decompress_exact(id: CodecId, payload: &[u8], output: &mut [u8]) -> Result<(), String> {
    let size = output.len();
    let produced = match id {
        CodecId::Raw => {
            if payload.len() != size {
                return Err(format!("raw payload has {} bytes", payload.len()));
            }
            output.copy_from_slice(payload);
            size
        }
        // liblz4's bounds-checked decoder (1.45x lz4_flex's on 8 KiB units
        // of the /usr tar when both were used), which also compresses.
        CodecId::Lz4 => {
            let expected = i32::try_from(size).map_err(|_| format!("lz4: {size} bytes"))?;
            lz4::block::decompress_to_buffer(payload, Some(expected), output)
                .map_err(|e| format!("lz4: {e}"))?
        }
        CodecId::Zstd => CONTEXTS.with(|contexts| {
            let mut contexts = contexts.borrow_mut();
            if contexts.zstd_dec.is_none() {
                contexts.zstd_dec =
                    Some(zstd::bulk::Decompressor::new().map_err(|e| format!("zstd: {e}"))?);
            }
            let decompressor = contexts.zstd_dec.as_mut().expect("just set");
            decompressor
                .decompress_to_buffer(payload, output)
                .map_err(|e| format!("zstd: {e}"))
        })?,
        CodecId::Deflate => CONTEXTS.with(|contexts| {
            let mut contexts = contexts.borrow_mut();
            let decompressor = contexts
                .deflate_dec
                .get_or_insert_with(libdeflater::Decompressor::new);
            decompressor
                .deflate_decompress(payload, output)
                .map_err(|e| format!("deflate: {e:?}"))
        })?,
    };
    if produced != size {
        return Err(format!(
            "{} produced {produced} bytes, expected {size}",
            id.name()
        ));
    }
    Ok(())
}

/// Decompresses a payload whose full size is `output.len()`, but only as
/// far as `want` bytes: enough to read the first blocks of a unit without
/// the rest. Bytes of `output` past `want` are unspecified.
pub fn decompress_prefix(
    id: CodecId,
    payload: &[u8],
    output: &mut [u8],
    want: usize,
) -> Result<(), String> {
    assert!(want <= output.len(), "a prefix longer than the whole");
    if want == output.len() {
        return decompress_exact(id, payload, output);
    }
    match id {
        // LZ4 decodes a 32 KiB unit faster whole (liblz4 copies in wide
        // strides) than a decoder that stops early could decode its half.
        CodecId::Lz4 => decompress_exact(id, payload, output),
        CodecId::Zstd => CONTEXTS.with(|contexts| {
            use zstd::stream::raw::Operation;
            let mut contexts = contexts.borrow_mut();
            if contexts.zstd_stream.is_none() {
                let decoder =
                    zstd::stream::raw::Decoder::new().map_err(|e| format!("zstd: {e}"))?;
                contexts.zstd_stream = Some(decoder);
            }
            let decoder = contexts.zstd_stream.as_mut().expect("just set");
            decoder.reinit().map_err(|e| format!("zstd: {e}"))?;
            // An output of `want` bytes: the decoder stops once it is full.
            let mut input = zstd::stream::raw::InBuffer::around(payload);
            let mut out = zstd::stream::raw::OutBuffer::around(&mut output[..want]);
            while out.pos() < want {
                let before = (input.pos(), out.pos());
                decoder
                    .run(&mut input, &mut out)
                    .map_err(|e| format!("zstd: {e}"))?;
                if (input.pos(), out.pos()) == before {
                    return Err(format!("zstd: the frame ends after {} bytes", out.pos()));
                }
            }
            Ok(())
        }),
        // Raw is a copy; DEFLATE has no cheap way to stop early.
        CodecId::Raw | CodecId::Deflate => decompress_exact(id, payload, output),
    }
}

/// Compresses an arbitrary buffer with LZ4 (used for checkpoint chunks).
pub fn lz4_compress(input: &[u8]) -> Vec<u8> {
    let len = i32::try_from(input.len()).expect("an LZ4 input under 2 GiB");
    // SAFETY: a pure function of a length.
    let bound = unsafe { lz4::liblz4::LZ4_compressBound(len) };
    let mut output = Vec::new();
    lz4_into(input, &mut output, bound as usize, LZ4_ACCELERATION)
        .expect("LZ4's bound holds any input");
    output
}

/// Decompresses an LZ4 buffer whose decompressed size is known.
pub fn lz4_decompress(input: &[u8], size: usize) -> Result<Vec<u8>, String> {
    let mut output = vec![0u8; size];
    let expected = i32::try_from(size).map_err(|_| format!("lz4: {size} bytes"))?;
    let produced = lz4::block::decompress_to_buffer(input, Some(expected), &mut output)
        .map_err(|e| format!("lz4: {e}"))?;
    if produced != size {
        return Err(format!("lz4 produced {produced} bytes, expected {size}"));
    }
    Ok(output)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngCore, SeedableRng};

    #[test]
    fn prefixes_decode_like_the_whole() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(3);
        let mut unit = Vec::new();
        for block in 0..8 {
            unit.extend(match block % 3 {
                0 => text_block(),
                1 => random_block(block),
                _ => vec![block as u8; BLOCK_SIZE],
            });
        }
        for codec in [
            Codec::Lz4,
            Codec::Zstd { level: 1 },
            Codec::Zstd { level: 9 },
        ] {
            let mut payload = Vec::new();
            let id = compress_unit(codec, &unit, &mut payload).expect("compresses");
            for want in [
                1,
                100,
                BLOCK_SIZE,
                3 * BLOCK_SIZE + 7,
                unit.len() - 1,
                unit.len(),
            ] {
                let mut out = vec![0u8; unit.len()];
                decompress_prefix(id, &payload, &mut out, want).unwrap();
                assert_eq!(out[..want], unit[..want], "{codec}: prefix of {want}");
            }
            // Damage is an error, never a panic.
            for cut in [1, payload.len() / 2] {
                let mut out = vec![0u8; unit.len()];
                let _ = decompress_prefix(id, &payload[..cut], &mut out, unit.len() - 1);
            }
            for _ in 0..200 {
                let mut junk = payload.clone();
                let at = (rng.next_u64() as usize) % junk.len();
                junk[at] ^= 1 << (rng.next_u64() % 8);
                let mut out = vec![0u8; unit.len()];
                let _ = decompress_prefix(id, &junk, &mut out, unit.len() / 2);
            }
        }
    }

    fn text_block() -> Vec<u8> {
        let sentence =
            b"The quick brown fox jumps over the lazy dog; zdisk packs extents byte-tight. ";
        sentence.iter().cycle().take(BLOCK_SIZE).copied().collect()
    }

    fn random_block(seed: u64) -> Vec<u8> {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        let mut block = vec![0u8; BLOCK_SIZE];
        rng.fill_bytes(&mut block);
        block
    }

    #[test]
    fn codec_specs_parse_and_round_trip() {
        assert_eq!(Codec::parse("lz4"), Ok(Codec::Lz4));
        assert_eq!(Codec::parse("none"), Ok(Codec::None));
        assert_eq!(Codec::parse("zstd"), Ok(Codec::Zstd { level: 1 }));
        assert_eq!(Codec::parse("zstd:-5"), Ok(Codec::Zstd { level: -5 }));
        assert_eq!(Codec::parse("ZSTD:19"), Ok(Codec::Zstd { level: 19 }));
        assert_eq!(Codec::parse("deflate:6"), Ok(Codec::Deflate { level: 6 }));
        assert!(Codec::parse("zstd:0").is_err());
        assert!(Codec::parse("zstd:23").is_err());
        assert!(Codec::parse("deflate:13").is_err());
        assert!(Codec::parse("lz4:3").is_err());
        assert!(Codec::parse("brotli").is_err());
        for spec in ["lz4", "none", "zstd:-3", "zstd:7", "deflate:9"] {
            let codec = Codec::parse(spec).unwrap();
            let (id, level) = codec.to_parts();
            assert_eq!(Codec::from_parts(id as u8, level), Some(codec));
        }
    }

    #[test]
    fn every_codec_round_trips_compressible_data() {
        let input = text_block();
        for codec in [
            Codec::Lz4,
            Codec::Zstd { level: 1 },
            Codec::Zstd { level: -7 },
            Codec::Deflate { level: 1 },
            Codec::Deflate { level: 12 },
        ] {
            let mut payload = Vec::new();
            let id = compress_block(codec, &input, &mut payload);
            assert_ne!(id, CodecId::Raw, "{codec} should compress text");
            assert!(
                payload.len() < BLOCK_SIZE / 4,
                "{codec} gave {} bytes",
                payload.len()
            );
            let mut output = vec![0u8; BLOCK_SIZE];
            decompress_block(id, &payload, &mut output).unwrap();
            assert_eq!(output, input, "{codec} round trip");
        }
    }

    #[test]
    fn random_data_is_stored_raw_by_every_codec() {
        let input = random_block(7);
        for codec in [
            Codec::None,
            Codec::Lz4,
            Codec::Zstd { level: 3 },
            Codec::Deflate { level: 6 },
        ] {
            let mut payload = Vec::new();
            assert_eq!(compress_block(codec, &input, &mut payload), CodecId::Raw);
            assert_eq!(payload, input);
        }
    }

    #[test]
    fn repeated_random_halves_are_still_compressed() {
        // High order-0 entropy but an obvious LZ match: the probe must not
        // mistake it for random data.
        let half = random_block(9);
        let mut input = half[..BLOCK_SIZE / 2].to_vec();
        input.extend_from_slice(&half[..BLOCK_SIZE / 2]);
        assert!(entropy_bits_per_byte(&input) > ENTROPY_RANDOM_BITS);
        let mut payload = Vec::new();
        let id = compress_block(Codec::Zstd { level: 1 }, &input, &mut payload);
        assert_eq!(id, CodecId::Zstd);
        assert!(payload.len() < BLOCK_SIZE * 6 / 10);
    }

    #[test]
    fn corrupt_payloads_fail_cleanly() {
        let input = text_block();
        for codec in [
            Codec::Lz4,
            Codec::Zstd { level: 1 },
            Codec::Deflate { level: 1 },
        ] {
            let mut payload = Vec::new();
            let id = compress_block(codec, &input, &mut payload);
            let mut output = vec![0u8; BLOCK_SIZE];
            let truncated = &payload[..payload.len() / 2];
            assert!(
                decompress_block(id, truncated, &mut output).is_err(),
                "{codec}"
            );
        }
        let mut output = vec![0u8; BLOCK_SIZE];
        assert!(decompress_block(CodecId::Raw, &[1, 2, 3], &mut output).is_err());
    }

    #[test]
    fn entropy_estimate_separates_text_from_noise() {
        assert!(entropy_bits_per_byte(&text_block()) < 5.0);
        assert!(entropy_bits_per_byte(&random_block(1)) > 7.9);
        assert_eq!(entropy_bits_per_byte(&[0u8; BLOCK_SIZE]), 0.0);
    }
}
