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
import math
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
    # meson's MALLOC_PERTURB_ fills every allocation: DeepSpeed's up-front buffers with it.
    env.pop("MALLOC_PERTURB_", None)
    # Where scripts/pyenv.sh keeps DeepSpeed's built CPU Adam op (it compiles for minutes
    # otherwise); a TORCH_EXTENSIONS_DIR of the environment wins.
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(
        os.environ.get("ZOFFLOAD_VENV_ROOT", os.path.expanduser("~/.cache/zoffload")),
        "torch-extensions"))
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
        # DeepSpeed's fp32 partitions on the CPU are the param slots' views: its own copy of
        # the master is gone, and no step copies params out (DeepSpeed copies them on).
        assert ours["copies"]["params_viewed"] >= 1 and ours["copies"]["param_copies"] == 0, \
            f"{case}: {ours['copies']}"
    print(f"world {world}: worst relative (loss, param) difference from DeepSpeedCPUAdam: "
          f"{worst}")
    assert all(lw <= LOSS_RTOL and pw <= PARAM_RTOL for lw, pw in worst.values()), worst
    resumed = launch(world, daemon.socket, tmp_path / "resumed.pt", "resume", ckpt)
    for case, c in ds_worker.CASES.items():
        if not c["ckpt"]:
            continue
        whole = got[f"{case}/ours"]
        for how in ("resumed", "streamed"):
            again = resumed[f"{case}/{how}"]
            assert again["losses"] == whole["losses"][ds_worker.CKPT_AT:], \
                f"{case} {how}: the resumed losses differ"
            for a, b in zip(again["params"], whole["params"]):
                assert torch.equal(a, b), f"{case} {how}: the resumed run differs from the whole"
        # The moments never went through the trainer's memory: the streamed save wrote no
        # ZeRO optimizer files (ZeRO-1/2), or ones whose optimizer state is a reference to
        # the streamed one (ZeRO-3: its fp32 partitions are DeepSpeed's weights).
        streamed = ckpt / f"{case}-streamed" / f"step{ds_worker.CKPT_AT}"
        zero_files = list(streamed.glob("*optim_states.pt"))
        assert len(zero_files) == (world if c["stage"] == 3 else 0), zero_files
        for path in zero_files:
            osd = torch.load(path, weights_only=False)["optimizer_state_dict"]
            assert osd["optimizer_state_dict"] == {
                "state": {}, "param_groups": osd["optimizer_state_dict"]["param_groups"],
                "zoffload.deepspeed": "zoffload"}, path
        assert list((streamed / "zoffload").glob("rank-*.safetensors"))
    if world == 2:
        check_reshard(daemon, tmp_path, ckpt)


