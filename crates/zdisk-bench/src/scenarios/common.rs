//! What the scenarios share: their outcome, their settings, formatting and
//! sizing helpers.

use serde_json::Value;

use zdisk_core::BLOCK_SIZE;

use crate::drive::Drive;
use crate::driver::Target;
use crate::pattern::Pattern;

pub(crate) const KIB: u64 = 1024;
pub(crate) const MIB: u64 = 1024 * KIB;

/// A scenario's outcome.
#[derive(Default)]
pub struct Outcome {
    /// The scenario's object (also what the chart is drawn from).
    pub json: Value,
    /// Table: header, then rows.
    pub table: Vec<Vec<String>>,
    /// JSON lines written instead of `json`, one per measurement, when a
    /// scenario's figures are rows rather than one object.
    pub lines: Vec<Value>,
    /// Further tables, each under its caption.
    pub tables: Vec<(String, Vec<Vec<String>>)>,
}

/// Knobs shared by the scenarios.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Bytes moved per measurement (scaled down to fit the drive).
    pub size_bytes: u64,
    pub patterns: Vec<Pattern>,
    /// How the dirty scenario dirties the drive: sequential or random 4 KiB writes.
    pub dirty_fill_random: bool,
    /// Spare factors for the write-amplification scenario.
    pub spares: Vec<f64>,
    /// The file-copy scenario's source drive read rate (`None`: unlimited).
    pub copy_source_bytes_per_sec: Option<u64>,
    /// The threads scenario: thread counts (empty: 1, 2, 4 … up to the
    /// host's CPUs, and 4), and seconds per measurement.
    pub threads: Vec<usize>,
    pub seconds: f64,
    pub seed: u64,
}

pub(crate) fn mb(value: f64) -> String {
    if value.is_finite() {
        format!("{value:.1}")
    } else {
        "no time".into()
    }
}

pub(crate) fn count(value: f64) -> String {
    if value.is_finite() {
        format!("{value:.0}")
    } else {
        "no time".into()
    }
}

pub(crate) fn ratio(value: Option<f64>) -> String {
    value.map_or("-".into(), |v| format!("{v:.3}"))
}

pub(crate) fn logical_of(target: &Target) -> u64 {
    target.volume.superblock().logical_size_bytes
}

pub(crate) fn round_down(value: u64, unit: u64) -> u64 {
    value / unit * unit
}

/// Bytes of incompressible data a drive's log can hold and still be
/// rewritten: the log less the segments zdisk keeps back, less room for
/// the cleaner to work in (2 segments, or 1/32 of them), less the record
/// headers.
pub(crate) fn incompressible_capacity(drive: &dyn Drive, log_capacity: u64) -> u64 {
    let (segment, _) = drive.segment_and_page();
    let segments = log_capacity.div_ceil(segment);
    let block = BLOCK_SIZE as u64;
    let blocks = log_capacity / block;
    let overhead = zdisk_core::Volume::overhead_segments_for(blocks, segments, segment);
    let working_room = (segments / 32).max(2);
    // Records do not straddle segments.
    let usable = segments.saturating_sub(overhead + working_room);
    usable * (segment / zdisk_core::record::RAW_RECORD_LEN) * block
}
