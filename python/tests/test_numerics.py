"""zoffload.torch optimizers against torch.optim: same hyperparameters, same gradients.

Tolerance: the daemon keeps fp32 master weights and moments, like torch on fp32 params, but
its kernels use the op order of torch 2.x's AdamW (lerp for the first moment, no FMA) while
torch 1.13 here does mul_/add_ and its vectorised add fuses multiply-adds; the two differ by a
few ulps per step.  Both are fed the very same gradients each step (taken from our model and
copied into the reference), so nothing feeds back.  Measured after 110 steps: at most 4e-7 of
the largest param (about 3 ulps at |p| = 1) for AdamW, Adam and Adagrad, 0 for Lion.
RTOL = 2**-18 (~3.8e-6, 32 ulps) leaves ten times that and is still a hundred times smaller
than a single step's update at lr 1e-3 would show if any op were wrong.  Lion's sign() may
take either side where its interpolation is zero to within those ulps: such an element is
off by 2 lr, and a few per ten thousand are allowed (none happen here).
"""
import copy
import math

import pytest
import torch

import zhelpers
import zoffload.torch as zt

RTOL = 2.0 ** -18
STEPS = 110


class RefLion(torch.optim.Optimizer):
    """Lion as published (Chen et al. 2023; lion-pytorch's update), written in torch."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, wd, (b1, b2) = group["lr"], group["weight_decay"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p)
                p.mul_(1 - lr * wd)
                update = st["exp_avg"].clone().mul_(b1).add(p.grad, alpha=1 - b1).sign_()
                p.add_(update, alpha=-lr)
                st["exp_avg"].mul_(b2).add_(p.grad, alpha=1 - b2)


CASES = {
    "AdamW": (zt.AdamW, torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.05)),
    "Adam": (zt.Adam, torch.optim.Adam, dict(lr=1e-3, weight_decay=0.01, betas=(0.8, 0.99))),
    "Adagrad": (zt.Adagrad, torch.optim.Adagrad, dict(lr=1e-2, lr_decay=1e-3, weight_decay=0.01,
                                                      initial_accumulator_value=0.1)),
    "Lion": (zt.Lion, RefLion, dict(lr=1e-4, weight_decay=0.1)),
    # torch 2.x's Adam(decoupled_weight_decay=True) is AdamW's update (torch 1.13's Adam has
    # no such argument, so the reference is AdamW on both).
    "Adam-decoupled": (zt.Adam, lambda params, decoupled_weight_decay, **kw:
                       torch.optim.AdamW(params, **kw),
                       dict(lr=1e-3, weight_decay=0.05, decoupled_weight_decay=True)),
}


def max_rel_err(got, want):
    worst = 0.0
    for a, b in zip(got, want):
        a, b = a.detach().double(), b.detach().double()
        worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item())
    return worst


def lion_flipped(got, want, lr):
    """Elements whose Lion updates took the other sign at least once (|diff| >= lr)."""
    return sum(int(((a.detach() - b.detach()).abs() >= lr).sum()) for a, b in zip(got, want))


def step_both(ours, ref, opt, ref_opt, step):
    opt.zero_grad()
    ref_opt.zero_grad()
    zhelpers.loss_of(ours, step).backward()
    for p, q in zip(ours.parameters(), ref.parameters()):
        q.grad = p.grad.detach().clone().to(q.dtype)
    opt.step()
    ref_opt.step()


def check_close(name, got, want, kw):
    err = max_rel_err(got, want)
    if name == "Lion":
        # sign() of a first moment that is zero to within the ulps above takes either side.
        flipped = lion_flipped(got, want, kw["lr"])
        total = sum(p.numel() for p in want)
        assert flipped <= total // 10000, f"Lion: {flipped} of {total} elements differ by lr"
        return
    assert err <= RTOL, f"{name}: max relative difference {err:.3g} > {RTOL:.3g}"


@pytest.mark.parametrize("name", list(CASES))
def test_transformer_vs_torch(daemon, name):
    ours_cls, ref_cls, kw = CASES[name]
    ours = zhelpers.model(seed=1)
    ref = copy.deepcopy(ours)
    opt = ours_cls(ours.parameters(), job=f"tf-{name}", socket=daemon.socket, **kw)
    ref_opt = ref_cls(ref.parameters(), **kw)
    start = [p.detach().clone() for p in ref.parameters()]
    for step in range(1, STEPS + 1):
        step_both(ours, ref, opt, ref_opt, step)
    check_close(name, list(ours.parameters()), list(ref.parameters()), kw)
    # The steps did something: a bug that left the params alone would pass the above only
    # against a reference that also did nothing.
    moved = max_rel_err(list(ref.parameters()), start)
    assert moved > 1000 * RTOL, f"{name}: the params barely moved ({moved:.3g})"
    sd = opt.state_dict()
    assert all(int(s["step"]) == STEPS for s in sd["state"].values())
    opt.close()


ODD = [1, 3, 7, 17, 255, 1023, 1025, 4099, 65537, 100003]


@pytest.mark.parametrize("name", list(CASES))
def test_odd_sizes_vs_torch(daemon, name):
    """Sizes that leave every SIMD tail and chunk boundary a remainder."""
    ours_cls, ref_cls, kw = CASES[name]
    torch.manual_seed(2)
    ours = [torch.nn.Parameter(torch.randn(n)) for n in ODD]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = ours_cls(ours, job=f"odd-{name}", socket=daemon.socket, **kw)
    ref_opt = ref_cls(ref, **kw)
    for step in range(STEPS):
        for p, q in zip(ours, ref):
            p.grad = torch.randn(p.shape) * (0.1 + step % 3)
            q.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    check_close(name, ours, ref, kw)
    opt.close()


def check_low_precision(opt, ours, master, dtype):
    """Each param is exactly our fp32 master rounded; and that master is torch's to RTOL, so
    the params equal the reference master rounded, or sit one ulp off where the masters'
    few-ulp difference straddles a rounding boundary (rarely)."""
    eps = torch.finfo(dtype).eps
    same = total = 0
    for p, q in zip(ours, master):
        assert p.dtype == dtype
        m = torch.empty(p.numel())
        opt._entries[p].zt.read("master", m.numpy())
        assert torch.equal(m.view(p.shape).to(dtype), p.detach()), "param is not its master rounded"
        assert max_rel_err([m], [q.detach().reshape(-1)]) <= RTOL
        want = q.detach().to(dtype).float()
        diff = (p.detach().float() - want).abs()
        # One ulp; near zero, where an ulp is tiny, the masters' own RTOL difference.
        floor = RTOL * q.detach().abs().max().item()
        assert (diff <= torch.clamp(want.abs() * eps, min=floor)).all(), \
            f"{dtype}: more than one ulp off"
        same += int((diff == 0).sum())
        total += diff.numel()
    # fp16 (10-bit mantissa) straddles boundaries four times as often as bf16: ~1.3% here.
    assert same >= 0.95 * total, f"{dtype}: only {same} of {total} equal"


def test_bf16_transformer(daemon):
    dtype = torch.bfloat16
    ours = zhelpers.model(seed=3, dtype=dtype)
    master = copy.deepcopy(ours).float()
    opt = zt.AdamW(ours.parameters(), lr=1e-3, job="lp-transformer", socket=daemon.socket)
    ref_opt = torch.optim.AdamW(master.parameters(), lr=1e-3)
    assert all(e.grad.dtype == dtype for e in opt._entries.values())
    for step in range(1, 31):
        step_both(ours, master, opt, ref_opt, step)
    check_low_precision(opt, list(ours.parameters()), list(master.parameters()), dtype)
    opt.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_dtype", [None, torch.float32])
def test_low_precision_params(daemon, dtype, grad_dtype):
    """bf16/fp16 params (torch 1.13 has no fp16 matmul on the CPU: synthetic gradients), with
    gradients handed over in the params' dtype or in fp32."""
    torch.manual_seed(8)
    ours = [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in ODD]
    master = [torch.nn.Parameter(p.detach().float()) for p in ours]
    opt = zt.AdamW(ours, lr=1e-3, job=f"lp-{dtype}-{grad_dtype}", socket=daemon.socket,
                   grad_dtype=grad_dtype)
    ref_opt = torch.optim.AdamW(master, lr=1e-3)
    assert all(e.grad.dtype == (grad_dtype or dtype) for e in opt._entries.values())
    for _ in range(STEPS):
        for p, q in zip(ours, master):
            g = torch.randn(p.shape)
            p.grad = g.to(dtype)
            q.grad = p.grad.float()         # what reaches the slot, in either dtype
        opt.step()
        ref_opt.step()
    check_low_precision(opt, ours, master, dtype)
    opt.close()


