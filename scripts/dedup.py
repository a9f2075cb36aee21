#!/usr/bin/python3
"""Data that repeats: zdisk against btrfs with duperemove (issue #25).

Two workloads, each written to one zdisk volume and to one btrfs, all on
tmpfs (a new directory in /dev/shm, removed at the end):
- two-image: two ext4 images made with `mkfs.ext4 -q -d TREE IMG 512M`,
  tree A copies of /usr/share/doc, /usr/lib/python3 and /usr/share/perl,
  tree B the same plus /usr/share/i18n, at offsets 0 and 512 MiB;
- copies: image A written --copies times (default 10) at offsets
  k x 512 MiB, each copy with 1% of its non-zero 4 KiB blocks overwritten
  with random data (fixed seed);
- rates: the write rate of unique data and of its duplicate. The first
  512 MiB of a tar of /usr/share/doc, /usr/lib/x86_64-linux-gnu and
  /usr/bin (little of it repeats) written by nbdcopy at offset 0, then the
  same file at offset 512 MiB, each through nbdkit's offset filter (one
  more hop, the same for every row), for each zdisk configuration, twice
  in turn; the best of the two of each. Printed: unique and duplicate
  MB/s, dedup on's unique rate over dedup off's, and its duplicate rate
  over its unique rate.
For each workload, one run of each of:
- every zdisk configuration (CONFIGS below, and --zdisk-config): `zdisk
  create` with its words, `zdisk serve` with its serve words, the images
  copied in by one nbdcopy (--flush --no-extents) whose source is nbdkit's split plugin
  over the image files, so each lands at its offset; stored_bytes and
  metadata_bytes from /stats right after it (before any idle pass: serve
  runs with --recompress off unless the configuration says otherwise);
  write MB/s is the layout's bytes (holes included) over nbdcopy's seconds;
- btrfs compress-force=zstd:1 on a loop file in /dev/shm: the image files
  copied with cp (holes stay holes) and synced, stored bytes from
  compsize's disk usage; then `duperemove -dr -b 4096` over them (timed),
  and compsize again (shared extents count once);
- `zdisk estimate --codec zstd` of the same layout (the images
  concatenated, through a pipe): its predictions without and with dedup.
One table per workload: configuration, write MB/s, stored MiB (record
bytes: stored_bytes for zdisk, compsize's disk usage for btrfs), stored
plus zdisk's metadata, and the ratio of stored bytes to btrfs after
duperemove; for zdisk with dedup on, the share of the layout's duplicate
blocks it found (its dedup_found over the non-zero blocks that are not
the first of their content, counted here with SHA-256) and its dedup
index's RAM per distinct block written. Then one JSON object per row
(also appended to --json FILE).

Needs root (loop mounts), nbdcopy, nbdkit, mkfs.ext4, mkfs.btrfs, compsize,
duperemove; about 4 GiB of /dev/shm for --copies 10.

  --quick                        trees of /usr/share/perl (A) and it plus
                                 /usr/share/i18n (B), 2 copies, rates of
                                 64 MiB (a minute or two)
  --workloads two-image,copies,rates
                                 which to run (default all three)
  --copies N                     copies of image A in the copies workload
  --zdisk-config 'NAME=CREATE WORDS[;SERVE WORDS]'
                                 one more zdisk configuration, e.g.
                                 'zdisk zstd dedup=--codec zstd --dedup on'
"""

import hashlib
import json
import os
import random
import shlex
import subprocess
import time

import harness

IMAGE_BYTES = harness.OS_IMAGE_BYTES
TREE_A, TREE_A_QUICK = harness.OS_TREE_A, harness.OS_TREE_A_QUICK
TREE_B_EXTRA = harness.OS_TREE_B_EXTRA
SEED = 25
MODIFIED_SHARE = 0.01

