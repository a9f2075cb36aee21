#!/usr/bin/python3
"""The paged map under a bounded cache: RSS, verification and 4 KiB random reads.

One image (16 TiB logical by default), served on a Unix socket with
`--map-cache` and written by fio's nbd engine:
  1. fill     BLOCKS random 4 KiB writes over the whole volume (fio's LFSR
              generator, so no block is written twice), each with a crc32c
              verify header; the server's VmRSS and /stats after the fill
              (RSS against cache + 64 MiB);
  2. verify   kill -9 of the server, a restart (its recovery time), and
              every block read back and verified by fio (--verify_only);
  3. reads    for a map cache of 100%, 25% and 5% of the map's size (its
              leaves' heap bytes, `map_resident_bytes` with everything in
              RAM), a restart with that cache and a timed 4 KiB random read
              of the written blocks (same LFSR sequence), after a warm-up
              pass; each as a ratio of the 100% case's IOPS in this run,
              with the cache's hits and misses. With --rounds N the three
              caches are measured N times, interleaved, and the ratio is
              each round's, with the median printed (a shared host's
              speed drifts). --reads-only measures the reads on the image
              a previous run left in --dir.
The idle pass is off (--recompress off). Needs fio with the nbd engine.
Usage: map_cache.py [--zdisk BIN] [--dir DIR] [--logical 16T]
                    [--physical 12G] [--blocks 2097152] [--cache 8M]
                    [--seconds 20] [--rounds 1] [--reads-only]
A JSON object with every figure after the table.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from map_rss import BLOCK, free_port, parse_size, rss_bytes, stats, wait_for, _answers  # noqa: E402


# The servers started, so that a failure stops them.
SERVERS = []


class Server:
    def __init__(self, args, image, sock, cache):
        self.port = free_port()
        self.sock = sock
        started = time.time()
        self.process = subprocess.Popen(
            [args.zdisk, "serve", image, "--socket", sock, "--metrics", f"127.0.0.1:{self.port}",
             "--recompress", "off", "--map-cache", str(cache)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        SERVERS.append(self.process)
        wait_for(lambda: os.path.exists(sock), "the socket", seconds=600)
        wait_for(lambda: _answers(self.port), "the metrics endpoint", seconds=600)
        self.open_seconds = time.time() - started

    def rss(self):
        return rss_bytes(self.process.pid)

    def stats(self):
        return stats(self.port)

    def kill(self):
        self.process.kill()
        self.process.wait()
        if os.path.exists(self.sock):
            os.remove(self.sock)

    def stop(self):
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=600)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if os.path.exists(self.sock):
            os.remove(self.sock)


def fio(sock, rw, args, extra=()):
    command = [
        "fio", "--name=map", "--ioengine=nbd", f"--uri=nbd+unix:///?socket={sock}",
        f"--rw={rw}", "--bs=4k", f"--size={args.logical}",
        f"--io_size={args.blocks * BLOCK}", "--random_generator=lfsr",
        "--norandommap", "--randseed=12", "--iodepth=16", "--output-format=json",
        *extra,
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"fio {rw} failed: {done.stdout[-2000:]} {done.stderr[-2000:]}")
    out = done.stdout
    return json.loads(out[out.index("{"):])


VERIFY = ("--verify=crc32c", "--verify_fatal=1")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zdisk", default="target/release/zdisk")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--logical", default="16T")
    parser.add_argument("--physical", default="12G")
    parser.add_argument("--blocks", type=int, default=2 * 1024 * 1024)
    parser.add_argument("--cache", default="8M")
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--reads-only", action="store_true")
    args = parser.parse_args()
    if shutil.which("fio") is None:
        sys.exit("map_cache.py: fio is needed")
    workdir = args.dir or tempfile.mkdtemp(prefix="map_cache.")
    os.makedirs(workdir, exist_ok=True)
    image = os.path.join(workdir, "paged.zdisk")
    sock = os.path.join(workdir, "paged.sock")
    cache = parse_size(args.cache)
    if args.reads_only and not os.path.exists(image):
        sys.exit(f"map_cache.py: --reads-only needs {image} from a previous run")
    if not args.reads_only:
        subprocess.run(
            [args.zdisk, "create", image, "--logical", args.logical, "--physical", args.physical,
             "--force"],
            check=True, capture_output=True, text=True,
        )
    result = {"zdisk": args.zdisk, "logical": args.logical, "blocks": args.blocks, "cache_bytes": cache}
    try:
        if not args.reads_only:
            fill_and_verify(args, image, sock, cache, result)
        reads, map_bytes = measure_reads(args, image, sock, result)
    finally:
        for process in SERVERS:
            if process.poll() is None:
                process.kill()
                process.wait()
        if args.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    report(result, reads, map_bytes, cache)


def fill_and_verify(args, image, sock, cache, result):
    if True:
        server = Server(args, image, sock, cache)
        rss_before = server.rss()
        started = time.time()
        # Flushed at the end: only flushed writes must survive kill -9.
        fio(sock, "randwrite", args, ("--do_verify=0", "--end_fsync=1", *VERIFY))
        result["fill_seconds"] = time.time() - started
        after = server.stats()
        result["fill_rss_before_bytes"] = rss_before
        result["fill_rss_bytes"] = server.rss()
        result["fill_mapped_blocks"] = after["mapped_bytes"] // BLOCK
        result["fill_map_memory_bytes"] = after["map_memory_bytes"]
        result["fill_map_resident_bytes"] = after["map_resident_bytes"]
        result["fill_map_leaves"] = after["map_leaves"]
        result["rss_within_cache_plus_64m"] = result["fill_rss_bytes"] <= cache + (64 << 20)

        server.kill()
        server = Server(args, image, sock, cache)
        result["recovery_seconds"] = server.open_seconds
        started = time.time()
        fio(sock, "randwrite", args, ("--verify_only", *VERIFY))
        result["verify_seconds"] = time.time() - started
        result["verified_blocks"] = args.blocks
        result["verify_rss_bytes"] = server.rss()
        result["verify_stats"] = {k: v for k, v in server.stats().items() if k.startswith("map_")}
        server.stop()


def measure_reads(args, image, sock, result):
    if True:

        # The map's size: every leaf in RAM after a pass over the blocks.
        server = Server(args, image, sock, 1 << 40)
        fio(sock, "randread", args)
        map_bytes = server.stats()["map_resident_bytes"]
        server.stop()
        result["map_bytes"] = map_bytes
        reads = {percent: [] for percent in (100, 25, 5)}
        for _, percent in [(r, p) for r in range(args.rounds) for p in (100, 25, 5)]:
            size = map_bytes * percent // 100 if percent < 100 else 1 << 40
            server = Server(args, image, sock, size)
            fio(sock, "randread", args)  # warm-up: the cache fills
            before = server.stats()
            run = fio(sock, "randread", args, ("--time_based", f"--runtime={args.seconds}"))
            after = server.stats()
            rss = server.rss()
            server.stop()
            reads[percent].append({
                "cache_bytes": size,
                "iops": run["jobs"][0]["read"]["iops"],
                "hits": after["map_cache_hits"] - before["map_cache_hits"],
                "misses": after["map_cache_misses"] - before["map_cache_misses"],
                "rss_bytes": rss,
            })
        for percent in reads:
            for r, run in enumerate(reads[percent]):
                run["ratio"] = run["iops"] / reads[100][r]["iops"]
        result["reads"] = reads
    return reads, map_bytes


def report(result, reads, map_bytes, cache):
    mib = 1 << 20
    if "fill_seconds" not in result:
        print_reads(reads, map_bytes)
        print(json.dumps(result))
        return
    print(f"fill: {result['fill_mapped_blocks']} blocks in {result['fill_seconds']:.0f} s; "
          f"RSS {result['fill_rss_bytes'] / mib:.1f} MiB (cache {cache / mib:.0f} MiB + 64 MiB: "
          f"{'within' if result['rss_within_cache_plus_64m'] else 'OVER'}); "
          f"map {result['fill_map_memory_bytes'] / mib:.1f} MiB, leaves in RAM "
          f"{result['fill_map_resident_bytes'] / mib:.1f} MiB")
    print(f"kill -9, restart in {result['recovery_seconds']:.2f} s, {result['verified_blocks']} blocks "
          f"verified in {result['verify_seconds']:.0f} s, RSS {result['verify_rss_bytes'] / mib:.1f} MiB")
    print_reads(reads, map_bytes)
    print(json.dumps(result))


def print_reads(reads, map_bytes):
    mib = 1 << 20
    print(f"map {map_bytes / mib:.1f} MiB; 4 KiB random reads by map cache:")
    print(f"{'cache':>8} {'MiB':>8} {'round':>5} {'IOPS':>10} {'ratio':>6} {'hits':>10} {'misses':>10}")
    for percent, runs in reads.items():
        for n, r in enumerate(runs):
            print(f"{percent:>7}% {min(r['cache_bytes'], map_bytes) / mib:>8.1f} {n + 1:>5} "
                  f"{r['iops']:>10.0f} {r['ratio']:>6.2f} {r['hits']:>10} {r['misses']:>10}")
        ratios = sorted(r["ratio"] for r in runs)
        print(f"{percent:>7}% median ratio {ratios[len(ratios) // 2]:.2f}")


if __name__ == "__main__":
    main()
