"""state_dict in torch's format both ways, and a killed trainer taking its state back."""
import copy
import io
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

import zhelpers
import zoffload.torch as zt
from test_numerics import RTOL, max_rel_err, step_both

WORKER = os.path.join(os.path.dirname(__file__), "worker.py")


def roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf)


def test_state_dict_into_torch(daemon):
    ours = zhelpers.model(seed=20)
    ref = copy.deepcopy(ours)
    opt = zt.AdamW(ours.parameters(), lr=1e-3, weight_decay=0.02, job="sd-out",
                   socket=daemon.socket)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.02)
    for step in range(1, 21):
        step_both(ours, ref, opt, ref_opt, step)
    sd = roundtrip(opt.state_dict())
    want = ref_opt.state_dict()
    assert sd["param_groups"] == want["param_groups"]
    assert sorted(sd["state"]) == sorted(want["state"])
    for i, st in sd["state"].items():
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
        assert torch.is_tensor(st["step"]) and float(st["step"]) == 20
        for key in ("exp_avg", "exp_avg_sq"):
            assert st[key].shape == want["state"][i][key].shape
            assert max_rel_err([st[key]], [want["state"][i][key]]) <= RTOL, key
    # Loaded into torch's own AdamW, training goes on as if it had been torch all along.
    loaded = copy.deepcopy(ours)
    torch_opt = torch.optim.AdamW(loaded.parameters(), lr=1.0)
    torch_opt.load_state_dict(sd)
    assert torch_opt.param_groups[0]["lr"] == 1e-3
    for step in range(21, 41):
        step_both(loaded, ref, torch_opt, ref_opt, step)
    assert max_rel_err(list(loaded.parameters()), list(ref.parameters())) <= RTOL
    opt.close()


def test_state_dict_from_torch(daemon):
    ref = zhelpers.model(seed=21)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for step in range(1, 21):
        ref_opt.zero_grad()
        zhelpers.loss_of(ref, step).backward()
        ref_opt.step()
    sd = roundtrip(ref_opt.state_dict())
    ours = copy.deepcopy(ref)
    opt = zt.AdamW(ours.parameters(), lr=5.0, job="sd-in", socket=daemon.socket)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 1e-3
    back = opt.state_dict()
    for i, st in back["state"].items():
        assert float(st["step"]) == 20
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[key], sd["state"][i][key]), "written state reads back changed"
    for step in range(21, 41):
        step_both(ours, ref, opt, ref_opt, step)
    assert max_rel_err(list(ours.parameters()), list(ref.parameters())) <= RTOL
    opt.close()


def test_state_dict_adagrad_and_lion_keys(daemon):
    for cls, keys in ((zt.Adagrad, {"step", "sum"}), (zt.Lion, {"step", "exp_avg"})):
        p = torch.nn.Parameter(torch.randn(10))
        opt = cls([p], job=f"keys-{cls.__name__}", socket=daemon.socket)
        p.grad = torch.ones(10)
        opt.step()
        sd = opt.state_dict()
        assert set(sd["state"][0]) == keys
        # Own output back in: same moments.
        before = {k: v.clone() for k, v in sd["state"][0].items()}
        opt.load_state_dict(sd)
        after = opt.state_dict()["state"][0]
        assert all(torch.equal(before[k], after[k]) for k in keys)
        opt.close()


def test_load_state_dict_rejects_wrong_sizes(daemon):
    p = torch.nn.Parameter(torch.randn(10))
    opt = zt.AdamW([p], job="sd-bad", socket=daemon.socket)
    sd = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(9),
                        "exp_avg_sq": torch.zeros(9)}},
          "param_groups": opt.state_dict()["param_groups"]}
    with pytest.raises(ValueError, match="holds 9 values for a parameter of 10"):
        opt.load_state_dict(sd)
    opt.close()


