#!/usr/bin/python3
"""Two zdisk builds compared on one scenario, in interleaved rounds.

  ab.py --a BIN_A --b BIN_B --scenario NAME [--rounds N] [--nbdkit] ...

Each build gets its own image in the same directory, served on a Unix
socket; every round measures A then B (the order flips every other round,
so neither always runs first), because a shared host's speed drifts more
between rounds than the difference one wants to see. Prints each round's
figures, then per figure the medians and the median of the per-round
ratios B / A (with their range); --nbdkit adds nbdkit's memory plugin to
every round of the read and write scenarios, and the ratios to it. The
last line is one JSON object: {"scenario", "a", "b", "rounds": [{"A": {...},
"B": {...}}...], "median": {"A": {...}, "B": {...}}, "b_over_a": {figure:
{"median", "min", "max"}}, "over_nbdkit": {"A": {...}, "B": {...}}}.
Without --b, A alone is measured (no ratios).

Scenarios (--quick in brackets):
  seq-read    the corpus written once, then 1 MiB sequential reads (fio nbd,
              QD8 x 2 jobs, each job reading its half 3 times): mb_s,
              server_cpu_s_per_gb (CPU per byte is steadier than MB/s on a
              busy host)
  rand-read   the corpus written once, then 4 KiB random reads of it (fio
              nbd, QD16 x 2 jobs, 6 [2] s): mb_s, iops, server_cpu_s_per_gb
  write       nbdcopy --flush of the corpus into a fresh image each round:
              mb_s, server_cpu_s_per_gb, stored_bytes
  map-read    4 KiB random reads with the whole map cached: 262,144 [16,384]
              random 4 KiB blocks (fio, LFSR, half compressible) written once
              into a 64 GiB [4 GiB] volume; each round restarts the server,
              reads every block once (the map's leaves come into RAM), then
              15 [2] s of random reads of the same blocks at QD16: iops
  idle-space  space while busy and once idle: a fresh 1 GiB image, 20 [3] s
              of random 4 KiB writes of 60%-compressible data over 256 [64]
              MiB with an fsync every 64, then /stats at once and after 60
              [7] s without requests: stored_bytes, busy_ and
              idle_physical_used_bytes, idle_sealed_under_10_percent_live,
              idle_segments_cleaned, busy_reclaimable_bytes

The corpus (seq-read, rand-read, write) is --corpus FILE, else the first
--corpus-mib (512 [32]) MiB of a tar of /usr. The read, write and map-read
scenarios serve with --recompress off (the idle pass would move data
between rounds), idle-space with the defaults; --serve-flags "..."
replaces those flags for both builds. Needs fio (nbd engine) and
nbdcopy; --nbdkit needs nbdkit. Rounds default to 3 [2].
"""

import os
import shlex
import time

import harness

SCENARIOS = {}


def scenario(name, nbdkit=False, flags=("--recompress", "off"), corpus=False):
    def register(cls):
        cls.name, cls.nbdkit, cls.flags, cls.corpus = name, nbdkit, list(flags), corpus
        SCENARIOS[name] = cls
        return cls
    return register


class Build:
    """One side of the comparison: a zdisk binary (or nbdkit memory) and
    its image, served on demand."""

    def __init__(self, label, zdisk, work, flags, teardown):
        self.label, self.zdisk, self.flags, self.teardown = label, zdisk, flags, teardown
        self.image = os.path.join(work, f"{label}.zdisk")
        self.sock = os.path.join(work, f"{label}.sock")
        self.server = None

    def create(self, logical, *extra):
        if self.zdisk:
            harness.zdisk_create(self.zdisk, self.image, "--logical", logical, "--force", *extra)

    def up(self, nbdkit_bytes=None):
        if self.server is None:
            if self.zdisk:
                self.server = harness.Server(self.teardown, self.zdisk, self.image, self.sock,
                                             self.flags)
            else:
                self.server = harness.Nbdkit(self.teardown, self.sock, nbdkit_bytes)
        return self.server

    def down(self):
        if self.server is not None:
            self.server.stop()
            self.server = None


def cpu_per_gb(server, seconds_before, byte_count):
    return (server.cpu_seconds() - seconds_before) / (byte_count / 1e9)


class CorpusReads:
    def __init__(self, ctx):
        self.ctx = ctx

    def prepare(self, build):
        build.create(self.ctx.logical)
        server = build.up(self.ctx.logical_bytes)
        harness.nbdcopy("--flush", self.ctx.corpus, server.uri)


