#!/usr/bin/python3
"""The table-less hash store (zdisk kv) against RocksDB on ext4, both on
zdisk volumes of the same kind, with the same YCSB-style driver: load,
then workloads A, B, C, F and D (400 B pairs, zipfian keys, the same
number of pairs and client threads). Case study 2 in docs/case-studies.md.

  kv           the store on a zdisk export, through its own NBD client
  rocksdb-lz4  RocksDB (LZ4) on ext4 on zdisk: nbdfuse, loop, mkfs.ext4
  rocksdb-none RocksDB without compression, same stack

Each engine gets a fresh zdisk image (lz4 codec) served with --metrics;
after every phase the driver (`zdisk kv ycsb`) flushes (RocksDB: its
memtable; then sync and fstrim for ext4) and reads zdisk's /stats. One
JSON object per phase per engine is appended to --json FILE: engine,
workload, ops_per_s, p50_us, p99_us, p999_us, cpu_us_per_op (client +
zdisk + nbdfuse processes), rss_bytes (the driver with its engine),
server_rss_bytes (zdisk), mapped_bytes, stored_bytes, physical_bytes (=
stored_bytes: live compressed extents), physical_used_bytes (with garbage
not yet cleaned). Then the case study's tables, as Markdown.

  --tables FILE  print the tables from an earlier run's JSON lines and stop
  --quick        300 000 pairs, 10 s per workload (a few minutes in all)
  default        5 000 000 pairs, 60 s per workload

Needs root, fuse3 (nbdfuse), util-linux, e2fsprogs, and RocksDB's shared
library (Debian: apt-get install rocksdb-tools). Builds nothing: run
`cargo build --release` first.
"""

import json
import os
import subprocess

import harness

ENGINES = ["kv", "rocksdb-lz4", "rocksdb-none"]
WORKLOADS = ["load", "A", "B", "C", "F", "D"]


def run_engine(args, zdisk, engine, work, records, seconds):
    with harness.Teardown() as teardown:
        work = os.path.join(work, engine)
        os.makedirs(work, exist_ok=True)
        teardown.push(f"remove {work}", lambda: harness.run(["rm", "-rf", "--one-file-system", work]))
        image = os.path.join(work, "vol.zdisk")
        # The store's slots (~0.9 KB a pair at half fill, with room for D's
        # inserts) or RocksDB's files with room to compact, plus slack.
        logical_gib = (records * 2048 >> 30) + 2
        harness.zdisk_create(zdisk, image, "--logical", f"{logical_gib}G", "--codec", "lz4")
        server = harness.Server(teardown, zdisk, image, os.path.join(work, "nbd.sock"))
        common = [zdisk, "kv", "ycsb", "--records", str(records), "--seconds", str(seconds),
                  "--threads", str(args.threads), "--metrics", server.address,
                  "--json", args.json, "--label", "quick" if args.quick else "full",
                  "--watch-pid", str(server.pid)]
        harness.progress("kv-vs-rocksdb.py", f"{engine}: {records} pairs, {seconds} s per "
                                             f"workload, {args.threads} threads")
        with harness.Teardown() as filesystem:
            if engine == "kv":
                command = common + ["--engine", "kv", "--device", server.uri]
            else:
                # Direct I/O from the loop device to the FUSE file: no second
                # page cache under ext4 that would serve reads the store must fetch.
                fs = harness.Ext4OnExport(
                    filesystem, server.uri, work, direct_io=True,
                    mkfs_options=("-E", "nodiscard,lazy_itable_init=0,lazy_journal_init=0"))
                command = common + ["--engine", "rocksdb", "--db", os.path.join(fs.mnt, "db"),
                                    "--compression", engine.removeprefix("rocksdb-"),
                                    "--watch-pid", str(fs.fuse.pid),
                                    "--settle-cmd", f"sync; fstrim {fs.mnt}"]
            done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
            print(done.stdout, end="", flush=True)
            if done.returncode != 0:
                raise harness.Failure(f"zdisk kv ycsb ({engine}) failed with {done.returncode}")
        # The filesystem is unmounted and nbdfuse gone: the server stops cleanly.
        server.stop()


