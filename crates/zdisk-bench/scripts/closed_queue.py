#!/usr/bin/env python3
"""Closed-queue simulation of random 4 KiB reads on FEMU's default timing.

An independent cross-check of `zdisk bench --profile femu-default
--scenario qd` (docs/emulation.md, "FEMU calibration"): QD slots, each
issuing its next read when the previous one completes, to one of PLANES
planes chosen uniformly at random; a plane serves its reads one at a time
for T_READ microseconds. Nothing else takes time, as in FEMU. Prints IOPS
and mean latency for each queue depth.

Usage: closed_queue.py [reads] [seed]
"""
import heapq
import random
import sys

PLANES = 64  # 8 channels x 8 LUNs, one plane each
T_READ_US = 40.0


def simulate(depth, reads, seed):
    rng = random.Random(seed)
    plane_free = [0.0] * PLANES
    slots = [0.0] * depth  # time at which each slot issues its next read
    heapq.heapify(slots)
    end = 0.0
    latency = 0.0
    for _ in range(reads):
        issued = heapq.heappop(slots)
        plane = rng.randrange(PLANES)
        done = max(issued, plane_free[plane]) + T_READ_US
        plane_free[plane] = done
        latency += done - issued
        end = max(end, done)
        heapq.heappush(slots, done)
    return reads / end * 1e6, latency / reads


def main():
    reads = int(sys.argv[1]) if len(sys.argv) > 1 else 400_000
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    print(f"{'QD':>3} {'IOPS':>9} {'latency us':>11}")
    for depth in (1, 2, 4, 8, 16, 32):
        iops, latency = simulate(depth, reads, seed)
        print(f"{depth:>3} {iops:>9.0f} {latency:>11.1f}")


if __name__ == "__main__":
    main()
