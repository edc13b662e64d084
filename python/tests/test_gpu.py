"""zoffload.torch with the params on a GPU: the copies to and from the slots (grads D2H into
the grad slot, params H2D from the param slot, both slots cudaHostRegister'ed) on real CUDA,
alone and under FSDP2 (fully_shard) over NCCL, with and without CPUOffloadPolicy.

Runs only where torch sees a GPU (benchmarks/device/run.sh runs it there); skipped, and said
so, elsewhere: the CPU machines that run the test suite have none, and test_cuda_pins.py covers
the registrations there against a stand-in of torch's cudart.

Numerics: ours and torch.optim.AdamW on a copy of the model take the very same grads each
step, so only the update differs; test_numerics's RTOL (2**-18, 32 ulps of fp32) and its
reasoning apply.  The reference steps on the GPU (torch's CUDA kernels: the same formula,
its own op order), ours on the CPU.
"""
import copy

import pytest
import torch

from test_numerics import RTOL, max_rel_err
import zhelpers
import zoffload.torch as zt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no GPU (torch.cuda.is_available() is False)")

STEPS = 30


def test_cuda_params_lockstep(daemon):
    torch.manual_seed(0)
    ours = zhelpers.TinyTransformer().cuda()
    ref = copy.deepcopy(ours)
    opt = zt.AdamW(ours.parameters(), lr=2e-3, weight_decay=0.05, job="gpu-params",
                   socket=daemon.socket)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=2e-3, weight_decay=0.05)
    first = None
    for step in range(STEPS):
        opt.zero_grad()
        ref_opt.zero_grad()
        x, y = (t.cuda() for t in zhelpers.batch(step))
        logits = ours(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 y.reshape(-1))
        first = float(loss) if first is None else first
        loss.backward()
        for p, q in zip(ours.parameters(), ref.parameters()):
            q.grad = p.grad.detach().clone()
        opt.step()
        ref_opt.step()
    got, want = list(ours.parameters()), list(ref.parameters())
    assert all(p.is_cuda for p in got)
    err = max_rel_err(got, want)
    assert err <= RTOL, f"params: max relative difference {err:.3g} > {RTOL:.3g}"
    # The moments, read back from the daemon, against the reference's on the GPU.
    so, sr = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    for i in sr:
        assert float(so[i]["step"]) == float(sr[i]["step"]) == STEPS
        for key in ("exp_avg", "exp_avg_sq"):
            err = max_rel_err([so[i][key].cpu()], [sr[i][key].cpu()])
            assert err <= RTOL, f"param {i} {key}: max relative difference {err:.3g}"
    x, y = (t.cuda() for t in zhelpers.batch(0))
    with torch.no_grad():
        logits = ours(x)
        last = float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                       y.reshape(-1)))
    assert first - last > 0.05, f"the loss barely moved: {first} -> {last}"
    opt.close()


@pytest.mark.parametrize("offload", ["offload", "mesh"])
def test_fsdp2_on_the_gpu(daemon, tmp_path, monkeypatch, offload):
    """fsdp2_worker's train on one GPU over NCCL: with CPUOffloadPolicy (pinned CPU shards,
    copied to and from the slots on the CPU) and without it (shards on the GPU: the copies
    to and from the registered slots), 50 steps in lockstep with torch.optim.AdamW under the
    same FSDP2."""
    test_fsdp2 = pytest.importorskip("test_fsdp2")
    if not test_fsdp2.HAVE_FSDP2:
        pytest.skip(f"torch {torch.__version__} has no FSDP2")
    monkeypatch.setenv("ZOFFLOAD_TEST_DEVICE", "cuda")
    out = tmp_path / "r.pt"
    test_fsdp2.launch(1, daemon.socket, "train", f"gpu-fsdp2-{offload}", out, offload,
                      "default", test_fsdp2.STEPS)
    r = torch.load(out, weights_only=False, map_location="cpu")
    test_fsdp2.check_lockstep(r)
    test_fsdp2.check_clip(r)
    stats, n = r["copy_stats"][0], len(r["ours"])
    print(f"{offload}: copy_stats {stats}")
    # Neither shard is a slot's view, so every step copies each one in: on the GPU (mesh),
    # and pinned by FSDP2 (offload: a view would be a private mapping, pageable, under the
    # all-gather's non_blocking copies).
    why = "not a CPU tensor" if offload == "mesh" else "FSDP2 pins its shard"
    assert stats["params_viewed"] == 0 and stats["fallbacks"] == {why: n}, stats
    assert stats["param_copies"] == n * test_fsdp2.STEPS, stats