# The zdisk configurations each workload is written with: a name, the
# words `zdisk create` gets, the words `zdisk serve` gets.
CONFIGS = [
    ("zdisk lz4 (dedup off)", ["--dedup", "off"], ["--recompress", "off"]),
    ("zdisk lz4 (dedup on)", ["--dedup", "on"], ["--recompress", "off"]),
    ("zdisk zstd (dedup off)", ["--codec", "zstd", "--dedup", "off"], ["--recompress", "off"]),
    ("zdisk zstd (dedup on)", ["--codec", "zstd", "--dedup", "on"], ["--recompress", "off"]),
]
RATE_SOURCES = ["/usr/share/doc", "/usr/lib/x86_64-linux-gnu", "/usr/bin"]
RATE_ROUNDS = 2

ESTIMATE_CODEC = "zstd"
BTRFS = "btrfs compress-force=zstd:1"
DUPEREMOVE = "btrfs + duperemove -dr -b 4096"


def make_image(tree, image):
    harness.run(["mkfs.ext4", "-q", "-d", tree, image, "512M"])
    if os.path.getsize(image) != IMAGE_BYTES:
        raise harness.Failure(f"{image} is {os.path.getsize(image)} bytes, not 512 MiB")


def modified_copy(image, copy, blocks, seed):
    """`image` copied to `copy` (holes kept), with a share of its non-zero
    blocks overwritten by random bytes chosen by `seed`."""
    harness.run(["cp", "--sparse=always", image, copy])
    rng = random.Random(seed)
    chosen = rng.sample(blocks, max(1, round(len(blocks) * MODIFIED_SHARE)))
    with open(copy, "r+b") as f:
        for index in sorted(chosen):
            f.seek(index * harness.BLOCK)
            f.write(rng.randbytes(harness.BLOCK))
    return len(chosen)


def split_source(images):
    """nbdcopy's source: nbdkit's split plugin, the images end to end.
    nbdcopy runs with --no-extents: the split plugin of nbdkit 1.32 drops
    the connection when asked for the extents of these sparse files, so
    nbdcopy reads the holes and sends its zero-detected runs as zeroes."""
    return ["[", "nbdkit", "split", *images, "]"]


def zdisk_row(ctx, zdisk, images, name, create_words, serve_words):
    layout_bytes = len(images) * IMAGE_BYTES
    image = os.path.join(ctx.work, "volume.zdisk")
    harness.zdisk_create(zdisk, image, "--logical", layout_bytes, "--force", *create_words)
    with harness.Teardown() as teardown:
        teardown.push(f"remove {image}", lambda: os.remove(image))
        server = harness.Server(teardown, zdisk, image, os.path.join(ctx.work, "zdisk.sock"),
                                flags=serve_words)
        seconds = harness.nbdcopy("--flush", "--no-extents", "--", *split_source(images),
                                  server.uri)
        stats = server.stats()
        server.stop()
    return {"write_mb_s": layout_bytes / seconds / 1e6, "stored_bytes": stats["stored_bytes"],
            "metadata_bytes": stats["metadata_bytes"],
            "stored_with_metadata_bytes": stats["stored_bytes"] + stats["metadata_bytes"],
            "mapped_bytes": stats["mapped_bytes"], "create": create_words, "serve": serve_words,
            "dedup": stats["dedup"], "dedup_lookups": stats["dedup_lookups"],
            "dedup_found": stats["dedup_found"], "dedup_stale": stats["dedup_stale"],
            "dedup_index_bytes": stats["dedup_index_bytes"],
            "dedup_chapter_reads": stats["dedup_chapter_reads"],
            "distinct_blocks": stats["distinct_blocks"],
            "dedup_index_write_bytes": stats["counters"]["dedup_index_write_bytes"]}


def duplicate_blocks(images):
    """Non-zero 4 KiB blocks of the images end to end that repeat an
    earlier one: what a perfect dedup would find."""
    zero = bytes(harness.BLOCK)
    seen = set()
    duplicates = 0
    for image in images:
        with open(image, "rb") as f:
            while True:
                block = f.read(harness.BLOCK)
                if not block:
                    break
                if block == zero:
                    continue
                digest = hashlib.sha256(block).digest()
                if digest in seen:
                    duplicates += 1
                else:
                    seen.add(digest)
    return duplicates, len(seen)


