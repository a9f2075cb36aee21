#!/usr/bin/python3
"""Snapshots and clones: what one costs as the volume grows, ten snapshots
of an OS image that keeps changing, and ten clones of one, beside btrfs
and qcow2 (issue #26).

Everything on tmpfs (a new directory in /dev/shm, removed at the end).

cost: two volumes, each served and written by nbdcopy from nbdkit's
  pattern plugin (every 8 bytes hold their own offset, so every block is
  distinct and none is zero):
  - small: --small-logical (1 GiB) with all of it mapped;
  - large: --large-logical (1 TiB) with --large-mapped (16 GiB) mapped.
  Then --takes (5) snapshots of each, one after another through
  `zdisk snapshot IMAGE NAME` while served. For each: the command's wall
  time (its process start and the control socket included), and what the
  image wrote for it: media_write_bytes and metadata_bytes from /stats
  before and after. Then as many clones of the first snapshot through
  `zdisk clone IMAGE SNAPSHOT NAME`, measured the same way. Then each
  clone and each snapshot deleted with `zdisk delete`, timed. Printed:
  median and largest time and bytes per volume, and the large volume's
  median time over the small one's, for snapshots and for clones.

series: the two-image layout of scripts/dedup.py (two ext4 images made by
  `mkfs.ext4 -d`, tree A copies of /usr/share/doc, /usr/lib/python3 and
  /usr/share/perl, tree B the same plus /usr/share/i18n, at offsets 0 and
  512 MiB), written once; then --rounds (10) rounds of: a snapshot, then
  5% of the layout's non-zero 4 KiB blocks, chosen at random each round
  (seed fixed), overwritten with random bytes. The same rounds, the same
  blocks and bytes, on:
  - zdisk, for each configuration in CONFIGS: the layout by nbdcopy, the
    snapshots by `zdisk snapshot` while served, the blocks by libnbd
    pwrite and a flush; stored bytes from /stats (stored_bytes, and
    metadata_bytes: map pages, checkpoints and the metadata area);
  - btrfs compress-force=zstd:1 on a loop device: the layout one file in
    a subvolume, `btrfs subvolume snapshot -r` per round, the blocks
    written in place with pwrite and fsync; stored bytes from compsize's
    disk usage over the subvolume and its snapshots (shared extents
    counted once; btrfs's own metadata not included);
  - qcow2: `qemu-img convert` of the layout, `qemu-img snapshot -c` per
    round, the blocks written by one qemu-io per round (with a byte
    pattern: qcow2 does not compress, so the bytes do not change what it
    stores); stored bytes are the file's allocated bytes.
  Printed per system: stored bytes after the first write and after the
  rounds; the target of issue #26, 1.05 x (first write + the rewritten
  blocks) + 2 MiB per snapshot, the rewritten blocks counted at 4 KiB
  plus a 32-byte record header each (random bytes do not compress); the
  median and largest snapshot time; for zdisk, 4 KiB
  random reads (fio, --read-seconds each, best of two) of the oldest
  snapshot after the rounds against the volume's before them (the same
  bytes: the snapshot reads through ten spaces and the entries kept for
  it, the volume did not); and after every snapshot is
  deleted and `zdisk compact` run, stored bytes against a fresh image
  holding only the volume's final contents (copied by nbdcopy).
clones: the same layout written once and a snapshot of it; then --rounds
  (10) clones of that one snapshot, each with its own 5% of the layout's
  non-zero blocks (the series' plan, round i for clone i) overwritten with
  random bytes. The same blocks and bytes on:
  - zdisk, for each configuration in CONFIGS: `zdisk clone` while served,
    the blocks by libnbd pwrite to the clone's own export and a flush;
    stored bytes from /stats (stored_bytes: every record the map names,
    the clones' included, plus metadata_bytes);
  - btrfs compress-force=zstd:1: `btrfs subvolume snapshot` (writable) of
    the subvolume per clone, the blocks written into the clone's file;
    compsize over the subvolume and the clones;
  - qcow2 backing files: `qemu-img create -b` per clone over a qcow2 copy
    of the layout, the blocks written by qemu-io; the allocated bytes of
    the base and every clone.
  Printed per system: stored bytes before the clones and after; the
  target of issue #26 for clones, 1.05 x (one image + the rewritten
  blocks) + 2 MiB per clone; the median clone time; for zdisk, 4 KiB random
  reads (fio, best of two) of the last clone (95% of its blocks unchanged,
  read through the snapshot) over the volume's before the clones; and
  after every clone and the snapshot are deleted and `zdisk compact` run,
  stored bytes over the volume's own before the clones (it did not
  change).
Then one JSON object per row (also appended to --json FILE).

Needs nbdcopy, nbdkit, fio, mkfs.ext4, python3-libnbd; root for btrfs
(loop mounts; or --skip-btrfs), qemu-img and qemu-io for qcow2 (or
--skip-qcow2). About 6 GiB of /dev/shm with the defaults.

  --parts cost,series,clones which parts to run (default all three)
  --quick                    cost: 64 MiB small, 1 TiB with 1 GiB mapped;
                             series and clones: tree A of /usr/share/perl
                             only, 3 rounds, 3 s reads
"""

