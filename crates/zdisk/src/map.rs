//! `zdisk map`: where a volume's space goes, as a picture and a table.
//!
//! The statuses come from the same place for an image at rest and for a
//! served one: an image is opened read-only and asked for
//! `stored_status`, encoded as the `zdisk:compression` bits the server
//! sends; a URI is asked through `nbdinfo --map=zdisk:compression --json`,
//! so any server that offers the context can be drawn. Everything after
//! that works on those bits alone (docs/semantics.md has their layout).

use std::path::Path;
use std::process::Command;

use plotters::prelude::*;

use zdisk_core::units::{format_size, BLOCK_SIZE_U64};
use zdisk_core::OpenOptions;
use zdisk_nbd::wire::{
    compression_status, ZDISK_CODEC_SHIFT, ZDISK_KIND_COMPRESSED, ZDISK_KIND_DAMAGED,
    ZDISK_KIND_HOLE, ZDISK_KIND_MASK, ZDISK_KIND_RAW, ZDISK_KIND_ZERO, ZDISK_SHARED,
    ZDISK_SIZE_SHIFT,
};

use crate::args::MapArgs;

/// Extents asked for at a time from an image.
const EXTENTS_PER_CALL: usize = 4096;
/// The picture's grid: cells per row, and most rows.
const GRID_COLUMNS: u64 = 128;
const GRID_ROWS_MAX: u64 = 64;
/// Regions in the text summary.
const REGIONS: u64 = 16;

/// One run of the map: offset, length, zdisk:compression status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub offset: u64,
    pub length: u64,
    pub status: u32,
}

/// What a byte is, for colouring and counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Class {
    Hole = 0,
    Zero,
    /// Compressed to at most a quarter (4:1 or better).
    Quarter,
    /// To at most a half.
    Half,
    /// To at most three quarters.
    ThreeQuarters,
    /// Compressed, but to more than three quarters.
    Little,
    Raw,
    Damaged,
}

const CLASSES: [Class; 8] = [
    Class::Hole,
    Class::Zero,
    Class::Quarter,
    Class::Half,
    Class::ThreeQuarters,
    Class::Little,
    Class::Raw,
    Class::Damaged,
];

impl Class {
    fn of(status: u32) -> Class {
        let sixteenths = (status >> ZDISK_SIZE_SHIFT & 0xf) + 1;
        match status & ZDISK_KIND_MASK {
            ZDISK_KIND_HOLE => Class::Hole,
            ZDISK_KIND_ZERO => Class::Zero,
            ZDISK_KIND_RAW => Class::Raw,
            ZDISK_KIND_COMPRESSED => match sixteenths {
                0..=4 => Class::Quarter,
                5..=8 => Class::Half,
                9..=12 => Class::ThreeQuarters,
                _ => Class::Little,
            },
            ZDISK_KIND_DAMAGED => Class::Damaged,
            // A kind this version does not know: say it is damaged
            // rather than guess.
            _ => Class::Damaged,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Class::Hole => "hole",
            Class::Zero => "zeros",
            Class::Quarter => "compressed 4:1+",
            Class::Half => "compressed 2-4:1",
            Class::ThreeQuarters => "compressed 1.33-2:1",
            Class::Little => "compressed <1.33:1",
            Class::Raw => "raw (incompressible)",
            Class::Damaged => "damaged",
        }
    }

    fn colour(self) -> RGBColor {
        match self {
            Class::Hole => RGBColor(0xee, 0xee, 0xee),
            Class::Zero => RGBColor(0x9e, 0xca, 0xe1),
            Class::Quarter => RGBColor(0x1b, 0x78, 0x37),
            Class::Half => RGBColor(0x7f, 0xbf, 0x7b),
            Class::ThreeQuarters => RGBColor(0xfe, 0xe0, 0x8b),
            Class::Little => RGBColor(0xfd, 0xae, 0x61),
            Class::Raw => RGBColor(0xd7, 0x30, 0x27),
            Class::Damaged => RGBColor(0, 0, 0),
        }
    }
}

/// Stored bytes a logical byte of this status takes, about: raw blocks a
/// whole block, compressed ones the middle of their size class.
fn stored_fraction(status: u32) -> f64 {
    match status & ZDISK_KIND_MASK {
        ZDISK_KIND_RAW => 1.0,
        ZDISK_KIND_COMPRESSED => ((status >> ZDISK_SIZE_SHIFT & 0xf) as f64 + 0.5) / 16.0,
        _ => 0.0,
    }
}

