# Sends malformed and out-of-range NBD requests with libnbd's strict mode
# off, and a truly unknown command over a raw socket. Every request must get
# the right error, and the connection must keep working after each.
# Run under /usr/bin/python3: bad_requests.py SOCKET_PATH
import errno
import socket
import struct
import sys

import nbd

path = sys.argv[1]
uri = f"nbd+unix:///?socket={path}"
failures = []


def connect(meta=True):
    h = nbd.NBD()
    if meta:
        h.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
    h.connect_uri(uri)
    h.set_strict_mode(0)
    return h


h = connect()
size = h.get_size()
marker = b"\x5a" * 4096
h.pwrite(marker, 0)


def still_works(handle, what):
    try:
        if handle.pread(4096, 0) != marker:
            failures.append(f"{what}: block 0 changed")
    except nbd.Error as e:
        failures.append(f"{what}: connection broken afterwards: {e}")


def expect(what, expected, fn, handle=h):
    try:
        fn()
        failures.append(f"{what}: succeeded, expected {errno.errorcode[expected]}")
    except nbd.Error as e:
        # libnbd's exception carries the number in errnum (errno is its name).
        if e.errnum != expected:
            failures.append(f"{what}: got {e.errno} ({e}), expected {errno.errorcode[expected]}")
        else:
            print(f"ok: {what} -> {errno.errorcode[expected]}")
    still_works(handle, what)


expect("read past the end", errno.EINVAL, lambda: h.pread(4096, size))
expect("read straddling the end", errno.EINVAL, lambda: h.pread(8192, size - 4096))
expect("read with offset overflow", errno.EINVAL, lambda: h.pread(4096, 2**64 - 4096))
expect("write past the end", errno.ENOSPC, lambda: h.pwrite(b"x" * 4096, size))
expect("trim past the end", errno.EINVAL, lambda: h.trim(4096, size))
expect("write zeroes past the end", errno.ENOSPC, lambda: h.zero(4096, size))
expect("cache past the end", errno.EINVAL, lambda: h.cache(4096, size))
expect("block status past the end", errno.EINVAL, lambda: h.block_status(4096, size, lambda *a: 0))
expect("misaligned read", errno.EINVAL, lambda: h.pread(100, 1))
expect("misaligned write", errno.EINVAL, lambda: h.pwrite(b"y" * 700, 3))
expect("misaligned trim", errno.EINVAL, lambda: h.trim(1000, 7))
# Requests up to 64 MiB are served (libnbd itself sends no more; the raw
# socket below sends more).
big = h.pread(64 << 20, 0)
if len(big) != 64 << 20 or big[:4096] != marker:
    failures.append("a 64 MiB read did not return the export")
else:
    print("ok: 64 MiB read served")
expect("unknown command flag on read", errno.EINVAL, lambda: h.pread(4096, 0, flags=1 << 10))
expect("NO_HOLE flag on a write", errno.EINVAL, lambda: h.pwrite(marker, 0, flags=nbd.CMD_FLAG_NO_HOLE))
expect("zero-length block status", errno.EINVAL, lambda: h.block_status(0, 0, lambda *a: 0))

plain = connect(meta=False)
expect("block status without a metadata context", errno.EINVAL,
       lambda: plain.block_status(4096, 0, lambda *a: 0), handle=plain)

# A command type that does not exist, over a raw socket (libnbd cannot send one).
s = socket.socket(socket.AF_UNIX)
s.connect(path)


def recv_exact(n):
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise EOFError("server closed the connection")
        data += chunk
    return data


magic, opt_magic, _flags = struct.unpack(">QQH", recv_exact(18))
assert magic == 0x4E42444D41474943 and opt_magic == 0x49484156454F5054
s.sendall(struct.pack(">I", 3))  # FIXED_NEWSTYLE | NO_ZEROES
s.sendall(struct.pack(">QII", opt_magic, 1, 0))  # NBD_OPT_EXPORT_NAME ""
export_size, _tflags = struct.unpack(">QH", recv_exact(10))
for command, name in [(99, "unknown command 99"), (0xFFFF, "unknown command 65535")]:
    s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, command, 7, 0, 0))
    reply_magic, error, cookie = struct.unpack(">IIQ", recv_exact(16))
    if reply_magic != 0x67446698 or cookie != 7 or error != errno.EINVAL:
        failures.append(f"{name}: reply magic {reply_magic:#x} error {error} cookie {cookie}")
    else:
        print(f"ok: {name} -> EINVAL")
# READ of 64 MiB + 4 KiB, and a WRITE announcing 72 MiB whose payload
# follows: both refused, the payload read and dropped.
for command, length, name in [(0, (64 << 20) + 4096, "oversized read"), (1, 72 << 20, "oversized write")]:
    s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, command, 10 + command, 0, length))
    if command == 1:
        s.sendall(b"\0" * length)
    reply_magic, error, cookie = struct.unpack(">IIQ", recv_exact(16))
    if error != errno.EINVAL or cookie != 10 + command:
        failures.append(f"{name}: error {error} cookie {cookie}")
    else:
        print(f"ok: {name} -> EINVAL")
s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 0, 8, 0, 4096))  # READ 4096 at 0
reply_magic, error, cookie = struct.unpack(">IIQ", recv_exact(16))
data = recv_exact(4096)
if error != 0 or data != marker:
    failures.append(f"raw read after unknown commands: error {error}, data intact {data == marker}")
else:
    print("ok: raw connection still works after unknown commands")
s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 2, 9, 0, 0))  # DISC
s.close()

if failures:
    print("\n".join(failures), file=sys.stderr)
    sys.exit(1)
print("all bad requests answered with the right error; connections kept working")
