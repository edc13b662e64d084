"""Param views: a CPU param's storage is a private writable mapping of its param slot, so a
step's new params are in it with no copy out (see zoffload/torch.py, client/zclient_view.c).

Checked here:
- a step through views gives the very bits of the copying path (param_views=False) and no
  copies (copy_stats);
- what the user writes into a viewed param outside step() (a model's load_state_dict,
  p.data.mul_(), numpy) is what the next step starts from, as with torch.optim, and
  p.data = ... falls back to copying, counted; a write into a param that is a copy is
  taken the same way (found by comparing it with its slot);
- params that cannot be views are refused by name and still train;
- close() leaves the params their values in storage of their own;
- a reconnect that maps another slot file over the view keeps what was written into it.
Against torch.optim.AdamW with test_numerics' tolerance (RTOL, justified there): the same
gradients are copied into the reference each step, so nothing feeds back.
"""
import array
import json
import mmap
import os

import numpy
import pytest
import torch

import zoffload
import zoffload.torch as zt
import zhelpers
from test_cuda_pins import SlotSwappingRelay, backing
from test_numerics import RTOL, max_rel_err

KW = dict(lr=2e-3, weight_decay=0.05)


def train_both(ours, ref, opt, ref_opt, steps, first=1):
    for step in range(first, first + steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        zhelpers.loss_of(ours, step).backward()
        for p, q in zip(ours.parameters(), ref.parameters()):
            q.grad = p.grad.detach().clone()
        opt.step()
        ref_opt.step()


def viewed(opt, p):
    e = opt._entries[p]
    return e.view is not None and p.data_ptr() == e.view.data_ptr()


def test_views_give_the_copying_path_bits_with_no_copies(daemon):
    runs = []
    for views in (True, False):
        m = zhelpers.model(seed=3)
        opt = zt.AdamW(m.parameters(), job=f"views-{views}", socket=daemon.socket,
                       param_views=views, **KW)
        zhelpers.train(m, opt, 12)
        stats = opt.copy_stats()
        n = len(list(m.parameters()))
        if views:
            assert all(viewed(opt, p) for p in m.parameters())
            assert stats["params_viewed"] == n and stats["param_copies"] == 0
            assert stats["fallbacks"] == {}
            # zero_grad() of torch 2.x sets grads to None: a copy each step (1.13 zeroes
            # the slot in place: the first step's only).
            assert stats["grad_copies"] in (n, 12 * n)
        else:
            assert stats["params_viewed"] == 0 and stats["param_copies"] == 12 * n
            assert stats["fallbacks"] == {"param_views=False": n}
        runs.append([p.detach().clone() for p in m.parameters()])
        opt.close()
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cls, fmt, dtype", [
    (zt.Adam, None, torch.float32), (zt.Adagrad, None, torch.float32),
    (zt.Lion, None, torch.float32), (zt.AdamW, "q8-moments", torch.float32),
    (zt.AdamW, "bf16-moments", torch.float32), (zt.AdamW, "bf16-master+q8", torch.bfloat16),
    (zt.AdamW, None, torch.bfloat16)])
def test_every_update_and_format_through_views(daemon, cls, fmt, dtype):
    """The daemon writes each update's and format's params into the slot the view reads:
    the same bits as copying them out."""
    runs = []
    for views in (True, False):
        m = zhelpers.model(seed=9, dtype=dtype)
        kw = {} if fmt is None else {"state_format": fmt}
        opt = cls(m.parameters(), lr=1e-3, job=f"views-{cls.__name__}-{fmt}-{dtype}-{views}",
                  socket=daemon.socket, param_views=views, **kw)
        zhelpers.train(m, opt, 6)
        assert opt.copy_stats()["params_viewed"] == (len(list(m.parameters())) if views else 0)
        runs.append([p.detach().clone() for p in m.parameters()])
        opt.close()
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_grads_in_the_slot_copy_nothing(daemon):
    m = zhelpers.model(seed=4)
    opt = zt.AdamW(m.parameters(), job="views-grads", socket=daemon.socket, **KW)
    for step in range(1, 6):
        opt.zero_grad(set_to_none=False)
        zhelpers.loss_of(m, step).backward()
        opt.step()
    stats = opt.copy_stats()
    n = len(list(m.parameters()))
    assert stats["grad_copies"] == n and stats["param_copies"] == 0   # the first step's only
    opt.close()


@pytest.mark.skipif(not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"),
                    reason=f"torch {torch.__version__} has no post-accumulate-grad hooks")
