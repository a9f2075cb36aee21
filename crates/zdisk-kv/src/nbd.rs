//! A small blocking NBD client, so the store runs on a zdisk export with
//! no kernel module, FUSE or filesystem in between.
//!
//! Fixed newstyle handshake with `NBD_OPT_EXPORT_NAME`, simple replies,
//! one request in flight per connection. [`NbdDevice`] opens several
//! connections and gives each calling thread its own (by a per-thread
//! number), so client threads do not queue behind each other. That is
//! safe for durability because zdisk advertises `NBD_FLAG_CAN_MULTI_CONN`:
//! a flush on one connection covers writes completed on every connection
//! (checked at connect; a server without it gets one connection).
//!
//! The protocol constants come from `zdisk_nbd::wire`, the one place that
//! spells the wire format.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use zdisk_nbd::wire::{
    IHAVEOPT, NBDMAGIC, NBD_CMD_DISC, NBD_CMD_FLUSH, NBD_CMD_READ, NBD_CMD_WRITE,
    NBD_CMD_WRITE_ZEROES, NBD_FLAG_CAN_MULTI_CONN, NBD_FLAG_C_FIXED_NEWSTYLE, NBD_FLAG_C_NO_ZEROES,
    NBD_FLAG_FIXED_NEWSTYLE, NBD_FLAG_NO_ZEROES, NBD_FLAG_READ_ONLY, NBD_FLAG_SEND_WRITE_ZEROES,
    NBD_OPT_EXPORT_NAME, NBD_REQUEST_MAGIC, NBD_SIMPLE_REPLY_MAGIC,
};

use crate::device::SlotDevice;
use crate::error::{Error, Result};

/// Where an NBD server listens, parsed from a URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NbdAddress {
    /// `nbd://HOST[:PORT][/EXPORT]` (port 10809 by default).
    Tcp { host_port: String, export: String },
    /// `nbd+unix:///[EXPORT]?socket=PATH`.
    Unix { socket: String, export: String },
}

impl NbdAddress {
    pub fn parse(uri: &str) -> Result<NbdAddress> {
        let bad = |why: &str| Error::BadUri {
            uri: uri.to_string(),
            why: why.to_string(),
        };
        if let Some(rest) = uri.strip_prefix("nbd+unix://") {
            let (path, query) = rest
                .split_once('?')
                .ok_or_else(|| bad("needs ?socket=PATH"))?;
            let socket = query
                .split('&')
                .find_map(|pair| pair.strip_prefix("socket="))
                .filter(|socket| !socket.is_empty())
                .ok_or_else(|| bad("needs ?socket=PATH"))?;
            let export = path.strip_prefix('/').unwrap_or(path).to_string();
            Ok(NbdAddress::Unix {
                socket: socket.to_string(),
                export,
            })
        } else if let Some(rest) = uri.strip_prefix("nbd://") {
            let (authority, export) = rest.split_once('/').unwrap_or((rest, ""));
            if authority.is_empty() {
                return Err(bad("needs a host"));
            }
            let host_port = if authority.rsplit_once(':').is_some_and(|(_, port)| {
                !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit())
            }) {
                authority.to_string()
            } else {
                format!("{authority}:10809")
            };
            Ok(NbdAddress::Tcp {
                host_port,
                export: export.to_string(),
            })
        } else {
            Err(bad(
                "expected nbd://HOST[:PORT][/EXPORT] or nbd+unix:///EXPORT?socket=PATH",
            ))
        }
    }

    fn export(&self) -> &str {
        match self {
            NbdAddress::Tcp { export, .. } | NbdAddress::Unix { export, .. } => export,
        }
    }
}

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(stream) => stream.read(buf),
            Stream::Unix(stream) => stream.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(stream) => stream.write(buf),
            Stream::Unix(stream) => stream.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// One connection in the transmission phase.
struct Connection {
    stream: Stream,
    cookie: u64,
    /// The request header and a write's payload, sent with one `write_all`.
    send: Vec<u8>,
}

/// What the server said about the export.
struct Export {
    size_bytes: u64,
    flags: u16,
}

fn handshake_error(what: &str) -> Error {
    Error::Protocol(format!("NBD handshake: {what}"))
}

