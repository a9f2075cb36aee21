//! The drive model: flash-rule bookkeeping and the timing schedule.
//!
//! Pure and deterministic: every method takes the time `t` (nanoseconds)
//! at which the caller issues the work and returns the time at which the
//! caller may continue. No clock is read here; `NandMedia` supplies `t`
//! from the real or the virtual clock and waits (or advances its cursor)
//! until the returned time.
//!
//! Each plane is a "free at" time (a busy-until): its work runs in call
//! order, starting when both the caller and the plane are ready. Channels,
//! the controller, the link and the compressor are [`Calendar`]s: a
//! transfer takes the earliest idle gap at or after its data is ready.
//!
//! Invariants: `next_page[b]` is the next programmable page of block `b`
//! (`FACTORY_ERASED` on a new drive and `UNERASED` on a reopened one,
//! until the block's first erase; the engine must erase first); a
//! page's data is in the write buffer from its admission until its
//! program completes; at most `write_buffer_pages` pages are in the
//! buffer at once.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use zdisk_core::media::HostDirection;

use crate::profile::NandParams;

/// `next_page` of a block that has not been erased since the image was
/// opened: its contents are unknown to the model.
pub(crate) const UNERASED: u32 = u32::MAX;
/// `next_page` of a block of a freshly created drive: erased, so reads
/// know it holds nothing, but the engine must still erase it before
/// programming (the `Media` contract).
pub(crate) const FACTORY_ERASED: u32 = u32::MAX - 1;

/// Counters and derived figures of an emulated drive.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct NandStats {
    /// Pages programmed into the NAND array.
    pub pages_programmed: u64,
    /// Pages read from the NAND array.
    pub pages_read: u64,
    /// Page reads served from the write buffer or the PLP staging buffer.
    pub buffer_read_hits: u64,
    /// Page reads of pages the controller knows are erased (never
    /// programmed since the block's erase), answered without the array.
    pub erased_page_reads: u64,
    /// Erase blocks erased (a segment erase counts one per plane).
    pub blocks_erased: u64,
    /// Partial pages kept in the power-loss-protected buffer.
    pub staged_pages: u64,
    pub staged_bytes: u64,
    pub meta_writes: u64,
    pub syncs: u64,
    /// Host commands seen through `host_transfer`.
    pub host_commands: u64,
    pub host_write_bytes: u64,
    pub host_read_bytes: u64,
    pub segments_recycled: u64,
    pub recycled_bytes: u64,
    pub relocated_bytes: u64,
    pub erase_count_min: u32,
    pub erase_count_max: u32,
    pub erase_count_mean: f64,
    /// Busy time summed over every plane (program, read, erase).
    pub plane_busy_ns: u64,
    /// Busy time summed over every channel bus.
    pub channel_busy_ns: u64,
    pub controller_busy_ns: u64,
    pub link_busy_ns: u64,
    pub compress_busy_ns: u64,
    pub recycle_busy_ns: u64,
    /// Time callers spent waiting for write-buffer admission (or, without
    /// a buffer, for their programs).
    pub buffer_wait_ns: u64,
    pub read_wait_ns: u64,
    pub sync_wait_ns: u64,
    pub recycle_wait_ns: u64,
    pub host_wait_ns: u64,
}

/// Where a segment page lives in the array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageAddress {
    pub unit: u32,
    pub channel: u32,
    pub die: u32,
    pub plane: u32,
    /// Block index within its plane (= the segment).
    pub block: u32,
    pub page_in_block: u32,
}