def saved_state(dir):
    """{param name: {array: its whole fp32 tensor}} from a streaming checkpoint's rank files,
    each element asserted to be in exactly one of them."""
    from safetensors import safe_open

    out, seen = {}, {}
    for path in sorted(dir.glob("rank-*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            for key in f.keys():
                entry, array = key.rsplit("/", 1)
                name = meta[f"{entry}/global_name"]
                off, n = int(meta[f"{entry}/global_offset"]), int(meta[f"{entry}/global_numel"])
                t = f.get_tensor(key)
                whole = out.setdefault(name, {}).setdefault(array, torch.zeros(n))
                whole[off:off + t.numel()] = t
                count = seen.setdefault((name, array), torch.zeros(n, dtype=torch.int32))
                count[off:off + t.numel()] += 1
    for (name, array), count in seen.items():
        assert bool((count == 1).all()), f"{dir}: {name}/{array} is not saved exactly once"
    return out


def check_reshard(daemon, tmp_path, ckpt):
    """ZeRO-1/2: the 2 ranks' streamed checkpoints loaded by 1 rank: DeepSpeed's flat partitions of
    another layout hold every saved master and moment bit for bit (saved again at once,
    and the masters as DeepSpeed's safe_get_full_fp32_param reads them), and it trains on."""
    got = launch(1, daemon.socket, tmp_path / "reshard.pt", "reshard", ckpt)
    for case, c in ds_worker.CASES.items():
        if not c["ckpt"] or c["stage"] == 3:
            continue        # ZeRO-3: DeepSpeed's own files refuse another world size
        r = got[f"{case}/reshard"]
        before = saved_state(ckpt / f"{case}-streamed" / f"step{ds_worker.CKPT_AT}" / "zoffload")
        after = saved_state(ckpt / f"{case}-resaved-1" / "again" / "zoffload")
        assert before.keys() == after.keys() == r["masters"].keys(), case
        for name, arrays in before.items():
            for array, t in arrays.items():
                assert torch.equal(after[name][array], t), f"{case}: {name}/{array} changed"
            assert torch.equal(r["masters"][name], arrays["master"]), \
                f"{case}: DeepSpeed's view of {name}'s master is not the restored one"
        assert all(math.isfinite(x) for x in r["losses"]), r["losses"]


# zoffload.deepspeed.initialize in this process (world size 1 over gloo): the config mapped.
@pytest.fixture(scope="module")
def process_group():
    import deepspeed

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None    # see ds_worker.py
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(dist_backend="gloo")
    yield
    torch.distributed.destroy_process_group()


def nvme_config(path):
    return {"train_micro_batch_size_per_gpu": 8,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, **ds_worker.SMALL_BUCKETS, "offload_optimizer": {
                "device": "nvme", "nvme_path": path, "pin_memory": True, "buffer_count": 4}},
            "steps_per_print": 1 << 30}


def job_of(opt):
    import json

    (job,) = [j for j in json.loads(opt.jobs())["jobs"] if j["name"] == opt.job]
    return job


def test_nvme_config_is_nvme_state_in_the_daemon(make_daemon, process_group):
    import zoffload.deepspeed as zds

    d = make_daemon(swap=True)
    swap = os.path.join(d.dir, "swap")
    cfg = nvme_config(os.path.join(swap, "ds"))     # inside one of the daemon's swap paths
    m = zhelpers.model(seed=11)
    engine, opt, _, _ = zds.initialize(model=m, model_parameters=m.parameters(), config=cfg,
                                       job="ds-nvme", socket=d.socket)
    # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false; the config given is unchanged.
    assert type(opt.optimizer).__name__ == "AdamW" and opt.optimizer.defaults["lr"] == 1e-3
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    assert "optimizer" in cfg
    # DeepSpeed keeps its partitions on the CPU and runs no swapper of its own.
    assert engine.zero_offload_optimizer().device == "cpu"
    assert not engine.optimizer.swap_optimizer and engine.optimizer.optimizer_swapper is None
    for step in range(1, 4):
        x, y = zhelpers.batch(step)
        logits = engine(x)
        engine.backward(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                          y.reshape(-1)))
        engine.step()
    job = job_of(opt.optimizer)
    assert job["policy"] == "nvme" and job["last_step"] == 3
    assert job["params"] == sum(p.ds_numel for p in m.parameters())
    engine.destroy()
    opt.optimizer.close()


def test_nvme_path_not_the_daemons(make_daemon, process_group):
    import zoffload.deepspeed as zds

    d = make_daemon(swap=True)
    m = zhelpers.model(seed=11)
    with pytest.raises(ValueError, match=r"nvme_path /elsewhere/ds is not one of the daemon's "
                                         r"swap paths \(.*/swap\)"):
        zds.initialize(model=m, config=nvme_config("/elsewhere/ds"), job="ds-bad-path",
                       socket=d.socket)
    import zoffload.torch as zt

    own = zt.AdamW(m.parameters(), job="ds-own", socket=d.socket, policy="cpu")
    cfg = nvme_config(os.path.join(d.dir, "swap"))
    del cfg["optimizer"]
    with pytest.raises(ValueError, match="job 'ds-own' has policy cpu: build it with "
                                         "policy=\"nvme\""):
        zds.initialize(model=m, optimizer=own, config=cfg, socket=d.socket)
    own.close()
    bare = make_daemon()
    with pytest.raises(ValueError, match="the daemon has no swap.paths"):
        zds.initialize(model=m, config=nvme_config("/elsewhere/ds"), job="ds-no-swap",
                       socket=bare.socket)


