//! Whole pages, and every other medium call the engine decides under the
//! state lock, on their way to the medium.
//!
//! Appending a record is a copy into a stream's page buffer under the state
//! lock; writing the full pages to the medium is a system call that copies
//! them again (into the page cache, or across a drive's link), and it used
//! to happen under that lock too, so every other writer waited for it.
//! Now full pages are queued here under the lock and written after it is
//! released, by one thread at a time (the log writer, `volume/guard.rs`),
//! so that compression, appends and reads on other threads go on
//! meanwhile. The medium's segment events (a segment readied for a new
//! incarnation, sealed, freed) and staging-slot writes queue here too, so
//! that no medium call runs under the lock and all of them reach the
//! medium in the order the engine decided them: a tier's `segment_freed`
//! erases its copy, so one arriving after the segment was readied again
//! would destroy the new incarnation.
//!
//! Invariants:
//! - Writes go to the medium in queue order, one writer at a time, so each
//!   segment's pages are still written in order and each once.
//! - Every queued write has a ticket, increasing; `written_through` is the
//!   highest ticket written. A sync covers a write only once
//!   `written_through` reached its ticket (`Volume::sync_media` waits).
//! - A queued write stays here until it is on the medium, so a read of a
//!   record in it is served from RAM (`State::read_buffered`).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::units::{PageIndex, SegmentId};

/// Pages queued beyond this many bytes make the thread that queued them
/// wait for the writer: the queue is bounded even if the medium is slow.
pub(crate) const OUTBOUND_LIMIT_BYTES: usize = 16 * 1024 * 1024;

/// What a queued write does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WriteKind {
    /// Programs whole pages.
    Pages,
    /// Writes whole 512-byte sectors from a sector boundary, on a medium
    /// with staging (`Staging::write_sectors`).
    Sectors,
    /// Hands a partial page to a medium with power-loss protection
    /// (`DriveModel::stage_partial_page`), after the pages before it.
    Stage,
    /// Writes staging slot `n` (`Staging::write_staging`); not segment data.
    Staging(usize),
    /// Readies the segment for a new incarnation (`Media::prepare_segment`).
    Prepare,
    /// The segment's incarnation was sealed at `offset` bytes
    /// (`SegmentEvents::segment_sealed`).
    Sealed,
    /// The segment was freed (`SegmentEvents::segment_freed`).
    Freed,
}

impl WriteKind {
    /// True if the write puts bytes into its segment (which a read of a
    /// record there may need before it reaches the medium).
    pub fn is_segment_data(self) -> bool {
        matches!(
            self,
            WriteKind::Pages | WriteKind::Sectors | WriteKind::Stage
        )
    }
}

/// Pages of one segment, to be written (or a partial one staged) at
/// `first_page`.
#[derive(Debug, Clone)]
pub(crate) struct PageWrite {
    pub ticket: u64,
    pub kind: WriteKind,
    pub segment: SegmentId,
    pub first_page: PageIndex,
    /// Byte offset of `bytes[0]` in the segment.
    pub offset: u64,
    /// Shared, not copied: queueing a batch must not copy it under the lock.
    pub bytes: Arc<Vec<u8>>,
}

impl PageWrite {
    pub fn end_offset(&self) -> u64 {
        self.offset + self.bytes.len() as u64
    }
}

/// The queue of page writes, with its tickets and its one writer.
#[derive(Debug, Default)]
pub(crate) struct Outbound {
    queue: VecDeque<PageWrite>,
    queued_bytes: usize,
    /// Queued data writes per segment, so that a read of a record in a
    /// segment with none (almost every read) does not scan the queue.
    data_writes: HashMap<SegmentId, u32>,
    /// The ticket of the last write queued (0: none ever).
    last_ticket: u64,
    /// Every write with a ticket up to this one is on the medium.
    written_through: u64,
    /// A thread is writing the front of the queue.
    busy: bool,
    /// Buffers of writes done, emptied, for the next batches to fill: a
    /// fresh one is page-faulted in again (2% of a streaming write's CPU).
    spare: Vec<Vec<u8>>,
}

/// Written buffers kept for reuse, and the largest kept.
const SPARE_BUFFERS: usize = 4;
const SPARE_BYTES_MAX: usize = 4 << 20;

impl Outbound {
    /// Queues `bytes`: whole pages of `segment` from `first_page`, or for
    /// `WriteKind::Stage` the start of that one page.
    pub fn push(
        &mut self,
        kind: WriteKind,
        segment: SegmentId,
        first_page: PageIndex,
        offset: u64,
        bytes: Vec<u8>,
    ) {
        debug_assert!(
            bytes.is_empty()
                == matches!(
                    kind,
                    WriteKind::Prepare | WriteKind::Sealed | WriteKind::Freed
                ),
            "{kind:?} with {} bytes",
            bytes.len()
        );
        self.last_ticket += 1;
        self.queued_bytes += bytes.len();
        if kind.is_segment_data() {
            *self.data_writes.entry(segment).or_default() += 1;
        }
        self.queue.push_back(PageWrite {
            ticket: self.last_ticket,
            kind,
            segment,
            first_page,
            offset,
            bytes: Arc::new(bytes),
        });
    }