def test_param_groups_and_scheduler(daemon):
    """Each group steps with its own hyperparameters; the scheduler's lr is read every step."""
    ours = zhelpers.model(seed=4)
    ref = copy.deepcopy(ours)

    def groups(m):
        return [{"params": list(m.emb.parameters()) + [m.pos], "lr": 3e-3, "weight_decay": 0.0},
                {"params": list(m.layer.parameters()), "betas": (0.85, 0.98)},
                {"params": list(m.norm.parameters()) + list(m.head.parameters())}]
    opt = zt.AdamW(groups(ours), lr=1e-3, weight_decay=0.1, job="groups", socket=daemon.socket)
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=10, gamma=0.5)
    for step in range(1, 41):
        step_both(ours, ref, opt, ref_opt, step)
        sched.step()
        ref_sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-3 / 16)
    assert max_rel_err(list(ours.parameters()), list(ref.parameters())) <= RTOL
    opt.close()


def test_scheduler_changes_the_step(daemon):
    """Without re-reading the group's lr every step the two runs below would agree."""
    runs = []
    for i, gamma in enumerate((1.0, 0.1)):
        m = zhelpers.model(seed=5)
        opt = zt.AdamW(m.parameters(), job=f"sched-{i}", socket=daemon.socket)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=gamma)
        for step in range(1, 6):
            opt.zero_grad()
            zhelpers.loss_of(m, step).backward()
            opt.step()
            sched.step()
        runs.append([p.detach().clone() for p in m.parameters()])
        opt.close()
    assert max_rel_err(runs[0], runs[1]) > 1e-4