/// Bytes per class and stored bytes, over some range.
#[derive(Debug, Clone, Copy, Default)]
struct Tally {
    bytes: [u64; CLASSES.len()],
    stored: f64,
    codecs: [u64; 16],
    /// Bytes whose stored content other blocks share (status bit 13).
    shared: u64,
}

impl Tally {
    fn add(&mut self, status: u32, length: u64) {
        self.bytes[Class::of(status) as usize] += length;
        self.stored += stored_fraction(status) * length as f64;
        if status & ZDISK_KIND_MASK == ZDISK_KIND_COMPRESSED {
            self.codecs[(status >> ZDISK_CODEC_SHIFT & 0xf) as usize] += length;
        }
        if status & ZDISK_SHARED != 0 {
            self.shared += length;
        }
    }

    fn total(&self) -> u64 {
        self.bytes.iter().sum()
    }

    /// The class holding the most bytes (the first of equals), holes
    /// counting only when nothing else is there: on a large volume a
    /// cell spans many blocks, and a little data in it should show.
    fn majority(&self) -> Class {
        let mut best = Class::Hole;
        for class in CLASSES {
            if class != Class::Hole
                && (best == Class::Hole || self.bytes[class as usize] > self.bytes[best as usize])
                && self.bytes[class as usize] > 0
            {
                best = class;
            }
        }
        best
    }
}

/// Adds up `runs` over `start..end`.
fn tally(runs: &[Run], start: u64, end: u64) -> Tally {
    let mut tally = Tally::default();
    let first = runs.partition_point(|run| run.offset + run.length <= start);
    for run in &runs[first..] {
        if run.offset >= end {
            break;
        }
        let from = run.offset.max(start);
        let to = (run.offset + run.length).min(end);
        tally.add(run.status, to - from);
    }
    tally
}

pub fn run(args: &MapArgs) -> Result<(), String> {
    if let Some(png) = &args.png {
        let extension = png.extension().and_then(|e| e.to_str()).unwrap_or("");
        if !extension.eq_ignore_ascii_case("png") {
            return Err(format!("{}: the picture must end in .png", png.display()));
        }
    }
    let (name, runs) = if is_uri(&args.target) {
        (args.target.clone(), runs_of_uri(&args.target)?)
    } else {
        let path = Path::new(&args.target);
        (path.display().to_string(), runs_of_image(path)?)
    };
    let logical = runs.iter().map(|run| run.length).sum::<u64>();
    if logical == 0 {
        return Err(format!("{name}: the volume is empty"));
    }
    crate::output::write(format_args!("{}", summary(&name, &runs, logical)))?;
    if let Some(png) = &args.png {
        draw(png, &name, &runs, logical)?;
        crate::output::write(format_args!("picture: {}\n", png.display()))?;
    }
    Ok(())
}

fn is_uri(target: &str) -> bool {
    ["nbd://", "nbds://", "nbd+unix://", "nbds+unix://"]
        .iter()
        .any(|scheme| target.starts_with(scheme))
}

/// The runs of an image at rest, opened read-only.
fn runs_of_image(path: &Path) -> Result<Vec<Run>, String> {
    let options = OpenOptions {
        read_only: true,
        background: false,
        ..OpenOptions::default()
    };
    let volume = crate::image::open(path, options).map_err(|e| {
        if e.contains("in use by another zdisk process") {
            format!("{e}; while it is served, map it through the server: zdisk map nbd://ADDR or nbd+unix:///?socket=PATH")
        } else {
            e
        }
    })?;
    let size = zdisk_core::BlockDevice::size_bytes(&*volume);
    let mut runs: Vec<Run> = Vec::new();
    let mut offset = 0;
    while offset < size {
        let extents = zdisk_core::BlockDevice::stored_status(
            &*volume,
            offset,
            size - offset,
            EXTENTS_PER_CALL,
        )
        .map_err(|e| e.to_string())?;
        if extents.is_empty() {
            return Err(format!("{}: no status for offset {offset}", path.display()));
        }
        for extent in extents {
            push_run(
                &mut runs,
                offset,
                extent.length_bytes,
                compression_status(extent.stored),
            );
            offset += extent.length_bytes;
        }
    }
    Ok(runs)
}

