#!/usr/bin/python3
"""4 KiB random reads at QD1 while a writer streams, zdisk against nbdkit memory.

Each server gets one export of 8 x the corpus (4 GiB; image on tmpfs):
the corpus (--corpus FILE, else the first --corpus-mib MiB of a tar of
/usr: OS files) is copied to [0, corpus) with nbdcopy --flush, once. Then,
in each round and on each server (the order flips every other round), fio
through its nbd engine runs for --seconds:
  reads   job r alone: 4 KiB random reads at QD1 over [0, corpus);
  mixed   job r again, beside job w: 1 MiB sequential writes at QD8 over
          [2 x corpus, 6 x corpus) ([1 GiB, 3 GiB) by default), 60%
          compressible (--buffer_compress_percentage=60 --refill_buffers).
Prints per server and round: the writer's MB/s, the reads' IOPS and
completion latency p50 / p99 / p99.9 (us), alone and beside the writer;
then the medians and, per round, zdisk / nbdkit: read IOPS ratio and p99
ratio (alone and mixed) and the writer's MB/s ratio. --baseline BIN adds
a second zdisk build (e.g. main's), measured the same way in the same
rounds, and the ratios zdisk / baseline. The last line is one JSON object:
{"corpus_bytes", "seconds", "rounds": [{SERVER: {"reads": {...}, "mixed":
{...}}}...], "median": {SERVER: {...}}, "ratios": {"zdisk/nbdkit": {...}}}.

zdisk serves with its defaults (lz4) unless --codec (given to zdisk
create) or --serve-flags "..." (added to zdisk serve, e.g. "--recompress
off") say otherwise; both apply to the baseline too. Needs fio (nbd engine),
nbdcopy and nbdkit.

  --quick   1 round of 3 s, a 32 MiB corpus (256 MiB exports)
  default   2 rounds of 20 s, a 512 MiB corpus (4 GiB exports)
"""

import json
import os
import shlex
import subprocess

import harness

PERCENTILES = {"p50": "50.000000", "p99": "99.000000", "p99_9": "99.900000"}