def test_fresh_grads_go_into_the_slots_in_backward(daemon):
    """zero_grad()'s default (set_to_none): each gradient backward makes is copied into its
    slot by a post-accumulate-grad hook and the slot becomes p.grad, so step() copies none;
    a second backward before step() adds into the slot in place (its sum that of one
    backward over both losses); maximize leaves the gradient to step(), which negates its
    slot.  In lockstep with torch.optim.AdamW (RTOL), which takes ours' gradients."""
    ours, ref = zhelpers.model(seed=6), zhelpers.model(seed=6)
    opt = zt.AdamW(ours.parameters(), job="views-fresh", socket=daemon.socket, **KW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **KW)
    params = list(ours.parameters())
    for step in range(1, 7):
        opt.zero_grad()
        ref_opt.zero_grad()
        assert all(p.grad is None for p in params)
        if step % 3 == 0:
            # Two micro-batches: the second accumulates into the slot.
            want = torch.autograd.grad(zhelpers.loss_of(ours, 10 * step) +
                                       zhelpers.loss_of(ours, 10 * step + 1), params)
            zhelpers.loss_of(ours, 10 * step).backward()
            zhelpers.loss_of(ours, 10 * step + 1).backward()
            err = max_rel_err([p.grad for p in params], want)
            assert err <= 1e-6, f"accumulated grads: max relative difference {err:.3g}"
        else:
            zhelpers.loss_of(ours, step).backward()
        for p in params:
            assert p.grad.data_ptr() == opt._entries[p].grad.data_ptr(), "p.grad is no slot"
        for p, q in zip(params, ref.parameters()):
            q.grad = p.grad.detach().clone()
        opt.step()
        ref_opt.step()
    err = max_rel_err(params, list(ref.parameters()))
    assert err <= RTOL, f"params: max relative difference {err:.3g} > {RTOL:.3g}"
    # One copy a param a step, in backward (the micro-batches' second added in place).
    assert opt.copy_stats()["grad_copies"] == 6 * len(params), opt.copy_stats()
    opt.close()
    m = zhelpers.model(seed=6)
    opt = zt.AdamW(m.parameters(), job="views-fresh-max", socket=daemon.socket, maximize=True,
                   **KW)
    zhelpers.loss_of(m, 1).backward()
    assert all(p.grad.data_ptr() != opt._entries[p].grad.data_ptr() for p in m.parameters())
    opt.close()


def test_writes_outside_step_are_what_the_next_step_starts_from(daemon):
    ours, ref = zhelpers.model(seed=5), zhelpers.model(seed=5)
    opt = zt.AdamW(ours.parameters(), job="views-writes", socket=daemon.socket, **KW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **KW)
    train_both(ours, ref, opt, ref_opt, 3)
    other = zhelpers.model(seed=99).state_dict()
    for m in (ours, ref):
        m.load_state_dict(other)            # param.copy_() into every param
    train_both(ours, ref, opt, ref_opt, 3, first=4)
    assert opt.copy_stats()["param_writes_taken"] == len(other)
    with torch.no_grad():
        for m in (ours, ref):
            m.head.weight.data.mul_(0.5)    # through .data: no version bump to see
            m.pos.detach().numpy()[0, 0] = 3.0
    train_both(ours, ref, opt, ref_opt, 3, first=7)
    stats = opt.copy_stats()
    assert stats["param_writes_taken"] == len(other) + 2
    assert stats["param_copies"] == 0 and stats["params_viewed"] == len(other)
    assert max_rel_err(list(ours.parameters()), list(ref.parameters())) <= RTOL
    opt.close()


@pytest.mark.parametrize("why", ["param_views=False", "overlap"])
def test_writes_into_copied_params_are_what_the_next_step_starts_from(daemon, why):
    # A param that is no view is copied into after each step; a write into it between steps
    # (here a load_state_dict and a numpy write, as into views above) was dropped: the next
    # step started from the daemon's old master and overwrote it.
    ours, ref = zhelpers.model(seed=8), zhelpers.model(seed=8)
    opt = zt.AdamW(ours.parameters(), job=f"copies-{why}", socket=daemon.socket,
                   param_views=why != "param_views=False", overlap=why == "overlap", **KW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **KW)
    train_both(ours, ref, opt, ref_opt, 3)
    assert opt.copy_stats()["param_writes_taken"] == 0      # its own copies are no writes
    other = zhelpers.model(seed=98).state_dict()
    for m in (ours, ref):
        m.load_state_dict(other)
    train_both(ours, ref, opt, ref_opt, 2, first=4)
    with torch.no_grad():
        for m in (ours, ref):
            m.pos.detach().numpy()[0, 0] = 3.0
    train_both(ours, ref, opt, ref_opt, 2, first=6)
    stats = opt.copy_stats()
    assert stats["params_viewed"] == 0 and stats["fallbacks"] == {why: len(other)}
    assert stats["param_writes_taken"] == len(other) + 1
    assert max_rel_err(list(ours.parameters()), list(ref.parameters())) <= RTOL
    opt.close()


