#!/usr/bin/python3
"""zdisk against its peers, in one run on tmpfs: nbdkit's memory plugin (no
compression: the protocol's ceiling on this machine), zdisk with each codec,
and btrfs with compress-force=zstd:1 on a loop file, over the same corpus of
OS files.

For each it measures, best of --rounds rounds:
- write MB/s: nbdcopy of the corpus into the export (btrfs: cp + sync);
- 4 KiB random read MB/s: fio's nbd engine, QD16 x 2 jobs (btrfs: fio psync
  on the file, 2 jobs, after dropping the page cache: not the same client,
  so shown for information only);
- 1 MiB sequential read MB/s: fio's nbd engine, QD8 x 2 jobs, each job
  reading its half of the corpus three times;
- stored bytes and ratio: zdisk's stored_bytes and compression_ratio,
  btrfs's disk usage from compsize;
- server CPU: cores the server used on average during the write;
- for zdisk, after the reads: the idle pass (the cold-data recompression
  that starts after 5 s without requests, on data not read for 60 s) is
  left to finish (up to --idle-limit seconds), and stored bytes, ratio
  and both reads are measured again: what reading cold data back costs.
Ratios are against nbdkit memory and against btrfs from the same run.
A codec may name a unit size: lz4@16K creates the image with --unit-max 16K.
--before BIN adds rows for an older zdisk binary (plain codecs, no idle
pass), so that a change's before and after come from one run.

Needs root (loop mount), nbdkit, nbdcopy, fio, btrfs-progs, btrfs-compsize.
Usage: peers.py --zdisk BIN [--dir /dev/shm/peers] [--corpus-mib 512]
       [--codecs lz4,zstd,zstd@8K] [--rounds 2] [--idle-limit 240] [--json FILE] [--skip-btrfs]
       [--before OLD_BIN [--before-codecs lz4,zstd]]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request


def run(args, **kwargs):
    return subprocess.run(args, check=True, capture_output=True, text=True, **kwargs)


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def wait_socket(path, proc):
    deadline = time.time() + 60
    while not os.path.exists(path):
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"server did not start: {path}")
        time.sleep(0.05)


def fio_read_mb_s(args):
    out = run(["fio", "--numjobs=2", "--group_reporting", "--output-format=json"] + args).stdout
    # fio's nbd engine prints a line before its JSON.
    result = json.loads(out[out.index("{"):])
    return result["jobs"][0]["read"]["bw_bytes"] / 1e6


def fio_randread(uri=None, filename=None, size=None):
    args = ["--name=rr", "--rw=randread", "--bs=4k", "--time_based", "--runtime=8"]
    if uri:
        args += ["--ioengine=nbd", f"--uri={uri}", "--iodepth=16", f"--size={size}"]
    else:
        args += ["--ioengine=psync", f"--filename={filename}", "--iodepth=1"]
    return fio_read_mb_s(args)


def fio_seqread(uri, size):
    """1 MiB sequential reads, QD8 x 2 jobs, each job reading its half
    three times."""
    half = size // 2
    return fio_read_mb_s(["--name=sr", "--rw=read", "--bs=1M", "--ioengine=nbd", f"--uri={uri}",
                          "--iodepth=8", f"--size={half}", f"--offset_increment={half}",
                          "--loops=3"])


class Export:
    """An NBD server on a Unix socket, measured while it runs."""

    def __init__(self, args, sock):
        self.sock = sock
        if os.path.exists(sock):
            os.remove(sock)  # left by an earlier run: it must not look ready
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_socket(sock, self.proc)
        self.uri = f"nbd+unix:///?socket={sock}"

    def measure(self, corpus, corpus_bytes, export_bytes):
        cpu0, t0 = cpu_seconds(self.proc.pid), time.time()
        run(["nbdcopy", corpus, self.uri])
        t1 = time.time()
        cores = (cpu_seconds(self.proc.pid) - cpu0) / (t1 - t0)
        seqread = fio_seqread(self.uri, corpus_bytes)
        randread = fio_randread(uri=self.uri, size=corpus_bytes)
        return {"write_mb_s": corpus_bytes / (t1 - t0) / 1e6,
                "seq_read_mb_s": seqread,
                "randread_4k_mb_s": randread, "server_cores": cores}

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=120)


def nbdkit_round(work, corpus, corpus_bytes, export_bytes):
    sock = os.path.join(work, "nbdkit.sock")
    server = Export(["nbdkit", "--foreground", "-U", sock, "memory", str(export_bytes)], sock)
    try:
        return server.measure(corpus, corpus_bytes, export_bytes)
    finally:
        server.stop()


METRICS = "127.0.0.1:19187"


def served_stats():
    with urllib.request.urlopen(f"http://{METRICS}/stats", timeout=10) as reply:
        return json.load(reply)


def zdisk_round(zdisk, work, spec, corpus, corpus_bytes, export_bytes, idle_limit, before=False):
    codec, _, unit = spec.partition("@")
    name = f"zdisk-{'before-' if before else ''}{spec.replace(':', '-').replace('@', '-')}"
    image = os.path.join(work, f"{name}.zdisk")
    sock = os.path.join(work, "zdisk.sock")
    for path in (image, sock):
        if os.path.exists(path):
            os.remove(path)
    create = [zdisk, "create", image, "--logical", str(export_bytes), "--codec", codec]
    if unit:
        create += ["--unit-max", unit]
    run(create)
    server = Export([zdisk, "serve", image, "--socket", sock, "--metrics", METRICS], sock)
    try:
        result = server.measure(corpus, corpus_bytes, export_bytes)
        stats = served_stats()
        result.update(stored_bytes=stats["stored_bytes"], ratio=stats["compression_ratio"])
        if before:
            return result  # an older zdisk: no idle pass to wait for
        # The idle pass: wait until what it rewrote stops changing.
        t0 = time.time()
        last = None
        while time.time() - t0 < idle_limit:
            time.sleep(5)
            stats = served_stats()
            now = (stats["recompressed_bytes"], stats["stored_bytes"])
            if stats["recompressed_bytes"] > 0 and now == last:
                break
            last = now
        result.update(idle_seconds=time.time() - t0,
                      stored_idle_bytes=stats["stored_bytes"],
                      ratio_idle=stats["compression_ratio"],
                      randread_4k_idle_mb_s=fio_randread(uri=server.uri, size=corpus_bytes),
                      seq_read_idle_mb_s=fio_seqread(server.uri, corpus_bytes))
    finally:
        server.stop()
    os.remove(image)
    return result


def btrfs_round(work, corpus, corpus_bytes):
    loop_file = os.path.join(work, "btrfs.img")
    mount = os.path.join(work, "btrfs")
    os.makedirs(mount, exist_ok=True)
    with open(loop_file, "wb") as f:
        f.truncate(max(2 * corpus_bytes, 1 << 30))
    device = run(["losetup", "-f", "--show", loop_file]).stdout.strip()
    try:
        run(["mkfs.btrfs", "-q", "-f", device])
        run(["mount", "-o", "compress-force=zstd:1", device, mount])
        try:
            target = os.path.join(mount, "corpus.tar")
            t0 = time.time()
            run(["cp", corpus, target])
            run(["sync", "-f", target])
            t1 = time.time()
            usage = run(["compsize", "-b", target]).stdout
            disk = None
            for line in usage.splitlines():
                if line.startswith("TOTAL"):
                    disk = int(line.split()[2])
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            t2 = time.time()
            run(["dd", f"if={target}", "of=/dev/null", "bs=1M"])
            t3 = time.time()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            randread = fio_randread(filename=target)
            return {"write_mb_s": corpus_bytes / (t1 - t0) / 1e6,
                    "seq_read_mb_s": corpus_bytes / (t3 - t2) / 1e6,
                    "randread_4k_mb_s": randread, "stored_bytes": disk,
                    "ratio": corpus_bytes / disk if disk else None, "server_cores": None}
        finally:
            run(["umount", mount])
    finally:
        run(["losetup", "-d", device])
        os.remove(loop_file)


def print_table(header, body):
    table = [header] + body
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for index, r in enumerate(table):
        print("  " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if index == 0:
            print("  " + "-" * (sum(widths) + 2 * (len(widths) - 1)))


def best(rounds):
    """Best of the rounds: highest speeds; sizes are the same each round."""
    out = dict(rounds[0])
    for key in ("write_mb_s", "seq_read_mb_s", "randread_4k_mb_s", "randread_4k_idle_mb_s",
                "seq_read_idle_mb_s"):
        if key not in out:
            continue
        out[key] = max(r[key] for r in rounds)
        out[key + "_rounds"] = [round(r[key], 1) for r in rounds]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zdisk", required=True)
    parser.add_argument("--dir", default="/dev/shm/peers")
    parser.add_argument("--corpus-mib", type=int, default=512)
    parser.add_argument("--corpus", help="use this file instead of a tar of /usr")
    parser.add_argument("--codecs", default="lz4,zstd")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--idle-limit", type=float, default=240,
                        help="seconds to wait for zdisk's idle pass to finish")
    parser.add_argument("--before", metavar="BIN",
                        help="an older zdisk to measure in the same run (no idle pass)")
    parser.add_argument("--before-codecs", default="lz4,zstd")
    parser.add_argument("--json")
    parser.add_argument("--skip-btrfs", action="store_true")
    args = parser.parse_args()
    for tool in ["nbdkit", "nbdcopy", "fio"] + ([] if args.skip_btrfs else ["mkfs.btrfs", "compsize", "losetup"]):
        if shutil.which(tool) is None:
            sys.exit(f"peers.py: {tool} is not installed")
    if not args.skip_btrfs and os.geteuid() != 0:
        sys.exit("peers.py: the btrfs comparison needs root (loop mount); or pass --skip-btrfs")

    os.makedirs(args.dir, exist_ok=True)
    corpus = args.corpus or os.path.join(args.dir, "corpus.tar")
    if not args.corpus:
        with open(corpus, "wb") as out:
            tar = subprocess.Popen(["tar", "cf", "-", "/usr"], stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL)
            remaining = args.corpus_mib << 20
            while remaining:
                chunk = tar.stdout.read(min(remaining, 1 << 20))
                if not chunk:
                    break
                out.write(chunk)
                remaining -= len(chunk)
            tar.kill()
            tar.wait()
    elif os.path.dirname(os.path.abspath(corpus)) != os.path.abspath(args.dir):
        # On tmpfs with the rest: a corpus in the page cache of a disk
        # file can be evicted while a peer sits idle (this host's DAMON
        # reclaim took 90 MB of it within a minute), and then the next
        # peer's copy would wait for the disk.
        copy = os.path.join(args.dir, "corpus.tar")
        shutil.copyfile(corpus, copy)
        corpus = copy
    corpus_bytes = os.path.getsize(corpus)
    export_bytes = (corpus_bytes + (64 << 20)) // (1 << 20) * (1 << 20)
    print(f"corpus: {corpus} ({corpus_bytes / (1 << 20):.0f} MiB); rounds: {args.rounds}", flush=True)

    rows = {}
    plan = [("nbdkit memory", lambda: nbdkit_round(args.dir, corpus, corpus_bytes, export_bytes))]
    for codec in args.codecs.split(","):
        plan.append((f"zdisk {codec}", lambda c=codec: zdisk_round(
            args.zdisk, args.dir, c, corpus, corpus_bytes, export_bytes, args.idle_limit)))
    for codec in (args.before_codecs.split(",") if args.before else []):
        plan.append((f"before: zdisk {codec}", lambda c=codec: zdisk_round(
            args.before, args.dir, c, corpus, corpus_bytes, export_bytes, 0, before=True)))
    if not args.skip_btrfs:
        plan.append(("btrfs compress-force=zstd:1", lambda: btrfs_round(args.dir, corpus, corpus_bytes)))
    results = {name: [] for name, _ in plan}
    # Interleaved rounds, so drift on a noisy host falls on every peer alike.
    for round_index in range(args.rounds):
        for name, measure in plan:
            results[name].append(measure())
            print(f"  round {round_index + 1}: {name}: "
                  f"write {results[name][-1]['write_mb_s']:.0f} MB/s", flush=True)
    for name, _ in plan:
        rows[name] = best(results[name])

    base = rows["nbdkit memory"]
    btrfs = rows.get("btrfs compress-force=zstd:1")
    def ratio(row, key, against, against_key=None):
        value, reference = row.get(key), (against or {}).get(against_key or key)
        return f"{value / reference:.2f}" if value and reference else "-"

    def mib(value):
        return f"{value / (1 << 20):.0f}" if value else "-"

    print("fresh: right after the copy")
    print_table(
        ["", "write MB/s", "x nbdkit", "x btrfs", "4K rand read MB/s", "x nbdkit",
         "1M seq read MB/s", "x nbdkit", "stored MiB", "x btrfs", "ratio", "server cores"],
        [[name, f"{row['write_mb_s']:.0f}", ratio(row, "write_mb_s", base),
          ratio(row, "write_mb_s", btrfs),
          f"{row['randread_4k_mb_s']:.0f}", ratio(row, "randread_4k_mb_s", base),
          f"{row['seq_read_mb_s']:.0f}", ratio(row, "seq_read_mb_s", base),
          mib(row.get("stored_bytes")), ratio(row, "stored_bytes", btrfs),
          f"{row['ratio']:.2f}" if row.get("ratio") else "-",
          f"{row['server_cores']:.2f}" if row.get("server_cores") is not None else "-"]
         for name, row in rows.items()])
    idle_rows = [(name, row) for name, row in rows.items() if "stored_idle_bytes" in row]
    if idle_rows:
        print("after the idle pass (zdisk only; reads against fresh nbdkit memory)")
        print_table(
            ["", "idle s", "stored MiB", "x btrfs", "ratio", "4K rand read MB/s", "x nbdkit",
             "1M seq read MB/s", "x nbdkit"],
            [[name, f"{row['idle_seconds']:.0f}", mib(row["stored_idle_bytes"]),
              ratio(row, "stored_idle_bytes", btrfs, "stored_bytes"),
              f"{row['ratio_idle']:.2f}" if row.get("ratio_idle") else "-",
              f"{row['randread_4k_idle_mb_s']:.0f}",
              ratio(row, "randread_4k_idle_mb_s", base, "randread_4k_mb_s"),
              f"{row['seq_read_idle_mb_s']:.0f}",
              ratio(row, "seq_read_idle_mb_s", base, "seq_read_mb_s")]
             for name, row in idle_rows])
    print("btrfs reads go through the kernel (fio psync on the file, page cache dropped), "
          "not through NBD: compare them with care.")
    if args.json:
        with open(args.json, "w") as f:
            for name, row in rows.items():
                f.write(json.dumps(dict(row, peer=name, corpus_bytes=corpus_bytes)) + "\n")


if __name__ == "__main__":
    main()
