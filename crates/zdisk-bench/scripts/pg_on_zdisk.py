#!/usr/bin/python3
"""PostgreSQL's pgbench on ext4 on a zdisk export, as a user would run it:
zdisk serve, nbdfuse, a loop device, mkfs.ext4, mount, initdb, pgbench.

Reports, for the timed run only (initialisation excluded): transactions,
TPS, mean latency, and what zdisk wrote for them: host bytes, media bytes,
flush padding and staging, flushes, media bytes per transaction and the
shares of padding and staging in media writes; and, after the run, the
database's size, zdisk's mapped, stored and physical bytes. One JSON object
on the last line of output. (A zdisk older than staging reports no
staging_bytes; it counts as 0.)

Needs root, fuse3 (nbdfuse), util-linux (losetup), e2fsprogs, postgresql.
Usage: pg_on_zdisk.py --zdisk BIN --dir DIR [--codec lz4] [--scale 20]
       [--fillfactor 100] [--seconds 60] [--clients 4] [--nbdkit-file]
With --nbdkit-file the export is a plain file through nbdkit's file plugin
instead of zdisk (the non-compressing baseline).
"""

import argparse
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import time
import urllib.request


def run(args, **kwargs):
    return subprocess.run(args, check=True, capture_output=True, text=True, **kwargs)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_for(predicate, what, seconds=60):
    deadline = time.time() + seconds
    while not predicate():
        if time.time() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


class Stack:
    """Everything started, torn down in reverse order whatever happens."""

    def __init__(self):
        self.undo = []

    def push(self, what, action):
        self.undo.append((what, action))

    def close(self):
        while self.undo:
            what, action = self.undo.pop()
            try:
                action()
            except Exception as error:  # keep tearing down the rest
                print(f"teardown: {what}: {error}", file=sys.stderr)


def postgres_user():
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        sys.exit("pg_on_zdisk.py: no postgres user (install postgresql)")


def pg_bin(name):
    base = "/usr/lib/postgresql"
    versions = sorted(os.listdir(base)) if os.path.isdir(base) else []
    for version in reversed(versions):
        path = os.path.join(base, version, "bin", name)
        if os.path.exists(path):
            return path
    found = shutil.which(name)
    if not found:
        sys.exit(f"pg_on_zdisk.py: {name} not found (install postgresql)")
    return found


def as_postgres(args, **kwargs):
    return run(["runuser", "-u", "postgres", "--"] + args, **kwargs)


