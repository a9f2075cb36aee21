//! The cold-data pass: the one owner of what the engine does with data
//! nobody is writing or reading.
//!
//! While the volume is idle (no host request for `idle_after`), the
//! background thread takes one *idle step* at a time, within a budget of
//! CPU and I/O ([`IdleBudget`]): it compacts the emptiest sealed segment if
//! at most half of it lives, else (with [`Recompress::Idle`] or `Gc`) it
//! rewrites the sealed segment with the oldest data the pass has not
//! rewritten yet, unless a host read needed it within `read_warm_for`.
//! A rewrite decompresses every live block and compresses runs of
//! consecutive blocks again with [`COLD_CODEC`] in units of up to
//! [`COLD_UNIT_BLOCKS`], each block keeping its version
//! ([`plan_recompress`]); the cleaner's relocation and release carry it out
//! (`clean.rs`). With `Recompress::Gc` the background cleaner also
//! rewrites a cold victim this way.
//!
//! This module holds the pass's state ([`ColdPass`]: when the host last
//! came, which segments it read lately, the checkpoints the pass wrote),
//! its budget, its choice of victims ([`idle_choice`]) and its rewrite.
//! Time comes from `OpenOptions::clock`, handed to [`ColdPass`] as `now`.
//!
//! Invariants: the pass never runs while the host is active (any request
//! resets the idle timer); it writes at most two checkpoints between
//! rewrites (recovery from the older root counts too), so a candidate
//! that keeps needing one cannot make it loop; data read lately is never
//! recompressed, and stays marked as read where it moves.

use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::codec::{decompress_exact, Codec};
use crate::error::Result;
use crate::record::{decode_unit, RecordKey, RecordKind};
use crate::segments::{SegmentInfo, SegmentState};
use crate::units::{SegmentId, BLOCK_SIZE};

use super::clean::{victim_of, Cleaning};
use super::moves::{compress_run, decompress_unit, plan_record, split_raw, LiveExtent, Move};
use super::state::{State, StreamKind};
use super::Volume;

/// The largest unit the cold-data pass writes (32 KiB). On the /usr tar
/// (lz4 at first, 292 MiB), 32 KiB units stored 230 MiB and served 4 KiB
/// random reads at 147 MB/s; 64 KiB units 225 MiB at 96 MB/s; 128 KiB
/// units 221 MiB at 66 MB/s.
pub(crate) const COLD_UNIT_BLOCKS: u8 = 8;

/// The codec the cold-data pass compresses with: slower than a volume's
/// everyday codec, and worth it for data that is not going to change.
pub(crate) const COLD_CODEC: Codec = Codec::Zstd { level: 9 };

/// Checkpoints the pass may write in a row without rewriting a segment.
const CHECKPOINTS_BETWEEN_REWRITES: u32 = 2;

/// When data found cold is rewritten in larger units with a stronger
/// codec, so that a volume's ratio improves over time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Recompress {
    /// Never.
    Off,
    /// When the volume is idle: a background pass with a CPU budget
    /// rewrites cold segments, and compacts mostly dead ones.
    #[default]
    Idle,
    /// Also whenever the background cleaner relocates a cold victim.
    Gc,
}

impl Recompress {
    pub fn parse(text: &str) -> std::result::Result<Recompress, String> {
        match text {
            "off" => Ok(Recompress::Off),
            "idle" => Ok(Recompress::Idle),
            "gc" => Ok(Recompress::Gc),
            other => Err(format!(
                "unknown recompress mode {other:?}: use off, idle or gc"
            )),
        }
    }
}

impl fmt::Display for Recompress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Recompress::Off => "off",
            Recompress::Idle => "idle",
            Recompress::Gc => "gc",
        })
    }
}

