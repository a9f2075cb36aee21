//! A medium in RAM that can simulate power loss.
//!
//! `MemMedia` keeps two images: what a reader sees now, and what would
//! survive a power cut (the durable image). Every write, erase and metadata
//! write since the last `sync` is a pending operation. [`MemMedia::crash`]
//! builds the medium a restart would find:
//! - each pending operation independently survives or is lost;
//! - one surviving page write is torn: each of its 512-byte sectors
//!   independently lands or keeps its old contents;
//! - optionally one landed sector of the torn write gets a flipped bit.
//!
//! This is the fault model of docs/semantics.md, and the crash harness
//! (`sim.rs`, with the `testing` feature) runs the real engine against it
//! under thousands of seeds.
//!
//! Reusing a segment either erases it, as flash does, or overwrites it in
//! place, as a file does ([`MemMedia::reusing_in_place`]); in place, the
//! medium also has staging (sector writes and staging slots, see
//! `Media::staging`), whose writes are lost and torn like any other.

use std::sync::Mutex;

use rand::Rng;

use super::{
    check_read_range, Media, MediaGeometry, PageDiscipline, Staging, SECTOR_BYTES, STAGING_SLOTS,
    STAGING_SLOT_BYTES,
};
use crate::error::{Error, Result};
use crate::units::{PageIndex, SegmentId};

/// Sector size at which pending writes tear.
pub const TEAR_SECTOR_BYTES: usize = SECTOR_BYTES;

/// How hard a simulated power cut hits the pending operations.
#[derive(Debug, Clone, Copy)]
pub struct CrashConfig {
    /// Probability that a pending operation survives.
    pub keep_probability: f64,
    /// Tear one surviving write at sector granularity.
    pub tear: bool,
    /// Flip one bit in one sector of the torn write.
    pub flip_bit: bool,
}

impl Default for CrashConfig {
    fn default() -> Self {
        CrashConfig {
            keep_probability: 0.5,
            tear: true,
            flip_bit: false,
        }
    }
}

#[derive(Clone)]
struct Image {
    /// Segment contents; an empty vector reads as zeros.
    segments: Vec<Vec<u8>>,
    meta: [Vec<u8>; 2],
    staging: Vec<Vec<u8>>,
}

impl Image {
    fn new(geometry: &MediaGeometry) -> Self {
        Image {
            segments: vec![Vec::new(); geometry.segment_count as usize],
            meta: [Vec::new(), Vec::new()],
            staging: vec![vec![0u8; STAGING_SLOT_BYTES]; STAGING_SLOTS],
        }
    }

    fn write(&mut self, geometry: &MediaGeometry, segment: SegmentId, offset: usize, data: &[u8]) {
        let bytes = &mut self.segments[segment.index()];
        if bytes.is_empty() {
            bytes.resize(geometry.segment_size_bytes as usize, 0);
        }
        bytes[offset..offset + data.len()].copy_from_slice(data);
    }

    fn apply(&mut self, geometry: &MediaGeometry, op: &Pending) {
        match op {
            Pending::Pages {
                segment,
                offset,
                data,
            } => self.write(geometry, *segment, *offset, data),
            Pending::Erase { segment } => self.segments[segment.index()] = Vec::new(),
            Pending::Meta { slot, data } => self.meta[*slot] = data.clone(),
            Pending::Staging { slot, data } => {
                self.staging[*slot][..data.len()].copy_from_slice(data)
            }
        }
    }

    /// The bytes `op` would replace.
    fn overwritten(&self, op: &Pending) -> Vec<u8> {
        match op {
            Pending::Pages {
                segment,
                offset,
                data,
            } => {
                let current = &self.segments[segment.index()];
                if current.is_empty() {
                    vec![0u8; data.len()]
                } else {
                    current[*offset..*offset + data.len()].to_vec()
                }
            }
            Pending::Meta { slot, data } => {
                let mut old = self.meta[*slot].clone();
                old.resize(data.len(), 0);
                old
            }
            Pending::Staging { slot, data } => self.staging[*slot][..data.len()].to_vec(),
            Pending::Erase { .. } => unreachable!("erases are not torn"),
        }
    }
}

#[derive(Clone)]
enum Pending {
    Pages {
        segment: SegmentId,
        offset: usize,
        data: Vec<u8>,
    },
    Erase {
        segment: SegmentId,
    },
    Meta {
        slot: usize,
        data: Vec<u8>,
    },
    Staging {
        slot: usize,
        data: Vec<u8>,
    },
}

