#!/usr/bin/python3
"""Soak run: honest clients keep verifying their data while a hostile client
stalls, idle connections pile up, and the server is killed with -9 and
restarted.

What it measures, and prints as a JSON line at the end:
- honest rounds: each honest client runs fio rounds (random 4 KiB writes
  with crc32c verify, fsync at the end) on its own region; a round during
  which the server was killed is "interrupted", and the client then checks
  its last completed round with fio --verify_only once the server is back.
  verify_failures counts every verify that failed (must be 0), and
  honest_rounds_failed rounds that failed with the server up (must be 0);
- hostile clients (--hostile): each asks for four 32 MiB reads and never
  reads a reply, reconnecting whenever the server drops it;
- idle connections: half never finish the handshake (dropped at its
  deadline, then reopened), half finish it and sit idle;
- the server's peak RSS, sampled every 0.2 s.

Usage: soak.py --zdisk BIN --dir DIR [--seconds 180] [--clients 4] [--idle 60] [--hostile 4]
Run it with Debian's python3; it needs fio. Exit status 1 if a verify
failed or an honest round failed with the server up.
"""

import argparse
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

NBDMAGIC = 0x4E42444D41474943
IHAVEOPT = 0x49484156454F5054
REQUEST_MAGIC = 0x25609513
OPT_GO = 7
CMD_READ = 0
REGION = 64 << 20
ROUND_BYTES = 16 << 20


