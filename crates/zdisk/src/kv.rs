//! `zdisk kv`: the command line of the table-less hash key-value store
//! (`crates/zdisk-kv`, case study 2 in docs/case-studies.md) and the chart
//! of its YCSB comparison. Thin: parse, open, call the library.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Subcommand};
use serde_json::Value;

use zdisk_bench::plot::{plot_grouped_panels, BarPanel};
use zdisk_kv::{open_device, FormatConfig, Store};

#[derive(Args, Debug)]
pub struct KvArgs {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
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
    /// Runs YCSB-style workloads on the store or on RocksDB; one JSON
    /// object per phase on stdout (and appended to --json).
    Ycsb(Box<YcsbArgs>),
    /// Reads every slot and checks the store's invariants; JSON report.
    Check {
        #[arg(long)]
        device: String,
    },
    /// Charts `ycsb` JSON lines (one object per engine and phase): ops/s and
    /// p99 latency per workload, stored bytes and the driver's RSS per engine.
    Plot {
        /// The JSON lines that `zdisk kv ycsb --json` appended.
        results: PathBuf,
        /// The chart to draw: .png or .svg.
        chart: PathBuf,
        /// The chart's title.
        #[arg(default_value = "table-less hash store vs RocksDB on zdisk")]
        title: String,
    },
}

#[derive(Args, Debug)]
struct YcsbArgs {
    /// `kv` (this store; needs --device) or `rocksdb` (needs --db).
    #[arg(long)]
    engine: String,
    /// The store's device (formatted first unless --no-format).
    #[arg(long)]
    device: Option<String>,
    #[arg(long)]
    no_format: bool,
    /// Average slot fill when formatting.
    #[arg(long, default_value_t = 0.5)]
    fill: f64,
    /// RocksDB's directory.
    #[arg(long)]
    db: Option<String>,
    /// RocksDB's compression: lz4 or none.
    #[arg(long, default_value = "lz4")]
    compression: String,
    /// RAM for caching: RocksDB's block cache, or the store's slot cache.
    #[arg(long, default_value_t = 32 << 20)]
    cache_bytes: usize,
    /// Records loaded.
    #[arg(long, default_value_t = 1_000_000)]
    records: u64,
    /// Seconds per run phase.
    #[arg(long, default_value_t = 30.0)]
    seconds: f64,
    /// Client threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Phases in order: load and workloads A, B, C, D, F.
    #[arg(long, default_value = "load,A,B,C,F,D")]
    workloads: String,
    /// zdisk's metrics address (HOST:PORT) for its /stats after each phase.
    #[arg(long)]
    metrics: Option<String>,
    /// A shell command run after each phase's settle, before /stats (e.g. sync; fstrim MNT).
    #[arg(long)]
    settle_cmd: Option<String>,
    /// Processes whose CPU time counts as the server's (zdisk, nbdfuse).
    #[arg(long)]
    watch_pid: Vec<u32>,
    /// A free-form label copied into every JSON line.
    #[arg(long)]
    label: Option<String>,
    #[arg(long)]
    json: Option<PathBuf>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// CPU seconds (user + system) of this process.
fn own_cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

/// CPU seconds of another process, from /proc (0 if it is gone).
fn pid_cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the command's closing parenthesis; utime and stime are 14 and 15.
    let Some(rest) = stat.rsplit_once(')').map(|(_, rest)| rest) else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (ticks(11) + ticks(12)) / hz
}

/// Resident set size of this process.
fn own_rss_bytes() -> u64 {
    rss_bytes("/proc/self/status")
}

/// zdisk's /stats, by a plain HTTP GET.
fn zdisk_stats(address: &str) -> Result<Value, String> {
    use std::io::{Read, Write};
    let mut stream =
        std::net::TcpStream::connect(address).map_err(|e| format!("metrics {address}: {e}"))?;
    stream
        .write_all(format!("GET /stats HTTP/1.0\r\nHost: {address}\r\n\r\n").as_bytes())
        .map_err(|e| e.to_string())?;
    let mut reply = String::new();
    stream
        .read_to_string(&mut reply)
        .map_err(|e| e.to_string())?;
    let body = reply.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    serde_json::from_str(body).map_err(|e| format!("metrics {address}: bad /stats: {e}"))
}