impl Pending {
    /// The bytes a write writes.
    fn data(&self) -> &[u8] {
        match self {
            Pending::Pages { data, .. }
            | Pending::Meta { data, .. }
            | Pending::Staging { data, .. } => data,
            Pending::Erase { .. } => unreachable!("an erase writes no bytes"),
        }
    }

    /// The same write with other bytes (a torn version of it).
    fn with_data(&self, data: Vec<u8>) -> Pending {
        match self {
            Pending::Pages {
                segment, offset, ..
            } => Pending::Pages {
                segment: *segment,
                offset: *offset,
                data,
            },
            Pending::Meta { slot, .. } => Pending::Meta { slot: *slot, data },
            Pending::Staging { slot, .. } => Pending::Staging { slot: *slot, data },
            Pending::Erase { .. } => unreachable!("erases are not torn"),
        }
    }
}

struct State {
    live: Image,
    durable: Image,
    pending: Vec<Pending>,
    syncs: u64,
    fail_writes: bool,
    /// Mutating operations left before `fail_writes` switches on.
    fail_after: Option<u64>,
}

/// A RAM medium with optional power-loss simulation.
pub struct MemMedia {
    geometry: MediaGeometry,
    state: Mutex<State>,
    discipline: PageDiscipline,
    /// Reuse overwrites in place, leaving the old incarnation's bytes past
    /// the new one's, as a file or block device does; otherwise reuse
    /// erases, as flash does.
    reuse_in_place: bool,
}

impl MemMedia {
    pub fn new(geometry: MediaGeometry) -> Result<MemMedia> {
        geometry.validate()?;
        Ok(MemMedia {
            state: Mutex::new(State {
                live: Image::new(&geometry),
                durable: Image::new(&geometry),
                pending: Vec::new(),
                syncs: 0,
                fail_writes: false,
                fail_after: None,
            }),
            discipline: PageDiscipline::new(&geometry),
            geometry,
            reuse_in_place: false,
        })
    }

    /// Makes segment reuse overwrite in place instead of erasing, as on a
    /// file: stale records of older incarnations stay behind.
    pub fn reusing_in_place(mut self) -> MemMedia {
        self.reuse_in_place = true;
        self
    }

    /// A small geometry for tests: `segment_count` segments of `segment_size_bytes`.
    pub fn with_size(
        page_size_bytes: u32,
        segment_size_bytes: u64,
        segment_count: u32,
    ) -> Result<MemMedia> {
        MemMedia::new(MediaGeometry {
            page_size_bytes,
            segment_size_bytes,
            segment_count,
            meta_slot_size_bytes: 256 * 1024,
        })
    }

    /// Number of `sync` calls so far.
    pub fn sync_count(&self) -> u64 {
        self.state.lock().expect("media lock").syncs
    }

    /// Makes every later write fail with an I/O error (or succeed again).
    pub fn set_fail_writes(&self, fail: bool) {
        self.state.lock().expect("media lock").fail_writes = fail;
    }

    /// Lets `operations` more writes, erases, syncs and metadata writes
    /// through, then fails every later one: a power cut in the middle of
    /// whatever the engine is doing.
    pub fn set_fail_after(&self, operations: u64) {
        self.state.lock().expect("media lock").fail_after = Some(operations);
    }

    /// Number of operations that a crash now could lose.
    pub fn pending_count(&self) -> usize {
        self.state.lock().expect("media lock").pending.len()
    }

    /// Flips one bit of the live and durable images (simulated bit rot).
    pub fn corrupt(&self, segment: SegmentId, offset: usize, bit: u8) {
        let mut guard = self.state.lock().expect("media lock");
        let state = &mut *guard;
        for image in [&mut state.live, &mut state.durable] {
            let bytes = &mut image.segments[segment.index()];
            if bytes.is_empty() {
                bytes.resize(self.geometry.segment_size_bytes as usize, 0);
            }
            bytes[offset] ^= 1 << (bit % 8);
        }
    }

    /// Flips one bit of a metadata slot in the live and durable images.
    pub fn corrupt_meta(&self, slot: usize, offset: usize, bit: u8) {
        let mut guard = self.state.lock().expect("media lock");
        let state = &mut *guard;
        for image in [&mut state.live, &mut state.durable] {
            let bytes = &mut image.meta[slot];
            if bytes.len() <= offset {
                bytes.resize(offset + 1, 0);
            }
            bytes[offset] ^= 1 << (bit % 8);
        }
    }

