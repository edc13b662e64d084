"""Param lists swapped under the optimizer, as DeepSpeed's ZeRO does (no DeepSpeed here):
ZeRO-1/2 narrows each group to one flat fp32 partition once and steps one group at a time
(param_groups made a one-group list for the call); ZeRO-3 sets each group's list to its flat
sub-group before step() and empties it after.  A tensor first seen at step() is registered
then, from its value; the model's params it replaced before any step are freed.

Checked against torch.optim.AdamW on the same flat tensors with the same gradients: RTOL and
its reasoning are test_numerics.py's (nothing feeds back).  Restores are bit for bit: the
state read back is the daemon's, and the update is per element.
"""
import json

import torch

import zoffload.torch as zt
from test_numerics import RTOL, max_rel_err

STEPS = 12


def groups_of_flats(seed, sizes=((300, 41), (77,))):
    """Flat fp32 partitions of two groups (the first of two params)."""
    torch.manual_seed(seed)
    model = [[torch.nn.Parameter(torch.randn(n)) for n in g] for g in sizes]
    flats = [torch.cat([p.detach() for p in g]).clone().requires_grad_(True) for g in model]
    return model, flats


def grads(step, flats):
    g = torch.Generator().manual_seed(500 + step)
    return [torch.randn(f.shape, generator=g) for f in flats]


def tensors_in_daemon(opt):
    (job,) = [j for j in json.loads(opt.jobs())["jobs"] if j["name"] == opt.job]
    return job["tensors"], job["params"]


def zero12_step(opt, flats, step):
    """One ZeRO-1/2 step: each group stepped alone, as stage_1_and_2._optimizer_step does."""
    for f, g in zip(flats, grads(step, flats)):
        f.grad = g
    original = opt.param_groups
    for gi in range(len(original)):
        opt.param_groups = [original[gi]]
        opt.step()
        opt.param_groups = original


def zero3_step(opt, flats, step):
    for f, g in zip(flats, grads(step, flats)):
        f.grad = g
    for gi, f in enumerate(flats):
        opt.param_groups[gi]["params"] = [f]
        opt.step()
        opt.param_groups[gi]["params"] = []


def reference(flats, steps, first=1):
    ref = [f.detach().clone().requires_grad_(True) for f in flats]
    opt = torch.optim.AdamW([{"params": [ref[0]]}, {"params": [ref[1]], "lr": 3e-3}],
                            lr=1e-2, weight_decay=0.05)
    for step in range(first, first + steps):
        for r, g in zip(ref, grads(step, ref)):
            r.grad = g
        opt.step()
    return ref, opt


def test_zero12_narrowed_groups(daemon):
    model, flats = groups_of_flats(1)
    start = [f.detach().clone() for f in flats]
    opt = zt.AdamW([{"params": model[0]}, {"params": model[1], "lr": 3e-3}], lr=1e-2,
                   weight_decay=0.05, job="zero12", socket=daemon.socket)
    assert tensors_in_daemon(opt) == (3, 418)
    for g, f in zip(opt.param_groups, flats):
        g["params"] = [f]
    for step in range(1, STEPS + 1):
        zero12_step(opt, flats, step)
    # The model's params went (replaced before any step); the flats are what is held.
    assert tensors_in_daemon(opt) == (2, 418)
    ref, _ = reference(start, STEPS)
    assert max_rel_err(flats, ref) <= RTOL
    # Each group's own lr reached the daemon (the second group's flat moved less).
    sd = opt.state_dict()
    assert [float(s["step"]) for s in sd["state"].values()] == [STEPS, STEPS]
    assert [list(g["params"]) for g in sd["param_groups"]] == [[0], [1]]
    opt.close()


def test_zero3_lists_filled_and_emptied(daemon, tmp_path):
    """ZeRO-3: lists filled around each step; state_dict/load_state_dict with every flat
    put back in (as stage3._rigid_state_dict does), and a new optimizer that loads it before
    its first step and has the fp32 partition restored after the load (as DeepSpeed's
    load_checkpoint does) goes on bit for bit as the uninterrupted run."""
    model, flats = groups_of_flats(2)
    start = [f.detach().clone() for f in flats]

    def build(job):
        opt = zt.AdamW([{"params": []}, {"params": [], "lr": 3e-3}], lr=1e-2,
                       weight_decay=0.05, job=job, socket=daemon.socket)
        return opt

    whole = build("zero3-whole")
    for step in range(1, STEPS + 1):
        zero3_step(whole, flats, step)
    ref, _ = reference(start, STEPS)
    assert max_rel_err(flats, ref) <= RTOL
    assert tensors_in_daemon(whole) == (2, 418)

    half = STEPS // 2
    again = [s.clone().requires_grad_(True) for s in start]
    first = build("zero3-first")
    for step in range(1, half + 1):
        zero3_step(first, again, step)
    for g, f in zip(first.param_groups, again):
        g["params"] = [f]
    sd = first.state_dict()
    saved_master = [f.detach().clone() for f in again]
    for g in first.param_groups:
        g["params"] = []
    first.close()
    assert all(float(s["step"]) == half for s in sd["state"].values())
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in sd["state"].values())

    # "A new process": fresh flats of other values, filled in, loaded, emptied, then the
    # fp32 partitions restored from the checkpoint behind the optimizer's back.
    resumed = [torch.zeros_like(s).requires_grad_(True) for s in start]
    second = build("zero3-second")
    for g, f in zip(second.param_groups, resumed):
        g["params"] = [f]
    second.load_state_dict(sd)
    # Read back before any step: what was loaded, though nothing is registered yet.
    back = second.state_dict()
    for i in back["state"]:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(back["state"][i][key], sd["state"][i][key])
    for g in second.param_groups:
        g["params"] = []
    with torch.no_grad():
        for f, m in zip(resumed, saved_master):
            f.copy_(m)
    for step in range(half + 1, STEPS + 1):
        zero3_step(second, resumed, step)
    for a, b in zip(resumed, flats):
        assert torch.equal(a.detach(), b.detach()), "resumed run differs from the whole one"
    whole.close()
    second.close()


def test_load_state_dict_then_params_restored(daemon):
    """In one process: load_state_dict, then the params set behind the optimizer (DeepSpeed
    restores its fp32 partition after the optimizer's state): the next step starts from the
    params as set, not as they were at the load."""
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.randn(64))
    q = torch.nn.Parameter(p.detach().clone())
    opt = zt.AdamW([p], lr=1e-2, job="load-then-set", socket=daemon.socket)
    ref = torch.optim.AdamW([q], lr=1e-2)
    for _ in range(3):
        p.grad = torch.randn(64)
        q.grad = p.grad.clone()
        opt.step()
        ref.step()
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    with torch.no_grad():
        p.copy_(q * 0.5)
        q.mul_(0.5)
    for _ in range(3):
        p.grad = torch.randn(64)
        q.grad = p.grad.clone()
        opt.step()
        ref.step()
    assert max_rel_err([p], [q]) <= RTOL
    opt.close()
