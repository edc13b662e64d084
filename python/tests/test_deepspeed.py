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