/// The idle pass's share of the machine: after each step it pauses long
/// enough that its CPU time stays within `cpu_share` of one core and the
/// bytes it reads and writes within `io_bytes_per_sec`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IdleBudget {
    /// Fraction of one core, above 0 and at most 1.
    pub cpu_share: f64,
    /// Bytes per second the pass may read and write together.
    pub io_bytes_per_sec: u64,
}

impl Default for IdleBudget {
    fn default() -> Self {
        IdleBudget {
            cpu_share: 0.5,
            io_bytes_per_sec: 64 << 20,
        }
    }
}

impl IdleBudget {
    /// The pause after a step that took `busy` and moved `io_bytes`.
    pub fn pause_after(&self, busy: Duration, io_bytes: u64) -> Duration {
        let share = self.cpu_share.clamp(0.01, 1.0);
        let for_cpu = busy.mul_f64((1.0 - share) / share);
        let for_io = match self.io_bytes_per_sec {
            0 => Duration::ZERO,
            rate => Duration::from_secs_f64(io_bytes as f64 / rate as f64).saturating_sub(busy),
        };
        for_cpu.max(for_io)
    }
}

/// The pass's state, kept without the state lock (host requests update it
/// on their way in). Every method takes the current reading of the
/// volume's monotonic clock.
pub(crate) struct ColdPass {
    /// The clock's reading at the last host request, in nanoseconds.
    last_host_io_nanos: AtomicU64,
    /// Checkpoints the pass wrote since it last rewrote a segment.
    checkpoints: AtomicU32,
    /// Per segment: when a host read last needed one of its records, in
    /// whole seconds of the clock plus one (0: not since the volume
    /// opened). Not persisted: after a restart all data counts as unread.
    read_secs: Vec<AtomicU32>,
}

/// A clock reading as the whole seconds plus one that `read_secs` keeps.
fn mark_of(now: Duration) -> u32 {
    u32::try_from(now.as_secs())
        .unwrap_or(u32::MAX - 1)
        .saturating_add(1)
}

impl ColdPass {
    pub(crate) fn new(segment_count: u32, now: Duration) -> ColdPass {
        ColdPass {
            last_host_io_nanos: AtomicU64::new(now.as_nanos() as u64),
            checkpoints: AtomicU32::new(0),
            read_secs: (0..segment_count).map(|_| AtomicU32::new(0)).collect(),
        }
    }

    /// A host request came: the volume is not idle. A write also lets the
    /// pass checkpoint again.
    pub(crate) fn host_io(&self, write: bool, now: Duration) {
        if write {
            self.checkpoints.store(0, Ordering::Relaxed);
        }
        self.last_host_io_nanos
            .store(now.as_nanos() as u64, Ordering::Relaxed);
    }

    /// No host request for `idle_after`.
    pub(crate) fn is_idle(&self, now: Duration, idle_after: Duration) -> bool {
        let last = self.last_host_io_nanos.load(Ordering::Relaxed);
        (now.as_nanos() as u64).saturating_sub(last) >= idle_after.as_nanos() as u64
    }

    /// A host read needed a record in `segment`.
    pub(crate) fn segment_read(&self, segment: SegmentId, now: Duration) {
        if let Some(mark) = self.read_secs.get(segment.index()) {
            mark.store(mark_of(now), Ordering::Relaxed);
        }
    }

    /// A host read needed a record in `segment` within `warm_for` (at
    /// least a second: marks are whole seconds).
    pub(crate) fn read_recently(
        &self,
        segment: SegmentId,
        now: Duration,
        warm_for: Duration,
    ) -> bool {
        let mark = self
            .read_secs
            .get(segment.index())
            .map_or(0, |mark| mark.load(Ordering::Relaxed));
        mark != 0 && u64::from(mark_of(now).saturating_sub(mark)) < warm_for.as_secs().max(1)
    }

    /// The pass rewrites a segment: it may checkpoint again afterwards.
    fn rewriting(&self) {
        self.checkpoints.store(0, Ordering::Relaxed);
    }