@scenario("seq-read", nbdkit=True, corpus=True)
class SeqRead(CorpusReads):
    def measure(self, build):
        server = build.up()
        half = self.ctx.corpus_bytes // 2 // harness.MIB * harness.MIB
        cpu = server.cpu_seconds()
        run = harness.fio(server.uri, "seq", "read", "1M", "--numjobs=2", "--group_reporting",
                          f"--size={half}", f"--offset_increment={half}",
                          "--loops=3", iodepth=8)
        job = harness.fio_job(run)
        return {"mb_s": job["bw_bytes"] / 1e6,
                "server_cpu_s_per_gb": cpu_per_gb(server, cpu, job["io_bytes"])}


@scenario("rand-read", nbdkit=True, corpus=True)
class RandRead(CorpusReads):
    def measure(self, build):
        server = build.up()
        cpu = server.cpu_seconds()
        run = harness.fio(server.uri, "rand", "randread", "4k", "--numjobs=2", "--group_reporting",
                          f"--size={self.ctx.corpus_bytes // harness.MIB * harness.MIB}",
                          "--time_based", f"--runtime={2 if self.ctx.quick else 6}")
        job = harness.fio_job(run)
        return {"mb_s": job["bw_bytes"] / 1e6, "iops": job["iops"],
                "server_cpu_s_per_gb": cpu_per_gb(server, cpu, job["io_bytes"])}


@scenario("write", nbdkit=True, corpus=True)
class Write:
    def __init__(self, ctx):
        self.ctx = ctx

    def prepare(self, build):
        pass

    def measure(self, build):
        build.create(self.ctx.logical)
        server = build.up(self.ctx.logical_bytes)
        cpu = server.cpu_seconds()
        seconds = harness.nbdcopy("--flush", self.ctx.corpus, server.uri)
        result = {"mb_s": self.ctx.corpus_bytes / seconds / 1e6,
                  "server_cpu_s_per_gb": cpu_per_gb(server, cpu, self.ctx.corpus_bytes)}
        if build.zdisk:
            result["stored_bytes"] = server.stats()["stored_bytes"]
        build.down()
        return result


@scenario("map-read")
class MapRead:
    def __init__(self, ctx):
        self.ctx = ctx
        self.blocks = 16384 if ctx.quick else 262144
        self.logical = "4G" if ctx.quick else "64G"

    def job(self, server, *extra):
        return harness.fio(server.uri, "map", "randread", "4k", f"--size={self.logical}",
                           f"--io_size={self.blocks * harness.BLOCK}", "--random_generator=lfsr",
                           "--norandommap", "--randseed=3", *extra)

    def prepare(self, build):
        build.create(self.logical, "--physical", "4G")
        server = build.up()
        harness.fio(server.uri, "fill", "randwrite", "4k", f"--size={self.logical}",
                    f"--io_size={self.blocks * harness.BLOCK}", "--random_generator=lfsr",
                    "--norandommap", "--randseed=3", "--refill_buffers",
                    "--buffer_compress_percentage=50", "--end_fsync=1")
        build.down()

    def measure(self, build):
        server = build.up()
        self.job(server)  # every block once: the map's leaves come into RAM
        run = self.job(server, "--time_based", f"--runtime={2 if self.ctx.quick else 15}")
        build.down()
        return {"iops": harness.fio_job(run)["iops"]}


@scenario("idle-space", flags=())
class IdleSpace:
    def __init__(self, ctx):
        self.ctx = ctx

    def prepare(self, build):
        pass

    def measure(self, build):
        quick = self.ctx.quick
        build.create("1G", "--physical", "1G")
        server = build.up()
        harness.fio(server.uri, "churn", "randwrite", "4k", f"--size={64 if quick else 256}M",
                    "--time_based", f"--runtime={3 if quick else 20}",
                    "--buffer_compress_percentage=60", "--refill_buffers", "--fsync=64")
        busy = server.stats()
        time.sleep(7 if quick else 60)
        idle = server.stats()
        build.down()
        result = {"stored_bytes": idle["stored_bytes"],
                  "busy_physical_used_bytes": busy["physical_used_bytes"],
                  "idle_physical_used_bytes": idle["physical_used_bytes"],
                  "idle_sealed_under_10_percent_live": idle["sealed_utilization_histogram"][0],
                  "idle_segments_cleaned": idle["segments_cleaned"]}
        if "reclaimable_bytes" in busy:
            result["busy_reclaimable_bytes"] = busy["reclaimable_bytes"]
        return result


