//! `zdisk serve`: claim the listening address, open (or create) an image,
//! serve it over NBD until SIGINT, SIGTERM or SIGHUP, then flush and write
//! a clean checkpoint.
//!
//! Order matters for a careful operator: everything that can be checked
//! (arguments, TLS credentials, the address) is checked before an image is
//! created, so a busy port or a bad flag leaves nothing behind. All output
//! goes through the non-blocking log (`logging.rs`): a stuck or closed
//! stderr never stalls or kills the server.

use std::net::ToSocketAddrs;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use zdisk_core::units::format_size;
use zdisk_core::{BlockDevice, OpenOptions, Recompress, Volume, WriteEffort};
use zdisk_nbd::{
    BoundListener, ExtraExport, ExtraExports, ListenAddr, Server, ServerConfig, TlsConfig,
    TlsCredentials, TlsMode,
};

use crate::args::ServeArgs;
use crate::image::{self, DEFAULT_LOGICAL_BYTES, DEFAULT_PHYSICAL_BYTES};

pub fn run(args: ServeArgs) -> Result<(), String> {
    crate::logging::init();
    let listen = listen_addr(&args)?;
    let existing = std::fs::symlink_metadata(&args.image).is_ok();
    check_layout_flags(&args, existing)?;
    let config = server_config(&args)?;
    let bound =
        BoundListener::bind(&listen).map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    zdisk_core::media::set_mapped_reads(args.mapped_reads);
    let volume = open_or_create(&args, existing)?;
    let served = serve(&args, bound, config, volume.clone());
    // Whatever happened, flush and checkpoint what was written.
    let closed = volume.close();
    served?;
    closed.map_err(|e| format!("clean shutdown failed: {e}"))?;
    log::info!("{} closed cleanly", args.image.display());
    Ok(())
}

fn listen_addr(args: &ServeArgs) -> Result<ListenAddr, String> {
    Ok(match &args.socket {
        Some(path) => ListenAddr::Unix(path.clone()),
        None => ListenAddr::Tcp(
            args.listen
                .to_socket_addrs()
                .map_err(|e| format!("invalid --listen address {:?}: {e}", args.listen))?
                .next()
                .ok_or_else(|| format!("--listen {:?} resolves to no address", args.listen))?,
        ),
    })
}

/// Layout flags shape a new image only; on an existing one they would be
/// silently ignored, so they are refused instead.
fn check_layout_flags(args: &ServeArgs, existing: bool) -> Result<(), String> {
    let layout = &args.layout;
    let given: Vec<&str> = [
        ("--logical", layout.logical.is_some()),
        ("--physical", layout.physical.is_some()),
        ("--segment-size", layout.segment_size.is_some()),
    ]
    .into_iter()
    .filter_map(|(flag, set)| set.then_some(flag))
    .collect();
    if existing && !given.is_empty() {
        return Err(format!(
            "{} applies only when serve creates the image, and {} already exists; \
             its layout is fixed (zdisk stats shows it)",
            given.join(", "),
            args.image.display()
        ));
    }
    if args.virtual_time && existing && !image::is_nand_image(&args.image) {
        return Err(format!(
            "--virtual-time applies to emulated drives, and {} is a plain image",
            args.image.display()
        ));
    }
    if args.virtual_time && !existing {
        return Err(format!(
            "--virtual-time applies to emulated drives, and serve would create {} as a plain image \
             (create an emulated one with zdisk create {} --nand PROFILE)",
            args.image.display(),
            args.image.display()
        ));
    }
    Ok(())
}

