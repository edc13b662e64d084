"""One rank of a DeepSpeed run for test_deepspeed.py: python3 ds_worker.py RANK WORLD PORT SOCKET
OUT MODE [CKPT].

Every case of CASES in one process group, each with zoffload.torch.AdamW ("ours") and with
DeepSpeed's DeepSpeedCPUAdam ("ref"): the small transformer of zhelpers under ZeRO stage 1, 2
or 3 with offload_optimizer on the CPU, STEPS optimizer steps.  MODE "all": every case both
ways; rank 0 saves {case/which: {"losses", "params"}} into OUT.  For "ckpt" cases ours also
saves engine.save_checkpoint after step CKPT_AT into CKPT/case, and zoffload.deepspeed's
save_checkpoint into CKPT/case-streamed.  MODE "resume": only the ckpt cases, ours, from
load_checkpoint of each, steps CKPT_AT+1 to STEPS.  MODE "reshard": the ckpt cases' streamed
checkpoint, saved by another world size, loaded (see reshard()).  MODE "amp":
test_deepspeed's mixed-precision runs (amp_run) for each of AMP_CASES, ours, DeepSpeedCPUAdam
and torch's AdamW; rank 0 saves {dtype-stage/which: record} into OUT.
"""
import faulthandler
import os
import sys

import torch

# A rank stuck (in a collective its peer never joins) says where, before the test's timeout.
faulthandler.dump_traceback_later(500, exit=True)
# A rank that aborts (SIGABRT from C++ teardown) says where Python was.
faulthandler.enable(all_threads=True)

sys.path.insert(0, os.path.dirname(__file__))
import zhelpers  # noqa: E402

STEPS = 50
CKPT_AT = 20
LR = 3e-3
# DeepSpeed's default buckets are 5e8 elements (2 GB of fp32 allocated up front, untouched
# unless malloc perturbs it: meson's MALLOC_PERTURB_ writes every byte).  One of 2**16 still
# holds the whole model (about 12 k params), so the bucketing is the default's.
SMALL_BUCKETS = {"reduce_bucket_size": 1 << 16, "allgather_bucket_size": 1 << 16}
# (stage, micro batch, gradient accumulation, clipping, checkpointed)
# (dtype, ZeRO stage) of MODE "amp"
AMP_CASES = [("fp16", 2), ("bf16", 3)]
CASES = {
    "zero1": dict(stage=1, micro=8, accum=1, clip=0.0, ckpt=False),
    "zero2-accum4-clip": dict(stage=2, micro=2, accum=4, clip=1.0, ckpt=True),
    "zero3": dict(stage=3, micro=8, accum=1, clip=0.0, ckpt=True),
}


def config(case, job, socket):
    c = CASES[case]
    cfg = {"train_micro_batch_size_per_gpu": c["micro"],
           "gradient_accumulation_steps": c["accum"],
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95],
                                                     "eps": 1e-8, "weight_decay": 0.01}},
           "zero_optimization": {"stage": c["stage"], "overlap_comm": True,
                                 "contiguous_gradients": True, **SMALL_BUCKETS,
                                 "offload_optimizer": {"device": "cpu", "pin_memory": False}},
           "steps_per_print": 1 << 30, "wall_clock_breakdown": False}
    if c["clip"]:
        cfg["gradient_clipping"] = c["clip"]
    return cfg


def micro_batch(case, step, micro, rank, world):
    """Optimizer step `step`, micro-batch `micro`: this rank's own batch."""
    c = CASES[case]
    x, y = zhelpers.batch(((step * c["accum"] + micro) * world + rank) % 997, n=c["micro"])
    return x, y


def build(case, which, rank, job, socket):
    import deepspeed
    import zoffload.deepspeed as zds

    m = zhelpers.model(seed=11)
    cfg = config(case, job, socket)
    if which == "ours":
        engine, *_ = zds.initialize(model=m, model_parameters=m.parameters(), config=cfg,
                                    job=job, socket=socket)
    else:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        p = cfg.pop("optimizer")["params"]
        opt = DeepSpeedCPUAdam(m.parameters(), lr=p["lr"], betas=tuple(p["betas"]),
                               eps=p["eps"], weight_decay=p["weight_decay"], adamw_mode=True)
        engine, *_ = deepspeed.initialize(model=m, optimizer=opt, config=cfg)
    return m, engine


def train_step(engine, case, step, rank, world):
    """Optimizer step `step`, its micro-batches each forward, backward and engine.step();
    the mean loss."""
    total = 0.0
    for micro in range(CASES[case]["accum"]):
        x, y = micro_batch(case, step, micro, rank, world)
        logits = engine(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 y.reshape(-1))
        engine.backward(loss)
        engine.step()
        total += loss.item()
    return total / CASES[case]["accum"]


