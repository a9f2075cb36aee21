//! `NandMedia`: the [`Media`] implementation, tying a drive model to a
//! clock and a page store.
//!
//! Every call takes its start time from the clock, asks the model when the
//! caller may continue, and then either sleeps until then (real time) or
//! moves the current operation's cursor there (virtual time). The model
//! and the virtual clock share one mutex; the real clock never sleeps
//! while holding it.
//!
//! Locks (issue #23: reads never wait behind I/O). `inner` (marked
//! "nand") is taken by every call, reads included, and guards only the
//! model's arithmetic: no store I/O and no sleep ever runs under it (debug
//! builds panic otherwise). The per-segment `segment_order` locks keep a
//! segment's erase, programs and staged page reaching the store in the
//! order the model saw them; they are taken before `inner`, held during
//! that segment's store writes, and never taken by a read. The RAM store's
//! per-segment locks guard a memory copy of that segment's bytes (see
//! `store.rs`).

use std::cell::Cell;
use std::ops::{Deref, DerefMut};
use std::path::Path;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use zdisk_core::clock::{Timing, VirtualTime};
use zdisk_core::held::{assert_none_held, Held};
use zdisk_core::media::{DriveModel, HostDirection, Media, MediaGeometry, ReadRange};
use zdisk_core::units::{PageIndex, SegmentId};
use zdisk_core::{Error, Result};

use crate::model::{Model, NandStats, PageAddress};
use crate::profile::{NandParams, Profile, META_SLOT_SIZE_BYTES};
use crate::store::Store;

/// The virtual clock: the running operation's cursor, or the idle time
/// that calls outside an operation are issued at.
#[derive(Debug, Default)]
struct Timeline {
    in_op: bool,
    cursor_ns: u64,
    idle_ns: u64,
}

struct Inner {
    model: Model,
    time: Timeline,
}

/// `inner` held, and marked held for the debug check that no I/O or
/// sleep runs under it (`zdisk_core::held`).
struct Locked<'a> {
    guard: MutexGuard<'a, Inner>,
    _held: Held,
}

impl Deref for Locked<'_> {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.guard
    }
}

impl DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Inner {
        &mut self.guard
    }
}

/// An emulated NAND drive. See the crate documentation for the model.
pub struct NandMedia {
    params: NandParams,
    geometry: MediaGeometry,
    timing: Timing,
    epoch: Instant,
    inner: Mutex<Inner>,
    /// Per segment: held from before its model step until its store
    /// writes are done, by erases, programs and staging (never by reads).
    segment_order: Vec<Mutex<()>>,
    store: Store,
}

impl NandMedia {
    /// A drive whose pages live in RAM (allocated as they are programmed).
    pub fn new_in_memory(params: NandParams, timing: Timing) -> Result<NandMedia> {
        params.validate()?;
        let store = Store::ram(&params);
        Ok(NandMedia::assemble(params, timing, store, None, Vec::new()))
    }

    /// Creates a sparse image file for the drive. An existing file is
    /// replaced only if `overwrite`.
    pub fn create(
        path: &Path,
        params: NandParams,
        timing: Timing,
        overwrite: bool,
    ) -> Result<NandMedia> {
        params.validate()?;
        let store = Store::create_file(path, &params, overwrite)?;
        Ok(NandMedia::assemble(params, timing, store, None, Vec::new()))
    }

    /// Reopens an image: everything comes from its header. Every block
    /// must be erased before it is programmed again (write pointers are
    /// not kept), as on `FileMedia`; erase counts and staged pages are.
    pub fn open(path: &Path, timing: Timing) -> Result<NandMedia> {
        let (store, params, erase_counts, staged) = Store::open_file(path)?;
        let staged = staged
            .into_iter()
            .map(|page| (page.segment, page.page, page.data))
            .collect();
        Ok(NandMedia::assemble(
            params,
            timing,
            store,
            Some(erase_counts),
            staged,
        ))
    }