def open_again(**kw):
    """The daemon notices a dead rank's socket close a moment after the process is reaped."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return zt.AdamW(**kw)
        except zt.ZoffloadError as e:
            if "already attached" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def test_killed_trainer_takes_its_state_back(daemon, tmp_path):
    after5 = tmp_path / "after5.pt"
    full = tmp_path / "full.pt"
    # The run that dies after step 5, and one that trains 10 steps uninterrupted.
    r = subprocess.run([sys.executable, WORKER, "train", daemon.socket, "crash", "10",
                        str(after5), "5"], capture_output=True, text=True, timeout=zhelpers.HANG_S)
    assert r.returncode == -9, r.stderr
    r = subprocess.run([sys.executable, WORKER, "train", daemon.socket, "whole", "10",
                        str(full)], capture_output=True, text=True, timeout=zhelpers.HANG_S)
    assert r.returncode == 0, r.stderr
    m = zhelpers.model(seed=999)        # fresh weights: the daemon's must replace them
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = open_again(params=m.parameters(), lr=2e-3, job="crash", socket=daemon.socket,
                         resume=True)
    assert opt.resumed_step == 5
    assert any("resuming after step 5" in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
    for p, q in zip(m.parameters(), torch.load(after5)):
        assert torch.equal(p.detach(), q)
    assert all(float(s["step"]) == 5 for s in opt.state_dict()["state"].values())
    zhelpers.train(m, opt, 5, first=6)
    for p, q in zip(m.parameters(), torch.load(full)):
        assert torch.equal(p.detach(), q), "resumed run differs from the uninterrupted one"
    opt.close()
    # close() freed it: a new optimizer of the same job starts afresh.
    opt = zt.AdamW(zhelpers.model(seed=11).parameters(), job="crash", socket=daemon.socket)
    assert opt.resumed_step == 0
    opt.close()


def test_state_assigned_directly_like_zero(daemon):
    """ZeroRedundancyOptimizer.load_state_dict writes optim.state[p] itself, bypassing ours:
    such state goes into the daemon at the next step."""
    torch.manual_seed(22)
    ours = [torch.nn.Parameter(torch.randn(50)), torch.nn.Parameter(torch.randn(7))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = zt.AdamW(ours, lr=1e-2, job="direct", socket=daemon.socket)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2)
    for p, q in zip(ours, ref):
        st = {"step": torch.tensor(7.0), "exp_avg": torch.randn(p.shape) * 0.1,
              "exp_avg_sq": torch.rand(p.shape) * 0.01}
        opt.state[p] = {k: v.clone() for k, v in st.items()}
        ref_opt.state[q] = {k: v.clone() for k, v in st.items()}
    for _ in range(5):
        for p, q in zip(ours, ref):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    assert max_rel_err(ours, ref) <= RTOL
    assert all(float(s["step"]) == 12 for s in opt.state_dict()["state"].values())
    opt.close()


def test_load_state_dict_without_state_starts_afresh(daemon):
    """torch's semantics: a param the loaded state does not cover starts from zero moments at
    step 0 (here the daemon's tensor is reset, not left ahead of the step count)."""
    torch.manual_seed(23)
    ours = [torch.nn.Parameter(torch.randn(40))]
    ref = [torch.nn.Parameter(ours[0].detach().clone())]
    opt = zt.AdamW(ours, lr=1e-2, job="afresh", socket=daemon.socket)
    for _ in range(3):
        ours[0].grad = torch.randn(40)
        opt.step()
    ref[0].data.copy_(ours[0].detach())
    ref_opt = torch.optim.AdamW(ref, lr=1e-2)
    opt.load_state_dict(ref_opt.state_dict())       # a fresh optimizer's: no state at all
    for _ in range(5):
        ours[0].grad = torch.randn(40)
        ref[0].grad = ours[0].grad.clone()
        opt.step()
        ref_opt.step()
    assert max_rel_err(ours, ref) <= RTOL
    assert float(opt.state_dict()["state"][0]["step"]) == 5
    opt.close()