import os
import random
import subprocess
import time

import harness

IMAGE_BYTES = harness.OS_IMAGE_BYTES
TREE_A, TREE_A_QUICK = harness.OS_TREE_A, harness.OS_TREE_A_QUICK
TREE_B_EXTRA = harness.OS_TREE_B_EXTRA
SEED = 26
REWRITTEN_SHARE = 0.05
TARGET_SLACK = 1.05
TARGET_PER_SNAPSHOT = 2 * harness.MIB
# A record header: what a stored block costs beyond its payload (format.md).
RECORD_HEADER = 32

# The zdisk configurations: a name, `zdisk create` words, `zdisk serve` words.
CONFIGS = [
    ("zdisk lz4", [], ["--recompress", "off"]),
    ("zdisk zstd", ["--codec", "zstd"], ["--recompress", "off"]),
]
BTRFS = "btrfs compress-force=zstd:1"
QCOW2 = "qcow2 internal snapshots"
QCOW2_CLONES = "qcow2 backing files"


def zdisk_command(zdisk, *words):
    done = subprocess.run([zdisk, *map(str, words)], capture_output=True, text=True)
    if done.returncode != 0:
        raise harness.Failure(f"zdisk {' '.join(map(str, words))} failed: {done.stderr.strip()}")
    return done.stdout


def timed(action):
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def mib(value):
    return f"{value / harness.MIB:.1f}"


def size(value):
    return f"{value >> 30} GiB" if value >= 1 << 30 else f"{value >> 20} MiB"


def ms(value):
    return f"{value * 1e3:.1f}"


# ---- cost ---------------------------------------------------------------


