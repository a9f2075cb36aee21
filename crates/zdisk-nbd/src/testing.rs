//! A RAM-backed [`BlockDevice`] test double with fault injection, for the
//! protocol tests, the fuzz entry points and the `ramserve` example.
//!
//! It follows the `BlockDevice` contract (byte-addressed, read-modify-write
//! is free in RAM, past-the-end is `OutOfRange`) and tracks allocation per
//! [`RAM_BLOCK_BYTES`] block so block status has holes, zeroes and data to
//! report. On top of that a test can:
//! - make calls touching an offset fail with an I/O error, or every write
//!   fail with `NoSpace`, `ReadOnly` or `ShutDown`, or a call panic;
//! - hold calls at an offset at a gate until released, to prove that
//!   requests run concurrently and that replies may overtake each other;
//! - inspect the most recent calls with their flags (FUA, may_punch).

use std::collections::{HashSet, VecDeque};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use zdisk_core::{BlockDevice, Error, Extent, ExtentState, Result};

/// Allocation granularity of [`RamDevice`].
pub const RAM_BLOCK_BYTES: u64 = 4096;

/// How many recent calls [`RamDevice::calls`] remembers.
const CALL_LOG_CAPACITY: usize = 1024;

/// One call the device received, for tests to inspect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    Read {
        offset: u64,
        length: u64,
    },
    Write {
        offset: u64,
        length: u64,
        fua: bool,
    },
    WriteZeroes {
        offset: u64,
        length: u64,
        may_punch: bool,
        fua: bool,
    },
    Trim {
        offset: u64,
        length: u64,
        fua: bool,
    },
    Flush,
    Cache {
        offset: u64,
        length: u64,
    },
    BlockStatus {
        offset: u64,
        length: u64,
        max_extents: usize,
    },
}

struct Contents {
    bytes: Vec<u8>,
    blocks: Vec<ExtentState>,
}

#[derive(Default)]
struct Faults {
    io_error_offsets: HashSet<u64>,
    panic_offsets: HashSet<u64>,
    no_space: bool,
    shut_down: bool,
}

#[derive(Default)]
struct Gate {
    held_offsets: HashSet<u64>,
    waiting: usize,
}

