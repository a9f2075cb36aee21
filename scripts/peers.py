#!/usr/bin/python3
"""zdisk against what a user would pick instead, in one run on tmpfs.

nbdkit's memory plugin (no compression: the protocol's ceiling on this
machine), zdisk with each codec, optionally an older zdisk (--before), and
btrfs with compress-force=zstd:1 on a loop file, over the same corpus of
OS files: the first 512 MiB of a tar of /usr/share/doc,
/usr/lib/x86_64-linux-gnu and /usr/bin (issue #27's reference workload).
For each, best of --rounds interleaved rounds:
- write MB/s: nbdcopy of the corpus into the export (btrfs: cp + sync);
- 4 KiB random read MB/s: fio's nbd engine, QD16 x 2 jobs, 8 s (btrfs: fio
  psync on the file, 2 jobs, after dropping the page cache: not the same
  client, so shown for information only);
- 1 MiB sequential read MB/s: fio's nbd engine, QD8 x 2 jobs, each job
  reading its half of the corpus three times;
- stored bytes and ratio: zdisk's stored_bytes and compression_ratio,
  btrfs's disk usage from compsize;
- server cores: CPU the server used on average during the write;
- for zdisk, media bytes per host byte (media_write_bytes over
  host_write_bytes) right after the copy and after the idle pass, and the
  bytes written at fast effort (host_write_fast_bytes);
- for zdisk, after the reads: the idle pass (the cold-data recompression
  that starts after 5 s without requests, on data not read for 60 s) is
  left to finish (up to --idle-limit seconds; 0 skips it), and stored
  bytes, ratio and both reads are measured again: what reading cold data
  back costs.
Ratios are against nbdkit memory and against btrfs from the same run.
A codec may name a unit size: lz4@16K creates the image with --unit-max 16K;
and a write effort: lz4/full serves with --write-effort full (the default
is adaptive).
--before BIN adds rows for an older zdisk binary (plain codecs, no idle
pass), so that a change's before and after come from one run.
Tables, then one JSON object per peer (also written to --json FILE).

Needs nbdkit, nbdcopy, fio; the btrfs row needs root (loop mount),
btrfs-progs and btrfs-compsize (or pass --skip-btrfs).

  --quick   a 32 MiB corpus, one round, lz4 adaptive and full, no idle pass (seconds)
"""

import os
import shutil
import time
import types

import harness


def fio_randread(uri=None, filename=None, size=None, seconds=8):
    args = ["--numjobs=2", "--group_reporting", "--time_based", f"--runtime={seconds}"]
    if uri:
        run = harness.fio(uri, "rr", "randread", "4k", f"--size={size}", *args)
    else:
        run = harness.fio(None, "rr", "randread", "4k", "--ioengine=psync", f"--filename={filename}",
                          *args, iodepth=1)
    return harness.fio_job(run)["bw_bytes"] / 1e6


def fio_seqread(uri, size, loops):
    half = size // 2 // harness.MIB * harness.MIB
    run = harness.fio(uri, "sr", "read", "1M", "--numjobs=2", "--group_reporting",
                      f"--size={half}", f"--offset_increment={half}", f"--loops={loops}",
                      iodepth=8)
    return harness.fio_job(run)["bw_bytes"] / 1e6


def measure(server, ctx):
    cpu0, t0 = server.cpu_seconds(), time.monotonic()
    harness.nbdcopy(ctx.corpus, server.uri)
    seconds = time.monotonic() - t0
    cores = (server.cpu_seconds() - cpu0) / seconds
    return {"write_mb_s": ctx.corpus_bytes / seconds / 1e6,
            "seq_read_mb_s": fio_seqread(server.uri, ctx.corpus_bytes, ctx.loops),
            "randread_4k_mb_s": fio_randread(uri=server.uri, size=ctx.corpus_bytes,
                                             seconds=ctx.read_seconds),
            "server_cores": cores}


def nbdkit_round(ctx):
    with harness.Teardown() as teardown:
        server = harness.Nbdkit(teardown, os.path.join(ctx.work, "nbdkit.sock"), ctx.export_bytes)
        return measure(server, ctx)


def media_per_host(stats):
    return stats["media_write_bytes"] / stats["host_write_bytes"]


