//! The log writer: appending commits, flushing them, checkpointing.
//!
//! Appends are buffered; `flush` writes the blocks they touched (whole
//! blocks, zeros after the last commit) and then flushes the device, and a
//! commit is durable once the `flush` after it returns. How many commits
//! share a flush (group commit) is the caller's choice.
//!
//! Invariants:
//! - every byte of a block holding flushed commits is rewritten only with
//!   the same bytes (packed: the block's earlier commits are kept in the
//!   buffer), so a torn rewrite cannot lose a durable commit;
//! - nothing is written into a block at or after the anchor's start that
//!   is a lap ahead of it: commits not yet checkpointed are never
//!   overwritten ([`WalError::Full`] instead);
//! - a range is trimmed only after an anchor starting past it is durable.

use super::device::{device_op, DeviceOp, LogDevice, WalError};
use super::format::{
    encode_record, initial_chain_crc, round_up, Anchor, Layout, Ring, BLOCK_BYTES,
    RECORD_HEADER_BYTES,
};
use super::reader::{read_log, Recovered};

/// Where a new log goes and how it lays out commits.
#[derive(Debug, Clone, Copy)]
pub struct WalConfig {
    pub layout: Layout,
    /// Device offset of the log (block-aligned): two anchor blocks, then the ring.
    pub base_offset: u64,
    /// Bytes of the ring commits are written to (whole blocks).
    pub area_bytes: u64,
    /// Tells this log's records from those of any log here before it.
    pub log_id: u64,
}

/// What the writer has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WalCounters {
    pub commits: u64,
    /// Flushes that wrote something.
    pub flushes: u64,
    /// Bytes of blocks written for commits (anchors not included).
    pub written_bytes: u64,
    pub checkpoints: u64,
    pub trimmed_bytes: u64,
}

/// Blocks to write at the next flush, from a block-aligned log position.
struct Chunk {
    position: u64,
    bytes: Vec<u8>,
}

impl Chunk {
    fn end(&self) -> u64 {
        self.position + self.bytes.len() as u64
    }
}

/// A write-ahead log on a block device.
pub struct Wal<D: LogDevice> {
    device: D,
    ring: Ring,
    layout: Layout,
    log_id: u64,
    /// Generation of the newest anchor written.
    generation: u64,
    /// Written into every record: the generation this writer opened with.
    epoch: u32,
    /// The live log starts here (the durable anchor's start).
    tail_position: u64,
    tail_seq: u64,
    next_seq: u64,
    /// Position after the last commit appended.
    end: u64,
    /// CRC of the last commit appended (the next one chains from it).
    chain_crc: u32,
    /// The last commit known durable.
    flushed_seq: u64,
    /// A commit was appended since the last flush.
    group_open: bool,
    chunks: Vec<Chunk>,
    counters: WalCounters,
}

impl<D: LogDevice> Wal<D> {
    /// Starts an empty log, replacing whatever was at the place.
    pub fn create(mut device: D, config: WalConfig) -> Result<Wal<D>, WalError> {
        let ring = Ring::new(config.base_offset, config.area_bytes);
        let room = device.size_bytes().saturating_sub(config.base_offset);
        if ring.device_bytes() > room {
            return Err(WalError::DoesNotFit {
                needed_bytes: ring.device_bytes(),
                room_bytes: room,
            });
        }
        let anchor = Anchor {
            layout: config.layout,
            generation: 1,
            log_id: config.log_id,
            area_bytes: config.area_bytes,
            start_position: 0,
            start_seq: 1,
            chain_crc: initial_chain_crc(config.log_id),
        };
        // Both slots: an older log's anchor must not outlive this one.
        let mut slots = vec![0u8; (2 * BLOCK_BYTES) as usize];
        let at = (anchor.slot() * BLOCK_BYTES) as usize;
        slots[at..at + BLOCK_BYTES as usize].copy_from_slice(&anchor.encode());
        let offset = ring.anchor_offset(0);
        device_op(
            DeviceOp::Write,
            offset,
            slots.len() as u64,
            device.write_at(offset, &slots),
        )?;
        device_op(DeviceOp::Flush, 0, 0, device.flush())?;
        Ok(Wal::assemble(device, ring, &anchor, anchor.generation))
    }