pub(crate) struct Model {
    params: NandParams,
    units: u32,
    pages_per_segment: u32,
    plane_free_ns: Vec<u64>,
    /// Reserved transfer intervals per channel bus.
    channels_busy: Vec<Calendar>,
    /// No operation still to come starts before this time, so channel
    /// reservations ending earlier can be forgotten.
    horizon_ns: u64,
    controller_busy: Calendar,
    link_busy: Calendar,
    compress_busy: Calendar,
    recycle_free_ns: u64,
    /// Completion times of the programs whose pages occupy the write buffer.
    in_flight: BinaryHeap<Reverse<(u64, u32, u32)>>,
    /// (segment, page) → program completion, for reads served from the buffer.
    buffered: HashMap<(u32, u32), u64>,
    /// Every program, erase and metadata write issued so far is done by then.
    durable_ns: u64,
    /// Per block (`segment * units + unit`).
    next_page: Vec<u32>,
    erase_counts: Vec<u32>,
    /// Per segment: the staged partial page and its bytes.
    staged: HashMap<u32, (u32, Vec<u8>)>,
    stats: NandStats,
}

/// What `program` did besides scheduling.
pub(crate) struct Programmed {
    /// When the caller may continue.
    pub continue_ns: u64,
    /// A staged partial page of this segment was replaced by the program.
    pub unstaged: bool,
}

fn transfer_ns(bytes: u64, rate: Option<u64>) -> u64 {
    match rate {
        None => 0,
        Some(rate) => (bytes as u128 * 1_000_000_000).div_ceil(rate as u128) as u64,
    }
}

impl Model {
    /// `fresh`: a newly created drive, whose blocks are all erased.
    pub fn new(params: NandParams, erase_counts: Vec<u32>, fresh: bool) -> Model {
        let profile = &params.profile;
        let units = profile.units();
        let blocks = units as usize * profile.segment_count() as usize;
        assert_eq!(erase_counts.len(), blocks, "erase counts for every block");
        Model {
            units,
            pages_per_segment: profile.geometry().pages_per_segment(),
            plane_free_ns: vec![0; units as usize],
            channels_busy: vec![Calendar::default(); profile.channels as usize],
            horizon_ns: 0,
            controller_busy: Calendar::default(),
            link_busy: Calendar::default(),
            compress_busy: Calendar::default(),
            recycle_free_ns: 0,
            in_flight: BinaryHeap::new(),
            buffered: HashMap::new(),
            durable_ns: 0,
            next_page: vec![if fresh { FACTORY_ERASED } else { UNERASED }; blocks],
            erase_counts,
            staged: HashMap::new(),
            stats: NandStats::default(),
            params,
        }
    }

    /// Maps a segment page to its plane and page-in-block: consecutive
    /// pages go to different channels first, then dies, then planes.
    pub fn locate(&self, segment: u32, page: u32) -> PageAddress {
        let profile = &self.params.profile;
        let unit = page % self.units;
        PageAddress {
            unit,
            channel: unit % profile.channels,
            die: (unit / profile.channels) % profile.dies_per_channel,
            plane: unit / (profile.channels * profile.dies_per_channel),
            block: segment,
            page_in_block: page / self.units,
        }
    }

    fn block_index(&self, segment: u32, unit: u32) -> usize {
        segment as usize * self.units as usize + unit as usize
    }

    fn page_size(&self) -> u64 {
        self.params.profile.page_bytes() as u64
    }

    pub fn erase_counts_of(&self, segment: u32) -> &[u32] {
        let start = self.block_index(segment, 0);
        &self.erase_counts[start..start + self.units as usize]
    }

    pub fn staged(&self, segment: u32) -> Option<(u32, &[u8])> {
        self.staged
            .get(&segment)
            .map(|(page, data)| (*page, data.as_slice()))
    }

    /// Restores a staged page found in an image being opened.
    pub fn restore_staged(&mut self, segment: u32, page: u32, data: Vec<u8>) {
        assert!(segment < self.params.profile.segment_count());
        assert!(page < self.pages_per_segment);
        self.staged.insert(segment, (page, data));
    }

    fn check_program(&self, segment: u32, page: u32) {
        let address = self.locate(segment, page);
        let next = self.next_page[self.block_index(segment, address.unit)];
        let place = || {
            format!(
                "segment {segment} page {page} (channel {}, die {}, plane {}, block {}, page {} of the block)",
                address.channel, address.die, address.plane, address.block, address.page_in_block
            )
        };
        assert!(
            next < FACTORY_ERASED,
            "flash rule broken: {} programmed without an erase",
            place()
        );
        assert!(
            address.page_in_block >= next,
            "flash rule broken: {} programmed twice (the block's next programmable page is {next})",
            place()
        );
        assert_eq!(
            address.page_in_block,
            next,
            "flash rule broken: {} programmed out of order (the block's next programmable page is {next})",
            place()
        );
    }