class Context:
    def __init__(self, args, work):
        self.quick = args.quick
        self.corpus = self.corpus_bytes = None
        self.logical = "1G"
        if SCENARIOS[args.scenario].corpus:
            size = (args.corpus_mib or (32 if args.quick else 512)) * harness.MIB
            self.corpus = harness.corpus(args.corpus, size, work)
            self.corpus_bytes = os.path.getsize(self.corpus)
            self.logical = str((self.corpus_bytes + 64 * harness.MIB) // harness.MIB * harness.MIB)
        self.logical_bytes = harness.parse_size(self.logical)


def ratios(rounds, top, bottom):
    out = {}
    for key in rounds[0][top]:
        values = [r[top][key] / r[bottom][key] for r in rounds if r[bottom].get(key)]
        if values:
            out[key] = {"median": harness.median(values), "min": min(values), "max": max(values)}
    return out


def body():
    parser = harness.parser(__doc__)
    parser.add_argument("--a", required=True, metavar="BIN_A", help="the first zdisk binary")
    parser.add_argument("--b", metavar="BIN_B", help="the second zdisk binary")
    parser.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    parser.add_argument("--rounds", type=harness.positive)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--nbdkit", action="store_true",
                        help="also measure nbdkit's memory plugin (read and write scenarios)")
    parser.add_argument("--corpus", help="the file to write and read (default: a tar of /usr)")
    parser.add_argument("--corpus-mib", type=harness.positive)
    parser.add_argument("--serve-flags", help="zdisk serve flags for both builds, replacing "
                                              "the scenario's")
    parser.add_argument("--dir", help="where images and corpus go (kept; default: a new "
                                      "directory in /dev/shm, removed at the end)")
    parser.add_argument("--json", help="also append the JSON object to this file")
    args = parser.parse_args()
    kind = SCENARIOS[args.scenario]
    if args.nbdkit and not kind.nbdkit:
        parser.error(f"--nbdkit applies to the read and write scenarios, not {args.scenario}")
    rounds = args.rounds or (2 if args.quick else 3)
    builds = [("A", harness.zdisk_binary(args.a))]
    if args.b:
        builds.append(("B", harness.zdisk_binary(args.b)))
    harness.require_tools("fio", "nbdcopy", *(["nbdkit"] if args.nbdkit else []))
    flags = shlex.split(args.serve_flags) if args.serve_flags is not None else kind.flags
    with harness.Teardown() as teardown:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        work = harness.workdir(teardown, args.dir, "ab.", base)
        ctx = Context(args, work)
        sides = [Build(label, zdisk, work, flags, teardown) for label, zdisk in builds]
        if args.nbdkit:
            sides.append(Build("nbdkit", None, work, flags, teardown))
        measured = kind(ctx)
        for side in sides:
            measured.prepare(side)
        results = []
        for n in range(rounds):
            this_round = {}
            for side in (sides if n % 2 == 0 else sides[::-1]):
                this_round[side.label] = measured.measure(side)
                figures = ", ".join(f"{k} {v:.4g}" for k, v in this_round[side.label].items())
                print(f"round {n + 1} {side.label}: {figures}", flush=True)
            results.append(this_round)
    labels = [side.label for side in sides]
    summary = {"scenario": args.scenario, "a": builds[0][1], "b": args.b and builds[1][1],
               "quick": args.quick, "serve_flags": flags, "corpus": ctx.corpus,
               "corpus_bytes": ctx.corpus_bytes, "rounds": results,
               "median": {label: {key: harness.median([r[label][key] for r in results])
                                  for key in results[0][label]} for label in labels}}
    for label in labels:
        print(f"{label} medians: " + ", ".join(f"{k} {v:.4g}"
                                               for k, v in summary["median"][label].items()))
    if args.b:
        summary["b_over_a"] = ratios(results, "B", "A")
        for key, r in summary["b_over_a"].items():
            print(f"B / A {key}: median {r['median']:.3f} (min {r['min']:.3f}, max {r['max']:.3f})")
    if args.nbdkit:
        summary["over_nbdkit"] = {label: {k: v["median"]
                                          for k, v in ratios(results, label, "nbdkit").items()}
                                  for label, _ in builds}
        for label, figures in summary["over_nbdkit"].items():
            print(f"{label} / nbdkit: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()))
    harness.emit_json(summary, args.json)


if __name__ == "__main__":
    harness.main("ab.py", body)