fn server_config(args: &ServeArgs) -> Result<ServerConfig, String> {
    let credentials = match (&args.tls_certificates, &args.tls_psk) {
        (Some(_), Some(_)) => {
            return Err("give --tls-certificates or --tls-psk, not both".into());
        }
        (Some(dir), None) => Some(TlsCredentials::Certificates {
            dir: dir.clone(),
            verify_peer: args.tls_verify_peer,
        }),
        (None, Some(file)) => Some(TlsCredentials::PskFile(file.clone())),
        (None, None) => None,
    };
    if args.tls_verify_peer && args.tls_certificates.is_none() {
        return Err("--tls-verify-peer needs --tls-certificates".into());
    }
    // As with nbdkit, credentials alone offer TLS; --tls says how strictly.
    let tls_mode = args.tls.unwrap_or(if credentials.is_some() {
        TlsMode::On
    } else {
        TlsMode::Off
    });
    let tls = match (&credentials, tls_mode) {
        (Some(_), TlsMode::Off) => {
            return Err("--tls off contradicts --tls-certificates/--tls-psk".into());
        }
        (None, TlsMode::On | TlsMode::Require) => {
            return Err(format!(
                "--tls {tls_mode} needs credentials: --tls-certificates DIR or --tls-psk FILE"
            ));
        }
        (Some(credentials), _) => Some(TlsConfig::load(credentials).map_err(|e| e.to_string())?),
        (None, TlsMode::Off) => None,
    };
    let config = ServerConfig {
        export_name: args.export_name.clone(),
        description: Some(format!("zdisk image {}", args.image.display())),
        read_only: args.read_only,
        max_connections: args.max_connections,
        max_handshakes: args.max_handshakes,
        max_handshakes_per_address: args.max_handshakes_per_address,
        max_tls_handshakes: args.max_tls_handshakes,
        max_in_flight_bytes: usize::try_from(args.max_in_flight)
            .map_err(|_| "--max-in-flight is too large".to_string())?,
        handshake_timeout: Duration::from_secs_f64(args.handshake_timeout),
        reply_timeout: Duration::from_secs_f64(args.reply_timeout),
        tls_mode,
        tls,
        ..ServerConfig::default()
    };
    config.check().map_err(|e| e.to_string())?;
    Ok(config)
}

/// The tier's settings; refused for an image that has no tier.
fn tier_config(args: &ServeArgs) -> Result<zdisk_tier::TierConfig, String> {
    let given = args.tier_sync
        || args.tier_timeout.is_some()
        || args.tier_keep.is_some()
        || args.tier_wait.is_some();
    if given && !zdisk_tier::is_tiered(&args.image) {
        return Err(format!(
            "--tier-sync, --tier-timeout, --tier-keep and --tier-wait apply to tiered volumes; {} has no tier",
            args.image.display()
        ));
    }
    let defaults = zdisk_tier::TierConfig::default();
    Ok(zdisk_tier::TierConfig {
        sync: args.tier_sync,
        retry_timeout: args
            .tier_timeout
            .map_or(defaults.retry_timeout, Duration::from_secs_f64),
        keep_roots_for: args
            .tier_keep
            .map_or(defaults.keep_roots_for, Duration::from_secs_f64),
        wait_for_bucket: args
            .tier_wait
            .map_or(defaults.wait_for_bucket, Duration::from_secs_f64),
        ..defaults
    })
}

fn open_or_create(args: &ServeArgs, existing: bool) -> Result<Arc<Volume>, String> {
    let tier = tier_config(args)?;
    let nand = existing && image::is_nand_image(&args.image);
    if nand && args.recompress.is_some_and(|mode| mode != Recompress::Off) {
        return Err(
            "--recompress does not apply to an emulated drive: its controller compresses each 4 KiB block once"
                .into(),
        );
    }
    if nand
        && args
            .write_effort
            .is_some_and(|effort| effort != WriteEffort::Full)
    {
        return Err(
            "--write-effort does not apply to an emulated drive: its controller compresses in hardware at line rate, always at full effort"
                .into(),
        );
    }
    let options = OpenOptions {
        read_only: args.read_only,
        codec: args.codec,
        gc_policy: args.gc_policy,
        unit_blocks: args.unit_max,
        recompress: args.recompress.unwrap_or_default(),
        write_effort: args.write_effort.unwrap_or_default(),
        idle_compact: args.idle_compact,
        map_cache_bytes: args.map_cache,
        dedup: args.dedup,
        dedup_cache_bytes: args.dedup_cache,
        ..OpenOptions::default()
    };
    let volume = if existing {
        let volume = image::open_with_clock(&args.image, options, args.virtual_time, tier)?;
        let report = volume.open_report();
        for problem in &report.slot_problems {
            log::warn!("metadata {problem}");
        }
        if report.replayed_records > 0 {
            log::info!(
                "recovered after an unclean stop: replayed {} records from {} segments in {:.2?}",
                report.replayed_records,
                report.replayed_segments,
                report.duration
            );
        }
        if report.cells_rebuilt > 0 {
            log::warn!(
                "recovery rebuilt {} shared contents from their own records: the records that first shared them were gone",
                report.cells_rebuilt
            );
        }
        volume
    } else {
        if args.read_only {
            return Err(format!(
                "{} does not exist, and --read-only cannot create it",
                args.image.display()
            ));
        }
        let mut layout = args.layout.clone();
        if layout.logical.is_none() {
            layout.logical = Some(DEFAULT_LOGICAL_BYTES);
            layout.physical = layout.physical.or(Some(DEFAULT_PHYSICAL_BYTES));
        }
        let codec = args.codec.unwrap_or_default();
        let policy = args.gc_policy.unwrap_or_default();
        let units = args
            .unit_max
            .unwrap_or_else(|| zdisk_core::meta::default_unit_blocks(codec));
        let volume = image::create(&args.image, &layout, codec, policy, units, false, options)?;
        log::info!(
            "{} did not exist; created it with defaults (logical {}, physical {} sparse file, codec {codec})",
            args.image.display(),
            format_size(layout.logical.unwrap_or(0)),
            format_size(volume.superblock().physical_size_bytes),
        );
        if let Some(note) = image::oversized_note(&volume) {
            log::warn!("{note}");
        }
        volume
    };
    log::info!("serving {}", image::describe(&volume, &args.image));
    Ok(volume)
}