@pytest.mark.parametrize("block, why", [
    ({"type": "OneBitAdam", "params": {"lr": 1e-3}}, "optimizer type 'OneBitAdam' has no "
     "zoffload equivalent"),
    ({"type": "AdamW", "params": {"lr": 1e-3, "momentum": 0.9}},
     r"optimizer.params.momentum \(0.9\) has no equivalent in zoffload's AdamW"),
    ({"type": "AdamW", "params": {"lr": "auto"}}, r"optimizer.params.lr is \"auto\""),
    ({"type": "Adam", "params": {"bias_correction": False}},
     "optimizer.params.bias_correction"),
])
def test_unsupported_optimizer_blocks_refused_by_name(block, why):
    import zoffload.deepspeed as zds

    with pytest.raises(ValueError, match=why):
        zds.optimizer_from_config(block)


def test_config_given_twice_or_not_at_all_refused_by_name():
    import argparse
    import zoffload.deepspeed as zds

    m = zhelpers.model(seed=11)
    cfg = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}}
    args = argparse.Namespace(deepspeed_config="ds_config.json")
    # Refused before DeepSpeed or the daemon is reached: neither config is guessed between.
    with pytest.raises(ValueError, match=r"a DeepSpeed config in both args.deepspeed_config "
                                         r"and config=: give one"):
        zds.initialize(args=args, model=m, config=cfg)
    assert args.deepspeed_config == "ds_config.json", "the caller's args were changed"
    with pytest.raises(ValueError, match=r"no DeepSpeed config \(config=, config_params= or "
                                         r"args.deepspeed_config\)"):
        zds.initialize(args=argparse.Namespace(), model=m)


def test_config_blocks_mapped():
    import deepspeed
    import zoffload.deepspeed as zds
    import zoffload.torch as zt

    # One changed import: the rest of a script's deepspeed.* is DeepSpeed's own.
    assert zds.zero is deepspeed.zero
    assert zds.add_config_arguments is deepspeed.add_config_arguments
    with pytest.raises(AttributeError):
        zds.no_such_thing_in_deepspeed

    cls, kw = zds.optimizer_from_config({"type": "adam", "params": {
        "lr": 2e-4, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.1,
        "adam_w_mode": False, "torch_adam": True}})
    assert cls is zt.Adam and kw == dict(lr=2e-4, betas=(0.8, 0.9), eps=1e-6,
                                         weight_decay=0.1)
    assert zds.optimizer_from_config({"type": "Lion", "params": {"lr": 1e-4}}) == (
        zt.Lion, {"lr": 1e-4})


def test_foreign_optimizer_refused(daemon, process_group):
    import zoffload.deepspeed as zds

    m = zhelpers.model(seed=11)
    cfg = {"train_micro_batch_size_per_gpu": 8,
           "zero_optimization": {"stage": 2, **ds_worker.SMALL_BUCKETS}}
    with pytest.raises(TypeError, match="optimizer= is a AdamW, not a zoffload.torch "
                                        "optimizer"):
        zds.initialize(model=m, optimizer=torch.optim.AdamW(m.parameters()), config=cfg,
                       socket=daemon.socket)
    with pytest.raises(ValueError, match="no optimizer block and no optimizer= was given"):
        zds.initialize(model=m, config=cfg, job="ds-none", socket=daemon.socket)


def test_job_named_from_the_launch(daemon, process_group, monkeypatch):
    """DeepSpeed's launcher sets no run id: without $ZOFFLOAD_JOB the ranks of a launch share
    a drawn name; with it, that is the name."""
    import zoffload.deepspeed as zds

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    cfg = {"train_micro_batch_size_per_gpu": 8,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 1, **ds_worker.SMALL_BUCKETS,
                                 "offload_optimizer": {"device": "cpu"}},
           "steps_per_print": 1 << 30}
    names = []
    for env in (None, "from-env"):
        if env is None:
            monkeypatch.delenv("ZOFFLOAD_JOB", raising=False)
        else:
            monkeypatch.setenv("ZOFFLOAD_JOB", env)
        m = zhelpers.model(seed=11)
        engine, opt, _, _ = zds.initialize(model=m, config=cfg, socket=daemon.socket)
        names.append(opt.optimizer.job)
        assert job_of(opt.optimizer)["policy"] == "cpu"
        engine.destroy()
        opt.optimizer.close()
    assert names[0].startswith("deepspeed-") and len(names[0]) == len("deepspeed-") + 16
    assert names[1] == "from-env"