    fn assemble(
        params: NandParams,
        timing: Timing,
        store: Store,
        erase_counts: Option<Vec<u32>>,
        staged: Vec<(u32, u32, Vec<u8>)>,
    ) -> NandMedia {
        let blocks = params.profile.segment_count() as usize * params.profile.units() as usize;
        // A new drive is erased throughout; a reopened one is unknown
        // until each block's next erase.
        let fresh = erase_counts.is_none();
        let mut model = Model::new(
            params.clone(),
            erase_counts.unwrap_or_else(|| vec![0; blocks]),
            fresh,
        );
        for (segment, page, data) in staged {
            model.restore_staged(segment, page, data);
        }
        let segment_order = (0..params.profile.segment_count())
            .map(|_| Mutex::new(()))
            .collect();
        NandMedia {
            segment_order,
            geometry: params.profile.geometry(),
            params,
            timing,
            epoch: Instant::now(),
            inner: Mutex::new(Inner {
                model,
                time: Timeline::default(),
            }),
            store,
        }
    }

    pub fn params(&self) -> &NandParams {
        &self.params
    }

    pub fn profile(&self) -> &Profile {
        &self.params.profile
    }

    pub fn timing(&self) -> Timing {
        self.timing
    }

    /// The image file, or `None` in RAM.
    pub fn path(&self) -> Option<&Path> {
        self.store.path()
    }

    pub fn stats(&self) -> NandStats {
        self.lock().model.stats()
    }

    /// Where a segment page lives in the array.
    pub fn locate(&self, segment: SegmentId, page: PageIndex) -> PageAddress {
        self.lock().model.locate(segment.0, page.0)
    }

    /// Starts a host operation issued at `issue_ns` (virtual clock only).
    /// Media calls until [`NandMedia::end_op`] are scheduled no earlier
    /// than the operation's cursor, and each moves the cursor to when the
    /// operation may continue.
    pub fn begin_op(&self, issue_ns: u64) {
        self.assert_virtual("begin_op");
        let mut inner = self.lock();
        assert!(!inner.time.in_op, "begin_op while an operation is running");
        inner.time.in_op = true;
        inner.time.cursor_ns = issue_ns;
        inner.model.set_horizon(issue_ns);
    }

    /// Ends the running operation and returns its completion time.
    pub fn end_op(&self) -> u64 {
        self.assert_virtual("end_op");
        let mut inner = self.lock();
        assert!(inner.time.in_op, "end_op without begin_op");
        inner.time.in_op = false;
        inner.time.cursor_ns
    }

    /// Sets the time at which media calls outside an operation are issued
    /// (virtual clock only), e.g. background cleaning between host
    /// operations. Such calls occupy resources but wait for nothing.
    pub fn set_time(&self, now_ns: u64) {
        self.assert_virtual("set_time");
        let mut inner = self.lock();
        inner.time.idle_ns = now_ns;
        inner.model.set_horizon(now_ns);
    }

    /// The current time: the running operation's cursor or the idle time
    /// (virtual), or nanoseconds since the drive was opened (real).
    pub fn now_ns(&self) -> u64 {
        let inner = self.lock();
        self.start_ns(&inner)
    }

    /// When every resource is idle and everything issued so far is durable.
    pub fn idle_at_ns(&self) -> u64 {
        self.lock().model.idle_at_ns()
    }

    fn assert_virtual(&self, what: &str) {
        assert_eq!(
            self.timing,
            Timing::Virtual,
            "{what} needs the virtual clock"
        );
    }