fn serve(
    args: &ServeArgs,
    bound: BoundListener,
    config: ServerConfig,
    volume: Arc<Volume>,
) -> Result<(), String> {
    let tls = (
        config.tls_mode,
        config.tls.as_ref().map(|t| t.summary().to_string()),
    );
    let device: Arc<dyn BlockDevice> = volume.clone();
    let mut server = Server::with_listener(bound, device, config).map_err(|e| e.to_string())?;
    server.set_extra_exports(Arc::new(SnapshotExports {
        volume: volume.clone(),
    }));
    let counters = server.counters();
    let bound = server.local_addr().map_err(|e| e.to_string())?;
    let control = match crate::control::serve(&args.image, volume.clone()) {
        Ok(control) => Some(control),
        Err(e) => {
            log::warn!(
                "no control socket ({e}): zdisk stats cannot ask this server; --metrics ADDR serves statistics over HTTP"
            );
            None
        }
    };
    if let Some(addr) = &args.metrics {
        let local = crate::metrics::spawn(addr, volume.clone(), counters)?;
        log::info!("statistics at http://{local}/stats and http://{local}/metrics");
    }
    if let (mode, Some(summary)) = &tls {
        log::info!("TLS {mode}: {summary}");
    }
    // Handlers first: a script may signal as soon as it reads the hints.
    let shutdown = server.shutdown_handle();
    let mut signals = Signals::new([SIGINT, SIGTERM, SIGHUP])
        .map_err(|e| format!("cannot install signal handlers: {e}"))?;
    log_connect_hints(&bound, &args.export_name, args);

    let signal_handle = signals.handle();
    let waiter = std::thread::spawn(move || {
        if let Some(signal) = signals.forever().next() {
            let name = match signal {
                SIGINT => "SIGINT",
                SIGHUP => "SIGHUP",
                _ => "SIGTERM",
            };
            log::info!("{name} received: finishing requests, flushing and checkpointing");
            shutdown.shutdown();
        }
    });
    let served = server.run();
    drop(control);
    signal_handle.close();
    let _ = waiter.join();
    served.map_err(|e| format!("server failed: {e}"))
}