def test_replaced_storage_falls_back_to_copying(daemon):
    ours, ref = zhelpers.model(seed=6), zhelpers.model(seed=6)
    opt = zt.AdamW(ours.parameters(), job="views-replaced", socket=daemon.socket, **KW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **KW)
    train_both(ours, ref, opt, ref_opt, 2)
    for m in (ours, ref):
        m.norm.weight.data = torch.full_like(m.norm.weight, 0.75)
    train_both(ours, ref, opt, ref_opt, 4, first=3)
    stats = opt.copy_stats()
    assert stats["fallbacks"] == {"p.data replaced": 1}
    assert stats["param_copies"] == 4 and not viewed(opt, ours.norm.weight)
    assert max_rel_err(list(ours.parameters()), list(ref.parameters())) <= RTOL
    opt.close()


def test_params_that_cannot_be_views_say_why_and_train(daemon):
    flat = torch.zeros(40)
    torch.manual_seed(0)
    flat.normal_()
    inside = torch.nn.Parameter(flat[8:24])     # a slice of a flat buffer
    strided = torch.nn.Parameter(torch.randn(6, 4).t())
    own = torch.nn.Parameter(torch.randn(16))
    refs = [torch.nn.Parameter(t.detach().clone()) for t in (inside, strided, own)]
    opt = zt.AdamW([inside, strided, own], job="views-refused", socket=daemon.socket, **KW)
    ref_opt = torch.optim.AdamW(refs, **KW)
    assert opt.copy_stats()["fallbacks"] == {"shares its storage": 1, "not contiguous": 1}
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        for p, q in zip([inside, strided, own], refs):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    assert inside.data_ptr() == flat[8:].data_ptr()   # still the buffer's
    assert max_rel_err([inside, strided, own], refs) <= RTOL
    opt.close()
    for views, overlap, why in ((False, False, "param_views=False"), (True, True, "overlap")):
        p = torch.nn.Parameter(torch.randn(8))
        o = zt.AdamW([p], job=f"views-{why}", socket=daemon.socket, param_views=views,
                     overlap=overlap)
        assert o.copy_stats()["fallbacks"] == {why: 1}
        o.close()


def test_close_gives_params_storage_of_their_own(daemon):
    m = zhelpers.model(seed=7)
    opt = zt.AdamW(m.parameters(), job="views-close", socket=daemon.socket, **KW)
    zhelpers.train(m, opt, 2)
    before = [p.detach().clone() for p in m.parameters()]
    slots = [backing(p.data_ptr()) for p in m.parameters()]
    opt.close()
    for p, b, slot in zip(m.parameters(), before, slots):
        assert torch.equal(p.detach(), b) and backing(p.data_ptr()) != slot
    p.data.add_(1.0)                        # writable, and nobody else's



def test_close_while_another_holder_still_references_a_viewed_param(daemon):
    """close() while something else still holds a viewed param's old storage: torch 1.13's
    ZeroRedundancyOptimizer broadcasts each param with async_op=True, and gloo's worker lets
    go of the broadcast's input a moment after wait() returns.  close() raised BufferError
    ("unregister() would unmap the slots of tensor 'p9/32', which 1 object(s) still view")
    and the process aborted (test_dist's ZeRO run in CI, now and then).  Now close() frees
    the daemon's state, and the holder keeps the values it saw, in memory that stays mapped
    until it lets go; the param has storage of its own as before."""
    m = zhelpers.model(seed=7)
    opt = zt.AdamW(m.parameters(), job="views-held", socket=daemon.socket, **KW)
    zhelpers.train(m, opt, 2)
    p = next(iter(m.parameters()))
    assert viewed(opt, p)
    held = p.data                           # another Tensor over p's storage, as gloo's
    grad_held = p.grad.data                 # and over the grad slot
    want, want_grad = held.clone(), grad_held.clone()
    opt.close()
    assert torch.equal(held, want) and torch.equal(grad_held, want_grad)
    assert torch.equal(p.detach(), want) and p.data_ptr() != held.data_ptr()
    held.add_(1.0)                          # still writable, and no longer p's
    assert torch.equal(p.detach(), want) and not torch.equal(held, want)
    c = zoffload.Connection(daemon.socket)
    assert not any(j["name"] == "views-held" for j in json.loads(c.jobs())["jobs"])
    c.close()
    del held, grad_held                     # the mapping goes with the last of them

