"""zoffload._zclient on its own: the calls torch.py does not make, and the connection lock."""
import array
import json
import threading

import pytest
import torch

import zoffload


def conn(daemon, job="zc"):
    c = zoffload.Connection(daemon.socket)
    c.job_open(job)
    return c


def test_state_io_and_job_calls(daemon):
    c = conn(daemon)
    t = c.register("w", array.array("f", range(10)))
    assert (t.name, t.numel, t.grad_dtype, t.param_dtype, t.registered) == ("w", 10, "fp32", "fp32", True)
    assert t.last_step == 0 and c.job_last_step == 0
    m = array.array("f", [0.0] * 4)
    t.read("master", m, 3)
    assert list(m) == [3.0, 4.0, 5.0, 6.0]
    t.write("exp_avg", array.array("f", [0.5] * 10))
    t.set_step(41)
    assert t.last_step == 41
    torch.frombuffer(t.grad, dtype=torch.float32).fill_(1.0)
    c.submit([t], optim="adam", step=42, lr=0.1, weight_decay=0.0)
    res = t.wait()
    assert res["status"] == "applied" and res["step"] == 42 and t.last_step == 42
    out = array.array("f", [0.0] * 10)
    t.read("exp_avg", out)
    assert out[0] == pytest.approx(0.9 * 0.5 + 0.1)
    with pytest.raises(ValueError, match="state must be"):
        t.read("sum", out)
    with pytest.raises(zoffload.ZoffloadError, match="outside the tensor"):
        t.read("master", out, 5)
    assert c.ping() > 0
    assert json.loads(c.stats())["tensors"] == 1
    (job,) = json.loads(c.jobs())["jobs"]
    assert job["name"] == "zc" and job["last_step"] == 42
    c.job_close()
    assert not t.registered
    c.close()
    assert c.closed


def test_param_offload(daemon):
    c = conn(daemon, "offload")
    t = c.register("w", array.array("f", [1.0] * 1000), param_dtype="bf16", param_offload=True)
    c.submit([t], optim="adamw", step=1, lr=0.1)
    c.wait_all()
    before = memoryview(t.param).tobytes()
    c.param_release([t])
    c.param_prefetch([t])
    t.param_wait()
    t.param_wait()
    assert memoryview(t.param).tobytes() == before
    stats = c.param_stats()
    assert stats["ready"] + stats["waited"] == 2 and stats["ready"] >= 1
    c.close()


def test_threads_share_a_connection(daemon):
    """Calls from two threads are serialised by the connection's lock (libzclient allows one
    thread at a time): replies never cross."""
    c = conn(daemon, "threads")
    ts = [c.register(f"w{i}", array.array("f", [1.0] * 4096)) for i in range(4)]
    errors = []

    def pinger():
        try:
            for _ in range(300):
                c.ping()
                json.loads(c.stats())
        except Exception as e:          # noqa: BLE001 - reported below
            errors.append(e)
    th = threading.Thread(target=pinger)
    th.start()
    for step in range(1, 301):
        c.submit(ts, optim="adamw", step=step, lr=1e-3)
        assert c.wait_all()["status"] == "applied"
    th.join()
    assert errors == []
    assert all(t.last_step == 300 for t in ts)
    c.close()


def test_package_exports_the_bindings():
    """What `import zoffload` promises (its docstring, __all__): the binding's four types."""
    from zoffload import _zclient

    assert sorted(zoffload.__all__) == ["Connection", "Slot", "Tensor", "ZoffloadError"]
    for name in zoffload.__all__:
        assert getattr(zoffload, name) is getattr(_zclient, name), name


def test_types_are_not_made_by_hand():
    with pytest.raises(TypeError, match="Connection.register"):
        zoffload.Tensor()
    assert issubclass(zoffload.ZoffloadError, OSError)


