#!/usr/bin/env bash
# The SF-1200 dirty-drive test on a file medium, repeated: `zdisk bench
# --scenario dirty` on an image in DIR, RUNS times, then each run's "% of
# clean" figures and the figures pooled over every round of every run
# (docs/emulation.md, "The same test on a file medium").
#
# Usage: dirty-file.sh DIR [RUNS] [LOGICAL] [PHYSICAL] [SIZE]
# defaults: 10 runs of a 2G volume on a 2192M file, 1G measured per state.
# DIR needs room for three images (about 3 × PHYSICAL).
set -euo pipefail
dir=${1:?usage: dirty-file.sh DIR [RUNS] [LOGICAL] [PHYSICAL] [SIZE]}
runs=${2:-10}
logical=${3:-2G}
physical=${4:-2192M}
size=${5:-1G}
here=$(cd "$(dirname "$0")" && pwd)
zdisk=${ZDISK:-$here/../../../target/release/zdisk}
[ -x "$zdisk" ] || { echo "missing: $zdisk (cargo build --release)" >&2; exit 2; }
mkdir -p "$dir"

for run in $(seq 1 "$runs"); do
    "$zdisk" bench --quiet --force --image "$dir/dirty.zdisk" --scenario dirty \
        --logical "$logical" --physical "$physical" --size "$size" \
        --json "$dir/run$run.json" >/dev/null
done

python3 - "$dir" "$runs" <<'PY'
import json, statistics, sys

folder, count = sys.argv[1], int(sys.argv[2])
runs = [json.loads(open(f"{folder}/run{i}.json").readline()) for i in range(1, count + 1)]
for i, r in enumerate(runs, 1):
    print(f"run {i}: clean {r['clean_mb_s']:.1f} MB/s; dirty {r['dirty_percent_of_clean']:.1f} %, "
          f"after TRIM {r['after_trim_percent_of_clean']:.1f} % of clean; "
          f"WA {r['clean_write_amplification']:.3f} / {r['write_amplification']:.3f} / "
          f"{r['after_trim_write_amplification']:.3f}")
for key, name in [("dirty_percent_of_clean", "dirty"), ("after_trim_percent_of_clean", "after TRIM")]:
    values = [r[key] for r in runs]
    print(f"{name}: min {min(values):.1f} median {statistics.median(values):.1f} "
          f"max {max(values):.1f} % of clean over {count} runs")
seconds = {k: sum(sum(r["round_seconds"][k]) for r in runs) for k in ("clean", "dirty", "after_trim")}
print(f"pooled over {sum(r['rounds'] for r in runs)} rounds: dirty "
      f"{100 * seconds['clean'] / seconds['dirty']:.1f} %, after TRIM "
      f"{100 * seconds['clean'] / seconds['after_trim']:.1f} % of clean")
PY
