//! The drives a benchmark can run on: a real image in real time, or an
//! emulated NAND drive (see `zdisk-nand`) in virtual time. Every scenario
//! asks for a fresh drive, so scenarios never see each other's data.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use zdisk_core::media::{file_geometry, FileMedia, Media, FILE_DATA_OFFSET};
use zdisk_core::meta::{geometry_in_slots, MediaKind};
use zdisk_core::{Codec, CreateOptions, GcPolicy, OpenOptions, Volume};

use crate::driver::Target;

/// Variations a scenario asks of a drive.
#[derive(Debug, Clone, Default)]
pub struct DriveOptions {
    /// Power-loss protection (emulated drives only); `None` for the
    /// drive's own setting (the profile's default, or `--plp`).
    pub plp: Option<bool>,
    /// Logical size; `None` for the drive's default.
    pub logical_bytes: Option<u64>,
    /// Physical size; `None` for the drive's default.
    pub physical_bytes: Option<u64>,
    pub gc_policy: Option<GcPolicy>,
    pub codec: Option<Codec>,
}

pub trait Drive: Send + Sync {
    /// E.g. "image /tmp/b.zdisk (real time)".
    fn describe(&self) -> String;
    fn supports_plp(&self) -> bool;
    /// Physical log capacity and logical size a default drive has.
    fn default_sizes(&self) -> (u64, u64);
    /// Segment size and page size of the medium.
    fn segment_and_page(&self) -> (u64, u64);
    /// A fresh, empty drive.
    fn create(&self, options: &DriveOptions) -> Result<Target, String>;

    /// 4 KiB random read IOPS the drive's timing parameters imply at queue
    /// depth `qd`, for emulated drives.
    fn random_read_iops_model(&self, qd: usize) -> Option<f64> {
        let _ = qd;
        None
    }

    /// Reopens the drive last created (with its data), if the drive can.
    fn reopener(&self) -> Option<Box<dyn Fn() -> Result<Target, String> + '_>> {
        None
    }

    /// Another drive of the same kind on the same medium, told apart by
    /// `name`, for a baseline measured in the same run; `None` if the
    /// medium holds only one (a block device, an emulated drive, which
    /// needs no baseline as its time is virtual).
    fn sibling(&self, name: &str) -> Option<Box<dyn Drive>> {
        let _ = name;
        None
    }

    /// Removes what `create` left on the medium, if it can be removed.
    fn discard(&self) {}

    /// Checks, before anything is created, that the drive and the named
    /// siblings a run will ask for may be (re)created.
    fn preflight(&self, siblings: &[&str]) -> Result<(), String> {
        let _ = siblings;
        Ok(())
    }

    /// Files this run created that are still there.
    fn files_left(&self) -> Vec<PathBuf> {
        Vec::new()
    }
}

/// A real image file or block device, driven in real time.
///
/// The benchmark recreates its image for every scenario, so it must never
/// destroy what it was not given: a path that existed before this run is
/// replaced only with `force`, an image another process holds (its lock) is
/// refused even then, and only files this run created are removed at the end.
pub struct ImageDrive {
    pub path: PathBuf,
    pub logical_bytes: u64,
    pub physical_bytes: u64,
    pub segment_bytes: u64,
    pub codec: Codec,
    pub gc_policy: GcPolicy,
    /// The user allowed replacing an existing image (`--force`).
    pub force: bool,
    /// Every path this run created, shared with sibling drives.
    pub created: CreatedFiles,
}

/// The image files one benchmark run created, in order of creation.
#[derive(Debug, Clone, Default)]
pub struct CreatedFiles(Arc<Mutex<Vec<PathBuf>>>);

impl CreatedFiles {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<PathBuf>> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn contains(&self, path: &Path) -> bool {
        self.lock().iter().any(|p| p == path)
    }

    fn insert(&self, path: &Path) -> bool {
        let mut paths = self.lock();
        if paths.iter().any(|p| p == path) {
            return false;
        }
        paths.push(path.to_path_buf());
        true
    }

    fn remove(&self, path: &Path) {
        self.lock().retain(|p| p != path);
    }

