#!/usr/bin/python3
"""train_gpt.py's small character-level GPT under FSDP2 (fully_shard, CPUOffloadPolicy), every
rank's shard of the optimizer stepped by zoffloadd through zoffload.torch.AdamW.

FSDP2 shards each parameter over the ranks (a DTensor; dim 0 split, the last rank's part the
shorter when it does not divide); with CPUOffloadPolicy each rank's shard and its gradient
sit in CPU memory, and the optimizer steps that shard.  Here the daemon does: each rank
registers its own shard, and with the "auto" policy and a small pinned budget part of the
state lives on the daemon's swap directory (NVMe), the tier FSDP2 has none of.  Launched by
torchrun, on the CPU over gloo:

    PYTHONPATH=build/python torchrun --nproc-per-node 2 examples/fsdp2_train.py \\
        --socket /tmp/zoffload.sock

With --overlap (and --clip none) each shard's step is submitted as soon as FSDP2 has
reduce-scattered its gradient, so the daemon steps the blocks whose backward is done while
backward goes on through the others; step() then waits.

The daemon needs a swap path for the NVMe part (README "Configuration": swap.paths); without
one, "auto" keeps everything pinned.  At the end rank 0 saves a distributed checkpoint
(torch.distributed.checkpoint, --dcp DIR): the model and the optimizer state, which a run of
any number of ranks loads (README "FSDP2").
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import GPT, HERE  # noqa: E402

import zoffload.torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--socket", help="zoffloadd's socket (default: $ZOFFLOAD_SOCKET)")
    ap.add_argument("--job", default=None, help="default: torchrun's run id")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8, help="per rank")
    ap.add_argument("--pinned-budget", type=int, default=64 << 10,
                    help="pinned bytes for each rank's state before auto spills to NVMe")
    ap.add_argument("--policy", default="auto", choices=["auto", "cpu", "nvme"])
    ap.add_argument("--clip", default="torch", choices=["torch", "zoffload", "none"],
                    help="clip the grads to norm 1.0 with torch.nn.utils.clip_grad_norm_ over "
                    "the DTensor grads, or with the optimizer's own opt.clip_grad_norm_ (the "
                    "daemon's norm of each shard, all-reduced: two numbers)")
    ap.add_argument("--overlap", action="store_true",
                    help="step each shard as soon as FSDP2 has reduce-scattered its gradient, "
                    "while backward goes on (overlap=True); clips nothing (--clip none)")
    ap.add_argument("--dcp", default=None, help="save a distributed checkpoint there at the end")
    ap.add_argument("--text", default=os.path.join(HERE, "data", "shakespeare.txt"))
    args = ap.parse_args()
    if args.overlap and args.clip != "none":
        ap.error("--overlap steps each shard in backward, before any norm is known: "
                 "give --clip none with it")

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    text = open(args.text, encoding="utf-8").read()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    torch.manual_seed(0)                 # the same initial model on every rank
    model = GPT(len(chars))
    mesh = init_device_mesh("cpu", (world,))
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for block in model.blocks:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    gen = torch.Generator().manual_seed(1 + rank)     # every rank its own batches

    def batch():
        ix = torch.randint(len(data) - model.ctx - 1, (args.batch,), generator=gen)
        x = torch.stack([data[i:i + model.ctx] for i in ix])
        y = torch.stack([data[i + 1:i + model.ctx + 1] for i in ix])
        return x, y

    # As with torch.optim.AdamW under FSDP2: the model's (DTensor) parameters.
    opt = zoffload.torch.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, job=args.job,
                               socket=args.socket, policy=args.policy,
                               pinned_budget=args.pinned_budget, overlap=args.overlap)
    shard = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    print(f"rank {rank}/{world}: GPT of {total / 1e6:.2f} M parameters, this rank's shard "
          f"{shard} of them in zoffloadd (job '{opt.job}', {args.policy})", flush=True)
    t0 = time.monotonic()
    for step in range(1, args.steps + 1):
        x, y = batch()
        loss = F.cross_entropy(model(x).reshape(-1, len(chars)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.clip == "torch":
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # over all ranks
            norm = norm.full_tensor()
        elif args.clip == "zoffload":
            norm = opt.clip_grad_norm_(1.0)     # over all ranks too; applied in the step
        else:
            norm = torch.tensor(float("nan"))   # not computed
        opt.step()
        if step == 1 or step % 50 == 0 or step == args.steps:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if rank == 0:
                print(f"step {step:4d}  train loss {mean.item() / world:.3f}  grad norm "
                      f"{norm.item():.3f}  ({time.monotonic() - t0:.1f} s)",
                      flush=True)
    if args.dcp:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=args.dcp)
        if rank == 0:
            print(f"saved a distributed checkpoint into {args.dcp}", flush=True)
    job = [j for j in json.loads(opt.jobs())["jobs"] if j["name"] == opt.job][0]
    dist.barrier()
    if rank == 0:
        print(f"zoffloadd: job '{opt.job}': {job['ranks_attached']} ranks, {job['tensors']} "
              f"tensors, {job['params']} params (the shards of {total}), state "
              f"{job['pinned_bytes'] / 2**20:.2f} MiB pinned + "
              f"{job['nvme_bytes'] / 2**20:.2f} MiB on NVMe, {job['steps_applied']} "
              "steps applied", flush=True)
    dist.barrier()
    opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
