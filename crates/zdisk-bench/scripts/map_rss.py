#!/usr/bin/python3
"""RAM per mapped block of a zdisk server, as its RSS shows it.

Two fills of 1 GiB each on a fresh image (1 TiB logical, 4 GiB physical by
default), served on a Unix socket and written by fio's nbd engine:
  sparse      random 4 KiB writes over the whole volume (262,144 blocks
              almost all in chunks of their own);
  sequential  1 GiB written in order (dense data).
Each fill runs in four parts. The server's VmRSS and the stats'
mapped_bytes are read before the fill and after each part, and reported
as RSS growth per mapped block over the whole fill (growth / blocks) and
over the last three parts (what further blocks cost, without the fixed
costs the first requests bring: threads' stacks and arenas, buffers,
codecs). Both include what the allocator keeps of transient buffers (a
checkpoint's dump, requests' payloads), which comes in jumps of a few
MiB. map_memory_bytes (the map's own count of its heap bytes, allocator
overhead included) is printed too, per mapped block.

The idle pass is off (--recompress off, and --idle-compact off on builds
that have idle compaction) so that nothing runs between the
fill and the reading. Needs fio with the nbd engine.
Usage: map_rss.py [--zdisk BIN] [--dir DIR] [--logical 1T] [--physical 4G]
                  [--fill 1G] [--only sparse|sequential]
One JSON object per fill on its own line after the table.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pg_on_zdisk import free_port, wait_for  # noqa: E402  (map_cache.py takes them from here too)

BLOCK = 4096
PARTS = 4


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def stats(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=30) as r:
        return json.load(r)


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def fio(sock, name, rw, offset, size, io_size, bs):
    args = [
        "fio", f"--name={name}", "--ioengine=nbd",
        f"--uri=nbd+unix:///?socket={sock}", f"--rw={rw}", f"--bs={bs}",
        f"--offset={offset}", f"--size={size}", f"--io_size={io_size}",
        "--iodepth=16", "--norandommap", "--randrepeat=0",
        "--output-format=json",
    ]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out[out.index("{"):])


def measure(args, fill, workdir):
    image = os.path.join(workdir, f"{fill}.zdisk")
    sock = os.path.join(workdir, f"{fill}.sock")
    subprocess.run(
        [args.zdisk, "create", image, "--logical", args.logical, "--physical", args.physical, "--force"],
        check=True, capture_output=True, text=True,
    )
    port = free_port()
    idle = ["--recompress", "off"]
    help_text = subprocess.run([args.zdisk, "serve", "--help"], capture_output=True, text=True)
    if "--idle-compact" in help_text.stdout + help_text.stderr:
        idle += ["--idle-compact", "off"]
    server = subprocess.Popen(
        [args.zdisk, "serve", image, "--socket", sock, "--metrics", f"127.0.0.1:{port}"] + idle,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_for(lambda: os.path.exists(sock), "the socket")
        wait_for(lambda: _answers(port), "the metrics endpoint")
        time.sleep(0.5)
        points = [(rss_bytes(server.pid), stats(port))]
        fill_bytes = parse_size(args.fill)
        logical = parse_size(args.logical)
        part_bytes = fill_bytes // PARTS
        for part in range(PARTS):
            if fill == "sparse":
                fio(sock, fill, "randwrite", 0, logical, part_bytes, "4k")
            else:
                fio(sock, fill, "write", part * part_bytes, part_bytes, part_bytes, "128k")
            points.append((rss_bytes(server.pid), stats(port)))
    finally:
        server.terminate()
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        for path in (image, sock):
            if os.path.exists(path):
                os.remove(path)
    mapped = [p[1]["mapped_bytes"] // BLOCK for p in points]
    rss = [p[0] for p in points]
    result = {
        "fill": fill,
        "zdisk": args.zdisk,
        "mapped_blocks": mapped[-1] - mapped[0],
        "rss_before_bytes": rss[0],
        "rss_after_bytes": rss[-1],
        "rss_growth_bytes": rss[-1] - rss[0],
        "rss_by_part_bytes": rss,
        "bytes_per_block": (rss[-1] - rss[0]) / max(1, mapped[-1] - mapped[0]),
        "later_bytes_per_block": (rss[-1] - rss[1]) / max(1, mapped[-1] - mapped[1]),
        "map_memory_bytes": points[-1][1].get("map_memory_bytes"),
    }
    result["map_bytes_per_block"] = (result["map_memory_bytes"] or 0) / max(1, mapped[-1])
    return result


def _answers(port):
    try:
        stats(port)
        return True
    except OSError:
        return False


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zdisk", default="target/release/zdisk")
    parser.add_argument("--dir", default=None, help="where the images go (a temporary directory by default)")
    parser.add_argument("--logical", default="1T")
    parser.add_argument("--physical", default="4G")
    parser.add_argument("--fill", default="1G")
    parser.add_argument("--only", choices=["sparse", "sequential"])
    args = parser.parse_args()
    if shutil.which("fio") is None:
        sys.exit("map_rss.py: fio is needed")
    workdir = args.dir or tempfile.mkdtemp(prefix="map_rss.")
    os.makedirs(workdir, exist_ok=True)
    fills = [args.only] if args.only else ["sparse", "sequential"]
    results = [measure(args, fill, workdir) for fill in fills]
    if args.dir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"{'fill':<11} {'blocks':>9} {'RSS growth':>12} {'B/block':>8} {'last 3/4':>9} {'map B/block':>12}")
    for r in results:
        print(
            f"{r['fill']:<11} {r['mapped_blocks']:>9} {r['rss_growth_bytes'] / 2**20:>10.1f} M "
            f"{r['bytes_per_block']:>8.1f} {r['later_bytes_per_block']:>9.1f} {r['map_bytes_per_block']:>12.1f}"
        )
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
