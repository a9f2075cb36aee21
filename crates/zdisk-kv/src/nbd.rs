//! An NBD export as a [`SlotDevice`], so the store runs on a zdisk export
//! with no kernel module, FUSE or filesystem in between.
//!
//! The protocol is `zdisk_nbd_wire::client`'s, zdisk's one NBD client;
//! this adapter only spreads threads over connections. [`NbdDevice`]
//! opens several and gives each calling thread its own (by a per-thread
//! number), so client threads do not queue behind each other. That is
//! safe for durability because zdisk advertises `NBD_FLAG_CAN_MULTI_CONN`:
//! a flush on one connection covers writes completed on every connection
//! (checked at connect; a server without it gets one connection).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use zdisk_nbd_wire::client::{Address, ClientError, Config, Connection};
use zdisk_nbd_wire::wire::{NBD_FLAG_CAN_MULTI_CONN, NBD_FLAG_READ_ONLY};

use crate::device::SlotDevice;
use crate::error::{Error, Result};

/// An NBD export as a [`SlotDevice`]; see the module documentation.
pub struct NbdDevice {
    connections: Vec<Mutex<Connection>>,
    size_bytes: u64,
}

static NEXT_THREAD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static THREAD_NUMBER: usize = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
}

impl NbdDevice {
    /// Connects `connections` times (at least once) to `uri`
    /// (`nbd://HOST[:PORT][/EXPORT]` or `nbd+unix:///[EXPORT]?socket=PATH`).
    pub fn connect(uri: &str, connections: usize) -> Result<NbdDevice> {
        let address = Address::parse(uri)?;
        let config = Config::default();
        let first = Connection::connect_to(&address, &config)?;
        let export = first.export().expect("connected").clone();
        if export.has(NBD_FLAG_READ_ONLY) {
            return Err(Error::Nbd(ClientError::ReadOnly));
        }
        let wanted = if export.has(NBD_FLAG_CAN_MULTI_CONN) {
            connections.max(1)
        } else {
            1
        };
        let mut all = vec![Mutex::new(first)];
        for _ in 1..wanted {
            all.push(Mutex::new(Connection::connect_to(&address, &config)?));
        }
        Ok(NbdDevice {
            connections: all,
            size_bytes: export.size_bytes,
        })
    }

    fn connection(&self) -> MutexGuard<'_, Connection> {
        let index = THREAD_NUMBER.with(|number| *number) % self.connections.len();
        self.connections[index]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl SlotDevice for NbdDevice {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        Ok(self.connection().read_at(offset, buf)?)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        Ok(self.connection().write_at(offset, buf)?)
    }

    fn flush(&self) -> Result<()> {
        Ok(self.connection().flush()?)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        match self.connection().write_zeroes(offset, len) {
            Err(ClientError::Unsupported { .. }) => {}
            other => return Ok(other?),
        }
        // The export cannot write zeroes: send them.
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

impl Drop for NbdDevice {
    fn drop(&mut self) {
        // A polite disconnect (NBD_CMD_DISC has no reply); a connection
        // already broken has nothing to say goodbye to.
        for connection in self.connections.drain(..) {
            let connection = connection.into_inner().unwrap_or_else(|p| p.into_inner());
            let _ = connection.disconnect();
        }
    }
}
