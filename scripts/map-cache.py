#!/usr/bin/python3
"""The paged map under a bounded cache: RSS, verification and 4 KiB random reads.

One image (16 TiB logical by default), served on a Unix socket with
--map-cache and written by fio's nbd engine:
  1. fill     BLOCKS random 4 KiB writes over the whole volume (fio's LFSR
              generator, so no block is written twice), each with a crc32c
              verify header, ending with a flush; the server's VmRSS and
              /stats after the fill (RSS against cache + 64 MiB);
  2. verify   kill -9 of the server, a restart (its recovery time), and
              every block read back and verified by fio (--verify_only);
  3. reads    for a map cache of 100%, 25% and 5% of the map's size (its
              leaves' heap bytes, map_resident_bytes with everything in
              RAM), a restart with that cache and a timed 4 KiB random read
              of the written blocks (same LFSR sequence), after a warm-up
              pass; each as a ratio of the 100% case's IOPS in the same
              round, with the cache's hits, misses (pages read back) and
              peeks (of those, pages read for one lookup, their leaves
              not kept). With --rounds N the three caches are measured
              N times, interleaved (a shared host's speed drifts), and
              the median ratio is printed.
              --reads-only measures the reads on the image a previous run
              left in --dir.
The idle pass is off (--recompress off). Needs fio with the nbd engine.
A table, then one JSON object with every figure.

  --quick   16,384 blocks on a 64 GiB volume, 2 s reads (seconds)
  default   2,097,152 blocks on a 16 TiB volume, 20 s reads
"""

import os

import harness

VERIFY = ("--verify=crc32c", "--verify_fatal=1")
PERCENTS = (100, 25, 5)


class Volume:
    def __init__(self, args, zdisk, work):
        self.args, self.zdisk = args, zdisk
        self.image = os.path.join(work, "paged.zdisk")
        self.sock = os.path.join(work, "paged.sock")

    def serve(self, teardown, cache):
        return harness.Server(teardown, self.zdisk, self.image, self.sock,
                              ["--recompress", "off", "--map-cache", str(cache)])

    def fio(self, server, rw, *extra):
        return harness.fio(server.uri, "map", rw, "4k", f"--size={self.args.logical}",
                           f"--io_size={self.args.blocks * harness.BLOCK}",
                           "--random_generator=lfsr", "--norandommap", "--randseed=12", *extra)


def fill_and_verify(volume, cache, result):
    with harness.Teardown() as teardown:
        server = volume.serve(teardown, cache)
        rss_before = server.rss()
        # Flushed at the end: only flushed writes must survive kill -9.
        run = volume.fio(server, "randwrite", "--do_verify=0", "--end_fsync=1", *VERIFY)
        result["fill_seconds"] = run["jobs"][0]["job_runtime"] / 1000
        after = server.stats()
        result.update(
            fill_rss_before_bytes=rss_before, fill_rss_bytes=server.rss(),
            fill_mapped_blocks=after["mapped_bytes"] // harness.BLOCK,
            fill_map_memory_bytes=after["map_memory_bytes"],
            fill_map_resident_bytes=after["map_resident_bytes"],
            fill_map_leaves=after["map_leaves"])
        result["rss_within_cache_plus_64m"] = result["fill_rss_bytes"] <= cache + (64 << 20)
        server.kill()
        result["recovery_seconds"] = server.start()
        run = volume.fio(server, "randwrite", "--verify_only", *VERIFY)
        result["verify_seconds"] = run["jobs"][0]["job_runtime"] / 1000
        result["verified_blocks"] = volume.args.blocks
        result["verify_rss_bytes"] = server.rss()
        result["verify_stats"] = {k: v for k, v in server.stats().items() if k.startswith("map_")}
        server.stop()


