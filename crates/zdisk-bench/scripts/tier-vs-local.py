#!/usr/bin/python3
"""A tiered volume on a one-node Ceph against a local volume, in one run.

Boots the test cluster (crates/zdisk/tests/support/ceph.sh: one monitor,
one memstore OSD, radosgw on a loopback port, an S3 user), makes a bucket,
and measures two volumes of the same logical size, both served on a Unix
socket with --recompress off (the idle pass would move and refetch data
between the phases):
  local   an ordinary image with room for everything;
  tier    an image of --cache bytes (much smaller than the corpus) with
          --tier s3://tier-vs-local/vol, its segments in the bucket.
Phases, each on both volumes:
  write    nbdcopy --flush of the corpus (the 512 MiB /usr tar at
           /dev/shm/usr512.tar; --quick: its first 64 MiB), timed to the
           end of nbdcopy (acknowledged and flushed locally); for the tier
           also the time until every sealed segment is in the bucket
           (tier_lag_bytes no more than the open segments) and until
           tier_lag_bytes is 0 and the local cache is back within --cache
           (the open segments go up with a root object, at most every
           10 s, so this is never under the publish interval). Then the
           uploaded bytes per byte the client wrote (host_write_bytes)
           and per byte stored (stored_bytes, compressed), and a clean
           stop (the tier's uploads its last root object).
  cold     a restart, then every block read (nbdcopy to a file, compared
           with the corpus): for the tier, all but --cache bytes of
           segments come from the bucket by ranged GETs.
  restore  the tier's image and its .tier file deleted; `zdisk create
           NEW --physical CACHE --from s3://...` then serve and read
           everything back (compared), timed from the create.
Ratios are tier / local in the same round; --rounds N repeats the three
phases on fresh images and a fresh prefix of the bucket, interleaved,
and prints each figure's median too (a shared host's speed drifts). The images and the OSD's memstore
are in RAM (tmpfs): the local volume is the best case a machine could
offer, and the gap is the S3 path's cost, not a disk's.
Needs root, the Ceph packages (see ceph.sh check), nbdcopy and curl.
Usage: tier-vs-local.py [--zdisk BIN] [--dir DIR] [--corpus FILE]
                        [--quick] [--cache SIZE] [--rounds N]
                        [--json FILE] [--keep]
Prints a table per round, then one JSON object {"rounds": [...],
"median": {...}} (also written to --json FILE).
"""

import argparse
import filecmp
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from map_rss import parse_size, stats  # noqa: E402
from pg_on_zdisk import free_port, wait_for  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CEPH_SH = os.path.join(HERE, "..", "..", "zdisk", "tests", "support", "ceph.sh")
DEFAULT_CORPUS = "/dev/shm/usr512.tar"
BUCKET = "tier-vs-local"
MIB = 1 << 20

# The servers started, so that a failure stops them.
SERVERS = []


class Ceph:
    """The one-node cluster, booted by ceph.sh and stopped by its PIDs."""

    def __init__(self, workdir):
        self.dir = os.path.join(workdir, "ceph")
        started = time.time()
        done = subprocess.run(["bash", CEPH_SH, "start", self.dir], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"ceph.sh start failed: {done.stdout}{done.stderr}")
        self.boot_seconds = time.time() - started
        self.env = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)

    def curl(self, *args):
        """A request signed as the cluster's S3 user; returns the HTTP status."""
        done = subprocess.run(
            ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--aws-sigv4", "aws:amz:us-east-1:s3",
             "--user", f"{self.env['AWS_ACCESS_KEY_ID']}:{self.env['AWS_SECRET_ACCESS_KEY']}",
             "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD", *args],
            capture_output=True, text=True,
        )
        return done.stdout.strip()

    def create_bucket(self, name):
        status = self.curl("-X", "PUT", f"{self.env['AWS_ENDPOINT_URL']}/{name}")
        if status != "200":
            raise RuntimeError(f"creating bucket {name}: HTTP {status}")

    def stop(self):
        subprocess.run(["bash", CEPH_SH, "stop", self.dir], capture_output=True)


