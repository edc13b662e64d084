"""What a user sees when things go wrong: clear Python exceptions, with the daemon's words."""
import array
import io
import errno
import json
import os

import pytest
import torch

import zhelpers
import zoffload
import zoffload.torch as zt


def params(n=1000):
    return [torch.nn.Parameter(torch.randn(n))]


def test_daemon_not_running(tmp_path):
    sock = str(tmp_path / "nobody.sock")
    with pytest.raises(zoffload.ZoffloadError) as info:
        zt.AdamW(params(), job="j", socket=sock)
    assert isinstance(info.value, OSError)
    assert info.value.errno == errno.ENOENT
    assert sock in str(info.value) and "is zoffloadd running" in str(info.value)


def test_refused_job(daemon):
    first = zt.AdamW(params(), job="shared", socket=daemon.socket, rank=0, world_size=2)
    with pytest.raises(zoffload.ZoffloadError, match="job 'shared' has world size 2, not 4"):
        zt.AdamW(params(), job="shared", socket=daemon.socket, rank=1, world_size=4)
    with pytest.raises(zoffload.ZoffloadError, match="rank 0 of job 'shared' is already attached"):
        zt.AdamW(params(), job="shared", socket=daemon.socket, rank=0, world_size=2)
    with pytest.raises(zoffload.ZoffloadError, match="rank 2 is not below world size 2"):
        zt.AdamW(params(), job="shared", socket=daemon.socket, rank=2, world_size=2)
    first.close()


def test_budget_exhausted(make_daemon):
    d = make_daemon(config={"memory": {"pinned_budget": "1M"}})
    with pytest.raises(zoffload.ZoffloadError) as info:
        zt.AdamW(params(200_000), job="big", socket=d.socket, policy="cpu")
    assert info.value.errno == errno.ENOSPC
    assert "needs" in str(info.value) and "pinned budget" in str(info.value)


def test_refused_constructor_leaves_nothing(make_daemon):
    """The first param fits, the second does not: the first is freed, not kept for a restart."""
    d = make_daemon(config={"memory": {"pinned_budget": "1M"}})
    with pytest.raises(zoffload.ZoffloadError, match="pinned budget"):
        zt.AdamW(params(1000) + params(200_000), job="half", socket=d.socket, policy="cpu")
    with zoffload.Connection(d.socket) as c:
        assert json.loads(c.jobs())["jobs"] == []
        assert json.loads(c.stats())["tensors"] == 0


def test_step_after_close(daemon):
    opt = zt.AdamW(params(), job="closed", socket=daemon.socket)
    opt.close()
    opt.close()                     # twice is fine
    with pytest.raises(RuntimeError, match="after close"):
        opt.step()


def test_spills_to_swap_instead(make_daemon):
    """The same state with policy 'auto' and a swap dir: it fits, partly on NVMe."""
    d = make_daemon(config={"memory": {"pinned_budget": "1M"}}, swap=True)
    ps = params(200_000)
    opt = zt.AdamW(ps, job="big", socket=d.socket, policy="auto")
    ps[0].grad = torch.ones_like(ps[0])
    opt.step()
    job = json.loads(opt.jobs())["jobs"][0]
    assert job["nvme_bytes"] > 0
    # The first moment after one step of ones, read back through the NVMe tier.
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], torch.full((200_000,), 0.1))
    opt.close()


