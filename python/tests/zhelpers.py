"""Shared by the tests and their worker processes: a real zoffloadd on a temp socket, a small
transformer, and deterministic data."""
import json
import os
import signal
import socket
import subprocess
import tempfile
import time

import torch

ZOFFLOADD = os.environ.get("ZOFFLOADD", "")
# How long a child process may take before it is taken for hung.  A guard against a hang, not
# a limit on speed: a child that takes 30 s alone took over 120 s on two cores shared with a
# build and the other meson test, so this is far past anything a loaded machine makes of it.
HANG_S = 600


class Daemon:
    """zoffloadd on a socket in a fresh temp dir (as tests/integration/itd.c does in C)."""

    def __init__(self, config=None, swap=False):
        self.dir = tempfile.mkdtemp(prefix="zoff-py-")
        self.socket = os.path.join(self.dir, "sock")
        self.log = os.path.join(self.dir, "daemon.log")
        cfg = {"compute": {"worker_threads": 2}, "limits": {"detach_grace_s": 60}}
        if swap:
            os.mkdir(os.path.join(self.dir, "swap"))
            cfg["swap"] = {"paths": [{"path": os.path.join(self.dir, "swap"),
                                      "capacity": "256M"}], "chunk_elements": 65536}
        for key, value in (config or {}).items():
            cfg.setdefault(key, {}).update(value)
        with open(os.path.join(self.dir, "zoffload.conf"), "w") as f:
            json.dump(cfg, f)
        if not ZOFFLOADD:
            raise RuntimeError("$ZOFFLOADD (the built daemon) is not set; meson test sets it")
        with open(self.log, "w") as logf:
            self.proc = subprocess.Popen([ZOFFLOADD, "--config", os.path.join(self.dir, "zoffload.conf"),
                                          "--socket", self.socket], stdout=logf, stderr=logf)
        # The socket exists from bind(); the daemon may still be preparing its swap files
        # before it listens, so wait until a connection is accepted (as itd.c does).
        deadline = time.monotonic() + 10
        while not self._accepts():
            if self.proc.poll() is not None:
                raise RuntimeError("zoffloadd exited at start: " + self.log_text())
            if time.monotonic() > deadline:
                raise RuntimeError("zoffloadd did not listen within 10 s: " + self.log_text())
            time.sleep(0.005)

    def _accepts(self):
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            try:
                s.connect(self.socket)
            except OSError:
                return False
        return True

    def log_text(self):
        with open(self.log) as f:
            return f.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for root, dirs, files in os.walk(self.dir, topdown=False):
            for name in files:
                os.unlink(os.path.join(root, name))
            for name in dirs:
                os.rmdir(os.path.join(root, name))
        os.rmdir(self.dir)


class TinyTransformer(torch.nn.Module):
    """A one-layer transformer language model: embedding, encoder layer, head."""

    def __init__(self, vocab=37, d=32, heads=4, ff=72, ctx=12):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.randn(ctx, d) * 0.02)
        self.layer = torch.nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x):
        h = self.emb(x) + self.pos[: x.shape[1]]
        return self.head(self.norm(self.layer(h)))


def model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return TinyTransformer().to(dtype)


def batch(step, vocab=37, n=8, ctx=12):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, vocab, (n, ctx + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def loss_of(m, step):
    x, y = batch(step)
    logits = m(x)
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             y.reshape(-1))


def train(m, opt, steps, first=1):
    for step in range(first, first + steps):
        opt.zero_grad()
        loss_of(m, step).backward()
        opt.step()
