"""FSDP2 (torch.distributed.fsdp.fully_shard) with zoffload.torch.AdamW: every rank steps its
own shard of each DTensor param in the daemon.  Processes over gloo on the CPU, each one a
rank of fsdp2_worker.py; a small transformer whose dims shard unevenly over 2, 3 and 4 ranks
(and a param of 2 rows: none of it on the last rank over 3, on the last two over 4).

Numerics: the zoffload run and torch.optim.AdamW on a second FSDP2 copy of the model go in
lockstep, the reference taking the zoffload run's (clipped) DTensor grads, so that only the
update differs: test_numerics's RTOL (2**-18, 32 ulps of fp32) and reasoning apply, over 50
steps.  Measured here: under 3e-7 for params and moments, a tenth of it.  The final losses,
each forward through FSDP2's all-gather, show that what the step wrote into each rank's shard
is what FSDP2 computes with.

Without CPUOffloadPolicy on a CPU run, the sharded params live on the mesh's device, the CPU:
the same CPU-tensor path as with it (what differs is FSDP2's own copies, not ours).  Either
way an unpadded shard is its param slot's view (copy_stats() says which, and that no step
copied them out), and after close() FSDP2's forward gives the same loss from shards of its
own again.  The GPU path (shards on the GPU, copies to and from the slots) is not run here.

Skipped (and said so) under a torch without fully_shard (1.13).
"""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from test_numerics import RTOL, max_rel_err
import zhelpers

try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401
    HAVE_FSDP2 = True
except (ImportError, ValueError):
    # 1.13 has none; its torch.distributed.fsdp does not even import under Python 3.11
    # (a dataclass default that 3.11 refuses: ValueError).
    HAVE_FSDP2 = False

pytestmark = pytest.mark.skipif(not HAVE_FSDP2, reason=f"torch {torch.__version__} has no "
                                "FSDP2 (torch.distributed.fsdp.fully_shard)")

WORKER = os.path.join(os.path.dirname(__file__), "fsdp2_worker.py")
STEPS = 50
MAX_NORM = 0.25         # fsdp2_worker's: below every step's norm here, so every step clips


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world, sock, mode, job, out, *args):
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, WORKER, mode, str(rank), str(world), port, sock,
                               job, str(out), *map(str, args)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=zhelpers.HANG_S)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for rank, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} of {world}: {text[-4000:]}"
    return outputs


def check_lockstep(r):
    check_params_and_state(r)
    # The params moved.
    first, (got, want) = r["first_loss"], r["final_loss"]
    assert first - want > 0.05, f"the loss barely moved: {first} -> {want}"
    # The same forward once the optimizer is closed: the shards it viewed kept their values.
    assert r["loss_after_close"] == got, (r["loss_after_close"], got)


def check_params_and_state(r):
    """Ours and the reference: the same params and moments to RTOL, STEPS steps each, and
    FSDP2's forward sees what the step wrote into the shards (the final losses)."""
    ours, ref = r["ours"], r["ref"]
    assert list(ours) == list(ref)
    err = max_rel_err([ours[k] for k in ours], [ref[k] for k in ours])
    assert err <= RTOL, f"params: max relative difference {err:.3g} > {RTOL:.3g}"
    so, sr = r["ours_state"]["state"], r["ref_state"]["state"]
    assert list(so) == list(sr) == list(ours)
    for name in so:
        assert float(so[name]["step"]) == float(sr[name]["step"]) == STEPS, name
        for key in ("exp_avg", "exp_avg_sq"):
            err = max_rel_err([so[name][key]], [sr[name][key]])
            assert err <= RTOL, f"{name}.{key}: max relative difference {err:.3g}"
    got, want = r["final_loss"]
    assert abs(got - want) <= 1e-5 * want, f"FSDP2's forward: loss {got}, torch's {want}"


def check_clip(r):
    # clip_grad_norm_ on the DTensor grads: the norm of the gathered full grads (fp64 here;
    # fp32 sums there: 1e-6), and the grads the step took are scaled to MAX_NORM.
    got, want = r["first_norm"]
    assert want > MAX_NORM and all(n > MAX_NORM for n in r["norms"]), "no step clipped"
    assert abs(got - want) <= 1e-6 * want, (got, want)
    assert abs(r["clipped_norm"] - MAX_NORM) <= 1e-5 * MAX_NORM, r["clipped_norm"]


def the_job(r, name):
    (job,) = [j for j in json.loads(r["jobs"])["jobs"] if j["name"] == name]
    return job


