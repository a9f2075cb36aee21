# Writer and verifier for the kill -9 test, run under /usr/bin/python3.
#
#   crashwriter.py write URI BLOCKS ROUND BASELINE - writes forever, printing
#       each write ("W lba gen") before issuing it and "F n" after each
#       completed flush; the test kills the server under it. Generations of
#       round R start at R * 10**6 + 1, so rounds never reuse a value.
#   crashwriter.py verify URI BLOCKS LOG BASELINE - reads every block and
#       checks it against the log: its value at the last completed flush
#       (or, if the block was not written since, its BASELINE value from
#       the previous round), or one written after it; never anything else.
#       Then rewrites BASELINE with the generation each block now holds.
#   crashwriter.py multiconn URI BLOCKS    - writes on one connection,
#       flushes on another (multi-conn), prints "F" when the flush returns.
#
# With a last argument `dup`, write and verify use contents that repeat
# across blocks (a block's bytes depend on its generation only, drawn from
# 48 per round), and write also trims (logged as generation 0): what
# deduplication shares, overwrites and drops.
import hashlib
import random
import sys

import nbd

BLOCK = 4096
DUP = False
DUP_CONTENTS = 48


def content(lba, gen):
    if gen == 0:
        return bytes(BLOCK)
    head = (f"zdisk dup gen={gen} " if DUP else f"zdisk lba={lba} gen={gen} ").encode()
    digest = hashlib.sha256(head).digest()
    # Half compressible text, half pseudo-random bytes.
    text = (head * (BLOCK // 2 // len(head) + 1))[: BLOCK // 2]
    noise = (digest * (BLOCK // 2 // len(digest) + 1))[: BLOCK // 2]
    noise = bytes(b ^ (i & 0xFF) for i, b in enumerate(noise))
    return text + noise


def connect(uri):
    h = nbd.NBD()
    h.connect_uri(uri)
    return h


def write(uri, blocks, seed):
    rng = random.Random(seed)
    h = connect(uri)
    gen = seed * 10**6
    writes = 0
    flushes = 0
    while True:
        lba = rng.randrange(blocks)
        gen += 1
        count = rng.choice([1, 1, 1, 2, 8])
        count = min(count, blocks - lba)
        if DUP and rng.random() < 0.1:
            for i in range(count):
                print(f"W {lba + i} 0", flush=True)
            h.trim(count * BLOCK, lba * BLOCK)
        else:
            gens = [gen] * count
            if DUP:
                gens = [seed * 10**6 + rng.randrange(1, DUP_CONTENTS + 1) for _ in range(count)]
            for i in range(count):
                print(f"W {lba + i} {gens[i]}", flush=True)
            data = b"".join(content(lba + i, gens[i]) for i in range(count))
            h.pwrite(data, lba * BLOCK)
        writes += 1
        if writes % 50 == 0:
            h.flush()
            flushes += 1
            print(f"F {flushes}", flush=True)


def load_baseline(path):
    try:
        return {lba: int(gen) for lba, gen in enumerate(open(path).read().split())}
    except FileNotFoundError:
        return {}


def verify(uri, blocks, log_path, baseline_path):
    durable = load_baseline(baseline_path)
    since = {}
    for line in open(log_path):
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "W" and len(parts) == 3:
            lba, gen = int(parts[1]), int(parts[2])
            since.setdefault(lba, []).append(gen)
        elif parts[0] == "F":
            for lba, gens in since.items():
                durable[lba] = gens[-1]
            since = {}
    h = connect(uri)
    bad = 0
    nonzero = 0
    now = []
    for lba in range(blocks):
        data = h.pread(BLOCK, lba * BLOCK)
        allowed = [durable.get(lba, 0)] + since.get(lba, [])
        if durable.get(lba, 0):
            nonzero += 1
        match = [g for g in allowed if data == content(lba, g)]
        if not match:
            bad += 1
            now.append(0)
            if bad <= 10:
                print(f"block {lba}: not one of generations {allowed}", file=sys.stderr)
        else:
            now.append(match[0])
    with open(baseline_path, "w") as out:
        out.write(" ".join(str(g) for g in now))
    print(f"verified {blocks} blocks ({nonzero} with data as of the last completed flush), {bad} bad")
    sys.exit(1 if bad else 0)


def multiconn(uri, blocks):
    writer = connect(uri)
    flusher = connect(uri)
    for lba in range(blocks):
        writer.pwrite(content(lba, 7), lba * BLOCK)
    flusher.flush()
    print("F", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    if sys.argv[-1] == "dup":
        DUP = True
        sys.argv.pop()
    mode, uri, blocks = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "write":
        write(uri, blocks, int(sys.argv[4]))
    elif mode == "verify":
        verify(uri, blocks, sys.argv[4], sys.argv[5])
    elif mode == "multiconn":
        multiconn(uri, blocks)
    elif mode == "check-gen":
        h = connect(uri)
        gen = int(sys.argv[4])
        bad = [lba for lba in range(blocks) if h.pread(BLOCK, lba * BLOCK) != content(lba, gen)]
        print(f"{len(bad)} of {blocks} blocks differ from generation {gen}")
        sys.exit(1 if bad else 0)
