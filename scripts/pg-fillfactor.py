#!/usr/bin/python3
"""PostgreSQL fillfactor on zdisk against a plain export (case study 3).

For each fillfactor (100, 90, 75, 50 by default), on a fresh volume each
time: ext4 on the export through nbdfuse and a loop device (README,
"Connecting clients"), `pgbench -i -s SCALE -F FF`, a CHECKPOINT, then a
timed TPC-B-like run (`pgbench -T SECONDS -c CLIENTS`), another
CHECKPOINT, and the sizes. The same runs go to `nbdkit file` on a sparse
file, the non-compressing baseline ("baseline": true; --no-baseline
skips it). With --fillfactors 100 --no-baseline it is one pgbench run on
ext4 on zdisk, with what zdisk wrote for it.

Sizes are taken twice, after the load ("load_*") and after the timed run
(the unprefixed keys), each time after a CHECKPOINT and a syncfs, so that
what PostgreSQL holds in its buffers has reached the export:
- db_bytes: pg_database_size of the pgbench database;
- mapped_bytes: zdisk's mapped_bytes (logical bytes holding data, zeros
  excluded); on the baseline, the file's allocated 4 KiB blocks that are
  not all zeros (the same definition, counted by reading the file);
- physical_bytes: zdisk's stored_bytes (live compressed extents, record
  headers included: what the drive must keep); on the baseline, the
  file's allocated bytes (st_blocks);
- physical_used_bytes: zdisk's physical_used_bytes (metadata plus every
  written segment in use, dead data not yet cleaned included); on the
  baseline, the allocated bytes again;
- compression_ratio: mapped_bytes / physical_bytes.
For the timed run: tps and latency_ms (pgbench's), transactions,
hot_update_share (HOT updates / updates of pgbench_accounts: free space in
a page is what makes an update HOT), wal_bytes, and on zdisk what it
wrote: run_host_write_bytes, run_media_write_bytes, run_padding_bytes
(flush padding), run_staging_bytes, run_flushes, media_bytes_per_txn,
host_bytes_per_txn, padding_share and staging_share (of media bytes).
--breakdown (zdisk runs) adds "breakdown", the file, non-zero and LZ4
bytes of the WAL, the pgbench database and the rest of the cluster, and
"accounts_pages", the free space in pgbench_accounts' pages and how much
of it is not zeros.

By default each configuration runs alone on a volume torn down before the
next. --rounds N keeps them all up and takes the timed run in N rounds in
turn (round_tps lists them), so that the host's drift weighs on all alike;
zdisk then serves with --recompress off (unless --recompress says
otherwise), so that idle volumes do not recompress while others are
measured.

One JSON object per run on stdout as it finishes and in --json FILE, then
a table. Everything a run creates (servers, FUSE mounts, loop devices,
mounts, the PostgreSQL cluster, images, its directory under --dir) is torn
down in reverse order, also on Ctrl-C, SIGTERM and SIGHUP.

  --quick   scale 5 (an 83 MB database at FF=100), 10 s runs, 4 GiB
            volumes: about two minutes for all eight runs
  default   scale 100 (a 1.5 GB database at FF=100: the accounts table is
            ten times PostgreSQL's default shared_buffers, so updates go to
            pages that must be written back), 180 s runs, 16 GiB volumes:
            about 30 minutes

Needs root (losetup, mount), /dev/fuse, loop devices, nbdfuse and
fusermount3 (fuse3, libnbd-bin), nbdkit, e2fsprogs, util-linux and
PostgreSQL's server and client (Debian: postgresql). --dir (default: a new
directory in /var/tmp, removed at the end) must be a disk filesystem with
sparse files: 16 GiB volumes do not fit in most machines' tmpfs.
"""

import argparse
import json
import os
import pwd
import subprocess
import tempfile
import time

import harness

UNIT = 8192
ZERO_BLOCK = bytes(harness.BLOCK)
BLOCK = harness.BLOCK


