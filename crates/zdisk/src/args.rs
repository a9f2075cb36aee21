//! The command line's arguments: one struct per subcommand, and the
//! parsers that turn text into sizes, codecs, policies and durations, so
//! that a bad value is refused by clap with one line before anything runs.

use std::path::PathBuf;

use clap::Args;

use zdisk_core::units::parse_size;
use zdisk_core::{Codec, GcPolicy, Recompress, WriteEffort};
use zdisk_nbd::TlsMode;

pub fn size_arg(text: &str) -> Result<u64, String> {
    parse_size(text)
}

pub fn codec_arg(text: &str) -> Result<Codec, String> {
    Codec::parse(text)
}

pub fn recompress_arg(text: &str) -> Result<Recompress, String> {
    Recompress::parse(text)
}

pub fn write_effort_arg(text: &str) -> Result<WriteEffort, String> {
    WriteEffort::parse(text)
}

pub fn policy_arg(text: &str) -> Result<GcPolicy, String> {
    GcPolicy::parse(text)
}

/// A compression unit size (4K to 128K, whole blocks) as a block count.
pub fn unit_arg(text: &str) -> Result<u8, String> {
    let bytes = parse_size(text)?;
    let block = zdisk_core::units::BLOCK_SIZE_U64;
    let blocks_max = zdisk_core::record::UNIT_BLOCKS_MAX as u64;
    if bytes == 0 || !bytes.is_multiple_of(block) || bytes / block > blocks_max {
        return Err(format!(
            "{text:?} is not a unit size: 4K to {}K in whole 4 KiB blocks",
            blocks_max * 4
        ));
    }
    Ok((bytes / block) as u8)
}

fn on_off_arg(text: &str) -> Result<bool, String> {
    match text {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{text:?} is neither on nor off")),
    }
}

fn tls_mode_arg(text: &str) -> Result<TlsMode, String> {
    TlsMode::parse(text)
}

fn seconds_arg(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(seconds) if seconds.is_finite() && seconds > 0.0 && seconds <= 1e6 => Ok(seconds),
        _ => Err(format!("{text:?} is not a number of seconds above 0")),
    }
}

fn seconds_or_zero_arg(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(seconds) if seconds.is_finite() && (0.0..=1e9).contains(&seconds) => Ok(seconds),
        _ => Err(format!("{text:?} is not a number of seconds, 0 or more")),
    }
}

fn count_arg(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(count) if count > 0 => Ok(count),
        _ => Err(format!("{text:?} is not a positive whole number")),
    }
}

#[derive(Args, Debug, Clone)]
pub struct LayoutArgs {
    /// Logical size exposed to clients (K, M, G, T suffixes); may exceed the physical size.
    #[arg(long, value_parser = size_arg)]
    pub logical: Option<u64>,
    /// Physical size of the image file; defaults to the logical size for a
    /// file, and to the whole device for a block device.
    #[arg(long, value_parser = size_arg)]
    pub physical: Option<u64>,
    /// Segment size: the unit of log writing and cleaning (default: scaled
    /// to the medium, at most 4M).
    #[arg(long, value_parser = size_arg)]
    pub segment_size: Option<u64>,
}