fn run_ycsb(args: YcsbArgs) -> Result<(), String> {
    use std::time::Duration;
    use zdisk_kv::ycsb::{run_phase, Engine, KeySpace, PhaseConfig, Workload, Zipfian};
    let phases: Vec<Workload> = args
        .workloads
        .split(',')
        .map(|name| Workload::parse(name.trim()).ok_or(format!("unknown workload {name:?}")))
        .collect::<Result<_, _>>()?;
    if args.threads == 0 || args.records == 0 {
        return Err("--threads and --records must be positive".into());
    }
    if !(args.seconds > 0.0 && args.seconds.is_finite()) {
        return Err(format!("--seconds {} must be positive", args.seconds));
    }
    let logical_bytes: Box<dyn Fn() -> u64>;
    let (engine, engine_name): (Box<dyn Engine>, String) = match args.engine.as_str() {
        "kv" => {
            let spec = args.device.as_deref().ok_or("--engine kv needs --device")?;
            let device = open_device(spec, args.threads).map_err(|e| e.to_string())?;
            let store = if args.no_format {
                Store::open(device)
            } else {
                let pair_bytes = zdisk_kv::ycsb::KEY_BYTES + zdisk_kv::ycsb::VALUE_BYTES;
                // Room for D's inserts too: 10 % more pairs.
                let config = FormatConfig::for_pairs(
                    args.records + args.records / 10,
                    pair_bytes,
                    args.fill,
                );
                Store::format(device, config)
            }
            .map_err(|e| e.to_string())?
            .with_cache(args.cache_bytes as u64);
            let bytes = store.geometry().device_bytes();
            logical_bytes = Box::new(move || bytes);
            (Box::new(store), "kv".to_string())
        }
        "rocksdb" => {
            let db = args.db.as_deref().ok_or("--engine rocksdb needs --db")?;
            let compression = match args.compression.as_str() {
                "lz4" => zdisk_kv::rocks::Compression::Lz4,
                "none" => zdisk_kv::rocks::Compression::None,
                other => return Err(format!("--compression {other:?}: lz4 or none")),
            };
            let engine = zdisk_kv::rocks::RocksDb::open(db, compression, args.cache_bytes, true)?;
            let dir = PathBuf::from(db);
            logical_bytes = Box::new(move || directory_bytes(&dir));
            (Box::new(engine), format!("rocksdb-{}", args.compression))
        }
        other => return Err(format!("--engine {other:?}: kv or rocksdb")),
    };
    let keys = KeySpace::new(args.records);
    let zipfian = Zipfian::new(args.records);
    let mut json_file = match &args.json {
        Some(path) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| format!("{}: {e}", path.display()))?,
        ),
        None => None,
    };
    for (index, workload) in phases.into_iter().enumerate() {
        let config = PhaseConfig {
            workload,
            records: args.records,
            threads: args.threads,
            duration: Duration::from_secs_f64(args.seconds),
            seed: args.seed + index as u64,
        };
        let counters_before = engine.counters();
        let cpu_before = own_cpu_seconds();
        let server_before: f64 = args.watch_pid.iter().map(|&pid| pid_cpu_seconds(pid)).sum();
        let result = run_phase(engine.as_ref(), &keys, &zipfian, config)?;
        let cpu = own_cpu_seconds() - cpu_before;
        let server_cpu = args
            .watch_pid
            .iter()
            .map(|&pid| pid_cpu_seconds(pid))
            .sum::<f64>()
            - server_before;
        let rss_bytes = own_rss_bytes();
        engine.settle()?;
        if let Some(command) = &args.settle_cmd {
            let status = std::process::Command::new("sh")
                .args(["-c", command])
                .status()
                .map_err(|e| format!("--settle-cmd: {e}"))?;
            if !status.success() {
                return Err(format!("--settle-cmd failed: {status}"));
            }
        }
        let operations = result.operations.max(1) as f64;
        let mut line = serde_json::json!({
            "engine": engine_name,
            "workload": workload.name(),
            "label": args.label,
            "records": args.records,
            "records_now": keys.inserted(),
            "threads": args.threads,
            "seconds": result.elapsed.as_secs_f64(),
            "operations": result.operations,
            "ops_per_s": result.operations as f64 / result.elapsed.as_secs_f64(),
            "mean_us": result.latency.mean_us(),
            "p50_us": result.latency.quantile_us(0.5),
            "p99_us": result.latency.quantile_us(0.99),
            "p999_us": result.latency.quantile_us(0.999),
            "reads": result.reads,
            "reads_found": result.reads_found,
            "client_cpu_us_per_op": cpu * 1e6 / operations,
            "server_cpu_us_per_op": server_cpu * 1e6 / operations,
            "cpu_us_per_op": (cpu + server_cpu) * 1e6 / operations,
            "rss_bytes": rss_bytes,
            "cache_bytes": args.cache_bytes,
            "engine_counters": counter_deltas(&counters_before, &engine.counters()),
            "logical_bytes": logical_bytes(),
        });
        if let Some(address) = &args.metrics {
            let stats = zdisk_stats(address)?;
            for key in [
                "mapped_bytes",
                "stored_bytes",
                "physical_used_bytes",
                "host_write_bytes",
                "media_write_bytes",
                "compression_ratio",
            ] {
                line[key] = stats.get(key).cloned().unwrap_or(Value::Null);
            }
            line["physical_bytes"] = stats.get("stored_bytes").cloned().unwrap_or(Value::Null);
            line["server_rss_bytes"] = args.watch_pid.first().map(|pid| pid_rss_bytes(*pid)).into();
        }
        let text = line.to_string();
        println!("{text}");
        if let Some(file) = json_file.as_mut() {
            use std::io::Write;
            writeln!(file, "{text}").map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

/// Each numeric counter's change over a phase.
fn counter_deltas(before: &Value, after: &Value) -> Value {
    let Some(after) = after.as_object() else {
        return Value::Null;
    };
    let deltas = after
        .iter()
        .filter_map(|(key, value)| {
            let now = value.as_u64()?;
            let then = before.get(key).and_then(|v| v.as_u64()).unwrap_or(0);
            Some((key.clone(), Value::from(now.saturating_sub(then))))
        })
        .collect();
    Value::Object(deltas)
}

/// Bytes of the files in a directory (not recursive: RocksDB's is flat).
fn directory_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|entry| entry.ok()?.metadata().ok())
        .filter(|metadata| metadata.is_file())
        .map(|metadata| metadata.len())
        .sum()
}