class Server:
    def __init__(self, args, image, sock, env):
        self.port = free_port()
        self.sock = sock
        self.log = sock + ".log"
        if os.path.exists(sock):
            os.remove(sock)
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [args.zdisk, "serve", image, "--socket", sock, "--metrics", f"127.0.0.1:{self.port}",
                 "--recompress", "off"],
                stdout=subprocess.DEVNULL, stderr=log, env=env,
            )
        SERVERS.append(self.process)
        wait_for(lambda: os.path.exists(sock), "the socket", seconds=600)
        wait_for(lambda: self._answers(), "the metrics endpoint", seconds=600)

    def _answers(self):
        try:
            self.stats()
            return True
        except OSError:
            return False

    def uri(self):
        return f"nbd+unix:///?socket={self.sock}"

    def stats(self):
        return stats(self.port)

    def stop(self):
        """A clean stop; returns its seconds (the tier uploads what is left)."""
        started = time.time()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=600)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise RuntimeError("zdisk serve did not stop in 600 s")
        if self.process.returncode != 0:
            with open(self.log) as log:
                tail = log.read()[-2000:]
            raise RuntimeError(f"zdisk serve exited with {self.process.returncode}: {tail}")
        return time.time() - started


def zdisk(args, env, *words):
    done = subprocess.run([args.zdisk, *words], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"zdisk {' '.join(words)} failed: {done.stderr.strip()}")


def nbdcopy(*words):
    started = time.time()
    done = subprocess.run(["nbdcopy", *words], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"nbdcopy {' '.join(words)} failed: {done.stderr.strip()}")
    return time.time() - started


def read_and_compare(server, corpus, out, length):
    """Reads the whole export into `out` (timed), then compares its first
    `length` bytes with the corpus."""
    seconds = nbdcopy(server.uri(), out)
    with open(out, "r+b") as f:
        f.truncate(length)
    if not filecmp.cmp(corpus, out, shallow=False):
        raise RuntimeError(f"{out} does not read back as {corpus}")
    os.remove(out)
    return seconds