def btrfs_rows(ctx, images):
    layout_bytes = len(images) * IMAGE_BYTES
    with harness.Teardown() as teardown:
        mount = harness.btrfs_mount(teardown, ctx.work, max(layout_bytes, 2 << 30))
        targets = [os.path.join(mount, f"image-{index}.img") for index in range(len(images))]
        t0 = time.monotonic()
        for source, target in zip(images, targets):
            harness.run(["cp", source, target])
        harness.run(["sync", "-f", targets[0]])
        written = time.monotonic() - t0
        before = harness.compsize_bytes(targets)
        t1 = time.monotonic()
        harness.run(["duperemove", "-dr", "-b", "4096", mount])
        dedup_seconds = time.monotonic() - t1
        harness.run(["sync", "-f", targets[0]])
        after = harness.compsize_bytes(targets)
        du = harness.run(["btrfs", "filesystem", "du", "-s", "--raw", mount]).stdout.split("\n")
    return ({"write_mb_s": layout_bytes / written / 1e6, "stored_bytes": before},
            {"write_mb_s": None, "stored_bytes": after, "duperemove_seconds": dedup_seconds,
             "btrfs_filesystem_du": " ".join(du[-2].split()) if len(du) > 1 else None})


def estimate_rows(zdisk, images):
    """`zdisk estimate` of the layout: the images end to end, through a pipe."""
    cat = subprocess.Popen(["cat", *images], stdout=subprocess.PIPE)
    t0 = time.monotonic()
    done = subprocess.run([zdisk, "estimate", "--json", "--codec", ESTIMATE_CODEC, "-"],
                          stdin=cat.stdout, capture_output=True, text=True)
    cat.stdout.close()
    cat.wait()
    seconds = time.monotonic() - t0
    if done.returncode != 0:
        raise harness.Failure(f"zdisk estimate failed: {done.stderr.strip()}")
    prediction = json.loads(done.stdout.splitlines()[0])
    dedup = prediction["dedup"]
    return ({"write_mb_s": None, "stored_bytes": prediction["physical_bytes"],
             "estimate_seconds": seconds, "logical_bytes": prediction["logical_bytes"]},
            {"write_mb_s": None, "stored_bytes": dedup["physical_bytes"],
             "distinct_blocks": dedup["distinct_blocks"],
             "duplicate_blocks": dedup["duplicate_blocks"], "ref_records": dedup["ref_records"],
             "sample_shift": dedup["sample_shift"]})


def run_workload(ctx, zdisk, name, images):
    rows = {}
    duplicates, distinct = duplicate_blocks(images)
    for config, create_words, serve_words in ctx.configs:
        harness.progress("dedup.py", f"{name}: {config}")
        row = zdisk_row(ctx, zdisk, images, config, create_words, serve_words)
        if row["dedup"] == "on":
            row["duplicate_blocks"] = duplicates
            row["found_share"] = row["dedup_found"] / duplicates if duplicates else None
            row["index_bytes_per_distinct_block"] = row["dedup_index_bytes"] / distinct
        rows[config] = row
    if not ctx.skip_btrfs:
        harness.progress("dedup.py", f"{name}: {BTRFS}, then duperemove")
        rows[BTRFS], rows[DUPEREMOVE] = btrfs_rows(ctx, images)
    harness.progress("dedup.py", f"{name}: zdisk estimate")
    without, with_dedup = estimate_rows(zdisk, images)
    rows[f"zdisk estimate {ESTIMATE_CODEC}, without dedup"] = without
    rows[f"zdisk estimate {ESTIMATE_CODEC}, with dedup"] = with_dedup
    report(name, len(images), rows)
    for row_name, row in rows.items():
        harness.emit_json(dict(row, workload=name, configuration=row_name,
                               layout_bytes=len(images) * IMAGE_BYTES), ctx.json)


