"""save_checkpoint / load_checkpoint: the daemon's streaming checkpoint from zoffload.torch.

A run interrupted by a checkpoint and resumed in a new process on another daemon must be
bit-identical to the run that went on: the state file holds the fp32 master and moments
exactly, and the step is the same elementwise update on the same bits.
"""
import errno
import os
import struct
import subprocess
import sys

import pytest
import torch

import zhelpers
import zoffload.torch as zt
from zoffload.torch import ZoffloadError

KW = {"AdamW": dict(lr=1e-3, betas=(0.8, 0.95), weight_decay=0.05),
      "Lion": dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1)}


def groups(m, lr):
    # Two groups with their own lr: the loader is built with other values and must get these.
    params = list(m.parameters())
    return [{"params": params[:2], "lr": lr * 3}, {"params": params[2:]}]


def make_opt(cls_name, m, daemon, job, policy, **over):
    kw = dict(KW[cls_name], **over)
    return getattr(zt, cls_name)(groups(m, kw["lr"]), job=job, socket=daemon.socket,
                                 policy=policy, **kw)


def resume(cls_name, socket, policy, ckpt, first, last, out):
    """The second half, in a process of its own: another model, another lr, then the load."""
    m = zhelpers.model(seed=99)
    d = type("D", (), {"socket": socket})
    opt = make_opt(cls_name, m, d, "ckpt-resume", policy, lr=0.5)
    step = opt.load_checkpoint(ckpt)
    assert step == first - 1, step
    zhelpers.train(m, opt, last - first + 1, first=first)
    torch.save({"params": [p.detach().clone() for p in m.parameters()],
                "state_dict": opt.state_dict()}, out)
    opt.close()


def assert_same_sd(got, want):
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"])
    for i, st in want["state"].items():
        assert set(got["state"][i]) == set(st)
        for key, value in st.items():
            assert torch.equal(got["state"][i][key], value), (i, key)


@pytest.mark.parametrize("policy", ["cpu", "nvme"])
@pytest.mark.parametrize("cls_name", ["AdamW", "Lion"])
def test_resume_bit_identical(make_daemon, tmp_path, cls_name, policy):
    swap = policy == "nvme"
    first_daemon, second_daemon = make_daemon(swap=swap), make_daemon(swap=swap)
    k, n = 7, 15
    m = zhelpers.model(seed=1)
    opt = make_opt(cls_name, m, first_daemon, "ckpt-run", policy)
    zhelpers.train(m, opt, k)
    ckpt = tmp_path / "step-7"
    opt.save_checkpoint(ckpt)
    assert sorted(os.listdir(ckpt)) == ["rank-00000-of-00001.safetensors",
                                        "zoffload-torch-rank-00000-of-00001.json"]
    zhelpers.train(m, opt, n - k, first=k + 1)     # the uninterrupted run goes on
    want = {"params": [p.detach().clone() for p in m.parameters()],
            "state_dict": opt.state_dict()}
    opt.close()

    out = tmp_path / "resumed.pt"
    code = ("import sys, test_checkpoint as t; "
            f"t.resume({cls_name!r}, {second_daemon.socket!r}, {policy!r}, {str(ckpt)!r}, "
            f"{k + 1}, {n}, {str(out)!r})")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=zhelpers.HANG_S,
                   cwd=os.path.dirname(__file__))
    got = torch.load(out)
    for a, b in zip(got["params"], want["params"]):
        assert torch.equal(a, b)
    assert_same_sd(got["state_dict"], want["state_dict"])
    assert got["state_dict"]["param_groups"][0]["lr"] == KW[cls_name]["lr"] * 3


def corrupt_data_byte(path):
    with open(path, "r+b") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + hlen + 100)
        b = f.read(1)
        f.seek(8 + hlen + 100)
        f.write(bytes([b[0] ^ 0x40]))