    /// Pages of `segment` programmed since its erase (its blocks are
    /// programmed in order, so this is the next segment page), or
    /// `UNERASED` if a block has not been erased.
    fn segment_write_pointer(&self, segment: u32) -> u32 {
        let start = self.block_index(segment, 0);
        let blocks = &self.next_page[start..start + self.units as usize];
        if blocks.iter().any(|&next| next >= FACTORY_ERASED) {
            return UNERASED;
        }
        blocks.iter().sum()
    }

    /// True if the page is known to hold nothing: its block is erased and
    /// the page has not been programmed since.
    fn known_erased(&self, segment: u32, page: u32) -> bool {
        let address = self.locate(segment, page);
        match self.next_page[self.block_index(segment, address.unit)] {
            UNERASED => false,
            FACTORY_ERASED => true,
            next => address.page_in_block >= next,
        }
    }

    /// Programs whole pages `first_page..` of `segment`, issued at `t`.
    pub fn program(
        &mut self,
        t: u64,
        segment: u32,
        first_page: u32,
        len_bytes: usize,
    ) -> Programmed {
        let profile = &self.params.profile;
        assert!(
            segment < profile.segment_count(),
            "write to segment {segment} beyond the medium ({} segments)",
            profile.segment_count()
        );
        assert!(
            len_bytes > 0 && (len_bytes as u64).is_multiple_of(self.page_size()),
            "write of {len_bytes} bytes to segment {segment} is not whole pages"
        );
        let pages = (len_bytes as u64 / self.page_size()) as u32;
        assert!(
            first_page as u64 + pages as u64 <= self.pages_per_segment as u64,
            "segment {segment}: write of {pages} pages at page {first_page} runs past the segment end"
        );
        let written = self.segment_write_pointer(segment);
        for page in first_page..first_page + pages {
            self.check_program(segment, page);
            let unit = self.locate(segment, page).unit;
            let index = self.block_index(segment, unit);
            self.next_page[index] += 1;
        }
        // Each block is in order; the segment as a whole must be too.
        assert_eq!(
            first_page, written,
            "flash rule broken: segment {segment} page {first_page} programmed out of order \
             (the segment's next programmable page is {written})"
        );
        let unstaged = match self.staged.get(&segment) {
            Some((page, _)) if (first_page..first_page + pages).contains(page) => {
                self.staged.remove(&segment);
                true
            }
            _ => false,
        };

        let profile = &self.params.profile;
        let buffer_pages = profile.write_buffer_pages as usize;
        let page_transfer_ns = transfer_ns(self.page_size(), profile.channel_bytes_per_sec);
        let program_ns = profile.latency_program_ns;
        let channels = profile.channels;
        // Pages whose programs finished by `t` have left the buffer.
        while let Some(Reverse((done, s, p))) = self.in_flight.peek().copied() {
            if done > t {
                break;
            }
            self.in_flight.pop();
            self.forget_buffered(s, p, done);
        }
        let mut continue_ns = t;
        for page in first_page..first_page + pages {
            let unit = page % self.units;
            let channel = (unit % channels) as usize;
            let admitted = if buffer_pages == 0 || self.in_flight.len() < buffer_pages {
                t
            } else {
                let Reverse((done, s, p)) = self.in_flight.pop().expect("a full buffer");
                self.forget_buffered(s, p, done);
                t.max(done)
            };
            let (_, transfer_end) =
                self.channels_busy[channel].book(admitted, page_transfer_ns, self.horizon_ns);
            let program_start = transfer_end.max(self.plane_free_ns[unit as usize]);
            let done = program_start + program_ns;
            self.plane_free_ns[unit as usize] = done;
            self.durable_ns = self.durable_ns.max(done);
            if buffer_pages == 0 {
                // No buffer: the write completes with its program.
                continue_ns = continue_ns.max(done);
            } else {
                continue_ns = continue_ns.max(admitted);
                self.in_flight.push(Reverse((done, segment, page)));
                self.buffered.insert((segment, page), done);
            }
        }
        self.stats.pages_programmed += pages as u64;
        self.stats.plane_busy_ns += program_ns * pages as u64;
        self.stats.channel_busy_ns += page_transfer_ns * pages as u64;
        self.stats.buffer_wait_ns += continue_ns - t;
        Programmed {
            continue_ns,
            unstaged,
        }
    }