    fn lock(&self) -> Locked<'_> {
        let guard = self.inner.lock().expect("NAND model lock poisoned");
        Locked {
            guard,
            _held: Held::mark("nand"),
        }
    }

    /// Orders `segment`'s store writes (see the module's note on locks).
    /// None for a segment past the medium: the model refuses it.
    fn order(&self, segment: SegmentId) -> Option<MutexGuard<'_, ()>> {
        self.segment_order
            .get(segment.index())
            .map(|order| order.lock().expect("NAND segment order lock poisoned"))
    }

    fn real_now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    fn start_ns(&self, inner: &Inner) -> u64 {
        match self.timing {
            // Real time only moves forward: it is the horizon too .
            Timing::Real => self.real_now_ns(),
            Timing::Virtual if inner.time.in_op => inner.time.cursor_ns,
            Timing::Virtual => inner.time.idle_ns,
        }
    }

    /// Lets the caller continue at `done_ns`: moves the virtual cursor, or
    /// returns the real-time deadline to sleep until once the lock is gone.
    fn settle(&self, mut inner: Locked<'_>, done_ns: u64) -> Option<u64> {
        match self.timing {
            Timing::Virtual => {
                if inner.time.in_op {
                    inner.time.cursor_ns = inner.time.cursor_ns.max(done_ns);
                }
                None
            }
            Timing::Real => Some(done_ns),
        }
    }

    fn wait(&self, deadline_ns: Option<u64>) {
        let Some(deadline_ns) = deadline_ns else {
            return;
        };
        assert_none_held("a modelled wait");
        thread_local! {
            static FINE_SLACK: Cell<bool> = const { Cell::new(false) };
        }
        FINE_SLACK.with(|done| {
            if !done.get() {
                // Linux's default 50 us timer slack would lengthen every
                // modelled wait; 1 us keeps sleeps close to the model.
                // SAFETY: PR_SET_TIMERSLACK only changes this thread's slack.
                unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong, 0, 0, 0) };
                done.set(true);
            }
        });
        loop {
            let now = self.real_now_ns();
            if now >= deadline_ns {
                return;
            }
            std::thread::sleep(Duration::from_nanos(deadline_ns - now));
        }
    }

    /// Runs a timed model step and waits as the clock demands.
    fn timed(&self, step: impl FnOnce(&mut Model, u64) -> u64) {
        let mut inner = self.lock();
        let start = self.start_ns(&inner);
        let done = step(&mut inner.model, start);
        let deadline = self.settle(inner, done);
        self.wait(deadline);
    }

    fn check_read_range(&self, segment: SegmentId, offset: u64, len: usize) -> Result<()> {
        if segment.0 >= self.geometry.segment_count
            || offset
                .checked_add(len as u64)
                .is_none_or(|end| end > self.geometry.segment_size_bytes)
        {
            return Err(Error::CorruptImage(format!(
                "read of {len} bytes at segment {segment} offset {offset} is outside the medium"
            )));
        }
        Ok(())
    }
}

impl Media for NandMedia {
    fn geometry(&self) -> MediaGeometry {
        self.geometry
    }

    fn physical_size_bytes(&self) -> u64 {
        self.geometry.log_capacity_bytes() + 2 * META_SLOT_SIZE_BYTES as u64
    }

    fn write_pages(&self, segment: SegmentId, first_page: PageIndex, data: &[u8]) -> Result<()> {
        let order = self.order(segment);
        let mut inner = self.lock();
        let start = self.start_ns(&inner);
        if self.timing == Timing::Real {
            inner.model.set_horizon(start);
        }
        let programmed = inner
            .model
            .program(start, segment.0, first_page.0, data.len());
        let deadline = self.settle(inner, programmed.continue_ns);
        let offset = first_page.0 as u64 * self.geometry.page_size_bytes as u64;
        self.store.write(segment.0, offset, data)?;
        if programmed.unstaged {
            self.store.unstage(segment.0)?;
        }
        drop(order);
        self.wait(deadline);
        Ok(())
    }

    fn read(&self, segment: SegmentId, offset_bytes: u64, buf: &mut [u8]) -> Result<()> {
        let mut one = [ReadRange {
            segment,
            offset_bytes,
            buf,
        }];
        self.read_batch(&mut one)
            .pop()
            .expect("one result per range")
    }

