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
  write    nbdcopy --flush of the corpus (the first 512 MiB of a tar of
           /usr, or --corpus FILE), timed to the end of nbdcopy
           (acknowledged and flushed locally); for the tier also the time
           until every sealed segment is in the bucket (tier_lag_bytes no
           more than the open segments) and until tier_lag_bytes is 0 and
           the local cache is back within --cache (the open segments go up
           with a root object, at most every 10 s, so this is never under
           the publish interval). Then the uploaded bytes per byte the
           client wrote (host_write_bytes) and per byte stored
           (stored_bytes, compressed), and a clean stop (the tier uploads
           its last root object).
  cold     a restart, then every block read (nbdcopy to a file, compared
           with the corpus): for the tier, all but --cache bytes of
           segments come from the bucket by ranged GETs.
  restore  the tier's image and its .tier file deleted; `zdisk create
           NEW --physical CACHE --from s3://...` then serve and read
           everything back (compared), timed from the create.
Ratios are tier / local in the same round; --rounds N repeats the three
phases on fresh images and a fresh prefix of the bucket, interleaved,
and prints each figure's median too (a shared host's speed drifts). The
images and the OSD's memstore are in RAM (tmpfs): the local volume is the
best case a machine could offer, and the gap is the S3 path's cost, not a
disk's. Needs root, the Ceph packages (ceph.sh check says which), nbdcopy
and curl; one cluster runs on a machine at a time.
Prints a table per round, then one JSON object {"rounds": [...],
"median": {...}} (also written to --json FILE).

  --quick   the corpus's first 64 MiB (about a minute with the boot)
"""

import filecmp
import json
import os
import time

import harness
from harness import MIB, Failure, nbdcopy

BUCKET = "tier-vs-local"


def create(args, env, image, *words):
    harness.zdisk_create(args.zdisk, image, *words, env=env)


def serve(args, teardown, image, sock, env):
    return harness.Server(teardown, args.zdisk, image, sock, ["--recompress", "off"], env=env)


def read_and_compare(server, corpus, out, length):
    """Reads the whole export into `out` (timed), then compares its first
    `length` bytes with the corpus."""
    seconds = nbdcopy(server.uri, out)
    with open(out, "r+b") as f:
        f.truncate(length)
    if not filecmp.cmp(corpus, out, shallow=False):
        raise Failure(f"{out} does not read back as {corpus}")
    os.remove(out)
    return seconds


def body():
    parser = harness.parser(__doc__)
    harness.add_zdisk(parser)
    parser.add_argument("--dir", default=None,
                        help="work directory (kept; default: a new one in /dev/shm)")
    parser.add_argument("--corpus", default=None)
    parser.add_argument("--quick", action="store_true", help="64 MiB of the corpus")
    parser.add_argument("--cache", default=None,
                        help="the tier's local cache (default: an eighth of the corpus)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--rounds", type=harness.positive, default=1,
                        help="repeat on fresh images; medians printed")
    args = parser.parse_args()
    args.zdisk = harness.zdisk_binary(args.zdisk)
    harness.require_tools("nbdcopy", "curl")
    harness.require_root("the Ceph daemons")
    cache = harness.parse_size(args.cache) if args.cache else None
    with harness.Teardown() as teardown:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        workdir = harness.workdir(teardown, args.dir, "tier-vs-local.", base)
        corpus = harness.corpus(args.corpus, (64 if args.quick else 512) * MIB, workdir)
        length = os.path.getsize(corpus)
        cache = cache or max(8 * MIB, length // 8 // MIB * MIB)
        ceph = harness.Ceph(teardown, workdir)
        ceph.create_bucket(BUCKET)
        rounds = [run(args, teardown, workdir, ceph, corpus, length, cache, n)
                  for n in range(args.rounds)]
    for n, result in enumerate(rounds):
        report(result, n, args.rounds)
    summary = {"rounds": rounds,
               "median": {key: harness.median([r[key] for r in rounds]) for key in MEDIANS}}
    if args.rounds > 1:
        print("medians over the rounds: "
              + ", ".join(f"{k} {v:.3f}" for k, v in summary["median"].items()))
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")


# The figures whose median over the rounds is printed.
MEDIANS = (
    "local_write_mb_s", "tier_write_mb_s", "write_ratio", "write_until_sealed_uploaded_ratio",
    "write_until_uploaded_ratio", "local_cold_read_mb_s", "tier_cold_read_mb_s", "cold_read_ratio",
    "restore_seconds", "restore_ratio", "uploaded_per_written_byte", "uploaded_per_stored_byte",
)


def run(args, teardown, workdir, ceph, corpus, length, cache, round_number):
    """One round on fresh images and a fresh prefix of the bucket."""
    env = dict(os.environ, **ceph.env)
    url = f"s3://{BUCKET}/vol{round_number}"
    logical = (length + 64 * MIB) // MIB * MIB
    images = {"local": os.path.join(workdir, "local.zdisk"), "tier": os.path.join(workdir, "tier.zdisk")}
    create(args, env, images["local"], "--logical", str(logical), "--physical", str(logical))
    create(args, env, images["tier"], "--logical", str(logical), "--physical", str(cache),
          "--tier", url)
    result = {
        "zdisk": args.zdisk, "corpus": corpus, "corpus_bytes": length, "cache_bytes": cache,
        "logical_bytes": logical, "ceph_boot_seconds": ceph.boot_seconds, "round": round_number,
    }

    # Write.
    for name in ("local", "tier"):
        server = serve(args, teardown, images[name], os.path.join(workdir, f"{name}.sock"), env)
        started = time.monotonic()
        seconds = nbdcopy("--flush", corpus, server.uri)
        result[f"{name}_write_seconds"] = seconds
        if name == "tier":
            # Sealed segments go up as they are sealed; the open ones only
            # with a root object, at most every publish interval (10 s).
            sealed_up = None
            while True:
                s = server.stats()
                open_bytes = s["segments_by_state"]["open"] * s["segment_size_bytes"]
                if sealed_up is None and s["tier_lag_bytes"] <= open_bytes:
                    sealed_up = time.monotonic() - started
                if s["tier_lag_bytes"] == 0 and s["tier_resident_bytes"] <= cache:
                    break
                if time.monotonic() - started > 1800:
                    raise Failure(f"the bucket did not catch up in 1800 s: {s}")
                time.sleep(0.05)
            result["tier_caught_up_seconds"] = time.monotonic() - started
            result["tier_sealed_uploaded_seconds"] = sealed_up
            s = server.stats()
            for key in ("host_write_bytes", "stored_bytes", "tier_uploaded_bytes", "tier_evicted_bytes",
                        "tier_resident_bytes", "tier_roots_published"):
                result[f"tier_{key}" if not key.startswith("tier_") else key] = s[key]
        result[f"{name}_stop_seconds"] = server.stop()

    # Cold read: a restart, then everything read back.
    for name in ("local", "tier"):
        server = serve(args, teardown, images[name], os.path.join(workdir, f"{name}.sock"), env)
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
    started = time.monotonic()
    create(args, env, restored, "--physical", str(cache), "--from", url)
    result["restore_create_seconds"] = time.monotonic() - started
    server = serve(args, teardown, restored, os.path.join(workdir, "restored.sock"), env)
    result["restore_open_seconds"] = time.monotonic() - started
    read_and_compare(server, corpus, os.path.join(workdir, "back.raw"), length)
    result["restore_seconds"] = time.monotonic() - started
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
    harness.main("tier-vs-local.py", body)
