#!/bin/bash
# 4 KiB random reads with the whole map cached: two zdisk builds, in
# interleaved rounds (a shared host's speed drifts between rounds).
# Each build fills its own 64 GiB image with 262,144 random 4 KiB blocks
# (fio, LFSR, half-compressible), then each round restarts each server,
# reads every block once (the map's leaves come into RAM) and measures
# 15 s of random reads of the same blocks at queue depth 16.
# Usage: map_read_ab.sh BASE_ZDISK NEW_ZDISK [DIR] [ROUNDS]
set -e
BASE=${1:?base zdisk binary}; NEW=${2:?new zdisk binary}
D=${3:-/var/tmp/map_read_ab}; ROUNDS=${4:-3}
rm -rf "$D"; mkdir -p "$D"
declare -A BIN=([base]=$BASE [new]=$NEW)
job() { # name, socket, extra fio arguments
  fio --name="$1" --ioengine=nbd --uri="nbd+unix:///?socket=$2" --bs=4k --size=64G --io_size=1G \
      --random_generator=lfsr --norandommap --randseed=3 --iodepth=16 "${@:3}"
}
start() { ${BIN[$1]} serve "$D/$1.zdisk" --socket "$D/$1.sock" --recompress off >/dev/null 2>&1 & pid=$!
          while [ ! -S "$D/$1.sock" ]; do sleep 0.1; done; }
stop() { kill -INT "$pid"; wait "$pid" || true; rm -f "$D/$1.sock"; }
for v in base new; do
  ${BIN[$v]} create "$D/$v.zdisk" --logical 64G --physical 4G >/dev/null
  start $v
  job fill "$D/$v.sock" --rw=randwrite --refill_buffers --buffer_compress_percentage=50 >/dev/null
  stop $v
done
for round in $(seq "$ROUNDS"); do
  for v in base new; do
    start $v
    job warm "$D/$v.sock" --rw=randread >/dev/null
    iops=$(job read "$D/$v.sock" --rw=randread --time_based --runtime=15 --output-format=json |
           /usr/bin/python3 -c 'import json,sys; t=sys.stdin.read(); print(round(json.loads(t[t.index("{"):])["jobs"][0]["read"]["iops"]))')
    echo "round $round $v $iops IOPS"
    stop $v
  done
done
rm -rf "$D"