    /// All ranges are issued at once, as a controller dispatches the page
    /// reads of a command to every die at the same time; the batch
    /// completes with its slowest page.
    fn read_batch(&self, reads: &mut [ReadRange<'_>]) -> Vec<Result<()>> {
        let checks: Vec<Result<()>> = reads
            .iter()
            .map(|r| self.check_read_range(r.segment, r.offset_bytes, r.buf.len()))
            .collect();
        let mut inner = self.lock();
        let start = self.start_ns(&inner);
        if self.timing == Timing::Real {
            inner.model.set_horizon(start);
        }
        let page_size = self.geometry.page_size_bytes as u64;
        let mut done = start;
        let mut overlays = Vec::with_capacity(reads.len());
        for (r, check) in reads.iter().zip(&checks) {
            if check.is_err() {
                overlays.push(None);
                continue;
            }
            let len = r.buf.len() as u64;
            done = done.max(inner.model.read(start, r.segment.0, r.offset_bytes, len));
            let staged = inner.model.staged(r.segment.0).and_then(|(page, data)| {
                let begin = page as u64 * page_size;
                let end = begin + data.len() as u64;
                (begin < r.offset_bytes + len && end > r.offset_bytes)
                    .then(|| (begin, data.to_vec()))
            });
            overlays.push(staged);
        }
        let deadline = self.settle(inner, done);
        let results = reads
            .iter_mut()
            .zip(checks)
            .zip(overlays)
            .map(|((r, check), staged)| {
                check?;
                self.store.read(r.segment.0, r.offset_bytes, r.buf)?;
                if let Some((begin, data)) = staged {
                    // The staged bytes overlay the (unprogrammed, 0xFF) page.
                    let offset = r.offset_bytes;
                    let from = begin.max(offset);
                    let to = (begin + data.len() as u64).min(offset + r.buf.len() as u64);
                    r.buf[(from - offset) as usize..(to - offset) as usize]
                        .copy_from_slice(&data[(from - begin) as usize..(to - begin) as usize]);
                }
                Ok(())
            })
            .collect();
        self.wait(deadline);
        results
    }

    fn erase_segment(&self, segment: SegmentId) -> Result<()> {
        // The segment's order lock is held until the store is erased, so
        // no program of the fresh segment can reach the store before the
        // erase does; reads go on meanwhile.
        let order = self.order(segment);
        let mut inner = self.lock();
        let start = self.start_ns(&inner);
        let dropped_staged = inner.model.erase(start, segment.0);
        let counts = inner.model.erase_counts_of(segment.0).to_vec();
        let deadline = self.settle(inner, start);
        self.store.erase(segment.0)?;
        self.store.save_erase_counts(segment.0, &counts)?;
        if dropped_staged {
            self.store.unstage(segment.0)?;
        }
        drop(order);
        self.wait(deadline);
        Ok(())
    }

    fn sync(&self) -> Result<()> {
        let mut inner = self.lock();
        let start = self.start_ns(&inner);
        let done = inner.model.sync(start);
        let deadline = self.settle(inner, done);
        // The host file's own flush overlaps the modelled wait.
        self.store.sync()?;
        self.wait(deadline);
        Ok(())
    }

    fn write_meta_slot(&self, slot: usize, data: &[u8]) -> Result<()> {
        assert!(slot < 2, "metadata slot {slot} does not exist");
        assert!(
            data.len() <= META_SLOT_SIZE_BYTES as usize,
            "metadata record of {} bytes exceeds the slot",
            data.len()
        );
        self.timed(|model, start| {
            model.meta_write(start);
            start
        });
        self.store.write_meta(slot, data)
    }

    fn read_meta_slot(&self, slot: usize) -> Result<Vec<u8>> {
        assert!(slot < 2, "metadata slot {slot} does not exist");
        self.store.read_meta(slot)
    }

    fn describe(&self) -> String {
        let place = match self.store.path() {
            Some(path) => format!("image {}", path.display()),
            None => "RAM".to_string(),
        };
        let timing = match self.timing {
            Timing::Real => "real time",
            Timing::Virtual => "virtual time",
        };
        format!(
            "emulated NAND drive {} ({place}, {timing})",
            self.params.profile.name
        )
    }

    fn drive(&self) -> Option<&dyn DriveModel> {
        Some(self)
    }
}

impl DriveModel for NandMedia {
    fn host_transfer(&self, direction: HostDirection, bytes: u64) {
        self.timed(|model, start| model.host_transfer(start, direction, bytes));
    }

    fn power_loss_protection(&self) -> bool {
        self.params.config.power_loss_protection
    }

    fn stage_partial_page(&self, segment: SegmentId, page: PageIndex, data: &[u8]) -> Result<()> {
        if !self.params.config.power_loss_protection {
            return Err(Error::Unsupported(format!(
                "emulated drive {} is configured without power-loss protection",
                self.params.profile.name
            )));
        }
        // Persisted under the segment's order lock (not the model's), so
        // an erase or a program of the segment cannot interleave.
        let _order = self.order(segment);
        self.lock().model.stage(segment.0, page.0, data);
        self.store.stage(segment.0, page.0, data)
    }