fn push_run(runs: &mut Vec<Run>, offset: u64, length: u64, status: u32) {
    match runs.last_mut() {
        Some(last) if last.status == status && last.offset + last.length == offset => {
            last.length += length
        }
        _ => runs.push(Run {
            offset,
            length,
            status,
        }),
    }
}

/// The runs a server reports, through nbdinfo.
fn runs_of_uri(uri: &str) -> Result<Vec<Run>, String> {
    let output = Command::new("nbdinfo")
        .args(["--json", "--map=zdisk:compression", uri])
        .output()
        .map_err(|e| format!("cannot run nbdinfo (from libnbd, needed to map a URI): {e}"))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        return Err(format!(
            "nbdinfo --map=zdisk:compression {uri} failed: {}",
            stderr.trim().replace('\n', "; ")
        ));
    }
    let value: serde_json::Value = serde_json::from_slice(&output.stdout)
        .map_err(|e| format!("nbdinfo printed no JSON map: {e}"))?;
    let rows = value
        .as_array()
        .ok_or("nbdinfo's map is not a JSON array")?;
    let mut runs = Vec::with_capacity(rows.len());
    let mut expected = 0;
    for row in rows {
        let field = |name: &str| {
            row[name]
                .as_u64()
                .ok_or_else(|| format!("nbdinfo's map row {row} has no {name}"))
        };
        let (offset, length, status) = (field("offset")?, field("length")?, field("type")?);
        if offset != expected {
            return Err(format!("nbdinfo's map skips from {expected} to {offset}"));
        }
        let status = u32::try_from(status).map_err(|_| format!("status {status} is not 32-bit"))?;
        push_run(&mut runs, offset, length, status);
        expected = offset + length;
    }
    Ok(runs)
}

/// The text summary: totals, then one line per region.
fn summary(name: &str, runs: &[Run], logical: u64) -> String {
    let total = tally(runs, 0, logical);
    let mut out = String::new();
    let percent = |tally: &Tally, class: Class| {
        100.0 * tally.bytes[class as usize] as f64 / tally.total().max(1) as f64
    };
    let compressed = |tally: &Tally| {
        [
            Class::Quarter,
            Class::Half,
            Class::ThreeQuarters,
            Class::Little,
        ]
        .iter()
        .map(|&class| tally.bytes[class as usize])
        .sum::<u64>()
    };
    let written = |tally: &Tally| {
        tally.total() - tally.bytes[Class::Hole as usize] - tally.bytes[Class::Zero as usize]
    };
    let codecs: Vec<String> = total
        .codecs
        .iter()
        .enumerate()
        .filter(|(_, bytes)| **bytes > 0)
        .map(|(id, bytes)| {
            let name = zdisk_core::codec::CodecId::from_u8(id as u8)
                .map_or("unknown", |codec| codec.name());
            format!("{name} {}", format_size(*bytes))
        })
        .collect();
    out.push_str(&format!(
        "{name}: {} logical, {} written ({} raw, {} compressed{}), {} zeros, {} holes; \
         stored about {}\n",
        format_size(logical),
        format_size(written(&total)),
        format_size(total.bytes[Class::Raw as usize]),
        format_size(compressed(&total)),
        if codecs.is_empty() {
            String::new()
        } else {
            format!(": {}", codecs.join(", "))
        },
        format_size(total.bytes[Class::Zero as usize]),
        format_size(total.bytes[Class::Hole as usize]),
        format_size(total.stored as u64),
    ));
    if total.shared > 0 {
        out.push_str(&format!(
            "shared: {} of that shares stored contents with other blocks (each content is \
             stored once; \"stored about\" counts it for every block sharing it)\n",
            format_size(total.shared)
        ));
    }
    if total.bytes[Class::Damaged as usize] > 0 {
        out.push_str(&format!(
            "damaged: {} (run zdisk check)\n",
            format_size(total.bytes[Class::Damaged as usize])
        ));
    }
    out.push_str(&format!(
        "\n{:<23} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6} {:>11} {:>7}\n",
        "region", "hole", "zero", "4:1+", "2-4:1", "<2:1", "<1.3:1", "raw", "stored", "ratio"
    ));
    let region = (logical / REGIONS).div_ceil(BLOCK_SIZE_U64).max(1) * BLOCK_SIZE_U64;
    let mut start = 0;
    while start < logical {
        let end = (start + region).min(logical);
        let t = tally(runs, start, end);
        let ratio = if t.stored >= 1.0 {
            format!("{:.2}x", written(&t) as f64 / t.stored)
        } else {
            "-".into()
        };
        out.push_str(&format!(
            "{:<23} {:>5.1}% {:>5.1}% {:>5.1}% {:>5.1}% {:>5.1}% {:>5.1}% {:>5.1}% {:>11} {:>7}\n",
            format!("{}..{}", short_size(start), short_size(end)),
            percent(&t, Class::Hole),
            percent(&t, Class::Zero),
            percent(&t, Class::Quarter),
            percent(&t, Class::Half),
            percent(&t, Class::ThreeQuarters),
            percent(&t, Class::Little),
            percent(&t, Class::Raw),
            format_size(t.stored as u64),
            ratio,
        ));
        start = end;
    }
    out.push_str(
        "stored: estimated from each extent's size class (docs/semantics.md, zdisk:compression); \
         ratio: written bytes over stored\n",
    );
    out
}

