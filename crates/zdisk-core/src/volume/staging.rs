//! Staging: how a flush on a medium that is not flash keeps its partial
//! last sector durable without padding, and how recovery gets it back.
//!
//! On a medium with staging (`Media::staging`: a file, a block device,
//! RAM overwriting in place) a stream writes its segment in 512-byte
//! sectors, in order and each once. A barrier writes every complete sector
//! in place; what is left, less than a sector of records, goes into a
//! staging slot instead of being padded, and stays in the stream's buffer
//! until the sector fills and is written in place like the others. So a
//! flush writes the bytes that are new, rounded out to sectors, plus one or
//! two sectors of staging.
//!
//! Each stream has two staging slots and a flush writes one of them, never
//! the one holding the newest staging a completed sync covered
//! ([`StagingSlots::slot_for`]). A torn staging write, or one that never
//! lands, therefore leaves the other slot with everything the last
//! completed flush staged. No segment sector that holds flushed records is
//! ever written again either: sectors are written once, and the partial
//! one is written in place only when it is complete, while its flushed
//! prefix is still safe in the protected slot.
//!
//! Recovery ([`recover_staged`]) reads every slot and lays each valid
//! staging record back over its segment, if the root it recovers from
//! would replay that incarnation and the segment holds no record of a
//! newer one. Staged bytes are always a true prefix of their sector's
//! final contents (records are only appended), so laying an old staging of
//! the same incarnation over a sector written whole later changes nothing,
//! and one of an incarnation the segment has since been reused for is
//! refused. A writable recovery then writes the laid-over sectors back in
//! place and syncs, before this run's flushes may reuse the slots; a
//! read-only one serves them from RAM ([`Overlaid`]).
//!
//! A staging record (docs/format.md has the layout) names its segment, its
//! full incarnation number and its sector's offset, and its CRC32C is keyed
//! with the volume's UUID like a log record's, so a slot written for
//! another volume, or torn, never decodes.

use std::collections::HashSet;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::media::{
    Admission, DriveModel, Media, MediaGeometry, ReadRange, SECTOR_BYTES, STAGING_SLOTS,
};
use crate::meta::RetainedRoot;
use crate::record::{decode_record, RecordKey, HEADER_SIZE, RECORD_ALIGN};
use crate::units::{PageIndex, SegmentId};

/// "ZSTG": the first bytes of a staging record.
const STAGED_MAGIC: [u8; 4] = *b"ZSTG";
/// Bytes of a staging record's header; the data follows it.
pub(crate) const STAGED_HEADER_BYTES: usize = 32;

/// Slots per stream: the one being written and the one kept.
const SLOTS_PER_STREAM: usize = 2;

/// The start of a segment sector that a flush staged: `data` goes at
/// `offset_bytes` of incarnation `seq` of `segment`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Staged {
    pub segment: SegmentId,
    pub seq: u64,
    /// A sector multiple.
    pub offset_bytes: u64,
    /// 1 to 511 bytes.
    pub data: Vec<u8>,
}

impl Staged {
    /// The staging record, whole sectors.
    pub(crate) fn encode(&self, key: &RecordKey) -> Vec<u8> {
        assert!(
            !self.data.is_empty() && self.data.len() < SECTOR_BYTES,
            "staging {} bytes: a partial sector has 1 to {} bytes",
            self.data.len(),
            SECTOR_BYTES - 1
        );
        assert!(
            self.offset_bytes.is_multiple_of(SECTOR_BYTES as u64),
            "staging at offset {}, not a sector start",
            self.offset_bytes
        );
        let len = (STAGED_HEADER_BYTES + self.data.len()).div_ceil(SECTOR_BYTES) * SECTOR_BYTES;
        let mut out = vec![0u8; len];
        out[0..4].copy_from_slice(&STAGED_MAGIC);
        out[4..8].copy_from_slice(&self.segment.0.to_le_bytes());
        out[8..16].copy_from_slice(&self.seq.to_le_bytes());
        out[16..20].copy_from_slice(&(self.offset_bytes as u32).to_le_bytes());
        out[20..22].copy_from_slice(&(self.data.len() as u16).to_le_bytes());
        let crc = staged_crc(&self.data, &out[..24], key);
        out[24..28].copy_from_slice(&crc.to_le_bytes());
        out[STAGED_HEADER_BYTES..STAGED_HEADER_BYTES + self.data.len()].copy_from_slice(&self.data);
        debug_assert_eq!(Staged::decode(&out, key).as_ref(), Some(self));
        out
    }

