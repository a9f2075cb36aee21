#!/usr/bin/python3
"""PostgreSQL fillfactor on zdisk against a plain export (issue #13 part 3).

For each fillfactor, on a fresh volume each time: ext4 on the export
through nbdfuse and a loop device (README, "Connecting clients"),
`pgbench -i -s SCALE -F FF`, a CHECKPOINT, then a timed TPC-B-like run
(`pgbench -T SECONDS -c CLIENTS`), another CHECKPOINT, and the sizes.
The same runs go to `nbdkit file` on a sparse file, the non-compressing
baseline. pg-fillfactor.sh checks prerequisites and runs this.

Sizes are taken twice, after the load ("load_*") and after the timed run
(the unprefixed keys): each time after a CHECKPOINT and a syncfs, so that
what PostgreSQL holds in its buffers has reached the export.

- db_bytes: pg_database_size of the pgbench database.
- mapped_bytes: zdisk's mapped_bytes (logical bytes holding data, zeros
  excluded); on the baseline, the file's allocated 4 KiB blocks that are
  not all zeros (the same definition, counted by reading the file).
- physical_bytes: zdisk's stored_bytes (live compressed extents, record
  headers included: what the drive must keep); on the baseline, the
  file's allocated bytes (st_blocks).
- physical_used_bytes: zdisk's physical_used_bytes (metadata plus every
  written segment in use, dead data not yet cleaned included); on the
  baseline, the allocated bytes again.
- compression_ratio: mapped_bytes / physical_bytes.
- tps, latency_ms: pgbench's, for the timed run.
- hot_update_share: HOT updates / updates of pgbench_accounts in the run,
  the mechanism by which free space in a page speeds updates.
- wal_bytes: WAL the timed run generated.
- with --breakdown (zdisk runs): "breakdown", the file, non-zero and LZ4
  bytes of the WAL, the pgbench database and the rest of the cluster, and
  "accounts_pages", the free space in pgbench_accounts' pages and how much
  of it is not zeros.

By default each configuration runs alone on a volume torn down before the
next. --rounds N keeps them all up and takes the timed run in N rounds in
turn (round_tps lists them), so that the host's drift weighs on all alike.

One JSON object per run on stdout as it finishes and in --json FILE.
Everything a run creates is torn down in reverse order, also on Ctrl-C,
SIGTERM and SIGHUP, and its directory is removed.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pg_on_zdisk as pg  # noqa: E402  (run, Stack, pg_bin, as_postgres, stats, ...)

BLOCK = 4096
UNIT = 8192
ZERO_BLOCK = bytes(BLOCK)


class Interrupted(Exception):
    pass


def on_signal(number, _frame):
    raise Interrupted(signal.Signals(number).name)


PENDING = []


def patient(number, _frame):
    PENDING.append(signal.Signals(number).name)
    print(f"pg-fillfactor: {signal.Signals(number).name} received; cleaning up first",
          file=sys.stderr, flush=True)


def detached(args, **kwargs):
    """A command in its own session: a Ctrl-C at the terminal reaches this
    script, which then tears down in order, and never the server or
    nbdfuse underneath a mounted filesystem."""
    return pg.run(args, start_new_session=True, **kwargs)


def spawn(args, log):
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


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
    def __init__(self, data, sockdir, port):
        self.data, self.port = data, port
        self.conn = ["-h", sockdir, "-p", str(port)]

    def tool(self, name, args, **kwargs):
        return pg.as_postgres([pg.pg_bin(name)] + self.conn + args, start_new_session=True, **kwargs)

    def sql(self, query, db="bench"):
        return self.tool("psql", ["-X", "-At", "-v", "ON_ERROR_STOP=1", "-c", query, db]).stdout.strip()

    def stop(self):
        ctl = [pg.pg_bin("pg_ctl"), "-D", self.data, "-w", "-t", "120"]
        try:
            pg.as_postgres(ctl + ["-m", "fast", "stop"], start_new_session=True)
        except subprocess.CalledProcessError:
            pg.as_postgres(ctl + ["-m", "immediate", "stop"], start_new_session=True)


class Run:
    """One configuration: an export (zdisk or the plain file), ext4 on it
    through nbdfuse and a loop device, a PostgreSQL cluster on that, and
    pgbench's database. Everything is pushed onto `stack` as it is made."""

    def __init__(self, args, user, baseline, fillfactor, stack):
        self.args = args
        label = f"{'baseline' if baseline else 'zdisk'}-ff{fillfactor}"
        work = tempfile.mkdtemp(prefix=f"{label}-", dir=args.dir)
        stack.push("scratch directory", lambda: pg.run(["rm", "-rf", "--one-file-system", work]))
        os.chmod(work, 0o755)  # the postgres user walks through it to its data
        sock = os.path.join(work, "nbd.sock")
        raw = os.path.join(work, "nbd.raw")
        self.mnt = os.path.join(work, "mnt")
        os.makedirs(self.mnt)
        log = open(os.path.join(work, "servers.log"), "wb")
        stack.push("server log", log.close)
        self.result = {"label": label, "baseline": baseline, "fillfactor": fillfactor,
                       "codec": None if baseline else args.codec,
                       "recompress": None if baseline else (args.recompress or "default"),
                       "scale": args.scale, "clients": args.clients, "seconds": args.seconds,
                       "rounds": args.rounds, "logical": args.logical,
                       "pg_options": args.pg_option}
        self.metrics = None
        if baseline:
            self.backing = os.path.join(work, "plain.img")
            detached(["truncate", "-s", args.logical, self.backing])
            server = spawn(["nbdkit", "--foreground", "--exit-with-parent", "-U", sock,
                            "file", self.backing], log)
        else:
            self.backing = os.path.join(work, "pg.zdisk")
            detached([args.zdisk, "create", self.backing, "--logical", args.logical,
                      "--codec", args.codec])
            self.metrics = f"127.0.0.1:{pg.free_port()}"
            extra = ["--recompress", args.recompress] if args.recompress else []
            server = spawn([args.zdisk, "serve", self.backing, "--socket", sock,
                            "--metrics", self.metrics] + extra, log)
        stack.push("NBD server", lambda: (server.terminate(), server.wait(timeout=300)))
        pg.wait_for(lambda: os.path.exists(sock) or server.poll() is not None, "the NBD server")
        if server.poll() is not None:
            raise RuntimeError(f"the NBD server exited ({server.returncode}); see {work}/servers.log")
        if self.metrics:
            pg.wait_for(lambda: try_stats(self.metrics) is not None, "zdisk's /stats")
        open(raw, "w").close()
        fuse = spawn(["nbdfuse", raw, f"nbd+unix:///?socket={sock}"], log)
        stack.push("nbdfuse", lambda: (detached(["fusermount3", "-u", raw]), fuse.wait(timeout=60)))
        # losetup before nbdfuse gives the file its size would see 0 bytes.
        pg.wait_for(lambda: os.path.getsize(raw) > 0, "nbdfuse to size its file")
        loop = detached(["losetup", "-f", "--show", raw]).stdout.strip()
        stack.push("loop device", lambda: detached(["losetup", "-d", loop]))
        detached(["mkfs.ext4", "-q"] + args.mkfs_options.split() + [loop])
        mount = ["mount"] + (["-o", args.mount_options] if args.mount_options else [])
        detached(mount + [loop, self.mnt])
        stack.push("mount", lambda: detached(["umount", self.mnt]))

        data = os.path.join(self.mnt, "pgdata")
        sockdir = os.path.join(work, "pgsock")
        for d in (data, sockdir):
            os.makedirs(d)
            os.chown(d, user.pw_uid, user.pw_gid)
        pg.as_postgres([pg.pg_bin("initdb"), "-D", data, "--no-sync"], start_new_session=True)
        port = pg.free_port()
        options = "".join(f" -c {option}" for option in args.pg_option)
        pg.as_postgres([pg.pg_bin("pg_ctl"), "-D", data, "-w", "-t", "120",
                        "-l", os.path.join(sockdir, "postgres.log"), "start",
                        "-o", f"-k {sockdir} -p {port} -c listen_addresses=''{options}"],
                       start_new_session=True)
        self.db = Postgres(data, sockdir, port)
        stack.push("PostgreSQL", self.db.stop)
        self.db.tool("createdb", ["bench"])
        self.rounds = []

    def sizes(self):
        # The baseline holds the same files: its breakdown would repeat zdisk's.
        return sizes(self.db, self.mnt, self.metrics, self.backing,
                     self.args.breakdown and self.metrics is not None)

    def load(self):
        """pgbench -i, then the sizes, then the counters the timed run starts from."""
        started = time.monotonic()
        self.db.tool("pgbench", ["-i", "-q", "-s", str(self.args.scale),
                                 "-F", str(self.result["fillfactor"]), "bench"])
        self.result["load_seconds"] = round(time.monotonic() - started, 1)
        self.result.update({f"load_{k}": v for k, v in self.sizes().items()})
        self.before = pg.stats(self.metrics)
        self.wal_start = self.db.sql("select pg_current_wal_lsn()")
        self.updates_start = table_updates(self.db)

    def bench(self, seconds):
        out = self.db.tool("pgbench", ["-T", str(seconds), "-c", str(self.args.clients),
                                       "-j", str(self.args.jobs), "bench"])
        self.rounds.append(pg.parse_pgbench(out.stdout))

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
        r.update(self.sizes())
        if self.metrics:
            after = pg.stats(self.metrics)
            for key in ("host_write_bytes", "media_write_bytes"):
                r[f"run_{key}"] = after[key] - self.before[key]
        return r


