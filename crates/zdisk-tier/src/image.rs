//! Tiered images: create one over an empty prefix, attach a new local
//! cache to a volume already in a bucket (`--from`), open one.
//!
//! A tiered image is a sparse image file laid out as any file image, of the
//! volume's full log size (it holds only what the cache keeps), and its
//! `.tier` file. Its root says `media_kind` 4 (`Tiered`), with the tier's
//! URL as media parameters, so that nothing opens it as a plain file.

use std::path::Path;
use std::sync::Arc;

use zdisk_core::media::{file_geometry, FileMedia, Media};
use zdisk_core::meta::{geometry_in_slots, MediaKind, Root};
use zdisk_core::{CreateOptions, OpenOptions, Volume};

use crate::error::{Result, TierError};
use crate::location::Location;
use crate::medium::{get_root, list, TierConfig, TieredMedia};
use crate::reach::Contact;
use crate::sidecar::{sidecar_path, Sidecar};

/// True if `image` has a tier (its `.tier` file exists).
pub fn is_tiered(image: &Path) -> bool {
    sidecar_path(image).exists()
}

/// What `create --tier` needs beyond the engine's settings.
pub struct TierLayout {
    pub url: String,
    /// The volume's log size in the bucket (the sparse image's size).
    pub log_bytes: u64,
    pub segment_size_bytes: u64,
    /// Most bytes of segments the local cache keeps.
    pub cache_bytes: u64,
    /// Make the bucket if it does not exist (`--create-bucket`).
    pub create_bucket: bool,
}

fn refuse_existing(image: &Path) -> Result<()> {
    for path in [image.to_path_buf(), sidecar_path(image)] {
        if path.exists() {
            return Err(TierError::Exists(format!(
                "{} already exists; a tiered image is made only where nothing is",
                path.display()
            )));
        }
    }
    Ok(())
}

fn random_id() -> Result<[u8; 16]> {
    use std::io::Read;
    let mut id = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut id))
        .map_err(|e| TierError::Local(format!("cannot read /dev/urandom: {e}")))?;
    Ok(id)
}

/// Removes what a failed create or restore left.
fn remove_partial(image: &Path) {
    let _ = std::fs::remove_file(image);
    let _ = std::fs::remove_file(sidecar_path(image));
}

/// Creates a tiered volume over an empty prefix and opens it.
pub fn create(
    image: &Path,
    layout: &TierLayout,
    mut create: CreateOptions,
    config: TierConfig,
    options: OpenOptions,
) -> Result<Arc<Volume>> {
    let location = Location::parse(&layout.url)?;
    refuse_existing(image)?;
    file_geometry(layout.log_bytes, layout.segment_size_bytes)?;
    let store = location.open_store(config.retry_timeout)?;
    let runtime = current_thread_runtime()?;
    location.reach(
        &runtime,
        Contact::Create {
            make_bucket: layout.create_bucket,
        },
    )?;
    let listing = runtime.block_on(list(&store, &location))?;
    if !listing.roots.is_empty() || !listing.segments.is_empty() {
        return Err(TierError::Exists(format!(
            "{} already holds a volume; attach to it with `zdisk create IMAGE --physical SIZE --from {}`",
            location.url, location.url
        )));
    }
    let result = (|| {
        Sidecar::new(&location.url, random_id()?, 0, layout.cache_bytes)
            .store(&sidecar_path(image))?;
        let inner = FileMedia::create(
            image,
            Some(layout.log_bytes),
            layout.segment_size_bytes,
            false,
        )?;
        let media = TieredMedia::open(Arc::new(inner), sidecar_path(image), config)?;
        create.media_kind = MediaKind::Tiered;
        create.media_params = location.url.as_bytes().to_vec();
        Ok(Volume::create(media as Arc<dyn Media>, create, options)?)
    })();
    if result.is_err() {
        remove_partial(image);
    }
    result
}