impl Connection {
    fn open(address: &NbdAddress) -> Result<(Connection, Export)> {
        let stream = match address {
            NbdAddress::Tcp { host_port, .. } => {
                let stream = TcpStream::connect(host_port).map_err(|source| Error::Open {
                    what: host_port.clone(),
                    source,
                })?;
                stream.set_nodelay(true).map_err(Error::Io)?;
                Stream::Tcp(stream)
            }
            NbdAddress::Unix { socket, .. } => {
                Stream::Unix(UnixStream::connect(socket).map_err(|source| Error::Open {
                    what: socket.clone(),
                    source,
                })?)
            }
        };
        let mut connection = Connection {
            stream,
            cookie: 0,
            send: Vec::new(),
        };
        let export = connection.handshake(address.export())?;
        Ok((connection, export))
    }

    fn handshake(&mut self, export_name: &str) -> Result<Export> {
        let mut greeting = [0u8; 18];
        self.stream.read_exact(&mut greeting).map_err(Error::Io)?;
        let magic = u64::from_be_bytes(greeting[0..8].try_into().expect("8 bytes"));
        let option_magic = u64::from_be_bytes(greeting[8..16].try_into().expect("8 bytes"));
        let server_flags = u16::from_be_bytes([greeting[16], greeting[17]]);
        if magic != NBDMAGIC || option_magic != IHAVEOPT {
            return Err(handshake_error("not a newstyle NBD server"));
        }
        if server_flags & NBD_FLAG_FIXED_NEWSTYLE == 0 {
            return Err(handshake_error("the server is not fixed newstyle"));
        }
        let no_zeroes = server_flags & NBD_FLAG_NO_ZEROES != 0;
        let mut client_flags = NBD_FLAG_C_FIXED_NEWSTYLE;
        if no_zeroes {
            client_flags |= NBD_FLAG_C_NO_ZEROES;
        }
        let name = export_name.as_bytes();
        let mut hello = Vec::with_capacity(20 + name.len());
        hello.extend_from_slice(&client_flags.to_be_bytes());
        hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
        hello.extend_from_slice(&NBD_OPT_EXPORT_NAME.to_be_bytes());
        hello.extend_from_slice(&(name.len() as u32).to_be_bytes());
        hello.extend_from_slice(name);
        self.stream.write_all(&hello).map_err(Error::Io)?;
        // A server that does not know the export closes the connection here.
        let mut reply = [0u8; 10];
        self.stream.read_exact(&mut reply).map_err(|error| {
            handshake_error(&format!("export {export_name:?} refused ({error})"))
        })?;
        if !no_zeroes {
            self.stream.read_exact(&mut [0u8; 124]).map_err(Error::Io)?;
        }
        Ok(Export {
            size_bytes: u64::from_be_bytes(reply[0..8].try_into().expect("8 bytes")),
            flags: u16::from_be_bytes([reply[8], reply[9]]),
        })
    }

    /// Sends one request and waits for its simple reply; a read's data
    /// lands in `read_into`.
    fn request(
        &mut self,
        command: u16,
        offset: u64,
        payload: &[u8],
        read_into: &mut [u8],
    ) -> Result<()> {
        let length = if command == NBD_CMD_READ {
            read_into.len()
        } else {
            payload.len()
        };
        self.request_with_length(command, offset, length as u32, payload, read_into)
    }

    /// NBD_CMD_WRITE_ZEROES: a length but no payload.
    fn request_zeroes(&mut self, offset: u64, length: u32) -> Result<()> {
        self.request_with_length(NBD_CMD_WRITE_ZEROES, offset, length, &[], &mut [])
    }

    fn request_with_length(
        &mut self,
        command: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
        read_into: &mut [u8],
    ) -> Result<()> {
        self.cookie += 1;
        self.send.clear();
        self.send
            .extend_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
        self.send.extend_from_slice(&0u16.to_be_bytes());
        self.send.extend_from_slice(&command.to_be_bytes());
        self.send.extend_from_slice(&self.cookie.to_be_bytes());
        self.send.extend_from_slice(&offset.to_be_bytes());
        self.send.extend_from_slice(&length.to_be_bytes());
        self.send.extend_from_slice(payload);
        self.stream.write_all(&self.send).map_err(Error::Io)?;
        let mut head = [0u8; 16];
        self.stream.read_exact(&mut head).map_err(Error::Io)?;
        let magic = u32::from_be_bytes(head[0..4].try_into().expect("4 bytes"));
        let errno = u32::from_be_bytes(head[4..8].try_into().expect("4 bytes"));
        let cookie = u64::from_be_bytes(head[8..16].try_into().expect("8 bytes"));
        if magic != NBD_SIMPLE_REPLY_MAGIC {
            return Err(Error::Protocol(format!("reply magic {magic:#x}")));
        }
        if cookie != self.cookie {
            return Err(Error::Protocol(format!(
                "reply for cookie {cookie}, expected {}",
                self.cookie
            )));
        }
        if errno != 0 {
            return Err(Error::Server {
                command,
                offset,
                errno,
            });
        }
        if command == NBD_CMD_READ {
            self.stream.read_exact(read_into).map_err(Error::Io)?;
        }
        Ok(())
    }
}

