//! A plain RAM medium for the real-time benchmarks of the engine itself
//! (`--memory`): flash-like (erase before reuse, no staging area), with
//! nothing between a request and its bytes but a per-segment read-write
//! lock, so that what limits many threads is the engine, not the medium.
//!
//! `zdisk_core::media::MemMedia` is the tests' medium: it keeps a live and
//! a durable image to simulate power loss and takes one mutex for every
//! read and write, which would cap a thread-scaling measurement at the
//! simulator's lock. Nothing here survives the process, so `sync` has
//! nothing to do.

use std::sync::{Mutex, RwLock};

use zdisk_core::media::{Media, MediaGeometry};
use zdisk_core::units::PageIndex;
use zdisk_core::{Error, Result, SegmentId};

pub struct RamMedia {
    geometry: MediaGeometry,
    /// Each segment's bytes, allocated at its first write (empty: erased,
    /// reads as zeros).
    segments: Vec<RwLock<Vec<u8>>>,
    meta: [Mutex<Vec<u8>>; 2],
}

impl RamMedia {
    pub fn new(geometry: MediaGeometry) -> Result<RamMedia> {
        geometry.validate()?;
        Ok(RamMedia {
            segments: (0..geometry.segment_count)
                .map(|_| RwLock::new(Vec::new()))
                .collect(),
            meta: [Mutex::new(Vec::new()), Mutex::new(Vec::new())],
            geometry,
        })
    }

    fn range(&self, segment: SegmentId, offset_bytes: u64, len: usize) -> Result<usize> {
        let end = offset_bytes.checked_add(len as u64);
        if segment.index() >= self.segments.len()
            || end.is_none_or(|end| end > self.geometry.segment_size_bytes)
        {
            return Err(Error::InvalidArgument(format!(
                "RAM medium: {len} bytes at {offset_bytes} of segment {} lie outside it",
                segment.index()
            )));
        }
        Ok(offset_bytes as usize)
    }
}

impl Media for RamMedia {
    fn geometry(&self) -> MediaGeometry {
        self.geometry
    }

    fn physical_size_bytes(&self) -> u64 {
        self.geometry.log_capacity_bytes() + 2 * self.geometry.meta_slot_size_bytes as u64
    }

    fn write_pages(&self, segment: SegmentId, first_page: PageIndex, data: &[u8]) -> Result<()> {
        let offset = first_page.0 as u64 * self.geometry.page_size_bytes as u64;
        let start = self.range(segment, offset, data.len())?;
        let mut bytes = self.segments[segment.index()]
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if bytes.is_empty() {
            bytes.resize(self.geometry.segment_size_bytes as usize, 0);
        }
        bytes[start..start + data.len()].copy_from_slice(data);
        Ok(())
    }

    fn read(&self, segment: SegmentId, offset_bytes: u64, buf: &mut [u8]) -> Result<()> {
        let start = self.range(segment, offset_bytes, buf.len())?;
        let bytes = self.segments[segment.index()]
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if bytes.is_empty() {
            buf.fill(0);
        } else {
            buf.copy_from_slice(&bytes[start..start + buf.len()]);
        }
        Ok(())
    }

    fn erase_segment(&self, segment: SegmentId) -> Result<()> {
        self.range(segment, 0, 0)?;
        *self.segments[segment.index()]
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Vec::new();
        Ok(())
    }

    fn sync(&self) -> Result<()> {
        Ok(())
    }

    fn write_meta_slot(&self, slot: usize, data: &[u8]) -> Result<()> {
        assert!(slot < 2, "metadata slot {slot} does not exist");
        assert!(data.len() <= self.geometry.meta_slot_size_bytes as usize);
        *self.meta[slot]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = data.to_vec();
        Ok(())
    }

    fn read_meta_slot(&self, slot: usize) -> Result<Vec<u8>> {
        assert!(slot < 2, "metadata slot {slot} does not exist");
        let mut bytes = self.meta[slot]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        bytes.resize(self.geometry.meta_slot_size_bytes as usize, 0);
        Ok(bytes)
    }

    fn describe(&self) -> String {
        format!(
            "RAM ({} segments of {} bytes)",
            self.geometry.segment_count, self.geometry.segment_size_bytes
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn media() -> RamMedia {
        RamMedia::new(MediaGeometry {
            page_size_bytes: 4096,
            segment_size_bytes: 64 * 1024,
            segment_count: 8,
            meta_slot_size_bytes: 8192,
        })
        .expect("geometry")
    }

    #[test]
    fn pages_read_back_and_erase_to_zeros() {
        let media = media();
        media
            .write_pages(SegmentId(1), PageIndex(2), &[7u8; 4096])
            .unwrap();
        let mut buf = [0u8; 4096];
        media.read(SegmentId(1), 2 * 4096, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 7), "the page reads back");
        media.read(SegmentId(0), 0, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0), "an unwritten segment is zeros");
        media.erase_segment(SegmentId(1)).unwrap();
        media.read(SegmentId(1), 2 * 4096, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0), "an erased segment is zeros");
    }

    #[test]
    fn out_of_range_requests_are_errors() {
        let media = media();
        let mut buf = [0u8; 4096];
        assert!(media.read(SegmentId(8), 0, &mut buf).is_err());
        assert!(media.read(SegmentId(0), 62 * 1024, &mut buf).is_err());
        assert!(media
            .write_pages(SegmentId(0), PageIndex(16), &[0u8; 4096])
            .is_err());
    }

    #[test]
    fn meta_slots_read_back_padded() {
        let media = media();
        media.write_meta_slot(1, b"root").unwrap();
        let slot = media.read_meta_slot(1).unwrap();
        assert_eq!(&slot[..4], b"root");
        assert_eq!(slot.len(), 8192);
        assert!(media.read_meta_slot(0).unwrap().iter().all(|&b| b == 0));
    }
}