# Mixed precision, loss scaling, overflow skips and a scheduler from the config, in this
# process (world size 1 over gloo), and over 2 processes (ds_worker.py's "amp" mode).
AMP_STEPS = 50
OVERFLOW_AT = 17        # the optimizer step whose loss is made inf (fp16 only)
LR_MAX, LR_MIN, WARMUP = 3e-3, 1e-4, 10
# Tolerances.  In fp16 and bf16 the forward and backward run in half precision: two correct
# AdamWs' fp32 masters, a few ulps apart after a step (see the module doc), round to half
# params that differ by one half ulp (2**-11 or 2**-8 relative) in some elements, and that
# goes through the loss and grows over the steps.  So ours is checked against a second
# independent AdamW in the same DeepSpeed run, torch.optim.AdamW: measured over 50 steps
# (stages 1, 2, 3; 1 and 2 processes), at most 2.3e-5 (fp16) and 1.3e-4 (bf16) relative on a
# loss and 5.6e-3 / 7e-3 of a tensor's largest value on the final params (the key bias left
# out, as above; bf16 ZeRO-3 over 2 processes: the same bits, no master rounded otherwise).  The
# bounds leave about 3x; an lr off by the scheduler's one step, a skipped step taken or an
# unscaled gradient (256x) moves a loss by more than 1e-2 within these steps.
# DeepSpeedCPUAdam is further from both, alike: 3e-2 on the params, 2e-4 on a loss (in fp32
# 3e-6: whatever it does otherwise in half precision, torch's AdamW and ours do not); ours
# must be no further from it than torch's AdamW is (1.5x, with a floor).
AMP_TOL = {"fp16": (7e-5, 1.5e-2), "bf16": (3e-4, 2e-2)}


def amp_config(dtype, stage):
    cfg = {"train_micro_batch_size_per_gpu": 8,
           "optimizer": {"type": "AdamW", "params": {"lr": LR_MAX, "betas": [0.9, 0.95],
                                                     "eps": 1e-8, "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupDecayLR", "params": {
               "warmup_min_lr": LR_MIN, "warmup_max_lr": LR_MAX, "warmup_num_steps": WARMUP,
               "total_num_steps": AMP_STEPS, "warmup_type": "linear"}},
           "zero_optimization": {"stage": stage, **ds_worker.SMALL_BUCKETS,
                                 "offload_optimizer": {"device": "cpu", "pin_memory": False}},
           "gradient_clipping": 1.0,
           "steps_per_print": 1 << 30}
    if dtype == "fp16":
        # A scale of 2**8 that never grows within the run (loss_scale_window), and halves at
        # the first overflow (hysteresis 1): the forced overflow is the only one.
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8,
                       "loss_scale_window": 1000, "hysteresis": 1, "min_loss_scale": 1}
    else:
        cfg["bf16"] = {"enabled": True}
    return cfg


def expected_lr(applied):
    """WarmupDecayLR's lr for the optimizer step that is the `applied`-th to be applied
    (1-based), written out from DeepSpeed's documented schedule: the scheduler starts at
    warmup_min_lr (iteration -1) and steps after each applied optimizer step, never after a
    skipped one."""
    it = applied - 2
    if it < 0:
        return LR_MIN
    gamma = it / WARMUP if it < WARMUP else max(0.0, (AMP_STEPS - it) / (AMP_STEPS - WARMUP))
    return LR_MIN + (LR_MAX - LR_MIN) * gamma


def fp32_partitions(engine):
    """The fp32 masters DeepSpeed hands the optimizer (ZeRO-1/2's flat partitions, ZeRO-3's
    sub-groups), copied."""
    opt = engine.optimizer
    groups = getattr(opt, "single_partition_of_fp32_groups", None)
    if groups is None:
        groups = opt.fp32_partitioned_groups_flat
    return [g.detach().clone() for g in groups]


