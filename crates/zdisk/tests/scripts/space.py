# Thin-provisioning and damage checks, run under /usr/bin/python3.
#
#   space.py fill URI          - on a volume whose logical size is several
#       times its physical size: write incompressible 1 MiB chunks until the
#       server answers ENOSPC, check that reads, TRIM and WRITE_ZEROES still
#       work and nothing written was lost, TRIM half of it, and check that
#       writes succeed again.
#   space.py write-known URI BLOCKS      - write a known pattern to BLOCKS blocks, flush.
#   space.py verify-known URI BLOCKS BAD - read every block: those listed in
#       the comma-separated BAD list must fail with EIO, every other block
#       must hold its pattern.
#   space.py verify-known-or-zero URI BLOCKS BAD - the same, but a block may
#       also read as zeros (its write was lost, never replaced by garbage).
import errno
import hashlib
import os
import sys

import nbd

CHUNK = 1 << 20
BLOCK = 4096


def connect(uri):
    h = nbd.NBD()
    h.connect_uri(uri)
    return h


def digest(data):
    return hashlib.sha256(data).hexdigest()


def fill(uri):
    h = connect(uri)
    size = h.get_size()
    written = {}
    offset = 0
    hit = False
    while offset + CHUNK <= size:
        data = os.urandom(CHUNK)
        try:
            h.pwrite(data, offset)
        except nbd.Error as e:
            if e.errnum != errno.ENOSPC:
                raise
            hit = True
            break
        written[offset] = digest(data)
        offset += CHUNK
    if not hit:
        sys.exit(f"wrote all {size} bytes without ENOSPC: not a thin volume?")
    full_at = offset
    print(f"ENOSPC after {full_at >> 20} MiB of incompressible data on a {size >> 20} MiB volume")
    # Another write still fails cleanly, and the server is still up.
    try:
        h.pwrite(os.urandom(CHUNK), full_at)
        sys.exit("a second write into a full volume succeeded")
    except nbd.Error as e:
        assert e.errnum == errno.ENOSPC, e
    for off, d in written.items():
        assert digest(h.pread(CHUNK, off)) == d, f"data at {off} changed after ENOSPC"
    print("reads after ENOSPC: all written data intact")
    # WRITE_ZEROES (keeping allocation) and TRIM work on a full volume.
    first = min(written)
    h.zero(CHUNK, first, flags=nbd.CMD_FLAG_NO_HOLE)
    assert h.pread(CHUNK, first) == bytes(CHUNK)
    del written[first]
    trimmed = sorted(written)[::2]
    for off in trimmed:
        h.trim(CHUNK, off)
        del written[off]
    h.flush()
    print(f"zeroed 1 MiB and trimmed {len(trimmed)} MiB on the full volume")
    # Space came back: new writes succeed, into the trimmed holes and past the old end.
    rewritten = 0
    for off in trimmed[: len(trimmed) * 3 // 4]:
        data = os.urandom(CHUNK)
        h.pwrite(data, off)
        written[off] = digest(data)
        rewritten += 1
    print(f"after TRIM: rewrote {rewritten} MiB")
    for off, d in written.items():
        assert digest(h.pread(CHUNK, off)) == d, f"data at {off} wrong at the end"
    h.flush()
    print("all data intact at the end")


def pattern(lba):
    head = f"zdisk block {lba} ".encode()
    text = (head * (BLOCK // len(head) + 1))[: BLOCK // 2]
    noise = hashlib.sha256(head).digest() * (BLOCK // 2 // 32)
    return text + noise


def write_known(uri, blocks):
    h = connect(uri)
    for start in range(0, blocks, 256):
        n = min(256, blocks - start)
        h.pwrite(b"".join(pattern(lba) for lba in range(start, start + n)), start * BLOCK)
    h.flush()
    print(f"wrote {blocks} known blocks")


def verify_known(uri, blocks, bad, zero_ok=False):
    h = connect(uri)
    failures = []
    eio = 0
    zeros = 0
    for lba in range(blocks):
        try:
            data = h.pread(BLOCK, lba * BLOCK)
            if lba in bad:
                failures.append(f"block {lba} is listed as damaged but read back")
            elif zero_ok and data == bytes(BLOCK):
                zeros += 1
            elif data != pattern(lba):
                failures.append(f"block {lba} returned wrong data")
        except nbd.Error as e:
            if lba not in bad:
                failures.append(f"block {lba} failed ({e}) but is not listed as damaged")
            elif e.errnum != errno.EIO:
                failures.append(f"block {lba} failed with {e.errno}, expected EIO")
            else:
                eio += 1
    if failures:
        print("\n".join(failures[:20]), file=sys.stderr)
        sys.exit(1)
    print(f"{blocks - eio - zeros} blocks intact, {zeros} read as never written, "
          f"{eio} damaged blocks read as EIO")


if __name__ == "__main__":
    mode, uri = sys.argv[1], sys.argv[2]
    if mode == "fill":
        fill(uri)
    elif mode == "write-known":
        write_known(uri, int(sys.argv[3]))
    elif mode == "verify-known":
        bad = {int(x) for x in sys.argv[4].split(",") if x}
        verify_known(uri, int(sys.argv[3]), bad)
    elif mode == "verify-known-or-zero":
        bad = {int(x) for x in sys.argv[4].split(",") if x}
        verify_known(uri, int(sys.argv[3]), bad, zero_ok=True)