def test_bad_arguments(daemon, monkeypatch):
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        zt.AdamW(params(), amsgrad=True, job="j", socket=daemon.socket)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        zt.Adam(params(), lr=-1, job="j", socket=daemon.socket)
    # What torch takes and the daemon cannot honour is refused by name, not ignored.
    for cls in (zt.AdamW, zt.Adam):
        with pytest.raises(ValueError, match="capturable=True is not supported: the daemon "
                                             "steps on the CPU"):
            cls(params(), capturable=True, job="j", socket=daemon.socket)
    for cls in (zt.AdamW, zt.Adam, zt.Adagrad):
        with pytest.raises(ValueError, match="differentiable=True is not supported"):
            cls(params(), differentiable=True, job="j", socket=daemon.socket)
    with pytest.raises(ValueError, match="policy must be 'cpu', 'nvme', 'auto'"):
        zt.AdamW(params(), job="j", socket=daemon.socket, policy="disk")
    with pytest.raises(TypeError, match="float32, bfloat16 or float16 only"):
        zt.AdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))], job="j2",
                 socket=daemon.socket)
    monkeypatch.delenv("ZOFFLOAD_JOB", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(ValueError, match="name the job"):
        zt.AdamW(params(), socket=daemon.socket)


def test_job_from_environment(daemon, monkeypatch):
    monkeypatch.delenv("ZOFFLOAD_JOB", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc123")
    monkeypatch.setenv("ZOFFLOAD_SOCKET", daemon.socket)
    opt = zt.AdamW(params())
    assert opt.job == "torchrun-abc123"
    opt.close()
    monkeypatch.setenv("ZOFFLOAD_JOB", "from-env")
    opt = zt.AdamW(params())
    assert opt.job == "from-env"
    assert "from-env" in opt.jobs()
    opt.close()


def test_daemon_dies_mid_training(make_daemon):
    # reconnect_ms=0: fail at once, as before reconnects.
    d = make_daemon()
    m = zhelpers.model(seed=30)
    opt = zt.AdamW(m.parameters(), job="dies", socket=d.socket, reconnect_ms=0)
    zhelpers.train(m, opt, 2)
    d.proc.kill()
    d.proc.wait()
    with pytest.raises(zoffload.ZoffloadError, match="closed the connection|Broken pipe"):
        zhelpers.train(m, opt, 1, first=3)


def test_daemon_does_not_come_back(make_daemon):
    d = make_daemon()
    m = zhelpers.model(seed=31)
    opt = zt.AdamW(m.parameters(), job="gone", socket=d.socket, reconnect_ms=300)
    zhelpers.train(m, opt, 2)
    d.proc.kill()
    d.proc.wait()
    with pytest.raises(zoffload.ZoffloadError,
                       match="did not come back within the reconnect timeout of 300 ms") as info:
        zhelpers.train(m, opt, 1, first=3)
    assert info.value.errno == errno.ECONNRESET


def test_slot_views_keep_the_memory_mapped(daemon):
    """A view of a slot outlives its tensor: unregister(), job_close() and close() leave
    the slots mapped, as they were, for the views still alive (a framework's thread may hold
    one that no one can take back), and the daemon lets go of the tensors all the same.
    Before, each refused with BufferError while any view lived."""
    c = zoffload.Connection(daemon.socket)
    c.job_open("views")
    gone = [c.register(n, array.array("f", [3.0] * 8)) for n in ("u", "jc", "cl")]
    grads = []
    for i, t in enumerate(gone):
        grads.append(torch.frombuffer(t.grad, dtype=torch.float32))
        grads[-1].fill_(float(i))
    gone[0].unregister()
    assert json.loads(c.jobs())["jobs"][0]["tensors"] == 2
    c.job_close()
    c.job_open("views")
    cl = c.register("cl", array.array("f", [3.0] * 8))
    grads.append(torch.frombuffer(cl.grad, dtype=torch.float32))
    grads[-1].fill_(5.0)
    param = torch.frombuffer(cl.param, dtype=torch.float32)
    c.close()
    for g, value in zip(grads, (0.0, 1.0, 2.0, 5.0)):
        assert g.tolist() == [value] * 8
        g.add_(1.0)
        assert g.tolist() == [value + 1.0] * 8
    assert param.tolist() == [3.0] * 8
    for t in gone + [cl]:
        with pytest.raises(zoffload.ZoffloadError, match="no longer registered|closed"):
            t.grad
    c = zoffload.Connection(daemon.socket)
    # A closed connection is a rank that died: its tensor stays for a restart, detached.
    job, = [j for j in json.loads(c.jobs())["jobs"] if j["name"] == "views"]
    assert job["ranks_attached"] == 0 and job["tensors_detached"] == 1
    c.job_drop("views")
    c.close()
    del grads, param

    c = zoffload.Connection(daemon.socket)
    c.job_open("views")
    t = c.register("w", array.array("f", [1.0] * 8), param_dtype="bf16")
    g = torch.frombuffer(t.grad, dtype=torch.float32)
    assert memoryview(t.param).readonly and not memoryview(t.grad).readonly
    with pytest.raises((BufferError, TypeError), match="read-only|read-write"):
        io.BytesIO(b"x").readinto(t.param)      # asks for a writable buffer
    with pytest.raises(ValueError, match="holds 3 bytes, its param slot 16"):
        t.param_into(bytearray(3))
    t.grad_from(array.array("f", [2.0] * 8))
    assert g.tolist() == [2.0] * 8
    out = bytearray(16)
    t.param_into(out)
    assert out == memoryview(t.param).tobytes()
    del g
    t.unregister()
    with pytest.raises(zoffload.ZoffloadError, match="no longer registered") as info:
        t.grad
    assert info.value.errno == errno.EBADF
    c.close()
    with pytest.raises(zoffload.ZoffloadError, match="closed"):
        c.stats()


def test_submit_errors_name_the_problem(daemon):
    c = zoffload.Connection(daemon.socket)
    c.job_open("submit")
    t = c.register("w", array.array("f", [1.0] * 8))
    with pytest.raises(zoffload.ZoffloadError, match="steps count from 1"):
        c.submit([t], optim="adamw", step=0, lr=1e-3)
    with pytest.raises(ValueError, match="optim must be"):
        c.submit([t], optim="sgd", step=1, lr=1e-3)
    with pytest.raises(TypeError, match="not a Tensor"):
        c.submit([t, 3], optim="adamw", step=1, lr=1e-3)
    c.submit([t], optim="adamw", step=1, lr=1e-3)
    with pytest.raises(zoffload.ZoffloadError, match="still in a step") as info:
        c.submit([t], optim="adamw", step=2, lr=1e-3)
    assert info.value.errno == errno.EBUSY
    assert c.wait_all()["status"] == "applied"
    with pytest.raises(ValueError, match="not a positive multiple of 4"):
        c.register("x", b"abc")
    c.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_permission_denied_names_group(daemon):
    """A user outside the socket's group reads which group to join, with the socket's path."""
    import grp

    os.chmod(daemon.dir, 0o711)
    group = grp.getgrgid(os.stat(daemon.socket).st_gid).gr_name
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        # Nothing but os calls and the connect: never back into pytest from the child.
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            try:
                zoffload.Connection(daemon.socket)
                os.write(w, b"connected")
            except zoffload.ZoffloadError as e:
                os.write(w, ("%d %s" % (e.errno, e.strerror)).encode())
                code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        got = f.read().decode()
    os.waitpid(pid, 0)
    assert got == "%d permission denied on %s: add your user to group %s (sudo usermod -aG %s " \
        "$USER, then log in again)" % (errno.EACCES, daemon.socket, group, group), got
