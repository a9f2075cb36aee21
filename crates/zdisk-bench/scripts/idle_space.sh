#!/bin/bash
# Space a volume takes while busy and once idle: a database-like churn
# (fio's nbd engine, random 4 KiB writes of 60%-compressible data over
# 256 MiB with an fsync every 64, for RUNTIME seconds) on a fresh 1 GiB
# image, then the server's /stats read at once and after IDLE seconds
# without requests. Prints one line per reading: stored bytes (what the
# data takes), physical_used_bytes (what the image holds), sealed segments
# under 10% live, segments cleaned. /stats is read over --metrics, so an
# older zdisk can be measured the same way for a baseline.
# Usage: idle_space.sh ZDISK_BIN LABEL [serve flags...]
# Environment: DIR (default /tmp/idle-space), PORT (19480), RUNTIME (20),
# IDLE (60). Needs fio with the nbd engine, curl and python3.
set -eu
bin=$1; label=$2; shift 2
port=${PORT:-19480}
dir=${DIR:-/tmp/idle-space}/$label
rm -rf "$dir"; mkdir -p "$dir"
"$bin" create "$dir/v.zdisk" --logical 1G --physical 1G > /dev/null
"$bin" serve "$dir/v.zdisk" --socket "$dir/n.sock" --metrics "127.0.0.1:$port" "$@" 2> "$dir/serve.log" &
server=$!
trap 'kill -INT $server 2> /dev/null; wait $server; rm -rf "$dir"' EXIT
for _ in $(seq 100); do grep -q 'listening on' "$dir/serve.log" && break; sleep 0.1; done
fio --name=churn --ioengine=nbd --uri="nbd+unix:///?socket=$dir/n.sock" --rw=randwrite --bs=4k \
    --iodepth=16 --size=256M --time_based --runtime="${RUNTIME:-20}" \
    --buffer_compress_percentage=60 --refill_buffers --fsync=64 --output=/dev/null
show() {
    curl -s "http://127.0.0.1:$port/stats" | /usr/bin/python3 -c '
import json, sys
s = json.load(sys.stdin)
mib = lambda key: s[key] / 2**20
print("%-12s %-8s stored %7.1f MiB  physical_used %7.1f MiB  reclaimable %s  sealed<10%%live %4d  cleaned %4d" % (
    sys.argv[1], sys.argv[2], mib("stored_bytes"), mib("physical_used_bytes"),
    "%7.1f MiB" % mib("reclaimable_bytes") if "reclaimable_bytes" in s else "      -    ",
    s["sealed_utilization_histogram"][0], s["segments_cleaned"]))' "$label" "$1"
}
show busy
sleep "${IDLE:-60}"
show "idle ${IDLE:-60}s"