    /// The pass wants a checkpoint first: true if it may write one.
    fn may_checkpoint(&self) -> bool {
        let written = self.checkpoints.fetch_add(1, Ordering::Relaxed);
        debug_assert!(written < u32::MAX / 2, "checkpoint count runs away");
        written < CHECKPOINTS_BETWEEN_REWRITES
    }
}

/// What the idle pass does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IdleChoice {
    /// Compact or recompress this sealed segment.
    Victim(SegmentId),
    /// The candidates hold range records a recovery may still replay.
    CheckpointFirst,
    /// Nothing to rewrite; cleaned segments wait for a barrier.
    Release,
    Nothing,
}

/// The idle pass's next move: the emptiest sealed segment if at most half
/// of it lives, else, when it may `recompress`, the one with the oldest
/// data not yet rewritten by the cold-data pass (at most half of its live
/// bytes are) and not read lately (`read_recently`).
/// True if the pass would still recompress a segment like this: it holds
/// live data, and less than half of it is the pass's own.
fn awaits_recompression(info: &SegmentInfo) -> bool {
    info.live_bytes > 0 && info.cold_bytes < info.live_bytes / 2
}

/// What the cold-data pass has yet to do, from the segment table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Pending {
    /// Live stored bytes in segments it has yet to recompress.
    pub bytes: u64,
    /// Of those, the bytes written below full effort, estimated per segment
    /// as its live share of what was appended fast.
    pub fast_bytes: u64,
}

/// What the cold-data pass has yet to rewrite (nothing if it is off).
pub(crate) fn pending(state: &State, recompress: bool) -> Pending {
    let mut pending = Pending::default();
    if !recompress {
        return pending;
    }
    let in_use =
        |info: &&SegmentInfo| matches!(info.state, SegmentState::Open | SegmentState::Sealed);
    for (_, info) in state.space().table().iter() {
        if !in_use(&info) || !awaits_recompression(info) {
            continue;
        }
        pending.bytes += info.live_bytes;
        if info.fast_bytes > 0 && info.fill_bytes > 0 {
            let share = info.fast_bytes as u128 * info.live_bytes as u128 / info.fill_bytes as u128;
            pending.fast_bytes += (share as u64).min(info.live_bytes);
        }
    }
    pending
}

pub(crate) fn idle_choice(
    state: &State,
    recompress: bool,
    read_recently: &dyn Fn(SegmentId) -> bool,
) -> IdleChoice {
    let half = state.segment_size_bytes() / 2;
    let sealed = || {
        state
            .space()
            .table()
            .iter()
            .filter(|(_, info)| info.state == SegmentState::Sealed)
    };
    let emptiest = sealed()
        .filter(|(_, info)| info.live_bytes <= half)
        .min_by_key(|(_, info)| info.live_bytes);
    // What was written at fast effort first (issue #27), then the oldest.
    let oldest_warm = sealed()
        .filter(|_| recompress)
        .filter(|(_, info)| awaits_recompression(info))
        .filter(|(segment, _)| !read_recently(*segment))
        .min_by_key(|(_, info)| (info.fast_bytes == 0, info.max_version));
    match emptiest.or(oldest_warm) {
        // Nothing a recovery would replay is copied (`Volume::clean_one_by`
        // says why).
        Some((segment, info))
            if (info.holds_ranges || info.live_bytes > 0) && state.needed_by_recovery(segment) =>
        {
            IdleChoice::CheckpointFirst
        }
        Some((segment, _)) => IdleChoice::Victim(segment),
        None if state.space().reclaimable_count() > 0 => IdleChoice::Release,
        None => IdleChoice::Nothing,
    }
}

impl Volume {
    fn now(&self) -> Duration {
        self.options.clock.monotonic()
    }

    /// A host request came (see [`ColdPass::host_io`]).
    pub(super) fn note_host_io(&self, write: bool) {
        self.cold.host_io(write, self.now());
    }

