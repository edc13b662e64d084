"""Reconnects from Python: a cut connection is a pause for zoffload.torch, the option to fail
instead, and the counter."""
import array
import errno
import os
import select
import socket
import threading
import time

import pytest

import zoffload
import zoffload.torch as zt
import zhelpers


class Relay:
    """Passes SEQPACKET datagrams and their descriptors between a client and the daemon;
    cut() closes the connection, after which the next client is taken."""

    def __init__(self, upstream, path):
        self.upstream = upstream
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen(4)
        self.wake_r, self.wake_w = os.pipe()
        self.clients = 0
        self.cuts = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _forward(self, src, dst):
        msg, fds, _, _ = socket.recv_fds(src, 1 << 20, 16)
        if not msg:
            return False
        socket.send_fds(dst, [msg], fds)
        for fd in fds:
            os.close(fd)
        return True

    def _run(self):
        while True:
            r, _, _ = select.select([self.listener, self.wake_r], [], [])
            if self.wake_r in r and os.read(self.wake_r, 1) == b"x":
                return
            if self.listener not in r:
                continue
            client, _ = self.listener.accept()
            daemon = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            daemon.connect(self.upstream)
            self.clients += 1
            while True:
                r, _, _ = select.select([client, daemon, self.wake_r], [], [])
                if self.wake_r in r:
                    cmd = os.read(self.wake_r, 1)
                    if cmd == b"c":
                        self.cuts += 1
                    client.close()
                    daemon.close()
                    if cmd == b"x":
                        return
                    break
                if (daemon in r and not self._forward(daemon, client)) or \
                        (client in r and not self._forward(client, daemon)):
                    client.close()
                    daemon.close()
                    break

    def cut(self):
        """Cuts the connection now (the relay must have a client) and waits until it is cut."""
        before = self.cuts
        os.write(self.wake_w, b"c")
        deadline = time.monotonic() + 10
        while self.cuts == before:
            assert time.monotonic() < deadline, "the relay did not cut within 10 s"
            time.sleep(0.001)

    def stop(self):
        os.write(self.wake_w, b"x")
        self.thread.join(10)
        self.listener.close()
        os.close(self.wake_r)
        os.close(self.wake_w)


@pytest.fixture
def relay(daemon):
    r = Relay(daemon.socket, os.path.join(daemon.dir, "relay.sock"))
    yield r
    r.stop()


@pytest.mark.parametrize("state_format", ["fp32", "q8-moments"])
def test_cut_connections_are_a_pause(daemon, relay, state_format):
    ref = zhelpers.model(seed=40)
    ref_opt = zt.AdamW(ref.parameters(), job="uncut-" + state_format, socket=daemon.socket,
                       state_format=state_format)
    zhelpers.train(ref, ref_opt, 6)

    m = zhelpers.model(seed=40)
    opt = zt.AdamW(m.parameters(), job="cut-" + state_format, socket=relay.path,
                   state_format=state_format)
    zhelpers.train(m, opt, 2)
    for first in (3, 5):
        relay.cut()
        zhelpers.train(m, opt, 2, first=first)
    assert relay.cuts == 2 and relay.clients == 3
    stats = opt.conn_stats()
    assert stats["reconnects"] == 2 and stats["reconnect_ns"] > 0
    assert stats["slots_remapped"] == 0
    for a, b in zip(m.parameters(), ref.parameters()):
        assert a.detach().equal(b.detach())
    assert ref_opt.conn_stats()["reconnects"] == 0
    assert opt.state_format == state_format
    opt.close()
    ref_opt.close()


def test_fail_fast_option(daemon, relay):
    c = zoffload.Connection(relay.path, reconnect_ms=0)
    c.job_open("failfast")
    t = c.register("w", array.array("f", [1.0] * 100))
    relay.cut()
    with pytest.raises(zoffload.ZoffloadError, match="closed the connection") as info:
        c.submit([t], optim="adamw", step=1, lr=0.1)
        c.wait_all()
    assert info.value.errno == errno.ECONNRESET
    assert c.conn_stats()["reconnects"] == 0
    c.close()


def test_set_reconnect_and_bad_values(daemon, relay):
    c = zoffload.Connection(relay.path)
    c.job_open("setter")
    t = c.register("w", array.array("f", [1.0] * 100))
    c.set_reconnect(-1)
    relay.cut()
    c.submit([t], optim="adamw", step=1, lr=0.1)
    assert c.wait_all()["status"] == "applied"
    assert c.conn_stats()["reconnects"] == 1
    with pytest.raises(TypeError, match="reconnect_ms must be an int"):
        c.set_reconnect("soon")
    with pytest.raises(ValueError, match="not -2"):
        c.set_reconnect(-2)
    with pytest.raises(TypeError, match="reconnect_ms must be an int"):
        zoffload.Connection(daemon.socket, reconnect_ms=1.5)
    c.close()