/// `12M`, `1.5G`: short enough for a column.
fn short_size(bytes: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("T", 1 << 40),
        ("G", 1 << 30),
        ("M", 1 << 20),
        ("K", 1 << 10),
    ];
    for (suffix, unit) in UNITS {
        if bytes >= unit {
            let value = bytes as f64 / unit as f64;
            return if bytes.is_multiple_of(unit) {
                format!("{}{suffix}", bytes / unit)
            } else {
                format!("{value:.1}{suffix}")
            };
        }
    }
    bytes.to_string()
}

/// The grid: how many bytes a cell covers, and how many rows there are.
fn grid(logical: u64) -> (u64, u64) {
    let cells = GRID_COLUMNS * GRID_ROWS_MAX;
    let cell = logical.div_ceil(cells).div_ceil(BLOCK_SIZE_U64).max(1) * BLOCK_SIZE_U64;
    let rows = logical.div_ceil(cell * GRID_COLUMNS);
    (cell, rows)
}

/// Draws the grid: the volume left to right and top to bottom, a cell
/// coloured by the class most of its bytes are in (grey only if all of
/// it is a hole), and a legend.
fn draw(path: &Path, name: &str, runs: &[Run], logical: u64) -> Result<(), String> {
    zdisk_bench::plot::register_font()?;
    let (cell, rows) = grid(logical);
    let row_bytes = cell * GRID_COLUMNS;
    let (unit, unit_name) = if row_bytes * rows >= 16 << 30 {
        (1u64 << 30, "GiB")
    } else {
        (1u64 << 20, "MiB")
    };
    let height = 150 + 10 * rows as u32;
    let root = BitMapBackend::new(path, (1000, height.max(300))).into_drawing_area();
    let err = |e: DrawingAreaErrorKind<_>| format!("drawing failed: {e}");
    root.fill(&WHITE).map_err(err)?;
    let (top, legend) = root.split_vertically(height.max(300) - 60);
    let total = tally(runs, 0, logical);
    let title = format!(
        "zdisk map: {name} ({} logical, stored about {})",
        format_size(logical),
        format_size(total.stored as u64)
    );
    let x_end = row_bytes as f64 / unit as f64;
    let y_end = (rows * row_bytes) as f64 / unit as f64;
    let mut chart = ChartBuilder::on(&top)
        .caption(title, ("sans-serif", 18))
        .margin(10)
        .margin_right(30)
        .x_label_area_size(35)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..x_end, y_end..0f64)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc(format!(
            "offset within the row ({unit_name}); each cell {}",
            format_size(cell)
        ))
        .y_desc(format!("row start ({unit_name})"))
        .label_style(("sans-serif", 13))
        .x_label_formatter(&|x| format!("{x:.1}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(err)?;
    let scale = |bytes: u64| bytes as f64 / unit as f64;
    let mut cells = Vec::new();
    for row in 0..rows {
        for column in 0..GRID_COLUMNS {
            let start = row * row_bytes + column * cell;
            if start >= logical {
                break;
            }
            let class = tally(runs, start, (start + cell).min(logical)).majority();
            let x0 = scale(column * cell);
            let y0 = scale(row * row_bytes);
            cells.push(Rectangle::new(
                [(x0, y0), (x0 + scale(cell), y0 + scale(row_bytes))],
                class.colour().filled(),
            ));
        }
    }
    chart.draw_series(cells).map_err(err)?;
    // The legend: a swatch and a label per class, with its share.
    let shown: Vec<Class> = CLASSES
        .iter()
        .copied()
        .filter(|class| *class != Class::Damaged || total.bytes[*class as usize] > 0)
        .collect();
    let width = 1000 / shown.len().max(1) as i32;
    for (index, class) in shown.iter().enumerate() {
        let x = 10 + index as i32 * width;
        legend
            .draw(&Rectangle::new(
                [(x, 12), (x + 16, 28)],
                class.colour().filled(),
            ))
            .map_err(err)?;
        legend
            .draw(&Rectangle::new(
                [(x, 12), (x + 16, 28)],
                BLACK.stroke_width(1),
            ))
            .map_err(err)?;
        let share = 100.0 * total.bytes[*class as usize] as f64 / logical as f64;
        legend
            .draw(&Text::new(
                class.label().to_string(),
                (x + 20, 10),
                ("sans-serif", 12),
            ))
            .map_err(err)?;
        legend
            .draw(&Text::new(
                format!("{share:.1}%"),
                (x + 20, 26),
                ("sans-serif", 12),
            ))
            .map_err(err)?;
    }
    root.present()
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compressed(sixteenths: u32) -> u32 {
        ZDISK_KIND_COMPRESSED | 1 << ZDISK_CODEC_SHIFT | (sixteenths - 1) << ZDISK_SIZE_SHIFT
    }

    #[test]
    fn statuses_fall_into_classes() {
        assert_eq!(Class::of(ZDISK_KIND_HOLE), Class::Hole);
        assert_eq!(Class::of(ZDISK_KIND_ZERO), Class::Zero);
        assert_eq!(
            Class::of(ZDISK_KIND_RAW | 15 << ZDISK_SIZE_SHIFT),
            Class::Raw
        );
        assert_eq!(Class::of(compressed(1)), Class::Quarter);
        assert_eq!(Class::of(compressed(4)), Class::Quarter);
        assert_eq!(Class::of(compressed(5)), Class::Half);
        assert_eq!(Class::of(compressed(12)), Class::ThreeQuarters);
        assert_eq!(Class::of(compressed(16)), Class::Little);
        assert_eq!(Class::of(ZDISK_KIND_DAMAGED), Class::Damaged);
        assert_eq!(
            Class::of(9),
            Class::Damaged,
            "unknown kinds are not guessed"
        );
    }

    #[test]
    fn tallies_clip_runs_to_the_range() {
        let runs = [
            Run {
                offset: 0,
                length: 8192,
                status: ZDISK_KIND_HOLE,
            },
            Run {
                offset: 8192,
                length: 8192,
                status: compressed(4),
            },
            Run {
                offset: 16384,
                length: 4096,
                status: ZDISK_KIND_RAW | 15 << ZDISK_SIZE_SHIFT,
            },
        ];
        let t = tally(&runs, 4096, 20480);
        assert_eq!(t.bytes[Class::Hole as usize], 4096);
        assert_eq!(t.bytes[Class::Quarter as usize], 8192);
        assert_eq!(t.bytes[Class::Raw as usize], 4096);
        assert_eq!(t.majority(), Class::Quarter);
        // A little data in a hole shows.
        assert_eq!(tally(&runs, 0, 12288).majority(), Class::Quarter);
        assert_eq!(tally(&runs, 0, 8192).majority(), Class::Hole);
        // 8 KiB at 3.5/16 and 4 KiB raw.
        assert!((t.stored - (8192.0 * 3.5 / 16.0 + 4096.0)).abs() < 1e-6);
        assert_eq!(t.codecs[1], 8192);
        let text = summary("v", &runs, 20480);
        assert!(text.contains("v: 20 KiB logical, 12 KiB written"), "{text}");
        assert!(!text.contains("shared"), "{text}");
        let mut shared = runs;
        shared[1].status |= ZDISK_SHARED;
        assert_eq!(tally(&shared, 0, 20480).shared, 8192);
        let text = summary("v", &shared, 20480);
        assert!(text.contains("shared: 8 KiB of that shares"), "{text}");
    }

    #[test]
    fn the_grid_covers_the_volume_in_whole_blocks() {
        for logical in [4096, 1 << 20, 64 << 20, (1 << 40) + 4096, 3 << 30] {
            let (cell, rows) = grid(logical);
            assert_eq!(cell % BLOCK_SIZE_U64, 0);
            assert!(rows <= GRID_ROWS_MAX, "{logical}: {rows} rows");
            assert!(cell * GRID_COLUMNS * rows >= logical);
        }
    }
}