def measure_reads(volume, result):
    args = volume.args
    with harness.Teardown() as teardown:
        # The map's size: every leaf in RAM after a pass over the blocks.
        server = volume.serve(teardown, 1 << 40)
        volume.fio(server, "randread")
        map_bytes = server.stats()["map_resident_bytes"]
        server.stop()
    result["map_bytes"] = map_bytes
    reads = {percent: [] for percent in PERCENTS}
    for _ in range(args.rounds):
        for percent in PERCENTS:
            size = map_bytes * percent // 100 if percent < 100 else 1 << 40
            with harness.Teardown() as teardown:
                server = volume.serve(teardown, size)
                volume.fio(server, "randread")  # warm-up: the cache fills
                before = server.stats()
                run = volume.fio(server, "randread", "--time_based", f"--runtime={args.seconds}")
                after = server.stats()
                rss = server.rss()
                server.stop()
            reads[percent].append({
                "cache_bytes": size,
                "iops": run["jobs"][0]["read"]["iops"],
                "hits": after["map_cache_hits"] - before["map_cache_hits"],
                "misses": after["map_cache_misses"] - before["map_cache_misses"],
                "peeks": after["map_cache_peeks"] - before["map_cache_peeks"],
                "rss_bytes": rss,
            })
    for percent in PERCENTS:
        for r, run in enumerate(reads[percent]):
            run["ratio"] = run["iops"] / reads[100][r]["iops"]
    result["reads"] = reads
    return reads, map_bytes


def report(result, reads, map_bytes, cache):
    mib = 1 << 20
    if "fill_seconds" in result:
        print(f"fill: {result['fill_mapped_blocks']} blocks in {result['fill_seconds']:.0f} s; "
              f"RSS {result['fill_rss_bytes'] / mib:.1f} MiB (cache {cache / mib:.0f} MiB + 64 MiB: "
              f"{'within' if result['rss_within_cache_plus_64m'] else 'OVER'}); "
              f"map {result['fill_map_memory_bytes'] / mib:.1f} MiB, leaves in RAM "
              f"{result['fill_map_resident_bytes'] / mib:.1f} MiB")
        print(f"kill -9, restart in {result['recovery_seconds']:.2f} s, "
              f"{result['verified_blocks']} blocks verified in {result['verify_seconds']:.0f} s, "
              f"RSS {result['verify_rss_bytes'] / mib:.1f} MiB")
    print(f"map {map_bytes / mib:.1f} MiB; 4 KiB random reads by map cache:")
    print(f"{'cache':>8} {'MiB':>8} {'round':>5} {'IOPS':>10} {'ratio':>6} {'hits':>10} {'misses':>10} "
          f"{'peeks':>10}")
    for percent, runs in reads.items():
        for n, r in enumerate(runs):
            print(f"{percent:>7}% {min(r['cache_bytes'], map_bytes) / mib:>8.1f} {n + 1:>5} "
                  f"{r['iops']:>10.0f} {r['ratio']:>6.2f} {r['hits']:>10} {r['misses']:>10} "
                  f"{r['peeks']:>10}")
        print(f"{percent:>7}% median ratio {harness.median([r['ratio'] for r in runs]):.2f}")


def body():
    parser = harness.parser(__doc__)
    harness.add_zdisk(parser)
    parser.add_argument("--dir", help="where the image goes (kept; default: a temporary directory)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--logical")
    parser.add_argument("--physical")
    parser.add_argument("--blocks", type=harness.positive)
    parser.add_argument("--cache", help="the map cache during the fill and verify (default 8M)")
    parser.add_argument("--seconds", type=harness.positive)
    parser.add_argument("--rounds", type=harness.positive, default=1)
    parser.add_argument("--reads-only", action="store_true")
    parser.add_argument("--json", help="also append the JSON object to this file")
    args = parser.parse_args()
    args.logical = args.logical or ("64G" if args.quick else "16T")
    args.physical = args.physical or ("1G" if args.quick else "12G")
    args.blocks = args.blocks or (16384 if args.quick else 2 * 1024 * 1024)
    args.seconds = args.seconds or (2 if args.quick else 20)
    cache = harness.parse_size(args.cache or ("1M" if args.quick else "8M"))
    zdisk = harness.zdisk_binary(args.zdisk)
    harness.require_tools("fio")
    with harness.Teardown() as teardown:
        work = harness.workdir(teardown, args.dir, "map-cache.")
        volume = Volume(args, zdisk, work)
        if args.reads_only and not os.path.exists(volume.image):
            raise harness.Failure(f"--reads-only needs {volume.image} from a previous run")
        result = {"zdisk": zdisk, "logical": args.logical, "blocks": args.blocks,
                  "cache_bytes": cache}
        if not args.reads_only:
            harness.zdisk_create(zdisk, volume.image, "--logical", args.logical, "--physical",
                                 args.physical, "--force")
            fill_and_verify(volume, cache, result)
        reads, map_bytes = measure_reads(volume, result)
    report(result, reads, map_bytes, cache)
    harness.emit_json(result, args.json)


if __name__ == "__main__":
    harness.main("map-cache.py", body)