    /// Opens the log at `base_offset` after a stop or a crash: finds every
    /// commit it holds and positions the writer after the last one. The
    /// writer takes a new epoch (an anchor written and flushed), so that
    /// its commits never chain onto records a crashed writer left behind.
    pub fn open(mut device: D, base_offset: u64) -> Result<(Wal<D>, Recovered), WalError> {
        let recovered = read_log(&mut device, base_offset)?;
        let found = recovered.anchor;
        let ring = Ring::new(base_offset, found.area_bytes);
        let anchor = Anchor {
            generation: found.generation + 1,
            ..found
        };
        let mut wal = Wal::assemble(device, ring, &found, anchor.generation);
        wal.write_anchor(&anchor)?;
        wal.next_seq = recovered.last_seq() + 1;
        wal.flushed_seq = recovered.last_seq();
        wal.end = recovered.end_position;
        wal.chain_crc = recovered.last_crc;
        let block_start = wal.end / BLOCK_BYTES * BLOCK_BYTES;
        if wal.layout == Layout::Packed && block_start < wal.end {
            // The block the next commit joins: its commits are rewritten
            // with it, byte for byte.
            let mut block = vec![0u8; BLOCK_BYTES as usize];
            let offset = ring.device_offset(block_start);
            device_op(
                DeviceOp::Read,
                offset,
                BLOCK_BYTES,
                wal.device.read_at(offset, &mut block),
            )?;
            block.truncate((wal.end - block_start) as usize);
            wal.chunks.push(Chunk {
                position: block_start,
                bytes: block,
            });
        }
        Ok((wal, recovered))
    }

    fn assemble(device: D, ring: Ring, anchor: &Anchor, generation: u64) -> Wal<D> {
        Wal {
            device,
            ring,
            layout: anchor.layout,
            log_id: anchor.log_id,
            generation: anchor.generation,
            epoch: generation as u32,
            tail_position: anchor.start_position,
            tail_seq: anchor.start_seq,
            next_seq: anchor.start_seq,
            end: anchor.start_position,
            chain_crc: anchor.chain_crc,
            flushed_seq: anchor.start_seq - 1,
            group_open: false,
            chunks: Vec::new(),
            counters: WalCounters::default(),
        }
    }

    pub fn layout(&self) -> Layout {
        self.layout
    }

    pub fn counters(&self) -> WalCounters {
        self.counters
    }

    /// The sequence number the next commit gets.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The last commit a returned `flush` made durable.
    pub fn flushed_seq(&self) -> u64 {
        self.flushed_seq
    }

    /// The first commit not yet checkpointed.
    pub fn tail_seq(&self) -> u64 {
        self.tail_seq
    }

    /// Position after the last commit appended.
    pub fn end_position(&self) -> u64 {
        self.end
    }

    pub fn device(&mut self) -> &mut D {
        &mut self.device
    }

    pub fn into_device(self) -> D {
        self.device
    }

    /// Appends a commit (durable after the next `flush`); returns its
    /// sequence number.
    pub fn append(&mut self, payload: &[u8]) -> Result<u64, WalError> {
        let len = (RECORD_HEADER_BYTES + payload.len()) as u64;
        if len > self.ring.area_bytes {
            return Err(WalError::DoesNotFit {
                needed_bytes: len,
                room_bytes: self.ring.area_bytes,
            });
        }
        let mut start = self.end;
        if self.layout == Layout::Sparse && !self.group_open {
            start = round_up(start, BLOCK_BYTES);
        }
        let start = self.ring.place(start, len);
        let last_block = (start + len - 1) / BLOCK_BYTES;
        if last_block >= self.tail_position / BLOCK_BYTES + self.ring.area_blocks() {
            return Err(WalError::Full {
                commit_bytes: len,
                live_bytes: self.end - self.tail_position,
                area_bytes: self.ring.area_bytes,
            });
        }
        let seq = self.next_seq;
        let (record, crc) = encode_record(seq, self.epoch, payload, self.chain_crc);
        self.buffer(start, &record);
        self.end = start + len;
        self.chain_crc = crc;
        self.next_seq += 1;
        self.group_open = true;
        self.counters.commits += 1;
        Ok(seq)
    }