    fn segment_recycled(&self, segment_bytes: u64, relocated_bytes: u64) {
        self.timed(|model, start| model.recycle(start, segment_bytes, relocated_bytes));
    }

    fn recycling_ready(&self) -> bool {
        let inner = self.lock();
        let now = self.start_ns(&inner);
        inner.model.recycling_ready(now)
    }

    fn wear(&self) -> zdisk_core::Wear {
        let inner = self.lock();
        let stats = inner.model.stats();
        zdisk_core::Wear {
            blocks_erased: inner.model.erase_count_total(),
            erase_count_min: stats.erase_count_min,
            erase_count_max: stats.erase_count_max,
            erase_count_mean: stats.erase_count_mean,
        }
    }
}

impl VirtualTime for NandMedia {
    fn begin_op(&self, issue_ns: u64) {
        NandMedia::begin_op(self, issue_ns);
    }

    fn end_op(&self) -> u64 {
        NandMedia::end_op(self)
    }
}

/// The lock discipline (issue #23): reads take no lock a store write holds,
/// and in debug builds any store I/O or modelled sleep under a marked lock
/// panics.
#[cfg(test)]
mod tests {
    use std::sync::{mpsc, Arc};
    use std::time::Duration;

    use super::*;
    use crate::profile::NandParams;

    fn drive(timing: Timing) -> NandMedia {
        let params = NandParams::named("tiny").expect("the tiny profile");
        let drive = NandMedia::new_in_memory(params, timing).expect("a RAM drive");
        for segment in 0..2 {
            drive.erase_segment(SegmentId(segment)).expect("erase");
        }
        drive
    }

    fn page(fill: u8, drive: &NandMedia) -> Vec<u8> {
        vec![fill; drive.geometry().page_size_bytes as usize]
    }

    #[test]
    fn a_read_takes_no_lock_a_store_write_holds() {
        let drive = Arc::new(drive(Timing::Virtual));
        drive
            .write_pages(SegmentId(1), PageIndex(0), &page(7, &drive))
            .expect("program");
        // As a program or erase of segment 1 holds it during its store I/O.
        let order = drive.order(SegmentId(1)).expect("segment 1 exists");
        let reader = drive.clone();
        let (done, finished) = mpsc::channel();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 4096];
            let read = reader.read(SegmentId(1), 0, &mut buf).map(|()| buf);
            let _ = done.send(read);
        });
        // Not a speed bound: a read that waited for the lock would never end.
        let read = finished
            .recv_timeout(Duration::from_secs(60))
            .expect("the read waited for segment 1's store writes")
            .expect("the read succeeds");
        assert!(read.iter().all(|&byte| byte == 7), "the programmed page");
        drop(order);
    }

    #[cfg(any(debug_assertions, zdisk_lock_checks))]
    #[test]
    #[should_panic(expected = "a NAND store read while holding the nand lock")]
    fn store_io_under_the_model_lock_panics() {
        let drive = drive(Timing::Virtual);
        let _inner = drive.lock();
        let mut buf = vec![0u8; 512];
        let _ = drive.store.read(0, 0, &mut buf);
    }

    #[cfg(any(debug_assertions, zdisk_lock_checks))]
    #[test]
    #[should_panic(expected = "a NAND store read while holding the state lock")]
    fn a_read_under_a_callers_marked_lock_panics() {
        let drive = drive(Timing::Virtual);
        let _state = Held::mark("state");
        let mut buf = vec![0u8; 512];
        let _ = drive.read(SegmentId(0), 0, &mut buf);
    }

    #[cfg(any(debug_assertions, zdisk_lock_checks))]
    #[test]
    #[should_panic(expected = "a modelled wait while holding the state lock")]
    fn a_real_time_wait_under_a_marked_lock_panics() {
        let drive = drive(Timing::Real);
        let _state = Held::mark("state");
        drive.host_transfer(HostDirection::Read, 4096);
    }
}