def zdisk_round(ctx, zdisk, spec, before=False):
    spec_codec, _, effort = spec.partition("/")
    codec, _, unit = spec_codec.partition("@")
    label = spec.replace(':', '-').replace('@', '-').replace('/', '-')
    name = f"zdisk-{'before-' if before else ''}{label}"
    image = os.path.join(ctx.work, f"{name}.zdisk")
    words = ["--logical", ctx.export_bytes, "--codec", codec, "--force"]
    harness.zdisk_create(zdisk, image, *words, *(["--unit-max", unit] if unit else []))
    with harness.Teardown() as teardown:
        teardown.push(f"remove {image}", lambda: os.remove(image))
        flags = ["--write-effort", effort] if effort else []
        server = harness.Server(teardown, zdisk, image, os.path.join(ctx.work, "zdisk.sock"),
                                flags=flags)
        result = measure(server, ctx)
        stats = server.stats()
        result.update(stored_bytes=stats["stored_bytes"], ratio=stats["compression_ratio"],
                      media_per_host=media_per_host(stats),
                      fast_bytes=stats.get("host_write_fast_bytes", 0))
        if not before and ctx.idle_limit > 0:
            # The idle pass: wait until what it rewrote stops changing.
            t0 = time.monotonic()
            last = None
            while time.monotonic() - t0 < ctx.idle_limit:
                time.sleep(5)
                stats = server.stats()
                now = (stats["recompressed_bytes"], stats["stored_bytes"])
                if stats["recompressed_bytes"] > 0 and now == last:
                    break
                last = now
            result.update(idle_seconds=time.monotonic() - t0,
                          stored_idle_bytes=stats["stored_bytes"],
                          media_per_host_idle=media_per_host(stats),
                          ratio_idle=stats["compression_ratio"],
                          randread_4k_idle_mb_s=fio_randread(uri=server.uri, size=ctx.corpus_bytes,
                                                             seconds=ctx.read_seconds),
                          seq_read_idle_mb_s=fio_seqread(server.uri, ctx.corpus_bytes, ctx.loops))
        server.stop()
    return result


def btrfs_round(ctx):
    with harness.Teardown() as teardown:
        mount = harness.btrfs_mount(teardown, ctx.work, max(2 * ctx.corpus_bytes, 1 << 30))
        target = os.path.join(mount, "corpus.tar")
        t0 = time.monotonic()
        harness.run(["cp", ctx.corpus, target])
        harness.run(["sync", "-f", target])
        t1 = time.monotonic()
        disk = None
        for line in harness.run(["compsize", "-b", target]).stdout.splitlines():
            if line.startswith("TOTAL"):
                disk = int(line.split()[2])
        drop_caches()
        t2 = time.monotonic()
        harness.run(["dd", f"if={target}", "of=/dev/null", "bs=1M"])
        t3 = time.monotonic()
        drop_caches()
        randread = fio_randread(filename=target, seconds=ctx.read_seconds)
    return {"write_mb_s": ctx.corpus_bytes / (t1 - t0) / 1e6,
            "seq_read_mb_s": ctx.corpus_bytes / (t3 - t2) / 1e6,
            "randread_4k_mb_s": randread, "stored_bytes": disk,
            "ratio": ctx.corpus_bytes / disk if disk else None, "server_cores": None}


def drop_caches():
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def best(rounds):
    """Best of the rounds: highest speeds; sizes are the same each round."""
    out = dict(rounds[0])
    for key in ("write_mb_s", "seq_read_mb_s", "randread_4k_mb_s", "randread_4k_idle_mb_s",
                "seq_read_idle_mb_s"):
        if key in out:
            out[key] = max(r[key] for r in rounds)
            out[key + "_rounds"] = [round(r[key], 1) for r in rounds]
    return out


def report(rows):
    base = rows["nbdkit memory"]
    btrfs = rows.get("btrfs compress-force=zstd:1")

    def ratio(row, key, against, against_key=None):
        value, reference = row.get(key), (against or {}).get(against_key or key)
        return f"{value / reference:.2f}" if value and reference else "-"

    def mib(value):
        return f"{value / (1 << 20):.0f}" if value else "-"

    def fraction(value, of):
        return f"{value / of:.2f}" if value is not None and of else "-"

    print("fresh: right after the copy (fast: share of the data written at fast effort)")
    harness.print_table(
        ["", "write MB/s", "x nbdkit", "x btrfs", "4K rand read MB/s", "x nbdkit",
         "1M seq read MB/s", "x nbdkit", "stored MiB", "x btrfs", "ratio", "server cores",
         "fast", "media/host"],
        [[name, f"{row['write_mb_s']:.0f}", ratio(row, "write_mb_s", base),
          ratio(row, "write_mb_s", btrfs),
          f"{row['randread_4k_mb_s']:.0f}", ratio(row, "randread_4k_mb_s", base),
          f"{row['seq_read_mb_s']:.0f}", ratio(row, "seq_read_mb_s", base),
          mib(row.get("stored_bytes")), ratio(row, "stored_bytes", btrfs),
          f"{row['ratio']:.2f}" if row.get("ratio") else "-",
          f"{row['server_cores']:.2f}" if row.get("server_cores") is not None else "-",
          fraction(row.get("fast_bytes"), row.get("corpus_bytes")),
          f"{row['media_per_host']:.3f}" if row.get("media_per_host") else "-"]
         for name, row in rows.items()])
    idle_rows = [(name, row) for name, row in rows.items() if "stored_idle_bytes" in row]
    if idle_rows:
        print("after the idle pass (zdisk only; reads against fresh nbdkit memory)")
        harness.print_table(
            ["", "idle s", "stored MiB", "x btrfs", "ratio", "4K rand read MB/s", "x nbdkit",
             "1M seq read MB/s", "x nbdkit", "media/host"],
            [[name, f"{row['idle_seconds']:.0f}", mib(row["stored_idle_bytes"]),
              ratio(row, "stored_idle_bytes", btrfs, "stored_bytes"),
              f"{row['ratio_idle']:.2f}" if row.get("ratio_idle") else "-",
              f"{row['randread_4k_idle_mb_s']:.0f}",
              ratio(row, "randread_4k_idle_mb_s", base, "randread_4k_mb_s"),
              f"{row['seq_read_idle_mb_s']:.0f}",
              ratio(row, "seq_read_idle_mb_s", base, "seq_read_mb_s"),
              f"{row['media_per_host_idle']:.3f}"]
             for name, row in idle_rows])
    if btrfs:
        print("btrfs reads go through the kernel (fio psync on the file, page cache dropped), "
              "not through NBD: compare them with care.")