@pytest.fixture
def relay(daemon):
    r = SlotSwappingRelay(daemon.socket, os.path.join(daemon.dir, "relay.sock"))
    yield r
    r.stop()


def test_a_remap_carries_what_was_written_into_the_view(daemon, relay):
    page = mmap.PAGESIZE // 4
    c = zoffload.Connection(relay.path)
    c.job_open("views-remap")
    t = c.register("w", array.array("f", [1.0] * 3 * page), param_view=True)
    view = torch.frombuffer(t.param_view, dtype=torch.float32)
    addr, old = view.data_ptr(), backing(view.data_ptr())
    view[page + 1] = 42.0                   # written, and no step has taken it yet
    relay.swap = True
    relay.cut()
    assert c.ping() > 0                     # reconnects: the slots come back in other files
    assert c.conn_stats()["slots_remapped"] == 2
    assert view.data_ptr() == addr and backing(addr) != old
    assert t.view_written() == 1 and view[page + 1].item() == 42.0
    assert torch.equal(view[:page], torch.ones(page)) and view[page].item() == 1.0
    t.view_reset()
    assert t.view_written() == 0 and torch.equal(view, torch.ones(3 * page))
    numpy.asarray(view)[0] = 5.0            # the new mapping is as writable as the old
    assert t.view_written() == 1
    del view
    t.unregister()
    c.close()


def test_a_remap_makes_a_graft_stale(daemon, relay):
    """A graft (FSDP2's reduce-scatter output made of grad slots, zoffload/_graft.py) maps
    the slot files of its making.  A reconnect that brings the slots back in other files
    leaves it writing into the old ones, which the daemon no longer steps from: the slots hook
    marks it stale, and from then on it holds no gradient (step() copies them in), while
    what was in it before the remap reached the new slot (the reconnect copies the grads)."""
    from types import SimpleNamespace

    from zoffload import _graft

    page = mmap.PAGESIZE // 4
    c = zoffload.Connection(relay.path)
    c.job_open("graft-remap")
    a = c.register("a", array.array("f", [1.0] * page))
    b = c.register("b", array.array("f", [1.0] * 10))
    ea, eb = SimpleNamespace(zt=a), SimpleNamespace(zt=b)
    g = _graft._Graft(c, 2 * page + 16, [(0, ea), (page, eb)])
    g.tensor[:page] = 3.0
    g.tensor[page:page + 10] = 4.0
    assert g.holds(ea, g.tensor[:page]) and g.holds(eb, g.tensor[page:page + 10])
    assert not g.holds(eb, g.tensor[:10])               # a's offset is not b's
    relay.swap = True
    relay.cut()
    assert c.ping() > 0                                 # reconnects: other slot files
    assert c.conn_stats()["slots_remapped"] == 4
    assert g.stale and not g.holds(ea, g.tensor[:page])
    assert torch.equal(torch.frombuffer(a.grad, dtype=torch.float32), torch.full((page,), 3.0))
    g.tensor[:page] = 5.0                               # the old file's pages: not a's now
    assert torch.equal(torch.frombuffer(a.grad, dtype=torch.float32), torch.full((page,), 3.0))
    a.unregister()
    b.unregister()
    c.close()


def test_load_checkpoint_restores_into_views(daemon, tmp_path):
    """A restore's tensors are views too, holding the restored params: the run goes on bit
    for bit as the uninterrupted one."""
    m = zhelpers.model(seed=8)
    opt = zt.AdamW(m.parameters(), job="views-ckpt", socket=daemon.socket, **KW)
    zhelpers.train(m, opt, 3)
    opt.save_checkpoint(tmp_path)
    zhelpers.train(m, opt, 3, first=4)
    want = [p.detach().clone() for p in m.parameters()]
    opt.close()
    m2 = zhelpers.model(seed=123)          # other values: the restore must set them all
    opt2 = zt.AdamW(m2.parameters(), job="views-ckpt-2", socket=daemon.socket, **KW)
    assert opt2.load_checkpoint(tmp_path) == 3
    assert all(viewed(opt2, p) for p in m2.parameters())
    zhelpers.train(m2, opt2, 3, first=4)
    assert opt2.copy_stats()["param_writes_taken"] == 0
    for a, b in zip(m2.parameters(), want):
        assert torch.equal(a.detach(), b)
    opt2.close()
