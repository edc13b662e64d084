"""ZeroRedundancyOptimizer(optimizer_class=zoffload.torch.AdamW) over gloo: 2 processes on one
daemon, and 4 processes over two daemons (two sockets standing for two nodes), each against a
single process; every rank takes the same batches, so gradients agree without DDP and the
sharded run must match the single one bit for bit (the update is per element).  And
DistributedDataParallel over gloo, each rank on its own batches (test_ddp_...)."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from test_numerics import RTOL, max_rel_err
import zhelpers
import zoffload
import zoffload.torch

WORKER = os.path.join(os.path.dirname(__file__), "worker.py")
STEPS = 8


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(mode, sockets, *args):
    """worker.py MODE RANK WORLD PORT SOCKET ARGS... for every rank of len(sockets), each on
    its socket; every one must exit 0.  Returns their outputs."""
    port = free_port()
    world = len(sockets)
    procs = [subprocess.Popen([sys.executable, WORKER, mode, str(rank), str(world), str(port),
                               sockets[rank], *map(str, args)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    outputs = [p.communicate(timeout=zhelpers.HANG_S)[0] for p in procs]
    for rank, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank}: {text}"
    return outputs


def run_zero(sockets, job, out, steps=STEPS, ckpt=()):
    world = len(sockets)
    outputs = run_ranks("zero", sockets, job, steps, out, *ckpt)
    jobs = [json.loads(line[5:]) for text in outputs for line in text.splitlines()
            if line.startswith("JOBS ")]
    assert len(jobs) == world
    return torch.load(out), jobs


def single(sock, tmp_path):
    out = tmp_path / "single.pt"
    r = subprocess.run([sys.executable, WORKER, "train", sock, "single", str(STEPS), str(out)],
                       capture_output=True, text=True, timeout=zhelpers.HANG_S)
    assert r.returncode == 0, r.stderr
    return torch.load(out)


def check_same(got, want):
    for a, b in zip(got["params"], want):
        assert torch.equal(a, b), "sharded run differs from the single process"
    state = got["state"]["state"]
    assert len(state) == len(want)
    assert all(float(s["step"]) == STEPS for s in state.values())


def job_seen(jobs, name):
    (job,) = [j for j in jobs["jobs"] if j["name"] == name]
    return job


def test_zero_two_ranks(daemon, tmp_path):
    got, jobs = run_zero([daemon.socket] * 2, "zero2", tmp_path / "zero2.pt")
    check_same(got, single(daemon.socket, tmp_path))
    job = job_seen(jobs[0], "zero2")
    assert job["world_size"] == 2 and job["ranks_attached"] == 2
    assert job["last_step"] == STEPS


def test_zero_four_ranks_two_daemons(make_daemon, tmp_path):
    a, b = make_daemon(), make_daemon()
    # Ranks 0-1 on the first "node", 2-3 on the second; each talks to its own daemon.
    got, jobs = run_zero([a.socket, a.socket, b.socket, b.socket], "zero4", tmp_path / "z4.pt")
    check_same(got, single(a.socket, tmp_path))
    for rank, seen in enumerate(jobs):
        job = job_seen(seen, "zero4")
        # Each daemon holds its own node's two ranks of the world of four, and their shards.
        assert job["world_size"] == 4 and job["ranks_attached"] == 2, (rank, job)
        assert job["steps_applied"] > 0 and job["tensors"] > 0
    shard_a = job_seen(jobs[0], "zero4")["params"]
    shard_b = job_seen(jobs[2], "zero4")["params"]
    assert shard_a + shard_b == sum(p.numel() for p in got["params"])


def test_zero_checkpoint_into_one_process(daemon, tmp_path):
    """Two ZeroRedundancyOptimizer ranks save their shards under the model's names; one
    process (world size 1) restores them and goes on, bit for bit as the single run."""
    half = STEPS // 2
    ckpt = tmp_path / "ckpt"
    run_zero([daemon.socket] * 2, "zero-ckpt", tmp_path / "zc.pt", steps=half, ckpt=[ckpt])
    assert sorted(f for f in os.listdir(ckpt) if not f.startswith(".")) == [
        "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors",
        "zoffload-torch-rank-00000-of-00002.json", "zoffload-torch-rank-00001-of-00002.json"]
    m = zhelpers.model(seed=12)
    opt = zoffload.torch.AdamW(m.parameters(), lr=1.0, job="zero-ckpt-one",
                               socket=daemon.socket)
    assert opt.load_checkpoint(ckpt, names={p: n for n, p in m.named_parameters()}) == half
    assert opt.param_groups[0]["lr"] == 2e-3
    zhelpers.train(m, opt, STEPS - half, first=half + 1)
    want = single(daemon.socket, tmp_path)
    for a, b in zip(m.parameters(), want):
        assert torch.equal(a.detach(), b), "restored run differs from the single process"
    opt.close()


@pytest.mark.parametrize("bucket_view", [False, True])
def test_ddp_gradients_are_the_ranks_mean(daemon, tmp_path, bucket_view):
    """Under DDP the step takes the gradients DDP averaged over the ranks, whether p.grad is
    the grad slot (made so in backward, where torch has post-accumulate-grad hooks: DDP
    copies the mean into it) or DDP's bucket (gradient_as_bucket_view: DDP makes p.grad its
    bucket after the hook made it the slot, so the hook stops for that param after the first
    step, and step() copies the bucket in).  Against torch.optim.AdamW taking the same
    gradients, each first checked against the mean of every rank's own (1e-6: the same
    fp32 sum in another order), to test_numerics's RTOL."""
    steps, out = 6, tmp_path / "ddp.pt"
    run_ranks("ddp", [daemon.socket] * 2, f"ddp-{bucket_view}", steps,
              "1" if bucket_view else "0", out)
    r = torch.load(out)
    assert r["grad_err"] <= 1e-6, f"gradients differ from the ranks' mean by {r['grad_err']:.3g}"
    err = max_rel_err(r["ours"], r["ref"])
    assert err <= RTOL, f"params: max relative difference {err:.3g} > {RTOL:.3g}"
    n = len(r["ours"])
    hooks = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")
    copies = r["stats"]["grad_copies"]
    if not bucket_view:
        # torch 2.x's zero_grad() sets the grads to None: the hook copies each backward's
        # into the slot.  1.13's zeroes p.grad, the slot from the first step on, in place.
        want = [n] * steps if hooks else [0] + [n] * (steps - 1)
        assert r["slot_after_backward"] == want, r["slot_after_backward"]
        assert copies == (n * steps if hooks else n), r["stats"]
    else:
        assert r["slot_after_backward"] == [0] * steps, r["slot_after_backward"]
        # The hook's one wasted copy a param (torch >= 2.1), then step()'s from the bucket.
        assert copies == n * steps + (n if hooks else 0), r["stats"]
    assert r["slot_after_step"] == [n] * steps, r["slot_after_step"]