def amp_run(which, dtype, stage, sock, job, rank=0, world=1):
    """One run (ours, "ref": DeepSpeedCPUAdam, "torch": torch's AdamW) on this rank of a
    process group of `world`; fp16's overflow is forced on the last rank only (DeepSpeed's
    check reduces it over the ranks)."""
    import deepspeed
    import zoffload.deepspeed as zds

    m = zhelpers.model(seed=11)
    cfg = amp_config(dtype, stage)
    if which == "ours":
        engine, opt, _, sched = zds.initialize(model=m, model_parameters=m.parameters(),
                                               config=cfg, job=job, socket=sock)
        zopt = opt.optimizer
        told = []           # the lr each submit gives the daemon
        group_args = zopt._group_args
        zopt._group_args = lambda g: told.append(group_args(g)["lr"]) or group_args(g)
    else:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        p = cfg.pop("optimizer")["params"]
        kw = dict(lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                  weight_decay=p["weight_decay"])
        if which == "ref":
            ref = DeepSpeedCPUAdam(m.parameters(), adamw_mode=True, **kw)
        else:       # "torch": a second independent AdamW, for the noise floor
            ref = torch.optim.AdamW(m.parameters(), **kw)
            cfg.update(zero_allow_untested_optimizer=True, zero_force_ds_cpu_optimizer=False)
        engine, opt, _, sched = deepspeed.initialize(model=m, optimizer=ref, config=cfg)
    assert type(sched).__name__ == "WarmupDecayLR"
    out = {"losses": [], "lrs": [], "scales": [], "skipped": []}
    for step in range(1, AMP_STEPS + 1):
        x, y = zhelpers.batch(step + 1000 * rank)
        logits = engine(x)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 y.reshape(-1))
        out["losses"].append(loss.item())
        out["lrs"].append(engine.get_lr()[0])
        forced = dtype == "fp16" and step == OVERFLOW_AT
        if forced:
            if rank == world - 1:
                loss = loss * float("inf")      # every gradient of this rank inf or NaN
            before = fp32_partitions(engine)
            if which == "ours":
                counts = [int(s["step"].item()) for s in zopt.state.values()]
                last = job_of(zopt)["last_step"]
        engine.backward(loss)
        engine.step()
        out["skipped"].append(engine.skipped_steps)
        if dtype == "fp16":
            out["scales"].append(float(engine.optimizer.loss_scale))
        if forced:
            # Skipped by DeepSpeed, before the optimizer: the masters as they were, and (ours)
            # no step count advanced here or in the daemon.
            after = fp32_partitions(engine)
            assert all(torch.equal(a, b) for a, b in zip(before, after)), \
                f"{which}: the overflowed step changed the fp32 masters"
            if which == "ours":
                assert [int(s["step"].item()) for s in zopt.state.values()] == counts
                assert job_of(zopt)["last_step"] == last == step - 1
    if which == "ours":
        out["told"] = told
        out["daemon_steps"] = job_of(zopt)["last_step"]
    with deepspeed.zero.GatheredParameters(list(m.parameters())):
        out["params"] = [p.detach().float().clone() for p in m.parameters()]
    out["masters"] = fp32_partitions(engine)
    if which == "ours":
        out["folded"] = getattr(engine.optimizer.unscale_and_clip_grads, "folded", 0)
    engine.destroy()
    if which == "ours":
        zopt.close()
    return out


@pytest.mark.parametrize("dtype, stage", [("fp16", 2), ("bf16", 2), ("fp16", 3), ("bf16", 1)])
def test_mixed_precision_loss_scale_overflow_and_scheduler(daemon, process_group, monkeypatch,
                                                           dtype, stage):
    """bf16 and fp16 (dynamic loss scale) under ZeRO with offload_optimizer on the CPU, the
    config's WarmupDecayLR and clipping 1.0: ours against DeepSpeedCPUAdam and torch's AdamW
    in the same config, step by step (tolerances at AMP_TOL).  fp16
    gets an overflow at OVERFLOW_AT: both skip it (masters unchanged, ours counts no step
    there, in torch's state or in the daemon), halve the scale alike, and hold the schedule
    back a step; the lr the daemon is told at each step is the schedule's."""
    from deepspeed.accelerator import get_accelerator

    if dtype == "fp16":
        # DeepSpeed's CPU accelerator says fp16 only where oneDNN computes it natively
        # (AVX512-FP16/AMX-FP16); torch's CPU kernels compute half on any x86 (slowly),
        # and the loss scaler and overflow skip are DeepSpeed's Python, the same on any device.
        monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)
    ours = amp_run("ours", dtype, stage, daemon.socket, f"amp-{dtype}-{stage}")
    ref = amp_run("ref", dtype, stage, daemon.socket, None)
    other = amp_run("torch", dtype, stage, daemon.socket, None)
    check_amp(ours, ref, other, dtype, stage)


