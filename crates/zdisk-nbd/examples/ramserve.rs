//! Serves a RAM disk over NBD, for trying the server with real clients
//! (nbdinfo, nbdcopy, nbdsh, qemu-io, qemu-img, fio) without the engine.
//!
//! Usage: `ramserve [--size BYTES[K|M|G]] [--tcp ADDR | --unix PATH]
//!                  [--name NAME] [--read-only] [--fail-io-at OFFSET]`
//! Defaults: 64M, TCP 127.0.0.1:10809, export "zdisk". `--fail-io-at`
//! injects an I/O error for any request touching that byte, to watch how
//! clients see device errors. Runs until killed.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use zdisk_nbd::testing::RamDevice;
use zdisk_nbd::{ListenAddr, Server, ServerConfig};

fn parse_size(text: &str) -> Option<u64> {
    let (digits, multiplier) = match text.chars().last()? {
        'K' | 'k' => (&text[..text.len() - 1], 1 << 10),
        'M' | 'm' => (&text[..text.len() - 1], 1 << 20),
        'G' | 'g' => (&text[..text.len() - 1], 1 << 30),
        _ => (text, 1),
    };
    digits.parse::<u64>().ok()?.checked_mul(multiplier)
}

fn usage(problem: &str) -> ExitCode {
    eprintln!("ramserve: {problem}");
    eprintln!(
        "usage: ramserve [--size BYTES[K|M|G]] [--tcp ADDR | --unix PATH] [--name NAME] \
         [--read-only] [--fail-io-at OFFSET]"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let mut size_bytes: u64 = 64 << 20;
    let mut addr = ListenAddr::Tcp(([127, 0, 0, 1], 10809).into());
    let mut config = ServerConfig::default();
    let mut fail_io_at = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--read-only" {
            config.read_only = true;
            continue;
        }
        let Some(value) = args.next() else {
            return usage(&format!("{flag} needs a value"));
        };
        match flag.as_str() {
            "--size" => match parse_size(&value) {
                Some(size) => size_bytes = size,
                None => return usage(&format!("bad size {value:?}")),
            },
            "--tcp" => match value.parse() {
                Ok(socket_addr) => addr = ListenAddr::Tcp(socket_addr),
                Err(error) => return usage(&format!("bad address {value:?}: {error}")),
            },
            "--unix" => addr = ListenAddr::Unix(PathBuf::from(value)),
            "--name" => config.export_name = value,
            "--fail-io-at" => match value.parse() {
                Ok(offset) => fail_io_at.push(offset),
                Err(error) => return usage(&format!("bad offset {value:?}: {error}")),
            },
            _ => return usage(&format!("unknown argument {flag:?}")),
        }
    }

    let device = Arc::new(RamDevice::new(size_bytes));
    for offset in fail_io_at {
        device.fail_io_at(offset);
    }
    config.description = Some(format!("zdisk-nbd ramserve, {size_bytes} bytes of RAM"));
    let server = match Server::bind(&addr, device, config) {
        Ok(server) => server,
        Err(error) => {
            eprintln!("ramserve: cannot listen on {addr}: {error}");
            return ExitCode::FAILURE;
        }
    };
    match server.local_addr() {
        Ok(bound) => eprintln!("ramserve: serving {size_bytes} bytes on {bound}"),
        Err(error) => eprintln!("ramserve: serving, but local_addr failed: {error}"),
    }
    match server.run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("ramserve: {error}");
            ExitCode::FAILURE
        }
    }
}