/// Makes a new local cache for the volume at `url` from its newest root
/// object, and opens it. Without `take_over`, refuses a volume whose newest
/// root is not a clean stop's: another machine may still be writing it.
pub fn restore(
    image: &Path,
    url: &str,
    cache_bytes: u64,
    take_over: bool,
    config: TierConfig,
    options: OpenOptions,
) -> Result<Arc<Volume>> {
    let location = Location::parse(url)?;
    refuse_existing(image)?;
    let store = location.open_store(config.retry_timeout)?;
    let runtime = current_thread_runtime()?;
    location.reach(&runtime, Contact::Attach)?;
    let listing = runtime.block_on(list(&store, &location))?;
    let Some(&number) = listing.roots.last() else {
        return Err(TierError::Missing(format!(
            "{} holds no zdisk volume (no root object)",
            location.url
        )));
    };
    let root_object = runtime.block_on(get_root(&store, &location, number))?;
    if !root_object.clean && !take_over && !options.read_only {
        return Err(TierError::OtherWriter(format!(
            "{}: its newest root object ({number}) is not a clean stop's, so another machine may \
             still be writing the volume; if that machine is gone, pass --take-over",
            location.url
        )));
    }
    let root = Root::decode(&root_object.engine_root).map_err(|e| {
        TierError::BadObject(format!("{}: root object {number}: {e}", location.url))
    })?;
    let superblock = &root.superblock;
    if superblock.media_kind != MediaKind::Tiered {
        return Err(TierError::BadObject(format!(
            "{}: root object {number} is not a tiered volume's",
            location.url
        )));
    }
    for entry in &root_object.segments {
        let there = listing
            .segments
            .get(&entry.incarnation())
            .copied()
            .unwrap_or(0);
        if there < entry.len_bytes {
            return Err(TierError::Missing(format!(
                "{}: root object {number} needs {} bytes of segment {} (seq {:08x}), the bucket holds {there}",
                location.url, entry.len_bytes, entry.segment, entry.seq32
            )));
        }
    }
    let result = (|| {
        let geometry = superblock.geometry;
        let inner = FileMedia::create(
            image,
            Some(superblock.physical_size_bytes),
            geometry.segment_size_bytes,
            false,
        )?;
        if inner.geometry() != geometry {
            return Err(TierError::Local(format!(
                "{}: a local image of {} bytes does not take the volume's geometry",
                location.url, superblock.physical_size_bytes
            )));
        }
        inner
            .write_meta_slot(root.slot(), &root_object.engine_root)
            .and_then(|()| inner.sync())?;
        let mut sidecar = Sidecar::new(&location.url, random_id()?, number, cache_bytes);
        sidecar.reader = options.read_only;
        sidecar.evicted = root_object
            .segments
            .iter()
            .map(|entry| (entry.segment, entry.seq32, entry.writer, entry.len_bytes))
            .collect();
        sidecar.store(&sidecar_path(image))?;
        drop(inner);
        open(image, config, options)
    })();
    if result.is_err() {
        remove_partial(image);
    }
    result
}

/// Opens a tiered image; a reader's (made `--from` with `--read-only`)
/// only read-only.
pub fn open(image: &Path, config: TierConfig, options: OpenOptions) -> Result<Arc<Volume>> {
    let sidecar = Sidecar::load(&sidecar_path(image))?;
    if sidecar.reader && !options.read_only {
        return Err(TierError::ReaderOnly(format!(
            "{} was made to read {} (create --from --read-only): serve it with --read-only",
            image.display(),
            sidecar.url
        )));
    }
    let config = TierConfig {
        read_only: options.read_only || config.read_only,
        ..config
    };
    let inner = FileMedia::open(image, options.read_only, geometry_in_slots)?;
    let media = TieredMedia::open(Arc::new(inner), sidecar_path(image), config)?;
    Ok(Volume::open(media as Arc<dyn Media>, options)?)
}

/// A runtime for the few store calls of a create or restore.
fn current_thread_runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| TierError::Local(format!("cannot start a runtime for the bucket: {e}")))
}