def test_overlap_same_bits(daemon):
    """overlap=True submits from gradient hooks during backward: bit for bit the plain run."""
    results = []
    for overlap in (False, True):
        m = zhelpers.model(seed=6)
        opt = zt.AdamW(m.parameters(), lr=2e-3, job=f"ovl-{overlap}", socket=daemon.socket,
                       overlap=overlap)
        for step in range(1, 21):
            opt.zero_grad(set_to_none=(step % 2 == 0))
            zhelpers.loss_of(m, step).backward()
            if overlap:
                assert all(e.in_flight for e in opt._entries.values()), "hooks did not submit"
            opt.step()
        results.append([p.detach().clone() for p in m.parameters()])
        opt.close()
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_overlap_refuses_two_backwards(daemon):
    m = zhelpers.model(seed=6)
    opt = zt.AdamW(m.parameters(), job="ovl-twice", socket=daemon.socket, overlap=True)
    zhelpers.loss_of(m, 1).backward()
    with pytest.raises(RuntimeError, match="one backward per step"):
        zhelpers.loss_of(m, 2).backward()
    opt.step()
    opt.close()


def test_overlap_refuses_grads_changed_after_backward(daemon):
    """torch's clip_grad_norm_ after a backward whose hooks submitted the steps was silently
    not applied (the steps had taken the gradients): step() refuses it by name; a step()
    after an untouched backward goes on, maximize too."""
    m = zhelpers.model(seed=6)
    opt = zt.AdamW(m.parameters(), job="ovl-clip", socket=daemon.socket, overlap=True,
                   maximize=True)
    zhelpers.loss_of(m, 1).backward()
    opt.step()
    opt.zero_grad()
    zhelpers.loss_of(m, 2).backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-4)    # far below: scales every grad
    with pytest.raises(RuntimeError, match="changed after backward handed them"):
        opt.step()
    opt.zero_grad()
    zhelpers.loss_of(m, 3).backward()
    opt.step()
    opt.close()


def test_closure_zero_grad_and_maximize(daemon):
    torch.manual_seed(7)
    w = torch.nn.Parameter(torch.randn(33))
    v = torch.nn.Parameter(w.detach().clone())
    opt = zt.Adam([w], lr=1e-2, maximize=True, job="closure", socket=daemon.socket)
    ref_opt = torch.optim.Adam([v], lr=1e-2, maximize=True)
    for _ in range(20):
        def closure(p=w, o=opt):
            o.zero_grad()
            loss = -(p * p).sum()
            loss.backward()
            return loss
        loss = opt.step(closure)
        assert torch.is_tensor(loss)
        ref_opt.zero_grad()
        (-(v * v).sum()).backward()
        ref_opt.step()
    assert max_rel_err([w], [v]) <= RTOL
    opt.zero_grad(set_to_none=True)
    assert w.grad is None
    w.grad = torch.ones_like(w)
    opt.zero_grad(set_to_none=False)
    assert w.grad is not None and not w.grad.any()
    opt.close()


def test_params_without_grad_are_skipped(daemon):
    a = torch.nn.Parameter(torch.ones(5))
    b = torch.nn.Parameter(torch.ones(5))
    opt = zt.AdamW([a, b], lr=0.1, job="nograd", socket=daemon.socket)
    a.grad = torch.ones(5)
    opt.step()
    assert not torch.equal(a.detach(), torch.ones(5))
    assert torch.equal(b.detach(), torch.ones(5))
    sd = opt.state_dict()
    assert list(sd["state"]) == [0] and int(sd["state"][0]["step"]) == 1
    b.grad = torch.ones(5)
    opt.step()              # a at step 2, b at step 1: two sets
    sd = opt.state_dict()
    assert int(sd["state"][0]["step"]) == 2 and int(sd["state"][1]["step"]) == 1
    opt.close()