def stats(metrics):
    if metrics is None:
        return {}
    with urllib.request.urlopen(f"http://{metrics}/stats", timeout=30) as reply:
        return json.load(reply)


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zdisk", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--codec", default="lz4")
    parser.add_argument("--logical", default="8G")
    parser.add_argument("--scale", type=int, default=20)
    parser.add_argument("--fillfactor", type=int, default=100)
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--nbdkit-file", action="store_true")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("pg_on_zdisk.py: needs root (losetup, mount)")
    user = postgres_user()

    work = os.path.abspath(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    sock = os.path.join(work, "nbd.sock")
    raw = os.path.join(work, "nbd.raw")
    mnt = os.path.join(work, "mnt")
    os.makedirs(mnt)
    stack = Stack()
    result = {"label": args.label, "codec": None if args.nbdkit_file else args.codec,
              "baseline": args.nbdkit_file, "scale": args.scale,
              "fillfactor": args.fillfactor, "clients": args.clients, "seconds": args.seconds}
    metrics = None
    try:
        if args.nbdkit_file:
            backing = os.path.join(work, "plain.img")
            with open(backing, "wb") as f:
                f.truncate(int(args.logical.rstrip("G")) << 30)
            server = subprocess.Popen(["nbdkit", "--foreground", "-U", sock, "file", backing],
                                      stderr=subprocess.DEVNULL)
        else:
            image = os.path.join(work, "pg.zdisk")
            run([args.zdisk, "create", image, "--logical", args.logical, "--codec", args.codec])
            metrics = f"127.0.0.1:{free_port()}"
            server = subprocess.Popen([args.zdisk, "serve", image, "--socket", sock,
                                       "--metrics", metrics], stderr=subprocess.DEVNULL)
        stack.push("server", lambda: (server.terminate(), server.wait(timeout=120)))
        wait_for(lambda: os.path.exists(sock), "the NBD server")
        open(raw, "w").close()
        fuse = subprocess.Popen(["nbdfuse", raw, f"nbd+unix:///?socket={sock}"])
        stack.push("nbdfuse", lambda: (run(["fusermount3", "-u", raw]), fuse.wait(timeout=60)))
        # losetup before nbdfuse gives the file its size would see 0 bytes.
        wait_for(lambda: os.path.getsize(raw) > 0, "nbdfuse to size its file")
        loop = run(["losetup", "-f", "--show", raw]).stdout.strip()
        stack.push("loop device", lambda: run(["losetup", "-d", loop]))
        run(["mkfs.ext4", "-q", "-E", "nodiscard", loop])
        run(["mount", loop, mnt])
        stack.push("mount", lambda: run(["umount", mnt]))
        data = os.path.join(mnt, "pgdata")
        os.makedirs(data)
        os.chown(data, user.pw_uid, user.pw_gid)
        sockdir = os.path.join(work, "pgsock")
        os.makedirs(sockdir)
        os.chown(sockdir, user.pw_uid, user.pw_gid)
        as_postgres([pg_bin("initdb"), "-D", data, "--no-sync"])
        port = str(free_port())
        as_postgres([pg_bin("pg_ctl"), "-D", data, "-w", "-l", os.path.join(data, "log"), "start",
                     "-o", f"-k {sockdir} -p {port} -c listen_addresses=''"])
        stack.push("postgres", lambda: as_postgres([pg_bin("pg_ctl"), "-D", data, "-w", "-m", "fast", "stop"]))
        pg = ["-h", sockdir, "-p", port]
        as_postgres([pg_bin("createdb")] + pg + ["bench"])
        as_postgres([pg_bin("pgbench")] + pg + ["-i", "-q", "-s", str(args.scale), "-F",
                                                 str(args.fillfactor), "bench"])
        as_postgres([pg_bin("psql")] + pg + ["-q", "-c", "CHECKPOINT", "bench"])
        before = stats(metrics)
        bench = as_postgres([pg_bin("pgbench")] + pg + ["-T", str(args.seconds), "-c",
                                                         str(args.clients), "-j", "2", "bench"])
        after = stats(metrics)
        result.update(parse_pgbench(bench.stdout))
        size = as_postgres([pg_bin("psql")] + pg + ["-At", "-c",
                                                     "select pg_database_size('bench')", "bench"])
        result["db_bytes"] = int(size.stdout.strip())
        if metrics:
            def delta(key):
                return after.get(key, 0) - before.get(key, 0)
            media = delta("media_write_bytes")
            txns = max(result.get("transactions", 0), 1)
            result.update(
                host_write_bytes=delta("host_write_bytes"), media_write_bytes=media,
                padding_bytes=delta("padding_bytes"),
                staging_bytes=delta("staging_bytes"),
                flushes=after["counters"]["flushes"] - before["counters"]["flushes"],
                media_bytes_per_txn=media / txns,
                host_bytes_per_txn=delta("host_write_bytes") / txns,
                padding_share=delta("padding_bytes") / media if media else None,
                staging_share=delta("staging_bytes") / media if media else None,
                mapped_bytes=after["mapped_bytes"], stored_bytes=after["stored_bytes"],
                physical_used_bytes=after["physical_used_bytes"],
                compression_ratio=after["compression_ratio"])
        else:
            result["physical_bytes"] = os.stat(backing).st_blocks * 512
    finally:
        stack.close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