    /// The created files that still exist.
    pub fn existing(&self) -> Vec<PathBuf> {
        self.lock().iter().filter(|p| p.exists()).cloned().collect()
    }
}

impl ImageDrive {
    /// Makes room for a fresh image at the path: removes the previous one
    /// if this run made it, or, with `force`, an unlocked zdisk image that
    /// was there before.
    fn remove_old(&self) -> Result<(), String> {
        if self.may_replace()? && std::fs::metadata(&self.path).is_ok_and(|m| m.is_file()) {
            std::fs::remove_file(&self.path)
                .map_err(|e| format!("cannot replace {}: {e}", self.path.display()))?;
        }
        Ok(())
    }

    /// Whether something is at the path that a new image would replace
    /// (`Ok(false)` if nothing is), or why it must not be replaced.
    fn may_replace(&self) -> Result<bool, String> {
        use std::io::Read;
        let Ok(metadata) = std::fs::metadata(&self.path) else {
            return Ok(false);
        };
        if self.created.contains(&self.path) {
            // Ours, from an earlier scenario (possibly still open here).
            return Ok(true);
        }
        if !self.force {
            return Err(format!(
                "{} already exists; the benchmark recreates its image and would destroy it, \
                 so give a new path or pass --force",
                self.path.display()
            ));
        }
        // Refuse an image in use, even with --force, before touching it.
        let file = std::fs::File::open(&self.path)
            .map_err(|e| format!("cannot open {}: {e}", self.path.display()))?;
        zdisk_core::media::lock_file(&file, &self.path, true).map_err(|e| e.to_string())?;
        if !metadata.is_file() {
            return Ok(true); // a block device is overwritten in place
        }
        let mut magic = [0u8; 16];
        let is_image = (&file).read_exact(&mut magic).is_ok()
            && (magic.starts_with(zdisk_core::meta::META_MAGIC)
                || zdisk_nand::is_nand_image(&magic));
        if !is_image && metadata.len() > 0 {
            return Err(format!(
                "{} exists and is not a zdisk image; the benchmark overwrites its image, so give a new path",
                self.path.display()
            ));
        }
        Ok(true)
    }
}

impl Drive for ImageDrive {
    fn describe(&self) -> String {
        format!("image {} (real time)", self.path.display())
    }

    fn supports_plp(&self) -> bool {
        false
    }

    fn default_sizes(&self) -> (u64, u64) {
        let geometry = file_geometry(self.physical_bytes, self.segment_bytes);
        let log = geometry
            .map(|g| g.log_capacity_bytes())
            .unwrap_or(self.physical_bytes);
        (log, self.logical_bytes)
    }

    fn segment_and_page(&self) -> (u64, u64) {
        (self.segment_bytes, 4096)
    }

    fn create(&self, options: &DriveOptions) -> Result<Target, String> {
        if options.plp == Some(true) {
            return Err("a file medium has no power-loss protection".into());
        }
        self.remove_old()?;
        if self.created.insert(&self.path) {
            crate::say!("bench: creating image {}", self.path.display())?;
        }
        let physical = options
            .physical_bytes
            .map(|log| log + FILE_DATA_OFFSET)
            .unwrap_or(self.physical_bytes);
        let media = FileMedia::create(&self.path, Some(physical), self.segment_bytes, false)
            .map_err(|e| e.to_string())?;
        let create = CreateOptions {
            logical_size_bytes: options.logical_bytes.unwrap_or(self.logical_bytes),
            codec: options.codec.unwrap_or(self.codec),
            gc_policy: options.gc_policy.unwrap_or(self.gc_policy),
            unit_blocks: zdisk_core::meta::default_unit_blocks(options.codec.unwrap_or(self.codec)),
            media_kind: MediaKind::File,
            media_params: Vec::new(),
            // The scenarios measure compression and cleaning; dedup has
            // its own benchmark (scripts/dedup.py).
            dedup: false,
        };
        let volume = Volume::create(
            Arc::new(media) as Arc<dyn Media>,
            create,
            OpenOptions::default(),
        )
        .map_err(|e| e.to_string())?;
        Ok(Target::real(volume))
    }