def pg_bin(name):
    """A PostgreSQL program from the newest installed version."""
    base = "/usr/lib/postgresql"
    versions = os.listdir(base) if os.path.isdir(base) else []
    versions.sort(key=lambda v: [int(p) for p in v.split(".") if p.isdigit()])
    for version in reversed(versions):
        path = os.path.join(base, version, "bin", name)
        if os.path.exists(path):
            return path
    raise harness.Missing(f"PostgreSQL's {name} (apt-get install postgresql)")


def as_postgres(args):
    return harness.run(["runuser", "-u", "postgres", "--"] + args)


def parse_pgbench(text):
    out = {}
    for line in text.splitlines():
        if line.startswith("number of transactions actually processed:"):
            out["transactions"] = int(line.split(":")[1].split("/")[0])
        elif line.startswith("latency average ="):
            out["latency_ms"] = float(line.split("=")[1].split()[0])
        elif line.startswith("tps =") and "tps" not in out:
            out["tps"] = float(line.split("=")[1].split()[0])
    return out


def lz4_unit_bytes():
    """A function giving the LZ4 size of a buffer, through the liblz4 zdisk
    itself uses; zero buffers count 0 (zdisk stores no data for them)."""
    import ctypes
    lib = ctypes.CDLL("liblz4.so.1")
    lib.LZ4_compress_default.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                         ctypes.c_int]
    bound = lib.LZ4_compressBound(UNIT)
    out = ctypes.create_string_buffer(bound)
    zero = bytes(UNIT)

    def size(chunk):
        if chunk == zero[:len(chunk)]:
            return 0
        return lib.LZ4_compress_default(chunk, out, len(chunk), bound)
    return size


def breakdown(data, db_oid):
    """Where the bytes are, by part of the cluster: file bytes, bytes in
    4 KiB blocks that are not zeros, and the LZ4 size of their 8 KiB units
    (zdisk's default unit; the volume adds record headers and ext4's own
    metadata and journal, which are no file). Diagnostic: --breakdown."""
    compressed = lz4_unit_bytes()
    parts = {}
    for root, _dirs, files in os.walk(data):
        rel = os.path.relpath(root, data)
        part = ("wal" if rel.startswith("pg_wal") else
                "bench" if rel == os.path.join("base", db_oid) else "other")
        sums = parts.setdefault(part, {"file_bytes": 0, "nonzero_bytes": 0, "lz4_bytes": 0})
        for name in files:
            path = os.path.join(root, name)
            if not os.path.isfile(path) or os.path.islink(path):
                continue
            with open(path, "rb") as f:
                while True:
                    chunk = f.read(UNIT)
                    if not chunk:
                        break
                    sums["file_bytes"] += len(chunk)
                    for i in range(0, len(chunk), BLOCK):
                        if chunk[i:i + BLOCK] != ZERO_BLOCK[:len(chunk[i:i + BLOCK])]:
                            sums["nonzero_bytes"] += min(BLOCK, len(chunk) - i)
                    sums["lz4_bytes"] += compressed(chunk)
    return parts


def free_space(relation_path):
    """Bytes between pd_lower and pd_upper (a heap page's free space) over
    every page of a relation, and how many of them are not zero: PostgreSQL
    zeroes a page when it creates it, but compacting a page after pruning
    leaves old tuple bytes there."""
    free = nonzero = pages = 0
    segment = 0
    while True:
        path = relation_path + (f".{segment}" if segment else "")
        if not os.path.exists(path):
            break
        with open(path, "rb") as f:
            while True:
                page = f.read(UNIT)
                if len(page) < UNIT:
                    break
                pages += 1
                lower = int.from_bytes(page[12:14], "little")
                upper = int.from_bytes(page[14:16], "little")
                if 24 <= lower <= upper <= UNIT:
                    gap = page[lower:upper]
                    free += len(gap)
                    nonzero += len(gap) - gap.count(0)
        segment += 1
    return {"pages": pages, "free_bytes": free, "free_nonzero_bytes": nonzero}


def allocated_bytes(path):
    return os.stat(path).st_blocks * 512