    /// Writes waiting that no thread has taken on.
    pub fn unclaimed(&self) -> bool {
        !self.busy && !self.queue.is_empty()
    }

    pub fn over_limit(&self) -> bool {
        self.queued_bytes > OUTBOUND_LIMIT_BYTES
    }

    /// Makes the caller the writer of everything queued now, if nobody is.
    pub fn claim(&mut self) -> Option<Vec<PageWrite>> {
        if !self.unclaimed() {
            return None;
        }
        self.busy = true;
        Some(self.queue.iter().cloned().collect())
    }

    /// The writer wrote everything up to `ticket` (all of its claim, or
    /// the part before a failed write); it stops being the writer.
    pub fn written(&mut self, ticket: u64) {
        if !self.busy {
            // Discarded meanwhile (a halt): nothing of the claim is queued.
            return;
        }
        while self.queue.front().is_some_and(|w| w.ticket <= ticket) {
            let done = self.queue.pop_front().expect("checked above");
            self.queued_bytes -= done.bytes.len();
            if done.kind.is_segment_data() {
                let count = self
                    .data_writes
                    .get_mut(&done.segment)
                    .expect("a queued data write is counted");
                *count -= 1;
                if *count == 0 {
                    self.data_writes.remove(&done.segment);
                }
            }
            // The last holder (the claim is dropped by now, unless a read
            // still holds it) gives the buffer back.
            if let Ok(mut bytes) = Arc::try_unwrap(done.bytes) {
                if self.spare.len() < SPARE_BUFFERS
                    && (1..=SPARE_BYTES_MAX).contains(&bytes.capacity())
                {
                    bytes.clear();
                    self.spare.push(bytes);
                }
            }
        }
        self.written_through = self.written_through.max(ticket);
        self.busy = false;
        debug_assert!(self.written_through <= self.last_ticket);
    }

    pub fn last_ticket(&self) -> u64 {
        self.last_ticket
    }

    /// An empty buffer a finished write gave back, if any.
    pub fn spare_buffer(&mut self) -> Option<Vec<u8>> {
        self.spare.pop()
    }

    pub fn written_through(&self) -> u64 {
        self.written_through
    }

    pub fn is_busy(&self) -> bool {
        self.busy
    }

    /// Queued writes of data into `segment`, in offset order.
    pub fn of_segment(&self, segment: SegmentId) -> impl Iterator<Item = &PageWrite> {
        let any = self.data_writes.contains_key(&segment);
        self.queue
            .iter()
            .take(if any { usize::MAX } else { 0 })
            .filter(move |w| w.segment == segment && w.kind.is_segment_data())
    }

    /// Queues a medium call that carries no data: `Prepare`, `Sealed`
    /// (`offset`: the fill) or `Freed`.
    pub fn push_event(&mut self, kind: WriteKind, segment: SegmentId, offset: u64) {
        self.push(kind, segment, PageIndex(0), offset, Vec::new());
    }

    /// Drops everything queued, as a power cut would.
    pub fn discard(&mut self) {
        self.queue.clear();
        self.queued_bytes = 0;
        self.data_writes.clear();
        self.written_through = self.last_ticket;
        self.busy = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_are_claimed_once_and_retired_in_order() {
        let mut out = Outbound::default();
        out.push(
            WriteKind::Pages,
            SegmentId(1),
            PageIndex(0),
            0,
            vec![1; 4096],
        );
        out.push(
            WriteKind::Pages,
            SegmentId(1),
            PageIndex(1),
            4096,
            vec![2; 4096],
        );
        let claimed = out.claim().expect("unclaimed writes");
        assert_eq!(claimed.len(), 2);
        assert!(out.claim().is_none(), "claimed twice");
        out.push(
            WriteKind::Pages,
            SegmentId(2),
            PageIndex(0),
            0,
            vec![3; 4096],
        );
        assert!(!out.unclaimed(), "a writer is busy");
        out.written(claimed[1].ticket);
        assert_eq!(out.written_through(), 2);
        assert!(out.unclaimed(), "the third write waits for a writer");
        assert_eq!(out.of_segment(SegmentId(1)).count(), 0);
        assert_eq!(out.of_segment(SegmentId(2)).count(), 1);
        out.discard();
        assert_eq!(out.written_through(), out.last_ticket());
    }
}