    fn forget_buffered(&mut self, segment: u32, page: u32, done: u64) {
        if self.buffered.get(&(segment, page)) == Some(&done) {
            self.buffered.remove(&(segment, page));
        }
    }

    /// Reads `len` bytes at `offset` of `segment`, issued at `t`. Pages in
    /// the write buffer or the staging buffer, and pages known to be
    /// erased, cost nothing; the others are read by their plane and the
    /// requested bytes cross the channel.
    pub fn read(&mut self, t: u64, segment: u32, offset: u64, len: u64) -> u64 {
        if len == 0 {
            return t;
        }
        let page_size = self.page_size();
        let profile = &self.params.profile;
        let (read_ns, channel_rate, channels) = (
            profile.latency_read_ns,
            profile.channel_bytes_per_sec,
            profile.channels,
        );
        let first = offset / page_size;
        let last = (offset + len - 1) / page_size;
        let staged_page = self.staged.get(&segment).map(|(page, _)| *page as u64);
        let mut done = t;
        for page in first..=last {
            let start = (page * page_size).max(offset);
            let end = ((page + 1) * page_size).min(offset + len);
            let in_buffer = self
                .buffered
                .get(&(segment, page as u32))
                .is_some_and(|&programmed| programmed > t);
            if staged_page == Some(page) || in_buffer {
                self.stats.buffer_read_hits += 1;
                continue;
            }
            if self.known_erased(segment, page as u32) {
                // The controller's block table says there is nothing to read.
                self.stats.erased_page_reads += 1;
                continue;
            }
            let unit = (page % self.units as u64) as usize;
            let channel = unit % channels as usize;
            let read_start = t.max(self.plane_free_ns[unit]);
            let read_end = read_start + read_ns;
            self.plane_free_ns[unit] = read_end;
            let transfer = transfer_ns(end - start, channel_rate);
            let (_, transfer_end) =
                self.channels_busy[channel].book(read_end, transfer, self.horizon_ns);
            done = done.max(transfer_end);
            self.stats.pages_read += 1;
            self.stats.plane_busy_ns += read_ns;
            self.stats.channel_busy_ns += transfer;
        }
        self.stats.read_wait_ns += done - t;
        done
    }

    /// Erases the segment's block on every plane, issued at `t`. The
    /// caller does not wait: later work on those planes queues behind the
    /// erase. Returns true if a staged page was dropped.
    pub fn erase(&mut self, t: u64, segment: u32) -> bool {
        let profile = &self.params.profile;
        assert!(
            segment < profile.segment_count(),
            "erase of segment {segment} beyond the medium ({} segments)",
            profile.segment_count()
        );
        let erase_ns = profile.latency_erase_ns;
        for unit in 0..self.units {
            let end = t.max(self.plane_free_ns[unit as usize]) + erase_ns;
            self.plane_free_ns[unit as usize] = end;
            self.durable_ns = self.durable_ns.max(end);
            let index = self.block_index(segment, unit);
            self.next_page[index] = 0;
            self.erase_counts[index] = self.erase_counts[index].saturating_add(1);
        }
        self.buffered.retain(|&(s, _), _| s != segment);
        self.stats.blocks_erased += self.units as u64;
        self.stats.plane_busy_ns += erase_ns * self.units as u64;
        self.staged.remove(&segment).is_some()
    }