    /// Decodes a staging slot; `None` for anything but an intact staging
    /// record of this volume (never written, torn, or another volume's).
    pub(crate) fn decode(bytes: &[u8], key: &RecordKey) -> Option<Staged> {
        let header = bytes.get(..STAGED_HEADER_BYTES)?;
        let reserved_zero = header[22..24] == [0; 2] && header[28..32] == [0; 4];
        if header[0..4] != STAGED_MAGIC || !reserved_zero {
            return None;
        }
        let word = |at: usize| u32::from_le_bytes(header[at..at + 4].try_into().expect("4 bytes"));
        let len = u16::from_le_bytes([header[20], header[21]]) as usize;
        let offset_bytes = word(16) as u64;
        if len == 0 || len >= SECTOR_BYTES || !offset_bytes.is_multiple_of(SECTOR_BYTES as u64) {
            return None;
        }
        let data = bytes.get(STAGED_HEADER_BYTES..STAGED_HEADER_BYTES + len)?;
        if staged_crc(data, &header[..24], key) != word(24) {
            return None;
        }
        Some(Staged {
            segment: SegmentId(word(4)),
            seq: u64::from_le_bytes(header[8..16].try_into().expect("8 bytes")),
            offset_bytes,
            data: data.to_vec(),
        })
    }

    fn end_offset(&self) -> u64 {
        self.offset_bytes + self.data.len() as u64
    }
}

/// CRC32C over the data, continued over header bytes 0..24 and the key
/// (as a record's: see `record::record_crc`).
fn staged_crc(data: &[u8], header: &[u8], key: &RecordKey) -> u32 {
    let crc = crc32c::crc32c_append(crc32c::crc32c(data), header);
    crc32c::crc32c_append(crc, &key.0)
}

/// What one stream's two slots hold.
#[derive(Debug, Default, Clone, Copy)]
struct StreamSlots {
    /// Per slot: the barrier generation that last wrote it (0: not this run).
    written_gen: [u64; SLOTS_PER_STREAM],
    /// The last staging written: (segment, offset, length).
    last: Option<(SegmentId, u64, usize)>,
}

/// Which staging slot each stream's next flush writes. Lives in `State`.
#[derive(Debug, Default)]
pub(crate) struct StagingSlots {
    streams: [StreamSlots; 2],
    /// Highest barrier generation a sync covered.
    synced_gen: u64,
}

impl StagingSlots {
    /// The medium's slot a flush of stream `stream` writes now: not the
    /// one holding the newest staging a completed sync covered, which is
    /// what recovery needs if this write tears.
    pub(crate) fn slot_for(&self, stream: usize) -> usize {
        let slots = &self.streams[stream];
        let kept = (0..SLOTS_PER_STREAM)
            .filter(|&a| slots.written_gen[a] != 0 && slots.written_gen[a] <= self.synced_gen)
            .max_by_key(|&a| slots.written_gen[a]);
        let write = kept.map_or(0, |kept| 1 - kept);
        stream * SLOTS_PER_STREAM + write
    }

    /// True if the last staging of `stream` holds exactly these bytes
    /// (nothing was appended since): a flush need not stage them again.
    pub(crate) fn holds(&self, stream: usize, segment: SegmentId, offset: u64, len: usize) -> bool {
        self.streams[stream].last == Some((segment, offset, len))
    }

