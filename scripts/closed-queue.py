#!/usr/bin/python3
"""Closed-queue simulation of random 4 KiB reads on FEMU's default timing.

An independent cross-check of `zdisk bench --profile femu-default
--scenario qd` (docs/emulation.md, "FEMU calibration"): QD slots, each
issuing its next read when the previous one completes, to one of 64
planes (8 channels x 8 LUNs) chosen uniformly at random; a plane serves
its reads one at a time for 40 us. Nothing else takes time, as in FEMU.
Prints IOPS and mean latency for each queue depth, then one JSON object
{"depths": [{"qd", "iops", "latency_us", "occupancy_iops"}...]} whose
occupancy_iops is the balls-into-bins estimate the emulator is checked
against (U * (1 - (1 - 1/U)^QD) planes busy).

  --quick   40 000 reads per depth instead of 400 000 (under a second)
"""

import heapq
import random

import harness

PLANES = 64
T_READ_US = 40.0
DEPTHS = (1, 2, 4, 8, 16, 32)


def simulate(depth, reads, seed):
    rng = random.Random(seed)
    plane_free = [0.0] * PLANES
    slots = [0.0] * depth  # when each slot issues its next read
    end = latency = 0.0
    for _ in range(reads):
        issued = heapq.heappop(slots)
        plane = rng.randrange(PLANES)
        done = max(issued, plane_free[plane]) + T_READ_US
        plane_free[plane] = done
        latency += done - issued
        end = max(end, done)
        heapq.heappush(slots, done)
    return reads / end * 1e6, latency / reads


def occupancy_iops(depth):
    busy = PLANES * (1 - (1 - 1 / PLANES) ** depth)
    return busy / T_READ_US * 1e6


def body():
    parser = harness.parser(__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reads", type=harness.positive, help="reads per depth")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="also append the JSON object to this file")
    args = parser.parse_args()
    reads = args.reads or (40_000 if args.quick else 400_000)
    rows = []
    print(f"{'QD':>3} {'IOPS':>9} {'latency us':>11} {'occupancy IOPS':>15}")
    for depth in DEPTHS:
        iops, latency = simulate(depth, reads, args.seed)
        rows.append({"qd": depth, "iops": iops, "latency_us": latency,
                     "occupancy_iops": occupancy_iops(depth)})
        print(f"{depth:>3} {iops:>9.0f} {latency:>11.1f} {occupancy_iops(depth):>15.0f}")
    harness.emit_json({"reads": reads, "seed": args.seed, "depths": rows}, args.json)


if __name__ == "__main__":
    harness.main("closed-queue.py", body)