def tables(rows):
    """The tables of docs/case-studies.md section 2, as Markdown; a cell
    whose engine or workload did not run shows a dash."""
    engines = [e for e in ENGINES if any(r["engine"] == e for r in rows)]

    def get(engine, workload, key):
        for r in rows:
            if r["engine"] == engine and r["workload"] == workload:
                return r.get(key)
        return None

    def num(x, digits=0):
        return "–" if x is None else f"{x:,.{digits}f}".replace(",", " ")

    def div(a, b, digits=2, suffix="×"):
        return "–" if a is None or not b else f"{a / b:.{digits}f}{suffix}"

    def header(first, columns):
        return [f"| {first} | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]

    lines = header("workload", [f"{e} ops/s" for e in engines] + ["kv ÷ rocksdb-lz4"])
    for w in WORKLOADS:
        lines.append(f"| {w} | " + " | ".join(num(get(e, w, "ops_per_s")) for e in engines)
                     + f" | {div(get('kv', w, 'ops_per_s'), get('rocksdb-lz4', w, 'ops_per_s'))} |")
    lines.append("")
    lines += header("workload", [f"{e} p99 / p99.9 µs" for e in engines])
    for w in WORKLOADS:
        lines.append(f"| {w} | " + " | ".join(
            f"{num(get(e, w, 'p99_us'))} / {num(get(e, w, 'p999_us'))}" for e in engines) + " |")
    lines.append("")
    lines += header("workload", [f"{e} CPU µs/op (client + zdisk{'' if e == 'kv' else ', nbdfuse'})"
                                 for e in engines])
    for w in WORKLOADS:
        lines.append(f"| {w} | " + " | ".join(
            f"{num(get(e, w, 'cpu_us_per_op'), 1)} ({num(get(e, w, 'client_cpu_us_per_op'), 1)}"
            f" + {num(get(e, w, 'server_cpu_us_per_op'), 1)})" for e in engines) + " |")
    lines.append("")
    lines += header("after", engines + ["kv ÷ rocksdb-lz4"])
    mb = lambda x: None if x is None else x / 1e6  # noqa: E731
    for w in ["load", "D"]:
        for key, name in [("logical_bytes", "logical (store's slots / RocksDB's files)"),
                          ("mapped_bytes", "zdisk mapped"),
                          ("stored_bytes", "zdisk stored (physical)"),
                          ("physical_used_bytes", "zdisk physical used, garbage included")]:
            lines.append(f"| {w}: {name} MB | " + " | ".join(num(mb(get(e, w, key)), 1)
                                                              for e in engines)
                         + f" | {div(get('kv', w, key), get('rocksdb-lz4', w, key))} |")
    for key, name in [("rss_bytes", "driver RSS"), ("server_rss_bytes", "zdisk serve RSS")]:
        largest = [max((get(e, w, key) or 0 for w in WORKLOADS), default=0) for e in engines]
        lines.append(f"| {name}, largest MB | " + " | ".join(num(x / 1e6, 1) for x in largest)
                     + " | |")
    lines.append("")
    lines += header("bytes written per operation, host / media", engines)
    cells = []
    for e in engines:
        ops = get(e, "load", "operations")
        host, media = get(e, "load", "host_write_bytes"), get(e, "load", "media_write_bytes")
        cells.append(f"{num(host / ops if ops and host is not None else None)} / "
                     f"{num(media / ops if ops and media is not None else None)}")
    lines.append("| load (per pair) | " + " | ".join(cells) + " |")
    cells = []
    for e in engines:
        try:
            writes = (sum(get(e, w, "operations") - get(e, w, "reads") for w in ["A", "B", "D"])
                      + get(e, "F", "operations") / 2)
            host = (get(e, "D", "host_write_bytes") - get(e, "load", "host_write_bytes")) / writes
            media = (get(e, "D", "media_write_bytes") - get(e, "load", "media_write_bytes")) / writes
            cells.append(f"{num(host)} / {num(media)}")
        except TypeError:  # a workload did not run
            cells.append("–")
    lines.append("| A, B, C, F, D together (per update or insert) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def read_rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def body():
    parser = harness.parser(__doc__)
    harness.add_zdisk(parser)
    parser.add_argument("--tables", metavar="FILE")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", help="where the JSON lines go (required to run)")
    parser.add_argument("--records", type=harness.positive)
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--threads", type=harness.positive, default=2)
    parser.add_argument("--dir", help="where the images go (default: a new directory in /dev/shm)")
    parser.add_argument("--engines", default=" ".join(ENGINES),
                        help=f"a space-separated subset of: {' '.join(ENGINES)}")
    args = parser.parse_args()
    if args.tables:
        print(tables(read_rows(args.tables)))
        return 0
    if not args.json:
        parser.error("--json FILE is required (or --tables FILE)")
    engines = args.engines.split()
    for engine in engines:
        if engine not in ENGINES:
            parser.error(f"unknown engine {engine!r} (one of {', '.join(ENGINES)})")
    records = args.records or (300_000 if args.quick else 5_000_000)
    seconds = args.seconds or (10 if args.quick else 60)
    zdisk = harness.zdisk_binary(args.zdisk)
    harness.require_root("losetup, mount")
    harness.require_tools("nbdfuse", "fusermount3", "losetup", "mkfs.ext4", "fstrim")
    args.json = os.path.abspath(args.json)
    open(args.json, "w").close()
    with harness.Teardown() as teardown:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        work = harness.workdir(teardown, args.dir, "kv-vs-rocksdb.", base)
        for engine in engines:
            run_engine(args, zdisk, engine, work, records, seconds)
    print(tables(read_rows(args.json)))
    harness.progress("kv-vs-rocksdb.py", f"results: {args.json}")


if __name__ == "__main__":
    harness.main("kv-vs-rocksdb.py", body)