    fn sibling(&self, name: &str) -> Option<Box<dyn Drive>> {
        use std::os::unix::fs::FileTypeExt;
        let is_device = std::fs::metadata(&self.path)
            .is_ok_and(|m| m.file_type().is_block_device() || m.file_type().is_char_device());
        if is_device {
            return None;
        }
        // dirty.zdisk -> dirty.clean.zdisk, in the same directory.
        let stem = self.path.file_stem()?.to_string_lossy().into_owned();
        let file = match self.path.extension() {
            Some(ext) => format!("{stem}.{name}.{}", ext.to_string_lossy()),
            None => format!("{stem}.{name}"),
        };
        Some(Box::new(ImageDrive {
            path: self.path.with_file_name(file),
            force: self.force,
            created: self.created.clone(),
            ..*self
        }))
    }

    fn discard(&self) {
        // Only what this run created, and only a regular file.
        if self.created.contains(&self.path) && self.path.is_file() {
            if std::fs::remove_file(&self.path).is_ok() {
                // Only a report: the file is gone whether or not it prints.
                let _ = crate::say!("bench: removed {}", self.path.display());
            }
            self.created.remove(&self.path);
        }
    }

    fn preflight(&self, siblings: &[&str]) -> Result<(), String> {
        self.may_replace()?;
        for name in siblings {
            if let Some(sibling) = self.sibling(name) {
                sibling.preflight(&[])?;
            }
        }
        Ok(())
    }

    fn files_left(&self) -> Vec<PathBuf> {
        self.created.existing()
    }

    fn reopener(&self) -> Option<Box<dyn Fn() -> Result<Target, String> + '_>> {
        Some(Box::new(|| {
            let media =
                FileMedia::open(&self.path, false, geometry_in_slots).map_err(|e| e.to_string())?;
            let volume = Volume::open(Arc::new(media) as Arc<dyn Media>, OpenOptions::default())
                .map_err(|e| e.to_string())?;
            Ok(Target::real(volume))
        }))
    }
}

/// An emulated NAND drive in virtual time, its contents in RAM.
pub struct NandDrive {
    pub params: zdisk_nand::NandParams,
    pub codec: Option<Codec>,
    pub gc_policy: GcPolicy,
}

impl NandDrive {
    fn params_for(&self, options: &DriveOptions) -> zdisk_nand::NandParams {
        let mut params = self.params.clone();
        if let Some(bytes) = options.physical_bytes {
            params.profile = params.profile.clone().with_physical_bytes(bytes);
        }
        if let Some(plp) = options.plp {
            params.config.power_loss_protection = plp;
        }
        params
    }
}

impl Drive for NandDrive {
    fn random_read_iops_model(&self, qd: usize) -> Option<f64> {
        Some(self.params.profile.random_read_iops_model(qd as u32))
    }

    fn describe(&self) -> String {
        let config = &self.params.config;
        let mut text = format!(
            "emulated {} (virtual time, {} physical",
            self.params.profile.name,
            zdisk_core::units::format_size(self.params.profile.physical_bytes())
        );
        if config.power_loss_protection {
            text.push_str(", power-loss protection");
        }
        if let Some(cap) = config.recycle_cap_bytes_per_sec {
            // As many decimals as the cap has (72.5, not 72 or 72.500).
            let mb_s = format!("{:.3}", cap as f64 / 1e6);
            let mb_s = mb_s.trim_end_matches('0').trim_end_matches('.');
            text.push_str(&format!(", recycling capped at {mb_s} MB/s"));
        }
        text.push(')');
        text
    }

    fn supports_plp(&self) -> bool {
        true
    }

    fn default_sizes(&self) -> (u64, u64) {
        let profile = &self.params.profile;
        (profile.physical_bytes(), profile.logical_size_bytes())
    }

    fn segment_and_page(&self) -> (u64, u64) {
        let profile = &self.params.profile;
        (profile.segment_size_bytes(), profile.page_size_bytes as u64)
    }