    /// The medium a restart after a power cut now would find.
    pub fn crash<R: Rng>(&self, rng: &mut R, config: CrashConfig) -> MemMedia {
        let state = self.state.lock().expect("media lock");
        let mut image = state.durable.clone();
        let survivors: Vec<&Pending> = state
            .pending
            .iter()
            .filter(|_| rng.gen_bool(config.keep_probability))
            .collect();
        let page_writes: Vec<usize> = survivors
            .iter()
            .enumerate()
            .filter(|(_, op)| !matches!(op, Pending::Erase { .. }))
            .map(|(index, _)| index)
            .collect();
        let torn = if config.tear && !page_writes.is_empty() {
            Some(page_writes[rng.gen_range(0..page_writes.len())])
        } else {
            None
        };
        for (index, op) in survivors.iter().enumerate() {
            if Some(index) != torn {
                image.apply(&self.geometry, op);
                continue;
            }
            let mut mixed = image.overwritten(op);
            let mut landed = Vec::new();
            for (sector, chunk) in op.data().chunks(TEAR_SECTOR_BYTES).enumerate() {
                if rng.gen_bool(0.5) {
                    let start = sector * TEAR_SECTOR_BYTES;
                    mixed[start..start + chunk.len()].copy_from_slice(chunk);
                    landed.push(start..start + chunk.len());
                }
            }
            if config.flip_bit && !landed.is_empty() {
                let range = landed[rng.gen_range(0..landed.len())].clone();
                let at = rng.gen_range(range);
                mixed[at] ^= 1 << rng.gen_range(0..8);
            }
            image.apply(&self.geometry, &op.with_data(mixed));
        }
        self.restarted(image)
    }

    /// The medium a restart finds after a power cut during the last write:
    /// every earlier pending operation survives, and the last write lands
    /// torn, the worst way: its first sector with a flipped bit, nothing
    /// else. For regression tests that need that exact tear.
    pub fn crash_tearing_last(&self) -> MemMedia {
        let state = self.state.lock().expect("media lock");
        let mut image = state.durable.clone();
        let (last, earlier) = state.pending.split_last().expect("a pending write to tear");
        earlier
            .iter()
            .for_each(|op| image.apply(&self.geometry, op));
        let mut torn = image.overwritten(last);
        let data = last.data();
        let sector = TEAR_SECTOR_BYTES.min(data.len());
        torn[..sector].copy_from_slice(&data[..sector]);
        torn[0] ^= 0x10;
        image.apply(&self.geometry, &last.with_data(torn));
        self.restarted(image)
    }

    /// A medium whose live and durable contents are `image`, as after a restart.
    fn restarted(&self, image: Image) -> MemMedia {
        MemMedia {
            state: Mutex::new(State {
                live: image.clone(),
                durable: image,
                pending: Vec::new(),
                syncs: 0,
                fail_writes: false,
                fail_after: None,
            }),
            discipline: PageDiscipline::new(&self.geometry),
            geometry: self.geometry,
            reuse_in_place: self.reuse_in_place,
        }
    }

    /// The medium a clean restart would find (everything written survives).
    pub fn reopen(&self) -> MemMedia {
        let live = self.state.lock().expect("media lock").live.clone();
        self.restarted(live)
    }

    /// Writes `data` at `offset` of `segment` in the live image, as pending
    /// operations of at most a page each: a power cut may keep any subset.
    fn write_pending(&self, state: &mut State, segment: SegmentId, offset: usize, data: &[u8]) {
        state.live.write(&self.geometry, segment, offset, data);
        let page = self.geometry.page_size_bytes as usize;
        for (index, chunk) in data.chunks(page).enumerate() {
            state.pending.push(Pending::Pages {
                segment,
                offset: offset + index * page,
                data: chunk.to_vec(),
            });
        }
    }

    fn check_writable(state: &mut State) -> Result<()> {
        if let Some(left) = state.fail_after {
            match left.checked_sub(1) {
                Some(left) => state.fail_after = Some(left),
                None => state.fail_writes = true,
            }
        }
        if state.fail_writes {
            return Err(Error::io(
                "writing to the simulated medium",
                std::io::Error::other("injected write failure"),
            ));
        }
        Ok(())
    }
}

impl Media for MemMedia {
    fn geometry(&self) -> MediaGeometry {
        self.geometry
    }

    fn physical_size_bytes(&self) -> u64 {
        self.geometry.log_capacity_bytes() + 2 * self.geometry.meta_slot_size_bytes as u64
    }

    fn write_pages(&self, segment: SegmentId, first_page: PageIndex, data: &[u8]) -> Result<()> {
        let mut state = self.state.lock().expect("media lock");
        Self::check_writable(&mut state)?;
        self.discipline.on_write(segment, first_page, data.len());
        let offset = first_page.0 as usize * self.geometry.page_size_bytes as usize;
        self.write_pending(&mut state, segment, offset, data);
        Ok(())
    }