@pytest.mark.parametrize("tracking", ["userfaultfd", "pagemap"])
def test_param_view_follows_the_slot_and_finds_writes(daemon, monkeypatch, tracking):
    """The param view reads the daemon's values where this process has not written, and
    tells the pages it wrote (its own copies, which no step updates) from the rest, both
    ways of finding them: a write from the kernel (read() into the view) counts too."""
    import mmap
    import os
    page = mmap.PAGESIZE // 4          # fp32 elements in a page
    n = 3 * page
    if tracking == "pagemap":
        monkeypatch.setenv("ZOFFLOAD_PARAM_VIEW_TRACKING", "pagemap")
    c = conn(daemon)
    t = c.register("w", array.array("f", [1.0] * n), param_view=True)
    if t.view_tracking != tracking:
        pytest.skip(f"this kernel tracks views by {t.view_tracking} (userfaultfd's "
                    "asynchronous write protection needs Linux 6.7 and no seccomp filter)")
    plain = c.register("u", array.array("f", [1.0] * 4))
    assert plain.param_view is None
    with pytest.raises(zoffload.ZoffloadError, match="no param view"):
        plain.view_written()
    view = torch.frombuffer(t.param_view, dtype=torch.float32)
    slot = torch.frombuffer(t.param, dtype=torch.float32)
    assert view.data_ptr() != slot.data_ptr() and torch.equal(view, slot)
    assert t.view_written() == 0
    torch.frombuffer(t.grad, dtype=torch.float32).fill_(1.0)
    c.submit([t], optim="adamw", step=1, lr=0.25, weight_decay=0.0)
    t.wait()
    # AdamW's first step moves every element by lr (bias-corrected m/sqrt(v) = 1).
    assert torch.equal(view, slot) and view[0].item() == pytest.approx(0.75)
    view[page + 1] = 42.0                           # the second page becomes the process's
    assert t.view_written() == 1
    c.submit([t], optim="adamw", step=2, lr=0.25, weight_decay=0.0)
    t.wait()
    assert view[page + 1].item() == 42.0
    assert view[page].item() != slot[page].item()   # the written page no longer follows
    assert torch.equal(view[:page], slot[:page]) and torch.equal(view[2 * page:], slot[2 * page:])
    t.view_reset()
    assert t.view_written() == 0 and torch.equal(view, slot)
    r, w = os.pipe()
    os.write(w, b"\0\0\0\0")
    into = memoryview(t.param_view).cast("B")[2 * mmap.PAGESIZE:][:4]
    assert os.readv(r, [into]) == 4
    assert t.view_written() == 1 and view[2 * page].item() == 0.0
    os.close(r)
    os.close(w)
    t.view_reset()
    view[0] = 7.0
    held = slot.clone()
    # Views that outlive the tensor keep its memory, as it was, and the view stays writable.
    t.unregister()
    assert torch.equal(slot, held) and view[0].item() == 7.0
    view[1] = 8.0
    assert view[1].item() == 8.0
    with pytest.raises(zoffload.ZoffloadError, match="no longer registered"):
        t.param_view


def test_submit_keywords_each_reach_the_step(daemon):
    """Every keyword of submit() lands in its own field: no_bias_correction was parsed as a
    double into an int (its value lost, bias correction applied anyway), and a keyword after
    it failed with SystemError.  Adam's first step from zero moments, gradient g: with bias
    correction the update is lr * sign(g) (m_hat = g, v_hat = g^2); without, it is
    lr * 0.1 g / (sqrt(0.001) g) = lr * 3.162..., so the two are told apart at once."""
    c = conn(daemon, "kw")
    t = c.register("w", array.array("f", [0.0] * 4))
    torch.frombuffer(t.grad, dtype=torch.float32).fill_(2.0)
    c.submit([t], optim="adam", step=1, lr=0.01, eps=0.0, no_bias_correction=True,
             check_finite=True, clip_coef=0.5)
    assert t.wait()["status"] == "applied"
    out = array.array("f", [0.0] * 4)
    t.read("master", out)
    # Clipped to g = 1: m = 0.1, v = 0.001, no correction: -lr * 0.1 / sqrt(0.001).
    assert out[0] == pytest.approx(-0.01 * 0.1 / 0.001 ** 0.5, rel=1e-6)
    # The gradient pass: the squared norm of what the slot holds, in double, and inf/NaNs.
    g = torch.frombuffer(t.grad, dtype=torch.float32)
    g.copy_(torch.tensor([3.0, 4.0, 0.0, 0.0]))
    assert c.grad_pass([t]) == {"sumsq": 25.0, "nonfinite": 0, "elements": 4}
    g[2] = float("inf")
    assert c.grad_pass([t])["nonfinite"] == 1
    del g           # the slots go with the job
    # torch.nn.utils.clip_grad_norm_'s coefficient, capped at 1.
    assert c.clip_coef(1.0, 25.0) == pytest.approx(1.0 / (5.0 + 1e-6), rel=1e-15)
    assert c.clip_coef(10.0, 25.0) == 1.0
    c.job_close()
    c.close()