def test_two_ranks_cpu_offload(daemon, tmp_path):
    out = tmp_path / "r.pt"
    launch(2, daemon.socket, "train", "fsdp2-2", out, "offload", "default", STEPS)
    r = torch.load(out, weights_only=False)
    check_lockstep(r)
    check_clip(r)
    # The daemon holds each rank's shard, not the whole params twice: rank 0's shard has
    # the larger half of every uneven dim 0 (37 rows: 19 and 18).
    total = sum(v.numel() for v in r["ours"].values())
    job = the_job(r, "fsdp2-2")
    assert job["params"] == total and job["tensors"] == 2 * len(r["ours"])
    assert r["local_numels"][list(r["ours"]).index("head.bias")] == 19
    # Each shard FSDP2 keeps unpadded is its param slot's view, so no step copies it out:
    # all of rank 0's (the larger part of an uneven dim 0 is the padded size); rank 1's
    # shards of an odd dim 0 (18 of 19 rows) are padded, so copied after every step.
    padded = sum(1 for v in r["ours"].values() if v.shape[0] % 2)
    first, last = r["copy_stats"]
    assert first["params_viewed"] == len(r["ours"]) and first["param_copies"] == 0, first
    assert not first["fallbacks"], first
    assert padded and last["fallbacks"] == {"padded shard": padded}, last
    assert last["params_viewed"] == len(r["ours"]) - padded, last
    assert last["param_copies"] == padded * STEPS, last


def test_overlap_steps_each_shard_in_backward(daemon, tmp_path):
    """overlap=True under FSDP2: every shard's step is submitted from its post-accumulate-grad
    hook, which FSDP2 calls after the module's reduce-scatter, so each is in flight before
    step() is called; the unpadded shards stay their slots' views; micro-batches accumulated
    without a reduce-scatter step once; the run keeps lockstep with torch's AdamW (RTOL, as
    above: the same grads, only the update differs)."""
    out = tmp_path / "r.pt"
    launch(2, daemon.socket, "overlap", "fsdp2-overlap", out, STEPS)
    r = torch.load(out, weights_only=False)
    check_params_and_state(r)
    ours = r["ours"]
    padded = sum(1 for v in ours.values() if v.shape[0] % 2)
    (n0, first), (n1, last) = r["copy_stats"]
    # Rank 0 holds every param; every shard of every step went from backward's hooks.
    assert n0 == len(ours) and r["in_flight"] == [n0] * STEPS, r["in_flight"]
    assert first["steps_in_backward"] == n0 * STEPS, first
    assert last["steps_in_backward"] == n1 * STEPS, last
    assert first["params_viewed"] == n0 and first["param_copies"] == 0, first
    assert last["fallbacks"] == {"padded shard": padded}, last
    assert last["param_copies"] == padded * STEPS, last
    assert "set_requires_gradient_sync(False)" in (r["second_backward"] or ""), r
    # Clipped after backward had handed the grads over: refused, not silently unclipped.
    assert "changed after backward handed them" in (r["clipped_after"] or ""), r


@pytest.mark.parametrize("world", [2, 1])
def test_reduce_scatter_lands_in_the_grad_slots(daemon, tmp_path, world):
    """FSDP2's reduce-scatter writes the sharded gradients straight into the grad slots
    (zoffload/_graft.py): after the first step, which learns each module's layout and copies
    as before, only w (off a page boundary of its module's output) is copied; an unpadded and
    a padded shard, a second synced backward (added into the grafted gradients) and a
    zero_grad(set_to_none=False) step (whose reduce-scatter cannot go into gradients still
    held) keep lockstep with torch's AdamW (RTOL, as above), and the grads are those of
    FSDP2's own reduce-scatter on the reference.  A world of one has no reduce-scatter:
    FSDP2 copies its input buffer into its output, and both are the graft."""
    out = tmp_path / "r.pt"
    launch(world, daemon.socket, "graft", f"fsdp2-graft{world}", out, STEPS)
    r = torch.load(out, weights_only=False)
    check_params_and_state(r)
    params = len(r["ours"])
    for stats, grad_err in r["copy_stats"]:
        # The reference's params are ours to RTOL, not bit for bit, and its grads follow
        # them smoothly (measured: 1.5e-6); a reduce-scatter lost or added twice is O(1).
        assert grad_err <= 1e-4, f"grads differ from FSDP2's own by {grad_err:.3g} (relative)"
        # Step 1: every gradient; then w's alone.
        assert stats["grad_copies"] == params + (STEPS - 1), stats
        # Four modules' outputs grafted at every step from the second, but step 4.
        assert stats["reduce_scatters_into_slots"] == 4 * (STEPS - 2), stats


