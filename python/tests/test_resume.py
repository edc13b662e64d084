"""When a new process goes on from the state a dead one left in the daemon, and when it must not.

The rule (zoffload.torch's docstring, README): a new process takes a dead process's state only
when that is surely the same run: resume=True, or torchrun restarted this run's workers
(TORCHELASTIC_RESTART_COUNT >= 1).  resume=False frees it.  Otherwise the constructor refuses,
naming the job and the step, and leaves the state as it was.  A load_state_dict after a
takeover restores what the user loaded.  torchrun without a run id ("none") gets a job name of
its own per launch.  Each test is written from the user's side and compares parameters bit for
bit against an uninterrupted run of the same script (same seed, same batches).
"""
import os
import subprocess
import sys

import pytest
import torch

import zhelpers
import zoffload.torch as zt
from test_dist import free_port
from test_state import open_again

WORKER = os.path.join(os.path.dirname(__file__), "worker.py")
LR = 2e-3           # worker.LR


def run_worker(*args, env=None, expect=0):
    r = subprocess.run([sys.executable, WORKER, *map(str, args)], capture_output=True,
                       text=True, timeout=zhelpers.HANG_S, env=env)
    assert r.returncode == expect, r.stderr
    return r.stdout


def uninterrupted(sock, tmp_path, steps):
    out = tmp_path / f"whole{steps}.pt"
    run_worker("train", sock, "whole", steps, out)
    return torch.load(out)


def same_params(m, want):
    return all(torch.equal(p.detach(), q) for p, q in zip(m.parameters(), want))


def test_default_refuses_and_leaves_the_state(daemon, tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    after5 = tmp_path / "after5.pt"
    run_worker("train", daemon.socket, "dead", 10, after5, 5, expect=-9)
    m = zhelpers.model(seed=999)
    mine = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(RuntimeError, match="job 'dead' rank 0 holds the optimizer state of a "
                       "process that died after step 5.*resume=True.*resume=False"):
        open_again(params=m.parameters(), lr=LR, job="dead", socket=daemon.socket)
    # Refused means untouched: the user's params, and the daemon's state for a later choice.
    assert same_params(m, mine)
    opt = open_again(params=m.parameters(), lr=LR, job="dead", socket=daemon.socket,
                     resume=True)
    assert opt.resumed_step == 5
    assert same_params(m, torch.load(after5))
    zhelpers.train(m, opt, 5, first=6)
    assert same_params(m, uninterrupted(daemon.socket, tmp_path, 10))
    opt.close()


def test_resume_false_frees_the_state(daemon, tmp_path):
    run_worker("train", daemon.socket, "dead2", 10, tmp_path / "x.pt", 3, expect=-9)
    m = zhelpers.model(seed=11)         # the worker's start
    opt = open_again(params=m.parameters(), lr=LR, job="dead2", socket=daemon.socket,
                     resume=False)
    assert opt.resumed_step == 0
    assert all("exp_avg" not in s or not s["exp_avg"].any()
               for s in opt.state_dict()["state"].values())
    zhelpers.train(m, opt, 4)
    assert same_params(m, uninterrupted(daemon.socket, tmp_path, 4))
    opt.close()


@pytest.mark.parametrize("how", ["torchrun-restart", "resume-true", "resume-false"])
def test_nanogpt_resume_restores_what_it_loaded(daemon, tmp_path, monkeypatch, how):
    """nanoGPT's resume: the model's weights from the checkpoint, then the optimizer, then
    its state_dict.  The dead process got to step 5 after saving at step 3: whatever the
    daemon took back, training must go on from step 3's weights and state."""
    ckpt = tmp_path / "ckpt.pt"
    job = "nano-" + how
    run_worker("nanogpt", daemon.socket, job, 3, 5, ckpt, expect=-9)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    kw = {}
    if how == "torchrun-restart":
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    else:
        kw["resume"] = how == "resume-true"
    saved = torch.load(ckpt)
    m = zhelpers.model(seed=999)
    m.load_state_dict(saved["model"])
    opt = open_again(params=m.parameters(), lr=LR, job=job, socket=daemon.socket, **kw)
    assert opt.resumed_step == (0 if how == "resume-false" else 5)
    opt.load_state_dict(saved["optimizer"])
    assert all(float(s["step"]) == 3 for s in opt.state_dict()["state"].values())
    zhelpers.train(m, opt, 7, first=4)
    assert same_params(m, uninterrupted(daemon.socket, tmp_path, 10)), \
        "the resumed run trained from other weights or state than it loaded"
    opt.close()


def test_torchrun_none_is_not_a_job_name(daemon, monkeypatch):
    monkeypatch.delenv("ZOFFLOAD_JOB", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    with pytest.raises(ValueError, match=r"torchrun gave no run id \(TORCHELASTIC_RUN_ID=none\)"):
        zt.AdamW(zhelpers.model().parameters(), socket=daemon.socket)


def launch(sock, world, steps, kill=False):
    """One torchrun launch without --rdzv-id: world processes, TORCHELASTIC_RUN_ID=none."""
    env = dict(os.environ, TORCHELASTIC_RUN_ID="none")
    env.pop("ZOFFLOAD_JOB", None)
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, "launch", str(rank), str(world),
                               str(port), sock, str(steps)] + (["kill"] if kill else []),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env)
             for rank in range(world)]
    jobs = []
    for rank, p in enumerate(procs):
        out, err = p.communicate(timeout=zhelpers.HANG_S)
        assert p.returncode == (-9 if kill else 0), f"rank {rank}: {err}"
        (line,) = [ln for ln in out.splitlines() if ln.startswith("JOB ")]
        name, resumed = line.split()[1:]
        assert resumed == "0", f"rank {rank} took back state: {line}"
        jobs.append(name)
    return jobs


def test_torchrun_launches_without_run_id_stay_apart(daemon):
    """What happened: every such launch was job 'torchrun-none', so a second, unrelated run
    took the first one's state, and a 2-process run then failed on the job's world size."""
    (first,) = launch(daemon.socket, 1, 3, kill=True)
    (second,) = launch(daemon.socket, 1, 3)
    two = launch(daemon.socket, 2, 3)
    assert two[0] == two[1], "the ranks of one launch must share the job"
    assert len({first, second, two[0]}) == 3, "launches must not share a job"
    assert all(j.startswith("torchrun-") and j != "torchrun-none" for j in [first, second] + two)
