//! A server fixture and an NBD client for the protocol tests.
//!
//! The client is zdisk's one NBD client (`zdisk_nbd_wire::client`) at its
//! low level, which speaks the client's half of the wire format: it shares
//! only the constants with the server's encoders and parsers, so a layout
//! mistake in the server cannot be mirrored here and cancel out (nbdkit
//! checks the client against a foreign server in zdisk-nbd-wire's tests).
//! It checks the framing of everything it receives (magic values, option
//! echo, cookies, chunk lengths); this wrapper panics on anything
//! malformed, and tests then check the meaning. What no well-behaved
//! client would send (bad magic, lying lengths, a trickle) goes through
//! the raw stream.

#![allow(dead_code)] // each test file uses a different part of the helpers

use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::Duration;

use zdisk_nbd::testing::RamDevice;
use zdisk_nbd::wire::*;
use zdisk_nbd::{ListenAddr, Server, ServerConfig, ShutdownHandle};
use zdisk_nbd_wire::client::{self, Address, ClientError, Connection, Stream};

/// How long any single read from or write to the server may take before a
/// test fails instead of hanging.
pub const IO_TIMEOUT: Duration = Duration::from_secs(20);

/// A running server on a RAM device, shut down and joined on drop.
pub struct TestServer {
    pub device: Arc<RamDevice>,
    pub addr: ListenAddr,
    handle: ShutdownHandle,
    thread: Option<JoinHandle<io::Result<()>>>,
}

impl TestServer {
    pub fn start(size_bytes: u64) -> Self {
        Self::start_with(size_bytes, ServerConfig::default())
    }

    pub fn start_with(size_bytes: u64, config: ServerConfig) -> Self {
        Self::start_at(
            &ListenAddr::Tcp("127.0.0.1:0".parse().unwrap()),
            size_bytes,
            config,
        )
    }

    pub fn start_at(addr: &ListenAddr, size_bytes: u64, config: ServerConfig) -> Self {
        let device = Arc::new(RamDevice::new(size_bytes));
        let server = Server::bind(addr, device.clone(), config).expect("bind");
        let addr = server.local_addr().expect("local_addr");
        let handle = server.shutdown_handle();
        let thread = thread::spawn(move || server.run());
        TestServer {
            device,
            addr,
            handle,
            thread: Some(thread),
        }
    }

    pub fn connect(&self) -> Client {
        Client::connect(&self.addr)
    }

    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.handle.clone()
    }

    /// Shuts down and returns what `run()` returned.
    pub fn stop(mut self) -> io::Result<()> {
        self.handle.shutdown();
        self.thread
            .take()
            .unwrap()
            .join()
            .expect("server thread panicked")
    }

    /// Whether `run()` has returned.
    pub fn is_finished(&self) -> bool {
        match &self.thread {
            Some(thread) => thread.is_finished(),
            None => true,
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(thread) = self.thread.take() {
            self.handle.shutdown();
            let _ = thread.join();
        }
    }
}

/// One option reply.
#[derive(Debug, Clone)]
pub struct OptReply {
    pub reply_type: u32,
    pub data: Vec<u8>,
}

impl OptReply {
    pub fn info_type(&self) -> Option<u16> {
        (self.reply_type == NBD_REP_INFO).then(|| be16(&self.data[0..2]))
    }
}

impl From<client::OptionReply> for OptReply {
    fn from(reply: client::OptionReply) -> OptReply {
        OptReply {
            reply_type: reply.reply_type,
            data: reply.data,
        }
    }
}

/// One structured reply chunk (a data chunk's payload holds only its
/// offset; the data is in [`Reply::data`]).
pub use zdisk_nbd_wire::client::Chunk;

/// A complete reply to one request.
#[derive(Debug, Clone)]
pub struct Reply {
    pub cookie: u64,
    pub simple: bool,
    /// The error of a simple reply, or of the first error chunk; 0 on success.
    pub error: u32,
    /// The error message of the first error chunk.
    pub message: String,
    /// READ data assembled from OFFSET_DATA chunks, or a simple reply's data.
    pub data: Vec<u8>,
    pub chunks: Vec<Chunk>,
}

impl From<client::Reply> for Reply {
    fn from(reply: client::Reply) -> Reply {
        Reply {
            cookie: reply.cookie,
            simple: reply.simple,
            error: reply.error,
            message: reply.message,
            data: reply.data,
            chunks: reply.chunks,
        }
    }
}

/// One block status chunk: context id, marked done, (length, flags) descriptors.
pub type ContextExtents = (u32, bool, Vec<(u32, u32)>);

impl Reply {
    /// The descriptors of the (single) block status chunk, as (length, flags).
    pub fn extents(&self) -> (u32, Vec<(u32, u32)>) {
        let mut all = self.extents_by_context();
        assert_eq!(all.len(), 1, "one block status chunk per context");
        let (context, _, descriptors) = all.remove(0);
        (context, descriptors)
    }

