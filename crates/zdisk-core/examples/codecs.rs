//! Prints, for each codec, the compression ratio and single-thread
//! compress/decompress throughput over the 4 KiB blocks of a file:
//!
//!     cargo run --release -p zdisk-core --example codecs -- FILE [CODEC...]
//!
//! The ratio counts payload bytes only (no record headers), so it is the
//! codec's own figure; `zdisk stats` reports the stored figure. Rows marked
//! "no probe" skip the entropy estimate and LZ4 probe that normally keep
//! zstd and DEFLATE off incompressible blocks, to show what it saves.
//! Rows marked "fast" are what a write at fast effort (issue #27) takes.

use std::time::Instant;

use zdisk_core::codec::{compress_block_with, decompress_block, CodecId, Effort};
use zdisk_core::{Codec, BLOCK_SIZE};

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(path) = args.next() else {
        eprintln!("usage: codecs FILE [CODEC...]");
        std::process::exit(2);
    };
    let data = std::fs::read(&path).unwrap_or_else(|e| {
        eprintln!("cannot read {path}: {e}");
        std::process::exit(1)
    });
    let blocks: Vec<&[u8]> = data
        .chunks_exact(BLOCK_SIZE)
        .filter(|b| b.iter().any(|&x| x != 0))
        .collect();
    let mut codecs: Vec<Codec> = args
        .map(|s| Codec::parse(&s).expect("codec spec"))
        .collect();
    if codecs.is_empty() {
        codecs = vec![
            Codec::Lz4,
            Codec::Zstd { level: 1 },
            Codec::Zstd { level: -5 },
            Codec::Deflate { level: 1 },
        ];
    }
    println!("{} non-zero blocks of {path}", blocks.len());
    println!(
        "{:<21} {:>7} {:>8} {:>14} {:>16}",
        "codec", "ratio", "raw %", "compress MB/s", "decompress MB/s"
    );
    let runs = codecs.iter().flat_map(|&codec| {
        let unprobed = matches!(codec, Codec::Zstd { .. } | Codec::Deflate { .. });
        [(codec, Effort::Full, true), (codec, Effort::Fast, true)]
            .into_iter()
            .chain(unprobed.then_some((codec, Effort::Full, false)))
    });
    for (codec, effort, probe) in runs {
        let mut payloads: Vec<(CodecId, Vec<u8>)> = Vec::with_capacity(blocks.len());
        let started = Instant::now();
        for block in &blocks {
            let mut out = Vec::new();
            let id = compress_block_with(codec, effort, block, &mut out, probe);
            payloads.push((id, out));
        }
        let compress_s = started.elapsed().as_secs_f64();
        let stored: usize = payloads.iter().map(|(_, p)| p.len()).sum();
        let raw = payloads
            .iter()
            .filter(|(id, _)| *id == CodecId::Raw)
            .count();
        let mut out = vec![0u8; BLOCK_SIZE];
        let started = Instant::now();
        for (id, payload) in &payloads {
            decompress_block(*id, payload, &mut out).expect("round trip");
        }
        let decompress_s = started.elapsed().as_secs_f64();
        let bytes = (blocks.len() * BLOCK_SIZE) as f64;
        println!(
            "{:<21} {:>7.3} {:>7.1}% {:>14.0} {:>16.0}",
            match (effort, probe) {
                (Effort::Fast, _) => format!("{codec} (fast)"),
                (_, true) => codec.to_string(),
                (_, false) => format!("{codec} (no probe)"),
            },
            bytes / stored as f64,
            100.0 * raw as f64 / blocks.len() as f64,
            bytes / compress_s / 1e6,
            bytes / decompress_s / 1e6
        );
    }
}