@pytest.mark.parametrize("dtype, stage", [("fp16", 2), ("bf16", 1), ("fp16", 3), ("bf16", 3)])
def test_unscale_and_clip_folded_into_the_step(daemon, process_group, monkeypatch, dtype,
                                               stage):
    """Under ZeRO DeepSpeed's pass multiplying the gradients by 1 / (loss scale x clip) is
    folded into the daemon's step (zoffload.deepspeed._fold_unscale): every step's factor
    taken (fp16's 2**8 loss scale, clipping 1.0; the model is one ZeRO-3 sub-group, so one
    factor a step there too), and the same bits as with DeepSpeed's own pass, on every loss
    and on the final masters and params."""
    from deepspeed.accelerator import get_accelerator
    import zoffload.deepspeed as zds

    if dtype == "fp16":
        monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)
    folded = amp_run("ours", dtype, stage, daemon.socket, f"fold-{dtype}-{stage}")
    monkeypatch.setattr(zds, "_FOLD_UNSCALE", False)
    passed = amp_run("ours", dtype, stage, daemon.socket, f"pass-{dtype}-{stage}")
    skips = 1 if dtype == "fp16" else 0
    assert folded["folded"] == AMP_STEPS - skips and passed["folded"] == 0
    assert folded["losses"] == passed["losses"]
    assert folded["skipped"] == passed["skipped"] and folded["scales"] == passed["scales"]
    for a, b in zip(folded["masters"] + folded["params"], passed["masters"] + passed["params"]):
        assert torch.equal(a, b)


def test_mixed_precision_two_processes(daemon, tmp_path):
    """The same over 2 processes (fp16 ZeRO-2, bf16 ZeRO-3): the overflow is forced on one
    rank's gradients only, and both ranks skip the step (DeepSpeed reduces the overflow
    flag before calling the optimizer; each rank asserts its masters and step counts
    unchanged), the scale halving on both."""
    got = launch(2, daemon.socket, tmp_path / "amp.pt", "amp", tmp_path / "none")
    for dtype, stage in ds_worker.AMP_CASES:
        k = f"{dtype}-{stage}"
        check_amp(got[k + "/ours"], got[k + "/ref"], got[k + "/torch"], dtype, stage)


