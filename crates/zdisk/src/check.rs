//! `zdisk check`: verify an image at rest, and optionally repair it.
//!
//! Exit status follows e2fsck: 0 clean, 1 damage found and repaired,
//! 4 damage or broken invariants remain.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use zdisk_core::OpenOptions;

use crate::args::CheckArgs;
use crate::output::say;

pub fn run(args: &CheckArgs) -> Result<ExitCode, String> {
    let options = OpenOptions {
        read_only: !args.repair,
        background: false,
        // Repair is how an operator accepts a lost checkpoint.
        accept_lost_checkpoint: args.repair,
        ..OpenOptions::default()
    };
    let volume = crate::image::open(&args.image, options)?;
    let opened = volume.open_report();
    let mut progress = Progress::new();
    let mut report_progress = |done: u64, total: u64| progress.show(done, total);
    let checked = if args.repair {
        volume.repair_with_progress(&mut report_progress)
    } else {
        volume.check_with_progress(true, &mut report_progress)
    };
    progress.finish();
    let report = checked.map_err(|e| e.to_string())?;
    if args.repair {
        volume.close().map_err(|e| e.to_string())?;
    }
    if args.json {
        let json = serde_json::json!({
            "image": args.image,
            "clean": report.is_clean(),
            "open": opened,
            "report": report,
        });
        say!(
            "{}",
            serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?
        )?;
    } else {
        for problem in &opened.slot_problems {
            say!("metadata: {problem}")?;
        }
        if opened.replayed_records > 0 {
            // Replay follows an unclean stop, or a newest root that could
            // not be used (damaged after a clean stop, say): recovery then
            // starts from an older one.
            let why = if opened.slot_problems.is_empty() && opened.lost_checkpoints.is_empty() {
                "the image was not shut down cleanly"
            } else {
                "the newest metadata could not be used, so recovery started from an older checkpoint"
            };
            say!(
                "log: replayed {} records from {} segments ({why})",
                opened.replayed_records,
                opened.replayed_segments
            )?;
        }
        // A crash's torn, unacknowledged writes leave these too (a page
        // that never reached the medium between two that did), so they
        // cannot count as damage; after a clean stop, or with an intact
        // newest root, they would not be read at all.
        for damage in &opened.replay_damage {
            say!("log: recovery skipped an unreadable record (torn by a crash, or damaged): {damage}")?;
        }
        say!(
            "verified {} extents ({} bytes)",
            report.extents_verified,
            report.bytes_verified
        )?;
        for error in &report.errors {
            say!("invariant violated: {error}")?;
        }
        for lost in &report.lost {
            say!("lost: {lost}")?;
        }
        for lost in &report.accepted_lost {
            say!("repaired: accepted the loss of {lost}; a new checkpoint replaces it")?;
        }
        if !report.damaged_blocks.is_empty() {
            say!(
                "damaged blocks ({}): {}",
                report.damaged_blocks.len(),
                list(&report.damaged_blocks)
            )?;
        }
        if !report.repaired_blocks.is_empty() {
            say!(
                "repaired: dropped {} damaged blocks, which now read as zeros: {}",
                report.repaired_blocks.len(),
                list(&report.repaired_blocks)
            )?;
        }
        if report.is_clean() && report.repaired_blocks.is_empty() && report.accepted_lost.is_empty()
        {
            say!("{}: clean", args.image.display())?;
        }
    }
    Ok(if !report.is_clean() {
        ExitCode::from(4)
    } else if !report.repaired_blocks.is_empty() || !report.accepted_lost.is_empty() {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// A progress line on standard error, when it is a terminal: rewritten in
/// place at most ten times a second, and erased at the end.
struct Progress {
    terminal: bool,
    shown: Option<Instant>,
}

impl Progress {
    fn new() -> Progress {
        Progress {
            terminal: std::io::stderr().is_terminal(),
            shown: None,
        }
    }

    fn show(&mut self, done: u64, total: u64) {
        if !self.terminal || total == 0 {
            return;
        }
        if self
            .shown
            .is_some_and(|at| at.elapsed() < Duration::from_millis(100))
            && done < total
        {
            return;
        }
        self.shown = Some(Instant::now());
        let percent = done * 100 / total;
        let _ = write!(
            std::io::stderr(),
            "\rverifying: {percent:>3}% ({done} of {total} blocks)"
        );
    }

    fn finish(&mut self) {
        if self.terminal && self.shown.is_some() {
            // Erase the line: the report follows on standard output.
            let _ = write!(std::io::stderr(), "\r\x1b[K");
        }
    }
}

fn list(blocks: &[u64]) -> String {
    blocks
        .iter()
        .map(|b| b.to_string())
        .collect::<Vec<_>>()
        .join(" ")
}