def nonzero_bytes(path):
    """Bytes in 4 KiB blocks of the file's data extents that are not all
    zeros: what zdisk would count as mapped."""
    total = 0
    with open(path, "rb") as f:
        fd = f.fileno()
        end = os.fstat(fd).st_size
        offset = 0
        while offset < end:
            try:
                data = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError:
                break  # no data after offset
            hole = os.lseek(fd, data, os.SEEK_HOLE)
            start = data - data % BLOCK
            f.seek(start)
            remaining = hole - start
            while remaining > 0:
                chunk = f.read(min(remaining, 1 << 20))
                if not chunk:
                    break
                remaining -= len(chunk)
                view = memoryview(chunk)
                for i in range(0, len(chunk), BLOCK):
                    block = view[i:i + BLOCK]
                    if block != ZERO_BLOCK[:len(block)]:
                        total += BLOCK
            offset = hole
    return total


class Postgres:
    """A cluster in DATA run by the postgres user, on a Unix socket only."""

    def __init__(self, teardown, data, sockdir, options):
        port = harness.free_port()
        self.data, self.conn = data, ["-h", sockdir, "-p", str(port)]
        as_postgres([pg_bin("initdb"), "-D", data, "--no-sync"])
        settings = "".join(f" -c {option}" for option in options)
        as_postgres([pg_bin("pg_ctl"), "-D", data, "-w", "-t", "120",
                     "-l", os.path.join(sockdir, "postgres.log"), "start",
                     "-o", f"-k {sockdir} -p {port} -c listen_addresses=''{settings}"])
        teardown.push("PostgreSQL", self.stop)

    def tool(self, name, args):
        return as_postgres([pg_bin(name)] + self.conn + args)

    def sql(self, query, db="bench"):
        return self.tool("psql", ["-X", "-At", "-v", "ON_ERROR_STOP=1", "-c", query, db]).stdout.strip()

    def stop(self):
        ctl = [pg_bin("pg_ctl"), "-D", self.data, "-w", "-t", "120"]
        try:
            as_postgres(ctl + ["-m", "fast", "stop"])
        except subprocess.CalledProcessError:
            as_postgres(ctl + ["-m", "immediate", "stop"])


