//! `kill -9` of `zdisk serve` under a write-ahead log (zdisk-bench's
//! `wal`), in both layouts, on a real image and on an emulated csd2000
//! with power-loss protection.
//!
//! A writer thread runs the log over NBD (a minimal client below: fixed
//! newstyle, simple replies), flushing every commit or every few, with
//! checkpoints that trim and a ring small enough to wrap. Once it has
//! flushed a few hundred commits the server is killed with SIGKILL. The
//! server is started again (it recovers), the log is read back over NBD,
//! and every commit a returned flush covered must be there with its
//! payload; then a new writer continues the same log for the next round.

mod support;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Trial};
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

use support::*;
use zdisk_bench::wal::{Layout, LogDevice, Recovered, Wal, WalConfig, WalError, BLOCK_BYTES};
use zdisk_nbd::wire::{
    IHAVEOPT, NBDMAGIC, NBD_CMD_FLUSH, NBD_CMD_READ, NBD_CMD_TRIM, NBD_CMD_WRITE,
    NBD_FLAG_C_FIXED_NEWSTYLE, NBD_FLAG_C_NO_ZEROES, NBD_FLAG_NO_ZEROES, NBD_OPT_EXPORT_NAME,
    NBD_REQUEST_MAGIC, NBD_SIMPLE_REPLY_MAGIC,
};

/// How long a round may take to flush its commits before the test calls
/// the server stuck (a liveness bound, not a speed floor).
const LIVENESS: Duration = Duration::from_secs(600);

fn main() {
    let args = Arguments::from_args();
    let mut trials = Vec::new();
    for (medium, create) in [
        ("file", &["--logical", "64M", "--physical", "64M"][..]),
        (
            "csd2000",
            &[
                "--nand",
                "csd2000",
                "--plp",
                "--physical",
                "1G",
                "--logical",
                "256M",
            ][..],
        ),
    ] {
        for layout in [Layout::Packed, Layout::Sparse] {
            let name = format!("{layout}_log_survives_kill_9_of_the_server_on_{medium}");
            trials.push(Trial::test(name, move || kill9(layout, medium, create)));
        }
    }
    libtest_mimic::run(&args, trials).exit();
}

/// A blocking NBD client on a Unix socket: one request at a time.
struct Nbd {
    stream: UnixStream,
    size_bytes: u64,
    cookie: u64,
}

impl Nbd {
    fn connect(socket: &Path) -> Result<Nbd, String> {
        let io = |e: std::io::Error| format!("NBD handshake: {e}");
        let mut stream = UnixStream::connect(socket).map_err(io)?;
        let mut greeting = [0u8; 18];
        stream.read_exact(&mut greeting).map_err(io)?;
        let word = |at: usize| u64::from_be_bytes(greeting[at..at + 8].try_into().unwrap());
        if word(0) != NBDMAGIC || word(8) != IHAVEOPT {
            return Err("not a fixed-newstyle NBD server".into());
        }
        let no_zeroes = u16::from_be_bytes([greeting[16], greeting[17]]) & NBD_FLAG_NO_ZEROES != 0;
        let mut flags = NBD_FLAG_C_FIXED_NEWSTYLE;
        if no_zeroes {
            flags |= NBD_FLAG_C_NO_ZEROES;
        }
        let mut hello = flags.to_be_bytes().to_vec();
        // NBD_OPT_EXPORT_NAME with the default (empty) name.
        hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
        hello.extend_from_slice(&NBD_OPT_EXPORT_NAME.to_be_bytes());
        hello.extend_from_slice(&0u32.to_be_bytes());
        stream.write_all(&hello).map_err(io)?;
        let mut export = [0u8; 10];
        stream.read_exact(&mut export).map_err(io)?;
        if !no_zeroes {
            stream.read_exact(&mut [0u8; 124]).map_err(io)?;
        }
        Ok(Nbd {
            stream,
            size_bytes: u64::from_be_bytes(export[..8].try_into().unwrap()),
            cookie: 0,
        })
    }

    fn request(
        &mut self,
        command: u16,
        offset: u64,
        len: u64,
        payload: &[u8],
        reply: &mut [u8],
    ) -> Result<(), String> {
        let io = |e: std::io::Error| format!("NBD command {command}: {e}");
        self.cookie += 1;
        let mut header = Vec::with_capacity(28 + payload.len());
        header.extend_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
        header.extend_from_slice(&0u16.to_be_bytes());
        header.extend_from_slice(&command.to_be_bytes());
        header.extend_from_slice(&self.cookie.to_be_bytes());
        header.extend_from_slice(&offset.to_be_bytes());
        header.extend_from_slice(&(len as u32).to_be_bytes());
        header.extend_from_slice(payload);
        self.stream.write_all(&header).map_err(io)?;
        let mut head = [0u8; 16];
        self.stream.read_exact(&mut head).map_err(io)?;
        let magic = u32::from_be_bytes(head[..4].try_into().unwrap());
        let error = u32::from_be_bytes(head[4..8].try_into().unwrap());
        let cookie = u64::from_be_bytes(head[8..].try_into().unwrap());
        if magic != NBD_SIMPLE_REPLY_MAGIC || cookie != self.cookie {
            return Err(format!("bad reply {magic:#x} for cookie {cookie}"));
        }
        if error != 0 {
            return Err(format!("NBD command {command} failed with errno {error}"));
        }
        self.stream.read_exact(reply).map_err(io)
    }
}

