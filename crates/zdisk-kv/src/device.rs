//! The block devices the store runs on: anything that reads and writes
//! whole 4 KiB slots at byte offsets and can make its writes durable.
//!
//! Contract ([`SlotDevice`]): reads and writes are positioned and may run
//! from several threads at once; a write is visible to later reads at
//! once; `flush` makes every write that returned before it durable. After
//! a crash, each slot-sized, slot-aligned write that no flush covered reads
//! back as its old or its new content, never a mix: zdisk promises this per
//! 4 KiB block (docs/semantics.md, "After a crash"). The store also checks a
//! CRC32C per slot, so a device that tears a slot is detected, not trusted.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Mutex;

use crate::error::{Error, Result};

/// Positioned I/O on a block device. See the module documentation.
pub trait SlotDevice: Send + Sync {
    /// Size of the device in bytes.
    fn size_bytes(&self) -> u64;
    /// Fills `buf` from `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()>;
    /// Writes `buf` at `offset`.
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()>;
    /// Makes every write that returned before this call durable.
    fn flush(&self) -> Result<()>;
    /// Makes `len` bytes at `offset` read as zeros, at best without
    /// storing anything (zdisk maps them as zeros).
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        let zeros = vec![0u8; 1 << 20];
        let mut done = 0;
        while done < len {
            let chunk = (len - done).min(zeros.len() as u64) as usize;
            self.write_at(&zeros[..chunk], offset + done)?;
            done += chunk as u64;
        }
        Ok(())
    }
}

/// A file or block device (an nbdfuse file, a loop device, a plain file),
/// through `pread`/`pwrite` and `fdatasync`.
pub struct FileDevice {
    file: File,
    size_bytes: u64,
}

impl FileDevice {
    pub fn open(path: &Path) -> Result<FileDevice> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| Error::Open {
                what: path.display().to_string(),
                source,
            })?;
        // A block device reports size 0 in its metadata; seeking finds it.
        let size_bytes = {
            use std::io::{Seek, SeekFrom};
            let mut handle = &file;
            handle.seek(SeekFrom::End(0)).map_err(Error::Io)?
        };
        Ok(FileDevice { file, size_bytes })
    }
}

impl SlotDevice for FileDevice {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.file.read_exact_at(buf, offset).map_err(Error::Io)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.file.write_all_at(buf, offset).map_err(Error::Io)
    }

    fn flush(&self) -> Result<()> {
        self.file.sync_data().map_err(Error::Io)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid descriptor and plain integers.
        let punched = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        if punched == 0 {
            return Ok(());
        }
        // Not every file system (or a block device) punches: write zeros.
        let zeros = vec![0u8; 1 << 20];
        let mut done = 0;
        while done < len {
            let chunk = (len - done).min(zeros.len() as u64) as usize;
            self.write_at(&zeros[..chunk], offset + done)?;
            done += chunk as u64;
        }
        Ok(())
    }
}

/// A RAM device for tests that keeps a live and a durable image: `crash`
/// throws away every write since the last flush, or keeps a chosen subset
/// of them (each write whole, as the contract allows).
pub struct MemDevice {
    state: Mutex<MemState>,
}

struct MemState {
    live: Vec<u8>,
    durable: Vec<u8>,
    /// Writes since the last flush, oldest first.
    pending: Vec<(u64, Vec<u8>)>,
}

impl MemDevice {
    pub fn new(size_bytes: usize) -> MemDevice {
        MemDevice {
            state: Mutex::new(MemState {
                live: vec![0; size_bytes],
                durable: vec![0; size_bytes],
                pending: Vec::new(),
            }),
        }
    }

    /// Simulates a power cut: the device comes back with its durable image
    /// plus those unflushed writes for which `keep(index)` is true.
    pub fn crash(&self, mut keep: impl FnMut(usize) -> bool) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let pending = std::mem::take(&mut state.pending);
        let mut image = state.durable.clone();
        for (index, (offset, bytes)) in pending.into_iter().enumerate() {
            if keep(index) {
                let start = offset as usize;
                image[start..start + bytes.len()].copy_from_slice(&bytes);
            }
        }
        state.durable = image.clone();
        state.live = image;
    }

    /// How many writes no flush has covered yet.
    pub fn pending_writes(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pending
            .len()
    }
}

fn check_range(offset: u64, len: usize, size_bytes: u64) -> Result<usize> {
    let end = offset.checked_add(len as u64);
    match end {
        Some(end) if end <= size_bytes => Ok(offset as usize),
        _ => Err(Error::OutOfRange {
            offset,
            length: len as u64,
            size_bytes,
        }),
    }
}

impl SlotDevice for MemDevice {
    fn size_bytes(&self) -> u64 {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .live
            .len() as u64
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let start = check_range(offset, buf.len(), state.live.len() as u64)?;
        buf.copy_from_slice(&state.live[start..start + buf.len()]);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let start = check_range(offset, buf.len(), state.live.len() as u64)?;
        state.live[start..start + buf.len()].copy_from_slice(buf);
        state.pending.push((offset, buf.to_vec()));
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.durable = state.live.clone();
        state.pending.clear();
        Ok(())
    }
}

impl SlotDevice for Box<dyn SlotDevice> {
    fn size_bytes(&self) -> u64 {
        (**self).size_bytes()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        (**self).read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        (**self).write_at(buf, offset)
    }

    fn flush(&self) -> Result<()> {
        (**self).flush()
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        (**self).write_zeroes(offset, len)
    }
}