def report(name, count, rows):
    reference = rows.get(DUPEREMOVE, {}).get("stored_bytes")

    def mib(value):
        return f"{value / harness.MIB:.1f}" if value is not None else "-"

    print(f"\n{name}: {count} x 512 MiB images "
          f"({count * IMAGE_BYTES / harness.MIB:.0f} MiB written)")
    body = []
    notes = []
    for row_name, row in rows.items():
        stored = row.get("stored_bytes")
        if "duperemove_seconds" in row:
            notes.append(f"duperemove took {row['duperemove_seconds']:.0f} s")
        elif "found_share" in row:
            notes.append(f"{row_name}: found {row['dedup_found']} of {row['duplicate_blocks']} "
                         f"duplicate blocks ({100 * (row['found_share'] or 0):.1f}%), index RAM "
                         f"{row['dedup_index_bytes'] / 1024:.0f} KiB, "
                         f"{row['index_bytes_per_distinct_block']:.2f} B per distinct block, "
                         f"{row['dedup_chapter_reads']} chapters read back")
        if "sample_shift" in row:
            notes.append(f"zdisk estimate: {row['duplicate_blocks']} of "
                         f"{row['duplicate_blocks'] + row['distinct_blocks']} non-zero blocks "
                         f"are duplicates, {row['ref_records']} reference records"
                         + (f", sampled 1/2^{row['sample_shift']}" if row["sample_shift"] else ""))
        body.append([row_name,
                     f"{row['write_mb_s']:.0f}" if row.get("write_mb_s") else "-",
                     mib(stored), mib(row.get("stored_with_metadata_bytes")),
                     f"{stored / reference:.2f}" if stored and reference else "-"])
    harness.print_table(["configuration", "write MB/s", "stored MiB", "+ metadata MiB",
                         "x btrfs+duperemove"], body)
    for note in notes:
        print(f"  {note}")


def rate_source(work, size_bytes):
    """The first `size_bytes` of a tar of RATE_SOURCES."""
    made = os.path.join(work, "rates.tar")
    harness.tar_prefix(made, size_bytes, RATE_SOURCES)
    if os.path.getsize(made) != size_bytes:
        raise harness.Missing(f"the tar of {' '.join(RATE_SOURCES)} is under "
                              f"{size_bytes // harness.MIB} MiB")
    return made


def rates_once(ctx, zdisk, source, create_words, serve_words):
    """Seconds to write `source` at offset 0, then again at 512 MiB."""
    size = os.path.getsize(source)
    image = os.path.join(ctx.work, "rates.zdisk")
    sock = os.path.join(ctx.work, "rates.sock")
    harness.zdisk_create(zdisk, image, "--logical", 2 * IMAGE_BYTES, "--force", *create_words)
    with harness.Teardown() as teardown:
        teardown.push(f"remove {image}", lambda: os.remove(image))
        server = harness.Server(teardown, zdisk, image, sock, flags=serve_words)
        seconds = []
        for offset in (0, IMAGE_BYTES):
            target = ["[", "nbdkit", "--filter=offset", "nbd", f"socket={sock}",
                      f"offset={offset}", f"range={size}", "]"]
            seconds.append(harness.nbdcopy("--flush", "--", source, *target))
        stats = server.stats()
        server.stop()
    return seconds, stats


def run_rates(ctx, zdisk):
    source = rate_source(ctx.work, ctx.rate_bytes)
    size = os.path.getsize(source)
    best = {}
    for round_ in range(RATE_ROUNDS):
        for config, create_words, serve_words in ctx.configs:
            harness.progress("dedup.py", f"rates, round {round_ + 1}: {config}")
            (first, second), stats = rates_once(ctx, zdisk, source, create_words, serve_words)
            row = best.setdefault(config, {"unique_mb_s": 0, "duplicate_mb_s": 0})
            row["unique_mb_s"] = max(row["unique_mb_s"], size / first / 1e6)
            row["duplicate_mb_s"] = max(row["duplicate_mb_s"], size / second / 1e6)
            row["dedup"] = stats["dedup"]
            row["dedup_found"] = stats["dedup_found"]
    print(f"\nrates: {size // harness.MIB} MiB of a tar written at 0, then again at 512 MiB "
          f"(best of {RATE_ROUNDS})")
    body = []
    for config, row in best.items():
        off = best.get(config.replace("(dedup on)", "(dedup off)"))
        if row["dedup"] == "on" and off:
            row["unique_vs_dedup_off"] = row["unique_mb_s"] / off["unique_mb_s"]
            row["duplicate_vs_unique"] = row["duplicate_mb_s"] / row["unique_mb_s"]
        body.append([config, f"{row['unique_mb_s']:.0f}", f"{row['duplicate_mb_s']:.0f}",
                     f"{row['unique_vs_dedup_off']:.2f}" if "unique_vs_dedup_off" in row else "-",
                     f"{row['duplicate_vs_unique']:.2f}" if "duplicate_vs_unique" in row else "-"])
        harness.emit_json(dict(row, workload="rates", configuration=config), ctx.json)
    harness.print_table(["configuration", "unique MB/s", "duplicate MB/s",
                         "unique x dedup off", "duplicate x unique"], body)


