//! The tier's local state, `IMAGE.tier` beside the image: which bucket,
//! which writer this image is, the last root object it published or
//! started from, and which segments are evicted (held only in the bucket).
//!
//! The evicted list must be durable before a segment's local bytes are
//! dropped, and its entry removed durably before the segment is written
//! again, so after a crash a segment is read from the bucket exactly when
//! its local bytes are gone. Written whole to a temporary file, synced and
//! renamed over the old one.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Result, TierError};

const VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sidecar {
    pub version: u32,
    /// The volume's `s3://BUCKET/PREFIX`.
    pub url: String,
    /// This image as a writer, in hex (random at create or restore).
    pub writer_id: String,
    /// The newest root object this image published or was restored from.
    pub bucket_root: u64,
    /// Most bytes of segments the local cache keeps (`--physical`).
    pub cache_bytes: u64,
    /// Evicted segments: (segment, seq32, writer, bytes in the bucket).
    pub evicted: Vec<(u32, u32, u64, u64)>,
    /// Segments written back into the cache from another writer's object:
    /// (segment, seq32, writer). An entry whose incarnation the segment no
    /// longer holds means nothing.
    #[serde(default)]
    pub written_back: Vec<(u32, u32, u64)>,
    /// Made `--from` a bucket to read it (`create --read-only`): never
    /// opened to write, so it never publishes or takes the volume.
    #[serde(default)]
    pub reader: bool,
}

/// The sidecar's path for an image.
pub fn sidecar_path(image: &Path) -> PathBuf {
    let mut name = image.as_os_str().to_owned();
    name.push(".tier");
    PathBuf::from(name)
}

impl Sidecar {
    pub fn new(url: &str, writer_id: [u8; 16], bucket_root: u64, cache_bytes: u64) -> Sidecar {
        Sidecar {
            version: VERSION,
            url: url.to_string(),
            writer_id: hex(&writer_id),
            bucket_root,
            cache_bytes,
            evicted: Vec::new(),
            written_back: Vec::new(),
            reader: false,
        }
    }

    pub fn writer_id(&self) -> Result<[u8; 16]> {
        let bad = || {
            TierError::Local(format!(
                "bad writer_id {:?} in the tier state",
                self.writer_id
            ))
        };
        if self.writer_id.len() != 32 {
            return Err(bad());
        }
        let mut id = [0u8; 16];
        for (i, byte) in id.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&self.writer_id[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(id)
    }

    pub fn load(path: &Path) -> Result<Sidecar> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            TierError::Local(format!(
                "cannot read the tier state {}: {e} (a tiered image needs it beside the image)",
                path.display()
            ))
        })?;
        let sidecar: Sidecar = serde_json::from_str(&text).map_err(|e| {
            TierError::Local(format!("the tier state {} is damaged: {e}", path.display()))
        })?;
        if sidecar.version != VERSION {
            return Err(TierError::Local(format!(
                "the tier state {} has version {}; this zdisk reads {VERSION}",
                path.display(),
                sidecar.version
            )));
        }
        sidecar.writer_id()?;
        Ok(sidecar)
    }

    /// Writes the state durably (temporary file, sync, rename, sync of the directory).
    pub fn store(&self, path: &Path) -> Result<()> {
        use std::io::Write;
        // Synced file I/O: never under a lock a read takes.
        zdisk_core::held::assert_none_held("writing the tier state file");
        let fail = |e: std::io::Error| {
            TierError::Local(format!(
                "cannot write the tier state {}: {e}",
                path.display()
            ))
        };
        let mut temporary = path.as_os_str().to_owned();
        temporary.push(".new");
        let temporary = PathBuf::from(temporary);
        let text = serde_json::to_string(self).expect("the tier state serialises");
        let mut file = std::fs::File::create(&temporary).map_err(fail)?;
        file.write_all(text.as_bytes()).map_err(fail)?;
        file.sync_all().map_err(fail)?;
        std::fs::rename(&temporary, path).map_err(fail)?;
        let parent = match path.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => Path::new("."),
        };
        if let Ok(directory) = std::fs::File::open(parent) {
            let _ = directory.sync_all();
        }
        Ok(())
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_round_trips_and_damage_is_an_error() {
        let dir = std::env::temp_dir().join(format!("zdisk-tier-sidecar-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("x.tier");
        let mut sidecar = Sidecar::new("s3://b/p", [7; 16], 3, 1 << 20);
        sidecar.evicted.push((4, 5, 6, 4096));
        sidecar.store(&path).unwrap();
        assert_eq!(Sidecar::load(&path).unwrap(), sidecar);
        assert_eq!(Sidecar::load(&path).unwrap().writer_id().unwrap(), [7; 16]);
        std::fs::write(&path, "{").unwrap();
        assert!(Sidecar::load(&path)
            .unwrap_err()
            .to_string()
            .contains("damaged"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
