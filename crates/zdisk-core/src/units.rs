//! Newtypes for the engine's indices, so that a block number, a segment
//! number and a page number can never be mixed up.

use std::fmt;

/// Bytes in one logical block. Every block is compressed on its own.
pub const BLOCK_SIZE: usize = 4096;
/// `BLOCK_SIZE` as a `u64`, for offset arithmetic.
pub const BLOCK_SIZE_U64: u64 = BLOCK_SIZE as u64;

/// A logical block number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lba(pub u64);

impl Lba {
    /// The byte offset of this block in the volume.
    pub fn offset_bytes(self) -> u64 {
        self.0 * BLOCK_SIZE_U64
    }
}

impl fmt::Display for Lba {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A segment number on the medium: the unit of sequential writing and of erase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct SegmentId(pub u32);

impl SegmentId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for SegmentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A page number within a segment: the unit of writing to the medium.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct PageIndex(pub u32);

/// Rounds `value` up to a multiple of `align`, which must be a power of two.
pub fn align_up(value: u64, align: u64) -> u64 {
    debug_assert!(align.is_power_of_two());
    (value + align - 1) & !(align - 1)
}

/// Parses a size such as `4096`, `512K`, `64M`, `10G` or `1T` (binary units).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("empty size".to_string());
    }
    let upper = text.to_ascii_uppercase();
    let trimmed = upper
        .strip_suffix("IB")
        .or_else(|| upper.strip_suffix('B'))
        .unwrap_or(&upper);
    let (digits, shift) = match trimmed.chars().last() {
        Some('K') => (&trimmed[..trimmed.len() - 1], 10),
        Some('M') => (&trimmed[..trimmed.len() - 1], 20),
        Some('G') => (&trimmed[..trimmed.len() - 1], 30),
        Some('T') => (&trimmed[..trimmed.len() - 1], 40),
        Some('P') => (&trimmed[..trimmed.len() - 1], 50),
        _ => (trimmed, 0),
    };
    let number: u64 = digits.trim().parse().map_err(|_| {
        format!("invalid size {text:?}: expected a number with an optional K, M, G or T suffix")
    })?;
    number
        .checked_mul(1u64 << shift)
        .ok_or_else(|| format!("size {text:?} is too large"))
}

/// Formats a byte count with a binary unit, e.g. `1.50 GiB`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else if value.fract() == 0.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("10G"), Ok(10 << 30));
        assert_eq!(parse_size("1T"), Ok(1 << 40));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert!(parse_size("").is_err());
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("-1G").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn sizes_format_readably() {
        assert_eq!(format_size(512), "512 B");
        assert_eq!(format_size(4096), "4 KiB");
        assert_eq!(format_size(3 << 29), "1.50 GiB");
    }

    #[test]
    fn align_up_rounds_to_power_of_two() {
        assert_eq!(align_up(0, 16), 0);
        assert_eq!(align_up(1, 16), 16);
        assert_eq!(align_up(32, 16), 32);
        assert_eq!(align_up(33, 16), 48);
    }
}
