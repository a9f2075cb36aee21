#!/usr/bin/python3
"""RAM per mapped block of a zdisk server, as its RSS shows it.

Two fills on a fresh image each (1 GiB written into a 1 TiB logical,
4 GiB physical volume by default), served on a Unix socket and written by
fio's nbd engine:
  sparse      random 4 KiB writes over the whole volume (262,144 blocks
              almost all in chunks of their own);
  sequential  the same bytes written in order (dense data).
Each fill runs in four parts. The server's VmRSS and /stats' mapped_bytes
are read before the fill and after each part, and reported as RSS growth
per mapped block over the whole fill (growth / blocks) and over the last
three parts (what further blocks cost, without the fixed costs the first
requests bring: threads' stacks and arenas, buffers, codecs). Both include
what the allocator keeps of transient buffers (a checkpoint's dump,
requests' payloads), which comes in jumps of a few MiB. map_memory_bytes
(the map's own count of its heap bytes, allocator overhead included) is
printed too, per mapped block.

The idle pass is off (--recompress off --idle-compact off) so that nothing
runs between the fill and the reading. Needs fio with the nbd engine.
A table, then one JSON object per fill on its own line.

  --quick   a 64 MiB fill into a 64 GiB volume (seconds)
"""

import os

import harness

PARTS = 4


def measure(args, zdisk, fill, work):
    with harness.Teardown() as teardown:
        image = os.path.join(work, f"{fill}.zdisk")
        harness.zdisk_create(zdisk, image, "--logical", args.logical, "--physical", args.physical,
                             "--force")
        teardown.push(f"remove {image}", lambda: os.remove(image))
        server = harness.Server(teardown, zdisk, image, os.path.join(work, f"{fill}.sock"),
                                ["--recompress", "off", "--idle-compact", "off"])
        points = [(server.rss(), server.stats())]
        logical = harness.parse_size(args.logical)
        part_bytes = harness.parse_size(args.fill) // PARTS
        for part in range(PARTS):
            if fill == "sparse":
                harness.fio(server.uri, fill, "randwrite", "4k", "--offset=0", f"--size={logical}",
                            f"--io_size={part_bytes}", "--norandommap", "--randrepeat=0")
            else:
                harness.fio(server.uri, fill, "write", "128k", f"--offset={part * part_bytes}",
                            f"--size={part_bytes}")
            points.append((server.rss(), server.stats()))
        server.stop()
    mapped = [p[1]["mapped_bytes"] // harness.BLOCK for p in points]
    rss = [p[0] for p in points]
    result = {
        "fill": fill,
        "zdisk": zdisk,
        "mapped_blocks": mapped[-1] - mapped[0],
        "rss_before_bytes": rss[0],
        "rss_after_bytes": rss[-1],
        "rss_growth_bytes": rss[-1] - rss[0],
        "rss_by_part_bytes": rss,
        "bytes_per_block": (rss[-1] - rss[0]) / max(1, mapped[-1] - mapped[0]),
        "later_bytes_per_block": (rss[-1] - rss[1]) / max(1, mapped[-1] - mapped[1]),
        "map_memory_bytes": points[-1][1].get("map_memory_bytes"),
    }
    result["map_bytes_per_block"] = (result["map_memory_bytes"] or 0) / max(1, mapped[-1])
    return result


def body():
    parser = harness.parser(__doc__)
    harness.add_zdisk(parser)
    parser.add_argument("--dir", help="where the images go (default: a temporary directory)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--logical")
    parser.add_argument("--physical", default="4G")
    parser.add_argument("--fill", help="bytes written per fill (default 1G)")
    parser.add_argument("--only", choices=["sparse", "sequential"])
    parser.add_argument("--json", help="also append each fill's JSON line to this file")
    args = parser.parse_args()
    args.logical = args.logical or ("64G" if args.quick else "1T")
    args.fill = args.fill or ("64M" if args.quick else "1G")
    zdisk = harness.zdisk_binary(args.zdisk)
    harness.require_tools("fio")
    with harness.Teardown() as teardown:
        work = harness.workdir(teardown, args.dir, "map-rss.")
        fills = [args.only] if args.only else ["sparse", "sequential"]
        results = [measure(args, zdisk, fill, work) for fill in fills]
    print(f"{'fill':<11} {'blocks':>9} {'RSS growth':>12} {'B/block':>8} {'last 3/4':>9} "
          f"{'map B/block':>12}")
    for r in results:
        print(f"{r['fill']:<11} {r['mapped_blocks']:>9} {r['rss_growth_bytes'] / 2**20:>10.1f} M "
              f"{r['bytes_per_block']:>8.1f} {r['later_bytes_per_block']:>9.1f} "
              f"{r['map_bytes_per_block']:>12.1f}")
    for r in results:
        harness.emit_json(r, args.json)


if __name__ == "__main__":
    harness.main("map-rss.py", body)