    /// The descriptors of every block status chunk, in order, with its
    /// context id and whether it was marked done.
    pub fn extents_by_context(&self) -> Vec<ContextExtents> {
        let as_client = client::Reply {
            chunks: self.chunks.clone(),
            ..client::Reply::default()
        };
        as_client
            .block_status()
            .expect("well-formed block status chunks")
            .into_iter()
            .map(|status| {
                let descriptors = status
                    .descriptors
                    .iter()
                    .map(|d| (d.length_bytes, d.flags))
                    .collect();
                (status.context_id, status.done, descriptors)
            })
            .collect()
    }
}

pub fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes(b.try_into().unwrap())
}
pub fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b.try_into().unwrap())
}
pub fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b.try_into().unwrap())
}

/// What to negotiate in [`Client::connect_with`].
#[derive(Debug, Clone, Copy)]
pub struct Setup {
    pub structured: bool,
    pub base_allocation: bool,
    pub block_size: bool,
}

impl Setup {
    pub const SIMPLE: Setup = Setup {
        structured: false,
        base_allocation: false,
        block_size: true,
    };
    pub const STRUCTURED: Setup = Setup {
        structured: true,
        base_allocation: true,
        block_size: true,
    };
}

/// Information gathered from a successful NBD_OPT_GO / NBD_OPT_INFO.
#[derive(Debug, Clone, Default)]
pub struct ExportInfo {
    pub size_bytes: u64,
    pub flags: u16,
    pub block_sizes: Option<(u32, u32, u32)>,
    pub name: Option<String>,
    pub description: Option<String>,
}

impl From<client::Export> for ExportInfo {
    fn from(export: client::Export) -> ExportInfo {
        ExportInfo {
            size_bytes: export.size_bytes,
            flags: export.flags,
            block_sizes: export
                .block_sizes
                .map(|b| (b.min_bytes, b.preferred_bytes, b.max_payload_bytes)),
            name: export.name,
            description: export.description,
        }
    }
}

/// The client: [`Connection`]'s low level, panicking on anything
/// malformed; raw bytes go through its stream.
pub struct Client {
    connection: Connection,
    pub structured: bool,
}

fn address(addr: &ListenAddr) -> Address {
    match addr {
        ListenAddr::Tcp(a) => Address::Tcp {
            host_port: a.to_string(),
            export: String::new(),
        },
        ListenAddr::Unix(p) => Address::Unix {
            socket: p.to_str().expect("a UTF-8 socket path").to_string(),
            export: String::new(),
        },
    }
}

impl Client {
    pub fn connect(addr: &ListenAddr) -> Client {
        let stream = Stream::connect(&address(addr), Some(IO_TIMEOUT)).expect("connect");
        Client {
            connection: Connection::new(stream),
            structured: false,
        }
    }

    fn stream(&mut self) -> &mut Stream {
        self.connection.get_mut()
    }

    pub fn read_bytes(&mut self, count: usize) -> Vec<u8> {
        let mut buf = vec![0; count];
        self.stream()
            .read_exact(&mut buf)
            .expect("read from server");
        buf
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.stream().write_all(bytes).expect("write to server");
    }

