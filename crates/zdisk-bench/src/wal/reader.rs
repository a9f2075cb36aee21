//! Recovery: finding every commit the log holds, from its anchor on.
//!
//! The reader starts where the newest intact anchor says the live log
//! starts, expecting its sequence number and chain CRC, and looks for each
//! next commit where a writer could have put it: right after the previous
//! one, at the next block (sparse: a flush starts a fresh block), or at the
//! start of the next lap (a record never crosses the end of the ring). It
//! takes the first place holding an intact record with the expected
//! sequence number that follows the previous commit (the chained CRC), and
//! stops where none does. Since a record is written in one place only and
//! its CRC covers its predecessor's, the candidates can never disagree:
//! zeros, trimmed blocks, stale records of earlier laps or of a crashed
//! writer, and torn records all fail.

use super::device::{device_op, DeviceOp, LogDevice, WalError};
use super::format::{
    decode_header, round_up, verify_record, Anchor, Layout, Ring, ANCHOR_SLOTS, BLOCK_BYTES,
    RECORD_HEADER_BYTES,
};

/// Bytes the reader asks the device for at once.
const WINDOW_BYTES: u64 = 64 * 1024;

/// One commit found in the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit {
    pub seq: u64,
    /// Log position of its record (see `format.rs`).
    pub position: u64,
    pub epoch: u32,
    pub payload: Vec<u8>,
}

/// What a scan of the log found.
#[derive(Debug, Clone)]
pub struct Recovered {
    /// The anchor the scan started from (the newest intact one).
    pub anchor: Anchor,
    /// Every commit from the anchor's start on, in sequence order.
    pub commits: Vec<Commit>,
    /// Position just after the last commit (the anchor's start if none).
    pub end_position: u64,
    /// CRC of the last commit (the anchor's chain CRC if none).
    pub last_crc: u32,
}

impl Recovered {
    /// Sequence number of the last commit found, or the one before the
    /// anchor's start if none was.
    pub fn last_seq(&self) -> u64 {
        self.commits
            .last()
            .map_or(self.anchor.start_seq - 1, |c| c.seq)
    }
}

/// The newest intact anchor of the log at `base_offset`.
pub fn read_anchor<D: LogDevice>(device: &mut D, base_offset: u64) -> Result<Anchor, WalError> {
    let mut slots = vec![0u8; (ANCHOR_SLOTS * BLOCK_BYTES) as usize];
    let len = slots.len() as u64;
    device_op(
        DeviceOp::Read,
        base_offset,
        len,
        device.read_at(base_offset, &mut slots),
    )?;
    slots
        .chunks(BLOCK_BYTES as usize)
        .filter_map(Anchor::decode)
        .max_by_key(|anchor| anchor.generation)
        .ok_or(WalError::NoAnchor { base_offset })
}

/// Scans the log at `base_offset` and returns every commit it holds.
pub fn read_log<D: LogDevice>(device: &mut D, base_offset: u64) -> Result<Recovered, WalError> {
    let anchor = read_anchor(device, base_offset)?;
    let ring = Ring::new(base_offset, anchor.area_bytes);
    let room = device.size_bytes().saturating_sub(base_offset);
    if ring.device_bytes() > room {
        return Err(WalError::DoesNotFit {
            needed_bytes: ring.device_bytes(),
            room_bytes: room,
        });
    }
    let mut window = Window::default();
    let mut commits = Vec::new();
    let mut position = anchor.start_position;
    let mut seq = anchor.start_seq;
    let mut crc = anchor.chain_crc;
    // Live commits span at most one lap: a bound, not an expectation.
    while position - anchor.start_position <= ring.area_bytes {
        let mut found = None;
        for candidate in candidates(&ring, anchor.layout, position) {
            if let Some(commit) = window.commit_at(device, &ring, candidate, seq, crc)? {
                found = Some(commit);
                break;
            }
        }
        let Some((commit, commit_crc)) = found else {
            break;
        };
        position = commit.position + (RECORD_HEADER_BYTES + commit.payload.len()) as u64;
        seq += 1;
        crc = commit_crc;
        commits.push(commit);
    }
    Ok(Recovered {
        anchor,
        commits,
        end_position: position,
        last_crc: crc,
    })
}

/// Where the commit after one ending at `position` may start, in order.
fn candidates(ring: &Ring, layout: Layout, position: u64) -> Vec<u64> {
    let mut places = vec![position];
    if layout == Layout::Sparse {
        places.push(round_up(position, BLOCK_BYTES));
    }
    places.push(round_up(position, ring.area_bytes));
    places.dedup();
    places
}

/// The part of the ring last read, so that a scan reads each block once.
#[derive(Default)]
struct Window {
    position: u64,
    bytes: Vec<u8>,
}

impl Window {
    /// `len` bytes at `position`, which must not cross the end of a lap.
    fn get<D: LogDevice>(
        &mut self,
        device: &mut D,
        ring: &Ring,
        position: u64,
        len: u64,
    ) -> Result<&[u8], WalError> {
        assert!(len <= ring.left_in_lap(position), "a read crosses a lap");
        let end = self.position + self.bytes.len() as u64;
        if position < self.position || position + len > end {
            let from = position / BLOCK_BYTES * BLOCK_BYTES;
            let want = WINDOW_BYTES
                .max(round_up(position + len, BLOCK_BYTES) - from)
                .min(ring.left_in_lap(from));
            self.bytes.resize(want as usize, 0);
            let offset = ring.device_offset(from);
            device_op(
                DeviceOp::Read,
                offset,
                want,
                device.read_at(offset, &mut self.bytes),
            )?;
            self.position = from;
        }
        let at = (position - self.position) as usize;
        Ok(&self.bytes[at..at + len as usize])
    }

    /// The commit `seq` at `position`, if an intact one that follows the
    /// commit whose CRC is `prev_crc` is there; with its CRC.
    fn commit_at<D: LogDevice>(
        &mut self,
        device: &mut D,
        ring: &Ring,
        position: u64,
        seq: u64,
        prev_crc: u32,
    ) -> Result<Option<(Commit, u32)>, WalError> {
        let left = ring.left_in_lap(position);
        if left < RECORD_HEADER_BYTES as u64 {
            return Ok(None);
        }
        let head = self.get(device, ring, position, RECORD_HEADER_BYTES as u64)?;
        let Some(header) = decode_header(head) else {
            return Ok(None);
        };
        if header.seq != seq || header.record_bytes() > left {
            return Ok(None);
        }
        let record = self.get(device, ring, position, header.record_bytes())?;
        if !verify_record(record, prev_crc) {
            return Ok(None);
        }
        let commit = Commit {
            seq,
            position,
            epoch: header.epoch,
            payload: record[RECORD_HEADER_BYTES..].to_vec(),
        };
        Ok(Some((commit, header.crc)))
    }
}
