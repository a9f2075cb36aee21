//! The drives a benchmark can run on: a real image in real time, or an
//! emulated NAND drive (see `zdisk-nand`) in virtual time. Every scenario
//! asks for a fresh drive, so scenarios never see each other's data.

use std::path::PathBuf;
use std::sync::Arc;

use zdisk_core::media::{file_geometry, FileMedia, Media, FILE_DATA_OFFSET};
use zdisk_core::meta::{geometry_in_slots, MediaKind};
use zdisk_core::{Codec, CreateOptions, GcPolicy, OpenOptions, Volume};

use crate::driver::{Clock, Target};

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
}

/// A real image file or block device, driven in real time.
pub struct ImageDrive {
    pub path: PathBuf,
    pub logical_bytes: u64,
    pub physical_bytes: u64,
    pub segment_bytes: u64,
    pub codec: Codec,
    pub gc_policy: GcPolicy,
}

impl ImageDrive {
    fn remove_old(&self) -> Result<(), String> {
        use std::io::Read;
        let Ok(metadata) = std::fs::metadata(&self.path) else {
            return Ok(());
        };
        if !metadata.is_file() {
            return Ok(()); // a block device is simply overwritten
        }
        let mut magic = [0u8; 8];
        let mut file = std::fs::File::open(&self.path).map_err(|e| e.to_string())?;
        let is_image =
            file.read_exact(&mut magic).is_ok() && &magic == zdisk_core::meta::META_MAGIC;
        if !is_image && metadata.len() > 0 {
            return Err(format!(
                "{} exists and is not a zdisk image; the benchmark overwrites its image, so give a new path",
                self.path.display()
            ));
        }
        std::fs::remove_file(&self.path)
            .map_err(|e| format!("cannot replace {}: {e}", self.path.display()))
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
        let physical = options
            .physical_bytes
            .map(|log| log + FILE_DATA_OFFSET)
            .unwrap_or(self.physical_bytes);
        let media = FileMedia::create(&self.path, Some(physical), self.segment_bytes, true)
            .map_err(|e| e.to_string())?;
        let create = CreateOptions {
            logical_size_bytes: options.logical_bytes.unwrap_or(self.logical_bytes),
            codec: options.codec.unwrap_or(self.codec),
            gc_policy: options.gc_policy.unwrap_or(self.gc_policy),
            media_kind: MediaKind::File,
            media_params: Vec::new(),
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
            ..*self
        }))
    }

    fn discard(&self) {
        if self.path.is_file() {
            let _ = std::fs::remove_file(&self.path);
        }
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

struct NandClock(Arc<zdisk_nand::NandMedia>);

impl crate::driver::VirtualClock for NandClock {
    fn begin_op(&self, issue_ns: u64) {
        self.0.begin_op(issue_ns);
    }

    fn end_op(&self) -> u64 {
        self.0.end_op()
    }
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
            text.push_str(&format!(
                ", recycling capped at {:.0} MB/s",
                cap as f64 / 1e6
            ));
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
            zdisk_nand::NandMedia::new_in_memory(params.clone(), zdisk_nand::Clock::Virtual)
                .map_err(|e| e.to_string())?,
        );
        let create = CreateOptions {
            logical_size_bytes: logical,
            codec,
            gc_policy: options.gc_policy.unwrap_or(self.gc_policy),
            media_kind: MediaKind::Nand,
            media_params: params.encode_params(),
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
            clock: Clock::Virtual(Arc::new(NandClock(media))),
            now_ns,
            details: Some(Box::new(move || {
                serde_json::to_value(stats_media.stats()).unwrap_or_default()
            })),
        })
    }
}