/// Resident set size of another process (0 if it is gone).
fn pid_rss_bytes(pid: u32) -> u64 {
    rss_bytes(&format!("/proc/{pid}/status"))
}

/// `VmRSS` of a `/proc/PID/status` file, in bytes (0 if unreadable).
fn rss_bytes(status_path: &str) -> u64 {
    std::fs::read_to_string(status_path)
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Runs one `zdisk kv` command. Exit status 1: the key was not found;
/// 2: `check` found problems (and, as for every zdisk command, any error).
pub fn run(args: KvArgs) -> Result<ExitCode, String> {
    let text = |e: zdisk_kv::Error| e.to_string();
    match args.command {
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
                    eprintln!("zdisk kv: {key:?} not found");
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
                eprintln!("zdisk kv: {key:?} not found");
                return Ok(ExitCode::from(1));
            }
        }
        Command::Ycsb(args) => run_ycsb(*args)?,
        Command::Plot {
            results,
            chart,
            title,
        } => plot(&results, &chart, &title)?,
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

/// Draws the chart of `ycsb` results: one colour per engine.
fn plot(results: &Path, chart: &Path, title: &str) -> Result<(), String> {
    let input = results.display();
    let text = std::fs::read_to_string(results).map_err(|e| format!("{input}: {e}"))?;
    let rows: Vec<Value> = text
        .lines()
        .filter(|line| !line.trim().is_empty())
        .enumerate()
        .map(|(n, line)| serde_json::from_str(line).map_err(|e| format!("{input}:{}: {e}", n + 1)))
        .collect::<Result<_, _>>()?;
    if rows.is_empty() {
        return Err(format!("{input}: no results"));
    }
    let mut engines: Vec<String> = Vec::new();
    let mut workloads: Vec<String> = Vec::new();
    for row in &rows {
        let engine = row["engine"]
            .as_str()
            .ok_or("a row without engine")?
            .to_string();
        let workload = row["workload"]
            .as_str()
            .ok_or("a row without workload")?
            .to_string();
        if !engines.contains(&engine) {
            engines.push(engine);
        }
        if !workloads.contains(&workload) {
            workloads.push(workload);
        }
    }
    let value = |engine: &str, workload: &str, key: &str| -> f64 {
        rows.iter()
            .find(|r| r["engine"] == engine && r["workload"] == workload)
            .and_then(|r| r[key].as_f64())
            .unwrap_or(0.0)
    };
    let per_workload = |key: &str, scale: f64| -> Vec<(String, Vec<f64>)> {
        engines
            .iter()
            .map(|engine| {
                let values = workloads
                    .iter()
                    .map(|w| value(engine, w, key) * scale)
                    .collect();
                (engine.clone(), values)
            })
            .collect()
    };
    let last = workloads.last().cloned().unwrap_or_default();
    let first = workloads.first().cloned().unwrap_or_default();
    let space_groups = vec![
        format!("stored, after {first}"),
        format!("stored, after {last}"),
        "driver RSS, max".to_string(),
    ];
    let space = engines
        .iter()
        .map(|engine| {
            let rss = workloads
                .iter()
                .map(|w| value(engine, w, "rss_bytes"))
                .fold(0.0, f64::max);
            (
                engine.clone(),
                vec![
                    value(engine, &first, "stored_bytes") / 1e6,
                    value(engine, &last, "stored_bytes") / 1e6,
                    rss / 1e6,
                ],
            )
        })
        .collect();
    let panels = vec![
        BarPanel {
            caption: "throughput per workload".into(),
            unit: "ops/s".into(),
            groups: workloads.clone(),
            series: per_workload("ops_per_s", 1.0),
        },
        BarPanel {
            caption: "p99 latency per workload".into(),
            unit: "µs".into(),
            groups: workloads.clone(),
            series: per_workload("p99_us", 1.0),
        },
        BarPanel {
            caption: "zdisk stored bytes (physical) and driver RSS".into(),
            unit: "MB".into(),
            groups: space_groups,
            series: space,
        },
    ];
    plot_grouped_panels(&panels, title, chart)
}
