//! Little-endian encoding helpers for on-disk structures.
//!
//! [`ByteReader`] never trusts a length it reads: every access is bounds
//! checked and fails with a message instead of panicking, because its input
//! comes from the medium.

/// Appends little-endian integers to a buffer.
#[derive(Default)]
pub struct ByteWriter {
    pub buf: Vec<u8>,
}

impl ByteWriter {
    pub fn new() -> Self {
        ByteWriter { buf: Vec::new() }
    }
    pub fn u8(&mut self, value: u8) {
        self.buf.push(value);
    }
    pub fn u16(&mut self, value: u16) {
        self.buf.extend_from_slice(&value.to_le_bytes());
    }
    pub fn u32(&mut self, value: u32) {
        self.buf.extend_from_slice(&value.to_le_bytes());
    }
    pub fn i32(&mut self, value: i32) {
        self.buf.extend_from_slice(&value.to_le_bytes());
    }
    pub fn u64(&mut self, value: u64) {
        self.buf.extend_from_slice(&value.to_le_bytes());
    }
    pub fn bytes(&mut self, value: &[u8]) {
        self.buf.extend_from_slice(value);
    }
    /// LEB128: 7 bits per byte, least significant first.
    pub fn varint(&mut self, mut value: u64) {
        while value >= 0x80 {
            self.u8((value as u8) | 0x80);
            value >>= 7;
        }
        self.u8(value as u8);
    }
    /// A signed value as a zigzag varint (small magnitudes stay short).
    pub fn zigzag(&mut self, value: i64) {
        self.varint(((value << 1) ^ (value >> 63)) as u64);
    }
}

/// Reads little-endian integers with bounds checks.
pub struct ByteReader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> ByteReader<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        ByteReader { bytes, pos: 0 }
    }

    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    pub fn take(&mut self, len: usize) -> Result<&'a [u8], String> {
        if self.remaining() < len {
            return Err(self.truncated(len));
        }
        let slice = &self.bytes[self.pos..self.pos + len];
        self.pos += len;
        Ok(slice)
    }

    #[cold]
    fn truncated(&self, len: usize) -> String {
        format!(
            "truncated: wanted {len} bytes at offset {}, only {} left",
            self.pos,
            self.remaining()
        )
    }

    #[inline]
    pub fn u8(&mut self) -> Result<u8, String> {
        match self.bytes.get(self.pos) {
            Some(&byte) => {
                self.pos += 1;
                Ok(byte)
            }
            None => Err(self.truncated(1)),
        }
    }
    pub fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    pub fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    pub fn i32(&mut self) -> Result<i32, String> {
        Ok(i32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    pub fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    /// A LEB128 varint of at most 64 bits.
    #[inline]
    pub fn varint(&mut self) -> Result<u64, String> {
        // Most varints a map page holds are one byte.
        if let Some(&byte) = self.bytes.get(self.pos).filter(|&&byte| byte < 0x80) {
            self.pos += 1;
            return Ok(byte as u64);
        }
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = self.u8()?;
            value |= ((byte & 0x7F) as u64) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err("varint longer than 64 bits".into())
    }
    /// A zigzag varint.
    #[inline]
    pub fn zigzag(&mut self) -> Result<i64, String> {
        let value = self.varint()?;
        Ok(((value >> 1) as i64) ^ -((value & 1) as i64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reader_reports_truncation_instead_of_panicking() {
        let mut writer = ByteWriter::new();
        writer.u32(7);
        writer.u64(u64::MAX);
        let mut reader = ByteReader::new(&writer.buf);
        assert_eq!(reader.u32(), Ok(7));
        assert_eq!(reader.u64(), Ok(u64::MAX));
        assert!(reader.u8().is_err());
        assert!(ByteReader::new(&[1, 2]).u32().is_err());
        assert!(ByteReader::new(&[]).take(usize::MAX).is_err());
    }
}