class Peer:
    """One server under test: a zdisk build on a tmpfs image, or nbdkit
    memory; started once, filled once, kept up for every round."""

    def __init__(self, label, zdisk, args, work, teardown):
        self.label, self.zdisk, self.args = label, zdisk, args
        self.sock = os.path.join(work, f"{label}.sock")
        if zdisk:
            image = os.path.join(work, f"{label}.zdisk")
            create = ["--logical", args.export_bytes]
            if args.codec:
                create += ["--codec", args.codec]
            harness.zdisk_create(zdisk, image, *create, "--force")
            self.server = harness.Server(teardown, zdisk, image, self.sock,
                                         shlex.split(args.serve_flags or ""))
        else:
            self.server = harness.Nbdkit(teardown, self.sock, args.export_bytes)

    def fill(self, corpus):
        return harness.nbdcopy("--flush", corpus, self.server.uri)

    def measure(self, mixed):
        """One fio run: job r, and job w beside it if `mixed`."""
        args = self.args
        corpus = args.corpus_bytes
        command = ["fio", "--ioengine=nbd", f"--uri={self.server.uri}", "--output-format=json",
                   "--time_based", f"--runtime={args.seconds}",
                   "--name=r", "--rw=randread", "--bs=4k", "--iodepth=1",
                   "--offset=0", f"--size={corpus}", "--randrepeat=0"]
        if mixed:
            command += ["--name=w", "--rw=write", "--bs=1M", "--iodepth=8",
                        f"--offset={2 * corpus}", f"--size={4 * corpus}",
                        "--buffer_compress_percentage=60", "--refill_buffers"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise harness.Failure(f"fio on {self.label} failed: "
                                  f"{(done.stdout + done.stderr).strip()[-2000:]}")
        out = done.stdout
        if "{" not in out:
            raise harness.Failure(f"fio on {self.label} printed no JSON: {out[-500:]}")
        jobs = {job["jobname"]: job for job in json.loads(out[out.index("{"):])["jobs"]}
        read = jobs["r"]["read"]
        percentiles = read["clat_ns"].get("percentile", {})
        result = {"read_iops": read["iops"], "reads": read["total_ios"]}
        for name, key in PERCENTILES.items():
            if key not in percentiles:
                raise harness.Failure(f"fio reported no {key} percentile for {self.label}")
            result[f"read_{name}_us"] = percentiles[key] / 1000
        if mixed:
            write = jobs["w"]["write"]
            result["write_mb_s"] = write["bw_bytes"] / 1e6
        return result


def ratio(a, b):
    return a / b if b else None


def ratios(top, bottom):
    """`top` / `bottom` for the figures the issue's targets are about."""
    out = {}
    for phase in ("reads", "mixed"):
        out[f"{phase}_iops"] = ratio(top[phase]["read_iops"], bottom[phase]["read_iops"])
        out[f"{phase}_p99"] = ratio(top[phase]["read_p99_us"], bottom[phase]["read_p99_us"])
    out["write_mb_s"] = ratio(top["mixed"]["write_mb_s"], bottom["mixed"]["write_mb_s"])
    return out


def median_of(rows, key):
    return harness.median([row[key] for row in rows if row[key] is not None])


def report(result, labels, pairs):
    print(f"{'server':>9} {'round':>5} {'phase':>6} {'write MB/s':>10} {'read IOPS':>10} "
          f"{'p50 us':>8} {'p99 us':>8} {'p99.9 us':>9}")
    for label in labels:
        for n, rnd in enumerate(result["rounds"]):
            for phase in ("reads", "mixed"):
                r = rnd[label][phase]
                write = f"{r['write_mb_s']:>10.1f}" if "write_mb_s" in r else f"{'-':>10}"
                print(f"{label:>9} {n + 1:>5} {phase:>6} {write} {r['read_iops']:>10.0f} "
                      f"{r['read_p50_us']:>8.1f} {r['read_p99_us']:>8.1f} "
                      f"{r['read_p99_9_us']:>9.1f}")
    print()
    for name in pairs:
        rows = result["ratios"][name]["rounds"]
        print(f"{name}, per round then median:")
        print(f"{'':>7} {'reads IOPS':>10} {'reads p99':>10} {'mixed IOPS':>10} "
              f"{'mixed p99':>10} {'write MB/s':>10}")
        for n, row in enumerate(rows + [result["ratios"][name]["median"]]):
            cells = [row[k] for k in ("reads_iops", "reads_p99", "mixed_iops", "mixed_p99",
                                      "write_mb_s")]
            text = " ".join(f"{c:>9.2f}x" if c is not None else f"{'-':>10}" for c in cells)
            print(f"{(str(n + 1) if n < len(rows) else 'median'):>7} {text}")


def body():
    parser = harness.parser(__doc__)
    harness.add_zdisk(parser)
    parser.add_argument("--baseline", help="a second zdisk binary measured alongside")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=harness.positive)
    parser.add_argument("--seconds", type=harness.positive)
    parser.add_argument("--corpus", help="the file copied to [0, its size) (default: a tar of /usr)")
    parser.add_argument("--corpus-mib", type=harness.positive)
    parser.add_argument("--codec", help="zdisk create --codec (default: zdisk's, lz4)")
    parser.add_argument("--serve-flags", help='extra zdisk serve flags, e.g. "--recompress off"')
    parser.add_argument("--dir", help="where images and sockets go (default: a new directory "
                                      "under /dev/shm, removed at the end)")
    parser.add_argument("--json", help="also append the JSON object to this file")
    args = parser.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.seconds = args.seconds or (3 if args.quick else 20)
    corpus_mib = args.corpus_mib or (32 if args.quick else 512)
    zdisk = harness.zdisk_binary(args.zdisk)
    baseline = harness.zdisk_binary(args.baseline) if args.baseline else None
    harness.require_tools("fio", "nbdcopy", "nbdkit")
    with harness.Teardown() as teardown:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        work = harness.workdir(teardown, args.dir, "mixed-rw.", base=shm)
        corpus = harness.corpus(args.corpus, corpus_mib * harness.MIB, work)
        args.corpus_bytes = os.path.getsize(corpus) // harness.BLOCK * harness.BLOCK
        if args.corpus_bytes < harness.MIB:
            raise harness.Failure(f"the corpus {corpus} holds less than 1 MiB")
        args.export_bytes = 8 * args.corpus_bytes
        peers = [Peer("zdisk", zdisk, args, work, teardown)]
        if baseline:
            peers.append(Peer("baseline", baseline, args, work, teardown))
        peers.append(Peer("nbdkit", None, args, work, teardown))
        result = {"zdisk": zdisk, "baseline": baseline, "codec": args.codec,
                  "serve_flags": args.serve_flags, "corpus_bytes": args.corpus_bytes,
                  "seconds": args.seconds, "fill_seconds": {}, "rounds": []}
        for peer in peers:
            harness.progress("mixed-rw.py", f"{peer.label}: nbdcopy of the corpus")
            result["fill_seconds"][peer.label] = peer.fill(corpus)
        for n in range(args.rounds):
            rnd = {}
            for peer in peers if n % 2 == 0 else reversed(peers):
                harness.progress("mixed-rw.py", f"round {n + 1}: {peer.label}")
                rnd[peer.label] = {"reads": peer.measure(mixed=False),
                                   "mixed": peer.measure(mixed=True)}
            result["rounds"].append(rnd)
    labels = [peer.label for peer in peers]
    result["median"] = {
        label: {phase: {key: harness.median([r[label][phase][key] for r in result["rounds"]])
                        for key in result["rounds"][0][label][phase]}
                for phase in ("reads", "mixed")}
        for label in labels}
    pairs = {"zdisk/nbdkit": ("zdisk", "nbdkit")}
    if baseline:
        pairs["zdisk/baseline"] = ("zdisk", "baseline")
    result["ratios"] = {}
    for name, (top, bottom) in pairs.items():
        rows = [ratios(r[top], r[bottom]) for r in result["rounds"]]
        result["ratios"][name] = {"rounds": rows,
                                  "median": {k: median_of(rows, k) for k in rows[0]}}
    report(result, labels, pairs)
    harness.emit_json(result, args.json)


if __name__ == "__main__":
    harness.main("mixed-rw.py", body)