def cost_volume(ctx, zdisk, name, logical, mapped, takes):
    image = os.path.join(ctx.work, f"{name}.zdisk")
    harness.zdisk_create(zdisk, image, "--logical", logical, "--physical", mapped * 2)
    with harness.Teardown() as teardown:
        teardown.push(f"remove {image}", lambda: os.remove(image))
        server = harness.Server(teardown, zdisk, image, os.path.join(ctx.work, f"{name}.sock"),
                                flags=["--recompress", "off", "--idle-compact", "off"])
        harness.progress("snapshots.py", f"cost: writing {mapped >> 20} MiB into {name}")
        written = harness.nbdcopy("--flush", "--", "[", "nbdkit", "pattern", str(mapped), "]",
                                  server.uri)
        stats = server.stats()
        if stats["mapped_bytes"] < mapped:
            raise harness.Failure(f"{name}: {stats['mapped_bytes']} bytes mapped, not {mapped}")
        takes_rows = []
        for index in range(takes):
            before = server.stats()
            seconds = timed(lambda: zdisk_command(zdisk, "snapshot", image, f"s{index}"))
            after = server.stats()
            takes_rows.append({
                "seconds": seconds,
                "media_write_bytes": after["counters"]["media_write_bytes"]
                - before["counters"]["media_write_bytes"],
                "metadata_growth_bytes": after["metadata_bytes"] - before["metadata_bytes"],
            })
        clone_rows = []
        for index in range(takes):
            before = server.stats()
            seconds = timed(lambda: zdisk_command(zdisk, "clone", image, "s0", f"c{index}"))
            after = server.stats()
            clone_rows.append({
                "seconds": seconds,
                "media_write_bytes": after["counters"]["media_write_bytes"]
                - before["counters"]["media_write_bytes"],
                "metadata_growth_bytes": after["metadata_bytes"] - before["metadata_bytes"],
            })
        deletes = [timed(lambda: zdisk_command(zdisk, "delete", image, f"c{index}"))
                   for index in range(takes)]
        deletes += [timed(lambda: zdisk_command(zdisk, "delete", image, f"s{index}"))
                    for index in range(takes)]
        server.stop()
    return {"volume": name, "logical_bytes": logical, "mapped_bytes": stats["mapped_bytes"],
            "stored_bytes": stats["stored_bytes"], "write_seconds": written,
            "takes": takes_rows, "clones": clone_rows, "delete_seconds": deletes}


def run_cost(ctx, zdisk):
    rows = [cost_volume(ctx, zdisk, "small", ctx.small_logical, ctx.small_logical, ctx.takes),
            cost_volume(ctx, zdisk, "large", ctx.large_logical, ctx.large_mapped, ctx.takes)]
    body = []
    for row in rows:
        for kind, key in (("snapshot", "takes"), ("clone", "clones")):
            times = [take["seconds"] for take in row[key]]
            media = [take["media_write_bytes"] for take in row[key]]
            meta = [take["metadata_growth_bytes"] for take in row[key]]
            body.append([f"{size(row['logical_bytes'])}, {size(row['mapped_bytes'])} mapped",
                         kind, ms(harness.median(times)), ms(max(times)),
                         str(int(harness.median(media))), str(max(media)), str(max(meta))])
    print("\nSnapshot and clone cost (zdisk snapshot, zdisk clone through the control socket, "
          "one after another)")
    harness.print_table(["volume", "what", "median ms", "max ms", "median bytes written",
                         "max bytes written", "max metadata growth"], body)
    for kind, key in (("snapshot", "takes"), ("clone", "clones")):
        small, large = (harness.median([t["seconds"] for t in row[key]]) for row in rows)
        print(f"  {kind}: large over small, median time: {large / small:.2f}x")
    print(f"  delete median ms: "
          + ", ".join(f"{row['volume']} {ms(harness.median(row['delete_seconds']))}"
                      for row in rows))
    for row in rows:
        harness.emit_json(dict(row, part="cost"), ctx.json)


# ---- series -------------------------------------------------------------


def make_layout(ctx, quick):
    """The two-image layout as one sparse file; returns its path."""
    sources = TREE_A_QUICK if quick else TREE_A
    images = []
    for name, extra in (("a", []), ("b", TREE_B_EXTRA)):
        tree = harness.make_tree(ctx.work, f"tree-{name}", sources + extra)
        image = os.path.join(ctx.work, f"{name}.img")
        harness.run(["mkfs.ext4", "-q", "-d", tree, image, "512M"])
        harness.run(["rm", "-rf", "--one-file-system", tree])
        images.append(image)
    layout = os.path.join(ctx.work, "layout.img")
    with open(layout, "wb") as f:
        f.truncate(2 * IMAGE_BYTES)
    for index, image in enumerate(images):
        harness.run(["dd", f"if={image}", f"of={layout}", "bs=1M", f"seek={index * 512}",
                     "conv=notrunc,sparse", "status=none"])
        os.remove(image)
    return layout