class Run:
    """One configuration: an export (zdisk or the plain file), ext4 on it
    through nbdfuse and a loop device, a PostgreSQL cluster on that, and
    pgbench's database. Everything is pushed onto `teardown` as it is made."""

    def __init__(self, args, user, baseline, fillfactor, teardown):
        self.args = args
        label = f"{'baseline' if baseline else 'zdisk'}-ff{fillfactor}"
        work = tempfile.mkdtemp(prefix=f"{label}-", dir=args.dir)
        teardown.push("scratch directory", lambda: harness.run(["rm", "-rf", "--one-file-system",
                                                                work]))
        os.chmod(work, 0o755)  # the postgres user walks through it to its data
        sock = os.path.join(work, "nbd.sock")
        self.result = {"label": label, "baseline": baseline, "fillfactor": fillfactor,
                       "codec": None if baseline else args.codec,
                       "recompress": None if baseline else (args.recompress or "default"),
                       "scale": args.scale, "clients": args.clients, "seconds": args.seconds,
                       "rounds": args.rounds, "logical": args.logical,
                       "pg_options": args.pg_option}
        self.server = None
        if baseline:
            self.backing = os.path.join(work, "plain.img")
            harness.run(["truncate", "-s", args.logical, self.backing])
            nbdkit = subprocess.Popen(["nbdkit", "--foreground", "--exit-with-parent", "-U", sock,
                                       "file", self.backing], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True)
            teardown.push("nbdkit", lambda: harness.stop_process(nbdkit, seconds=60))
            harness.wait_for(lambda: os.path.exists(sock) or nbdkit.poll() is not None, "nbdkit")
            if nbdkit.poll() is not None:
                raise harness.Failure(f"nbdkit exited with {nbdkit.returncode}")
            uri = f"nbd+unix:///?socket={sock}"
        else:
            self.backing = os.path.join(work, "pg.zdisk")
            harness.zdisk_create(args.zdisk, self.backing, "--logical", args.logical,
                                 "--codec", args.codec)
            flags = ["--recompress", args.recompress] if args.recompress else []
            self.server = harness.Server(teardown, args.zdisk, self.backing, sock, flags)
            uri = self.server.uri
        fs = harness.Ext4OnExport(teardown, uri, work, mkfs_options=args.mkfs_options.split(),
                                  mount_options=args.mount_options)
        self.fs = fs
        self.mnt = fs.mnt
        data = os.path.join(self.mnt, "pgdata")
        sockdir = os.path.join(work, "pgsock")
        for d in (data, sockdir):
            os.makedirs(d)
            os.chown(d, user.pw_uid, user.pw_gid)
        self.db = Postgres(teardown, data, sockdir, args.pg_option)
        self.db.tool("createdb", ["bench"])
        self.rounds = []

    def stats(self):
        return self.server.stats() if self.server else {}

    def sizes(self):
        # Taken after the load and after the timed run: a filesystem the
        # kernel made read-only on an I/O error has figures that mean
        # nothing, whatever PostgreSQL and pgbench said.
        if self.fs.read_only():
            raise harness.Failure(f"{self.result['label']}: ext4 on the export went read-only "
                                  "after an I/O error (see dmesg)")
        # The baseline holds the same files: its breakdown would repeat zdisk's.
        return sizes(self.db, self.mnt, self.server, self.backing,
                     self.args.breakdown and self.server is not None)

    def load(self):
        """pgbench -i, then the sizes, then the counters the timed run starts from."""
        started = time.monotonic()
        self.db.tool("pgbench", ["-i", "-q", "-s", str(self.args.scale),
                                 "-F", str(self.result["fillfactor"]), "bench"])
        self.result["load_seconds"] = round(time.monotonic() - started, 1)
        self.result.update({f"load_{k}": v for k, v in self.sizes().items()})
        self.before = self.stats()
        self.wal_start = self.db.sql("select pg_current_wal_lsn()")
        self.updates_start = table_updates(self.db)

    def bench(self, seconds):
        out = self.db.tool("pgbench", ["-T", str(seconds), "-c", str(self.args.clients),
                                       "-j", str(self.args.jobs), "bench"])
        self.rounds.append(parse_pgbench(out.stdout))

    def finish(self):
        """Totals of the timed rounds, then the sizes after them."""
        r = self.result
        r["transactions"] = sum(x["transactions"] for x in self.rounds)
        r["tps"] = sum(x["tps"] for x in self.rounds) / len(self.rounds)
        r["latency_ms"] = (sum(x["latency_ms"] * x["transactions"] for x in self.rounds)
                           / max(r["transactions"], 1))
        if len(self.rounds) > 1:
            r["round_tps"] = [round(x["tps"], 1) for x in self.rounds]
        r["wal_bytes"] = int(float(self.db.sql(
            f"select pg_wal_lsn_diff(pg_current_wal_lsn(), '{self.wal_start}')")))
        upd, hot = (end - start for end, start in zip(table_updates(self.db), self.updates_start))
        r["hot_update_share"] = hot / upd if upd else None
        after = self.stats()
        if self.server:
            def delta(key):
                return after.get(key, 0) - self.before.get(key, 0)
            txns = max(r["transactions"], 1)
            media = delta("media_write_bytes")
            r.update(run_host_write_bytes=delta("host_write_bytes"), run_media_write_bytes=media,
                     run_padding_bytes=delta("padding_bytes"),
                     run_staging_bytes=delta("staging_bytes"),
                     run_flushes=after["counters"]["flushes"] - self.before["counters"]["flushes"],
                     media_bytes_per_txn=media / txns,
                     host_bytes_per_txn=delta("host_write_bytes") / txns,
                     padding_share=delta("padding_bytes") / media if media else None,
                     staging_share=delta("staging_bytes") / media if media else None)
        r.update(self.sizes())
        return r


