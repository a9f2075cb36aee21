#!/bin/bash
# The table-less hash store (zdisk-kv) against RocksDB on ext4, both on
# zdisk volumes of the same kind, with the same YCSB-style driver: load,
# then workloads A, B, C, F and D (400 B pairs, zipfian keys, the same
# number of pairs and client threads). Case study 2 in docs/case-studies.md.
#
#   kv           the store on a zdisk export, through its own NBD client
#   rocksdb-lz4  RocksDB (LZ4) on ext4 on zdisk: nbdfuse, loop, mkfs.ext4
#   rocksdb-none RocksDB without compression, same stack
#
# Each engine gets a fresh zdisk image (lz4 codec) served with --metrics;
# after every phase the driver flushes (RocksDB: its memtable; then sync
# and fstrim for ext4) and reads zdisk's /stats. One JSON object per phase
# per engine is appended to FILE: engine, workload, ops_per_s, p50_us,
# p99_us, p999_us, cpu_us_per_op (client + zdisk + nbdfuse processes),
# rss_bytes (the driver with its engine), server_rss_bytes (zdisk),
# mapped_bytes, stored_bytes, physical_bytes (= stored_bytes: live
# compressed extents), physical_used_bytes (with garbage not yet cleaned).
#
# Needs root, fuse3 (nbdfuse), util-linux, e2fsprogs, and RocksDB's shared
# library (Debian: apt-get install rocksdb-tools). Builds nothing: run
# `cargo build --release` first.
#
# Usage: kv-vs-rocksdb.sh [--quick] --json FILE [--records N] [--seconds S]
#          [--threads T] [--dir DIR] [--engines "kv rocksdb-lz4 rocksdb-none"]
#   --quick: 300 000 pairs, 10 s per workload (a few minutes in all).
#   default: 5 000 000 pairs, 60 s per workload.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
zdisk=${ZDISK:-$root/target/release/zdisk}
zdisk_kv=${ZDISK_KV:-$root/target/release/zdisk-kv}
quick=0 json="" records="" seconds="" threads=2 dir=/dev/shm/kv-vs-rocksdb
engines="kv rocksdb-lz4 rocksdb-none"

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-2}"; }
die() { echo "kv-vs-rocksdb.sh: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        --quick) quick=1 ;;
        --json) json=${2:?--json needs a file}; shift ;;
        --records) records=${2:?}; shift ;;
        --seconds) seconds=${2:?}; shift ;;
        --threads) threads=${2:?}; shift ;;
        --dir) dir=${2:?}; shift ;;
        --engines) engines=${2:?}; shift ;;
        -h|--help) usage 0 ;;
        *) echo "kv-vs-rocksdb.sh: unknown argument $1" >&2; usage ;;
    esac
    shift
done
[ -n "$json" ] || die "--json FILE is required"
if [ "$quick" = 1 ]; then
    records=${records:-300000} seconds=${seconds:-10}
else
    records=${records:-5000000} seconds=${seconds:-60}
fi
case "$records$seconds$threads" in *[!0-9.]*) die "--records, --seconds and --threads take numbers" ;; esac
[ "$(id -u)" = 0 ] || die "needs root (losetup, mount)"
for tool in "$zdisk" "$zdisk_kv"; do
    [ -x "$tool" ] || die "$tool not found: run cargo build --release"
done
for tool in nbdfuse fusermount3 losetup mkfs.ext4 fstrim curl; do
    command -v "$tool" >/dev/null || die "$tool is not installed"
done
json=$(realpath -m "$json")
: > "$json"

# Logical size: the store's slots (~0.9 KB a pair at half fill, with room
# for D's inserts) or RocksDB's files with room to compact, plus slack.
logical_gib=$(( (records * 2048 >> 30) + 2 ))

cleanup=()
teardown() {
    local i
    for (( i=${#cleanup[@]}-1; i>=0; i-- )); do
        eval "${cleanup[$i]}" || echo "teardown: ${cleanup[$i]} failed" >&2
    done
    cleanup=()
}
trap teardown EXIT

free_port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_for() {  # wait_for SECONDS WHAT COMMAND...
    local deadline=$(( $(date +%s) + $1 )) what=$2; shift 2
    until "$@"; do
        [ "$(date +%s)" -lt "$deadline" ] || die "timed out waiting for $what"
        sleep 0.05
    done
}

run_engine() {
    local engine=$1 work="$dir/$1"
    rm -rf "$work"; mkdir -p "$work"
    local image="$work/vol.zdisk" sock="$work/nbd.sock" port
    port=$(free_port)
    "$zdisk" create "$image" --logical "${logical_gib}G" --codec lz4 >/dev/null
    "$zdisk" serve "$image" --socket "$sock" --metrics "127.0.0.1:$port" 2>"$work/serve.log" &
    local server=$!
    cleanup+=("kill -TERM $server; wait $server || true")
    wait_for 60 "zdisk serve" test -S "$sock"
    local common=(ycsb --records "$records" --seconds "$seconds" --threads "$threads"
                  --metrics "127.0.0.1:$port" --json "$json" --label "$([ $quick = 1 ] && echo quick || echo full)")
    echo "== $engine: $records pairs, $seconds s per workload, $threads threads" >&2
    if [ "$engine" = kv ]; then
        "$zdisk_kv" "${common[@]}" --engine kv --device "nbd+unix:///?socket=$sock" \
            --watch-pid "$server" >&2
    else
        local raw="$work/nbd.raw" mnt="$work/mnt" loop fuse
        mkdir -p "$mnt"; : > "$raw"
        nbdfuse "$raw" "nbd+unix:///?socket=$sock" &
        fuse=$!
        cleanup+=("fusermount3 -u $raw; wait $fuse || true")
        wait_for 60 "nbdfuse" test -s "$raw"
        # Direct I/O from the loop device to the FUSE file: no second page
        # cache under ext4 that would serve reads the store must fetch.
        loop=$(losetup --direct-io=on -f --show "$raw")
        cleanup+=("losetup -d $loop")
        mkfs.ext4 -q -E nodiscard,lazy_itable_init=0,lazy_journal_init=0 "$loop"
        mount "$loop" "$mnt"
        cleanup+=("umount $mnt")
        "$zdisk_kv" "${common[@]}" --engine rocksdb --db "$mnt/db" \
            --compression "${engine#rocksdb-}" --watch-pid "$server" --watch-pid "$fuse" \
            --settle-cmd "sync; fstrim $mnt" >&2
        du -sb "$mnt/db" >&2
    fi
    teardown
    rm -rf "$work"
}

mkdir -p "$dir"
for engine in $engines; do
    case "$engine" in
        kv|rocksdb-lz4|rocksdb-none) run_engine "$engine" ;;
        *) die "unknown engine $engine" ;;
    esac
done
echo "results: $json" >&2