def plan_rounds(blocks, rounds):
    """Per round, the blocks to overwrite (sorted) and a seed for their bytes."""
    rng = random.Random(SEED)
    count = max(1, round(len(blocks) * REWRITTEN_SHARE))
    return [(sorted(rng.sample(blocks, count)), SEED * 1000 + index) for index in range(rounds)]


def round_bytes(seed, count):
    """The random bytes of a round's blocks, the same for every system."""
    return random.Random(seed).randbytes(count * harness.BLOCK)


def zdisk_series(ctx, zdisk, layout, plan, name, create_words, serve_words):
    image = os.path.join(ctx.work, "series.zdisk")
    fresh = os.path.join(ctx.work, "fresh.zdisk")
    harness.zdisk_create(zdisk, image, "--logical", 2 * IMAGE_BYTES, *create_words)
    with harness.Teardown() as teardown:
        teardown.push(f"remove {image}", lambda: os.remove(image))
        sock = os.path.join(ctx.work, "series.sock")
        server = harness.Server(teardown, zdisk, image, sock, flags=serve_words)
        harness.nbdcopy("--flush", layout, server.uri)
        first = server.stats()
        before = random_reads(ctx, sock, "")
        import nbd  # python3-libnbd, under /usr/bin/python3

        handle = nbd.NBD()
        handle.connect_unix(sock)
        takes = []
        for index, (blocks, seed) in enumerate(plan):
            takes.append(timed(lambda: zdisk_command(zdisk, "snapshot", image, f"r{index}")))
            data = round_bytes(seed, len(blocks))
            for at, block in enumerate(blocks):
                chunk = data[at * harness.BLOCK:(at + 1) * harness.BLOCK]
                handle.pwrite(chunk, block * harness.BLOCK)
            handle.flush()
        handle.shutdown()
        after = server.stats()
        oldest = random_reads(ctx, sock, "r0")
        harness.progress("snapshots.py", f"series: {name}: deleting the snapshots, compacting")
        deletes = [timed(lambda: zdisk_command(zdisk, "delete", image, f"r{index}"))
                   for index in range(len(plan))]
        compact = timed(lambda: zdisk_command(zdisk, "compact", image))
        cleaned = server.stats()
        harness.zdisk_create(zdisk, fresh, "--logical", 2 * IMAGE_BYTES, *create_words)
        teardown.push(f"remove {fresh}", lambda: os.remove(fresh))
        other = harness.Server(teardown, zdisk, fresh, os.path.join(ctx.work, "fresh.sock"),
                               flags=serve_words)
        harness.nbdcopy("--flush", server.uri, other.uri)
        alone = other.stats()
        other.stop()
        server.stop()
    return {"first_stored_bytes": first["stored_bytes"],
            "first_metadata_bytes": first["metadata_bytes"],
            "stored_bytes": after["stored_bytes"], "metadata_bytes": after["metadata_bytes"],
            "snapshot_kept_bytes": after["snapshot_kept_bytes"],
            "snapshot_seconds": takes, "delete_seconds": deletes, "compact_seconds": compact,
            "after_delete_stored_bytes": cleaned["stored_bytes"],
            "fresh_copy_stored_bytes": alone["stored_bytes"],
            "after_delete_baseline_bytes": alone["stored_bytes"], "volume_read_iops": before,
            "snapshot_read_iops": oldest}


def random_reads(ctx, sock, export):
    """4 KiB random reads over the whole export, best of two runs: IOPS."""
    best = 0.0
    for _ in range(2):
        result = harness.fio(f"nbd+unix:///{export}?socket={sock}", "read", "randread", "4k",
                             "--time_based", f"--runtime={ctx.read_seconds}",
                             f"--size={2 * IMAGE_BYTES}")
        best = max(best, harness.fio_job(result)["iops"])
    return best