def test_corrupted_file_names_it(daemon, tmp_path):
    m = zhelpers.model(seed=2)
    opt = make_opt("AdamW", m, daemon, "ckpt-corrupt", "cpu")
    zhelpers.train(m, opt, 3)
    opt.save_checkpoint(tmp_path)
    opt.close()
    path = str(tmp_path / "rank-00000-of-00001.safetensors")
    corrupt_data_byte(path)

    m2 = zhelpers.model(seed=3)
    before = [p.detach().clone() for p in m2.parameters()]
    opt2 = make_opt("AdamW", m2, daemon, "ckpt-corrupt-load", "cpu")
    with pytest.raises(ZoffloadError) as ex:
        opt2.load_checkpoint(tmp_path)
    assert ex.value.errno == errno.EBADMSG
    assert path in str(ex.value)
    assert "CRC" in str(ex.value)
    # Nothing half-loaded: the optimizer is as built, and trains.
    for a, b in zip(m2.parameters(), before):
        assert torch.equal(a, b)
    assert all(not st for st in opt2.state.values())
    zhelpers.train(m2, opt2, 2)
    assert float(opt2.state_dict()["state"][0]["step"]) == 2
    opt2.close()


def test_missing_or_empty_dir(daemon, tmp_path):
    opt = zt.AdamW([torch.nn.Parameter(torch.ones(5))], job="ckpt-none", socket=daemon.socket)
    with pytest.raises(FileNotFoundError, match="no zoffload.torch checkpoint in"):
        opt.load_checkpoint(tmp_path)
    opt.close()


def save_linear(daemon, tmp_path, shape, cls=zt.AdamW):
    torch.manual_seed(4)
    p = torch.nn.Parameter(torch.randn(shape))
    opt = cls([p], job="ckpt-shape-save", socket=daemon.socket)
    p.grad = torch.ones_like(p)
    opt.step()
    opt.save_checkpoint(tmp_path)
    opt.close()


@pytest.mark.parametrize("shape", [(6, 4), (5, 5)])
def test_other_shape_refused(daemon, tmp_path, shape):
    save_linear(daemon, tmp_path, (4, 6))
    p = torch.nn.Parameter(torch.zeros(shape))
    opt = zt.AdamW([p], job="ckpt-shape-load", socket=daemon.socket)
    with pytest.raises(ValueError, match=r"parameter group0\.param0 .*(shape \[6, 4\] here, "
                       r"\[4, 6\]|25 elements here, 24)"):
        opt.load_checkpoint(tmp_path)
    opt.close()


def test_other_optimizer_refused(daemon, tmp_path):
    save_linear(daemon, tmp_path, (4, 6))
    p = torch.nn.Parameter(torch.zeros(4, 6))
    opt = zt.Lion([p], job="ckpt-optim-load", socket=daemon.socket)
    with pytest.raises(ValueError, match="saved by AdamW, not Lion"):
        opt.load_checkpoint(tmp_path)
    opt.close()


def test_only_into_fresh_optimizer(daemon, tmp_path):
    save_linear(daemon, tmp_path, (4, 6))
    p = torch.nn.Parameter(torch.zeros(4, 6))
    opt = zt.AdamW([p], job="ckpt-used", socket=daemon.socket)
    p.grad = torch.ones_like(p)
    opt.step()
    with pytest.raises(RuntimeError, match=r"fresh optimizer; parameter group0\.param0 "
                       r"already has state \(step 1\)"):
        opt.load_checkpoint(tmp_path)
    opt.close()


def grad_of(step, numel):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(numel, generator=g)


def test_two_ranks_into_one(daemon, tmp_path):
    """World size 2 (each rank a shard of W, its place given) restored into world size 1."""
    torch.manual_seed(5)
    w0 = torch.randn(70)
    whole = torch.nn.Parameter(w0.clone())
    ref = zt.AdamW([whole], lr=1e-2, job="ckpt-ref", socket=daemon.socket)
    shards = [torch.nn.Parameter(w0[:40].clone()), torch.nn.Parameter(w0[40:].clone())]
    ranks = [zt.AdamW([s], lr=1e-2, job="ckpt-ranks", socket=daemon.socket, rank=r,
                      world_size=2) for r, s in enumerate(shards)]
    for step in range(1, 6):
        g = grad_of(step, 70)
        whole.grad = g.clone()
        ref.step()
        for s, opt, lo in zip(shards, ranks, (0, 40)):
            s.grad = g[lo:lo + s.numel()].clone()
            opt.step()
    for s, opt, lo in zip(shards, ranks, (0, 40)):
        opt.save_checkpoint(tmp_path, places={s: ("W", lo, 70)})
        opt.close()
    assert torch.equal(torch.cat([s.detach() for s in shards]), whole.detach())

    fresh = torch.nn.Parameter(torch.zeros(70))
    opt = zt.AdamW([fresh], lr=1.0, job="ckpt-one", socket=daemon.socket)
    assert opt.load_checkpoint(tmp_path, names={fresh: "W"}) == 5
    assert opt.param_groups[0]["lr"] == 1e-2
    assert torch.equal(fresh.detach(), whole.detach())
    for step in range(6, 9):
        g = grad_of(step, 70)
        whole.grad, fresh.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
    assert torch.equal(fresh.detach(), whole.detach())
    assert_same_sd(opt.state_dict(), ref.state_dict())
    opt.close()
    ref.close()