impl LogDevice for Nbd {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), String> {
        self.request(NBD_CMD_READ, offset, buf.len() as u64, &[], buf)
    }

    fn write_at(&mut self, offset: u64, data: &[u8]) -> Result<(), String> {
        self.request(NBD_CMD_WRITE, offset, data.len() as u64, data, &mut [])
    }

    fn flush(&mut self) -> Result<(), String> {
        self.request(NBD_CMD_FLUSH, 0, 0, &[], &mut [])
    }

    fn trim(&mut self, offset: u64, len: u64) -> Result<(), String> {
        self.request(NBD_CMD_TRIM, offset, len, &[], &mut [])
    }
}

/// What the writers were told, to check what a recovery finds.
#[derive(Default)]
struct Model {
    appended: BTreeMap<u64, Vec<u8>>,
    acked: u64,
    checkpointed: u64,
}

impl Model {
    fn check(&mut self, recovered: &Recovered, context: &str) -> Result<(), Failed> {
        let first = recovered.anchor.start_seq;
        for (index, commit) in recovered.commits.iter().enumerate() {
            ensure!(commit.seq == first + index as u64, "{context}: a gap");
            ensure!(
                self.appended.get(&commit.seq) == Some(&commit.payload),
                "{context}: commit {} is not what was appended",
                commit.seq
            );
        }
        ensure!(
            (self.checkpointed..=self.acked + 1).contains(&first),
            "{context}: log starts at {first}; checkpointed {}, flushed {}",
            self.checkpointed,
            self.acked
        );
        ensure!(
            recovered.last_seq() >= self.acked,
            "{context}: flushed through {} but found only through {}",
            self.acked,
            recovered.last_seq()
        );
        self.appended.retain(|&seq, _| seq <= recovered.last_seq());
        self.acked = recovered.last_seq();
        self.checkpointed = first;
        Ok(())
    }
}

/// Appends and flushes until the device fails (the server was killed).
fn write_until_killed(mut wal: Wal<Nbd>, model: &Mutex<Model>, seed: u64) -> WalError {
    let mut rng = SmallRng::seed_from_u64(seed);
    loop {
        let group = rng.gen_range(1..=4);
        let mut step = || -> Result<(), WalError> {
            for _ in 0..group {
                let size = [128usize, 256, 512, 1024, 2048][rng.gen_range(0..5)];
                let mut payload = vec![0u8; size - 24];
                rng.fill_bytes(&mut payload);
                let seq = match wal.append(&payload) {
                    Err(WalError::Full { .. }) => {
                        wal.checkpoint()?;
                        wal.append(&payload)?
                    }
                    other => other?,
                };
                model.lock().unwrap().appended.insert(seq, payload);
            }
            wal.flush()?;
            if rng.gen_bool(0.02) {
                wal.checkpoint()?;
            }
            Ok(())
        };
        let result = step();
        {
            let mut model = model.lock().unwrap();
            model.acked = wal.flushed_seq();
            model.checkpointed = wal.tail_seq();
        }
        if let Err(error) = result {
            return error;
        }
    }
}

fn kill9(layout: Layout, medium: &str, create: &[&str]) -> Result<(), Failed> {
    let dir = Scratch::new(&format!("wal-kill9-{medium}-{layout}"));
    let image = dir.join("wal.zdisk");
    let socket = dir.join("sock");
    let mut args = vec!["create", image.to_str().unwrap()];
    args.extend_from_slice(create);
    let output = zdisk(&args);
    ensure!(
        output.status.success(),
        "zdisk create: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let serve_args: &[&str] = if medium == "file" {
        &[]
    } else {
        &["--virtual-time"]
    };
    let config = WalConfig {
        layout,
        base_offset: 1 << 20,
        area_bytes: 2048 * BLOCK_BYTES,
        log_id: 13,
    };
    let model = Arc::new(Mutex::new(Model {
        checkpointed: 1,
        ..Model::default()
    }));
    for round in 0..3u64 {
        let context = format!("{layout} on {medium}, round {round}");
        let mut server = Server::start(&image, &socket, serve_args)?;
        let device = Nbd::connect(&socket)?;
        let wal = if round == 0 {
            Wal::create(device, config).map_err(|e| e.to_string())?
        } else {
            ensure!(
                server.log().contains("recovered after an unclean stop"),
                "{context}: no recovery reported:\n{}",
                server.log()
            );
            let (wal, recovered) =
                Wal::open(device, config.base_offset).map_err(|e| format!("{context}: {e}"))?;
            model.lock().unwrap().check(&recovered, &context)?;
            println!(
                "{context}: recovered through commit {} ({} since the last checkpoint)",
                recovered.last_seq(),
                recovered.commits.len()
            );
            wal
        };
        let start = model.lock().unwrap().acked;
        let writer = {
            let model = model.clone();
            std::thread::spawn(move || write_until_killed(wal, &model, round))
        };
        // Kill once a few hundred commits are flushed, so recovery has
        // something to prove. The wait is for that event, not a speed
        // floor: the bound only stops a hung server from hanging the suite.
        let deadline = Instant::now() + LIVENESS;
        while model.lock().unwrap().acked < start + 300 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let status = server.stop_with("KILL")?;
        ensure!(!status.success(), "{context}: the server survived SIGKILL");
        let error = writer.join().map_err(|_| "the writer panicked")?;
        let acked = model.lock().unwrap().acked;
        println!("{context}: killed at commit {acked} flushed; the writer saw: {error}");
        ensure!(
            acked >= start + 300,
            "{context}: only {} commits flushed in {LIVENESS:?}: is the server stuck?",
            acked - start
        );
    }
    let server = Server::start(&image, &socket, serve_args)?;
    let mut device = Nbd::connect(&socket)?;
    let recovered = zdisk_bench::wal::read_log(&mut device, config.base_offset)
        .map_err(|e| format!("final read: {e}"))?;
    model.lock().unwrap().check(&recovered, "final")?;
    drop(server);
    Ok(())
}