def btrfs_series(ctx, layout, plan):
    with harness.Teardown() as teardown:
        mount = harness.btrfs_mount(teardown, ctx.work, 8 << 30)
        volume = os.path.join(mount, "volume")
        harness.run(["btrfs", "subvolume", "create", volume])
        target = os.path.join(volume, "layout.img")
        harness.run(["cp", "--sparse=always", layout, target])
        harness.run(["sync", "-f", target])
        first = harness.compsize_bytes([volume])
        takes = []
        snapshots = []
        for index, (blocks, seed) in enumerate(plan):
            snapshot = os.path.join(mount, f"r{index}")
            takes.append(timed(lambda: harness.run(
                ["btrfs", "subvolume", "snapshot", "-r", volume, snapshot])))
            snapshots.append(snapshot)
            data = round_bytes(seed, len(blocks))
            fd = os.open(target, os.O_WRONLY)
            try:
                for at, block in enumerate(blocks):
                    os.pwrite(fd, data[at * harness.BLOCK:(at + 1) * harness.BLOCK],
                              block * harness.BLOCK)
                os.fsync(fd)
            finally:
                os.close(fd)
        harness.run(["sync", "-f", target])
        after = harness.compsize_bytes([volume, *snapshots])
    return {"first_stored_bytes": first, "stored_bytes": after, "snapshot_seconds": takes}


def allocated_bytes(path):
    return os.stat(path).st_blocks * 512


def qcow2_series(ctx, layout, plan):
    disk = os.path.join(ctx.work, "series.qcow2")
    harness.run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", layout, disk])
    try:
        first = allocated_bytes(disk)
        takes = []
        for index, (blocks, _seed) in enumerate(plan):
            takes.append(timed(lambda: harness.run(
                ["qemu-img", "snapshot", "-c", f"r{index}", disk])))
            commands = []
            for at, block in enumerate(blocks):
                commands += ["-c", f"write -q -P {1 + (index + at) % 255} "
                                   f"{block * harness.BLOCK} {harness.BLOCK}"]
            harness.run(["qemu-io", "-f", "qcow2", *commands, disk])
        after = allocated_bytes(disk)
    finally:
        os.remove(disk)
    return {"first_stored_bytes": first, "stored_bytes": after, "snapshot_seconds": takes}


def run_series(ctx, zdisk):
    harness.progress("snapshots.py", "series: copying trees and making ext4 images")
    layout = make_layout(ctx, ctx.quick)
    blocks = harness.nonzero_blocks(layout)
    plan = plan_rounds(blocks, ctx.rounds)
    rewritten = sum(len(round_blocks) for round_blocks, _ in plan)
    rows = {}
    for name, create_words, serve_words in CONFIGS:
        harness.progress("snapshots.py", f"series: {name}")
        rows[name] = zdisk_series(ctx, zdisk, layout, plan, name, create_words, serve_words)
    if not ctx.skip_btrfs:
        harness.progress("snapshots.py", f"series: {BTRFS}")
        rows[BTRFS] = btrfs_series(ctx, layout, plan)
    if not ctx.skip_qcow2:
        harness.progress("snapshots.py", f"series: {QCOW2}")
        rows[QCOW2] = qcow2_series(ctx, layout, plan)
    os.remove(layout)
    title = (f"Ten snapshots of a changing OS image: {len(blocks)} non-zero blocks in the "
             f"layout, {len(plan)} rounds of a snapshot and {len(plan[0][0])} blocks "
             f"({REWRITTEN_SHARE:.0%}) rewritten with random bytes")
    notes = ("  MiB: stored bytes, plus zdisk's metadata_bytes; btrfs: compsize (data only); "
             "qcow2: allocated bytes of the file.\n  oldest snap reads: 4 KiB random read IOPS "
             "of the oldest snapshot after the rounds over the volume's before them (the same "
             "bytes).\n  after delete+compact: stored_bytes over a fresh image's holding the "
             "volume's final contents.")
    report(ctx, rows, plan, rewritten, title, notes,
           ("snapshot", "snapshot_seconds", "snapshot_read_iops", "oldest snap reads", "series"))