    fn create(&self, options: &DriveOptions) -> Result<Target, String> {
        let params = self.params_for(options);
        let logical = options
            .logical_bytes
            .unwrap_or_else(|| params.profile.logical_size_bytes());
        let codec = match options.codec.or(self.codec) {
            Some(codec) => codec,
            None => Codec::parse(&params.profile.codec)?,
        };
        let media = Arc::new(
            zdisk_nand::NandMedia::new_in_memory(
                params.clone(),
                zdisk_core::clock::Timing::Virtual,
            )
            .map_err(|e| e.to_string())?,
        );
        let create = CreateOptions {
            logical_size_bytes: logical,
            codec,
            gc_policy: options.gc_policy.unwrap_or(self.gc_policy),
            // The drive's controller compresses each 4 KiB block alone.
            unit_blocks: 1,
            media_kind: MediaKind::Nand,
            media_params: params.encode_params(),
            // Nor does it deduplicate.
            dedup: false,
        };
        let open = OpenOptions {
            background: false,
            ..OpenOptions::default()
        };
        let volume = Volume::create(media.clone() as Arc<dyn Media>, create, open)
            .map_err(|e| e.to_string())?;
        let now_ns = media.now_ns();
        let stats_media = media.clone();
        Ok(Target {
            volume,
            virtual_time: Some(media),
            now_ns,
            details: Some(Box::new(move || {
                serde_json::to_value(stats_media.stats()).unwrap_or_default()
            })),
        })
    }
}

/// A volume on a RAM medium (`crate::ram`), driven in real time: the
/// engine's own speed, with no medium latency and no medium lock in the
/// way. Nothing outlives the run.
pub struct RamDrive {
    pub logical_bytes: u64,
    /// Bytes of log (segments); the metadata slots come on top.
    pub physical_bytes: u64,
    pub segment_bytes: u64,
    pub codec: Codec,
    pub gc_policy: GcPolicy,
}

impl RamDrive {
    fn geometry(&self, physical_bytes: u64) -> zdisk_core::media::MediaGeometry {
        zdisk_core::media::MediaGeometry {
            page_size_bytes: 4096,
            segment_size_bytes: self.segment_bytes,
            segment_count: (physical_bytes / self.segment_bytes.max(1)).min(u32::MAX as u64 - 1)
                as u32,
            meta_slot_size_bytes: 1 << 20,
        }
    }
}

impl Drive for RamDrive {
    fn describe(&self) -> String {
        format!(
            "RAM ({} logical, {} physical, real time)",
            zdisk_core::units::format_size(self.logical_bytes),
            zdisk_core::units::format_size(self.physical_bytes)
        )
    }

    fn supports_plp(&self) -> bool {
        false
    }

    fn default_sizes(&self) -> (u64, u64) {
        (
            self.geometry(self.physical_bytes).log_capacity_bytes(),
            self.logical_bytes,
        )
    }

    fn segment_and_page(&self) -> (u64, u64) {
        (self.segment_bytes, 4096)
    }

    fn create(&self, options: &DriveOptions) -> Result<Target, String> {
        if options.plp == Some(true) {
            return Err("a RAM medium has no power-loss protection".into());
        }
        let geometry = self.geometry(options.physical_bytes.unwrap_or(self.physical_bytes));
        let media = crate::ram::RamMedia::new(geometry).map_err(|e| e.to_string())?;
        let codec = options.codec.unwrap_or(self.codec);
        let create = CreateOptions {
            logical_size_bytes: options.logical_bytes.unwrap_or(self.logical_bytes),
            codec,
            gc_policy: options.gc_policy.unwrap_or(self.gc_policy),
            unit_blocks: zdisk_core::meta::default_unit_blocks(codec),
            media_kind: MediaKind::Memory,
            media_params: Vec::new(),
            dedup: false,
        };
        let volume = Volume::create(
            Arc::new(media) as Arc<dyn Media>,
            create,
            OpenOptions::default(),
        )
        .map_err(|e| e.to_string())?;
        Ok(Target::real(volume))
    }
}
