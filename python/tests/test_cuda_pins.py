"""The Python CUDA path's pinned slots through a reconnect that maps other slot files over
them.  zoffload.torch registers each slot with cudaHostRegister (torch.cuda.cudart()) so that
its copies are asynchronous; pages still registered when a reconnect maps other files over
them (MAP_FIXED) would have the GPU read and write the old, stale pages.  The slots hook
(Tensor.set_slots_hook) lets go of them first.

No GPU here: torch's cudart is replaced by a stand-in that records the registrations and
checks, from /proc/self/maps, that no registered range changed its backing file while
registered (what a real GPU would silently get wrong).  The params stay CPU tensors, so the
copies themselves are not CUDA's; what is tested is when the pages are registered and let go
of.  A relay between the client and the daemon hands the slots back in other files after a
cut, as a daemon that could not keep them would."""
import array
import os
import socket
import sys

import pytest
import torch

import zoffload
import zoffload.torch as zt
import zhelpers
from test_reconnect import Relay

ZP_TENSOR_OK = 69            # proto.h; the type is the u16 after the magic and the version


def backing(addr):
    """(device, inode) of the mapping that holds addr."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return parts[3], parts[4]
    return None


class CudartStandIn:
    """cudaHostRegister / cudaHostUnregister as a GPU driver sees them."""

    def __init__(self):
        self.registered = {}        # addr -> (nbytes, backing at the first and last byte)
        self.violations = []
        self.registers = self.unregisters = 0

    def _backings(self, addr, nbytes):
        return backing(addr), backing(addr + nbytes - 1)

    def cudaHostRegister(self, addr, nbytes, flags):
        if addr in self.registered:
            self.violations.append(f"{addr:#x} registered twice")
        self.registered[addr] = (nbytes, self._backings(addr, nbytes))
        self.registers += 1
        return 0

    def cudaHostUnregister(self, addr):
        if addr not in self.registered:
            self.violations.append(f"{addr:#x} unregistered but not registered")
            return 1
        self.unregisters += 1
        nbytes, was = self.registered.pop(addr)
        if self._backings(addr, nbytes) != was:
            self.violations.append(f"{addr:#x} was mapped over while registered")
        return 0

    def check(self):
        for addr, (nbytes, was) in self.registered.items():
            if self._backings(addr, nbytes) != was:
                self.violations.append(f"{addr:#x} was mapped over while registered")
        assert not self.violations, self.violations


class SlotSwappingRelay(Relay):
    """After swap is set, every TENSOR_OK reaching the client carries copies of its slot
    files instead of the daemon's: the client sees other files and remaps."""
    swap = False

    def _forward(self, src, dst):
        msg, fds, _, _ = socket.recv_fds(src, 1 << 20, 16)
        if not msg:
            return False
        sent = fds
        if self.swap and len(fds) == 2 and int.from_bytes(msg[6:8], "little") == ZP_TENSOR_OK:
            sent = [copy_of(fd) for fd in fds]
        socket.send_fds(dst, [msg], sent)
        for fd in set(fds) | set(sent):
            os.close(fd)
        return True


def copy_of(fd):
    size = os.fstat(fd).st_size
    new = os.memfd_create("slot-copy")
    os.ftruncate(new, size)
    off = 0
    while off < size:
        chunk = os.pread(fd, min(1 << 20, size - off), off)
        os.pwrite(new, chunk, off)
        off += len(chunk)
    return new


@pytest.fixture
def relay(daemon):
    r = SlotSwappingRelay(daemon.socket, os.path.join(daemon.dir, "relay.sock"))
    yield r
    r.stop()


@pytest.fixture
def cudart(monkeypatch):
    standin = CudartStandIn()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: standin)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kw: None)
    return standin


def test_pins_let_go_of_before_a_remap(daemon, relay, cudart):
    m = zhelpers.model(seed=7)
    opt = zt.AdamW(m.parameters(), job="pins", socket=relay.path)
    entries = list(opt._entries.values())
    for e in entries:
        opt._cuda_register(e)       # as _attach does for a CUDA parameter
    assert len(cudart.registered) == 2 * len(entries)
    zhelpers.train(m, opt, 2)
    cudart.check()

    relay.swap = True
    relay.cut()
    zhelpers.train(m, opt, 1, first=3)      # reconnects: the slots come back in other files
    assert opt.conn_stats()["slots_remapped"] == 2 * len(entries)
    cudart.check()
    assert all(not e.pins.pinned for e in entries)      # let go of, not yet needed again
    zhelpers.train(m, opt, 1, first=4)      # registered again over the new files
    assert len(cudart.registered) == 2 * len(entries)
    cudart.check()
    opt.close()
    assert not cudart.registered
    assert cudart.registers == cudart.unregisters == 4 * len(entries)
    cudart.check()


def test_slots_hook_events(daemon, relay, monkeypatch):
    c = zoffload.Connection(relay.path)
    c.job_open("hook")
    seen = []
    t = c.register("w", array.array("f", [1.0] * 1000))
    with pytest.raises(TypeError, match="callable or None"):
        t.set_slots_hook(3)
    t.set_slots_hook(lambda why: seen.append(("first", why)))
    t.set_slots_hook(lambda why: seen.append(("second", why)))     # replaces the first
    c.submit([t], optim="adamw", step=1, lr=0.1)
    c.wait_all()
    relay.swap = True
    relay.cut()
    c.submit([t], optim="adamw", step=2, lr=0.1)
    c.wait_all()
    assert seen == [("second", "remap")]
    t.unregister()
    assert seen == [("second", "remap"), ("second", "unmap")]

    # A hook that raises cannot stop libzclient: reported, and the unmap goes on.
    u = c.register("u", array.array("f", [1.0] * 1000))
    u.set_slots_hook(lambda why: 1 / 0)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    u.unregister()
    assert not u.registered
    assert len(unraisable) == 1 and unraisable[0].exc_type is ZeroDivisionError
    # A hook left on a tensor whose Python object is gone runs at the connection's close.
    v = c.register("v", array.array("f", [1.0] * 1000))
    v.set_slots_hook(lambda why: seen.append(("v", why)))
    del v
    c.close()
    assert seen[-1] == ("v", "unmap")
