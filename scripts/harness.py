"""What every benchmark and soak script in scripts/ shares.

One owner for each piece of plumbing the scripts need, so that a script
reads as its measurement and nothing else:

- `main(name, body)`: runs a script's body; a `Failure` or a failed
  command becomes one line on stderr and exit status 1, a missing
  prerequisite (`Missing`) exit status 2, Ctrl-C, SIGTERM and SIGHUP tear
  everything down first (exit status 130);
- `Teardown`: everything a script starts (servers, FUSE mounts, loop
  devices, mounts, clusters, directories), undone in reverse order
  whatever happens;
- `Server`: `zdisk serve` on a Unix socket with `/stats` on a free port;
  `Nbdkit` for the nbdkit peers;
- `fio`, `nbdcopy`: the clients, with fio's JSON parsed;
- `stats`: a server's /stats;
- `Ext4OnExport`: ext4 on an NBD export through nbdfuse and a loop device
  (the README's kernel-filesystem route);
- `Ceph`: the one-node test cluster of crates/zdisk/tests/support/ceph.sh;
- `corpus`: the /usr tar most scripts write and read back;
- `make_tree`, `nonzero_blocks`, `compsize_bytes`: the ext4 images of
  /usr trees that dedup.py and snapshots.py write, and btrfs's usage;
- `print_table`: a table of figures, as the scripts print them.

Scripts run under /usr/bin/python3, whose libnbd bindings (`import nbd`)
are Debian's python3-libnbd. Nothing here measures: it prints only the tables it is handed.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(SCRIPTS)
CEPH_SH = os.path.join(REPO, "crates", "zdisk", "tests", "support", "ceph.sh")
MIB = 1 << 20
BLOCK = 4096


class Failure(Exception):
    """A measurement that could not be taken; the message is one line."""


class Missing(Exception):
    """A prerequisite that is not there (a tool, root, a package)."""


class Interrupted(Exception):
    """Ctrl-C, SIGTERM or SIGHUP while a script ran."""


def main(name, body):
    """Runs `body()` (which returns an exit status or None) as script `name`."""
    pending = []

    def interrupt(number, _frame):
        raise Interrupted(signal.Signals(number).name)

    def hold(number, _frame):
        pending.append(signal.Signals(number).name)

    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, interrupt)
    try:
        status = body() or 0
    except Missing as why:
        print(f"{name}: missing prerequisite: {why}", file=sys.stderr)
        status = 2
    except Interrupted as why:
        print(f"{name}: stopped by {why}; everything it started is torn down", file=sys.stderr)
        status = 130
    except subprocess.CalledProcessError as error:
        command = " ".join(str(word) for word in error.cmd)
        detail = f"{error.stdout or ''}{error.stderr or ''}".strip()[-2000:]
        print(f"{name}: {command} failed ({error.returncode}): {detail}", file=sys.stderr)
        status = 1
    except (Failure, OSError) as error:
        print(f"{name}: {error}", file=sys.stderr)
        status = 1
    finally:
        # A second Ctrl-C must not cut the teardown short.
        for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(number, hold)
    sys.exit(status)


def parser(doc):
    """An argument parser whose --help is the script's docstring."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_zdisk(parser_, flag="--zdisk", help_text="the zdisk binary"):
    default = os.path.join(REPO, "target", "release", "zdisk")
    parser_.add_argument(flag, default=default, help=f"{help_text} (default: target/release/zdisk)")


def zdisk_binary(path):
    """The absolute path of an executable zdisk, or Missing."""
    path = os.path.abspath(path)
    if not os.access(path, os.X_OK):
        raise Missing(f"no zdisk binary at {path} (cargo build --release)")
    return path


def require_tools(*tools):
    for tool in tools:
        found = os.access(tool, os.X_OK) if tool.startswith("/") else shutil.which(tool)
        if not found:
            raise Missing(f"{tool} is not installed")


def require_root(why):
    if os.geteuid() != 0:
        raise Missing(f"needs root ({why})")


