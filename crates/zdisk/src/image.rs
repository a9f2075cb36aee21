//! Creating and opening images on files and block devices.

use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::sync::Arc;

use zdisk_core::media::{FileMedia, Media};
use zdisk_core::meta::{geometry_in_slots as geometry, MediaKind};
use zdisk_core::units::format_size;
use zdisk_core::{Codec, CreateOptions, GcPolicy, OpenOptions, Volume};

use crate::args::{CreateArgs, LayoutArgs};
use crate::output::say;

/// Logical size of an image `serve` creates on its own.
pub const DEFAULT_LOGICAL_BYTES: u64 = 8 << 30;
/// Physical size of such an image (a sparse file: it takes space as written).
pub const DEFAULT_PHYSICAL_BYTES: u64 = 4 << 30;

/// Segment size for a medium: about 1/512 of it, between 256 KiB and 4 MiB,
/// and larger on media over 64 TiB, which would otherwise need more
/// segments than the engine can number (16 Mi).
pub fn default_segment_size(physical_bytes: u64) -> u64 {
    let target = (physical_bytes / 512).max(1);
    let power = 1u64 << (63 - target.leading_zeros());
    let fewest = (physical_bytes / ((1 << 24) - 1)).next_power_of_two();
    power.clamp(256 << 10, 4 << 20).max(fewest)
}

/// Creates an image file (or initialises a block device) and opens it.
pub fn create(
    path: &Path,
    layout: &LayoutArgs,
    codec: Codec,
    gc_policy: GcPolicy,
    unit_blocks: u8,
    force: bool,
    options: OpenOptions,
) -> Result<Arc<Volume>, String> {
    let is_block_device = is_block_device(path);
    let logical = layout
        .logical
        .ok_or("--logical is required: the size clients see, e.g. --logical 64G")?;
    if logical == 0 || logical % zdisk_core::units::BLOCK_SIZE_U64 != 0 {
        return Err(format!(
            "--logical {logical} must be a positive multiple of 4096 bytes"
        ));
    }
    let physical = match (layout.physical, is_block_device) {
        (Some(size), _) => Some(size),
        (None, true) => None,
        (None, false) => Some(logical),
    };
    let segment_size = layout.segment_size.unwrap_or_else(|| {
        let reference = physical.unwrap_or_else(|| block_device_size(path).unwrap_or(logical));
        default_segment_size(reference)
    });
    if !is_block_device {
        // Validate the layout before anything is created or replaced.
        let size = physical.expect("a file always has a physical size");
        zdisk_core::media::file_geometry(size, segment_size).map_err(|e| e.to_string())?;
    }
    create_replacing(path, force, |target| {
        let media =
            FileMedia::create(target, physical, segment_size, false).map_err(|e| match e {
                zdisk_core::Error::Io { source, .. }
                    if source.raw_os_error() == Some(libc::EFBIG) =>
                {
                    format!(
                        "cannot create {}: its filesystem cannot hold a file of {} ({source})",
                        path.display(),
                        format_size(physical.unwrap_or(0))
                    )
                }
                other => other.to_string(),
            })?;
        let create = CreateOptions {
            logical_size_bytes: logical,
            codec,
            gc_policy,
            unit_blocks,
            media_kind: MediaKind::File,
            media_params: Vec::new(),
            dedup: options.dedup.unwrap_or(zdisk_core::DEFAULT_DEDUP),
        };
        Volume::create(Arc::new(media) as Arc<dyn Media>, create, options)
            .map_err(|e| e.to_string())
    })
}

/// An image with snapshots is in use as surely as a served one: `--force`
/// does not overwrite it (its snapshots would go with it). A file that is
/// not a readable zdisk image is left to `--force`.
fn refuse_if_snapshotted(path: &Path) -> Result<(), String> {
    let options = OpenOptions {
        read_only: true,
        background: false,
        ..OpenOptions::default()
    };
    let Ok(volume) = open(path, options) else {
        return Ok(());
    };
    let names: Vec<String> = volume.snapshot_list().into_iter().map(|s| s.name).collect();
    if names.is_empty() {
        return Ok(());
    }
    Err(format!(
        "{} has {} snapshot(s) ({}): --force does not overwrite an image with snapshots; \
         delete them first (zdisk delete {} NAME)",
        path.display(),
        names.len(),
        names.join(", "),
        path.display()
    ))
}

