#!/usr/bin/env python3
"""A second stand-in for systemd's fd store, written apart from standin.c: Python keeps what
the daemon stores (FDSTORE=1) and starts its successor through bash's redirections
("exec zoffloadd ... 3<&1003 4<&1004"), as an operator's own supervisor might.  It changes
what systemd does not promise about the descriptors it hands back (their offsets, the
O_NONBLOCK flag of their open files, their order) and checks that the state still comes
back bit for bit; then it hands back a record reopened read-only, then write-only, through
/proc (a supervisor's mistake) and checks that the daemon refuses each by name and access
mode, leaving the state as it was for a correct restart after.

usage: supervisor.py ZOFFLOADD LIBZCLIENT"""
import array
import ctypes
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

if os.environ.get("ZOFFLOAD_PY_SKIP"):
    print("skipped:", os.environ["ZOFFLOAD_PY_SKIP"])
    sys.exit(77)
daemon, libpath = sys.argv[1], sys.argv[2]
tmp = tempfile.mkdtemp(prefix="zoff-pysup-")
sock_path = os.path.join(tmp, "sock")
notify_path = os.path.join(tmp, "notify")
config = os.path.join(tmp, "zoffload.conf")
log_path = os.path.join(tmp, "daemon.log")
with open(config, "w") as f:
    f.write('{ "compute": { "worker_threads": 2 }, "log": { "level": "info" } }\n')

notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
notify.bind(notify_path)
store = {}      # name -> descriptor (ours)
readies = 0
proc = None


def fail(msg):
    print("FAIL:", msg)
    try:
        print("--- daemon log\n" + open(log_path, errors="replace").read()[-4000:])
    except OSError:
        pass
    if proc is not None and proc.poll() is None:
        proc.kill()
    sys.exit(1)


def handle(timeout):
    """One notification (False when none came within timeout)."""
    global readies
    notify.settimeout(timeout)
    try:
        data, anc, _, _ = notify.recvmsg(4096, socket.CMSG_SPACE(253 * 4))
    except socket.timeout:
        return False
    fds = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(payload[:len(payload) - len(payload) % a.itemsize])
            fds.extend(a)
    fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
    name = fields.get("FDNAME", "stored")
    if fields.get("FDSTORE") == "1":
        for fd in fds:
            if name in store:
                os.close(store[name])
            store[name] = fd
        fds = []
    if fields.get("FDSTOREREMOVE") == "1" and name in store:
        os.close(store.pop(name))
    for fd in fds:
        os.close(fd)
    if fields.get("READY") == "1":
        readies += 1
    return True


def wait_ready(want, limit=60):
    end = time.time() + limit
    while readies < want and time.time() < end:
        if proc.poll() is not None:
            return False
        handle(0.2)
    return readies >= want


def drain():
    while handle(0.2):
        pass


def start(redirect=None):
    """The daemon, through bash, with the store as LISTEN_FDS; redirect(name, fd) -> the
    redirection for that descriptor, operator and source (default "<&fd": the descriptor
    itself)."""
    global proc
    names = sorted(store, reverse=True)     # another order than the daemon stored them in
    high, redirs = [], []
    for i, name in enumerate(names):
        # Out of the way of 3 .. 3 + n, so that no redirection overwrites another's source.
        h = fcntl.fcntl(store[name], fcntl.F_DUPFD, 1000)
        high.append(h)
        src = redirect(name, h) if redirect else "<&%d" % h
        redirs.append("%d%s" % (3 + i, src))
    env = dict(os.environ, NOTIFY_SOCKET=notify_path)
    env.pop("LISTEN_FDS", None)
    cmd = 'exec "$0" --config "$1" --socket "$2"'
    if names:
        env["LISTEN_FDS"] = str(len(names))
        env["LISTEN_FDNAMES"] = ":".join(names)
        cmd = "export LISTEN_PID=$$; " + cmd + " " + " ".join(redirs)
    with open(log_path, "a") as log:
        proc = subprocess.Popen(["bash", "-c", cmd, daemon, config, sock_path], env=env,
                                pass_fds=high, stdout=log, stderr=subprocess.STDOUT)
    for h in high:
        os.close(h)


