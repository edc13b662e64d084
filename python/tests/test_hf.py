"""zoffload.torch.AdamW inside Hugging Face's Trainer and Accelerate (examples/hf_trainer.py:
a 2-layer GPT-2 from a config, cosine schedule, clipping at 1.0, nothing downloaded).

Skipped, saying so, where transformers or accelerate is not importable (Debian's torch 1.13
has neither; the torch 2.x venv of python/requirements-lock.txt has both).

Tolerance against torch.optim.AdamW: the daemon's update differs from torch's by a few ulps a
step (test_numerics.py), and training feeds that back through the loss.  Measured over 30
steps: at most 8.1e-8 relative on any step's loss.  LOSS_RTOL = 1e-5 leaves a hundred times
that, while a schedule that is not followed, a missing clip or another weight decay moves the
loss by more than 1e-3 within those steps.  Resumes are bit for bit: the same process, the
same batches, and the state restored exactly.
"""
import os
import subprocess
import sys

import pytest
import torch

import zhelpers

transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                   "for this interpreter")
accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed for this "
                                 "interpreter")

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
sys.path.insert(0, EXAMPLES)
import hf_trainer  # noqa: E402

LOSS_RTOL = 1e-5


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_trainer_matches_torch(daemon, tmp_path):
    ours, lo = hf_trainer.train(str(tmp_path / "z"), 30, socket=daemon.socket, job="hf-cmp")
    _, lt = hf_trainer.train(str(tmp_path / "t"), 30, optimizer="torch")
    assert sorted(lo) == sorted(lt) == list(range(1, 31))
    worst = max(abs(lo[k] - lt[k]) / abs(lt[k]) for k in lt)
    assert worst <= LOSS_RTOL, f"losses differ from torch's by {worst:.3g}"
    assert lo[30] < lo[1] - 0.5, "the loss did not go down"
    # The schedule reached the daemon: the last groups' lr is the cosine's, not the start's.
    assert ours.optimizer.param_groups[0]["lr"] < 1e-4
    ours.optimizer.optimizer.close()


def test_trainer_resume_bit_for_bit(daemon, tmp_path):
    out = str(tmp_path / "run")
    whole, lw = hf_trainer.train(out, 30, socket=daemon.socket, job="hf-whole", save_steps=10)
    whole.optimizer.optimizer.close()
    saved = torch.load(os.path.join(out, "checkpoint-10", "optimizer.pt"))
    assert all(float(s["step"]) == 10 and "exp_avg_sq" in s for s in saved["state"].values())
    resumed, lr = hf_trainer.train(out, 30, socket=daemon.socket, job="hf-resumed",
                                   save_steps=10, resume_from=os.path.join(out, "checkpoint-10"))
    assert same(params(resumed.model), params(whole.model)), "the resumed run differs"
    assert all(lr[k] == lw[k] for k in range(11, 31))
    resumed.optimizer.optimizer.close()


def accelerate_run(sock, job, steps, save_at=None, load_from=None, state_dir=None):
    from accelerate import Accelerator

    import zoffload.torch as zt

    acc = Accelerator(cpu=True)
    model, data = hf_trainer.build(seed=1)
    opt = zt.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, job=job, socket=sock)
    dl = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)
    model, opt, dl = acc.prepare(model, opt, dl)
    first = 0
    if load_from:
        acc.load_state(load_from)
        first = save_at
        dl = acc.skip_first_batches(dl, first)
    for step, b in enumerate(dl, start=first + 1):
        loss = model(**b).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step == save_at and not load_from:
            acc.save_state(state_dir)
        if step == steps:
            break
    got = params(acc.unwrap_model(model))
    opt.optimizer.close()
    return got


def test_accelerate_save_and_load_state(daemon, tmp_path):
    state = str(tmp_path / "acc")
    whole = accelerate_run(daemon.socket, "acc-whole", 20, save_at=8, state_dir=state)
    resumed = accelerate_run(daemon.socket, "acc-resumed", 20, save_at=8, load_from=state)
    assert same(resumed, whole), "accelerate's load_state did not resume bit for bit"


def torchrun(*args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", os.path.join(EXAMPLES, "hf_trainer.py"), *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=zhelpers.HANG_S)
    assert r.returncode == 0, r.stderr[-4000:]


def test_trainer_ddp_two_processes(daemon, tmp_path):
    """DDP over gloo: each rank keeps its own copy of the state in the daemon.  The Trainer
    saves rank 0's alone (optimizer.pt); since DDP all-reduces the gradients every rank's
    state is the same, so that file is the whole state, and a resume loads it into both."""
    out, first, again = tmp_path / "ddp", tmp_path / "first.pt", tmp_path / "again.pt"
    torchrun("--socket", daemon.socket, "--steps", 20, "--save-steps", 10, "--output-dir", out,
             "--params-out", first)
    r0, r1 = torch.load(f"{first}.rank0"), torch.load(f"{first}.rank1")
    assert same(r0, r1), "the ranks' parameters drifted apart"
    saved = torch.load(out / "checkpoint-10" / "optimizer.pt")
    assert len(saved["state"]) == len(r0)
    torchrun("--socket", daemon.socket, "--steps", 20, "--save-steps", 10, "--output-dir", out,
             "--resume-from", out / "checkpoint-10", "--params-out", again)
    assert same(torch.load(f"{again}.rank0"), r0), "rank 0 did not resume bit for bit"
    assert same(torch.load(f"{again}.rank1"), r1), "rank 1 did not resume bit for bit"
