//! What the log runs on, and its errors.
//!
//! [`LogDevice`] is a byte-addressed block device: a zdisk volume in
//! process ([`TargetDevice`], real or virtual time), an NBD export (a
//! `zdisk_nbd_wire::Connection`, zdisk's one NBD client), or a test
//! double. The log only writes and trims whole, aligned blocks, and
//! relies on what every block device promises: after `flush` returns,
//! everything written before it survives a crash; a write that a crash
//! interrupts leaves each 512-byte sector of it old or new.

use std::fmt;
use std::io::{Read, Write};

use zdisk_core::BlockDevice;
use zdisk_nbd_wire::Connection;

use crate::driver::{self, Target};

/// A block device the log can run on. Errors are messages; the log wraps
/// them with what it was doing ([`WalError::Device`]).
pub trait LogDevice {
    fn size_bytes(&self) -> u64;
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), String>;
    fn write_at(&mut self, offset: u64, data: &[u8]) -> Result<(), String>;
    /// Makes everything written so far durable.
    fn flush(&mut self) -> Result<(), String>;
    /// Discards a range: it reads as zeros afterwards and holds no space.
    fn trim(&mut self, offset: u64, len: u64) -> Result<(), String>;
}

/// The device operation that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceOp {
    Read,
    Write,
    Flush,
    Trim,
}

/// What can go wrong running a log.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WalError {
    /// The device failed.
    Device {
        op: DeviceOp,
        offset: u64,
        len: u64,
        message: String,
    },
    /// Neither anchor slot holds an intact anchor: no log starts here.
    NoAnchor { base_offset: u64 },
    /// The next commit would overwrite commits not yet checkpointed.
    Full {
        commit_bytes: u64,
        live_bytes: u64,
        area_bytes: u64,
    },
    /// The log does not fit the device, or a commit cannot fit the log.
    DoesNotFit { needed_bytes: u64, room_bytes: u64 },
}

impl fmt::Display for WalError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WalError::Device {
                op,
                offset,
                len,
                message,
            } => write!(f, "log device {op:?} of {len} bytes at {offset}: {message}"),
            WalError::NoAnchor { base_offset } => {
                write!(f, "no intact log anchor at offset {base_offset}")
            }
            WalError::Full {
                commit_bytes,
                live_bytes,
                area_bytes,
            } => write!(
                f,
                "log full: a commit of {commit_bytes} bytes does not fit beside {live_bytes} \
                 bytes not yet checkpointed in a ring of {area_bytes}"
            ),
            WalError::DoesNotFit {
                needed_bytes,
                room_bytes,
            } => write!(f, "{needed_bytes} bytes needed, {room_bytes} available"),
        }
    }
}

impl std::error::Error for WalError {}

/// Runs a device operation, naming it in the error.
pub(crate) fn device_op<T>(
    op: DeviceOp,
    offset: u64,
    len: u64,
    result: Result<T, String>,
) -> Result<T, WalError> {
    result.map_err(|message| WalError::Device {
        op,
        offset,
        len,
        message,
    })
}

/// A benchmark target (a zdisk volume on an image or an emulated drive) as
/// a log device. In virtual time every operation advances the target's
/// clock by what the drive model says it takes, and the drive's background
/// work runs before it, as in `driver::run`; in real time the volume's own
/// background thread does that work.
pub struct TargetDevice<'a> {
    target: &'a mut Target,
}

impl<'a> TargetDevice<'a> {
    pub fn new(target: &'a mut Target) -> TargetDevice<'a> {
        TargetDevice { target }
    }

    pub fn target(&mut self) -> &mut Target {
        self.target
    }

    fn command(
        &mut self,
        command: impl FnOnce(&zdisk_core::Volume) -> Result<(), String>,
    ) -> Result<(), String> {
        driver::background_tick(self.target)?;
        driver::run_command(self.target, command).map(|_| ())
    }
}

impl LogDevice for TargetDevice<'_> {
    fn size_bytes(&self) -> u64 {
        self.target.volume.superblock().logical_size_bytes
    }

    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), String> {
        self.command(|volume| volume.read(offset, buf).map_err(|e| e.to_string()))
    }

    fn write_at(&mut self, offset: u64, data: &[u8]) -> Result<(), String> {
        self.command(|volume| volume.write(offset, data, false).map_err(|e| e.to_string()))
    }

    fn flush(&mut self) -> Result<(), String> {
        self.command(|volume| BlockDevice::flush(volume).map_err(|e| e.to_string()))
    }

    fn trim(&mut self, offset: u64, len: u64) -> Result<(), String> {
        self.command(|volume| volume.trim(offset, len, false).map_err(|e| e.to_string()))
    }
}

/// An NBD export as a log device: one request at a time on one
/// connection, through zdisk's NBD client. A connection that has not
/// finished its handshake has size 0, so no log fits it.
impl<S: Read + Write> LogDevice for Connection<S> {
    fn size_bytes(&self) -> u64 {
        self.export().map_or(0, |export| export.size_bytes)
    }

    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), String> {
        Connection::read_at(self, offset, buf).map_err(|e| e.to_string())
    }

    fn write_at(&mut self, offset: u64, data: &[u8]) -> Result<(), String> {
        Connection::write_at(self, offset, data).map_err(|e| e.to_string())
    }

    fn flush(&mut self) -> Result<(), String> {
        Connection::flush(self).map_err(|e| e.to_string())
    }

    fn trim(&mut self, offset: u64, len: u64) -> Result<(), String> {
        Connection::trim(self, offset, len).map_err(|e| e.to_string())
    }
}