zc = ctypes.CDLL(libpath)


class Desc(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("numel", ctypes.c_uint64),
                ("grad_dtype", ctypes.c_int), ("param_dtype", ctypes.c_int),
                ("param_offload", ctypes.c_bool)]


zc.zc_connect.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
zc.zc_job_open.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32, ctypes.c_uint32]
zc.zc_tensor_register.argtypes = [ctypes.c_void_p, ctypes.POINTER(Desc),
                                  ctypes.POINTER(ctypes.c_float),
                                  ctypes.POINTER(ctypes.c_void_p)]
zc.zc_tensor_read.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64,
                              ctypes.POINTER(ctypes.c_float)]
zc.zc_errmsg.argtypes = [ctypes.c_void_p]
zc.zc_errmsg.restype = ctypes.c_char_p
zc.zc_disconnect.argtypes = [ctypes.c_void_p]
zc.zc_set_reconnect.argtypes = [ctypes.c_void_p, ctypes.c_int]
N = 4096
desc = Desc(b"w", N, 0, 0, False)
want = (ctypes.c_float * N)(*[(i % 97) * 0.125 - 3.0 for i in range(N)])


def attach(init):
    conn = ctypes.c_void_p()
    end = time.time() + 30
    while zc.zc_connect(sock_path.encode(), ctypes.byref(conn)) != 0:
        if time.time() > end:
            fail("cannot connect")
        time.sleep(0.05)
    zc.zc_set_reconnect(conn, 0)
    if zc.zc_job_open(conn, b"py", 0, 1) != 0:
        fail("job_open: %s" % zc.zc_errmsg(conn))
    t = ctypes.c_void_p()
    r = zc.zc_tensor_register(conn, ctypes.byref(desc), init, ctypes.byref(t))
    if r != 0:
        fail("register: %d %s" % (r, zc.zc_errmsg(conn)))
    return conn, t


def kill_daemon():
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    drain()


try:
    start()
    if not wait_ready(1):
        fail("the daemon did not start")
    conn, _ = attach(want)
    kill_daemon()
    zc.zc_disconnect(conn)

    # What systemd does not promise: offsets moved, O_NONBLOCK set, another order.
    for fd in store.values():
        try:
            os.lseek(fd, 12345, os.SEEK_SET)
        except OSError:
            pass
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
    records = [n for n in store if n.endswith(".rec")]
    if not records or "table" not in store:
        fail("the daemon stored %s" % sorted(store))

    # A supervisor's mistake first: the record reopened read-only through /proc.
    start(lambda name, h: "</proc/self/fd/%d" % h if name in records else "<&%d" % h)
    if proc.wait(60) == 0:
        fail("a read-only record was accepted")
    drain()
    text = open(log_path, errors="replace").read()
    if "open read-only, not read-write" not in text or records[0] not in text:
        fail("the refusal does not name the record and its access mode")
    # And write-only (">>": appending, so the reopening itself truncates nothing).
    mark = len(text)
    start(lambda name, h: ">>/proc/self/fd/%d" % h if name in records else "<&%d" % h)
    if proc.wait(60) == 0:
        fail("a write-only record was accepted")
    drain()
    text = open(log_path, errors="replace").read()[mark:]
    if "open write-only, not read-write" not in text or records[0] not in text:
        fail("the refusal of a write-only record does not name it and its access mode")

    start()
    if not wait_ready(2):
        fail("the restart through bash did not come up")
    text = open(log_path, errors="replace").read()
    if "recovered 1 job(s), 1 tensor(s)" not in text:
        fail("the state did not come back")
    conn, t = attach((ctypes.c_float * N)())
    got = (ctypes.c_float * N)()
    r = zc.zc_tensor_read(t, 0, 0, N, got)
    if r != 0:
        fail("read: %d %s" % (r, zc.zc_errmsg(conn)))
    if bytes(got) != bytes(want):
        fail("the master came back different")
    zc.zc_disconnect(conn)
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    print("ok: restarted through bash with offsets, flags and order changed; read-only and "
          "write-only reopenings refused by name")
finally:
    if proc is not None and proc.poll() is None:
        proc.kill()
    shutil.rmtree(tmp, ignore_errors=True)