/// Builds a new image and puts it at `path` only once it is complete, so a
/// failed create leaves whatever was at `path` byte for byte.
///
/// A regular file is built under a temporary name in the same directory and
/// then moved into place: linked if `path` did not exist (so a file created
/// meanwhile is never replaced), renamed over it if it did, which needs
/// `force` and the old image's lock (a served image is refused, untouched).
/// A block device cannot be replaced, so it is locked and written in place;
/// callers validate every argument before.
fn create_replacing(
    path: &Path,
    force: bool,
    build: impl FnOnce(&Path) -> Result<Arc<Volume>, String>,
) -> Result<Arc<Volume>, String> {
    let existing = match std::fs::metadata(path) {
        Ok(metadata) => Some(metadata),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => None,
        Err(error) => return Err(format!("cannot inspect {}: {error}", path.display())),
    };
    if existing
        .as_ref()
        .is_some_and(|m| m.file_type().is_block_device())
    {
        return build(path);
    }
    // Hold the old image's lock until the new one has replaced it.
    let _old_lock = match &existing {
        None => None,
        Some(metadata) if !metadata.is_file() => {
            return Err(format!(
                "{} exists and is neither a regular file nor a block device",
                path.display()
            ))
        }
        Some(_) if !force => {
            return Err(format!(
                "{} already exists; pass --force to overwrite it",
                path.display()
            ))
        }
        Some(_) => {
            refuse_if_snapshotted(path)?;
            let file = std::fs::File::open(path)
                .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
            zdisk_core::media::lock_file(&file, path, true).map_err(|e| e.to_string())?;
            Some(file)
        }
    };
    // Through a symbolic link, the file it names is replaced, not the link.
    let target = match &existing {
        Some(_) => std::fs::canonicalize(path)
            .map_err(|e| format!("cannot resolve {}: {e}", path.display()))?,
        None => path.to_path_buf(),
    };
    let file_name = target
        .file_name()
        .ok_or_else(|| format!("{} does not name a file", path.display()))?;
    let temporary = target.with_file_name(format!(
        ".{}.creating-{}",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let volume = match build(&temporary) {
        Ok(volume) => volume,
        Err(message) => {
            let _ = std::fs::remove_file(&temporary);
            return Err(message);
        }
    };
    let placed = match existing {
        Some(_) => std::fs::rename(&temporary, &target),
        None => {
            std::fs::hard_link(&temporary, &target).and_then(|()| std::fs::remove_file(&temporary))
        }
    };
    if let Err(error) = placed {
        let _ = std::fs::remove_file(&temporary);
        return Err(format!(
            "cannot put the new image at {}: {error}",
            path.display()
        ));
    }
    sync_parent(&target);
    Ok(volume)
}

/// Makes a rename or link in `path`'s directory durable (best effort: the
/// image's own contents are synced by the engine).
fn sync_parent(path: &Path) {
    let parent = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    if let Ok(directory) = std::fs::File::open(parent) {
        let _ = directory.sync_all();
    }
}

pub fn create_command(args: &CreateArgs) -> Result<(), String> {
    if args.from.is_some() && args.dedup.is_some() {
        return Err(
            "--dedup does not apply with --from: the volume in the bucket keeps its setting (serve --dedup changes it)"
                .into(),
        );
    }
    let options = OpenOptions {
        background: false,
        dedup: args.dedup,
        ..OpenOptions::default()
    };
    for url in [&args.tier, &args.from].into_iter().flatten() {
        // memory:// is the tests' in-process store: gone when zdisk exits.
        if !url.starts_with("s3://") {
            return Err(format!("tier {url:?}: expected s3://BUCKET/PREFIX"));
        }
    }
    let volume = match (&args.nand, &args.tier, &args.from) {
        (_, Some(url), _) => create_tiered(args, url, options)?,
        (_, _, Some(url)) => {
            let cache = args
                .layout
                .physical
                .ok_or("--physical is required with --from: the most the local cache keeps")?;
            let options = OpenOptions {
                read_only: args.read_only,
                ..options
            };
            zdisk_tier::restore(
                &args.image,
                url,
                cache,
                args.take_over,
                zdisk_tier::TierConfig::default(),
                options,
            )
            .map_err(|e| e.to_string())?
        }
        (Some(profile), _, _) => create_nand(args, profile, options)?,
        (None, None, None) => create(
            &args.image,
            &args.layout,
            args.codec.unwrap_or_default(),
            args.gc_policy,
            args.unit_max.unwrap_or_else(|| {
                zdisk_core::meta::default_unit_blocks(args.codec.unwrap_or_default())
            }),
            args.force,
            options,
        )?,
    };
    volume.close().map_err(|e| e.to_string())?;
    say!("created {}", describe(&volume, &args.image))?;
    if args.nand.is_none() {
        if let Some(note) = oversized_note(&volume) {
            say!("note: {note}")?;
        }
    }
    Ok(())
}

/// A plain image whose medium exceeds its logical size cannot fill the
/// excess with data: say so, since it is more likely a slip than a plan.
pub fn oversized_note(volume: &Volume) -> Option<String> {
    let sb = volume.superblock();
    (sb.physical_size_bytes > sb.logical_size_bytes).then(|| {
        format!(
            "the physical size ({}) exceeds the logical size ({}): data can never take more \
             than the logical size, so the rest only gives the cleaner room \
             (a larger --logical would let clients use it)",
            format_size(sb.physical_size_bytes),
            format_size(sb.logical_size_bytes)
        )
    })
}

/// Creates a tiered volume: the image is a sparse file of the volume's
/// whole log that keeps at most `--physical` bytes of segments.
fn create_tiered(
    args: &CreateArgs,
    url: &str,
    options: OpenOptions,
) -> Result<Arc<Volume>, String> {
    let logical = args
        .layout
        .logical
        .ok_or("--logical is required: the size clients see, e.g. --logical 64G")?;
    if logical == 0 || logical % zdisk_core::units::BLOCK_SIZE_U64 != 0 {
        return Err(format!(
            "--logical {logical} must be a positive multiple of 4096 bytes"
        ));
    }
    let cache_bytes = args.layout.physical.ok_or(
        "--physical is required with --tier: the most the local cache keeps, e.g. --physical 1G",
    )?;
    // The log in the bucket is as large as a plain image's would be.
    let log_bytes = logical + zdisk_core::media::FILE_DATA_OFFSET;
    let segment_size = args
        .layout
        .segment_size
        .unwrap_or_else(|| default_segment_size(log_bytes));
    if cache_bytes < 8 * segment_size {
        return Err(format!(
            "--physical {} is too small a cache: it must hold at least 8 segments of {}",
            format_size(cache_bytes),
            format_size(segment_size)
        ));
    }
    let codec = args.codec.unwrap_or_default();
    let create = CreateOptions {
        logical_size_bytes: logical,
        codec,
        gc_policy: args.gc_policy,
        unit_blocks: args
            .unit_max
            .unwrap_or_else(|| zdisk_core::meta::default_unit_blocks(codec)),
        media_kind: MediaKind::Tiered,
        media_params: Vec::new(),
        dedup: options.dedup.unwrap_or(zdisk_core::DEFAULT_DEDUP),
    };
    let layout = zdisk_tier::TierLayout {
        url: url.to_string(),
        log_bytes,
        segment_size_bytes: segment_size,
        cache_bytes,
        create_bucket: args.create_bucket,
    };
    zdisk_tier::create(
        &args.image,
        &layout,
        create,
        zdisk_tier::TierConfig::default(),
        options,
    )
    .map_err(|e| e.to_string())
}

/// Creates an emulated NAND drive image.
fn create_nand(
    args: &CreateArgs,
    profile: &str,
    options: OpenOptions,
) -> Result<Arc<Volume>, String> {
    if args.unit_max.is_some_and(|blocks| blocks != 1) {
        return Err(
            "--unit-max does not apply to an emulated drive: its controller compresses each 4 KiB block alone"
                .into(),
        );
    }
    let params = crate::nand::params(
        profile,
        args.layout.physical,
        args.plp,
        args.recycle_cap_mb_s,
    )?;
    if args.layout.segment_size.is_some() {
        return Err(
            "--segment-size does not apply to an emulated drive: its geometry sets it".into(),
        );
    }
    let logical = args
        .layout
        .logical
        .unwrap_or_else(|| params.profile.logical_size_bytes());
    let codec = match args.codec {
        Some(codec) => codec,
        None => Codec::parse(&params.profile.codec)?,
    };
    create_replacing(&args.image, args.force, |target| {
        let media = zdisk_nand::NandMedia::create(
            target,
            params.clone(),
            zdisk_core::clock::Timing::Virtual,
            false,
        )
        .map_err(|e| e.to_string())?;
        let create = CreateOptions {
            logical_size_bytes: logical,
            codec,
            gc_policy: args.gc_policy,
            // The drive's controller compresses each 4 KiB block alone.
            unit_blocks: 1,
            media_kind: MediaKind::Nand,
            media_params: params.encode_params(),
            // The drives modelled do not deduplicate unless asked to.
            dedup: options.dedup.unwrap_or(false),
        };
        Volume::create(Arc::new(media) as Arc<dyn Media>, create, options)
            .map_err(|e| e.to_string())
    })
}

/// True if the file at `path` is an emulated NAND image.
pub fn is_nand_image(path: &Path) -> bool {
    use std::io::Read;
    let mut prefix = [0u8; 16];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut prefix))
        .is_ok_and(|_| zdisk_nand::is_nand_image(&prefix))
}