def test_flat_buffers_saved_by_pieces(daemon, tmp_path):
    """Flat buffers that hold parts of two params and padding (as DeepSpeed's ZeRO
    partitions), world size 2, saved piece by piece under the params' names: restored into
    the two params themselves and into one flat buffer of another layout, bit for bit the
    run of the two params, the padding zero."""
    torch.manual_seed(6)
    a0, b0 = torch.randn(30), torch.randn(25)
    ref_a, ref_b = torch.nn.Parameter(a0.clone()), torch.nn.Parameter(b0.clone())
    ref = zt.AdamW([ref_a, ref_b], lr=1e-2, job="pieces-ref", socket=daemon.socket)
    # A and B end to end, padded to 60: rank 0 holds A[0:30], rank 1 B[0:25] and 5 of padding.
    flats = [torch.nn.Parameter(a0.clone()),
             torch.nn.Parameter(torch.cat([b0, torch.zeros(5)]))]
    pieces = [[(0, 30, "A", 0, 30)], [(0, 25, "B", 0, 25)]]
    ranks = [zt.AdamW([f], lr=1e-2, job="pieces-ranks", socket=daemon.socket, rank=r,
                      world_size=2) for r, f in enumerate(flats)]

    def grads(step):
        g = grad_of(step, 55)
        return g[:30], g[30:]

    for step in range(1, 6):
        ga, gb = grads(step)
        ref_a.grad, ref_b.grad = ga.clone(), gb.clone()
        ref.step()
        flats[0].grad = ga.clone()
        flats[1].grad = torch.cat([gb, torch.zeros(5)])
        for opt in ranks:
            opt.step()
    for f, opt, pcs in zip(flats, ranks, pieces):
        opt.save_checkpoint(tmp_path, places={f: pcs})
        opt.close()

    a, b = torch.nn.Parameter(torch.zeros(30)), torch.nn.Parameter(torch.zeros(25))
    apart = zt.AdamW([a, b], lr=1.0, job="pieces-apart", socket=daemon.socket)
    assert apart.load_checkpoint(tmp_path, names={a: "A", b: "B"}) == 5
    # One flat buffer: B first, then 3 of padding, then A, then 6 more.
    flat = torch.nn.Parameter(torch.full((64,), 7.0))
    one = zt.AdamW([flat], lr=1.0, job="pieces-one", socket=daemon.socket)
    assert one.load_checkpoint(tmp_path, places={
        flat: [(0, 25, "B", 0, 25), (28, 30, "A", 0, 30)]}) == 5
    assert torch.equal(a.detach(), ref_a.detach()) and torch.equal(b.detach(), ref_b.detach())
    for step in range(6, 9):
        ga, gb = grads(step)
        ref_a.grad, ref_b.grad = ga.clone(), gb.clone()
        a.grad, b.grad = ga.clone(), gb.clone()
        flat.grad = torch.cat([gb, torch.zeros(3), ga, torch.zeros(6)])
        for opt in (ref, apart, one):
            opt.step()
    assert torch.equal(a.detach(), ref_a.detach()) and torch.equal(b.detach(), ref_b.detach())
    assert torch.equal(flat.detach()[:25], ref_b.detach())
    assert torch.equal(flat.detach()[28:58], ref_a.detach())
    pad = torch.cat([flat.detach()[25:28], flat.detach()[58:]])
    assert torch.equal(pad, torch.zeros(9)), pad
    sd, want = one.state_dict()["state"][0], ref.state_dict()["state"]
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(sd[key][:25], want[1][key]) and torch.equal(sd[key][28:58],
                                                                        want[0][key])
        assert not sd[key][25:28].any() and not sd[key][58:].any()
    # A piece outside its buffer, or over another, is refused by name before anything.
    with pytest.raises(ValueError, match="does not fit"):
        one.save_checkpoint(tmp_path / "bad", places={flat: [(60, 10, "A", 0, 30)]})
    with pytest.raises(ZoffloadError, match="are in two pieces"):
        one.save_checkpoint(tmp_path / "bad", places={
            flat: [(0, 25, "B", 0, 25), (20, 30, "A", 0, 30)]})
    for opt in (ref, apart, one):
        opt.close()