def run(case, which, rank, world, job, socket, first=1, save_to=None, load_from=None,
        streamed=False):
    """streamed: the checkpoint saved and loaded by zoffload.deepspeed's save_checkpoint /
    load_checkpoint (the daemon's streaming checkpoint) rather than the engine's own."""
    import deepspeed
    import zoffload.deepspeed as zds

    m, engine = build(case, which, rank, job, socket)
    if load_from is not None:
        if streamed:
            path, client = zds.load_checkpoint(engine, load_from)
            assert client.get("case") == case, client
        else:
            path, _ = engine.load_checkpoint(load_from)
        assert path is not None, f"nothing loaded from {load_from}"
    losses = []
    for step in range(first, STEPS + 1):
        losses.append(train_step(engine, case, step, rank, world))
        if save_to is not None and step == CKPT_AT:
            engine.save_checkpoint(save_to, tag=f"step{step}")
            # Positional, in engine.save_checkpoint's order (save_dir, tag, client_state).
            zds.save_checkpoint(engine, save_to + "-streamed", f"step{step}", {"case": case})
    with deepspeed.zero.GatheredParameters(list(m.parameters())):
        params = [p.detach().clone() for p in m.parameters()]
    copies = None
    if which == "ours":
        copies = engine.optimizer.optimizer.copy_stats()
    engine.destroy()
    if which == "ours":
        engine.optimizer.optimizer.close()
    return {"losses": losses, "params": params, "copies": copies}


def reshard(case, rank, world, job, socket, load_from, save_to):
    """A streamed checkpoint of another world size loaded: every param's fp32 master as
    DeepSpeed's safe_get_full_fp32_param reads it, the state saved again into save_to at
    once, and the losses of the steps after."""
    import deepspeed
    import zoffload.deepspeed as zds
    from deepspeed.utils import safe_get_full_fp32_param

    m, engine = build(case, "ours", rank, job, socket)
    path, _ = zds.load_checkpoint(engine, load_from)
    assert path is not None, f"nothing loaded from {load_from}"
    masters = {name: safe_get_full_fp32_param(p).detach().clone().reshape(-1)
               for name, p in m.named_parameters()}
    zds.save_checkpoint(engine, save_to, tag="again")
    losses = [train_step(engine, case, step, rank, world)
              for step in range(CKPT_AT + 1, CKPT_AT + 4)]
    with deepspeed.zero.GatheredParameters(list(m.parameters())):
        params = [p.detach().clone() for p in m.parameters()]
    engine.destroy()
    engine.optimizer.optimizer.close()
    return {"masters": masters, "losses": losses, "params": params}


def main(rank, world, port, socket, out, mode, ckpt=None):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import deepspeed

    # DeepSpeed's shared-memory allreduce for the CPU would be compiled at first use (minutes);
    # gloo alone does what these tests need.  (sys.modules: deepspeed.comm.torch as an
    # attribute is the torch package.)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    got = {}
    if mode == "amp":
        from deepspeed.accelerator import get_accelerator
        import test_deepspeed

        # As test_deepspeed's one-process test: DeepSpeed's CPU accelerator let through to fp16.
        type(get_accelerator()).is_fp16_supported = lambda self: True
        for dtype, stage in AMP_CASES:
            for which in ("ours", "ref", "torch"):
                job = f"amp-{dtype}-{stage}-{world}" if which == "ours" else None
                got[f"{dtype}-{stage}/{which}"] = test_deepspeed.amp_run(
                    which, dtype, stage, socket, job, rank, world)
    for case in (CASES if mode != "amp" else ()):
        if mode == "all":
            for which in ("ours", "ref"):
                save = (os.path.join(ckpt, case) if CASES[case]["ckpt"] and which == "ours"
                        else None)
                got[f"{case}/{which}"] = run(case, which, rank, world, f"{case}-{world}",
                                             socket, save_to=save)
        elif mode == "resume" and CASES[case]["ckpt"]:
            got[f"{case}/resumed"] = run(case, "ours", rank, world, f"{case}-{world}-resumed",
                                         socket, first=CKPT_AT + 1,
                                         load_from=os.path.join(ckpt, case))
            got[f"{case}/streamed"] = run(case, "ours", rank, world, f"{case}-{world}-streamed",
                                          socket, first=CKPT_AT + 1,
                                          load_from=os.path.join(ckpt, case) + "-streamed",
                                          streamed=True)
        elif mode == "reshard" and CASES[case]["ckpt"] and CASES[case]["stage"] < 3:
            # (ZeRO-3: DeepSpeed's own files refuse another world size.)
            got[f"{case}/reshard"] = reshard(case, rank, world, f"{case}-{world}-reshard",
                                             socket, os.path.join(ckpt, case) + "-streamed",
                                             os.path.join(ckpt, f"{case}-resaved-{world}"))
    if rank == 0:
        torch.save(got, out)
    deepspeed.comm.barrier()
    # Past the barrier every rank is done with its collectives and rank 0 has saved OUT.
    # Torch's and DeepSpeed's C++ teardown is left out: a rank aborted in it now and then
    # ("terminate called without an active exception", SIGABRT) after all its work, under
    # load, with destroy_process_group() called first as well.  Nothing of the test's
    # verdict is decided after this point.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), int(a[2]), a[3], a[4], a[5], *a[6:])
