#!/usr/bin/python3
"""Soak run: honest clients keep verifying their data while hostile clients
stall, idle connections pile up, and the server is killed with -9 and
restarted halfway through.

Every client is a real NBD peer: fio's nbd engine for the honest clients,
libnbd (Debian's python3-libnbd) for the hostile and idle ones.
- honest clients: fio rounds of random 4 KiB writes with crc32c verify and
  an fsync at the end, each client on its own 64 MiB region; a round during
  which the server was killed is "interrupted", and the client then checks
  its last completed round with fio --verify_only once the server is back.
  verify_failures counts every verify that failed (must be 0) and
  honest_rounds_failed rounds that failed with the server up (must be 0);
- hostile clients (--hostile): each asks for four 32 MiB reads on a socket
  with a 4 KiB receive buffer and never reads a reply, reconnecting
  whenever the server drops it;
- idle connections (--idle): half never finish the handshake (dropped at
  the server's deadline, then reopened), half finish it and sit idle;
- the server's peak RSS, sampled every 0.2 s.

Prints progress, then one JSON object: the counters above, kill9_restarts,
restart_seconds, max_rss_bytes, exit_status (of the final clean stop),
refused_connections (idle handshakes that failed with the server up) and
refused_reasons (libnbd's messages for them).
Exit status 1 if a verify failed or an honest round failed with the server
up. Needs fio (nbd engine) and python3-libnbd.

  --quick   20 s, 3 honest, 6 hostile, 40 idle clients
  default   180 s, 4 honest, 4 hostile, 60 idle clients
"""

import os
import select
import socket
import subprocess
import threading
import time

import harness

REGION = 64 << 20
ROUND_BYTES = 16 << 20
HOSTILE_READ = 32 << 20


def log(message):
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class Target:
    """The served volume, restartable, with the times of its kills: each
    from just before the kill to the restarted server listening."""

    def __init__(self, server):
        self.server = server
        self.lock = threading.Lock()
        self.kills = []  # (killed, restarted)

    def up(self):
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(self.server.sock)
            return True
        except OSError:
            return False

    def kill9_and_restart(self):
        with self.lock:
            killed = time.monotonic()
            self.kills.append((killed, None))
            self.server.kill()
            self.server.start()
            restarted = time.monotonic()
            self.kills[-1] = (killed, restarted)
            return restarted - killed

    def killed_between(self, start, end):
        """True if a kill and restart overlapped [start, end]: a connection
        made to the old server just before the kill, or queued on its
        socket, fails after it in ways the client names variously."""
        return any(start <= (restarted or end) and killed <= end
                   for killed, restarted in self.kills)