    /// `slot` was written for barrier generation `gen`.
    pub(crate) fn note_written(&mut self, slot: usize, gen: u64, staged: &Staged) {
        let slots = &mut self.streams[slot / SLOTS_PER_STREAM];
        debug_assert!(gen > self.synced_gen, "staging for a synced barrier");
        slots.written_gen[slot % SLOTS_PER_STREAM] = gen;
        slots.last = Some((staged.segment, staged.offset_bytes, staged.data.len()));
    }

    /// Barrier generation `gen` is durable.
    pub(crate) fn note_synced(&mut self, gen: u64) {
        self.synced_gen = self.synced_gen.max(gen);
    }
}

/// The staged sectors recovery from `root` lays over the segments: every
/// intact staging record of an incarnation `root` replays whose bytes are
/// not in place already, unless its segment, with the newer stagings laid
/// over, holds a record of a newer incarnation (it was reused since, so
/// what was staged was written in place long before), or is one of the
/// `dumps`. Of two stagings of one sector, the newer incarnation's, and
/// of one incarnation's two, the longer.
///
/// Newer incarnations are judged first and laid over before older ones
/// are judged, since the records that prove a segment was reused may end
/// in the newer incarnation's own staged sector.
pub(crate) fn recover_staged(
    media: &dyn Media,
    key: &RecordKey,
    root: &RetainedRoot,
    dumps: &HashSet<SegmentId>,
) -> Result<Vec<Staged>> {
    let Some(staging) = media.staging() else {
        return Ok(Vec::new());
    };
    let geometry = media.geometry();
    let mut found: Vec<Staged> = Vec::new();
    for slot in 0..STAGING_SLOTS {
        let Some(staged) = Staged::decode(&staging.read_staging(slot)?, key) else {
            continue;
        };
        let inside = staged.segment.0 < geometry.segment_count
            && staged.offset_bytes + SECTOR_BYTES as u64 <= geometry.segment_size_bytes;
        if !inside || dumps.contains(&staged.segment) || !root.replays(staged.segment, staged.seq) {
            continue;
        }
        let same_sector = found.iter().position(|other| {
            other.segment == staged.segment && other.offset_bytes == staged.offset_bytes
        });
        // The newer incarnation's copy wins: an older one's bytes there
        // were overwritten when the segment was reused, however long they
        // are. Of one incarnation's two, the longer (bytes are appended).
        match same_sector {
            Some(at) if (found[at].seq, found[at].data.len()) < (staged.seq, staged.data.len()) => {
                found[at] = staged
            }
            Some(_) => {}
            None => found.push(staged),
        }
    }
    found.sort_by_key(|s| (s.segment, std::cmp::Reverse(s.seq), s.offset_bytes));
    let mut view = vec![0u8; geometry.segment_size_bytes as usize];
    let mut viewed = None;
    let mut kept = Vec::with_capacity(found.len());
    for staged in found {
        if viewed != Some(staged.segment) {
            media.read(staged.segment, 0, &mut view)?;
            viewed = Some(staged.segment);
        }
        let range = staged.offset_bytes as usize..staged.end_offset() as usize;
        if view[range.clone()] != staged.data[..]
            && !holds_newer_incarnation(&view, staged.seq as u32, key)
        {
            view[range].copy_from_slice(&staged.data);
            kept.push(staged);
        }
    }
    Ok(kept)
}

/// True if `bytes` (a whole segment) hold a valid record of an incarnation
/// numbered after `seq32` (modulo 2^32, as everywhere seq32 is compared).
fn holds_newer_incarnation(bytes: &[u8], seq32: u32, key: &RecordKey) -> bool {
    (0..bytes.len().saturating_sub(HEADER_SIZE))
        .step_by(RECORD_ALIGN as usize)
        .filter_map(|at| decode_record(&bytes[at..], key, None).ok())
        .any(|(header, _)| (header.seg_seq.wrapping_sub(seq32) as i32) > 0)
}

