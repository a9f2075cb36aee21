#!/usr/bin/env bash
# Write amplification of an "OS install" on an emulated drive: a tree of
# real OS files is copied through ext4 onto an emulated compressing SSD
# served by zdisk in virtual time, and the drive's media bytes are compared
# with the host bytes ext4 wrote (docs/emulation.md).
#
# Usage (as root, with nbdfuse, losetup, mkfs.ext4):
#   os-install.sh [TREE] [PROFILE] [NAND_SIZE] [WORKDIR]
# defaults: /usr sf1200 16G a fresh directory under /tmp.
set -euo pipefail
tree=${1:-/usr}
profile=${2:-sf1200}
nand=${3:-16G}
work=${4:-$(mktemp -d /tmp/zdisk-os-install.XXXXXX)}
here=$(cd "$(dirname "$0")" && pwd)
zdisk=${ZDISK:-$here/../../../target/release/zdisk}

for tool in nbdfuse losetup mkfs.ext4 mount "$zdisk"; do
    command -v "$tool" >/dev/null || { echo "missing: $tool" >&2; exit 2; }
done
[ "$(id -u)" = 0 ] || { echo "needs root (loop device, mount)" >&2; exit 2; }

mkdir -p "$work/mnt"
server='' fuse='' loop=''
cleanup() {
    mountpoint -q "$work/mnt" && umount "$work/mnt"
    [ -n "$loop" ] && losetup -d "$loop" 2>/dev/null
    [ -n "$fuse" ] && { fusermount3 -u "$work/disk.raw" 2>/dev/null; wait "$fuse" 2>/dev/null; }
    [ -n "$server" ] && { kill -TERM "$server" 2>/dev/null; wait "$server" 2>/dev/null; }
    true
}
trap cleanup EXIT

"$zdisk" create "$work/drive.zdisk" --nand "$profile" --physical "$nand" --force
"$zdisk" serve "$work/drive.zdisk" --socket "$work/sock" --virtual-time 2>"$work/serve.log" &
server=$!
for _ in $(seq 100); do [ -S "$work/sock" ] && break; sleep 0.1; done
touch "$work/disk.raw"
nbdfuse "$work/disk.raw" "nbd+unix:///?socket=$work/sock" &
fuse=$!
for _ in $(seq 100); do [ -s "$work/disk.raw" ] && break; sleep 0.1; done
loop=$(losetup -f --show "$work/disk.raw")
mkfs.ext4 -q "$loop"
mount "$loop" "$work/mnt"
start=$(date +%s)
cp -a "$tree" "$work/mnt/"
du -sb "$work/mnt" | awk '{print "tree on ext4: " $1 " bytes"}'
umount "$work/mnt"
echo "copy and unmount: $(( $(date +%s) - start )) s of host time"
cleanup
server='' fuse='' loop=''
"$zdisk" stats "$work/drive.zdisk" --json >"$work/stats.json"
/usr/bin/python3 - "$work/stats.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
host, media = s["host_write_bytes"], s["media_write_bytes"]
for key in ("host_write_bytes", "media_write_bytes", "padding_bytes", "segment_tail_bytes",
            "gc_write_bytes", "mapped_bytes", "stored_bytes", "compression_ratio"):
    print(f"{key}: {s[key]}")
print(f"media / host write bytes: {media / host:.3f}")
PY
echo "image and logs in $work"