#[derive(Args, Debug)]
pub struct CreateArgs {
    /// Path of the image file or block device.
    pub image: PathBuf,
    #[command(flatten)]
    pub layout: LayoutArgs,
    /// Compression codec: lz4 (default), zstd[:LEVEL], deflate[:LEVEL] or
    /// none; an emulated drive defaults to its controller's codec.
    #[arg(long, value_parser = codec_arg)]
    pub codec: Option<Codec>,
    /// Cleaner victim policy: greedy or cost-benefit.
    #[arg(long, value_parser = policy_arg, default_value = "cost-benefit")]
    pub gc_policy: GcPolicy,
    /// Compress up to this much of a write's consecutive blocks together
    /// (4K: every block alone; default 8K with lz4, 32K with zstd or deflate;
    /// at most 128K).
    #[arg(long, value_parser = unit_arg)]
    pub unit_max: Option<u8>,
    /// Deduplicate: a block written whose 4 KiB are stored already is
    /// shared, not stored again. on (the default; off for an emulated
    /// drive) or off. `serve --dedup` changes it later.
    #[arg(long, value_parser = on_off_arg, value_name = "on|off")]
    pub dedup: Option<bool>,
    /// Overwrite an existing image file.
    #[arg(long)]
    pub force: bool,
    /// Create an emulated NAND drive with this profile (see docs/emulation.md):
    /// plain-tlc, sf1200, sf2500, vertex3-pro-200, csd2000, femu-default or tiny.
    #[arg(long)]
    pub nand: Option<String>,
    /// Emulated drive: model power-loss protection (flushes cost no padding).
    #[arg(long, requires = "nand")]
    pub plp: bool,
    /// Emulated drive: cap the recycling bandwidth (MB/s), as SandForce's
    /// lazy recycling does; 0: no cap. Default: the profile's controller's
    /// (sf1200 72.5, sf2500 400, others none).
    #[arg(long = "recycle-cap-mb-s", requires = "nand")]
    pub recycle_cap_mb_s: Option<f64>,
    /// Keep the volume's segments in an object store, s3://BUCKET/PREFIX
    /// (endpoint and credentials from AWS_* variables); the image is then
    /// a local cache of at most --physical bytes of segments. The bucket
    /// is checked first: an unreachable endpoint, a missing bucket, a
    /// refused key or secret or a skewed clock fails within seconds.
    #[arg(long, conflicts_with_all = ["nand", "force", "from"])]
    pub tier: Option<String>,
    /// With --tier: make the bucket if it does not exist (needs a key
    /// allowed to create buckets; AWS_REGION names its region).
    #[arg(long, requires = "tier")]
    pub create_bucket: bool,
    /// Make a new local cache for the tiered volume at s3://BUCKET/PREFIX
    /// (its newest root object), of at most --physical bytes.
    #[arg(long, conflicts_with_all = ["nand", "force", "codec", "unit_max", "segment_size", "logical"])]
    pub from: Option<String>,
    /// With --from: attach even if the volume's newest root is not a clean
    /// stop's (its writer crashed; make sure it is gone).
    #[arg(long, requires = "from")]
    pub take_over: bool,
    /// With --from: attach as a reader, which never writes the volume
    /// (serve the image with --read-only); its writer may be running.
    #[arg(long, requires = "from", conflicts_with = "take_over")]
    pub read_only: bool,
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Path of the image; created with defaults (printed) if missing.
    pub image: PathBuf,
    /// TCP address to listen on.
    #[arg(long, default_value = "127.0.0.1:10809", conflicts_with = "socket")]
    pub listen: String,
    /// Listen on a Unix socket instead of TCP.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Codec for new writes (remembered in the image).
    #[arg(long, value_parser = codec_arg)]
    pub codec: Option<Codec>,
    /// Cleaner victim policy (remembered in the image).
    #[arg(long, value_parser = policy_arg)]
    pub gc_policy: Option<GcPolicy>,
    /// Largest compression unit for new writes (remembered in the image).
    #[arg(long, value_parser = unit_arg)]
    pub unit_max: Option<u8>,
    /// Rewrite cold data with zstd -9 in 32 KiB units: off, idle (after 5 s
    /// without requests, at most half a core; the default) or gc (also when
    /// the cleaner moves cold data). Never on emulated drives. Mostly dead
    /// segments are compacted when idle in every mode, off included.
    #[arg(long, value_parser = recompress_arg)]
    pub recompress: Option<Recompress>,
    /// How hard writes compress: adaptive (the default: the codec's own
    /// effort while a core is free, a fast one while every core is
    /// compressing, and none, storing raw, while twice as many requests
    /// are and a quarter of the medium is free; the idle pass rewrites
    /// such writes first), full (always the codec's own: each byte reaches
    /// the medium once, for media where wear matters more than a burst's
    /// speed), fast or deferred (always raw). With --recompress off, and on
    /// emulated drives, adaptive is full.
    #[arg(long, value_parser = write_effort_arg)]
    pub write_effort: Option<WriteEffort>,
    /// Compact mostly dead segments when idle, even with --recompress off:
    /// on (the default) or off (with --recompress off too, no background
    /// work but what free space needs). Never on emulated drives.
    #[arg(long, value_parser = on_off_arg, default_value = "on", action = clap::ArgAction::Set)]
    pub idle_compact: bool,
    /// Serve read-only: write requests fail with EPERM.
    #[arg(long)]
    pub read_only: bool,
    /// Large reads of an image file decode straight from a read-only
    /// mapping of it: on (the default) or off (every read copies with
    /// pread, so a disk error under the file fails one request instead of
    /// stopping the server with SIGBUS). Block devices are always read
    /// with pread.
    #[arg(long, value_parser = on_off_arg, default_value = "on", action = clap::ArgAction::Set)]
    pub mapped_reads: bool,
    /// RAM the block map's leaves may take (e.g. 8M, 1G); leaves beyond it
    /// are paged out to the image and read back when needed. Default: 2
    /// bytes per 4 KiB block of the volume, at least 64M and at most 4G.
    #[arg(long, value_parser = size_arg, value_name = "SIZE")]
    pub map_cache: Option<u64>,
    /// Deduplicate new writes: on or off (remembered in the image; a new
    /// image defaults to on). Blocks stored before stay as they are.
    #[arg(long, value_parser = on_off_arg, value_name = "on|off")]
    pub dedup: Option<bool>,
    /// RAM the dedup index may take (e.g. 16M). Default: half a byte per
    /// 4 KiB block of the volume, at most 1G (at least the index's floor,
    /// about 70K); the index samples harder, finding fewer duplicates,
    /// when it outgrows it.
    #[arg(long, value_parser = size_arg, value_name = "SIZE")]
    pub dedup_cache: Option<u64>,
    /// Serve statistics over HTTP at ADDR: /stats (JSON) and /metrics (Prometheus).
    #[arg(long)]
    pub metrics: Option<String>,
    /// Export name offered to clients (the default export "" always works too).
    #[arg(long, default_value = "zdisk")]
    pub export_name: String,
    /// Emulated NAND images: run the drive model in virtual time, without
    /// sleeping (clients see the host's speed, not the drive's).
    #[arg(long)]
    pub virtual_time: bool,
    /// TLS: off, on (clients choose) or require (nothing but STARTTLS
    /// before TLS). Default: on if credentials are given, else off.
    #[arg(long, value_parser = tls_mode_arg)]
    pub tls: Option<TlsMode>,
    /// TLS with X.509: a directory holding ca-cert.pem, server-cert.pem and server-key.pem.
    #[arg(long, value_name = "DIR")]
    pub tls_certificates: Option<PathBuf>,
    /// TLS with pre-shared keys: a file of username:hexkey lines (psktool's format).
    #[arg(long, value_name = "FILE")]
    pub tls_psk: Option<PathBuf>,
    /// With --tls-certificates: require a client certificate signed by ca-cert.pem.
    #[arg(long)]
    pub tls_verify_peer: bool,
    /// Established sessions served at once; while this many are, a new
    /// client is refused with a reason. Connections still in their
    /// handshake do not count (see --max-handshakes).
    #[arg(long, value_parser = count_arg, default_value = "128")]
    pub max_connections: usize,
    /// Connections in their handshake at once; a newcomer beyond this
    /// drops the waiting connection that has done least (the oldest silent one).
    #[arg(long, value_parser = count_arg, default_value = "1024")]
    pub max_handshakes: usize,
    /// Connections in their handshake at once from one IPv4 address (or
    /// IPv6 /64); a newcomer beyond this drops that address's oldest silent
    /// one. An honest client sharing an attacker's address must speak
    /// before this many newer connections from it arrive.
    #[arg(long, value_parser = count_arg, default_value = "256")]
    pub max_handshakes_per_address: usize,
    /// TLS handshakes in progress at once; more queue, served in turn by address.
    #[arg(long, value_parser = count_arg, default_value = "32")]
    pub max_tls_handshakes: usize,
    /// Memory all connections together may hold in request and reply buffers.
    #[arg(long, value_parser = size_arg, default_value = "512M")]
    pub max_in_flight: u64,
    /// Seconds a new connection has, in all, to finish its handshake (TLS included).
    #[arg(long, value_parser = seconds_arg, default_value = "10")]
    pub handshake_timeout: f64,
    /// Seconds a client may take no reply data, while replies wait, before it is disconnected.
    #[arg(long, value_parser = seconds_arg, default_value = "30")]
    pub reply_timeout: f64,
    /// Tiered volumes: make FLUSH and FUA wait until a root object covering
    /// them is in the bucket (the bucket is then the durable copy).
    #[arg(long)]
    pub tier_sync: bool,
    /// Tiered volumes: seconds one request to the bucket is retried before
    /// it fails (a read of evicted data then fails with EIO; uploads retry).
    #[arg(long, value_parser = seconds_arg, value_name = "SECONDS")]
    pub tier_timeout: Option<f64>,
    /// Tiered volumes: seconds a root object is kept after a newer one is
    /// published (readers opened from it work that long); segment objects
    /// no kept root needs are then deleted. Default 600; 0 keeps only the newest.
    #[arg(long, value_parser = seconds_or_zero_arg, value_name = "SECONDS")]
    pub tier_keep: Option<f64>,
    /// Tiered volumes: at start, wait up to this long for a bucket out of
    /// reach (gateway down, network not up) before refusing to serve;
    /// without it, serve refuses within seconds, naming the cause. A
    /// missing bucket or refused credentials never wait.
    #[arg(long, value_parser = seconds_or_zero_arg, value_name = "SECONDS")]
    pub tier_wait: Option<f64>,
    /// Layout used only when the image has to be created.
    #[command(flatten)]
    pub layout: LayoutArgs,
}