    /// A host read needed a record in `segment`.
    pub(super) fn note_segment_read(&self, segment: SegmentId) {
        self.cold.segment_read(segment, self.now());
    }

    /// A host read needed a record in `segment` within
    /// `options.read_warm_for`.
    fn read_recently(&self, segment: SegmentId) -> bool {
        self.cold
            .read_recently(segment, self.now(), self.options.read_warm_for)
    }

    /// The idle pass has something it may do: compact, or recompress.
    fn idle_pass_enabled(&self) -> bool {
        self.options.idle_compact || self.options.recompress != Recompress::Off
    }

    /// Whether cleaning `victim_cold` data for `who` rewrites it with the
    /// cold codec: with `Recompress::Gc`, the background cleaner does.
    pub(super) fn recompress_when_cleaning(&self, who: Cleaning, victim_cold: bool) -> bool {
        who == Cleaning::Background && self.options.recompress == Recompress::Gc && victim_cold
    }

    /// The background thread's turn of the pass, when the cleaner had
    /// nothing to do: one idle step if the volume is idle, and the pause
    /// the budget asks for after it. Returns whether work was done with
    /// no pause owed (then the thread goes on at once), and the pause.
    pub(super) fn cold_turn(&self) -> (bool, Duration) {
        let mut pause = Duration::from_millis(100);
        if !self.idle_pass_enabled() || !self.cold.is_idle(self.now(), self.options.idle_after) {
            return (false, pause);
        }
        // Within the idle budget: a pause as long as the step's CPU time
        // and the bytes it moved ask for (real time: the budget is a
        // share of the machine).
        let started = Instant::now();
        let moved = |volume: &Volume| {
            let counters = volume.lock().counters();
            counters.gc_read_bytes + counters.gc_write_bytes
        };
        let moved_before = moved(self);
        let mut worked = false;
        if self.idle_step().unwrap_or(false) {
            let io_bytes = moved(self).saturating_sub(moved_before);
            pause = self
                .options
                .idle_budget
                .pause_after(started.elapsed(), io_bytes);
            worked = pause.is_zero();
        }
        (worked, pause)
    }

    /// One step of the idle pass (the volume idle): compacts the emptiest
    /// sealed segment if at most half of it lives (`idle_compact`, or any
    /// `Recompress` mode but `Off`), otherwise, with `Recompress::Idle` or
    /// `Gc`, rewrites the one with the oldest data the pass has not
    /// rewritten yet. The pass never scans a victim for range records:
    /// while its candidates hold some a recovery may still replay, it
    /// writes a checkpoint first (two at most: the older root's recovery
    /// counts too). When nothing is left, a flush releases what it
    /// cleaned. Returns false if there was nothing worth doing or no room
    /// to do it in.
    pub fn idle_step(&self) -> Result<bool> {
        let recompress = self.options.recompress != Recompress::Off;
        if self.read_only || !(recompress || self.options.idle_compact) {
            return Ok(false);
        }
        let maintenance = self.maintenance.lock().expect("maintenance lock poisoned");
        let choice = {
            let state = self.lock();
            state.check_writable()?;
            idle_choice(&state, recompress, &|segment| self.read_recently(segment))
        };
        match choice {
            IdleChoice::Victim(segment) => {
                let Some(state) = self.room_to_relocate(segment, 0, &[])? else {
                    return Ok(false);
                };
                let mut victim = victim_of(&state, segment);
                drop(state);
                // Compacting a segment being read keeps its codec: data
                // being read is not cold, and stays warm where it goes
                // (the GC stream's segment before and after the move:
                // half a segment fits in two).
                let warm = self.read_recently(segment);
                victim.recompress = recompress && !warm;
                self.cold.rewriting();
                let gc_segment = || self.lock().streams()[StreamKind::Gc as usize].segment;
                let target_before = gc_segment();
                let cleaned = self.clean_victim(&victim);
                if warm {
                    for target in [target_before, gc_segment()].into_iter().flatten() {
                        self.note_segment_read(target);
                    }
                }
                cleaned
            }
            IdleChoice::CheckpointFirst => {
                if !self.cold.may_checkpoint() {
                    return Ok(false);
                }
                drop(maintenance);
                self.checkpoint()?;
                Ok(true)
            }
            IdleChoice::Release => {
                drop(maintenance);
                self.flush()?;
                Ok(true)
            }
            IdleChoice::Nothing => Ok(false),
        }
    }

