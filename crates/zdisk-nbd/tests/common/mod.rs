//! A minimal NBD client and a server fixture for the protocol tests.
//!
//! The client is written from the specification, independently of the
//! server's encoders (it shares only the constants in `zdisk_nbd::wire`),
//! so a layout mistake in the server cannot be mirrored here and cancel
//! out. It checks the framing of everything it receives (magic values,
//! option echo, chunk lengths) and panics on anything malformed; tests then
//! check the meaning.

#![allow(dead_code)] // each test file uses a different part of the helpers

use std::collections::HashMap;
use std::io::{self, BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::Duration;

use zdisk_nbd::testing::RamDevice;
use zdisk_nbd::wire::*;
use zdisk_nbd::{ListenAddr, Server, ServerConfig, ShutdownHandle};

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

pub enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn try_clone(&self) -> Stream {
        match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone().unwrap()),
            Stream::Unix(s) => Stream::Unix(s.try_clone().unwrap()),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
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

/// One structured reply chunk.
#[derive(Debug, Clone)]
pub struct Chunk {
    pub flags: u16,
    pub chunk_type: u16,
    pub payload: Vec<u8>,
}

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

impl Reply {
    /// The descriptors of the (single) block status chunk, as (length, flags).
    pub fn extents(&self) -> (u32, Vec<(u32, u32)>) {
        let chunks: Vec<_> = self
            .chunks
            .iter()
            .filter(|c| c.chunk_type == NBD_REPLY_TYPE_BLOCK_STATUS)
            .collect();
        assert_eq!(chunks.len(), 1, "one block status chunk per context");
        let payload = &chunks[0].payload;
        assert!(payload.len() >= 12 && (payload.len() - 4) % 8 == 0);
        let context = be32(&payload[0..4]);
        let descriptors = payload[4..]
            .chunks(8)
            .map(|d| (be32(&d[0..4]), be32(&d[4..8])))
            .collect();
        (context, descriptors)
    }
}

/// One block status chunk: context id, marked done, (length, flags) descriptors.
pub type ContextExtents = (u32, bool, Vec<(u32, u32)>);

impl Reply {
    /// The descriptors of every block status chunk, in order, with its
    /// context id and whether it was marked done.
    pub fn extents_by_context(&self) -> Vec<ContextExtents> {
        self.chunks
            .iter()
            .filter(|c| c.chunk_type == NBD_REPLY_TYPE_BLOCK_STATUS)
            .map(|chunk| {
                let payload = &chunk.payload;
                assert!(payload.len() >= 12 && (payload.len() - 4) % 8 == 0);
                let descriptors = payload[4..]
                    .chunks(8)
                    .map(|d| (be32(&d[0..4]), be32(&d[4..8])))
                    .collect();
                (
                    be32(&payload[0..4]),
                    chunk.flags & NBD_REPLY_FLAG_DONE != 0,
                    descriptors,
                )
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

/// What to negotiate in [`Client::go`]-based setups.
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

pub struct Client {
    reader: BufReader<Stream>,
    writer: Stream,
    pub structured: bool,
    /// Outstanding reads: cookie -> (offset, length).
    reads: HashMap<u64, (u64, u32)>,
    /// Structured chunks received for replies not yet complete.
    partial: HashMap<u64, Vec<Chunk>>,
    next_cookie: u64,
}

impl Client {
    pub fn connect(addr: &ListenAddr) -> Client {
        let stream = match addr {
            ListenAddr::Tcp(a) => {
                let s = TcpStream::connect(a).expect("connect");
                s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
                s.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
                s.set_nodelay(true).unwrap();
                Stream::Tcp(s)
            }
            ListenAddr::Unix(p) => {
                let s = UnixStream::connect(p).expect("connect");
                s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
                s.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
                Stream::Unix(s)
            }
        };
        Client {
            reader: BufReader::new(stream.try_clone()),
            writer: stream,
            structured: false,
            reads: HashMap::new(),
            partial: HashMap::new(),
            next_cookie: 1,
        }
    }

    pub fn read_bytes(&mut self, count: usize) -> Vec<u8> {
        let mut buf = vec![0; count];
        self.reader.read_exact(&mut buf).expect("read from server");
        buf
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.writer.write_all(bytes).expect("write to server");
    }

    /// Sends bytes, reporting a failure (the server closed) instead of panicking.
    pub fn try_send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.writer.write_all(bytes)
    }

    /// Reads and counts everything until the server closes the connection.
    pub fn drain_until_closed(&mut self) -> usize {
        let mut total = 0;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            match self.reader.read(&mut buf) {
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
        match self.reader.read(&mut byte) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => true,
            Err(e) => panic!("waiting for close: {e}"),
        }
    }

    pub fn shutdown_write(&self) {
        match &self.writer {
            Stream::Tcp(s) => s.shutdown(Shutdown::Write).unwrap(),
            Stream::Unix(s) => s.shutdown(Shutdown::Write).unwrap(),
        }
    }

    // -- handshake ----------------------------------------------------------

    /// Reads the greeting, checks its magic values, returns the handshake flags.
    pub fn greeting(&mut self) -> u16 {
        let g = self.read_bytes(18);
        assert_eq!(be64(&g[0..8]), NBDMAGIC);
        assert_eq!(be64(&g[8..16]), IHAVEOPT);
        be16(&g[16..18])
    }

    pub fn send_client_flags(&mut self, flags: u32) {
        self.send(&flags.to_be_bytes());
    }

    /// Greeting plus FIXED_NEWSTYLE|NO_ZEROES client flags.
    pub fn start_handshake(&mut self) {
        let flags = self.greeting();
        assert_eq!(flags, NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES);
        self.send_client_flags(NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES);
    }

    pub fn send_option(&mut self, option: u32, data: &[u8]) {
        let mut m = Vec::new();
        m.extend_from_slice(&IHAVEOPT.to_be_bytes());
        m.extend_from_slice(&option.to_be_bytes());
        m.extend_from_slice(&(data.len() as u32).to_be_bytes());
        m.extend_from_slice(data);
        self.send(&m);
    }

    /// Reads one option reply and checks it answers `option`.
    pub fn option_reply(&mut self, option: u32) -> OptReply {
        let h = self.read_bytes(20);
        assert_eq!(be64(&h[0..8]), NBD_OPTION_REPLY_MAGIC, "option reply magic");
        assert_eq!(be32(&h[8..12]), option, "reply echoes the option");
        let reply_type = be32(&h[12..16]);
        let length = be32(&h[16..20]) as usize;
        assert!(
            length <= 1 << 20,
            "unreasonable option reply length {length}"
        );
        let data = self.read_bytes(length);
        OptReply { reply_type, data }
    }

    /// Reads replies up to and including the final one (ACK or an error).
    pub fn option_replies(&mut self, option: u32) -> Vec<OptReply> {
        let mut replies = Vec::new();
        loop {
            let reply = self.option_reply(option);
            let last =
                reply.reply_type == NBD_REP_ACK || reply.reply_type & NBD_REP_FLAG_ERROR != 0;
            replies.push(reply);
            if last {
                return replies;
            }
        }
    }

    pub fn option(&mut self, option: u32, data: &[u8]) -> Vec<OptReply> {
        self.send_option(option, data);
        self.option_replies(option)
    }

    pub fn go_data(name: &str, infos: &[u16]) -> Vec<u8> {
        let mut d = Vec::new();
        d.extend_from_slice(&(name.len() as u32).to_be_bytes());
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
        for i in infos {
            d.extend_from_slice(&i.to_be_bytes());
        }
        d
    }

    pub fn meta_data(name: &str, queries: &[&str]) -> Vec<u8> {
        let mut d = Vec::new();
        d.extend_from_slice(&(name.len() as u32).to_be_bytes());
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
        for q in queries {
            d.extend_from_slice(&(q.len() as u32).to_be_bytes());
            d.extend_from_slice(q.as_bytes());
        }
        d
    }

    /// Parses the replies of a successful INFO/GO.
    pub fn parse_info(replies: &[OptReply]) -> ExportInfo {
        let (last, infos) = replies.split_last().unwrap();
        assert_eq!(
            last.reply_type, NBD_REP_ACK,
            "GO/INFO ends with ACK: {replies:?}"
        );
        let mut info = ExportInfo::default();
        let mut saw_export = false;
        for r in infos {
            assert_eq!(r.reply_type, NBD_REP_INFO);
            match r.info_type().unwrap() {
                NBD_INFO_EXPORT => {
                    assert_eq!(r.data.len(), 12);
                    info.size_bytes = be64(&r.data[2..10]);
                    info.flags = be16(&r.data[10..12]);
                    saw_export = true;
                }
                NBD_INFO_BLOCK_SIZE => {
                    assert_eq!(r.data.len(), 14);
                    info.block_sizes = Some((
                        be32(&r.data[2..6]),
                        be32(&r.data[6..10]),
                        be32(&r.data[10..14]),
                    ));
                }
                NBD_INFO_NAME => info.name = Some(String::from_utf8(r.data[2..].to_vec()).unwrap()),
                NBD_INFO_DESCRIPTION => {
                    info.description = Some(String::from_utf8(r.data[2..].to_vec()).unwrap())
                }
                other => panic!("unexpected info type {other}"),
            }
        }
        assert!(saw_export, "NBD_INFO_EXPORT is mandatory");
        info
    }

    pub fn structured_reply(&mut self) {
        let r = self.option(NBD_OPT_STRUCTURED_REPLY, &[]);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].reply_type, NBD_REP_ACK);
        self.structured = true;
    }

    /// SET_META_CONTEXT; returns the (id, name) pairs the server selected.
    pub fn set_meta_context(
        &mut self,
        name: &str,
        queries: &[&str],
    ) -> Result<Vec<(u32, String)>, u32> {
        let replies = self.option(NBD_OPT_SET_META_CONTEXT, &Self::meta_data(name, queries));
        let (last, contexts) = replies.split_last().unwrap();
        if last.reply_type != NBD_REP_ACK {
            return Err(last.reply_type);
        }
        Ok(contexts
            .iter()
            .map(|r| {
                assert_eq!(r.reply_type, NBD_REP_META_CONTEXT);
                (
                    be32(&r.data[0..4]),
                    String::from_utf8(r.data[4..].to_vec()).unwrap(),
                )
            })
            .collect())
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
        let replies = c.option(NBD_OPT_GO, &Self::go_data("zdisk", infos));
        let info = Self::parse_info(&replies);
        (c, info)
    }

    // -- transmission -------------------------------------------------------

    pub fn cookie(&mut self) -> u64 {
        self.next_cookie += 1;
        self.next_cookie * 0x1_0000_0001
    }

    pub fn request_bytes(
        flags: u16,
        command: u16,
        cookie: u64,
        offset: u64,
        length: u32,
    ) -> Vec<u8> {
        let mut m = Vec::with_capacity(28);
        m.extend_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
        m.extend_from_slice(&flags.to_be_bytes());
        m.extend_from_slice(&command.to_be_bytes());
        m.extend_from_slice(&cookie.to_be_bytes());
        m.extend_from_slice(&offset.to_be_bytes());
        m.extend_from_slice(&length.to_be_bytes());
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
        let cookie = self.cookie();
        if command == NBD_CMD_READ {
            self.reads.insert(cookie, (offset, length));
        }
        let mut m = Self::request_bytes(flags, command, cookie, offset, length);
        m.extend_from_slice(payload);
        self.send(&m);
        cookie
    }

    /// Reads messages until some reply is complete, and returns it.
    pub fn reply(&mut self) -> Reply {
        loop {
            let magic = be32(&self.read_bytes(4));
            if magic == NBD_SIMPLE_REPLY_MAGIC {
                let rest = self.read_bytes(12);
                let error = be32(&rest[0..4]);
                let cookie = be64(&rest[4..12]);
                let read = self.reads.remove(&cookie);
                if self.structured {
                    assert!(
                        read.is_none(),
                        "simple reply to a READ with structured replies on"
                    );
                }
                let data = match read {
                    Some((_, length)) if error == 0 => self.read_bytes(length as usize),
                    _ => Vec::new(),
                };
                return Reply {
                    cookie,
                    simple: true,
                    error,
                    message: String::new(),
                    data,
                    chunks: Vec::new(),
                };
            }
            assert_eq!(magic, NBD_STRUCTURED_REPLY_MAGIC, "reply magic");
            assert!(self.structured, "structured reply without negotiation");
            let h = self.read_bytes(16);
            let flags = be16(&h[0..2]);
            let chunk_type = be16(&h[2..4]);
            let cookie = be64(&h[4..12]);
            let length = be32(&h[12..16]) as usize;
            assert!(
                length <= MAX_PAYLOAD_BYTES as usize + 8,
                "chunk of {length} bytes"
            );
            let payload = self.read_bytes(length);
            self.partial.entry(cookie).or_default().push(Chunk {
                flags,
                chunk_type,
                payload,
            });
            if flags & NBD_REPLY_FLAG_DONE != 0 {
                let chunks = self.partial.remove(&cookie).unwrap();
                return self.assemble(cookie, chunks);
            }
        }
    }

    fn assemble(&mut self, cookie: u64, chunks: Vec<Chunk>) -> Reply {
        let read = self.reads.remove(&cookie);
        let mut reply = Reply {
            cookie,
            simple: false,
            error: 0,
            message: String::new(),
            data: Vec::new(),
            chunks: chunks.clone(),
        };
        if let Some((_, length)) = read {
            reply.data = vec![0; length as usize];
        }
        for chunk in &chunks {
            let p = &chunk.payload;
            match chunk.chunk_type {
                NBD_REPLY_TYPE_NONE => assert!(p.is_empty()),
                NBD_REPLY_TYPE_OFFSET_DATA => {
                    let (offset, length) = read.expect("OFFSET_DATA only answers READ");
                    assert!(p.len() >= 9);
                    let at = be64(&p[0..8]);
                    assert!(
                        at >= offset && at + (p.len() as u64 - 8) <= offset + u64::from(length)
                    );
                    let start = (at - offset) as usize;
                    reply.data[start..start + p.len() - 8].copy_from_slice(&p[8..]);
                }
                NBD_REPLY_TYPE_BLOCK_STATUS => {}
                NBD_REPLY_TYPE_ERROR | NBD_REPLY_TYPE_ERROR_OFFSET => {
                    assert!(p.len() >= 6);
                    let error = be32(&p[0..4]);
                    assert_ne!(error, 0, "error chunks carry a nonzero error");
                    let message_length = be16(&p[4..6]) as usize;
                    assert!(6 + message_length <= p.len());
                    if reply.error == 0 {
                        reply.error = error;
                        reply.message =
                            String::from_utf8(p[6..6 + message_length].to_vec()).unwrap();
                    }
                }
                other => panic!("unexpected chunk type {other}"),
            }
        }
        reply
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
        let cookie = self.send_request(flags, command, offset, length, payload);
        let reply = self.reply();
        assert_eq!(reply.cookie, cookie, "reply to the request just sent");
        reply
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