def parse_size(text):
    """Bytes from a size such as 4096, 64M, 1.5G or 16T (binary units)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise Failure(f"{text!r} is not a size (e.g. 64M, 1G)") from None


def positive(text):
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, what, seconds=60):
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise Failure(f"timed out after {seconds} s waiting for {what}")
        time.sleep(0.05)


def median(values):
    values = sorted(values)
    if not values:
        return None
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def progress(name, text):
    print(f"{name}: {text}", file=sys.stderr, flush=True)


def run(args, **kwargs):
    """A command that must succeed; its output captured as text."""
    return subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True,
                          start_new_session=True, **kwargs)


class Teardown:
    """Undo actions, run in reverse order by `close` (or at the end of a
    `with` block), each even if an earlier one failed."""

    def __init__(self):
        self.undo = []

    def push(self, what, action):
        self.undo.append((what, action))

    def close(self):
        while self.undo:
            what, action = self.undo.pop()
            try:
                action()
            except Exception as error:  # keep tearing down the rest
                print(f"teardown: {what}: {error}", file=sys.stderr)

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()


def workdir(teardown, path, prefix, base=None):
    """`path` if given (created, kept), else a new directory under `base`
    (the system's temporary directory by default) removed at teardown."""
    if path:
        os.makedirs(path, exist_ok=True)
        return os.path.abspath(path)
    made = tempfile.mkdtemp(prefix=prefix, dir=base)
    teardown.push(f"remove {made}", lambda: run(["rm", "-rf", "--one-file-system", made]))
    return made


def rss_bytes(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_seconds(pid):
    """User plus system CPU seconds of a running process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stats(address):
    """The /stats JSON of a zdisk server whose --metrics is `address`."""
    with urllib.request.urlopen(f"http://{address}/stats", timeout=30) as reply:
        return json.load(reply)


def stop_process(process, seconds=600, sig=signal.SIGTERM):
    """Signals a process and waits; kill -9 if it takes longer than `seconds`."""
    if process.poll() is not None:
        return process.returncode
    process.send_signal(sig)
    try:
        return process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise Failure(f"{process.args[0]} did not stop in {seconds} s after {sig.name}")


class Server:
    """`zdisk serve IMAGE --socket SOCK --metrics 127.0.0.1:PORT [flags]`,
    ready once the socket exists and /stats answers. Stopped at teardown
    if still running; `stop` (SIGTERM, a clean close) and `kill` (-9) do it
    earlier. Its stderr goes to SOCK.log."""

    def __init__(self, teardown, zdisk, image, sock, flags=(), env=None, metrics=True,
                 start_seconds=600):
        self.zdisk, self.image, self.sock = zdisk, image, sock
        self.flags, self.env, self.start_seconds = list(flags), env, start_seconds
        self.address = f"127.0.0.1:{free_port()}" if metrics else None
        self.log = sock + ".log"
        self.process = None
        self.start()
        teardown.push(f"zdisk serve {image}", self._teardown)

    def start(self):
        """Starts (or restarts) the server; returns the seconds until it answered."""
        if os.path.exists(self.sock):
            os.remove(self.sock)
        started = time.monotonic()
        command = [self.zdisk, "serve", self.image, "--socket", self.sock, *self.flags]
        if self.address:
            command += ["--metrics", self.address]
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log,
                                            env=self.env, start_new_session=True)
        wait_for(lambda: os.path.exists(self.sock) or self.process.poll() is not None,
                 f"zdisk serve {self.image}", self.start_seconds)
        if self.process.poll() is not None:
            raise Failure(f"zdisk serve exited with {self.process.returncode}: {self.log_tail()}")
        if self.address:
            wait_for(self._answers, "zdisk's /stats", self.start_seconds)
        return time.monotonic() - started

    def _answers(self):
        try:
            stats(self.address)
            return True
        except OSError:
            return False

    @property
    def pid(self):
        return self.process.pid

    @property
    def uri(self):
        return f"nbd+unix:///?socket={self.sock}"

    def stats(self):
        if not self.address:
            raise Failure("this server was started without --metrics")
        return stats(self.address)

    def rss(self):
        return rss_bytes(self.process.pid)

    def cpu_seconds(self):
        return cpu_seconds(self.process.pid)

    def log_tail(self):
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-2000:].strip()
        except OSError:
            return ""

    def stop(self, sig=signal.SIGTERM):
        """A clean stop, which must exit 0; returns its seconds."""
        started = time.monotonic()
        status = stop_process(self.process, sig=sig)
        if status != 0:
            raise Failure(f"zdisk serve exited with {status}: {self.log_tail()}")
        return time.monotonic() - started

    def kill(self):
        """kill -9: what a crash leaves behind."""
        self.process.kill()
        self.process.wait()

    def _teardown(self):
        if self.process and self.process.poll() is None:
            stop_process(self.process, seconds=120)


class Nbdkit:
    """nbdkit's memory plugin on a Unix socket: the protocol's ceiling."""

    def __init__(self, teardown, sock, size_bytes):
        if os.path.exists(sock):
            os.remove(sock)
        self.sock = sock
        self.process = subprocess.Popen(
            ["nbdkit", "--foreground", "--exit-with-parent", "--unix", sock, "memory",
             str(size_bytes)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        teardown.push("nbdkit", lambda: stop_process(self.process, seconds=60))
        wait_for(lambda: os.path.exists(sock) or self.process.poll() is not None, "nbdkit")
        if self.process.poll() is not None:
            raise Failure(f"nbdkit exited with {self.process.returncode}")

    @property
    def pid(self):
        return self.process.pid

    @property
    def uri(self):
        return f"nbd+unix:///?socket={self.sock}"

    def cpu_seconds(self):
        return cpu_seconds(self.process.pid)

    def stop(self):
        stop_process(self.process, seconds=60)


def zdisk_create(zdisk, image, *words, env=None):
    """`zdisk create IMAGE words...`; a failure is one line."""
    done = subprocess.run([zdisk, "create", image, *map(str, words)], capture_output=True,
                          text=True, env=env)
    if done.returncode != 0:
        raise Failure(f"zdisk create {image} failed: {done.stderr.strip()}")


def fio(uri, name, rw, bs, *options, iodepth=16, check=True):
    """One fio job on the NBD export at `uri` (fio's nbd engine; with `uri`
    None, `options` name the engine and file), JSON output parsed. `options`
    are further fio flags such as "--size=64M". fio's nbd engine prints a
    line before its JSON, so everything before the first `{` is dropped."""
    engine = ["--ioengine=nbd", f"--uri={uri}"] if uri is not None else []
    command = ["fio", f"--name={name}", *engine, f"--rw={rw}", f"--bs={bs}",
               f"--iodepth={iodepth}", "--output-format=json", *options]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        if not check:
            return None
        raise Failure(f"fio {name} ({rw}) failed: {(done.stdout + done.stderr).strip()[-2000:]}")
    out = done.stdout
    if "{" not in out:
        raise Failure(f"fio {name} printed no JSON: {out[-500:]}")
    return json.loads(out[out.index("{"):])


def fio_job(result, kind="read"):
    """The first job's `read` or `write` section of fio's JSON."""
    return result["jobs"][0][kind]


def nbdcopy(*words):
    """`nbdcopy words...`; returns its seconds."""
    started = time.monotonic()
    done = subprocess.run(["nbdcopy", *map(str, words)], capture_output=True, text=True)
    if done.returncode != 0:
        raise Failure(f"nbdcopy {' '.join(map(str, words))} failed: {done.stderr.strip()}")
    return time.monotonic() - started


# The reference workload of issue #27: the first 512 MiB of a tar of these.
REFERENCE_TREES = ["/usr/share/doc", "/usr/lib/x86_64-linux-gnu", "/usr/bin"]


def corpus(path, size_bytes, directory, trees=("/usr",)):
    """The file to write and read back: `path` if given, else the first
    `size_bytes` of a tar of `trees` (/usr) made in `directory` (real OS
    files: executables, libraries, text; it compresses about 1.6x with lz4)."""
    if path:
        if not os.path.isfile(path):
            raise Failure(f"no corpus at {path}")
        return os.path.abspath(path)
    made = os.path.join(directory, "corpus.tar")
    trees = [tree for tree in trees if os.path.isdir(tree)] or ["/usr"]
    tar_prefix(made, size_bytes, ["--one-file-system", *trees])
    if os.path.getsize(made) != size_bytes:
        raise Failure(f"only {os.path.getsize(made)} bytes of {' '.join(trees)} could be "
                      f"tarred, not {size_bytes}")
    return made


def tar_prefix(made, size_bytes, words):
    """Writes to `made` the first `size_bytes` (at most) of `tar cf - WORDS`."""
    with open(made, "wb") as out:
        tar = subprocess.Popen(["tar", "cf", "-", *words], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL)
        remaining = size_bytes
        while remaining:
            chunk = tar.stdout.read(min(remaining, MIB))
            if not chunk:
                break
            out.write(chunk)
            remaining -= len(chunk)
        tar.kill()
        tar.wait()


class Ext4OnExport:
    """ext4 on an NBD export, the README's kernel-filesystem route:
    nbdfuse makes the export a file, a loop device makes the file a block
    device, mkfs.ext4 and mount. Every step is pushed onto `teardown`.
    `direct_io` opens the loop device with direct I/O, so that no second
    page cache sits between ext4 and the FUSE file."""

    def __init__(self, teardown, uri, work, mkfs_options=("-E", "nodiscard"), mount_options="",
                 direct_io=False, mkfs=True):
        self.raw = os.path.join(work, "nbd.raw")
        self.mnt = os.path.join(work, "mnt")
        os.makedirs(self.mnt, exist_ok=True)
        open(self.raw, "w").close()
        self.fuse = subprocess.Popen(["nbdfuse", self.raw, uri], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        teardown.push("nbdfuse", self._unfuse)
        # losetup before nbdfuse has sized its file would see 0 bytes.
        wait_for(lambda: os.path.getsize(self.raw) > 0 or self.fuse.poll() is not None, "nbdfuse")
        if self.fuse.poll() is not None:
            raise Failure(f"nbdfuse exited with {self.fuse.returncode}")
        loop = ["losetup", "-f", "--show"] + (["--direct-io=on"] if direct_io else [])
        self.loop = run(loop + [self.raw]).stdout.strip()
        teardown.push("loop device", lambda: run(["losetup", "-d", self.loop]))
        if mkfs:
            run(["mkfs.ext4", "-q", *mkfs_options, self.loop])
        run(["mount"] + (["-o", mount_options] if mount_options else []) + [self.loop, self.mnt])
        teardown.push("mount", self.unmount)

    def unmount(self):
        unmount(self.mnt, ["umount"])

    def read_only(self):
        """Whether the kernel has made the filesystem read-only: ext4 does
        so on an I/O error from the export (the mount's options in
        /proc/self/mounts then say `ro` or `emergency_ro`)."""
        options = mount_options(self.mnt)
        return options is not None and bool({"ro", "emergency_ro"} & set(options))

    def _unfuse(self):
        # Even if nbdfuse has died (its server gone), its mount stays until
        # unmounted.
        unmount(self.raw, ["fusermount3", "-u"])
        try:
            self.fuse.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.fuse.kill()
            self.fuse.wait()


def unmount(path, command, tries=10):
    """Unmounts `path` with `command` (umount, or fusermount3 -u), trying
    again for a while if it is busy (a process still closing files on it,
    a loop device still letting go of it), then lazily (the kernel detaches
    it once nothing uses it), so that one failed step of a teardown does
    not leave a mount behind, nor whatever serves it waiting on it. Raises
    if it had to be lazy, after doing so."""
    for _ in range(tries):
        if not mounted(path):
            return
        if subprocess.run([*command, path], capture_output=True).returncode == 0:
            return
        time.sleep(1)
    if mounted(path):
        lazy = [*command, "-z" if command[0] == "fusermount3" else "-l", path]
        subprocess.run(lazy, capture_output=True)
        raise Failure(f"{path} stayed busy for {tries} s; unmounted lazily ({' '.join(lazy)})")


def btrfs_mount(teardown, work, size_bytes):
    """A btrfs with compress-force=zstd:1 on a loop device over a sparse
    file of `size_bytes` in `work`, mounted at work/btrfs; `teardown`
    unmounts it and frees the device and file. Returns the mount point."""
    loop_file = os.path.join(work, "btrfs.img")
    mount = os.path.join(work, "btrfs")
    os.makedirs(mount, exist_ok=True)
    with open(loop_file, "wb") as f:
        f.truncate(size_bytes)
    teardown.push("loop file", lambda: os.remove(loop_file))
    device = run(["losetup", "-f", "--show", loop_file]).stdout.strip()
    teardown.push("loop device", lambda: run(["losetup", "-d", device]))
    run(["mkfs.btrfs", "-q", "-f", device])
    run(["mount", "-o", "compress-force=zstd:1", device, mount])
    teardown.push("mount", lambda: run(["umount", mount]))
    return mount


# The OS images of dedup.py and snapshots.py: ext4 images of this size
# made with `mkfs.ext4 -d` of tree A (copies of these directories; the
# quick tree with --quick), and of tree A plus B's extra.
OS_IMAGE_BYTES = 512 * MIB
OS_TREE_A = ["/usr/share/doc", "/usr/lib/python3", "/usr/share/perl"]
OS_TREE_A_QUICK = ["/usr/share/perl"]
OS_TREE_B_EXTRA = ["/usr/share/i18n"]


def compsize_bytes(paths):
    """compsize's disk usage of `paths` (a btrfs's shared extents once)."""
    for line in run(["compsize", "-b", *paths]).stdout.splitlines():
        if line.startswith("TOTAL"):
            return int(line.split()[2])
    raise Failure("compsize printed no TOTAL line")


def make_tree(work, name, sources):
    """work/name holding a copy of each directory in `sources`."""
    tree = os.path.join(work, name)
    os.makedirs(tree)
    for source in sources:
        if not os.path.isdir(source):
            raise Missing(f"{source} is not here to copy into tree {name}")
        run(["cp", "-a", source, os.path.join(tree, os.path.basename(source))])
    return tree


def nonzero_blocks(image):
    """Indexes of the non-zero 4 KiB blocks of `image`."""
    zero = bytes(BLOCK)
    found = []
    with open(image, "rb") as f:
        index = 0
        while True:
            block = f.read(BLOCK)
            if not block:
                break
            if block != zero:
                found.append(index)
            index += 1
    return found


def mounted(path):
    """Whether something is mounted on `path` (a directory or a file)."""
    return mount_options(path) is not None


def mount_options(path):
    """The options of the newest mount on `path` (a directory or a file),
    as a list; None if nothing is mounted there."""
    path = os.path.realpath(path)
    found = None
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            # Spaces in mount points are written as \040.
            if fields[1].replace("\\040", " ") == path:
                found = fields[3].split(",")
    return found


class Ceph:
    """The one-node Ceph with radosgw that the tier's tests boot
    (crates/zdisk/tests/support/ceph.sh), stopped at teardown. `env` holds
    the AWS_* settings a client needs."""

    def __init__(self, teardown, directory):
        check = subprocess.run(["bash", CEPH_SH, "check"], capture_output=True, text=True)
        if check.returncode != 0:
            raise Missing(f"cannot run the test cluster: {check.stdout.strip()}")
        self.dir = os.path.join(directory, "ceph")
        started = time.monotonic()
        done = subprocess.run(["bash", CEPH_SH, "start", self.dir], capture_output=True, text=True,
                              start_new_session=True)
        teardown.push("ceph", lambda: subprocess.run(["bash", CEPH_SH, "stop", self.dir],
                                                     capture_output=True))
        if done.returncode != 0:
            raise Failure(f"ceph.sh start failed: {(done.stdout + done.stderr).strip()[-2000:]}")
        self.boot_seconds = time.monotonic() - started
        self.env = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)

    def create_bucket(self, name):
        """A bucket, by a request signed as the cluster's S3 user."""
        done = subprocess.run(
            ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--aws-sigv4",
             "aws:amz:us-east-1:s3", "--user",
             f"{self.env['AWS_ACCESS_KEY_ID']}:{self.env['AWS_SECRET_ACCESS_KEY']}",
             "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD", "-X", "PUT",
             f"{self.env['AWS_ENDPOINT_URL']}/{name}"],
            capture_output=True, text=True)
        if done.stdout.strip() != "200":
            raise Failure(f"creating bucket {name}: HTTP {done.stdout.strip() or done.stderr}")


def print_table(header, body):
    """Rows of text cells: the first column left-aligned, the others right,
    a rule under the header. Prints only what it is given."""
    table = [header] + body
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for index, r in enumerate(table):
        print("  " + "  ".join(c.rjust(w) if i else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths))))
        if index == 0:
            print("  " + "-" * (sum(widths) + 2 * (len(widths) - 1)))


def emit_json(result, path=None):
    """The result as one JSON line on stdout, and in `path` if given."""
    line = json.dumps(result)
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
