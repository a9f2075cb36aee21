#!/usr/bin/env bash
# PostgreSQL fillfactor on a compressing drive (issue #13 part 3, the
# ScaleFlux case study): for FF = 100, 90, 75, 50, each on a fresh volume,
# ext4 on zdisk through nbdfuse and a loop device, `pgbench -i -s S -F FF`,
# then a timed TPC-B-like run; the same on a plain `nbdkit file` export of a
# sparse file (the non-compressing baseline, "baseline": true). Reports the
# database's size, zdisk's mapped and physical bytes, the compression ratio,
# TPS and latency. docs/case-studies.md (section 3) has the results.
#
# Usage: pg-fillfactor.sh [--quick] [--json FILE] [--zdisk BIN] [--dir DIR]
#        [--scale S] [--seconds T] [--clients C] [--jobs J] [--codec SPEC]
#        [--fillfactors 100,90,75,50] [--mkfs-options OPTS] [--mount-options OPTS]
#        [--no-baseline] [--rounds N] [--recompress MODE] [--breakdown]
#        [--pg-option NAME=VALUE]...
#   --quick    scale 5 (an 83 MB database at FF=100), 10 s runs, 4 GiB volumes:
#              about two minutes for all eight runs
#   default    scale 100 (a 1.5 GB database at FF=100: the accounts table is ten
#              times PostgreSQL's default shared_buffers, so updates go to pages
#              that must be written back), 180 s runs, 16 GiB volumes: about 30
#              minutes
#   --rounds N keep all eight volumes up at once and take the timed run in N
#              rounds in turn, so that drift and other work on the host weigh on
#              every configuration alike (TPS comparisons); zdisk then serves
#              with --recompress off, so idle volumes do not recompress while
#              the others are measured
#   --breakdown  also the file, non-zero and LZ4 bytes of the WAL, the pgbench
#              database and the rest of the cluster, and the free space in
#              pgbench_accounts' pages and how much of it is not zeros
#   --pg-option  a PostgreSQL setting for every cluster, e.g. synchronous_commit=off
#   --zdisk    default: target/release/zdisk of this workspace
#   --dir      where the per-run scratch directories go (default /var/tmp;
#              must be a disk filesystem with sparse files, not tmpfs)
#
# Needs root (losetup, mount), /dev/fuse, loop devices, nbdfuse and
# fusermount3 (fuse3, libnbd-bin), nbdkit, e2fsprogs, util-linux,
# PostgreSQL's server and client (postgresql), /usr/bin/python3. Everything
# it creates (servers, FUSE mounts, loop devices, mounts, the PostgreSQL
# cluster, images) is removed when it ends, also on failure or Ctrl-C.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"

zdisk="$repo/target/release/zdisk"
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --zdisk) zdisk="$2"; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) args+=("$1"); shift ;;
    esac
done

if [ "$(id -u)" != 0 ]; then
    echo "pg-fillfactor.sh: needs root (it creates loop devices and mounts ext4); run it with sudo" >&2
    exit 2
fi

missing=()
for f in /dev/fuse /dev/loop-control /usr/bin/python3; do
    [ -e "$f" ] || missing+=("$f")
done
for tool in nbdfuse fusermount3 nbdkit losetup mkfs.ext4 mount umount runuser truncate sync; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
pgbin="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)"
for tool in initdb pg_ctl postgres createdb psql pgbench; do
    [ -n "$pgbin" ] && [ -x "$pgbin/$tool" ] || missing+=("PostgreSQL's $tool")
done
getent passwd postgres >/dev/null || missing+=("the postgres user")
[ -x "$zdisk" ] || missing+=("$zdisk (cargo build --release, or --zdisk BIN)")
if [ ${#missing[@]} -gt 0 ]; then
    echo "pg-fillfactor.sh: missing prerequisites:" >&2
    printf '  %s\n' "${missing[@]}" >&2
    echo "Debian packages: postgresql fuse3 libnbd-bin nbdkit e2fsprogs util-linux python3" >&2
    exit 2
fi

exec /usr/bin/python3 "$here/pg_fillfactor.py" --zdisk "$zdisk" "${args[@]}"
