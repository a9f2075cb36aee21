#!/usr/bin/python3
"""Write amplification of an "OS install" on an emulated drive.

A tree of real OS files (/usr by default) is copied through ext4 onto an
emulated compressing SSD served by zdisk in virtual time (`zdisk create
--nand PROFILE`, `zdisk serve --virtual-time`, nbdfuse, a loop device,
mkfs.ext4, `cp -a`, umount), and the drive's media bytes are compared with
the host bytes ext4 wrote (docs/emulation.md, "Write amplification of an
OS install"). Prints the figures, then one JSON object: the stats fields
below, tree_bytes, host_seconds and media_per_host.

  --quick   /usr/share/doc onto a 1 GiB drive (under a minute)
  default   /usr onto a 16 GiB sf1200

Needs root (loop device, mount), /dev/fuse, nbdfuse, losetup, mkfs.ext4.
"""

import json
import os
import subprocess
import time

import harness

FIELDS = ("host_write_bytes", "media_write_bytes", "padding_bytes", "segment_tail_bytes",
          "gc_write_bytes", "mapped_bytes", "stored_bytes", "compression_ratio")


def body():
    parser = harness.parser(__doc__)
    harness.add_zdisk(parser)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tree", help="the directory copied (default /usr)")
    parser.add_argument("--profile", default="sf1200", help="the emulated drive (zdisk bench)")
    parser.add_argument("--nand", help="the drive's NAND size (default 16G)")
    parser.add_argument("--dir", help="where the image and the mount go (kept; default: a "
                                      "temporary directory, removed at the end)")
    parser.add_argument("--json", help="also append the JSON object to this file")
    args = parser.parse_args()
    tree = args.tree or ("/usr/share/doc" if args.quick else "/usr")
    nand = args.nand or ("1G" if args.quick else "16G")
    zdisk = harness.zdisk_binary(args.zdisk)
    harness.require_root("loop device, mount")
    harness.require_tools("nbdfuse", "fusermount3", "losetup", "mkfs.ext4")
    if not os.path.isdir(tree):
        raise harness.Failure(f"no directory {tree}")
    with harness.Teardown() as outer:
        work = harness.workdir(outer, args.dir, "os-install.")
        image = os.path.join(work, "drive.zdisk")
        harness.zdisk_create(zdisk, image, "--nand", args.profile, "--physical", nand, "--force")
        with harness.Teardown() as teardown:
            server = harness.Server(teardown, zdisk, image, os.path.join(work, "sock"),
                                    ["--virtual-time"], metrics=False)
            fs = harness.Ext4OnExport(teardown, server.uri, work, mkfs_options=())
            started = time.monotonic()
            harness.run(["cp", "-a", tree, fs.mnt + "/"])
            tree_bytes = int(harness.run(["du", "-sb", fs.mnt]).stdout.split()[0])
            fs.unmount()
            host_seconds = time.monotonic() - started
        # The drive has closed cleanly: its counters are final.
        done = subprocess.run([zdisk, "stats", image, "--json"], capture_output=True, text=True)
        if done.returncode != 0:
            raise harness.Failure(f"zdisk stats failed: {done.stderr.strip()}")
        stats = json.loads(done.stdout)
    result = {key: stats[key] for key in FIELDS}
    result.update(tree=tree, profile=args.profile, nand=nand, tree_bytes=tree_bytes,
                  host_seconds=host_seconds,
                  media_per_host=stats["media_write_bytes"] / stats["host_write_bytes"])
    print(f"tree on ext4: {tree_bytes} bytes")
    print(f"copy and unmount: {host_seconds:.0f} s of host time")
    for key in FIELDS:
        print(f"{key}: {stats[key]}")
    print(f"media / host write bytes: {result['media_per_host']:.3f}")
    harness.emit_json(result, args.json)


if __name__ == "__main__":
    harness.main("os-install.py", body)