def test_binding_errors(daemon, tmp_path):
    """The extension's calls raise ZoffloadError with libzclient's message."""
    from zoffload import _zclient
    with _zclient.Connection(daemon.socket) as conn:
        conn.job_open("ckpt-binding")
        t = conn.register("t", torch.ones(8).numpy())
        missing = str(tmp_path / "absent")
        with pytest.raises(ZoffloadError) as ex:
            conn.checkpoint_save(missing, [(t, None, 0, 0)], optim="adamw", step=0, lr=1e-3)
        assert ex.value.errno == errno.ENOENT and missing in str(ex.value)
        with pytest.raises(ZoffloadError) as ex:
            conn.register_checkpoint(str(tmp_path), [("u", 8, "fp32", "fp32", None, 0, 0)],
                                     optim="adamw")
        assert str(tmp_path) in str(ex.value)
        with pytest.raises(TypeError, match="entry 0: expected"):
            conn.checkpoint_save(str(tmp_path), [t], optim="adamw", step=0, lr=1e-3)
        conn.checkpoint_save(str(tmp_path), [(t, "g", 0, 0)], optim="adamw", step=0, lr=1e-3)
        ts, hyper = conn.register_checkpoint(
            str(tmp_path), [("u", 8, "fp32", "fp32", "g", 0, 0)], optim="adamw")
        assert ts[0].name == "u" and hyper["optim"] == "adamw" and hyper["lr"] == 1e-3
        with pytest.raises(ZoffloadError, match="saved by adamw, not lion"):
            conn.register_checkpoint(str(tmp_path), [("v", 8, "fp32", "fp32", "g", 0, 0)],
                                     optim="lion")
        conn.job_close()


def test_group_value_json_cannot_store(daemon, tmp_path):
    p = torch.nn.Parameter(torch.ones(4))
    opt = zt.AdamW([p], job="ckpt-json", socket=daemon.socket)
    opt.param_groups[0]["note"] = object()
    with pytest.raises(TypeError, match="a param group holds a value JSON cannot store"):
        opt.save_checkpoint(tmp_path / "c")
    assert not os.path.exists(tmp_path / "c" / "rank-00000-of-00001.safetensors")
    opt.close()


def half_params(seed, dtype):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape).to(dtype)) for shape in ((37, 5), (11,))]


def half_train(params, opt, first, last):
    for step in range(first, last + 1):
        for p in params:
            p.grad = grad_of(step, p.numel()).view(p.shape).to(p.dtype)
        opt.step()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_params_resume(make_daemon, tmp_path, dtype):
    """bf16/fp16 params: the restored params are the master's rounding, as the daemon's."""
    a, b = make_daemon(), make_daemon()
    ps = half_params(6, dtype)
    opt = zt.AdamW(ps, lr=1e-3, job="ckpt-half", socket=a.socket)
    half_train(ps, opt, 1, 4)
    opt.save_checkpoint(tmp_path)
    saved = [p.detach().clone() for p in ps]
    half_train(ps, opt, 5, 8)
    qs = half_params(7, dtype)
    opt2 = zt.AdamW(qs, lr=1e-3, job="ckpt-half", socket=b.socket)
    assert opt2.load_checkpoint(tmp_path) == 4
    for p, q in zip(saved, qs):
        assert torch.equal(p, q), "params not set from the restored master"
    half_train(qs, opt2, 5, 8)
    for p, q in zip(ps, qs):
        assert q.dtype == dtype and torch.equal(p, q)
    assert_same_sd(opt2.state_dict(), opt.state_dict())
    opt.close()
    opt2.close()


def test_streamed_reference_refused_by_load_state_dict(daemon):
    """The optimizer state zoffload.deepspeed.save_checkpoint leaves in DeepSpeed's ZeRO-3
    files is a reference to the streamed state: loaded as a state dict it would resume with
    no moments, and is refused by name."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = zt.AdamW([p], job="ckpt-reference", socket=daemon.socket)
    ref = {"state": {}, "param_groups": [dict(opt.param_groups[0], params=[])],
           "zoffload.deepspeed": "zoffload"}
    with pytest.raises(ValueError, match="zoffload.deepspeed.load_checkpoint"):
        opt.load_state_dict(ref)
    opt.close()