def test_example_with_overlap_trains(make_daemon):
    """examples/fsdp2_train.py --overlap under torchrun, 2 ranks, part of the state on the
    swap directory: the loss falls, every step is applied, and --overlap with clipping is
    refused by name."""
    d = make_daemon(swap=True)
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "fsdp2_train.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), example, "--socket", d.socket, "--job",
           "example-overlap", "--steps", "40", "--overlap", "--clip", "none"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=zhelpers.HANG_S)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    losses = [float(line.split("train loss")[1].split()[0])
              for line in out.stdout.splitlines() if "train loss" in line]
    assert len(losses) == 2 and losses[-1] < losses[0] - 0.3, out.stdout
    # The job's line: every tensor (each rank's shards) stepped 40 times, part on NVMe.
    (job,) = [line for line in out.stdout.splitlines() if line.startswith("zoffloadd: job")]
    tensors = int(job.split(" tensors")[0].split()[-1])
    assert f"{tensors * 40} steps applied" in job, job
    assert float(job.split("MiB pinned + ")[1].split()[0]) > 0, job
    refused = subprocess.run([sys.executable, example, "--overlap"], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and "--clip none" in refused.stderr, refused.stderr


def test_four_ranks_on_the_mesh_device_nvme(make_daemon, tmp_path):
    """No CPUOffloadPolicy, and the state on NVMe (policy='nvme'); one param with no rows on
    the last two ranks (2 rows over 4 ranks)."""
    d = make_daemon(swap=True)
    out = tmp_path / "r.pt"
    launch(4, d.socket, "train", "fsdp2-4", out, "mesh", "nvme", STEPS)
    r = torch.load(out, weights_only=False)
    check_lockstep(r)
    check_clip(r)
    job = the_job(r, "fsdp2-4")
    assert job["policy"] == "nvme" and job["nvme_bytes"] > 0 and job["pinned_bytes"] == 0
    assert job["params"] == sum(v.numel() for v in r["ours"].values())
    # 2 rows of the gate: one each on ranks 0-1, none on ranks 2-3, which register nothing.
    assert job["tensors"] == 4 * len(r["ours"]) - 2
    # On the mesh's device (the CPU) the shards are views too: rank 0's, never padded.
    first = r["copy_stats"][0]
    assert first["params_viewed"] == len(r["ours"]) and first["param_copies"] == 0, first


def test_hsdp_four_ranks(daemon, tmp_path):
    """HSDP (a 2-D mesh: 2 replicas of a 2-way shard, CPUOffloadPolicy): each shard stepped
    once, by its replica at coordinate 0, and broadcast to the other; its state through DCP
    and the streaming checkpoint."""
    out = tmp_path / "r.pt"
    launch(4, daemon.socket, "train", "hsdp-4", out, "hsdp", "default", STEPS)
    r = torch.load(out, weights_only=False)
    check_lockstep(r)
    check_clip(r)
    job = the_job(r, "hsdp-4")
    # Once per shard group: two ranks' tensors, each param's elements once.
    assert job["params"] == sum(v.numel() for v in r["ours"].values())
    assert job["tensors"] == 2 * len(r["ours"]) and job["ranks_attached"] == 4
    # The ones at replicate coordinate 0 hold every param's shard, the other replicas none:
    # they have theirs by the broadcast (the lockstep above is over every rank's params).
    held = sorted(r["held"], key=lambda h: h[1])       # by (replicate, shard) coordinate
    assert [(n, c) for n, c, _ in held] == [(len(r["ours"]), (0, 0)), (len(r["ours"]), (0, 1)),
                                            (0, (1, 0)), (0, (1, 1))]
    for (_, _, stepped), (_, _, given) in ((held[0], held[2]), (held[1], held[3])):
        assert all(torch.equal(a, b) for a, b in zip(stepped, given)), \
            "a replica's shard is not its stepping replica's"
    # Saved (DCP; the streaming checkpoint) and restored into a fresh HSDP run, bit for bit.
    assert r["restored"] == {"dcp": True, "own": True}, r["restored"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two ranks train 5 steps and save (DCP, and the streaming checkpoint), then 5 more;
    a fresh pair resumes from the DCP checkpoint."""
    d = zhelpers.Daemon()
    out = tmp_path_factory.mktemp("fsdp2-ckpt")
    try:
        outputs = launch(2, d.socket, "save", "fsdp2-save", out, 5)
        yield d, out, outputs
    finally:
        d.stop()


def test_refused_by_name(saved):
    _, _, outputs = saved
    lines = [line for line in outputs[0].splitlines() if line.startswith("REFUSED ")]
    assert len(lines) == 2, outputs[0][-3000:]
    assert lines[0].startswith("REFUSED partial: NotImplementedError")
    assert "placed as P(sum)" in lines[0] and "only Shard() and Replicate()" in lines[0]
    assert lines[1].startswith("REFUSED overlap: ValueError") and "outside fully_shard" in lines[1]


def test_dcp_resume_same_world_bit_for_bit(saved):
    _, out, _ = saved
    after, resumed = torch.load(out / "after.pt"), torch.load(out / "resumed.pt")
    assert list(after) == list(resumed)
    for k in after:
        assert torch.equal(after[k], resumed[k]), f"{k}: resumed from DCP differs"


def same_state(got, want):
    for k in want["params"]:
        assert torch.equal(got["params"][k], want["params"][k]), k
    gs, ws = got["optim"]["state"], want["optim"]["state"]
    assert list(gs) == list(ws)
    for k in ws:
        assert float(gs[k]["step"]) == float(ws[k]["step"]) == 5
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(gs[k][key], ws[k][key]), f"{k}.{key}"
    assert gs.keys() == ws.keys()


@pytest.mark.parametrize("world", [1, 3, 4])
def test_resharded_resume(saved, world):
    """The 2-rank save into 1, 3 and 4 ranks (over 3 the last rank has no rows of the gate,
    over 4 the last two; the head's 37 rows go 10/9/9/9 where the save had 19/18):
    DCP and our streaming checkpoint restore the state bit for bit (fp32 state);
    torch.optim.AdamW loaded from the same DCP checkpoint then steps in lockstep with ours."""
    d, out, _ = saved
    kinds = "dcp,own"
    launch(world, d.socket, "load", f"fsdp2-load{world}", out, kinds, 5)
    want = torch.load(out / "state.pt", weights_only=False)
    for kind in kinds.split(","):
        same_state(torch.load(out / f"loaded-{kind}-{world}.pt", weights_only=False), want)
    r = torch.load(out / f"lockstep-{world}.pt", weights_only=False)
    err = max_rel_err([r["ours"][k] for k in r["ours"]], [r["ref"][k] for k in r["ours"]])
    assert err <= RTOL, f"after the resharded resume: {err:.3g} > {RTOL:.3g}"
    moved = max_rel_err([r["ours"][k] for k in r["ours"]],
                        [want["params"][k] for k in r["ours"]])
    assert moved > 1000 * RTOL, "the resumed run did not step"


CLIP_STEPS, SKIP_AT = 50, 23


@pytest.mark.parametrize("world, layout", [(2, "flat"), (4, "hsdp")])
def test_own_global_clip_and_skip_across_ranks(daemon, tmp_path, world, layout):
    """opt.clip_grad_norm_ (the daemon's gradient pass, the ranks' shares all-reduced) under
    FSDP2 over 2 ranks, uneven shards, and under HSDP over 4 (2 replicas of a 2-way shard:
    only the stepping replicas' shares count, each shard's once): every step's norm is torch.nn.utils.clip_grad_norm_'s
    over the DTensor grads, the same on both ranks (the global one, not a rank's share), and
    the run stays in lockstep with torch.optim.AdamW clipped by torch.  An inf in one element
    of the last shard at SKIP_AT: every rank skips that step (params, torch's step
    counts and the daemon's unchanged), as the reference does.

    Tolerances: the norm is summed in double from the slots here and in fp32 per tensor by
    torch (1e-6 relative covers fp32's sums of 10^4 squares); the coefficients then differ
    by as much, which Adam's update all but divides out (m / sqrt(v) is scale-free but for
    eps), so the params and moments keep test_numerics's RTOL, as the unclipped lockstep."""
    out = tmp_path / "r.pt"
    launch(world, daemon.socket, "clip", f"fsdp2-clip-{layout}", out, layout, CLIP_STEPS,
           SKIP_AT)
    r = torch.load(out, weights_only=False)
    norms, ref = r["norms"], r["ref_norms"]
    # Every rank got the same norm each step: the global one.
    assert all(each == norms for each in r["each_rank"])
    for step, (got, want) in enumerate(zip(norms, ref), 1):
        if step == SKIP_AT:
            assert got == float("inf")
            continue
        assert want > MAX_NORM, f"step {step}: no clip"
        assert abs(got - want) <= 1e-6 * want, f"step {step}: norm {got}, torch's {want}"
    a = r["around"]
    for k in a["before"]:
        assert torch.equal(a["before"][k], a["after"][k]), f"{k} changed at the skipped step"
    assert a["steps"] == [SKIP_AT - 1.0] and a["daemon_step"] == SKIP_AT - 1
    err = max_rel_err([r["ours"][k] for k in r["ours"]], [r["ref"][k] for k in r["ours"]])
    assert err <= RTOL, f"params: max relative difference {err:.3g} > {RTOL:.3g}"
    so, sr = r["ours_state"]["state"], r["ref_state"]["state"]
    for name in so:
        assert float(so[name]["step"]) == float(sr[name]["step"]) == CLIP_STEPS - 1, name
        for key in ("exp_avg", "exp_avg_sq"):
            err = max_rel_err([so[name][key]], [sr[name][key]])
            assert err <= RTOL, f"{name}.{key}: max relative difference {err:.3g}"
