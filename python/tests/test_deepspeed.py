"""DeepSpeed's ZeRO (stages 1, 2, 3, offload_optimizer on the CPU) with zoffloadd holding the
optimizer (zoffload.deepspeed.initialize), on DeepSpeed's CPU accelerator over gloo, in 1 and
2 processes: against the same runs with DeepSpeed's own DeepSpeedCPUAdam, and
engine.save_checkpoint / load_checkpoint in a new process group bit for bit.  The cases are
ds_worker.py's CASES; each launch runs all of them in one process group (DeepSpeed's import
and start cost more than the runs).

Skipped, saying so, where deepspeed is not importable (Debian's torch 1.13 interpreter).

Tolerance against DeepSpeedCPUAdam: both keep an fp32 master and fp32 moments and get the
same gradients on the first step, but DeepSpeed's AVX kernel orders the update's operations
otherwise (its bias corrections folded into the step size, FMAs), a few ulps a step apart
from the daemon's (test_numerics.py measures 3 ulps against torch's), and training feeds the
difference back through the loss for 50 steps.  Measured (1 and 2 processes, every case): at
most 2e-7 relative on any step's loss and 3e-6 of a tensor's largest value on the final
params.  LOSS_RTOL and PARAM_RTOL leave ten times that; a wrong hyperparameter, a missed
clip or a micro-batch lost from the accumulation moves both by more than 1e-3 within these
steps.  One slice is left out of the param check: the attention's key bias (the middle third
of in_proj_bias), whose gradient is zero in exact arithmetic (softmax does not change when
every key moves alike), so that each Adam turns its rounding noise into steps of up to lr of
either sign: 1e-3 apart between the two, of no meaning.
"""
import os
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("deepspeed", reason="deepspeed is not installed for this interpreter")

import ds_worker  # noqa: E402
import zhelpers  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "ds_worker.py")
LOSS_RTOL = 2e-6
PARAM_RTOL = 3e-5
KEY_BIAS = "layer.self_attn.in_proj_bias"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world, sock, out, mode, ckpt):
    port = free_port()
    env = dict(os.environ)
    # Where the project's machines keep DeepSpeed's built CPU Adam op (it compiles for
    # minutes otherwise); a TORCH_EXTENSIONS_DIR of the environment wins.
    env.setdefault("TORCH_EXTENSIONS_DIR", "/root/.cache/zoffload/torch-extensions")
    procs = [subprocess.Popen([sys.executable, WORKER, str(rank), str(world), str(port), sock,
                               str(out), mode, str(ckpt)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for rank, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} of {world}: {text[-6000:]}"
    return torch.load(out)


def without_key_bias(params):
    names = [n for n, _ in zhelpers.model().named_parameters()]
    out = []
    for name, p in zip(names, params):
        if name == KEY_BIAS:
            d = p.numel() // 3
            p = torch.cat([p[:d], p[2 * d:]])
        out.append(p)
    return out


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("world", [1, 2])
def test_zero_stages_against_deepspeed_cpu_adam_and_resume(daemon, tmp_path, world):
    ckpt = tmp_path / "ckpt"
    got = launch(world, daemon.socket, tmp_path / "all.pt", "all", ckpt)
    worst = {}
    for case in ds_worker.CASES:
        ours, ref = got[f"{case}/ours"], got[f"{case}/ref"]
        assert len(ours["losses"]) == ds_worker.STEPS
        lw = max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], ref["losses"]))
        pw = max(rel_err(a, b) for a, b in zip(without_key_bias(ours["params"]),
                                                 without_key_bias(ref["params"])))
        worst[case] = (lw, pw)
        assert ours["losses"][-1] < ours["losses"][0] - 0.05, f"{case}: the loss did not go down"
    print(f"world {world}: worst relative (loss, param) difference from DeepSpeedCPUAdam: "
          f"{worst}")
    assert all(lw <= LOSS_RTOL and pw <= PARAM_RTOL for lw, pw in worst.values()), worst
    resumed = launch(world, daemon.socket, tmp_path / "resumed.pt", "resume", ckpt)
    for case, c in ds_worker.CASES.items():
        if not c["ckpt"]:
            continue
        whole, again = got[f"{case}/ours"], resumed[f"{case}/resumed"]
        assert again["losses"] == whole["losses"][ds_worker.CKPT_AT:], \
            f"{case}: the resumed losses differ"
        for a, b in zip(again["params"], whole["params"]):
            assert torch.equal(a, b), f"{case}: the resumed run differs from the whole one"
