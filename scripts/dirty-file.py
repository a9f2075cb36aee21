#!/usr/bin/python3
"""The SF-1200 dirty-drive test on a file medium, repeated.

`zdisk bench --scenario dirty` on an image in DIR, RUNS times; then each
run's "% of clean" figures and the figures pooled over every round of
every run (docs/emulation.md, "The same test on a file medium"). The last
line is one JSON object: {"runs": [...each run's bench JSON...],
"dirty_percent_of_clean": {"min", "median", "max"}, "after_trim_...": ...,
"pooled_dirty_percent_of_clean", "pooled_after_trim_percent_of_clean"}.

Defaults: 10 runs of a 2G volume on a 2192M file, 1G measured per state;
DIR (default: a temporary directory, removed at the end) needs room for
three images, about 3 x PHYSICAL.

  --quick   2 runs of a 64M volume on a 72M file, 16M per state (seconds)
"""

import json
import os
import subprocess

import harness


def body():
    parser = harness.parser(__doc__)
    harness.add_zdisk(parser)
    parser.add_argument("--dir", help="where the images and each run's JSON go (kept)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--runs", type=harness.positive)
    parser.add_argument("--logical")
    parser.add_argument("--physical")
    parser.add_argument("--size", help="bytes measured per state")
    parser.add_argument("--json", help="also append the summary JSON to this file")
    args = parser.parse_args()
    zdisk = harness.zdisk_binary(args.zdisk)
    runs = args.runs or (2 if args.quick else 10)
    logical = args.logical or ("64M" if args.quick else "2G")
    physical = args.physical or ("72M" if args.quick else "2192M")
    size = args.size or ("16M" if args.quick else "1G")
    with harness.Teardown() as teardown:
        work = harness.workdir(teardown, args.dir, "dirty-file.")
        results = []
        for run in range(1, runs + 1):
            out = os.path.join(work, f"run{run}.json")
            done = subprocess.run(
                [zdisk, "bench", "--quiet", "--force", "--image", os.path.join(work, "dirty.zdisk"),
                 "--scenario", "dirty", "--logical", logical, "--physical", physical,
                 "--size", size, "--json", out],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if done.returncode != 0:
                raise harness.Failure(f"zdisk bench (run {run}) failed: {done.stderr.strip()}")
            with open(out) as f:
                results.append(json.loads(f.readline()))
    summary = {"runs": results, "logical": logical, "physical": physical, "size": size}
    for i, r in enumerate(results, 1):
        print(f"run {i}: clean {r['clean_mb_s']:.1f} MB/s; dirty {r['dirty_percent_of_clean']:.1f} %, "
              f"after TRIM {r['after_trim_percent_of_clean']:.1f} % of clean; "
              f"WA {r['clean_write_amplification']:.3f} / {r['write_amplification']:.3f} / "
              f"{r['after_trim_write_amplification']:.3f}")
    for key, name in [("dirty_percent_of_clean", "dirty"),
                      ("after_trim_percent_of_clean", "after TRIM")]:
        values = [r[key] for r in results]
        summary[key] = {"min": min(values), "median": harness.median(values), "max": max(values)}
        print(f"{name}: min {min(values):.1f} median {harness.median(values):.1f} "
              f"max {max(values):.1f} % of clean over {runs} runs")
    seconds = {k: sum(sum(r["round_seconds"][k]) for r in results)
               for k in ("clean", "dirty", "after_trim")}
    summary["pooled_dirty_percent_of_clean"] = 100 * seconds["clean"] / seconds["dirty"]
    summary["pooled_after_trim_percent_of_clean"] = 100 * seconds["clean"] / seconds["after_trim"]
    print(f"pooled over {sum(r['rounds'] for r in results)} rounds: dirty "
          f"{summary['pooled_dirty_percent_of_clean']:.1f} %, after TRIM "
          f"{summary['pooled_after_trim_percent_of_clean']:.1f} % of clean")
    harness.emit_json(summary, args.json)


if __name__ == "__main__":
    harness.main("dirty-file.py", body)