    /// Sends bytes, reporting a failure (the server closed) instead of panicking.
    pub fn try_send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream().write_all(bytes)
    }

    /// Reads and counts everything until the server closes the connection.
    pub fn drain_until_closed(&mut self) -> usize {
        let mut total = 0;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            match self.stream().read(&mut buf) {
                Ok(0) => return total,
                Ok(count) => total += count,
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return total,
                Err(e) => panic!("waiting for close: {e}"),
            }
        }
    }

    /// Whether the server closed the connection (no more bytes will come).
    pub fn is_closed(&mut self) -> bool {
        let mut byte = [0u8; 1];
        match self.stream().read(&mut byte) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => true,
            Err(e) => panic!("waiting for close: {e}"),
        }
    }

    pub fn shutdown_write(&self) {
        self.connection.get_ref().shutdown(Shutdown::Write).unwrap();
    }

    // -- handshake ----------------------------------------------------------

    /// Reads the greeting, checks its magic values, returns the handshake flags.
    pub fn greeting(&mut self) -> u16 {
        self.connection.read_greeting().expect("greeting")
    }

    pub fn send_client_flags(&mut self, flags: u32) {
        self.connection
            .send_client_flags(flags)
            .expect("send client flags");
    }

    /// Greeting plus FIXED_NEWSTYLE|NO_ZEROES client flags.
    pub fn start_handshake(&mut self) {
        let flags = self.connection.start_handshake().expect("handshake");
        assert_eq!(flags, NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES);
    }

    pub fn send_option(&mut self, option: u32, data: &[u8]) {
        self.connection
            .send_option(option, data)
            .expect("send option");
    }

    /// Reads one option reply and checks it answers `option`.
    pub fn option_reply(&mut self, option: u32) -> OptReply {
        self.connection
            .option_reply(option)
            .expect("option reply")
            .into()
    }

    /// Reads replies up to and including the final one (ACK or an error).
    pub fn option_replies(&mut self, option: u32) -> Vec<OptReply> {
        self.connection
            .option_replies(option)
            .expect("option replies")
            .into_iter()
            .map(OptReply::from)
            .collect()
    }

    pub fn option(&mut self, option: u32, data: &[u8]) -> Vec<OptReply> {
        self.send_option(option, data);
        self.option_replies(option)
    }

    pub fn go_data(name: &str, infos: &[u16]) -> Vec<u8> {
        let mut data = Vec::new();
        put_go_data(&mut data, name, infos);
        data
    }

    pub fn meta_data(name: &str, queries: &[&str]) -> Vec<u8> {
        let mut data = Vec::new();
        put_meta_context_data(&mut data, name, queries);
        data
    }

    /// Parses the replies of a successful INFO/GO.
    pub fn parse_info(replies: &[OptReply]) -> ExportInfo {
        let replies: Vec<client::OptionReply> = replies
            .iter()
            .map(|r| client::OptionReply {
                option: NBD_OPT_GO,
                reply_type: r.reply_type,
                data: r.data.clone(),
            })
            .collect();
        client::Export::from_replies(&replies)
            .unwrap_or_else(|e| panic!("GO/INFO ends with ACK: {e}: {replies:?}"))
            .into()
    }

    pub fn structured_reply(&mut self) {
        self.connection
            .structured_replies()
            .expect("structured replies");
        self.structured = true;
    }

    /// SET_META_CONTEXT; returns the (id, name) pairs the server selected.
    pub fn set_meta_context(
        &mut self,
        name: &str,
        queries: &[&str],
    ) -> Result<Vec<(u32, String)>, u32> {
        match self.connection.set_meta_contexts(name, queries) {
            Ok(contexts) => Ok(contexts
                .iter()
                .map(|context| (context.id, context.name.clone()))
                .collect()),
            Err(ClientError::OptionRefused { reply_type, .. }) => Err(reply_type),
            Err(e) => panic!("SET_META_CONTEXT: {e}"),
        }
    }

    /// Connects and negotiates per `setup`, ending with NBD_OPT_GO.
    pub fn connect_with(addr: &ListenAddr, setup: Setup) -> (Client, ExportInfo) {
        let mut c = Client::connect(addr);
        c.start_handshake();
        if setup.structured {
            c.structured_reply();
        }
        if setup.base_allocation {
            let selected = c.set_meta_context("", &[BASE_ALLOCATION]).unwrap();
            assert_eq!(selected.len(), 1);
        }
        let infos: &[u16] = if setup.block_size {
            &[NBD_INFO_BLOCK_SIZE]
        } else {
            &[]
        };
        let export = c.connection.go("zdisk", infos).expect("NBD_OPT_GO").clone();
        (c, export.into())
    }

    // -- transmission -------------------------------------------------------

    pub fn cookie(&mut self) -> u64 {
        self.connection.next_cookie()
    }

    pub fn request_bytes(
        flags: u16,
        command: u16,
        cookie: u64,
        offset: u64,
        length: u32,
    ) -> Vec<u8> {
        let mut m = Vec::with_capacity(REQUEST_HEADER_BYTES);
        put_request_header(
            &mut m,
            &RequestHeader {
                flags,
                command,
                cookie,
                offset,
                length,
            },
        );
        m
    }

    /// Sends a request (with `payload` after it) and returns its cookie.
    pub fn send_request(
        &mut self,
        flags: u16,
        command: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> u64 {
        self.connection
            .send_request(flags, command, offset, length, payload)
            .expect("send request")
    }

    /// Reads messages until some reply is complete, and returns it.
    pub fn reply(&mut self) -> Reply {
        self.connection.receive_reply().expect("reply").into()
    }

    /// Sends a request and waits for its reply.
    pub fn request(
        &mut self,
        flags: u16,
        command: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> Reply {
        self.connection
            .request(flags, command, offset, length, payload)
            .expect("request")
            .into()
    }

    pub fn read(&mut self, offset: u64, length: u32) -> Reply {
        self.request(0, NBD_CMD_READ, offset, length, &[])
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) -> Reply {
        self.request(0, NBD_CMD_WRITE, offset, data.len() as u32, data)
    }

    /// Writes and reads back a small block, asserting success: proof that
    /// the connection still works after an error.
    pub fn assert_works(&mut self) {
        let data: Vec<u8> = (0..512u32).map(|i| (i * 7 + 3) as u8).collect();
        let w = self.write(4096, &data);
        assert_eq!(w.error, 0, "write after error: {}", w.message);
        let r = self.read(4096, 512);
        assert_eq!(r.error, 0, "read after error: {}", r.message);
        assert_eq!(r.data, data);
    }

    pub fn disconnect(&mut self) {
        let m = Self::request_bytes(0, NBD_CMD_DISC, self.cookie(), 0, 0);
        self.send(&m);
    }
}