def log(message):
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class Server:
    """zdisk serve on a Unix socket, restartable."""

    def __init__(self, zdisk, image, sock, log_path):
        self.zdisk, self.image, self.sock = zdisk, image, sock
        self.log = open(log_path, "ab")
        self.proc = None
        self.lock = threading.Lock()
        self.kills = []  # when each kill -9 began
        self.start()

    def start(self):
        self.proc = subprocess.Popen(
            [self.zdisk, "serve", self.image, "--socket", self.sock],
            stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.time() + 60
        while time.time() < deadline:
            if os.path.exists(self.sock) and self.connectable():
                return
            time.sleep(0.05)
        raise RuntimeError("zdisk serve did not start")

    def connectable(self):
        try:
            s = socket.socket(socket.AF_UNIX)
            s.connect(self.sock)
            s.close()
            return True
        except OSError:
            return False

    def kill9_and_restart(self):
        with self.lock:
            killed = time.time()
            self.kills.append(killed)
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.start()
            return time.time() - killed

    def rss(self):
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def killed_between(self, start, end):
        return any(start <= killed <= end for killed in self.kills)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def handshake(sock, name=b""):
    """Fixed newstyle handshake with NBD_OPT_GO; returns True if served."""
    greeting = recv_exact(sock, 18)
    if struct.unpack(">QQ", greeting[:16]) != (NBDMAGIC, IHAVEOPT):
        return False
    sock.sendall(struct.pack(">I", 3))  # FIXED_NEWSTYLE | NO_ZEROES
    data = struct.pack(">I", len(name)) + name + struct.pack(">H", 0)
    sock.sendall(struct.pack(">QII", IHAVEOPT, OPT_GO, len(data)) + data)
    while True:
        header = recv_exact(sock, 20)
        _, _, reply_type, length = struct.unpack(">QIII", header)
        recv_exact(sock, length)
        if reply_type == 1:  # ACK
            return True
        if reply_type & 0x80000000:
            return False


def recv_exact(sock, count):
    out = b""
    while len(out) < count:
        chunk = sock.recv(count - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def hostile(server, stop, stats):
    """Pipelines four 32 MiB reads and never reads a reply."""
    while not stop.is_set():
        try:
            s = socket.socket(socket.AF_UNIX)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(server.sock)
            if not handshake(s):
                s.close()
                time.sleep(0.5)
                continue
            for i in range(4):
                s.sendall(struct.pack(">IHHQQI", REQUEST_MAGIC, 0, CMD_READ, i, i * (32 << 20), 32 << 20))
            stats["hostile_connections"] += 1
            # Never read; wait until the server gives up on us (the reply
            # timeout) or the run ends.
            watch = select.poll()
            watch.register(s, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
            while not stop.is_set() and not watch.poll(500):
                pass
            s.close()
        except (OSError, ConnectionError):
            time.sleep(0.2)


def idle(server, stop, stats, finish_handshake):
    """Opens a connection and sits on it; reopens it when dropped."""
    while not stop.is_set():
        try:
            s = socket.socket(socket.AF_UNIX)
            s.connect(server.sock)
            stats["idle_connections_opened"] += 1
            if finish_handshake:
                if not handshake(s):
                    stats["refused_connections"] += 1
            else:
                recv_exact(s, 18)  # the greeting, then silence
            s.settimeout(1.0)
            while not stop.is_set():
                try:
                    if not s.recv(1 << 16):
                        break  # dropped (handshake deadline, restart)
                except socket.timeout:
                    continue
            s.close()
        except (OSError, ConnectionError):
            time.sleep(0.2)


def fio(uri, offset, seed, verify_only=False):
    args = ["fio", "--name=soak", "--ioengine=nbd", f"--uri={uri}", "--rw=randwrite",
            "--bs=4k", f"--size={ROUND_BYTES}", f"--offset={offset}", "--iodepth=8",
            "--verify=crc32c", "--verify_fatal=1", f"--randseed={seed}",
            "--refill_buffers", "--end_fsync=1", "--output-format=terse"]
    if verify_only:
        args.append("--verify_only")
    result = subprocess.run(args, capture_output=True, text=True)
    verify_error = "verify" in result.stderr.lower() and "bad" in result.stderr.lower()
    return result.returncode == 0, verify_error, result.stderr.strip()[-400:]


def honest(server, index, stop, stats):
    uri = f"nbd+unix:///?socket={server.sock}"
    offset = index * REGION
    last_done = None
    seed = 1000 * index
    while not stop.is_set():
        seed += 1
        started = time.time()
        ok, verify_error, detail = fio(uri, offset, seed)
        ended = time.time()
        if ok:
            stats["honest_rounds"] += 1
            last_done = seed
            continue
        if server.killed_between(started, ended) or not server.connectable():
            stats["interrupted_rounds"] += 1
            log(f"client {index}: round interrupted by the kill")
            while not server.connectable() and not stop.is_set():
                time.sleep(0.1)
            time.sleep(0.2)
            if last_done is not None:
                # Everything the last completed round wrote was flushed.
                ok, _, detail = fio(uri, offset, last_done, verify_only=True)
                stats["verifies_after_kill"] += 1
                log(f"client {index}: last completed round verified after the restart: {'ok' if ok else 'FAILED'}")
                if not ok:
                    stats["verify_failures"] += 1
                    log(f"client {index}: verify after kill -9 FAILED: {detail}")
            continue
        stats["honest_rounds_failed"] += 1
        if verify_error:
            stats["verify_failures"] += 1
        log(f"client {index}: round failed with the server up: {detail}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zdisk", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--seconds", type=float, default=180)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--idle", type=int, default=60)
    parser.add_argument("--hostile", type=int, default=4,
                        help="clients that ask for 128 MiB each and never read")
    args = parser.parse_args()

    os.makedirs(args.dir, exist_ok=True)
    image = os.path.join(args.dir, "soak.zdisk")
    sock = os.path.join(args.dir, "soak.sock")
    if os.path.exists(image):
        os.remove(image)
    subprocess.run([args.zdisk, "create", image, "--logical",
                    str((args.clients + 1) * REGION // (1 << 20)) + "M"], check=True,
                   stdout=subprocess.DEVNULL)
    server = Server(args.zdisk, image, sock, os.path.join(args.dir, "serve.log"))
    stats = {k: 0 for k in ["honest_rounds", "honest_rounds_failed", "interrupted_rounds",
                            "verify_failures", "verifies_after_kill", "hostile_connections",
                            "idle_connections_opened", "refused_connections"]}
    stop = threading.Event()
    threads = [threading.Thread(target=hostile, args=(server, stop, stats))
               for _ in range(args.hostile)]
    threads += [threading.Thread(target=idle, args=(server, stop, stats, i % 2 == 0))
                for i in range(args.idle)]
    threads += [threading.Thread(target=honest, args=(server, i, stop, stats))
                for i in range(args.clients)]
    log(f"soak: {args.clients} fio clients, {args.hostile} hostile, {args.idle} idle, "
        f"{args.seconds:.0f} s")
    for t in threads:
        t.start()
    started = time.time()
    max_rss = 0
    kill_at = started + args.seconds / 2
    restart_seconds = []
    while time.time() - started < args.seconds:
        max_rss = max(max_rss, server.rss())
        if kill_at and time.time() >= kill_at:
            kill_at = None
            log("kill -9 and restart")
            restart_seconds.append(server.kill9_and_restart())
        time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    status = server.stop()
    summary = dict(stats, seconds=round(time.time() - started, 1), clients=args.clients,
                   idle=args.idle, hostile=args.hostile, kill9_restarts=len(restart_seconds),
                   restart_seconds=[round(s, 2) for s in restart_seconds],
                   max_rss_bytes=max_rss, exit_status=status)
    log(f"honest rounds {stats['honest_rounds']} (failed {stats['honest_rounds_failed']}, "
        f"interrupted {stats['interrupted_rounds']}), verify failures {stats['verify_failures']}, "
        f"peak RSS {max_rss / (1 << 20):.0f} MiB, hostile connections {stats['hostile_connections']}, "
        f"idle connections opened {stats['idle_connections_opened']}")
    print(json.dumps(summary), flush=True)
    sys.exit(1 if stats["verify_failures"] or stats["honest_rounds_failed"] else 0)


if __name__ == "__main__":
    main()
