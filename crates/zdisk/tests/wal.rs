//! `kill -9` of `zdisk serve` under a write-ahead log (zdisk-bench's
//! `wal`), in both layouts, on a real image and on an emulated csd2000
//! with power-loss protection.
//!
//! A writer thread runs the log over NBD (zdisk's one client,
//! `zdisk_nbd_wire::Connection`, is a `LogDevice`), flushing every commit
//! or every few, with
//! checkpoints that trim and a ring small enough to wrap. Once it has
//! flushed a few hundred commits the server is killed with SIGKILL. The
//! server is started again (it recovers), the log is read back over NBD,
//! and every commit a returned flush covered must be there with its
//! payload; then a new writer continues the same log for the next round.

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Trial};
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

use support::*;
use zdisk_bench::wal::{Layout, Recovered, Wal, WalConfig, WalError, BLOCK_BYTES};
use zdisk_nbd_wire::client::{Address, Config, Connection};

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

/// A connection to the server's Unix socket: one request at a time.
fn connect(socket: &Path) -> Result<Connection, String> {
    let address = Address::Unix {
        socket: socket.to_str().ok_or("a UTF-8 socket path")?.to_string(),
        export: String::new(),
    };
    Connection::connect_to(&address, &Config::default()).map_err(|e| e.to_string())
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
fn write_until_killed(mut wal: Wal<Connection>, model: &Mutex<Model>, seed: u64) -> WalError {
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
        let device = connect(&socket)?;
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
    let mut device = connect(&socket)?;
    let recovered = zdisk_bench::wal::read_log(&mut device, config.base_offset)
        .map_err(|e| format!("final read: {e}"))?;
    model.lock().unwrap().check(&recovered, "final")?;
    drop(server);
    Ok(())
}