def make_corpus(args, workdir):
    """The corpus file and its length: --corpus, else the /usr tar (its
    first 64 MiB with --quick), made from /usr if it is absent."""
    if args.corpus:
        return args.corpus, os.path.getsize(args.corpus)
    want = 64 * MIB if args.quick else 512 * MIB
    path = os.path.join(workdir, "corpus.tar")
    source = DEFAULT_CORPUS if os.path.exists(DEFAULT_CORPUS) else None
    if source and os.path.getsize(source) == want:
        return source, want
    if source:
        command = f"head -c {want} {source} > {path}"
    else:
        command = f"tar cf - --one-file-system /usr 2>/dev/null | head -c {want} > {path}"
    subprocess.run(["sh", "-c", command], check=True)
    length = os.path.getsize(path)
    if length != want:
        raise RuntimeError(f"only {length} bytes of corpus could be made")
    return path, length


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zdisk", default="target/release/zdisk")
    parser.add_argument("--dir", default=None, help="work directory (default: a new one in /dev/shm)")
    parser.add_argument("--corpus", default=None)
    parser.add_argument("--quick", action="store_true", help="64 MiB of the corpus")
    parser.add_argument("--cache", default=None, help="the tier's local cache (default: an eighth of the corpus)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--rounds", type=int, default=1, help="repeat on fresh images; medians printed")
    args = parser.parse_args()
    args.zdisk = os.path.abspath(args.zdisk)
    for tool in ("nbdcopy", "curl"):
        if shutil.which(tool) is None:
            sys.exit(f"tier-vs-local.py: {tool} is needed")
    if not os.access(args.zdisk, os.X_OK):
        sys.exit(f"tier-vs-local.py: no zdisk binary at {args.zdisk} (cargo build --release)")
    if args.corpus and not os.path.isfile(args.corpus):
        sys.exit(f"tier-vs-local.py: no corpus at {args.corpus}")
    if args.rounds < 1:
        sys.exit("tier-vs-local.py: --rounds must be at least 1")
    if args.cache is not None:
        try:
            parse_size(args.cache)
        except ValueError:
            sys.exit(f"tier-vs-local.py: bad --cache {args.cache!r} (a size like 64M)")
    check = subprocess.run(["bash", CEPH_SH, "check"], capture_output=True, text=True)
    if check.returncode != 0:
        sys.exit(f"tier-vs-local.py: cannot run the test cluster: {check.stdout.strip()}")
    workdir = args.dir or tempfile.mkdtemp(prefix="tier-vs-local.", dir="/dev/shm")
    os.makedirs(workdir, exist_ok=True)
    ceph = None
    try:
        corpus, length = make_corpus(args, workdir)
        cache = parse_size(args.cache) if args.cache else max(8 * MIB, length // 8 // MIB * MIB)
        ceph = Ceph(workdir)
        ceph.create_bucket(BUCKET)
        rounds = [run(args, workdir, ceph, corpus, length, cache, n) for n in range(args.rounds)]
    finally:
        for process in SERVERS:
            if process.poll() is None:
                process.kill()
                process.wait()
        if ceph:
            ceph.stop()
        if not args.keep and args.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    for n, result in enumerate(rounds):
        report(result, n, args.rounds)
    summary = {"rounds": rounds, "median": {key: median([r[key] for r in rounds]) for key in MEDIANS}}
    if args.rounds > 1:
        print("medians over the rounds: " + ", ".join(f"{k} {v:.3f}" for k, v in summary["median"].items()))
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")


def median(values):
    values = sorted(values)
    return values[len(values) // 2]


# The figures whose median over the rounds is printed.
MEDIANS = (
    "local_write_mb_s", "tier_write_mb_s", "write_ratio", "write_until_sealed_uploaded_ratio",
    "write_until_uploaded_ratio", "local_cold_read_mb_s", "tier_cold_read_mb_s", "cold_read_ratio",
    "restore_seconds", "restore_ratio", "uploaded_per_written_byte", "uploaded_per_stored_byte",
)


def run(args, workdir, ceph, corpus, length, cache, round_number):
    """One round on fresh images and a fresh prefix of the bucket."""
    env = dict(os.environ, **ceph.env)
    url = f"s3://{BUCKET}/vol{round_number}"
    logical = (length + 64 * MIB) // MIB * MIB
    images = {"local": os.path.join(workdir, "local.zdisk"), "tier": os.path.join(workdir, "tier.zdisk")}
    zdisk(args, env, "create", images["local"], "--logical", str(logical), "--physical", str(logical))
    zdisk(args, env, "create", images["tier"], "--logical", str(logical), "--physical", str(cache),
          "--tier", url)
    result = {
        "zdisk": args.zdisk, "corpus": corpus, "corpus_bytes": length, "cache_bytes": cache,
        "logical_bytes": logical, "ceph_boot_seconds": ceph.boot_seconds, "round": round_number,
    }

    # Write.
    for name in ("local", "tier"):
        server = Server(args, images[name], os.path.join(workdir, f"{name}.sock"), env)
        started = time.time()
        seconds = nbdcopy("--flush", corpus, server.uri())
        result[f"{name}_write_seconds"] = seconds
        if name == "tier":
            # Sealed segments go up as they are sealed; the open ones only
            # with a root object, at most every publish interval (10 s).
            sealed_up = None
            while True:
                s = server.stats()
                open_bytes = s["segments_by_state"]["open"] * s["segment_size_bytes"]
                if sealed_up is None and s["tier_lag_bytes"] <= open_bytes:
                    sealed_up = time.time() - started
                if s["tier_lag_bytes"] == 0 and s["tier_resident_bytes"] <= cache:
                    break
                if time.time() - started > 1800:
                    raise RuntimeError(f"the bucket did not catch up in 1800 s: {s}")
                time.sleep(0.05)
            result["tier_caught_up_seconds"] = time.time() - started
            result["tier_sealed_uploaded_seconds"] = sealed_up
            s = server.stats()
            for key in ("host_write_bytes", "stored_bytes", "tier_uploaded_bytes", "tier_evicted_bytes",
                        "tier_resident_bytes", "tier_roots_published"):
                result[f"tier_{key}" if not key.startswith("tier_") else key] = s[key]
        result[f"{name}_stop_seconds"] = server.stop()

    # Cold read: a restart, then everything read back.
    for name in ("local", "tier"):
        server = Server(args, images[name], os.path.join(workdir, f"{name}.sock"), env)
        result[f"{name}_cold_read_seconds"] = read_and_compare(
            server, corpus, os.path.join(workdir, "back.raw"), length)
        if name == "tier":
            s = server.stats()
            result["tier_cold_fetched_bytes"] = s["tier_fetched_bytes"]
            result["tier_cold_cache_misses"] = s["tier_cache_misses"]
            result["tier_cold_cache_hits"] = s["tier_cache_hits"]
        server.stop()

    # Restore: the bucket alone.
    os.remove(images["tier"])
    os.remove(images["tier"] + ".tier")
    restored = os.path.join(workdir, "restored.zdisk")
    started = time.time()
    zdisk(args, env, "create", restored, "--physical", str(cache), "--from", url)
    result["restore_create_seconds"] = time.time() - started
    server = Server(args, restored, os.path.join(workdir, "restored.sock"), env)
    result["restore_open_seconds"] = time.time() - started
    read_and_compare(server, corpus, os.path.join(workdir, "back.raw"), length)
    result["restore_seconds"] = time.time() - started
    result["restore_fetched_bytes"] = server.stats()["tier_fetched_bytes"]
    server.stop()
    for path in (images["local"], restored, restored + ".tier"):
        os.remove(path)

    mb = length / 1e6
    for name in ("local", "tier"):
        result[f"{name}_write_mb_s"] = mb / result[f"{name}_write_seconds"]
        result[f"{name}_cold_read_mb_s"] = mb / result[f"{name}_cold_read_seconds"]
    result["tier_write_until_uploaded_mb_s"] = mb / result["tier_caught_up_seconds"]
    result["tier_write_until_sealed_uploaded_mb_s"] = mb / result["tier_sealed_uploaded_seconds"]
    result["restore_mb_s"] = mb / result["restore_seconds"]
    result["write_ratio"] = result["tier_write_mb_s"] / result["local_write_mb_s"]
    result["write_until_uploaded_ratio"] = result["tier_write_until_uploaded_mb_s"] / result["local_write_mb_s"]
    result["write_until_sealed_uploaded_ratio"] = (
        result["tier_write_until_sealed_uploaded_mb_s"] / result["local_write_mb_s"])
    result["cold_read_ratio"] = result["tier_cold_read_mb_s"] / result["local_cold_read_mb_s"]
    result["restore_ratio"] = result["restore_mb_s"] / result["local_cold_read_mb_s"]
    result["uploaded_per_written_byte"] = result["tier_uploaded_bytes"] / result["tier_host_write_bytes"]
    result["uploaded_per_stored_byte"] = result["tier_uploaded_bytes"] / result["tier_stored_bytes"]
    return result


def report(r, n, rounds):
    if rounds > 1:
        print(f"round {n + 1} of {rounds}")
    print(f"corpus {r['corpus']}: {r['corpus_bytes'] / MIB:.0f} MiB; tier cache {r['cache_bytes'] / MIB:.0f} MiB; "
          f"one-node Ceph booted in {r['ceph_boot_seconds']:.1f} s")
    print(f"{'':28} {'local':>10} {'tier':>10} {'tier/local':>10}")
    print(f"{'write MB/s (flushed)':28} {r['local_write_mb_s']:>10.1f} {r['tier_write_mb_s']:>10.1f} "
          f"{r['write_ratio']:>10.2f}")
    print(f"{'write MB/s (sealed uploaded)':28} {'':>10} {r['tier_write_until_sealed_uploaded_mb_s']:>10.1f} "
          f"{r['write_until_sealed_uploaded_ratio']:>10.2f}")
    print(f"{'write MB/s (lag 0, root)':28} {'':>10} {r['tier_write_until_uploaded_mb_s']:>10.1f} "
          f"{r['write_until_uploaded_ratio']:>10.2f}")
    print(f"{'clean stop s':28} {r['local_stop_seconds']:>10.2f} {r['tier_stop_seconds']:>10.2f}")
    print(f"{'cold read MB/s':28} {r['local_cold_read_mb_s']:>10.1f} {r['tier_cold_read_mb_s']:>10.1f} "
          f"{r['cold_read_ratio']:>10.2f}")
    print(f"{'restore + read all MB/s':28} {'':>10} {r['restore_mb_s']:>10.1f} {r['restore_ratio']:>10.2f}")
    print(f"restore: create --from {r['restore_create_seconds']:.2f} s, serving after "
          f"{r['restore_open_seconds']:.2f} s, everything read after {r['restore_seconds']:.1f} s "
          f"({r['restore_fetched_bytes'] / MIB:.0f} MiB fetched)")
    print(f"cold read of the tier: {r['tier_cold_fetched_bytes'] / MIB:.0f} MiB fetched, "
          f"{r['tier_cold_cache_misses']} misses, {r['tier_cold_cache_hits']} hits")
    print(f"uploaded {r['tier_uploaded_bytes'] / MIB:.1f} MiB for {r['tier_host_write_bytes'] / MIB:.1f} MiB "
          f"written ({r['uploaded_per_written_byte']:.3f} per byte written) and "
          f"{r['tier_stored_bytes'] / MIB:.1f} MiB stored ({r['uploaded_per_stored_byte']:.3f} per byte stored)")


if __name__ == "__main__":
    main()