    fn staging(&self) -> Option<&dyn Staging> {
        self.reuse_in_place.then_some(self as &dyn Staging)
    }

    fn read(&self, segment: SegmentId, offset_bytes: u64, buf: &mut [u8]) -> Result<()> {
        check_read_range(&self.geometry, segment, offset_bytes, buf.len())?;
        let state = self.state.lock().expect("media lock");
        let bytes = &state.live.segments[segment.index()];
        if bytes.is_empty() {
            buf.fill(0);
        } else {
            let start = offset_bytes as usize;
            buf.copy_from_slice(&bytes[start..start + buf.len()]);
        }
        Ok(())
    }

    fn erase_segment(&self, segment: SegmentId) -> Result<()> {
        let mut state = self.state.lock().expect("media lock");
        Self::check_writable(&mut state)?;
        state.live.segments[segment.index()] = Vec::new();
        state.pending.push(Pending::Erase { segment });
        self.discipline.on_erase(segment);
        Ok(())
    }

    fn prepare_segment(&self, segment: SegmentId) -> Result<()> {
        if !self.reuse_in_place {
            return self.erase_segment(segment);
        }
        Self::check_writable(&mut self.state.lock().expect("media lock"))?;
        self.discipline.on_erase(segment);
        Ok(())
    }

    fn sync(&self) -> Result<()> {
        let mut state = self.state.lock().expect("media lock");
        Self::check_writable(&mut state)?;
        let pending = std::mem::take(&mut state.pending);
        for op in &pending {
            state.durable.apply(&self.geometry, op);
        }
        state.syncs += 1;
        Ok(())
    }

    fn write_meta_slot(&self, slot: usize, data: &[u8]) -> Result<()> {
        assert!(slot < 2, "metadata slot {slot} does not exist");
        assert!(data.len() <= self.geometry.meta_slot_size_bytes as usize);
        let mut state = self.state.lock().expect("media lock");
        Self::check_writable(&mut state)?;
        state.live.meta[slot] = data.to_vec();
        state.pending.push(Pending::Meta {
            slot,
            data: data.to_vec(),
        });
        Ok(())
    }

    fn read_meta_slot(&self, slot: usize) -> Result<Vec<u8>> {
        assert!(slot < 2, "metadata slot {slot} does not exist");
        let state = self.state.lock().expect("media lock");
        let mut bytes = state.live.meta[slot].clone();
        bytes.resize(self.geometry.meta_slot_size_bytes as usize, 0);
        Ok(bytes)
    }

    fn describe(&self) -> String {
        format!(
            "memory ({} segments of {} bytes)",
            self.geometry.segment_count, self.geometry.segment_size_bytes
        )
    }
}

impl Staging for MemMedia {
    fn write_sectors(&self, segment: SegmentId, offset_bytes: u64, data: &[u8]) -> Result<()> {
        assert!(self.reuse_in_place, "sector writes on flash");
        let mut state = self.state.lock().expect("media lock");
        Self::check_writable(&mut state)?;
        self.discipline
            .on_write_sectors(segment, offset_bytes, data.len());
        self.write_pending(&mut state, segment, offset_bytes as usize, data);
        Ok(())
    }

    fn restore_sectors(&self, segment: SegmentId, offset_bytes: u64, data: &[u8]) -> Result<()> {
        assert!(self.reuse_in_place, "sector writes on flash");
        assert!(
            offset_bytes.is_multiple_of(SECTOR_BYTES as u64)
                && data.len().is_multiple_of(SECTOR_BYTES),
            "restoring part of a sector"
        );
        let mut state = self.state.lock().expect("media lock");
        Self::check_writable(&mut state)?;
        self.write_pending(&mut state, segment, offset_bytes as usize, data);
        Ok(())
    }

    fn write_staging(&self, slot: usize, data: &[u8]) -> Result<()> {
        assert!(self.reuse_in_place, "staging on flash");
        assert!(slot < STAGING_SLOTS, "staging slot {slot} does not exist");
        assert!(
            data.len() <= STAGING_SLOT_BYTES && data.len().is_multiple_of(SECTOR_BYTES),
            "staging write of {} bytes",
            data.len()
        );
        let mut state = self.state.lock().expect("media lock");
        Self::check_writable(&mut state)?;
        let op = Pending::Staging {
            slot,
            data: data.to_vec(),
        };
        state.live.apply(&self.geometry, &op);
        state.pending.push(op);
        Ok(())
    }

    fn read_staging(&self, slot: usize) -> Result<Vec<u8>> {
        assert!(slot < STAGING_SLOTS, "staging slot {slot} does not exist");
        Ok(self.state.lock().expect("media lock").live.staging[slot].clone())
    }
}
