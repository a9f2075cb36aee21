//! `zdisk snapshot`, `zdisk clone`, `zdisk volumes` and `zdisk delete`:
//! snapshots and clones of an image, through its server's control socket
//! while it is served (the image is locked then), or by opening the image
//! otherwise.
//!
//! A served image's snapshots are exported read-only, and its clones
//! writable, under their names beside the volume's own export
//! (`serve.rs`); `nbdinfo --list` shows them.

use std::path::Path;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use zdisk_core::units::format_size;
use zdisk_core::{OpenOptions, Volume};

use crate::args::{CloneArgs, CompactArgs, DeleteArgs, SnapshotArgs, VolumesArgs};
use crate::control::{self, AskError};
use crate::output::say;

/// A snapshot as the commands print it (the engine's `Snapshot` and
/// `SnapshotInfo`, as JSON crosses the control socket).
#[derive(Debug, Serialize, Deserialize)]
struct Taken {
    name: String,
    version: u64,
    created_unix_secs: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Listed {
    name: String,
    /// The clone it was taken of (absent: the image's volume).
    #[serde(default)]
    of: Option<String>,
    version: u64,
    created_unix_secs: u64,
    kept_blocks: u64,
    kept_stored_bytes: u64,
    /// What deleting it now would free (absent from an older server's
    /// answer).
    #[serde(default)]
    frees_blocks: u64,
    #[serde(default)]
    frees_stored_bytes: u64,
}

/// A clone as the commands print it (the engine's `CloneInfo`).
#[derive(Debug, Serialize, Deserialize)]
struct ListedClone {
    name: String,
    snapshot: String,
    version: u64,
    created_unix_secs: u64,
    own_blocks: u64,
    own_zero_blocks: u64,
    own_stored_bytes: u64,
    snapshots: Vec<String>,
    /// Blocks of data the clone sees, its own among them, and the rest
    /// (its snapshot's, shared).
    #[serde(default)]
    mapped_blocks: u64,
    #[serde(default)]
    own_data_blocks: u64,
    #[serde(default)]
    shared_blocks: u64,
}

#[derive(Debug, Deserialize)]
struct Listing {
    snapshots: Vec<Listed>,
    clones: Vec<ListedClone>,
}

/// A clone made.
#[derive(Debug, Serialize, Deserialize)]
struct Made {
    name: String,
    version: u64,
    created_unix_secs: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Deleted {
    kind: String,
    handed_down: u64,
    freed: u64,
}

/// What answered: the image's server, or the image opened here.
enum Source {
    Server,
    Image,
}

/// Runs `request` on the server of `image`, or, if nobody serves it,
/// `direct` on the image opened here (writable unless `read_only`).
fn through_server_or_image<T: for<'de> Deserialize<'de>>(
    image: &Path,
    request: &str,
    command: &str,
    read_only: bool,
    direct: impl FnOnce(&Volume) -> Result<T, String>,
) -> Result<(T, Source), String> {
    match control::ask(image, request, command) {
        Ok(reply) => serde_json::from_str(&reply)
            .map(|value| (value, Source::Server))
            .map_err(|e| {
                format!(
                    "the server of {} answered what {command} cannot read ({e})",
                    image.display()
                )
            }),
        Err(AskError::Failed(message)) => Err(message),
        Err(AskError::NotServed(_)) => {
            let options = OpenOptions {
                read_only,
                background: false,
                ..OpenOptions::default()
            };
            let volume = crate::image::open(image, options)?;
            let value = direct(&volume)?;
            if !read_only {
                volume.close().map_err(|e| e.to_string())?;
            }
            Ok((value, Source::Image))
        }
    }
}

/// Checks a name before anything opens: the same rule the engine keeps.
fn check_name(name: &str) -> Result<(), String> {
    zdisk_core::snapshots::check_name(name)
}

pub fn snapshot(args: &SnapshotArgs) -> Result<(), String> {
    check_name(&args.name)?;
    if let Some(clone) = &args.of {
        check_name(clone)?;
    }
    let started = Instant::now();
    let request = match &args.of {
        Some(clone) => format!("snapshot {} {clone}", args.name),
        None => format!("snapshot {}", args.name),
    };
    let (taken, source): (Taken, Source) =
        through_server_or_image(&args.image, &request, "zdisk snapshot", false, |volume| {
            match &args.of {
                Some(clone) => volume.take_snapshot_of(clone, &args.name),
                None => volume.take_snapshot(&args.name),
            }
            .map(|s| Taken {
                name: s.name,
                version: s.version,
                created_unix_secs: s.created_unix_secs,
            })
            .map_err(|e| e.to_string())
        })?;
    let elapsed = started.elapsed();
    if args.json {
        return say!(
            "{}",
            serde_json::to_string_pretty(&taken).map_err(|e| e.to_string())?
        );
    }
    let served = match source {
        Source::Server => format!(
            "; its server exports it read-only as \"{}\" now",
            taken.name
        ),
        Source::Image => format!(
            "; `zdisk serve {}` will export it read-only as \"{}\"",
            args.image.display(),
            taken.name
        ),
    };
    let of = match &args.of {
        Some(clone) => format!("clone {clone} of "),
        None => String::new(),
    };
    say!(
        "took snapshot {} of {of}{} (version {}) in {:.1} ms{served}",
        taken.name,
        args.image.display(),
        taken.version,
        elapsed.as_secs_f64() * 1000.0
    )
}

pub fn clone(args: &CloneArgs) -> Result<(), String> {
    check_name(&args.snapshot)?;
    check_name(&args.name)?;
    let started = Instant::now();
    let request = format!("clone {} {}", args.snapshot, args.name);
    let (made, source): (Made, Source) =
        through_server_or_image(&args.image, &request, "zdisk clone", false, |volume| {
            volume
                .make_clone(&args.snapshot, &args.name)
                .map(|c| Made {
                    name: c.name,
                    version: c.version,
                    created_unix_secs: c.created_unix_secs,
                })
                .map_err(|e| e.to_string())
        })?;
    let elapsed = started.elapsed();
    if args.json {
        return say!(
            "{}",
            serde_json::to_string_pretty(&made).map_err(|e| e.to_string())?
        );
    }
    let served = match source {
        Source::Server => format!("; its server exports it writable as \"{}\" now", made.name),
        Source::Image => format!(
            "; `zdisk serve {}` will export it writable as \"{}\"",
            args.image.display(),
            made.name
        ),
    };
    say!(
        "made clone {} of snapshot {} in {} (version {}) in {:.1} ms{served}",
        made.name,
        args.snapshot,
        args.image.display(),
        made.version,
        elapsed.as_secs_f64() * 1000.0
    )
}

pub fn volumes(args: &VolumesArgs) -> Result<(), String> {
    let (listing, source): (Listing, Source) =
        through_server_or_image(&args.image, "volumes", "zdisk volumes", true, |volume| {
            let listing = control::listing(volume)?;
            serde_json::to_value(&listing)
                .and_then(serde_json::from_value)
                .map_err(|e| e.to_string())
        })?;
    if args.json {
        // One list: the snapshots, then the clones, each with its kind.
        let mut all = Vec::new();
        for snapshot in &listing.snapshots {
            let mut value = serde_json::to_value(snapshot).map_err(|e| e.to_string())?;
            value["kind"] = "snapshot".into();
            all.push(value);
        }
        for clone in &listing.clones {
            let mut value = serde_json::to_value(clone).map_err(|e| e.to_string())?;
            value["kind"] = "clone".into();
            all.push(value);
        }
        return say!(
            "{}",
            serde_json::to_string_pretty(&all).map_err(|e| e.to_string())?
        );
    }
    let from = match source {
        Source::Server => "being served; from its server",
        Source::Image => "not being served; from the image",
    };
    let row = |cells: [&str; 9]| {
        format!(
            "{:<24} {:<9} {:<24} {:<20} {:>12} {:>12} {:>12} {:>9} {:>9}\n",
            cells[0],
            cells[1],
            cells[2],
            cells[3],
            cells[4],
            cells[5],
            cells[6],
            cells[7],
            cells[8]
        )
    };
    let mut out = format!("{}: {from}\n", args.image.display());
    out.push_str(&row([
        "NAME",
        "KIND",
        "OF",
        "MADE (UTC)",
        "HOLDS BLOCKS",
        "HOLDS BYTES",
        "FREES BLOCKS",
        "MAPPED",
        "SHARED",
    ]));
    out.push_str(&row([
        "(the volume)",
        "volume",
        "-",
        "-",
        "-",
        "-",
        "-",
        "-",
        "-",
    ]));
    for snapshot in &listing.snapshots {
        out.push_str(&row([
            &snapshot.name,
            "snapshot",
            snapshot.of.as_deref().unwrap_or("(the volume)"),
            &utc(snapshot.created_unix_secs),
            &snapshot.kept_blocks.to_string(),
            &format_size(snapshot.kept_stored_bytes),
            &snapshot.frees_blocks.to_string(),
            "-",
            "-",
        ]));
    }
    for clone in &listing.clones {
        out.push_str(&row([
            &clone.name,
            "clone",
            &clone.snapshot,
            &utc(clone.created_unix_secs),
            &clone.own_blocks.to_string(),
            &format_size(clone.own_stored_bytes),
            // A clone with snapshots cannot be deleted.
            // What deleting it frees: its own data (a clone with
            // snapshots cannot be deleted).
            &match clone.snapshots.is_empty() {
                true => (clone.own_blocks - clone.own_zero_blocks).to_string(),
                false => "-".to_string(),
            },
            &clone.mapped_blocks.to_string(),
            &clone.shared_blocks.to_string(),
        ]));
    }
    out.push_str(
        "A snapshot holds the blocks its volume changed since it was taken; deleting it \
         frees those no older snapshot of the same volume sees. A clone holds the blocks \
         written to it; every other block is its snapshot's, shared. (A snapshot's by \
         walking its own entries; a clone's HOLDS from the map's counts, its MAPPED (data \
         blocks it sees) and SHARED (those its snapshot holds) by walking its view a window \
         at a time.)\n",
    );
    crate::output::write(format_args!("{out}"))
}

pub fn delete(args: &DeleteArgs) -> Result<(), String> {
    check_name(&args.name)?;
    let request = format!("delete {}", args.name);
    let (deleted, _source): (Deleted, Source) =
        through_server_or_image(&args.image, &request, "zdisk delete", false, |volume| {
            control::delete_named(volume, &args.name).map(|d| Deleted {
                kind: d.kind.to_string(),
                handed_down: d.handed_down,
                freed: d.freed,
            })
        })?;
    if args.json {
        return say!(
            "{}",
            serde_json::to_string_pretty(&deleted).map_err(|e| e.to_string())?
        );
    }
    if deleted.kind == "clone" {
        return say!(
            "deleted clone {} of {}: the {} blocks it wrote are free (the cleaner reclaims \
             their space; `zdisk compact` or an idle minute does it now)",
            args.name,
            args.image.display(),
            deleted.freed
        );
    }
    say!(
        "deleted snapshot {} of {}: {} blocks it alone kept are free (the cleaner reclaims \
         their space; `zdisk compact` or an idle minute does it now), {} went to the next \
         older snapshot",
        args.name,
        args.image.display(),
        deleted.freed,
        deleted.handed_down
    )
}

#[derive(Debug, Serialize, Deserialize)]
struct Compacted {
    segments_cleaned: u64,
    used_before_bytes: u64,
    used_after_bytes: u64,
}

pub fn compact(args: &CompactArgs) -> Result<(), String> {
    let started = Instant::now();
    let (done, _source): (Compacted, Source) =
        through_server_or_image(&args.image, "compact", "zdisk compact", false, |volume| {
            volume
                .compact()
                .map(|c| Compacted {
                    segments_cleaned: c.segments_cleaned,
                    used_before_bytes: c.used_before_bytes,
                    used_after_bytes: c.used_after_bytes,
                })
                .map_err(|e| e.to_string())
        })?;
    if args.json {
        return say!(
            "{}",
            serde_json::to_string_pretty(&done).map_err(|e| e.to_string())?
        );
    }
    say!(
        "compacted {} in {:.1} s: cleaned {} segments; medium in use {} -> {}",
        args.image.display(),
        started.elapsed().as_secs_f64(),
        done.segments_cleaned,
        format_size(done.used_before_bytes),
        format_size(done.used_after_bytes)
    )
}

/// `secs` since the epoch as `YYYY-MM-DD HH:MM:SS` (UTC).
fn utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rest = secs % 86_400;
    // Howard Hinnant's days-to-civil algorithm.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn utc_dates() {
        assert_eq!(super::utc(0), "1970-01-01 00:00:00");
        assert_eq!(super::utc(1_700_000_000), "2023-11-14 22:13:20");
        assert_eq!(super::utc(951_782_400), "2000-02-29 00:00:00");
    }
}