#[derive(Args, Debug)]
pub struct StatsArgs {
    /// The image; while it is served, its server answers.
    pub image: PathBuf,
    /// Print JSON with the stable key names.
    #[arg(long, conflicts_with = "explain")]
    pub json: bool,
    /// Say what every key means.
    #[arg(long)]
    pub explain: bool,
}

#[derive(Args, Debug)]
pub struct SnapshotArgs {
    /// The image; while it is served, its server takes the snapshot.
    pub image: PathBuf,
    /// The snapshot's name (1 to 64 letters, digits, '.', '_', '-'): its
    /// read-only NBD export's name too.
    pub name: String,
    /// Snapshot this clone instead of the image's volume.
    #[arg(long, value_name = "CLONE")]
    pub of: Option<String>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct CloneArgs {
    /// The image; while it is served, its server makes the clone and
    /// exports it at once.
    pub image: PathBuf,
    /// The snapshot to clone.
    pub snapshot: String,
    /// The clone's name (1 to 64 letters, digits, '.', '_', '-'): its
    /// writable NBD export's name too.
    pub name: String,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct VolumesArgs {
    /// The image; while it is served, its server answers.
    pub image: PathBuf,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct DeleteArgs {
    /// The image; while it is served, its server deletes the snapshot or
    /// clone.
    pub image: PathBuf,
    /// The snapshot or clone to delete.
    pub name: String,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct CompactArgs {
    /// The image; while it is served, its server compacts it.
    pub image: PathBuf,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct EstimateArgs {
    /// A file, disk image or block device (opened read-only), or - for standard input.
    pub path: PathBuf,
    /// Codec to predict (repeatable): lz4, zstd[:LEVEL], deflate[:LEVEL] or
    /// none. Default: lz4, zstd, zstd:9 and deflate.
    #[arg(long = "codec", value_parser = codec_arg)]
    pub codecs: Vec<Codec>,
    /// Compression unit, as serve's --unit-max (default: each codec's default).
    #[arg(long, value_parser = unit_arg)]
    pub unit_max: Option<u8>,
    /// Compress only this percentage of the input (1 MiB pieces spread
    /// evenly) and scale the figures up.
    #[arg(long, default_value = "100")]
    pub sample: f64,
    /// Print one JSON object per codec, one per line.
    #[arg(long)]
    pub json: bool,
    /// Also predict what deduplicating 4 KiB blocks would save: on (the
    /// default: figures without and with dedup) or off.
    #[arg(long, value_parser = on_off_arg, default_value = "on", action = clap::ArgAction::Set)]
    pub dedup: bool,
    /// RAM for dedup's set of block fingerprints (about 16 bytes a block);
    /// past it the set keeps a sample of them and the dedup figures are
    /// estimated from it.
    #[arg(long, value_parser = size_arg, default_value = "64M", value_name = "SIZE")]
    pub dedup_memory: u64,
}

#[derive(Args, Debug)]
pub struct MapArgs {
    /// An image at rest, or the URI of a server (nbd://HOST:PORT,
    /// nbd+unix:///?socket=PATH), asked through nbdinfo.
    pub target: String,
    /// Also draw the volume to FILE (.png).
    #[arg(long, value_name = "FILE")]
    pub png: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct CheckArgs {
    pub image: PathBuf,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Drop map entries whose data is damaged (they then read as zeros), after listing them.
    #[arg(long)]
    pub repair: bool,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Emulated drive profile, run in virtual time (see docs/emulation.md).
    #[arg(
        long,
        conflicts_with_all = ["image", "memory"],
        required_unless_present_any = ["image", "memory"]
    )]
    pub profile: Option<String>,
    /// A real image (file or block device) to benchmark in real time. It is
    /// recreated for every scenario: its contents are lost.
    #[arg(long, conflicts_with = "memory")]
    pub image: Option<PathBuf>,
    /// A volume on a RAM medium, in real time: the engine's own speed, no
    /// medium in the way (for the threads scenario). Sized by --logical,
    /// --physical and --segment-size.
    #[arg(long)]
    pub memory: bool,
    /// Let the benchmark replace an --image that existed before this run
    /// (an image in use by another process is refused even then).
    #[arg(long, requires = "image")]
    pub force: bool,
    /// Scenarios, comma-separated: sweep, dirty, file-copy, flush, qd, wa, restart, sparse-wal,
    /// threads.
    #[arg(long, value_delimiter = ',', required = true)]
    pub scenario: Vec<String>,
    /// Write JSON lines to FILE: one object per scenario (per measurement for sparse-wal).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw a chart to FILE (.png or .svg).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Bytes moved per measurement (scaled down to fit the drive; sparse-wal: a commit per 32 KiB).
    #[arg(long, value_parser = size_arg, default_value = "256M")]
    pub size: u64,
    /// Data patterns for the sweep: zeros, random, compressible:N, file:PATH (repeatable).
    #[arg(long = "pattern")]
    pub patterns: Vec<String>,
    /// Emulated drives: model power-loss protection.
    #[arg(long)]
    pub plp: bool,
    /// Emulated drives: cap the recycling bandwidth (MB/s), as SandForce's
    /// lazy recycling does; 0: no cap. Default: the profile's controller's
    /// (sf1200 72.5, sf2500 400, others none).
    #[arg(long = "recycle-cap-mb-s")]
    pub recycle_cap_mb_s: Option<f64>,
    /// Dirty the drive with random 4 KiB writes instead of sequential ones.
    #[arg(long, default_value = "sequential", value_parser = ["sequential", "random"])]
    pub dirty_fill: String,
    /// file-copy: read rate of the drive the file is copied from, MB/s (0:
    /// unlimited). The default is fitted to AnandTech's SF-2500 copy.
    #[arg(long = "copy-source-mb-s", default_value_t = zdisk_bench::scenarios::COPY_SOURCE_MB_S)]
    pub copy_source_mb_s: f64,
    /// Spare factors for the wa scenario (physical space / live data − 1).
    #[arg(long, value_delimiter = ',', default_value = "0.28,0.07")]
    pub spare: Vec<f64>,
    /// Logical size of an image drive.
    #[arg(long, value_parser = size_arg, default_value = "1G")]
    pub logical: u64,
    /// Physical size of an image drive (or of the emulated NAND).
    #[arg(long, value_parser = size_arg)]
    pub physical: Option<u64>,
    /// Segment size of an image drive.
    #[arg(long, value_parser = size_arg, default_value = "1M")]
    pub segment_size: u64,
    /// Codec (image drives; emulated drives use their controller's).
    #[arg(long, value_parser = codec_arg)]
    pub codec: Option<Codec>,
    #[arg(long, value_parser = policy_arg, default_value = "cost-benefit")]
    pub gc_policy: GcPolicy,
    /// threads: thread counts, comma-separated (default: 1, 2, 4 … up to the
    /// host's CPUs, and 4 where it has fewer).
    #[arg(long, value_delimiter = ',')]
    pub threads: Vec<usize>,
    /// threads: seconds each measurement runs.
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Seed for data and offsets.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Do not print progress.
    #[arg(long)]
    pub quiet: bool,
}