def test_constructor_matches_torch():
    import inspect
    for ours, theirs in ((zt.AdamW, torch.optim.AdamW), (zt.Adam, torch.optim.Adam),
                         (zt.Adagrad, torch.optim.Adagrad)):
        a, b = inspect.signature(ours.__init__).parameters, inspect.signature(theirs.__init__).parameters
        for name, p in b.items():
            assert name in a, f"{ours.__name__} lacks {name}"
            if p.default is not inspect.Parameter.empty and name not in ("fused", "foreach"):
                assert a[name].default == p.default, f"{ours.__name__}.{name}"
    assert math.isclose(zt.Lion.__init__.__defaults__[0], 1e-4)


def test_grads_land_in_the_slots(daemon):
    """After a step p.grad is the grad slot itself (same values), so zero_grad() zeroes it in
    place and backward accumulates straight into shared memory: no copy on the next step.
    The transformer tests above run on that path from their second step on."""
    m = zhelpers.model(seed=9)
    opt = zt.AdamW(m.parameters(), job="grad-views", socket=daemon.socket)
    zhelpers.loss_of(m, 1).backward()
    grads = [p.grad.clone() for p in m.parameters()]
    opt.step()
    for p, g in zip(m.parameters(), grads):
        assert p.grad.data_ptr() == opt._entries[p].grad.data_ptr()
        assert torch.equal(p.grad, g), "the step changed the gradients"
    opt.zero_grad(set_to_none=False)
    zhelpers.loss_of(m, 2).backward()
    assert all(p.grad.data_ptr() == opt._entries[p].grad.data_ptr() for p in m.parameters())
    grads = [p.grad.clone() for p in m.parameters()]
    opt.step()
    opt.close()
    # close() hands p.grad back as ordinary memory before the slots go.
    for p, g in zip(m.parameters(), grads):
        assert torch.equal(p.grad, g)


def test_non_contiguous_params(daemon):
    """Params whose memory is not laid out as their slot take torch's copy_ both ways."""
    torch.manual_seed(10)
    ours = [torch.nn.Parameter(torch.randn(9, 7).t()), torch.nn.Parameter(torch.randn(5, 4)[:, :3])]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    assert not any(p.is_contiguous() for p in ours)
    opt = zt.AdamW(ours, lr=1e-2, job="strided", socket=daemon.socket)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2)
    for _ in range(20):
        for p, q in zip(ours, ref):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    assert max_rel_err(ours, ref) <= RTOL
    opt.close()


def test_own_clip_grad_norm_vs_torch(daemon):
    """opt.clip_grad_norm_ on one process's plain params (its own norm: no process group):
    the norm is torch.nn.utils.clip_grad_norm_'s, and the run stays within RTOL of torch's
    AdamW clipped by torch (the coefficients differ by the norms' rounding, double sums here
    and fp32 there, which Adam's m / sqrt(v) all but divides out).  An inf gradient skips the
    next step (params and step counts unchanged) or, with error_if_nonfinite, raises; what
    the daemon cannot clip is refused by name."""
    ours = zhelpers.model(seed=5)
    ref = copy.deepcopy(ours)
    opt = zt.AdamW(ours.parameters(), lr=1e-2, job="own-clip", socket=daemon.socket)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    max_norm = 0.3
    for step in range(1, 31):
        opt.zero_grad()
        ref_opt.zero_grad()
        zhelpers.loss_of(ours, step).backward()
        for p, q in zip(ours.parameters(), ref.parameters()):
            q.grad = p.grad.detach().clone()
        got = float(opt.clip_grad_norm_(max_norm))
        want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))
        assert want > max_norm and abs(got - want) <= 1e-6 * want, (step, got, want)
        opt.step()
        ref_opt.step()
    err = max_rel_err(list(ours.parameters()), list(ref.parameters()))
    assert err <= RTOL, f"max relative difference {err:.3g} > {RTOL:.3g}"
    before = [p.detach().clone() for p in ours.parameters()]
    opt.zero_grad()
    zhelpers.loss_of(ours, 99).backward()
    next(ours.parameters()).grad.view(-1)[3] = float("nan")
    assert float(opt.clip_grad_norm_(max_norm)) == float("inf")
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, ours.parameters()))
    assert all(int(s["step"]) == 30 for s in opt.state_dict()["state"].values())
    with pytest.raises(RuntimeError, match="non-finite .*error_if_nonfinite=True"):
        opt.clip_grad_norm_(max_norm, error_if_nonfinite=True)
    with pytest.raises(ValueError, match="norm_type=1.0: the daemon computes the L2 norm"):
        opt.clip_grad_norm_(max_norm, norm_type=1.0)
    with pytest.raises(ValueError, match="max_norm must be a positive number"):
        opt.clip_grad_norm_(0.0)
    # The refused calls left no skip or coefficient behind: this step is taken, unclipped.
    next(ours.parameters()).grad.view(-1)[3] = 0.0
    opt.step()
    assert all(int(s["step"]) == 31 for s in opt.state_dict()["state"].values())
    opt.close()