# ---- clones -------------------------------------------------------------


def write_blocks(sock, export, blocks, seed):
    """Overwrites `blocks` of `export` with the round's bytes, then flushes."""
    import nbd  # python3-libnbd, under /usr/bin/python3

    handle = nbd.NBD()
    handle.set_export_name(export)
    handle.connect_unix(sock)
    data = round_bytes(seed, len(blocks))
    for at, block in enumerate(blocks):
        handle.pwrite(data[at * harness.BLOCK:(at + 1) * harness.BLOCK], block * harness.BLOCK)
    handle.flush()
    handle.shutdown()


def zdisk_clones(ctx, zdisk, layout, plan, name, create_words, serve_words):
    image = os.path.join(ctx.work, "clones.zdisk")
    harness.zdisk_create(zdisk, image, "--logical", 2 * IMAGE_BYTES, *create_words)
    with harness.Teardown() as teardown:
        teardown.push(f"remove {image}", lambda: os.remove(image))
        sock = os.path.join(ctx.work, "clones.sock")
        server = harness.Server(teardown, zdisk, image, sock, flags=serve_words)
        harness.nbdcopy("--flush", layout, server.uri)
        first = server.stats()
        before = random_reads(ctx, sock, "")
        zdisk_command(zdisk, "snapshot", image, "golden")
        makes = []
        for index, (blocks, seed) in enumerate(plan):
            makes.append(timed(lambda: zdisk_command(zdisk, "clone", image, "golden",
                                                     f"c{index}")))
            write_blocks(sock, f"c{index}", blocks, seed)
        after = server.stats()
        last = random_reads(ctx, sock, f"c{len(plan) - 1}")
        harness.progress("snapshots.py", f"clones: {name}: deleting the clones, compacting")
        deletes = [timed(lambda: zdisk_command(zdisk, "delete", image, f"c{index}"))
                   for index in range(len(plan))]
        zdisk_command(zdisk, "delete", image, "golden")
        compact = timed(lambda: zdisk_command(zdisk, "compact", image))
        cleaned = server.stats()
        server.stop()
    # The volume did not change: what it stored before the clones is what
    # it should store once they are gone.
    return {"first_stored_bytes": first["stored_bytes"],
            "first_metadata_bytes": first["metadata_bytes"],
            "stored_bytes": after["stored_bytes"],
            "clone_bytes": after["clone_bytes"], "clone_blocks": after["clone_blocks"],
            "metadata_bytes": after["metadata_bytes"],
            "clone_seconds": makes, "delete_seconds": deletes, "compact_seconds": compact,
            "after_delete_stored_bytes": cleaned["stored_bytes"],
            "after_delete_baseline_bytes": first["stored_bytes"], "volume_read_iops": before,
            "clone_read_iops": last}


def btrfs_clones(ctx, layout, plan):
    with harness.Teardown() as teardown:
        mount = harness.btrfs_mount(teardown, ctx.work, 8 << 30)
        volume = os.path.join(mount, "volume")
        harness.run(["btrfs", "subvolume", "create", volume])
        target = os.path.join(volume, "layout.img")
        harness.run(["cp", "--sparse=always", layout, target])
        harness.run(["sync", "-f", target])
        first = harness.compsize_bytes([volume])
        makes = []
        clones = []
        for index, (blocks, seed) in enumerate(plan):
            clone = os.path.join(mount, f"c{index}")
            makes.append(timed(lambda: harness.run(
                ["btrfs", "subvolume", "snapshot", volume, clone])))
            clones.append(clone)
            data = round_bytes(seed, len(blocks))
            fd = os.open(os.path.join(clone, "layout.img"), os.O_WRONLY)
            try:
                for at, block in enumerate(blocks):
                    os.pwrite(fd, data[at * harness.BLOCK:(at + 1) * harness.BLOCK],
                              block * harness.BLOCK)
                os.fsync(fd)
            finally:
                os.close(fd)
        harness.run(["sync", "-f", target])
        after = harness.compsize_bytes([volume, *clones])
    return {"first_stored_bytes": first, "stored_bytes": after, "clone_seconds": makes}


