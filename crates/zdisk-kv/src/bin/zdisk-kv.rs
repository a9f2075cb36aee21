//! zdisk-kv: the store's command line. Thin: parse, open, call the library.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use zdisk_kv::{open_device, FormatConfig, Store};

#[derive(Parser)]
#[command(
    name = "zdisk-kv",
    about = "A table-less hash key-value store on a block device or NBD export"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Lays out a new, empty store (the device's old contents are lost).
    Format {
        /// nbd://HOST[:PORT][/EXPORT], nbd+unix:///EXPORT?socket=PATH, or a file or device path.
        #[arg(long)]
        device: String,
        /// Size the store for this many pairs (with --pair-bytes and --fill).
        #[arg(long, default_value_t = 1_000_000)]
        pairs: u64,
        /// Key plus value bytes of a typical pair.
        #[arg(long, default_value_t = 400)]
        pair_bytes: usize,
        /// Average share of a slot that pairs fill (0 < fill <= 1).
        #[arg(long, default_value_t = 0.5)]
        fill: f64,
        /// Home slots, instead of sizing from --pairs.
        #[arg(long)]
        slots: Option<u64>,
        /// The longest probe sequence (1..=256).
        #[arg(long, default_value_t = 64)]
        probe_slots: u32,
    },
    /// Prints a key's value.
    Get {
        #[arg(long)]
        device: String,
        key: String,
    },
    /// Sets a key's value and flushes.
    Put {
        #[arg(long)]
        device: String,
        key: String,
        value: String,
    },
    /// Removes a key and flushes.
    Delete {
        #[arg(long)]
        device: String,
        key: String,
    },
    /// Reads every slot and checks the store's invariants; JSON report.
    Check {
        #[arg(long)]
        device: String,
    },
}

fn run(cli: Cli) -> Result<ExitCode, String> {
    let text = |e: zdisk_kv::Error| e.to_string();
    match cli.command {
        Command::Format {
            device,
            pairs,
            pair_bytes,
            fill,
            slots,
            probe_slots,
        } => {
            if !(fill > 0.0 && fill <= 1.0) {
                return Err(format!("--fill {fill} must be in (0, 1]"));
            }
            if !(1..=zdisk_kv::store::PROBE_SLOTS_MAX).contains(&probe_slots) {
                return Err(format!(
                    "--probe-slots {probe_slots} must be in 1..={}",
                    zdisk_kv::store::PROBE_SLOTS_MAX
                ));
            }
            if pair_bytes == 0 || pair_bytes > zdisk_kv::format::RECORD_PAYLOAD_MAX_BYTES {
                return Err(format!(
                    "--pair-bytes {pair_bytes} must be in 1..={}",
                    zdisk_kv::format::RECORD_PAYLOAD_MAX_BYTES
                ));
            }
            let mut config = FormatConfig::for_pairs(pairs, pair_bytes, fill);
            if let Some(slots) = slots {
                config.home_slots = slots.max(1);
            }
            config.probe_slots = probe_slots;
            let store =
                Store::format(open_device(&device, 1).map_err(text)?, config).map_err(text)?;
            let geometry = store.geometry();
            println!(
                "formatted: {} home slots + {} probe slots, {} bytes",
                geometry.home_slots,
                geometry.probe_slots,
                geometry.device_bytes()
            );
        }
        Command::Get { device, key } => {
            let store = Store::open(open_device(&device, 1).map_err(text)?).map_err(text)?;
            match store.get(key.as_bytes()).map_err(text)? {
                Some(value) => println!("{}", String::from_utf8_lossy(&value)),
                None => {
                    eprintln!("zdisk-kv: {key:?} not found");
                    return Ok(ExitCode::from(1));
                }
            }
        }
        Command::Put { device, key, value } => {
            let store = Store::open(open_device(&device, 1).map_err(text)?).map_err(text)?;
            store.put(key.as_bytes(), value.as_bytes()).map_err(text)?;
            store.flush().map_err(text)?;
        }
        Command::Delete { device, key } => {
            let store = Store::open(open_device(&device, 1).map_err(text)?).map_err(text)?;
            let existed = store.delete(key.as_bytes()).map_err(text)?;
            store.flush().map_err(text)?;
            if !existed {
                eprintln!("zdisk-kv: {key:?} not found");
                return Ok(ExitCode::from(1));
            }
        }
        Command::Check { device } => {
            let store = Store::open(open_device(&device, 1).map_err(text)?).map_err(text)?;
            let report = store.check().map_err(text)?;
            println!(
                "{}",
                serde_json::to_string(&report).expect("a report serialises")
            );
            if !report.problems.is_empty() {
                return Ok(ExitCode::from(2));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(message) => {
            eprintln!("zdisk-kv: {message}");
            ExitCode::from(1)
        }
    }
}