def test_graft_grad_slots_writes_reach_the_daemon(daemon):
    """A gradient written through a graft is in the tensor's grad slot: the daemon steps it.
    The parts are checked first: a bad offset, overlap, size, dtype or type is refused by
    name and maps nothing."""
    c = conn(daemon, "graft")
    a = c.register("a", array.array("f", [1.0] * 1500))      # 6000 B: 2 pages
    b = c.register("b", array.array("f", [1.0] * 100))
    h = c.register("h", array.array("f", [1.0] * 8), grad_dtype="bf16")
    nbytes = 3 * 4096 + 400 + 64                            # b's page, then scratch
    g = c.graft_grad_slots(nbytes, [(a, 0), (b, 3 * 4096)])
    assert g.nbytes == nbytes
    buf = torch.frombuffer(g, dtype=torch.float32)
    assert buf.numel() == nbytes // 4
    buf[:1500] = 2.0
    buf[1500:3 * 1024] = 7.0                                # between the parts: scratch
    buf[3 * 1024:3 * 1024 + 100] = -3.0
    buf[3 * 1024 + 100:] = 5.0                              # past b: scratch
    assert torch.equal(torch.frombuffer(a.grad, dtype=torch.float32), torch.full((1500,), 2.0))
    assert torch.equal(torch.frombuffer(b.grad, dtype=torch.float32), torch.full((100,), -3.0))
    # And the other way: the slot's pages are the graft's.
    torch.frombuffer(b.grad, dtype=torch.float32)[7] = 11.0
    assert buf[3 * 1024 + 7] == 11.0
    c.submit([a, b], optim="adam", step=1, lr=0.5, weight_decay=0.0)
    c.wait_all()
    for t, sign in ((a, -1), (b, 1)):
        out = array.array("f", [0.0] * t.numel)
        t.read("master", out)
        assert out[0] == pytest.approx(1.0 + sign * 0.5, rel=1e-5), t.name   # Adam's first step: lr
    with pytest.raises(ValueError, match=r"parts\[1\].*page boundary"):
        c.graft_grad_slots(nbytes, [(a, 0), (b, 100)])
    with pytest.raises(ValueError, match=r"parts\[1\].*overlapping"):
        c.graft_grad_slots(nbytes, [(a, 0), (b, 4096)])
    with pytest.raises(ValueError, match=r"parts\[0\].*past the 4096 bytes"):
        c.graft_grad_slots(4096, [(a, 0)])
    with pytest.raises(ValueError, match=r"parts\[0\].*'h' has bf16 gradients"):
        c.graft_grad_slots(nbytes, [(h, 0)])
    with pytest.raises(TypeError, match=r"parts\[0\]: expected a \(Tensor, offset\)"):
        c.graft_grad_slots(nbytes, [a])
    with pytest.raises(ValueError, match="not a positive multiple of 4"):
        c.graft_grad_slots(6, [])
    other = conn(daemon, "graft2")
    o = other.register("o", array.array("f", [1.0] * 10))
    with pytest.raises(ValueError, match="another connection's"):
        c.graft_grad_slots(nbytes, [(o, 0)])
    # The graft outlives the tensor's unregister: its mapping keeps the old slot's pages.
    a.unregister()
    buf[0] = 9.0
    assert buf[0] == 9.0
    del buf, g
    other.close()
    c.close()