/// A byte-addressed RAM disk. See the module documentation.
pub struct RamDevice {
    size_bytes: u64,
    contents: Mutex<Contents>,
    faults: Mutex<Faults>,
    read_only: AtomicBool,
    gate: Mutex<Gate>,
    gate_changed: Condvar,
    calls: Mutex<VecDeque<Call>>,
    flushes: AtomicU64,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl RamDevice {
    /// A device of `size_bytes` that reads as zeros and is all holes.
    pub fn new(size_bytes: u64) -> Self {
        let bytes = usize::try_from(size_bytes).expect("RAM device fits in memory");
        let block_count = size_bytes.div_ceil(RAM_BLOCK_BYTES) as usize;
        RamDevice {
            size_bytes,
            contents: Mutex::new(Contents {
                bytes: vec![0; bytes],
                blocks: vec![ExtentState::Hole; block_count],
            }),
            faults: Mutex::new(Faults::default()),
            read_only: AtomicBool::new(false),
            gate: Mutex::new(Gate::default()),
            gate_changed: Condvar::new(),
            calls: Mutex::new(VecDeque::new()),
            flushes: AtomicU64::new(0),
        }
    }

    /// Calls whose range contains `offset` fail with an I/O error.
    pub fn fail_io_at(&self, offset: u64) {
        lock(&self.faults).io_error_offsets.insert(offset);
    }

    /// Calls whose range contains `offset` panic (a device bug).
    pub fn panic_at(&self, offset: u64) {
        lock(&self.faults).panic_offsets.insert(offset);
    }

    /// While set, writes and write-zeroes fail with `NoSpace`.
    pub fn set_no_space(&self, no_space: bool) {
        lock(&self.faults).no_space = no_space;
    }

    /// While set, every call fails with `ShutDown`.
    pub fn set_shut_down(&self, shut_down: bool) {
        lock(&self.faults).shut_down = shut_down;
    }

    /// While set, the device reports read-only and write-type calls fail with `ReadOnly`.
    pub fn set_read_only(&self, read_only: bool) {
        self.read_only.store(read_only, Ordering::SeqCst);
    }

    /// Removes every injected fault.
    pub fn clear_faults(&self) {
        *lock(&self.faults) = Faults::default();
        self.set_read_only(false);
    }

    /// Read and write calls starting exactly at `offset` wait until [`Self::release`].
    pub fn hold(&self, offset: u64) {
        lock(&self.gate).held_offsets.insert(offset);
    }

    /// Lets held calls at `offset` (and future ones) through.
    pub fn release(&self, offset: u64) {
        lock(&self.gate).held_offsets.remove(&offset);
        self.gate_changed.notify_all();
    }

    /// Waits until `count` calls are held at gates at the same time; false on timeout.
    pub fn wait_for_held(&self, count: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut gate = lock(&self.gate);
        while gate.waiting < count {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            gate = self
                .gate_changed
                .wait_timeout(gate, deadline - now)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
        true
    }

    /// The most recent calls, oldest first.
    pub fn calls(&self) -> Vec<Call> {
        lock(&self.calls).iter().copied().collect()
    }

    /// The most recent call, if any.
    pub fn last_call(&self) -> Option<Call> {
        lock(&self.calls).back().copied()
    }

    /// How many times `flush` succeeded.
    pub fn flush_count(&self) -> u64 {
        self.flushes.load(Ordering::SeqCst)
    }

    /// A copy of the device's bytes in `offset..offset+length`.
    pub fn snapshot(&self, offset: u64, length: u64) -> Vec<u8> {
        let start = offset as usize;
        lock(&self.contents).bytes[start..start + length as usize].to_vec()
    }

    fn record(&self, call: Call) {
        let mut calls = lock(&self.calls);
        if calls.len() == CALL_LOG_CAPACITY {
            calls.pop_front();
        }
        calls.push_back(call);
    }

    fn wait_at_gate(&self, offset: u64) {
        let mut gate = lock(&self.gate);
        if !gate.held_offsets.contains(&offset) {
            return;
        }
        gate.waiting += 1;
        self.gate_changed.notify_all();
        while gate.held_offsets.contains(&offset) {
            gate = self
                .gate_changed
                .wait(gate)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        gate.waiting -= 1;
    }

    /// Range and fault checks shared by every call.
    fn check(&self, offset: u64, length: u64, writes: bool) -> Result<()> {
        let faults = lock(&self.faults);
        if faults.shut_down {
            return Err(Error::ShutDown);
        }
        let out_of_range = match offset.checked_add(length) {
            Some(end) => end > self.size_bytes,
            None => true,
        };
        if out_of_range {
            return Err(Error::OutOfRange {
                offset,
                length,
                size: self.size_bytes,
            });
        }
        let touches = |at: &u64| *at >= offset && *at < offset + length;
        if faults.panic_offsets.iter().any(touches) {
            panic!("RamDevice: injected panic at offset {offset}");
        }
        if faults.io_error_offsets.iter().any(touches) {
            return Err(Error::io(
                format!("accessing offset {offset} length {length}"),
                io::Error::other("injected I/O error"),
            ));
        }
        if writes && self.read_only.load(Ordering::SeqCst) {
            return Err(Error::ReadOnly);
        }
        if writes && faults.no_space {
            return Err(Error::NoSpace {
                free_segments: 0,
                reserved_segments: 2,
            });
        }
        Ok(())
    }
}

/// Block indices fully inside `offset..offset+length`.
fn whole_blocks(offset: u64, length: u64) -> std::ops::Range<usize> {
    let first = offset.div_ceil(RAM_BLOCK_BYTES);
    let end = (offset + length) / RAM_BLOCK_BYTES;
    first as usize..end.max(first) as usize
}

/// Block indices touching `offset..offset+length`.
fn touched_blocks(offset: u64, length: u64) -> std::ops::Range<usize> {
    if length == 0 {
        return 0..0;
    }
    let first = offset / RAM_BLOCK_BYTES;
    let end = (offset + length).div_ceil(RAM_BLOCK_BYTES);
    first as usize..end as usize
}

impl BlockDevice for RamDevice {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn is_read_only(&self) -> bool {
        self.read_only.load(Ordering::SeqCst)
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.wait_at_gate(offset);
        let length = buf.len() as u64;
        self.record(Call::Read { offset, length });
        self.check(offset, length, false)?;
        let start = offset as usize;
        buf.copy_from_slice(&lock(&self.contents).bytes[start..start + buf.len()]);
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.wait_at_gate(offset);
        let length = data.len() as u64;
        self.record(Call::Write {
            offset,
            length,
            fua,
        });
        self.check(offset, length, true)?;
        let start = offset as usize;
        let mut contents = lock(&self.contents);
        contents.bytes[start..start + data.len()].copy_from_slice(data);
        for block in touched_blocks(offset, length) {
            contents.blocks[block] = ExtentState::Data;
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, length: u64, may_punch: bool, fua: bool) -> Result<()> {
        self.record(Call::WriteZeroes {
            offset,
            length,
            may_punch,
            fua,
        });
        self.check(offset, length, true)?;
        let start = offset as usize;
        let mut contents = lock(&self.contents);
        contents.bytes[start..start + length as usize].fill(0);
        let state = if may_punch {
            ExtentState::Hole
        } else {
            ExtentState::Zero
        };
        for block in whole_blocks(offset, length) {
            contents.blocks[block] = state;
        }
        Ok(())
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        self.record(Call::Trim {
            offset,
            length,
            fua,
        });
        self.check(offset, length, true)?;
        let mut contents = lock(&self.contents);
        for block in whole_blocks(offset, length) {
            contents.blocks[block] = ExtentState::Hole;
            let start = block * RAM_BLOCK_BYTES as usize;
            let end = (start + RAM_BLOCK_BYTES as usize).min(contents.bytes.len());
            contents.bytes[start..end].fill(0);
        }
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        self.record(Call::Flush);
        self.check(0, 0, false)?;
        self.flushes.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn cache(&self, offset: u64, length: u64) -> Result<()> {
        self.record(Call::Cache { offset, length });
        self.check(offset, length, false)
    }

    fn block_status(&self, offset: u64, length: u64, max_extents: usize) -> Result<Vec<Extent>> {
        self.record(Call::BlockStatus {
            offset,
            length,
            max_extents,
        });
        self.check(offset, length, false)?;
        let contents = lock(&self.contents);
        let end = offset + length;
        let mut extents: Vec<Extent> = Vec::new();
        let mut position = offset;
        while position < end {
            let block = position / RAM_BLOCK_BYTES;
            let run_end = ((block + 1) * RAM_BLOCK_BYTES).min(end);
            let state = contents.blocks[block as usize];
            let run_bytes = run_end - position;
            let count = extents.len();
            match extents.last_mut() {
                Some(last) if last.state == state => last.length_bytes += run_bytes,
                _ if count == max_extents => break,
                _ => extents.push(Extent {
                    length_bytes: run_bytes,
                    state,
                }),
            }
            position = run_end;
        }
        Ok(extents)
    }
}

#[cfg(test)]
mod tests {
    //! The double itself must be right, or protocol tests built on it prove
    //! nothing: allocation states after write, zero and trim, and faults.

    use super::*;

    #[test]
    fn allocation_follows_writes_zeroes_and_trims() {
        let device = RamDevice::new(8 * RAM_BLOCK_BYTES);
        device.write(RAM_BLOCK_BYTES, &[7; 10], false).unwrap();
        device
            .write_zeroes(2 * RAM_BLOCK_BYTES, RAM_BLOCK_BYTES, false, false)
            .unwrap();
        device
            .write(5 * RAM_BLOCK_BYTES, &[1; 4096], false)
            .unwrap();
        device
            .trim(5 * RAM_BLOCK_BYTES, RAM_BLOCK_BYTES, false)
            .unwrap();
        let extents = device.block_status(0, 8 * RAM_BLOCK_BYTES, 100).unwrap();
        let states: Vec<_> = extents.iter().map(|e| (e.length_bytes, e.state)).collect();
        assert_eq!(
            states,
            vec![
                (RAM_BLOCK_BYTES, ExtentState::Hole),
                (RAM_BLOCK_BYTES, ExtentState::Data),
                (RAM_BLOCK_BYTES, ExtentState::Zero),
                (5 * RAM_BLOCK_BYTES, ExtentState::Hole),
            ]
        );
        let mut buf = [0u8; 12];
        device.read(RAM_BLOCK_BYTES - 1, &mut buf).unwrap();
        assert_eq!(buf, [0, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 0]);
        assert_eq!(
            device
                .block_status(0, 3 * RAM_BLOCK_BYTES, 1)
                .unwrap()
                .len(),
            1
        );
    }

    #[test]
    fn faults_are_reported_as_engine_errors() {
        let device = RamDevice::new(1 << 16);
        device.fail_io_at(1000);
        let mut buf = [0u8; 512];
        assert!(device.read(512, &mut buf).unwrap_err().is_data_error());
        assert!(device.read(0, &mut buf).is_ok());
        device.set_no_space(true);
        assert!(matches!(
            device.write(0, &buf, false),
            Err(Error::NoSpace { .. })
        ));
        device.clear_faults();
        device.set_read_only(true);
        assert!(matches!(device.trim(0, 512, false), Err(Error::ReadOnly)));
        assert!(matches!(
            device.read(1 << 16, &mut buf),
            Err(Error::OutOfRange { .. })
        ));
    }
}