/// Lays the staged bytes of `segment` over `buf`, which holds its bytes
/// from `offset`.
pub(crate) fn lay_over(staged: &[Staged], segment: SegmentId, offset: u64, buf: &mut [u8]) {
    let end = offset + buf.len() as u64;
    for staged in staged.iter().filter(|s| s.segment == segment) {
        let lo = staged.offset_bytes.max(offset);
        let hi = staged.end_offset().min(end);
        if lo < hi {
            buf[(lo - offset) as usize..(hi - offset) as usize].copy_from_slice(
                &staged.data
                    [(lo - staged.offset_bytes) as usize..(hi - staged.offset_bytes) as usize],
            );
        }
    }
}

/// A read-only view of a medium with the staged sectors recovery found
/// laid over it: what a read-only volume reads, since it may not write
/// them back. Every write is refused.
pub(crate) struct Overlaid {
    inner: Arc<dyn Media>,
    staged: Vec<Staged>,
}

impl Overlaid {
    /// `media` itself if nothing is staged, else `media` under `staged`.
    pub(crate) fn over(media: Arc<dyn Media>, staged: Vec<Staged>) -> Arc<dyn Media> {
        if staged.is_empty() {
            return media;
        }
        Arc::new(Overlaid {
            inner: media,
            staged,
        })
    }
}

impl Media for Overlaid {
    fn geometry(&self) -> MediaGeometry {
        self.inner.geometry()
    }

    fn physical_size_bytes(&self) -> u64 {
        self.inner.physical_size_bytes()
    }

    fn write_pages(&self, _: SegmentId, _: PageIndex, _: &[u8]) -> Result<()> {
        Err(Error::ReadOnly)
    }

    fn read(&self, segment: SegmentId, offset_bytes: u64, buf: &mut [u8]) -> Result<()> {
        self.inner.read(segment, offset_bytes, buf)?;
        lay_over(&self.staged, segment, offset_bytes, buf);
        Ok(())
    }