/// Opens an existing image; an emulated drive runs in real time unless
/// `virtual_time`, and a tiered one runs as `tier` says.
pub fn open_with_clock(
    path: &Path,
    options: OpenOptions,
    virtual_time: bool,
    tier: zdisk_tier::TierConfig,
) -> Result<Arc<Volume>, String> {
    if is_nand_image(path) {
        let clock = if virtual_time {
            zdisk_core::clock::Timing::Virtual
        } else {
            zdisk_core::clock::Timing::Real
        };
        let media = zdisk_nand::NandMedia::open(path, clock).map_err(|e| e.to_string())?;
        return Volume::open(Arc::new(media) as Arc<dyn Media>, options).map_err(|e| e.to_string());
    }
    if zdisk_tier::is_tiered(path) {
        return zdisk_tier::open(path, tier, options).map_err(|e| e.to_string());
    }
    open_file(path, options)
}

/// Opens an existing image (an emulated drive without its timing).
pub fn open(path: &Path, options: OpenOptions) -> Result<Arc<Volume>, String> {
    open_with_clock(path, options, true, zdisk_tier::TierConfig::default())
}

fn open_file(path: &Path, options: OpenOptions) -> Result<Arc<Volume>, String> {
    let media = FileMedia::open(path, options.read_only, geometry).map_err(|e| match e {
        zdisk_core::Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            format!(
                "{} does not exist; create it with `zdisk create {} --logical SIZE`",
                path.display(),
                path.display()
            )
        }
        other => other.to_string(),
    })?;
    let volume =
        Volume::open(Arc::new(media) as Arc<dyn Media>, options).map_err(|e| e.to_string())?;
    if volume.superblock().media_kind == MediaKind::Tiered {
        return Err(format!(
            "{} is the cache of a tiered volume, but its {} is missing: make a new cache with              `zdisk create IMAGE --physical SIZE --from s3://BUCKET/PREFIX`",
            path.display(),
            zdisk_tier::sidecar_path(path).display()
        ));
    }
    Ok(volume)
}