/// An NBD export as a [`SlotDevice`]; see the module documentation.
pub struct NbdDevice {
    connections: Vec<Mutex<Connection>>,
    size_bytes: u64,
    transmission_flags: u16,
}

static NEXT_THREAD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static THREAD_NUMBER: usize = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
}

impl NbdDevice {
    /// Connects `connections` times (at least once) to `uri`.
    pub fn connect(uri: &str, connections: usize) -> Result<NbdDevice> {
        let address = NbdAddress::parse(uri)?;
        let (first, export) = Connection::open(&address)?;
        if export.flags & NBD_FLAG_READ_ONLY != 0 {
            return Err(Error::Protocol(format!("{uri} is read-only")));
        }
        let wanted = if export.flags & NBD_FLAG_CAN_MULTI_CONN != 0 {
            connections.max(1)
        } else {
            1
        };
        let mut all = vec![Mutex::new(first)];
        for _ in 1..wanted {
            all.push(Mutex::new(Connection::open(&address)?.0));
        }
        Ok(NbdDevice {
            connections: all,
            size_bytes: export.size_bytes,
            transmission_flags: export.flags,
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
        self.connection().request(NBD_CMD_READ, offset, &[], buf)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.connection()
            .request(NBD_CMD_WRITE, offset, buf, &mut [])
    }

    fn flush(&self) -> Result<()> {
        self.connection().request(NBD_CMD_FLUSH, 0, &[], &mut [])
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        if self.transmission_flags & NBD_FLAG_SEND_WRITE_ZEROES == 0 {
            let zeros = vec![0u8; 1 << 20];
            let mut done = 0;
            while done < len {
                let chunk = (len - done).min(zeros.len() as u64) as usize;
                self.write_at(&zeros[..chunk], offset + done)?;
                done += chunk as u64;
            }
            return Ok(());
        }
        // The length field is 32 bits: 1 GiB at a time.
        let mut done = 0;
        while done < len {
            let chunk = (len - done).min(1 << 30);
            self.connection()
                .request_zeroes(offset + done, chunk as u32)?;
            done += chunk;
        }
        Ok(())
    }
}

impl Drop for NbdDevice {
    fn drop(&mut self) {
        // A polite disconnect; NBD_CMD_DISC has no reply.
        for connection in &self.connections {
            let mut connection = connection.lock().unwrap_or_else(|p| p.into_inner());
            let mut header = Vec::with_capacity(28);
            header.extend_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
            header.extend_from_slice(&0u16.to_be_bytes());
            header.extend_from_slice(&NBD_CMD_DISC.to_be_bytes());
            header.extend_from_slice(&0u64.to_be_bytes());
            header.extend_from_slice(&0u64.to_be_bytes());
            header.extend_from_slice(&0u32.to_be_bytes());
            let _ = connection.stream.write_all(&header);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tcp_and_unix_uris() {
        assert_eq!(
            NbdAddress::parse("nbd://127.0.0.1:10810/vol").unwrap(),
            NbdAddress::Tcp {
                host_port: "127.0.0.1:10810".into(),
                export: "vol".into()
            }
        );
        assert_eq!(
            NbdAddress::parse("nbd://localhost").unwrap(),
            NbdAddress::Tcp {
                host_port: "localhost:10809".into(),
                export: String::new()
            }
        );
        assert_eq!(
            NbdAddress::parse("nbd+unix:///?socket=/tmp/s").unwrap(),
            NbdAddress::Unix {
                socket: "/tmp/s".into(),
                export: String::new()
            }
        );
    }

    #[test]
    fn refuses_bad_uris() {
        for uri in [
            "",
            "http://x",
            "nbd://",
            "nbd+unix:///",
            "nbd+unix:///?socket=",
        ] {
            assert!(
                matches!(NbdAddress::parse(uri), Err(Error::BadUri { .. })),
                "{uri:?} was accepted"
            );
        }
    }
}