def close(stack):
    """Tears a stack down; a second Ctrl-C must not cut that short."""
    handlers(patient)
    stack.close()
    handlers(on_signal)
    if PENDING:
        raise Interrupted(PENDING[0])


def handlers(handler):
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, handler)


def sequential(args, user, configs, emit):
    """Each configuration alone, on a volume torn down before the next."""
    for baseline, ff in configs:
        stack = pg.Stack()
        try:
            progress(f"{'baseline' if baseline else 'zdisk'} FF={ff}: load and {args.seconds} s")
            run = Run(args, user, baseline, ff, stack)
            run.load()
            run.bench(args.seconds)
            emit(run.finish())
        finally:
            close(stack)


def interleaved(args, user, configs, emit):
    """Every configuration loaded and kept up at once, then the timed run
    cut into rounds taken in turn (the order rotating), so that the host's
    drift and the other work on it weigh on every configuration alike."""
    stack = pg.Stack()
    try:
        runs = []
        for baseline, ff in configs:
            progress(f"{'baseline' if baseline else 'zdisk'} FF={ff}: load")
            runs.append(Run(args, user, baseline, ff, stack))
            runs[-1].load()
        seconds = max(1, args.seconds // args.rounds)
        for round_index in range(args.rounds):
            progress(f"round {round_index + 1} of {args.rounds}: {seconds} s each")
            shift = round_index % len(runs)
            for run in runs[shift:] + runs[:shift]:
                run.bench(seconds)
        for run in runs:
            emit(run.finish())
    finally:
        close(stack)


def progress(text):
    print(f"pg-fillfactor: {text}", file=sys.stderr, flush=True)


def try_stats(metrics):
    try:
        return pg.stats(metrics)
    except OSError:
        return None


def table_updates(db):
    row = db.sql("select n_tup_upd, n_tup_hot_upd from pg_stat_user_tables "
                 "where relname = 'pgbench_accounts'")
    upd, hot = row.split("|")
    return int(upd), int(hot)


def sizes(db, mnt, metrics, backing, parts=False):
    """Sizes once PostgreSQL's dirty buffers and ext4's are on the export."""
    db.sql("CHECKPOINT")
    detached(["sync", "-f", mnt])
    out = {"db_bytes": int(db.sql("select pg_database_size('bench')")),
           "wal_dir_bytes": dir_bytes(os.path.join(db.data, "pg_wal"))}
    if parts:
        oid = db.sql("select oid from pg_database where datname = 'bench'")
        out["breakdown"] = breakdown(db.data, oid)
        relation = db.sql("select pg_relation_filepath('pgbench_accounts')")
        out["accounts_pages"] = free_space(os.path.join(db.data, relation))
    if metrics:
        s = pg.stats(metrics)
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


def positive(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zdisk", required=True)
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--scale", type=positive)
    parser.add_argument("--seconds", type=positive)
    parser.add_argument("--clients", type=positive, default=4)
    parser.add_argument("--jobs", type=positive, default=2)
    parser.add_argument("--logical")
    parser.add_argument("--codec", default="lz4")
    parser.add_argument("--fillfactors", type=fillfactor_list, default="100,90,75,50")
    parser.add_argument("--mkfs-options", default="-E nodiscard")
    parser.add_argument("--mount-options", default="")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--rounds", type=positive, default=1,
                        help="keep every configuration up at once and cut the timed run "
                             "into this many rounds taken in turn (zdisk then serves with "
                             "--recompress off unless --recompress says otherwise, so that "
                             "idle volumes do not recompress while others are measured)")
    parser.add_argument("--recompress", help="zdisk serve --recompress MODE")
    parser.add_argument("--pg-option", action="append", default=[], metavar="NAME=VALUE",
                        help="a PostgreSQL setting for every cluster (repeatable), "
                             "e.g. synchronous_commit=off")
    parser.add_argument("--breakdown", action="store_true",
                        help="also report file, non-zero and LZ4 bytes of the WAL, the "
                             "pgbench database and the rest of the cluster")
    args = parser.parse_args()
    # --quick: a minute or two of work; the default: tables ten times
    # PostgreSQL's shared buffers, and a run long enough to update them.
    args.scale = args.scale or (5 if args.quick else 100)
    args.seconds = args.seconds or (10 if args.quick else 180)
    args.logical = args.logical or ("4G" if args.quick else "16G")
    if args.rounds > 1 and args.recompress is None:
        args.recompress = "off"
    user = pg.postgres_user()
    os.makedirs(args.dir, exist_ok=True)

    handlers(on_signal)
    out = open(args.json, "w") if args.json else None
    results = []

    def emit(result):
        results.append(result)
        print(json.dumps(result), flush=True)
        if out:
            out.write(json.dumps(result) + "\n")
            out.flush()

    configs = [(baseline, ff) for ff in args.fillfactors
               for baseline in ([False] if args.no_baseline else [False, True])]
    try:
        (interleaved if args.rounds > 1 else sequential)(args, user, configs, emit)
    except Interrupted as why:
        progress(f"stopped by {why}; everything it started is torn down")
        return 130
    except subprocess.CalledProcessError as error:
        progress(f"{' '.join(error.cmd)} failed ({error.returncode}):\n"
                 f"{error.stdout or ''}{error.stderr or ''}")
        return 1
    except (RuntimeError, OSError) as error:
        progress(f"{error}")
        return 1
    finally:
        handlers(patient)
        if out:
            out.close()
    summary(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