def wait_dropped(handle, stop):
    """Until the server closes the connection or the run ends."""
    watch = select.poll()
    watch.register(handle.aio_get_fd(), select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    while not stop.is_set() and not watch.poll(500):
        pass


def hostile(nbd, target, stop, counts):
    """Pipelines four 32 MiB reads and never reads a reply."""
    while not stop.is_set():
        try:
            s = socket.socket(socket.AF_UNIX)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(target.server.sock)
            handle = nbd.NBD()
            handle.connect_socket(s.detach())  # libnbd owns the socket now
            buffers = [nbd.Buffer(HOSTILE_READ) for _ in range(4)]
            for i, buffer in enumerate(buffers):
                handle.aio_pread(buffer, i * HOSTILE_READ)
            counts["hostile_connections"] += 1
            wait_dropped(handle, stop)
            del handle, buffers
        except (OSError, nbd.Error):
            time.sleep(0.2)


def idle(nbd, target, stop, counts, reasons, finish_handshake):
    """Opens a connection and sits on it; reopens it when dropped."""
    while not stop.is_set():
        handle = nbd.NBD()
        try:
            if finish_handshake:
                counts["idle_connections_opened"] += 1
                started = time.monotonic()
                try:
                    handle.connect_unix(target.server.sock)
                except nbd.Error as error:
                    # Refused: the handshake failed with a server up. Not
                    # the restart: no socket, nobody listening, or a reset
                    # of a connection queued on the killed server's socket
                    # (libnbd 1.14 reports a reset that comes before the
                    # socket is writable as "external event 0 is invalid
                    # in state CONNECT.START", EINVAL), so a failure that
                    # overlapped a kill does not count either. (libnbd's
                    # Error gives the errno's name as .errno.)
                    restart = target.killed_between(started, time.monotonic())
                    if not restart and error.errno not in (
                            "ENOENT", "ECONNREFUSED", "ECONNRESET"):
                        counts["refused_connections"] += 1
                        reasons.add(error.string)
                    time.sleep(0.2)
                    continue
            else:
                # Starts connecting; with nobody driving libnbd's state
                # machine the handshake never gets past the greeting.
                handle.aio_connect_unix(target.server.sock)
                counts["idle_connections_opened"] += 1
            wait_dropped(handle, stop)
        except nbd.Error:
            time.sleep(0.2)
        finally:
            del handle


def fio_round(uri, offset, seed, verify_only=False):
    args = ["fio", "--name=soak", "--ioengine=nbd", f"--uri={uri}", "--rw=randwrite",
            "--bs=4k", f"--size={ROUND_BYTES}", f"--offset={offset}", "--iodepth=8",
            "--verify=crc32c", "--verify_fatal=1", f"--randseed={seed}",
            "--refill_buffers", "--end_fsync=1", "--output-format=terse"]
    if verify_only:
        args.append("--verify_only")
    done = subprocess.run(args, capture_output=True, text=True)
    stderr = done.stderr.lower()
    return done.returncode == 0, "verify" in stderr and "bad" in stderr, done.stderr.strip()[-400:]


def honest(target, index, stop, counts):
    uri = target.server.uri
    offset = index * REGION
    last_done = None
    seed = 1000 * index
    while not stop.is_set():
        seed += 1
        started = time.monotonic()
        ok, verify_error, detail = fio_round(uri, offset, seed)
        ended = time.monotonic()
        if ok:
            counts["honest_rounds"] += 1
            last_done = seed
            continue
        if target.killed_between(started, ended) or not target.up():
            counts["interrupted_rounds"] += 1
            log(f"client {index}: round interrupted by the kill")
            while not target.up() and not stop.is_set():
                time.sleep(0.1)
            time.sleep(0.2)
            if last_done is not None:
                # Everything the last completed round wrote was flushed.
                ok, _, detail = fio_round(uri, offset, last_done, verify_only=True)
                counts["verifies_after_kill"] += 1
                log(f"client {index}: last completed round verified after the restart: "
                    f"{'ok' if ok else 'FAILED'}")
                if not ok:
                    counts["verify_failures"] += 1
                    log(f"client {index}: verify after kill -9 FAILED: {detail}")
            continue
        counts["honest_rounds_failed"] += 1
        if verify_error:
            counts["verify_failures"] += 1
        log(f"client {index}: round failed with the server up: {detail}")


def body():
    parser = harness.parser(__doc__)
    harness.add_zdisk(parser)
    parser.add_argument("--dir", help="where the image and the server's log go (kept)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--clients", type=harness.positive, help="honest fio clients")
    parser.add_argument("--idle", type=int, help="idle connections")
    parser.add_argument("--hostile", type=int, help="clients that ask for 128 MiB and never read")
    parser.add_argument("--json", help="also append the summary JSON to this file")
    args = parser.parse_args()
    seconds = args.seconds or (20 if args.quick else 180)
    clients = args.clients or (3 if args.quick else 4)
    idle_count = args.idle if args.idle is not None else (40 if args.quick else 60)
    hostile_count = args.hostile if args.hostile is not None else (6 if args.quick else 4)
    zdisk = harness.zdisk_binary(args.zdisk)
    harness.require_tools("fio")
    try:
        import nbd
    except ImportError:
        raise harness.Missing("python3-libnbd (run this with /usr/bin/python3)") from None

    with harness.Teardown() as teardown:
        work = harness.workdir(teardown, args.dir, "soak.")
        image = os.path.join(work, "soak.zdisk")
        harness.zdisk_create(zdisk, image, "--logical", f"{(clients + 1) * REGION // (1 << 20)}M",
                             "--force")
        server = harness.Server(teardown, zdisk, image, os.path.join(work, "soak.sock"),
                                metrics=False, start_seconds=60)
        target = Target(server)
        counts = {k: 0 for k in ["honest_rounds", "honest_rounds_failed", "interrupted_rounds",
                                 "verify_failures", "verifies_after_kill", "hostile_connections",
                                 "idle_connections_opened", "refused_connections"]}
        stop = threading.Event()
        threads = [threading.Thread(target=hostile, args=(nbd, target, stop, counts))
                   for _ in range(hostile_count)]
        reasons = set()
        threads += [threading.Thread(target=idle, args=(nbd, target, stop, counts, reasons,
                                                        i % 2 == 0))
                    for i in range(idle_count)]
        threads += [threading.Thread(target=honest, args=(target, i, stop, counts))
                    for i in range(clients)]
        log(f"soak: {clients} fio clients, {hostile_count} hostile, {idle_count} idle, "
            f"{seconds:.0f} s")
        teardown.push("client threads", lambda: [stop.set()] + [t.join(120) for t in threads])
        for t in threads:
            t.start()
        started = time.monotonic()
        max_rss = 0
        kill_at = started + seconds / 2
        restart_seconds = []
        while time.monotonic() - started < seconds:
            max_rss = max(max_rss, server.rss())
            if kill_at and time.monotonic() >= kill_at:
                kill_at = None
                log("kill -9 and restart")
                restart_seconds.append(target.kill9_and_restart())
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        status = harness.stop_process(server.process, seconds=60)
        summary = dict(counts, seconds=round(time.monotonic() - started, 1), clients=clients,
                       idle=idle_count, hostile=hostile_count,
                       kill9_restarts=len(restart_seconds),
                       restart_seconds=[round(s, 2) for s in restart_seconds],
                       max_rss_bytes=max_rss, exit_status=status,
                       refused_reasons=sorted(reasons))
    log(f"honest rounds {counts['honest_rounds']} (failed {counts['honest_rounds_failed']}, "
        f"interrupted {counts['interrupted_rounds']}), verify failures {counts['verify_failures']}, "
        f"peak RSS {max_rss / (1 << 20):.0f} MiB, hostile connections "
        f"{counts['hostile_connections']}, idle connections opened "
        f"{counts['idle_connections_opened']}")
    harness.emit_json(summary, args.json)
    return 1 if counts["verify_failures"] or counts["honest_rounds_failed"] else 0


if __name__ == "__main__":
    harness.main("soak.py", body)