def body():
    parser = harness.parser(__doc__)
    harness.add_zdisk(parser)
    parser.add_argument("--dir", help="work directory, on tmpfs (default: a new directory in "
                                      "/dev/shm, removed at the end)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--corpus-mib", type=harness.positive)
    parser.add_argument("--corpus", help="use this file instead of a tar of /usr")
    parser.add_argument("--codecs")
    parser.add_argument("--rounds", type=harness.positive)
    parser.add_argument("--idle-limit", type=float,
                        help="seconds to wait for zdisk's idle pass to finish (default 240; "
                             "0 skips it)")
    parser.add_argument("--before", metavar="BIN",
                        help="an older zdisk to measure in the same run (no idle pass)")
    parser.add_argument("--before-codecs", default="lz4,zstd")
    parser.add_argument("--json", help="also append one JSON line per peer to this file")
    parser.add_argument("--skip-btrfs", action="store_true")
    args = parser.parse_args()
    zdisk = harness.zdisk_binary(args.zdisk)
    before = harness.zdisk_binary(args.before) if args.before else None
    harness.require_tools("nbdkit", "nbdcopy", "fio")
    if not args.skip_btrfs:
        harness.require_tools("mkfs.btrfs", "compsize", "losetup")
        harness.require_root("the btrfs comparison mounts a loop device; or pass --skip-btrfs")
    ctx = types.SimpleNamespace()
    ctx.idle_limit = args.idle_limit if args.idle_limit is not None else (0 if args.quick else 240)
    ctx.loops = 1 if args.quick else 3
    ctx.read_seconds = 2 if args.quick else 8
    rounds = args.rounds or (1 if args.quick else 2)
    codecs = (args.codecs or ("lz4,lz4/full" if args.quick else "lz4,lz4/full,zstd,zstd/full")).split(",")
    with harness.Teardown() as teardown:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        ctx.work = harness.workdir(teardown, args.dir, "peers.", base)
        size = (args.corpus_mib or (32 if args.quick else 512)) * harness.MIB
        ctx.corpus = harness.corpus(args.corpus, size, ctx.work, harness.REFERENCE_TREES)
        if os.path.dirname(ctx.corpus) != ctx.work:
            # On tmpfs with the rest: a corpus in a disk file's page cache
            # can be evicted while a peer sits idle, and then the next
            # peer's copy would wait for the disk.
            copy = os.path.join(ctx.work, "corpus.tar")
            shutil.copyfile(ctx.corpus, copy)
            ctx.corpus = copy
        ctx.corpus_bytes = os.path.getsize(ctx.corpus)
        ctx.export_bytes = (ctx.corpus_bytes + (64 << 20)) // harness.MIB * harness.MIB
        print(f"corpus: {ctx.corpus_bytes / harness.MIB:.0f} MiB; rounds: {rounds}", flush=True)
        plan = [("nbdkit memory", lambda: nbdkit_round(ctx))]
        for codec in codecs:
            plan.append((f"zdisk {codec}", lambda c=codec: zdisk_round(ctx, zdisk, c)))
        for codec in (args.before_codecs.split(",") if before else []):
            plan.append((f"before: zdisk {codec}",
                         lambda c=codec: zdisk_round(ctx, before, c, before=True)))
        if not args.skip_btrfs:
            plan.append(("btrfs compress-force=zstd:1", lambda: btrfs_round(ctx)))
        results = {name: [] for name, _ in plan}
        # Interleaved rounds, so drift on a noisy host falls on every peer alike.
        for round_index in range(rounds):
            for name, run in plan:
                results[name].append(run())
                print(f"  round {round_index + 1}: {name}: "
                      f"write {results[name][-1]['write_mb_s']:.0f} MB/s", flush=True)
    rows = {name: dict(best(results[name]), corpus_bytes=ctx.corpus_bytes) for name, _ in plan}
    report(rows)
    for name, row in rows.items():
        harness.emit_json(dict(row, peer=name, corpus_bytes=ctx.corpus_bytes), args.json)


if __name__ == "__main__":
    harness.main("peers.py", body)
