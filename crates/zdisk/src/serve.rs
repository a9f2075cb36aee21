//! `zdisk serve`: open (or create) an image and serve it over NBD until
//! SIGINT or SIGTERM, then flush and write a clean checkpoint.

use std::net::ToSocketAddrs;
use std::sync::Arc;

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use zdisk_core::units::format_size;
use zdisk_core::{BlockDevice, OpenOptions, Volume};
use zdisk_nbd::{ListenAddr, Server, ServerConfig};

use crate::image::{self, DEFAULT_LOGICAL_BYTES, DEFAULT_PHYSICAL_BYTES};
use crate::ServeArgs;

pub fn run(args: ServeArgs) -> Result<(), String> {
    let listen = listen_addr(&args)?;
    let volume = open_or_create(&args)?;
    let served = serve(&args, &listen, volume.clone());
    // Whatever happened, flush and checkpoint what was written.
    let closed = volume.close();
    served?;
    closed.map_err(|e| format!("clean shutdown failed: {e}"))?;
    eprintln!("zdisk: {} closed cleanly", args.image.display());
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

fn open_or_create(args: &ServeArgs) -> Result<Arc<Volume>, String> {
    let options = OpenOptions {
        read_only: args.read_only,
        codec: args.codec,
        gc_policy: args.gc_policy,
        ..OpenOptions::default()
    };
    let volume = if args.image.exists() {
        let volume = image::open_with_clock(&args.image, options, args.virtual_time)?;
        let report = volume.open_report();
        for problem in &report.slot_problems {
            eprintln!("zdisk: warning: metadata {problem}");
        }
        if report.replayed_records > 0 {
            eprintln!(
                "zdisk: recovered after an unclean stop: replayed {} records from {} segments in {:.2?}",
                report.replayed_records, report.replayed_segments, report.duration
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
        let volume = image::create(&args.image, &layout, codec, policy, false, options)?;
        eprintln!(
            "zdisk: {} did not exist; created it with defaults (logical {}, physical {} sparse file, codec {codec})",
            args.image.display(),
            format_size(layout.logical.unwrap_or(0)),
            format_size(volume.superblock().physical_size_bytes),
        );
        volume
    };
    eprintln!("zdisk: serving {}", image::describe(&volume, &args.image));
    Ok(volume)
}

fn serve(args: &ServeArgs, listen: &ListenAddr, volume: Arc<Volume>) -> Result<(), String> {
    let config = ServerConfig {
        export_name: args.export_name.clone(),
        description: Some(format!("zdisk image {}", args.image.display())),
        read_only: args.read_only,
        ..ServerConfig::default()
    };
    let device: Arc<dyn BlockDevice> = volume.clone();
    let server = Server::bind(listen, device, config)
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    let bound = server.local_addr().map_err(|e| e.to_string())?;
    if let Some(addr) = &args.metrics {
        let local = crate::metrics::spawn(addr, volume.clone())?;
        eprintln!("zdisk: statistics at http://{local}/stats and http://{local}/metrics");
    }
    print_connect_hints(&bound, &args.export_name);

    let shutdown = server.shutdown_handle();
    let mut signals = Signals::new([SIGINT, SIGTERM])
        .map_err(|e| format!("cannot install signal handlers: {e}"))?;
    let signal_handle = signals.handle();
    let waiter = std::thread::spawn(move || {
        if let Some(signal) = signals.forever().next() {
            eprintln!(
                "zdisk: {} received: finishing requests, flushing and checkpointing",
                if signal == SIGINT {
                    "SIGINT"
                } else {
                    "SIGTERM"
                }
            );
            shutdown.shutdown();
        }
    });
    let served = server.run();
    signal_handle.close();
    let _ = waiter.join();
    served.map_err(|e| format!("server failed: {e}"))
}

fn print_connect_hints(bound: &ListenAddr, export: &str) {
    let (uri, qemu, nbd_client) = match bound {
        ListenAddr::Tcp(addr) => (
            format!("nbd://{addr}/{export}"),
            format!("nbd://{addr}/{export}"),
            format!(
                "nbd-client {} {} -N {export} /dev/nbd0",
                addr.ip(),
                addr.port()
            ),
        ),
        ListenAddr::Unix(path) => (
            format!("nbd+unix:///{export}?socket={}", path.display()),
            format!("nbd+unix:///{export}?socket={}", path.display()),
            format!("nbd-client -unix {} -N {export} /dev/nbd0", path.display()),
        ),
    };
    eprintln!("zdisk: listening on {bound}; connect with:");
    eprintln!("  nbdinfo {uri}");
    eprintln!("  qemu-img info {qemu}");
    eprintln!("  {nbd_client}");
    eprintln!("  touch /tmp/zdisk.raw && nbdfuse /tmp/zdisk.raw {uri} &   # then: losetup -f --show /tmp/zdisk.raw");
    eprintln!("zdisk: stop with Ctrl-C (SIGINT) or SIGTERM for a clean shutdown");
}
