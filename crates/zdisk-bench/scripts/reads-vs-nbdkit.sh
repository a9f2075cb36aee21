#!/bin/bash
# reads-vs-nbdkit.sh ROUNDS BIN... : nbdkit's memory plugin against each
# zdisk build BIN (lz4, the default), all holding the same corpus, read by
# fio's nbd engine in interleaved rounds; prints each run (MB/s, the
# server's CPU seconds per GB, fio's), then per build the median ratio to
# nbdkit in the same round and the median server CPU.
# Env: RW=read|randread (read), BS (1M), QD (8; per job, 2 jobs),
# LOOPS (3), CORPUS (/dev/shm/usr512.tar), DIR (/dev/shm/reads-vs-nbdkit).
set -u
RW=${RW:-read}; BS=${BS:-1M}; QD=${QD:-8}; LOOPS=${LOOPS:-3}
CORPUS=${CORPUS:-/dev/shm/usr512.tar}; D=${DIR:-/dev/shm/reads-vs-nbdkit}
ROUNDS=$1; shift; BINS=("$@")
[ -r "$CORPUS" ] || { echo "no corpus at $CORPUS (set CORPUS)"; exit 2; }
rm -rf "$D"; mkdir -p "$D"; OUT=$D/runs.txt
declare -A PID
nbdkit --foreground --unix "$D/k.sock" memory 600M 2>/dev/null & PID[k]=$!
for i in "${!BINS[@]}"; do
  "${BINS[$i]}" create "$D/z$i.zdisk" --logical 600M >/dev/null
  "${BINS[$i]}" serve "$D/z$i.zdisk" --socket "$D/z$i.sock" --recompress off 2>/dev/null &
  PID[z$i]=$!
done
cleanup() { kill "${PID[@]}" 2>/dev/null; wait 2>/dev/null; }
trap cleanup EXIT
NAMES=(k); for i in "${!BINS[@]}"; do NAMES+=("z$i"); done
for n in $(seq 100); do
  ready=1; for x in "${NAMES[@]}"; do [ -S "$D/$x.sock" ] || ready=0; done
  [ $ready = 1 ] && break; sleep 0.1
done
for x in "${NAMES[@]}"; do nbdcopy "$CORPUS" "nbd+unix:///?socket=$D/$x.sock"; done
for r in $(seq "$ROUNDS"); do for x in "${NAMES[@]}"; do
  P=${PID[$x]}; c0=$(awk '{print $14+$15}' /proc/$P/stat)
  json=$( { /usr/bin/time -f "FIOCPU %U %S" fio --name=r --ioengine=nbd \
      --uri="nbd+unix:///?socket=$D/$x.sock" --rw="$RW" --bs="$BS" --iodepth="$QD" \
      --numjobs=2 --offset_increment=256M --size=256M --loops="$LOOPS" \
      --group_reporting --output-format=json; } 2>&1 )
  c1=$(awk '{print $14+$15}' /proc/$P/stat)
  echo "$json" | /usr/bin/python3 -c "
import json, re, sys
s = sys.stdin.read(); cpu = re.search(r'FIOCPU (\S+) (\S+)', s)
job = json.loads(s[s.index('{'):s.rindex('}') + 1])['jobs'][0]['read']
gb = job['io_bytes'] / 1e9
print('round $r $x %.0f MB/s server %.3f s/GB fio %.3f s/GB' % (
    job['bw_bytes'] / 1e6, ($c1 - $c0) / 100 / gb, (float(cpu[1]) + float(cpu[2])) / gb))" | tee -a "$OUT"
done; done
echo "builds: k = nbdkit memory$(for i in "${!BINS[@]}"; do printf ', z%s = %s' "$i" "${BINS[$i]}"; done)"
/usr/bin/python3 - "$OUT" <<'PY'
import re, statistics, sys
rounds = {}
for line in open(sys.argv[1]):
    m = re.match(r'round (\d+) (\S+) (\d+) MB/s server ([\d.]+) s/GB', line)
    if m:
        rounds.setdefault(m[1], {})[m[2]] = (float(m[3]), float(m[4]))
for name in sorted({n for r in rounds.values() for n in r}):
    ratios = [r[name][0] / r['k'][0] for r in rounds.values()]
    server = [r[name][1] for r in rounds.values()]
    print(f"{name}: x nbdkit median {statistics.median(ratios):.2f} "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f}); "
          f"server CPU median {statistics.median(server):.3f} s/GB")
PY