def check_amp(ours, ref, other, dtype, stage):
    """The amp runs' checks, from rank 0's records (module comment at AMP_TOL)."""
    skips = 1 if dtype == "fp16" else 0
    assert ours["skipped"] == ref["skipped"] and ours["skipped"][-1] == skips
    assert ours["daemon_steps"] == AMP_STEPS - skips
    applied = [s for s in range(1, AMP_STEPS + 1) if not (skips and s == OVERFLOW_AT)]
    want = [expected_lr(applied.index(s) + 1) if s in applied else None
            for s in range(1, AMP_STEPS + 1)]
    for s in range(AMP_STEPS):
        # engine.get_lr() before each step is the schedule's (a skipped step's included).
        w = want[s] if want[s] is not None else want[s + 1]
        assert ours["lrs"][s] == pytest.approx(w, rel=1e-12) and ref["lrs"][s] == ours["lrs"][s]
    assert ours["told"] == pytest.approx([w for w in want if w is not None], rel=1e-12)
    if dtype == "fp16":
        assert ours["scales"] == ref["scales"]
        assert ours["scales"][OVERFLOW_AT - 2] == 256.0 and ours["scales"][OVERFLOW_AT - 1] == 128.0

    def apart(a, b):
        return (max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"])),
                max(rel_err(x, y) for x, y in zip(without_key_bias(a["params"]),
                                                   without_key_bias(b["params"]))))
    lw, pw = apart(ours, ref)
    ln, pn = apart(other, ref)
    lt, pt = apart(ours, other)
    print(f"{dtype} stage {stage}: ours vs DeepSpeedCPUAdam: loss {lw:.2e}, param {pw:.2e}; "
          f"torch AdamW vs DeepSpeedCPUAdam: loss {ln:.2e}, param {pn:.2e}; "
          f"ours vs torch AdamW: loss {lt:.2e}, param {pt:.2e}")
    loss_tol, param_tol = AMP_TOL[dtype]
    assert lt <= loss_tol and pt <= param_tol, ("against torch's AdamW", lt, pt)
    assert lw <= 1.5 * ln + 1e-5 and pw <= 1.5 * pn + 1e-3, \
        ("against DeepSpeedCPUAdam, further than torch's AdamW is", lw, pw, ln, pn)
    assert ours["losses"][-1] < ours["losses"][0] - 0.05


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeeds_fp32_and_grad_accessors_reach_the_daemons_tensors(daemon, process_group,
                                                                      stage):
    """deepspeed.utils' safe_get_full_grad, safe_get_full_fp32_param and
    safe_set_full_fp32_param (what users, Trainer callbacks and checkpoint tools read and
    write the masters and gradients through) reach the tensors the daemon steps, under
    ZeRO-1/2 with offload_optimizer on the CPU.  DeepSpeed maps each model param to views of
    its flat fp32 partition and of the partition's gradient, made once at initialize; the
    partition's storage becomes the param slot's view and its gradient the grad slot at the
    first step, so views made before read a dead copy: the initial masters and no gradient,
    and a write through them was lost (the daemon never saw it).  Compared exactly: the
    daemon's master and grad slot hold the very values DeepSpeed's views must show."""
    import deepspeed
    from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_grad,
                                 safe_set_full_fp32_param)
    import zoffload.deepspeed as zds

    m = zhelpers.model(seed=12)
    cfg = amp_config("bf16", stage)
    del cfg["scheduler"]
    engine, opt, _, _ = zds.initialize(model=m, model_parameters=m.parameters(), config=cfg,
                                       job=f"accessors-{stage}", socket=daemon.socket)
    zero, zopt = engine.optimizer, opt.optimizer
    lps = [(g, lp) for g, group in enumerate(zero.bit16_groups) for lp in group]

    def daemons(lp, g, what):
        """lp's elements of the daemon's master ("master") or grad slot ("grad")."""
        part = zero.single_partition_of_fp32_groups[g]
        e = zopt._entries[part]
        if what == "master":
            flat = torch.empty(part.numel(), dtype=torch.float32)
            e.zt.read("master", flat.numpy())
        else:
            flat = e.grad
        frag = lp._hp_mapping.get_hp_fragment_address()
        return flat.narrow(0, frag.start, frag.numel).view(lp.shape)

    def train_step(step):
        x, y = zhelpers.batch(step)
        logits = engine(x)
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        engine.backward(loss)
        if step >= 2:       # from the second step the partition's gradient is the grad slot
            for g, lp in lps:
                got = safe_get_full_grad(lp)
                assert torch.equal(got.float(), daemons(lp, g, "grad")), \
                    f"step {step}: safe_get_full_grad is not the gradient the daemon steps"
        engine.step()

    try:
        for step in range(1, 5):
            train_step(step)
            for g, lp in lps:
                assert torch.equal(safe_get_full_fp32_param(lp), daemons(lp, g, "master")), \
                    f"step {step}: safe_get_full_fp32_param is not the daemon's master"
        g, lp = lps[0]
        value = safe_get_full_fp32_param(lp) + 1.0
        safe_set_full_fp32_param(lp, value)
        assert torch.equal(safe_get_full_fp32_param(lp), value)
        train_step(5)
        # One AdamW step from the written master: at most a few lr away (|update| <= lr x
        # |m^|/sqrt(v^) + lr x wd x |w|), where losing the write leaves it 1.0 away.
        moved = (daemons(lp, g, "master") - value).abs().max().item()
        assert moved < 20 * LR_MAX, f"the written master was not stepped ({moved} away)"
        assert torch.equal(safe_get_full_fp32_param(lp), daemons(lp, g, "master"))
    finally:
        engine.destroy()
        zopt.close()