    /// Keeps `data`, the start of page `page` of `segment`, in the
    /// power-loss-protected buffer. Costs no NAND time.
    pub fn stage(&mut self, segment: u32, page: u32, data: &[u8]) {
        assert!(
            self.params.config.power_loss_protection,
            "stage_partial_page without power-loss protection"
        );
        let profile = &self.params.profile;
        assert!(
            segment < profile.segment_count(),
            "staging in segment {segment} beyond the medium"
        );
        assert!(
            page < self.pages_per_segment,
            "staging page {page} beyond segment {segment}"
        );
        assert!(
            !data.is_empty() && (data.len() as u64) < self.page_size(),
            "staging {} bytes: a partial page has 1 to {} bytes",
            data.len(),
            self.page_size() - 1
        );
        // The page must be the segment's next programmable one.
        self.check_program(segment, page);
        let written = self.segment_write_pointer(segment);
        assert_eq!(
            page, written,
            "flash rule broken: segment {segment} page {page} staged out of order \
             (the segment's next programmable page is {written})"
        );
        self.staged.insert(segment, (page, data.to_vec()));
        self.stats.staged_pages += 1;
        self.stats.staged_bytes += data.len() as u64;
    }

    /// A host command moving `bytes`, issued at `t`: the controller's
    /// per-command overhead, then the link, with the compressor (writes)
    /// streaming alongside the link.
    pub fn host_transfer(&mut self, t: u64, direction: HostDirection, bytes: u64) -> u64 {
        let profile = &self.params.profile;
        let overhead = profile.command_overhead_ns;
        let link_ns = transfer_ns(bytes, profile.link_bytes_per_sec);
        // Booked in gaps, like the channels: a command that is ready does
        // not wait behind one booked later (out-of-order completion).
        let horizon = self.horizon_ns;
        let (_, controller_end) = self.controller_busy.book(t, overhead, horizon);
        let (link_start, link_end) = self.link_busy.book(controller_end, link_ns, horizon);
        let mut done = link_end;
        let compress = match direction {
            HostDirection::Write if bytes > 0 => profile.compress_bytes_per_sec,
            _ => None,
        };
        if compress.is_some() {
            let compress_ns = transfer_ns(bytes, compress);
            let (_, compress_end) = self.compress_busy.book(link_start, compress_ns, horizon);
            done = link_end.max(compress_end);
            self.stats.compress_busy_ns += compress_ns;
        }
        self.stats.host_commands += 1;
        match direction {
            HostDirection::Write => self.stats.host_write_bytes += bytes,
            HostDirection::Read => self.stats.host_read_bytes += bytes,
        }
        self.stats.controller_busy_ns += overhead;
        self.stats.link_busy_ns += link_ns;
        self.stats.host_wait_ns += done - t;
        done
    }

    /// Makes everything issued so far durable: waits for every program,
    /// erase and metadata write, unless the buffer is power-loss protected.
    pub fn sync(&mut self, t: u64) -> u64 {
        self.stats.syncs += 1;
        if self.params.config.power_loss_protection {
            return t;
        }
        let done = t.max(self.durable_ns);
        self.stats.sync_wait_ns += done - t;
        done
    }

    /// A metadata slot write: the controller persists it in its own area
    /// within one program time; only `sync` waits for it.
    pub fn meta_write(&mut self, t: u64) {
        self.stats.meta_writes += 1;
        self.durable_ns = self
            .durable_ns
            .max(t + self.params.profile.latency_program_ns);
    }

    /// The cleaner reclaimed a segment: the recycling engine is busy for
    /// `segment_bytes` at the capped rate, and the caller waits for it.
    pub fn recycle(&mut self, t: u64, segment_bytes: u64, relocated_bytes: u64) -> u64 {
        self.stats.segments_recycled += 1;
        self.stats.recycled_bytes += segment_bytes;
        self.stats.relocated_bytes += relocated_bytes;
        let Some(cap) = self.params.config.recycle_cap_bytes_per_sec else {
            return t;
        };
        let busy = transfer_ns(segment_bytes, Some(cap));
        let done = t.max(self.recycle_free_ns) + busy;
        self.recycle_free_ns = done;
        self.stats.recycle_busy_ns += busy;
        self.stats.recycle_wait_ns += done - t;
        done
    }

