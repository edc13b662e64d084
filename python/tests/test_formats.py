"""state_format= on the zoffload.torch optimizers, against the same optimizer on fp32 state.

The compressed formats round the moments to 16 or 8 bits every step, so they cannot match
fp32 state to the ulp as test_numerics does against torch: what must hold is training.  The
tiny transformer of zhelpers (seed 1, batches of seed 1000 + step) is trained for STEPS
steps on fp32 state and on each format, fed the same batches; the loss over fresh batches
(steps 10001..10008) must come within 2% of fp32 state's, and the params must have moved the
same way (their distance from fp32 state's a small part of how far training moved them).
"""
import pytest
import torch

import zhelpers
import zoffload.torch as zt

STEPS = 60
FORMATS = ["bf16-moments", "q8-moments", "bf16-master+q8"]


def eval_loss(m):
    with torch.no_grad():
        return sum(zhelpers.loss_of(m, 10000 + s).item() for s in range(1, 9)) / 8


def trained(daemon, cls, fmt, job, **kw):
    m = zhelpers.model(seed=1)
    opt = cls(m.parameters(), job=job, socket=daemon.socket, state_format=fmt, lr=3e-3, **kw)
    zhelpers.train(m, opt, STEPS)
    return m, opt


def distance(a, b):
    return max(((p - q).abs().max() / q.abs().max()).item()
               for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("cls", [zt.AdamW, zt.Adam])
@pytest.mark.parametrize("fmt", FORMATS)
def test_trains_like_fp32_state(daemon, cls, fmt):
    ref, ref_opt = trained(daemon, cls, "fp32", f"ref-{cls.__name__}-{fmt}")
    ours, opt = trained(daemon, cls, fmt, f"{fmt}-{cls.__name__}")
    assert ref_opt.state_format == "fp32"
    assert opt.state_format == fmt
    start = zhelpers.model(seed=1)
    base, got, want = eval_loss(start), eval_loss(ours), eval_loss(ref)
    assert want < 0.95 * base, f"fp32 state did not train ({base:.4f} -> {want:.4f})"
    assert abs(got - want) <= 0.02 * want, f"{fmt}: loss {got:.4f}, fp32 state {want:.4f}"
    moved = distance(ref, start)
    assert distance(ours, ref) < 0.25 * moved, (
        f"{fmt}: params {distance(ours, ref):.3g} from fp32 state's, which moved {moved:.3g}")
    # The moments read back as fp32 and point where fp32 state's do (the trajectories
    # differ by now, so not to the bit): cosine similarity over all of exp_avg.
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    a = torch.cat([st["exp_avg"].reshape(-1) for st in sd["state"].values()])
    b = torch.cat([ref_sd["state"][k]["exp_avg"].reshape(-1) for k in sd["state"]])
    assert a.dtype == torch.float32 and a.shape == b.shape
    cos = (a @ b / (a.norm() * b.norm())).item()
    assert cos > 0.9, f"{fmt}: exp_avg has cosine {cos:.3f} with fp32 state's"
    opt.close()
    ref_opt.close()


def test_the_daemon_default(make_daemon):
    d = make_daemon(config={"memory": {"state_format": "q8-moments"}})
    m = zhelpers.model(seed=1)
    opt = zt.AdamW(m.parameters(), job="dflt", socket=d.socket)
    assert opt.state_format == "q8-moments"
    zhelpers.train(m, opt, 2)
    opt.close()


def test_bad_name_lists_the_formats(daemon):
    m = zhelpers.model(seed=1)
    with pytest.raises(zt.ZoffloadError, match="int4.*fp32.*bf16-moments.*q8-moments"):
        zt.AdamW(m.parameters(), job="bad", socket=daemon.socket, state_format="int4")


def test_optimizer_without_a_kernel_is_refused(daemon):
    m = zhelpers.model(seed=1)
    opt = zt.Lion(m.parameters(), job="lion", socket=daemon.socket, state_format="q8-moments")
    with pytest.raises(zt.ZoffloadError, match="q8-moments.*lion"):
        zhelpers.train(m, opt, 1)
    opt.close()


def test_nvme_tier(make_daemon):
    """The same training through the NVMe tier's chunks gives the pinned tier's params."""
    d = make_daemon(swap=True)
    pinned, popt = trained(d, zt.AdamW, "q8-moments", "pin", policy="cpu")
    nvme, opt = trained(d, zt.AdamW, "q8-moments", "nvme", policy="nvme")
    for p, q in zip(nvme.parameters(), pinned.parameters()):
        assert torch.equal(p, q)
    opt.close()
    popt.close()


def test_nvme_tier_bf16_master(make_daemon):
    """bf16-master+q8's stochastic rounding follows the element, not the chunk: the same bits."""
    d = make_daemon(swap=True)
    pinned, popt = trained(d, zt.AdamW, "bf16-master+q8", "pin", policy="cpu")
    nvme, opt = trained(d, zt.AdamW, "bf16-master+q8", "nvme", policy="nvme")
    for p, q in zip(nvme.parameters(), pinned.parameters()):
        assert torch.equal(p, q)
    # The params are the bf16 master: every value is a bf16 value.
    for p in nvme.parameters():
        assert torch.equal(p.detach().to(torch.bfloat16).to(p.dtype), p.detach())
    opt.close()
    popt.close()