    /// Adds a record at `start` to the blocks the next flush writes.
    fn buffer(&mut self, start: u64, record: &[u8]) {
        let lap = start / self.ring.area_bytes;
        match self.chunks.last_mut() {
            // Same lap, and at most the rest of the chunk's last block
            // (zeros) in between: one write.
            Some(chunk)
                if chunk.position / self.ring.area_bytes == lap
                    && start <= round_up(chunk.end(), BLOCK_BYTES) =>
            {
                assert!(start >= chunk.end(), "records overlap");
                chunk.bytes.resize((start - chunk.position) as usize, 0);
                chunk.bytes.extend_from_slice(record);
            }
            _ => {
                // Only at a block boundary: a block holding flushed
                // commits is always in a chunk already.
                assert!(
                    start.is_multiple_of(BLOCK_BYTES),
                    "a new chunk at {start} would overwrite the start of its block"
                );
                self.chunks.push(Chunk {
                    position: start,
                    bytes: record.to_vec(),
                });
            }
        }
    }

    /// Writes what was appended since the last flush and flushes the
    /// device: every commit appended so far is durable when it returns.
    pub fn flush(&mut self) -> Result<(), WalError> {
        if !self.group_open {
            return Ok(());
        }
        for chunk in &self.chunks {
            let mut bytes = chunk.bytes.clone();
            bytes.resize(round_up(bytes.len() as u64, BLOCK_BYTES) as usize, 0);
            let len = bytes.len() as u64;
            assert!(
                len <= self.ring.left_in_lap(chunk.position),
                "a chunk crosses the end of the ring"
            );
            let offset = self.ring.device_offset(chunk.position);
            device_op(
                DeviceOp::Write,
                offset,
                len,
                self.device.write_at(offset, &bytes),
            )?;
            self.counters.written_bytes += len;
        }
        device_op(DeviceOp::Flush, 0, 0, self.device.flush())?;
        self.counters.flushes += 1;
        self.flushed_seq = self.next_seq - 1;
        self.group_open = false;
        // Packed: the partly filled last block is written again, whole,
        // with the next commits.
        let block_start = self.end / BLOCK_BYTES * BLOCK_BYTES;
        let keep = match (self.layout, self.chunks.pop()) {
            (Layout::Packed, Some(last)) if block_start < self.end => {
                assert!(last.position <= block_start && last.end() == self.end);
                Some(Chunk {
                    position: block_start,
                    bytes: last.bytes[(block_start - last.position) as usize..].to_vec(),
                })
            }
            _ => None,
        };
        self.chunks.clear();
        self.chunks.extend(keep);
        Ok(())
    }

    /// Declares every commit so far applied elsewhere (a database's
    /// checkpoint): flushes, moves the anchor past them, and trims the
    /// blocks they held. Returns the bytes trimmed.
    pub fn checkpoint(&mut self) -> Result<u64, WalError> {
        self.flush()?;
        let start = match self.layout {
            Layout::Packed => self.end,
            Layout::Sparse => round_up(self.end, BLOCK_BYTES),
        };
        if start == self.tail_position {
            return Ok(0);
        }
        let anchor = Anchor {
            layout: self.layout,
            generation: self.generation + 1,
            log_id: self.log_id,
            area_bytes: self.ring.area_bytes,
            start_position: start,
            start_seq: self.next_seq,
            chain_crc: self.chain_crc,
        };
        self.write_anchor(&anchor)?;
        // Whole blocks before the new start's block; in packed, that block
        // still takes the next commits.
        let mut from = self.tail_position / BLOCK_BYTES * BLOCK_BYTES;
        let to = start / BLOCK_BYTES * BLOCK_BYTES;
        assert!(to - from <= self.ring.area_bytes, "more than a lap is live");
        let mut trimmed = 0;
        while from < to {
            let piece_end = to.min(from + self.ring.left_in_lap(from));
            let offset = self.ring.device_offset(from);
            let len = piece_end - from;
            device_op(DeviceOp::Trim, offset, len, self.device.trim(offset, len))?;
            trimmed += len;
            from = piece_end;
        }
        self.tail_position = start;
        self.tail_seq = self.next_seq;
        self.counters.checkpoints += 1;
        self.counters.trimmed_bytes += trimmed;
        Ok(trimmed)
    }

    /// Writes `anchor` to its slot and flushes: durable when it returns.
    fn write_anchor(&mut self, anchor: &Anchor) -> Result<(), WalError> {
        assert_eq!(anchor.generation, self.generation + 1, "anchors in order");
        let offset = self.ring.anchor_offset(anchor.slot());
        device_op(
            DeviceOp::Write,
            offset,
            BLOCK_BYTES,
            self.device.write_at(offset, &anchor.encode()),
        )?;
        device_op(DeviceOp::Flush, 0, 0, self.device.flush())?;
        self.generation = anchor.generation;
        Ok(())
    }
}