def parse_config(text):
    name, sep, words = text.partition("=")
    if not sep or not name.strip():
        raise harness.Failure(f"--zdisk-config {text!r}: write NAME=CREATE WORDS[;SERVE WORDS]")
    create, _, serve = words.partition(";")
    return (name.strip(), shlex.split(create),
            shlex.split(serve) if serve.strip() else ["--recompress", "off"])


def body():
    parser = harness.parser(__doc__)
    harness.add_zdisk(parser)
    parser.add_argument("--dir", help="work directory (default: a new directory in /dev/shm, "
                                      "removed at the end)")
    parser.add_argument("--workloads", default="two-image,copies,rates")
    parser.add_argument("--copies", type=harness.positive,
                        help="copies of image A in the copies workload (default 10; 2 with --quick)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--zdisk-config", action="append", default=[], metavar="NAME=WORDS")
    parser.add_argument("--skip-btrfs", action="store_true")
    parser.add_argument("--json", help="also append one JSON line per row to this file")
    args = parser.parse_args()
    zdisk = harness.zdisk_binary(args.zdisk)
    workloads = args.workloads.split(",")
    unknown = set(workloads) - {"two-image", "copies", "rates"}
    if unknown:
        raise harness.Failure(f"unknown workload {', '.join(sorted(unknown))}: "
                              "two-image, copies or rates")
    harness.require_tools("nbdcopy", "nbdkit", "mkfs.ext4", "cat")
    if not args.skip_btrfs:
        harness.require_tools("mkfs.btrfs", "compsize", "duperemove", "losetup", "btrfs")
        harness.require_root("the btrfs comparison mounts a loop device; or pass --skip-btrfs")

    class Context:
        pass

    ctx = Context()
    ctx.configs = CONFIGS + [parse_config(text) for text in args.zdisk_config]
    ctx.skip_btrfs = args.skip_btrfs
    ctx.json = args.json
    ctx.rate_bytes = 64 * harness.MIB if args.quick else IMAGE_BYTES
    with harness.Teardown() as teardown:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        ctx.work = harness.workdir(teardown, args.dir, "dedup.", base)
        harness.progress("dedup.py", "copying trees and making ext4 images")
        sources_a = TREE_A_QUICK if args.quick else TREE_A
        copies_count = args.copies or (2 if args.quick else 10)
        tree_a = harness.make_tree(ctx.work, "tree-a", sources_a)
        image_a = os.path.join(ctx.work, "a.img")
        make_image(tree_a, image_a)
        if "two-image" in workloads:
            tree_b = harness.make_tree(ctx.work, "tree-b", sources_a + TREE_B_EXTRA)
            image_b = os.path.join(ctx.work, "b.img")
            make_image(tree_b, image_b)
            harness.run(["rm", "-rf", "--one-file-system", tree_b])
        harness.run(["rm", "-rf", "--one-file-system", tree_a])
        if "two-image" in workloads:
            run_workload(ctx, zdisk, "two-image", [image_a, image_b])
            os.remove(image_b)
        if "copies" in workloads:
            blocks = harness.nonzero_blocks(image_a)
            copies = []
            for index in range(copies_count):
                copy = os.path.join(ctx.work, f"a-{index}.img")
                modified_copy(image_a, copy, blocks, SEED + index)
                copies.append(copy)
            harness.progress("dedup.py", f"copies: {copies_count} copies of A, "
                                         f"{len(blocks)} non-zero blocks each, 1% overwritten")
            run_workload(ctx, zdisk, "copies", copies)
            for copy in copies:
                os.remove(copy)
        if "rates" in workloads:
            run_rates(ctx, zdisk)


if __name__ == "__main__":
    harness.main("dedup.py", body)