    fn read_batch(&self, reads: &mut [ReadRange<'_>]) -> Vec<Result<()>> {
        let results = self.inner.read_batch(reads);
        for (read, result) in reads.iter_mut().zip(&results) {
            if result.is_ok() {
                lay_over(&self.staged, read.segment, read.offset_bytes, read.buf);
            }
        }
        results
    }

    fn erase_segment(&self, _: SegmentId) -> Result<()> {
        Err(Error::ReadOnly)
    }

    fn sync(&self) -> Result<()> {
        Ok(())
    }

    fn write_meta_slot(&self, _: usize, _: &[u8]) -> Result<()> {
        Err(Error::ReadOnly)
    }

    fn read_meta_slot(&self, slot: usize) -> Result<Vec<u8>> {
        self.inner.read_meta_slot(slot)
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn drive(&self) -> Option<&dyn DriveModel> {
        self.inner.drive()
    }

    fn admission(&self) -> Option<&dyn Admission> {
        self.inner.admission()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::media::{Staging, STAGING_SLOT_BYTES};

    const KEY: RecordKey = RecordKey([9; 16]);

    fn staged(len: usize) -> Staged {
        Staged {
            segment: SegmentId(3),
            seq: (7 << 32) | 12,
            offset_bytes: 5 * 512,
            data: (0..len).map(|i| i as u8 ^ 0x5A).collect(),
        }
    }

    #[test]
    fn staging_records_round_trip_and_any_damage_is_refused() {
        for len in [1, 100, 480, 481, 511] {
            let bytes = staged(len).encode(&KEY);
            let sectors = if len <= SECTOR_BYTES - STAGED_HEADER_BYTES {
                1
            } else {
                2
            };
            assert_eq!(bytes.len(), sectors * SECTOR_BYTES);
            assert!(bytes.len() <= STAGING_SLOT_BYTES);
            let mut slot = bytes.clone();
            slot.resize(STAGING_SLOT_BYTES, 0xEE);
            assert_eq!(Staged::decode(&slot, &KEY), Some(staged(len)));
            assert_eq!(Staged::decode(&bytes, &RecordKey([8; 16])), None);
            for at in 0..STAGED_HEADER_BYTES + len {
                let mut damaged = bytes.clone();
                damaged[at] ^= 0x04;
                assert_eq!(
                    Staged::decode(&damaged, &KEY),
                    None,
                    "flip at byte {at} of a {len}-byte staging went unnoticed"
                );
            }
        }
        assert_eq!(Staged::decode(&[0u8; STAGING_SLOT_BYTES], &KEY), None);
        assert_eq!(Staged::decode(&[], &KEY), None);
    }

    #[test]
    fn a_flush_never_writes_the_slot_a_completed_sync_keeps() {
        let mut slots = StagingSlots::default();
        let s = staged(10);
        // Nothing durable yet: either slot will do.
        assert_eq!(slots.slot_for(1), 2);
        slots.note_written(2, 1, &s);
        // Not synced: slot 2 may be written again, slot 3 too; the choice
        // stays on 2 while no staging is durable.
        assert_eq!(slots.slot_for(1), 2);
        slots.note_synced(1);
        assert_eq!(slots.slot_for(1), 3, "slot 2 holds the durable staging");
        slots.note_written(3, 2, &s);
        // Barrier 2 is not synced yet: slot 2 is still the one kept.
        assert_eq!(slots.slot_for(1), 3);
        slots.note_written(3, 3, &s);
        slots.note_synced(3);
        assert_eq!(
            slots.slot_for(1),
            2,
            "slot 3 now holds the newest durable one"
        );
        // The host stream's slots are its own.
        assert_eq!(slots.slot_for(0), 0);
        assert!(slots.holds(1, s.segment, s.offset_bytes, s.data.len()));
        assert!(!slots.holds(0, s.segment, s.offset_bytes, s.data.len()));
    }

    // --- The engine with staging: flushes, torn staging writes, crashes.

    use rand::rngs::SmallRng;
    use rand::{RngCore, SeedableRng};

    use crate::device::BlockDevice;
    use crate::media::MemMedia;
    use crate::units::{BLOCK_SIZE, BLOCK_SIZE_U64};
    use crate::volume::state::StreamKind;
    use crate::volume::{CreateOptions, OpenOptions, Volume};

    fn options(read_only: bool) -> OpenOptions {
        OpenOptions {
            background: false,
            read_only,
            ..OpenOptions::default()
        }
    }

    /// A volume on RAM that overwrites in place, so it has staging.
    fn staging_volume() -> (Arc<MemMedia>, Arc<Volume>) {
        let media = Arc::new(
            MemMedia::with_size(4096, 8 * 4096, 24)
                .unwrap()
                .reusing_in_place(),
        );
        let volume = Volume::create(
            media.clone() as Arc<dyn Media>,
            CreateOptions::new(64 * BLOCK_SIZE_U64),
            options(false),
        )
        .unwrap();
        (media, volume)
    }

    /// A block that compresses to a record of well under a sector.
    fn small(n: u8) -> Vec<u8> {
        let line = format!("staging test block {n}. ");
        line.bytes().cycle().take(BLOCK_SIZE).collect()
    }

    fn reads(volume: &Volume, lba: u64) -> Vec<u8> {
        let mut buf = vec![0u8; BLOCK_SIZE];
        volume.read(lba * BLOCK_SIZE_U64, &mut buf).unwrap();
        buf
    }

    fn reopen(media: MemMedia, read_only: bool) -> (Arc<MemMedia>, Arc<Volume>) {
        let media = Arc::new(media);
        let volume = Volume::open(media.clone() as Arc<dyn Media>, options(read_only)).unwrap();
        let report = volume.check(true).unwrap();
        assert!(report.is_clean(), "{report:?}");
        (media, volume)
    }

    /// Two flushes stage blocks 0 and 1 (their records share the open
    /// segment's first sector, so they live only in staging slots); the
    /// third flush's staging write tears, garbling the slot it writes, and
    /// the power fails before its sync. Both flushed blocks survive: the
    /// third flush wrote the other slot than the second's.
    #[test]
    fn a_torn_staging_write_keeps_what_the_last_completed_flush_staged() {
        let (media, volume) = staging_volume();
        for lba in 0..2 {
            volume
                .write(lba * BLOCK_SIZE_U64, &small(lba as u8), false)
                .unwrap();
            volume.flush().unwrap();
        }
        assert_eq!(volume.stats().padding_bytes, 0, "flushes stage, not pad");
        assert!(volume.stats().staging_bytes >= 2 * SECTOR_BYTES as u64);
        volume.write(2 * BLOCK_SIZE_U64, &small(2), false).unwrap();
        // The staging write goes through; the sync after it fails.
        let pending = media.pending_count();
        media.set_fail_after(1);
        assert!(volume.flush().is_err());
        assert_eq!(media.pending_count(), pending + 1, "one staging write");
        let (_media, volume) = reopen(media.crash_tearing_last(), false);
        assert_eq!(volume.open_report().staged_sectors, 1);
        assert_eq!(reads(&volume, 0), small(0));
        assert_eq!(reads(&volume, 1), small(1));
        let third = reads(&volume, 2);
        assert!(third == small(2) || third == vec![0u8; BLOCK_SIZE]);
    }

    /// A read-only open reads what only the staging slots hold; a writable
    /// one writes it back in place, so the slots may be reused at once.
    #[test]
    fn staged_sectors_are_read_from_ram_read_only_and_written_back_otherwise() {
        let (media, volume) = staging_volume();
        volume.write(0, &small(7), false).unwrap();
        volume.flush().unwrap();
        volume.halt();
        let (media, volume) = reopen(media.reopen(), true);
        assert_eq!(volume.open_report().staged_sectors, 1);
        assert_eq!(reads(&volume, 0), small(7));
        drop(volume);
        let (media, volume) = reopen(media.reopen(), false);
        assert_eq!(volume.open_report().staged_sectors, 1);
        assert_eq!(reads(&volume, 0), small(7));
        volume.halt();
        for slot in 0..STAGING_SLOTS {
            media.write_staging(slot, &[0u8; SECTOR_BYTES]).unwrap();
        }
        let (_media, volume) = reopen(media.reopen(), false);
        assert_eq!(volume.open_report().staged_sectors, 0);
        assert_eq!(reads(&volume, 0), small(7));
    }

    /// Writes block 0 (a record of about 2 KiB: its first sectors go in
    /// place, its end only into a staging slot) as the first record of the
    /// host stream's second incarnation of a segment: the first is filled
    /// (random fillers from `seed`) until block 0 no longer fits. Flushed;
    /// returns block 0.
    fn block_0_opens_an_incarnation(volume: &Volume, seed: u64) -> Vec<u8> {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut block = small(0);
        rng.fill_bytes(&mut block[..2000]);
        let room = || volume.lock().stream_room(StreamKind::Host);
        for lba in 10..64 {
            let mut filler = small(lba as u8);
            if lba == 10 || room() > 6 * 1024 {
                rng.fill_bytes(&mut filler);
            } else if room() < 2048 {
                break;
            }
            volume.write(lba * BLOCK_SIZE_U64, &filler, false).unwrap();
        }
        volume.flush().unwrap();
        volume.write(0, &block, false).unwrap();
        volume.flush().unwrap();
        block
    }

    /// A staging record of an older incarnation of a segment, which a root
    /// would still replay, is never laid over the newer incarnation, even
    /// when the records that show the segment was reused end in the newer
    /// incarnation's own staged sector (so the medium alone holds none
    /// that decodes).
    #[test]
    fn a_stale_staging_is_not_laid_over_a_reused_segment() {
        let (media, volume) = staging_volume();
        let block = block_0_opens_an_incarnation(&volume, 5);
        let (segment, seq, boundary) = {
            let state = volume.lock();
            let host = &state.streams()[0];
            (
                host.segment.unwrap(),
                host.seq,
                state.newest_root().boundary,
            )
        };
        assert!(seq > boundary, "an older incarnation the root replays");
        let location = volume.describe_block(0);
        assert!(
            location.contains(&format!("segment: SegmentId({}), offset: 0,", segment.0)),
            "block 0 is the first record of its incarnation: {location}"
        );
        let stale = Staged {
            segment,
            seq: seq - 1,
            offset_bytes: SECTOR_BYTES as u64,
            data: vec![0x5A; 96],
        };
        media
            .write_staging(3, &stale.encode(&volume.record_key))
            .unwrap();
        media.sync().unwrap();
        volume.halt();
        let (_media, volume) = reopen(media.reopen(), false);
        assert_eq!(volume.open_report().staged_sectors, 1, "only block 0's");
        assert_eq!(reads(&volume, 0), block);
    }

    /// Two stagings of the same sector, an older incarnation's longer than
    /// the newer one's: the newer one is laid over. (Keeping the longer
    /// one hid the newer staging, and with it the proof that the segment
    /// was reused, so the stale bytes went over a flushed record: the
    /// crash simulator's seed 248 with clones lost a flushed write so.)
    #[test]
    fn a_longer_stale_copy_of_the_same_sector_does_not_hide_the_newer_one() {
        let (media, volume) = staging_volume();
        let block = block_0_opens_an_incarnation(&volume, 6);
        let (segment, seq) = {
            let state = volume.lock();
            let host = &state.streams()[0];
            (host.segment.unwrap(), host.seq)
        };
        let newer = (0..STAGING_SLOTS)
            .filter_map(|slot| {
                Staged::decode(&media.read_staging(slot).unwrap(), &volume.record_key)
            })
            .find(|s| s.segment == segment && s.seq == seq)
            .expect("block 0's end is staged");
        assert!(newer.data.len() < SECTOR_BYTES - 1);
        let stale = Staged {
            segment,
            seq: seq - 1,
            offset_bytes: newer.offset_bytes,
            data: vec![0x5A; SECTOR_BYTES - 1],
        };
        media
            .write_staging(3, &stale.encode(&volume.record_key))
            .unwrap();
        media.sync().unwrap();
        volume.halt();
        let (_media, volume) = reopen(media.reopen(), false);
        assert_eq!(volume.open_report().staged_sectors, 1, "only block 0's");
        assert_eq!(reads(&volume, 0), block);
    }

    #[test]
    fn staged_bytes_are_laid_over_their_segment_only() {
        let s = staged(100);
        let mut buf = vec![0xFFu8; 1024];
        lay_over(std::slice::from_ref(&s), s.segment, 5 * 512 - 24, &mut buf);
        assert!(buf[..24].iter().all(|&b| b == 0xFF));
        assert_eq!(&buf[24..124], &s.data[..]);
        assert!(buf[124..].iter().all(|&b| b == 0xFF));
        let mut other = vec![0xFFu8; 1024];
        lay_over(std::slice::from_ref(&s), SegmentId(4), 5 * 512, &mut other);
        assert!(other.iter().all(|&b| b == 0xFF));
        let mut inside = vec![0u8; 10];
        lay_over(
            std::slice::from_ref(&s),
            s.segment,
            5 * 512 + 90,
            &mut inside,
        );
        assert_eq!(&inside, &s.data[90..100]);
    }
}