    /// The cold rewrite of a victim's live `records` (see
    /// [`plan_recompress`]), in units no larger than its segment allows.
    pub(super) fn plan_cold(
        &self,
        seq32: u32,
        records: &[(Option<&[u8]>, &[LiveExtent])],
    ) -> Vec<Move> {
        let units = crate::record::unit_blocks_for_segment(self.geometry.segment_size_bytes)
            .min(COLD_UNIT_BLOCKS);
        plan_recompress(&self.record_key, seq32, records, COLD_CODEC, units as u64)
    }
}

/// Plans the cold-data rewrite of a victim's live records (`records`:
/// each one's bytes as read, `None` if unreadable, and its live blocks):
/// every live block is decompressed, and runs of consecutive blocks,
/// across the records they came from, are compressed again with `codec`
/// in units of up to `unit_blocks` (aligned to multiples of it). Records
/// that are already such rewrites, and still whole, are copied as they
/// are; records that fail verification are marked damaged.
pub(crate) fn plan_recompress(
    key: &RecordKey,
    seq32: u32,
    records: &[(Option<&[u8]>, &[LiveExtent])],
    codec: Codec,
    unit_blocks: u64,
) -> Vec<Move> {
    let mut moves = Vec::new();
    // Live blocks to rewrite: (extent, decompressed block), by block.
    let mut blocks: Vec<(LiveExtent, Vec<u8>)> = Vec::new();
    for &(bytes, live) in records {
        let plan = plan_record(key, seq32, bytes, live, codec);
        let Move::Copy {
            header, payload, ..
        } = &plan
        else {
            // A partly live unit (rewritten below from its blocks anyway)
            // or damage.
            match plan {
                Move::Rewrite(records, _) => blocks.extend(
                    records
                        .into_iter()
                        .flat_map(|r| split_raw(&r).into_iter().collect::<Vec<_>>()),
                ),
                damaged => moves.push(damaged),
            }
            continue;
        };
        let unit = (header.kind == RecordKind::Unit)
            .then(|| decode_unit(header, payload).expect("verified by plan_record"));
        if unit.as_ref().is_some_and(|u| u.recompressed) {
            moves.push(plan);
            continue;
        }
        let raw = match &unit {
            Some(unit) => decompress_unit(header, unit.data, unit.count()),
            None => header.codec_id().and_then(|id| {
                let mut block = vec![0u8; BLOCK_SIZE];
                decompress_exact(id, payload, &mut block)
                    .ok()
                    .map(|()| block)
            }),
        };
        let Some(raw) = raw else {
            moves.push(Move::Damaged(
                live.iter().map(|&(lba, loc, _)| (lba, loc)).collect(),
            ));
            continue;
        };
        for &extent in live {
            let member = extent.1.member as usize;
            blocks.push((
                extent,
                raw[member * BLOCK_SIZE..(member + 1) * BLOCK_SIZE].to_vec(),
            ));
        }
    }
    blocks.sort_by_key(|((lba, _, _), _)| lba.0);
    let mut start = 0;
    while start < blocks.len() {
        // Consecutive blocks, within one aligned window of `unit_blocks`.
        let window = blocks[start].0 .0 .0 / unit_blocks;
        let mut end = start + 1;
        while end < blocks.len()
            && blocks[end].0 .0 .0 == blocks[end - 1].0 .0 .0 + 1
            && blocks[end].0 .0 .0 / unit_blocks == window
        {
            end += 1;
        }
        let run: Vec<LiveExtent> = blocks[start..end].iter().map(|(e, _)| *e).collect();
        let versions: Vec<u64> = run.iter().map(|&(_, _, v)| v).collect();
        let raw: Vec<u8> = blocks[start..end]
            .iter()
            .flat_map(|(_, b)| b.iter().copied())
            .collect();
        moves.push(Move::Rewrite(
            compress_run(&raw, &run, &versions, codec, true),
            codec,
        ));
        start = end;
    }
    moves
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: Duration = Duration::from_secs(1);

    #[test]
    fn the_volume_is_idle_only_once_no_request_came_for_idle_after() {
        let pass = ColdPass::new(8, 10 * SEC);
        let idle_after = 5 * SEC;
        assert!(!pass.is_idle(14 * SEC, idle_after));
        assert!(pass.is_idle(15 * SEC, idle_after));
        // A read counts as much as a write.
        pass.host_io(false, 20 * SEC);
        assert!(!pass.is_idle(24 * SEC, idle_after));
        assert!(pass.is_idle(25 * SEC, idle_after));
    }

    #[test]
    fn a_segment_read_is_warm_for_read_warm_for_and_others_stay_cold() {
        let pass = ColdPass::new(8, Duration::ZERO);
        let warm_for = 60 * SEC;
        assert!(!pass.read_recently(SegmentId(3), Duration::ZERO, warm_for));
        pass.segment_read(SegmentId(3), 100 * SEC);
        assert!(pass.read_recently(SegmentId(3), 159 * SEC, warm_for));
        assert!(!pass.read_recently(SegmentId(3), 160 * SEC, warm_for));
        assert!(!pass.read_recently(SegmentId(2), 100 * SEC, warm_for));
        // A read at the clock's first second still counts (marks are +1).
        pass.segment_read(SegmentId(0), Duration::ZERO);
        assert!(pass.read_recently(SegmentId(0), Duration::ZERO, Duration::ZERO));
        // A segment beyond the volume is never warm, and marking it is harmless.
        pass.segment_read(SegmentId(8), SEC);
        assert!(!pass.read_recently(SegmentId(8), SEC, warm_for));
    }

    #[test]
    fn the_pass_writes_at_most_two_checkpoints_until_it_rewrites_or_the_host_writes() {
        let pass = ColdPass::new(8, Duration::ZERO);
        assert!(pass.may_checkpoint());
        assert!(pass.may_checkpoint());
        assert!(!pass.may_checkpoint());
        pass.rewriting();
        assert!(pass.may_checkpoint());
        assert!(pass.may_checkpoint());
        pass.host_io(false, SEC);
        assert!(!pass.may_checkpoint(), "a read changes nothing to recover");
        pass.host_io(true, SEC);
        assert!(pass.may_checkpoint());
    }

    #[test]
    fn the_idle_budget_bounds_cpu_and_io() {
        let budget = IdleBudget {
            cpu_share: 0.5,
            io_bytes_per_sec: 10 << 20,
        };
        let ms = Duration::from_millis;
        // CPU-bound: as long a pause as the step took.
        assert_eq!(budget.pause_after(ms(40), 0), ms(40));
        // IO-bound: 20 MiB at 10 MiB/s is 2 s in all, step included.
        assert_eq!(budget.pause_after(ms(40), 20 << 20), ms(1960));
        let quarter = IdleBudget {
            cpu_share: 0.25,
            io_bytes_per_sec: 0,
        };
        assert_eq!(quarter.pause_after(ms(10), 1 << 30), ms(30));
    }

    #[test]
    fn recompress_modes_parse_as_they_print() {
        for mode in [Recompress::Off, Recompress::Idle, Recompress::Gc] {
            assert_eq!(Recompress::parse(&mode.to_string()), Ok(mode));
        }
        let error = Recompress::parse("always").unwrap_err();
        assert!(error.contains("use off, idle or gc"), "{error}");
    }
}