/// The URIs a user can paste, for the address and TLS settings in use.
fn log_connect_hints(bound: &ListenAddr, export: &str, args: &ServeArgs) {
    let tls_query = match (&args.tls_certificates, &args.tls_psk) {
        (Some(_), _) => Some("tls-certificates=CLIENT-DIR".to_string()),
        (_, Some(file)) => Some(format!("tls-psk-file={}", absolute(file))),
        _ => None,
    };
    let user = if args.tls_psk.is_some() { "USER@" } else { "" };
    let scheme = if tls_query.is_some() { "nbds" } else { "nbd" };
    let uri = match bound {
        ListenAddr::Tcp(addr) => {
            let mut uri = format!("{scheme}://{user}{addr}/{export}");
            if let Some(query) = &tls_query {
                uri.push_str(&format!("?{query}"));
            }
            uri
        }
        ListenAddr::Unix(path) => {
            let mut uri = format!("{scheme}+unix://{user}/{export}?socket={}", absolute(path));
            if let Some(query) = &tls_query {
                uri.push_str(&format!("&{query}"));
            }
            uri
        }
    };
    let name = if export.is_empty() {
        String::new()
    } else {
        format!(" -N {export}")
    };
    let nbd_client = match bound {
        ListenAddr::Tcp(addr) => {
            format!("nbd-client {} {}{name} /dev/nbd0", addr.ip(), addr.port())
        }
        ListenAddr::Unix(path) => format!("nbd-client -unix {}{name} /dev/nbd0", absolute(path)),
    };
    // Indented and unprefixed, so they can be pasted as they are.
    let hint = |text: String| crate::logging::line(format!("  {text}\n"));
    log::info!("listening on {bound}; connect with:");
    hint(format!("nbdinfo '{uri}'"));
    if tls_query.is_none() {
        hint(format!("qemu-img info '{uri}'"));
        hint(nbd_client);
        hint(format!("touch /tmp/zdisk.raw && nbdfuse -P /tmp/zdisk.pid /tmp/zdisk.raw '{uri}' &   # then, once /tmp/zdisk.pid exists: losetup -f --show /tmp/zdisk.raw (README: a kernel filesystem)"));
    }
    log::info!("stop with Ctrl-C (SIGINT), SIGTERM or SIGHUP for a clean shutdown");
}

fn absolute(path: &Path) -> String {
    std::path::absolute(path)
        .unwrap_or_else(|_| path.to_path_buf())
        .display()
        .to_string()
}

/// The volume's snapshots, each a read-only export under its name, and
/// its clones, each a writable one (`nbdinfo --list` shows them; one made
/// while the server runs is served at once, one deleted is gone for new
/// connections).
struct SnapshotExports {
    volume: Arc<Volume>,
}

impl SnapshotExports {
    fn describe(&self, snapshot: &zdisk_core::Snapshot) -> ExtraExport {
        let of = match self.volume.snapshot_volume(&snapshot.name) {
            Some(clone) => format!(" of clone {clone}"),
            None => String::new(),
        };
        ExtraExport {
            // Versions are never reused: an id names one snapshot for good.
            id: snapshot.version,
            name: snapshot.name.clone(),
            description: Some(format!(
                "zdisk snapshot {}{of} (read-only), taken at version {}",
                snapshot.name, snapshot.version
            )),
            size_bytes: self.volume.size_bytes(),
            read_only: true,
        }
    }

    fn describe_clone(&self, clone: &zdisk_core::CloneVolume) -> ExtraExport {
        let base = self
            .volume
            .snapshot_list()
            .into_iter()
            .find(|s| s.space == clone.base)
            .map_or_else(String::new, |s| s.name);
        ExtraExport {
            // A clone's version is its own: no snapshot has it.
            id: clone.version,
            name: clone.name.clone(),
            description: Some(format!(
                "zdisk clone {} of snapshot {base}, made at version {}",
                clone.name, clone.version
            )),
            size_bytes: self.volume.size_bytes(),
            read_only: false,
        }
    }
}

impl ExtraExports for SnapshotExports {
    fn list(&self) -> Vec<ExtraExport> {
        let snapshots = self.volume.snapshot_list();
        let clones = self.volume.clone_list();
        snapshots
            .iter()
            .map(|s| self.describe(s))
            .chain(clones.iter().map(|c| self.describe_clone(c)))
            .collect()
    }

    fn find(&self, name: &str) -> Option<ExtraExport> {
        if let Some(clone) = self.volume.clone_list().iter().find(|c| c.name == name) {
            return Some(self.describe_clone(clone));
        }
        self.volume
            .snapshot_list()
            .iter()
            .find(|s| s.name == name)
            .map(|s| self.describe(s))
    }

    fn open(&self, id: u64) -> Option<Arc<dyn BlockDevice>> {
        if let Some(clone) = self
            .volume
            .clone_list()
            .into_iter()
            .find(|c| c.version == id)
        {
            let device = self.volume.clone_device(&clone.name).ok()?;
            return Some(Arc::new(device));
        }
        let snapshot = self
            .volume
            .snapshot_list()
            .into_iter()
            .find(|s| s.version == id)?;
        let device = self.volume.snapshot_device(&snapshot.name).ok()?;
        Some(Arc::new(device))
    }
}