def qcow2_clones(ctx, layout, plan):
    base = os.path.join(ctx.work, "base.qcow2")
    harness.run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", layout, base])
    disks = [base]
    try:
        first = allocated_bytes(base)
        makes = []
        for index, (blocks, _seed) in enumerate(plan):
            disk = os.path.join(ctx.work, f"c{index}.qcow2")
            makes.append(timed(lambda: harness.run(
                ["qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "qcow2", disk])))
            disks.append(disk)
            commands = []
            for at, block in enumerate(blocks):
                commands += ["-c", f"write -q -P {1 + (index + at) % 255} "
                                   f"{block * harness.BLOCK} {harness.BLOCK}"]
            harness.run(["qemu-io", "-f", "qcow2", *commands, disk])
        after = sum(allocated_bytes(disk) for disk in disks)
    finally:
        for disk in disks:
            os.remove(disk)
    return {"first_stored_bytes": first, "stored_bytes": after, "clone_seconds": makes}


def run_clones(ctx, zdisk):
    harness.progress("snapshots.py", "clones: copying trees and making ext4 images")
    layout = make_layout(ctx, ctx.quick)
    blocks = harness.nonzero_blocks(layout)
    plan = plan_rounds(blocks, ctx.rounds)
    rewritten = sum(len(round_blocks) for round_blocks, _ in plan)
    rows = {}
    for name, create_words, serve_words in CONFIGS:
        harness.progress("snapshots.py", f"clones: {name}")
        rows[name] = zdisk_clones(ctx, zdisk, layout, plan, name, create_words, serve_words)
    if not ctx.skip_btrfs:
        harness.progress("snapshots.py", f"clones: {BTRFS}")
        rows[BTRFS] = btrfs_clones(ctx, layout, plan)
    if not ctx.skip_qcow2:
        harness.progress("snapshots.py", f"clones: {QCOW2_CLONES}")
        rows[QCOW2_CLONES] = qcow2_clones(ctx, layout, plan)
    os.remove(layout)
    title = (f"Clones of an OS image: {len(blocks)} non-zero blocks in the layout, "
             f"{len(plan)} clones of one snapshot, each with its own {len(plan[0][0])} blocks "
             f"({REWRITTEN_SHARE:.0%}) rewritten with random bytes")
    notes = ("  MiB: stored bytes (zdisk: the volume's and the clones'), plus zdisk's "
             "metadata_bytes; btrfs: compsize (data only); qcow2: allocated bytes of the base "
             "and every clone.\n  clone reads: 4 KiB random read IOPS of the last clone over "
             "the volume's before the clones (95% of the clone's blocks are the snapshot's).\n"
             "  after delete+compact: stored_bytes over the volume's own before the clones.")
    report(ctx, rows, plan, rewritten, title, notes,
           ("clone", "clone_seconds", "clone_read_iops", "clone reads", "clones"))


def report(ctx, rows, plan, rewritten, title, notes, what):
    """Prints the table of a series or clones part and emits its rows:
    `what` names the thing made, its rows' seconds and read keys, the
    reads column and the JSON part."""
    thing, seconds_key, reads_key, reads_label, part = what
    # Random 4 KiB blocks do not compress: each costs its bytes and, on
    # zdisk, a record header.
    rewritten_bytes = rewritten * (harness.BLOCK + RECORD_HEADER)
    print(f"\n{title}")
    body = []
    for name, row in rows.items():
        stored = row["stored_bytes"] + row.get("metadata_bytes", 0)
        first = row["first_stored_bytes"] + row.get("first_metadata_bytes", 0)
        target = TARGET_SLACK * (first + rewritten_bytes) + TARGET_PER_SNAPSHOT * len(plan)
        row.update(rewritten_blocks=rewritten, target_bytes=target,
                   stored_with_metadata_bytes=stored)
        reads = (f"{row[reads_key] / row['volume_read_iops']:.2f}x"
                 if "volume_read_iops" in row else "")
        baseline = row.get("after_delete_baseline_bytes")
        after_delete = (f"{row['after_delete_stored_bytes'] / baseline:.3f}x"
                        if baseline else "")
        body.append([name, mib(first), mib(stored), mib(target), f"{stored / target:.2f}",
                     ms(harness.median(row[seconds_key])), ms(max(row[seconds_key])),
                     reads, after_delete])
    short = "snap" if thing == "snapshot" else thing
    harness.print_table(["system", "first MiB", "after MiB", "target MiB", "of target",
                         f"{short} median ms", f"{short} max ms", reads_label,
                         "after delete+compact"], body)
    print(notes)
    for name, row in rows.items():
        harness.emit_json(dict(row, part=part, system=name), ctx.json)


def body():
    parser = harness.parser(__doc__)
    harness.add_zdisk(parser)
    parser.add_argument("--dir", help="work directory (default: a new directory in /dev/shm, "
                                      "removed at the end)")
    parser.add_argument("--parts", default="cost,series,clones")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--takes", type=harness.positive, default=5)
    parser.add_argument("--rounds", type=harness.positive)
    parser.add_argument("--small-logical", type=harness.parse_size)
    parser.add_argument("--large-logical", type=harness.parse_size, default=1 << 40)
    parser.add_argument("--large-mapped", type=harness.parse_size)
    parser.add_argument("--read-seconds", type=harness.positive)
    parser.add_argument("--skip-btrfs", action="store_true")
    parser.add_argument("--skip-qcow2", action="store_true")
    parser.add_argument("--json", help="also append one JSON line per row to this file")
    args = parser.parse_args()
    zdisk = harness.zdisk_binary(args.zdisk)
    parts = args.parts.split(",")
    unknown = set(parts) - {"cost", "series", "clones"}
    if unknown:
        raise harness.Failure(f"unknown part {', '.join(sorted(unknown))}: cost, series or "
                              "clones")
    harness.require_tools("nbdcopy", "nbdkit", "fio")
    if "series" in parts or "clones" in parts:
        harness.require_tools("mkfs.ext4", "dd")
        if not args.skip_btrfs:
            harness.require_tools("mkfs.btrfs", "compsize", "losetup", "btrfs")
            harness.require_root("the btrfs comparison mounts a loop device; "
                                 "or pass --skip-btrfs")
        if not args.skip_qcow2:
            harness.require_tools("qemu-img", "qemu-io")

    class Context:
        pass

    ctx = Context()
    ctx.quick = args.quick
    ctx.json = args.json
    ctx.takes = args.takes
    ctx.skip_btrfs, ctx.skip_qcow2 = args.skip_btrfs, args.skip_qcow2
    ctx.rounds = args.rounds or (3 if args.quick else 10)
    ctx.read_seconds = args.read_seconds or (3 if args.quick else 10)
    ctx.small_logical = args.small_logical or (64 * harness.MIB if args.quick else 1 << 30)
    ctx.large_logical = args.large_logical
    ctx.large_mapped = args.large_mapped or (1 << 30 if args.quick else 16 << 30)
    with harness.Teardown() as teardown:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        ctx.work = harness.workdir(teardown, args.dir, "snapshots.", base)
        if "cost" in parts:
            run_cost(ctx, zdisk)
        if "series" in parts:
            run_series(ctx, zdisk)
        if "clones" in parts:
            run_clones(ctx, zdisk)


if __name__ == "__main__":
    harness.main("snapshots.py", body)