pub fn describe(volume: &Volume, path: &Path) -> String {
    let sb = volume.superblock();
    let geometry = volume.geometry();
    let drive = match zdisk_nand::NandParams::decode_params(&sb.media_params) {
        Ok(params) if sb.media_kind == MediaKind::Nand => format!(
            " (emulated {}{})",
            params.profile.name,
            if params.config.power_loss_protection {
                ", PLP"
            } else {
                ""
            }
        ),
        _ => String::new(),
    };
    format!(
        "{}{drive}: logical {}, physical {}, {} segments of {}, codec {}, GC {}",
        path.display(),
        format_size(sb.logical_size_bytes),
        format_size(sb.physical_size_bytes),
        geometry.segment_count,
        format_size(geometry.segment_size_bytes),
        volume.settings().codec,
        volume.settings().gc_policy
    )
}

fn is_block_device(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device())
}

fn block_device_size(path: &Path) -> Option<u64> {
    use std::io::{Seek, SeekFrom};
    let mut file = std::fs::File::open(path).ok()?;
    file.seek(SeekFrom::End(0)).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_size_scales_with_the_medium() {
        assert_eq!(default_segment_size(64 << 20), 256 << 10);
        assert_eq!(default_segment_size(1 << 30), 2 << 20);
        assert_eq!(default_segment_size(4 << 30), 4 << 20);
        assert_eq!(default_segment_size(1 << 40), 4 << 20);
        assert_eq!(default_segment_size(100 << 40), 8 << 20);
    }
}