def sequential(args, user, configs, emit):
    """Each configuration alone, on a volume torn down before the next."""
    for baseline, ff in configs:
        with harness.Teardown() as teardown:
            progress(f"{'baseline' if baseline else 'zdisk'} FF={ff}: load and {args.seconds} s")
            run = Run(args, user, baseline, ff, teardown)
            run.load()
            run.bench(args.seconds)
            emit(run.finish())


def interleaved(args, user, configs, emit):
    """Every configuration loaded and kept up at once, then the timed run
    cut into rounds taken in turn (the order rotating), so that the host's
    drift and the other work on it weigh on every configuration alike."""
    with harness.Teardown() as teardown:
        runs = []
        for baseline, ff in configs:
            progress(f"{'baseline' if baseline else 'zdisk'} FF={ff}: load")
            runs.append(Run(args, user, baseline, ff, teardown))
            runs[-1].load()
        seconds = max(1, args.seconds // args.rounds)
        for round_index in range(args.rounds):
            progress(f"round {round_index + 1} of {args.rounds}: {seconds} s each")
            shift = round_index % len(runs)
            for run in runs[shift:] + runs[:shift]:
                run.bench(seconds)
        for run in runs:
            emit(run.finish())


def progress(text):
    harness.progress("pg-fillfactor.py", text)


def table_updates(db):
    row = db.sql("select n_tup_upd, n_tup_hot_upd from pg_stat_user_tables "
                 "where relname = 'pgbench_accounts'")
    upd, hot = row.split("|")
    return int(upd), int(hot)


def sizes(db, mnt, server, backing, parts=False):
    """Sizes once PostgreSQL's dirty buffers and ext4's are on the export."""
    db.sql("CHECKPOINT")
    harness.run(["sync", "-f", mnt])
    out = {"db_bytes": int(db.sql("select pg_database_size('bench')")),
           "wal_dir_bytes": dir_bytes(os.path.join(db.data, "pg_wal"))}
    if parts:
        oid = db.sql("select oid from pg_database where datname = 'bench'")
        out["breakdown"] = breakdown(db.data, oid)
        relation = db.sql("select pg_relation_filepath('pgbench_accounts')")
        out["accounts_pages"] = free_space(os.path.join(db.data, relation))
    if server:
        s = server.stats()
        out.update(mapped_bytes=s["mapped_bytes"], physical_bytes=s["stored_bytes"],
                   stored_bytes=s["stored_bytes"], physical_used_bytes=s["physical_used_bytes"],
                   zero_bytes=s["zero_bytes"], image_allocated_bytes=allocated_bytes(backing),
                   recompressed_bytes=s.get("recompressed_bytes", 0))
    else:
        allocated = allocated_bytes(backing)
        out.update(mapped_bytes=nonzero_bytes(backing), physical_bytes=allocated,
                   physical_used_bytes=allocated)
    out["compression_ratio"] = (out["mapped_bytes"] / out["physical_bytes"]
                                if out["physical_bytes"] else None)
    return out


def dir_bytes(path):
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


def mib(n):
    return f"{n / 2**20:9.1f}" if n is not None else "        -"


def summary(results):
    print("\nbackend   FF   db MiB  mapped MiB  physical MiB  phys-used MiB  ratio     TPS  lat ms  HOT%")
    for r in results:
        hot = r.get("hot_update_share")
        print(f"{'baseline' if r['baseline'] else 'zdisk':8} {r['fillfactor']:3} {mib(r['db_bytes'])}"
              f"   {mib(r['mapped_bytes'])}     {mib(r['physical_bytes'])}      "
              f"{mib(r['physical_used_bytes'])}  {r['compression_ratio']:5.2f} {r.get('tps', 0):7.1f}"
              f"  {r.get('latency_ms', 0):6.2f}  {100 * hot if hot is not None else 0:4.0f}")
    for baseline in (False, True):
        by_ff = {r["fillfactor"]: r for r in results if r["baseline"] == baseline}
        if 100 in by_ff and 50 in by_ff:
            lo, hi = by_ff[100], by_ff[50]
            name = "baseline" if baseline else "zdisk"
            print(f"{name}: FF=50 / FF=100: db {hi['db_bytes'] / lo['db_bytes']:.2f}x, "
                  f"physical {hi['physical_bytes'] / lo['physical_bytes']:.2f}x, "
                  f"physical used {hi['physical_used_bytes'] / lo['physical_used_bytes']:.2f}x "
                  f"(after load: db {hi['load_db_bytes'] / lo['load_db_bytes']:.2f}x, "
                  f"physical {hi['load_physical_bytes'] / lo['load_physical_bytes']:.2f}x)")


def fillfactor_list(text):
    """PostgreSQL accepts a table fillfactor from 10 to 100 (percent)."""
    values = []
    for part in text.split(","):
        try:
            value = int(part)
        except ValueError:
            value = 0
        if not 10 <= value <= 100:
            raise argparse.ArgumentTypeError(
                f"{part!r} in {text!r} is not a fillfactor (a whole number from 10 to 100)")
        values.append(value)
    return values


def prerequisites(args):
    harness.require_root("it creates loop devices and mounts ext4")
    for path in ("/dev/fuse", "/dev/loop-control"):
        if not os.path.exists(path):
            raise harness.Missing(path)
    harness.require_tools("nbdfuse", "fusermount3", "losetup", "mkfs.ext4", "mount", "umount",
                          "runuser", "truncate", "sync", *([] if args.no_baseline else ["nbdkit"]))
    for tool in ("initdb", "pg_ctl", "postgres", "createdb", "psql", "pgbench"):
        pg_bin(tool)
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        raise harness.Missing("the postgres user (apt-get install postgresql)") from None


def body():
    parser = harness.parser(__doc__)
    harness.add_zdisk(parser)
    parser.add_argument("--dir", help="where the per-run scratch directories go")
    parser.add_argument("--json", help="also write each run's JSON line to this file")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--scale", type=harness.positive)
    parser.add_argument("--seconds", type=harness.positive)
    parser.add_argument("--clients", type=harness.positive, default=4)
    parser.add_argument("--jobs", type=harness.positive, default=2)
    parser.add_argument("--logical")
    parser.add_argument("--codec", default="lz4")
    parser.add_argument("--fillfactors", type=fillfactor_list, default="100,90,75,50")
    parser.add_argument("--mkfs-options", default="-E nodiscard")
    parser.add_argument("--mount-options", default="")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--rounds", type=harness.positive, default=1,
                        help="keep every configuration up at once and cut the timed run "
                             "into this many rounds taken in turn")
    parser.add_argument("--recompress", help="zdisk serve --recompress MODE")
    parser.add_argument("--pg-option", action="append", default=[], metavar="NAME=VALUE",
                        help="a PostgreSQL setting for every cluster (repeatable), "
                             "e.g. synchronous_commit=off")
    parser.add_argument("--breakdown", action="store_true",
                        help="also report file, non-zero and LZ4 bytes of the WAL, the "
                             "pgbench database and the rest of the cluster")
    args = parser.parse_args()
    args.scale = args.scale or (5 if args.quick else 100)
    args.seconds = args.seconds or (10 if args.quick else 180)
    args.logical = args.logical or ("4G" if args.quick else "16G")
    if args.rounds > 1 and args.recompress is None:
        args.recompress = "off"
    args.zdisk = harness.zdisk_binary(args.zdisk)
    user = prerequisites(args)
    results = []
    out = open(args.json, "w") if args.json else None

    def emit(result):
        results.append(result)
        print(json.dumps(result), flush=True)
        if out:
            out.write(json.dumps(result) + "\n")
            out.flush()

    configs = [(baseline, ff) for ff in args.fillfactors
               for baseline in ([False] if args.no_baseline else [False, True])]
    try:
        with harness.Teardown() as teardown:
            args.dir = harness.workdir(teardown, args.dir, "pg-fillfactor.", "/var/tmp")
            os.chmod(args.dir, 0o755)  # the postgres user walks through it to its data
            (interleaved if args.rounds > 1 else sequential)(args, user, configs, emit)
    finally:
        if out:
            out.close()
    summary(results)


if __name__ == "__main__":
    harness.main("pg-fillfactor.py", body)