    /// Declares that no later call starts before `t` (an operation's issue
    /// time, or the real clock).
    pub fn set_horizon(&mut self, t: u64) {
        self.horizon_ns = self.horizon_ns.max(t);
    }

    pub fn recycling_ready(&self, t: u64) -> bool {
        self.params.config.recycle_cap_bytes_per_sec.is_none() || self.recycle_free_ns <= t
    }

    /// When every resource is idle and everything issued is durable.
    pub fn idle_at_ns(&self) -> u64 {
        self.plane_free_ns
            .iter()
            .copied()
            .chain(self.channels_busy.iter().map(Calendar::last_end_ns))
            .chain([
                self.controller_busy.last_end_ns(),
                self.link_busy.last_end_ns(),
                self.compress_busy.last_end_ns(),
                self.recycle_free_ns,
                self.durable_ns,
            ])
            .max()
            .unwrap_or(0)
    }

    /// Erases of every erase block since the image was created.
    pub fn erase_count_total(&self) -> u64 {
        self.erase_counts.iter().map(|&c| c as u64).sum()
    }

    pub fn stats(&self) -> NandStats {
        let mut stats = self.stats.clone();
        if !self.erase_counts.is_empty() {
            stats.erase_count_min = *self.erase_counts.iter().min().expect("not empty");
            stats.erase_count_max = *self.erase_counts.iter().max().expect("not empty");
            let total: u64 = self.erase_counts.iter().map(|&c| c as u64).sum();
            stats.erase_count_mean = total as f64 / self.erase_counts.len() as f64;
        }
        stats
    }
}

/// Reservations of a channel bus. A transfer takes the earliest gap long
/// enough at or after the moment its data is ready, so a die whose data is
/// ready does not wait behind a transfer booked for later (a controller
/// serves whichever die is ready); a single busy-until time would make
/// every channel a FIFO in call order.
#[derive(Debug, Clone, Default)]
pub(crate) struct Calendar {
    /// Sorted, non-overlapping `[start, end)` intervals.
    busy: Vec<(u64, u64)>,
}

impl Calendar {
    /// Books `duration` at the earliest time at or after `earliest`;
    /// intervals ending before `horizon` are forgotten first.
    pub(crate) fn book(&mut self, earliest: u64, duration: u64, horizon: u64) -> (u64, u64) {
        let stale = self.busy.partition_point(|&(_, end)| end <= horizon);
        self.busy.drain(..stale);
        if duration == 0 {
            return (earliest, earliest);
        }
        let mut start = earliest;
        for &(busy_start, busy_end) in &self.busy {
            if busy_end <= start {
                continue;
            }
            if busy_start >= start + duration {
                break;
            }
            start = busy_end;
        }
        let at = self.busy.partition_point(|&(s, _)| s < start);
        self.busy.insert(at, (start, start + duration));
        (start, start + duration)
    }

    pub(crate) fn last_end_ns(&self) -> u64 {
        self.busy.last().map_or(0, |&(_, end)| end)
    }
}

#[cfg(test)]
mod calendar_tests {
    use super::Calendar;

    #[test]
    fn transfers_fill_gaps_before_later_bookings() {
        let mut calendar = Calendar::default();
        assert_eq!(calendar.book(100, 10, 0), (100, 110));
        assert_eq!(calendar.book(50, 10, 0), (50, 60), "an earlier gap is used");
        assert_eq!(calendar.book(55, 10, 0), (60, 70));
        assert_eq!(
            calendar.book(95, 10, 0),
            (110, 120),
            "a gap too short is skipped"
        );
        assert_eq!(calendar.book(0, 0, 0), (0, 0), "no bus time, no booking");
        assert_eq!(calendar.last_end_ns(), 120);
        // Past bookings are forgotten.
        assert_eq!(calendar.book(200, 5, 150), (200, 205));
        assert_eq!(calendar.busy.len(), 1);
    }
}
