"""A training process for the tests that need more than one: python3 worker.py MODE ARGS...

train SOCKET JOB STEPS OUT [KILL_AFTER]: AdamW on the small transformer for STEPS steps,
    saving the params to OUT; with KILL_AFTER, save after that step and SIGKILL itself.
zero RANK WORLD PORT SOCKET JOB STEPS OUT [CKPT]: one rank of ZeroRedundancyOptimizer over
    gloo, every rank on the same batches (no DDP needed for equal gradients); rank 0 saves;
    with CKPT, every rank also saves its shard there (save_checkpoint, the model's names).
nanogpt SOCKET JOB CKPT_AT STEPS CKPT: trains as nanoGPT does, saving {model, optimizer}
    (torch.save) into CKPT after step CKPT_AT, and SIGKILLs itself after STEPS.
ddp RANK WORLD PORT SOCKET JOB STEPS BUCKET_VIEW OUT: one rank of DistributedDataParallel over
    gloo (gradient_as_bucket_view BUCKET_VIEW: 0 or 1), each rank on batches of its own, in
    lockstep with torch.optim.AdamW on a copy that takes ours' gradients once they are
    checked against the mean of every rank's own (all-reduced here by hand); rank 0 saves
    both runs' params, the largest gradient difference, whether p.grad was the grad slot
    after each backward and after each step, and copy_stats().
launch RANK WORLD PORT SOCKET STEPS [KILL]: one rank of a launch that names no job (the
    default job name from the environment); prints "JOB name resumed_step", trains STEPS steps,
    and with KILL SIGKILLs itself after them.
"""
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import zhelpers  # noqa: E402
import zoffload.torch as zt  # noqa: E402

LR = 2e-3


def params_of(m):
    return [p.detach().clone() for p in m.parameters()]


def trained(m, opt, steps):
    """Steps 1..steps on the small transformer's batches, yielding each step once done."""
    for step in range(1, steps + 1):
        opt.zero_grad()
        zhelpers.loss_of(m, step).backward()
        opt.step()
        yield step


def train(socket, job, steps, out, kill_after=None):
    m = zhelpers.model(seed=11)
    opt = zt.AdamW(m.parameters(), lr=LR, job=job, socket=socket)
    for step in trained(m, opt, steps):
        if kill_after == step:
            torch.save(params_of(m), out)
            os.kill(os.getpid(), signal.SIGKILL)
    torch.save(params_of(m), out)


def zero(rank, world, port, socket, job, steps, out, ckpt=None):
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    m = zhelpers.model(seed=11)
    opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=zt.AdamW, lr=LR, job=job,
                                  socket=socket)
    assert opt.optim.rank == rank and opt.optim.world_size == world
    for _ in trained(m, opt, steps):
        pass
    if ckpt is not None:
        opt.optim.save_checkpoint(ckpt, names={p: n for n, p in m.named_parameters()})
    # torch's consolidated state: every rank's shard, read from its own daemon.
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save({"params": params_of(m), "state": opt.state_dict()}, out)
    dist.barrier()
    # Every rank is attached and stepped: what this rank's daemon sees of the job.
    print("JOBS " + opt.optim.jobs(), flush=True)
    dist.barrier()
    opt.optim.close()
    dist.destroy_process_group()


def ddp(rank, world, port, socket, job, steps, bucket_view, out):
    import copy

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    m = zhelpers.model(seed=12)
    ref = copy.deepcopy(m)
    dm = torch.nn.parallel.DistributedDataParallel(m, gradient_as_bucket_view=bucket_view)
    opt = zt.AdamW(m.parameters(), lr=LR, job=job, socket=socket, rank=rank)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    params = list(m.parameters())

    def in_slots():
        return sum(p.grad.data_ptr() == opt._entries[p].grad.data_ptr() for p in params)
    grad_err, slot_after_backward, slot_after_step = 0.0, [], []
    for step in range(1, steps + 1):
        opt.zero_grad()
        ref_opt.zero_grad()
        zhelpers.loss_of(dm, 100 * step + rank).backward()
        zhelpers.loss_of(ref, 100 * step + rank).backward()
        for q in ref.parameters():
            dist.all_reduce(q.grad)
            q.grad /= world
        for p, q in zip(params, ref.parameters()):
            grad_err = max(grad_err, float((p.grad - q.grad).abs().max() /
                                           q.grad.abs().max().clamp_min(1e-30)))
            q.grad = p.grad.detach().clone()
        slot_after_backward.append(in_slots())
        opt.step()
        ref_opt.step()
        slot_after_step.append(in_slots())
    if rank == 0:
        torch.save({"ours": params_of(m), "ref": params_of(ref), "grad_err": grad_err,
                    "slot_after_backward": slot_after_backward,
                    "slot_after_step": slot_after_step, "stats": opt.copy_stats()}, out)
    dist.barrier()
    opt.close()
    dist.destroy_process_group()


def nanogpt(socket, job, ckpt_at, steps, ckpt):
    m = zhelpers.model(seed=11)
    opt = zt.AdamW(m.parameters(), lr=LR, job=job, socket=socket)
    for step in trained(m, opt, steps):
        if step == ckpt_at:
            torch.save({"model": m.state_dict(), "optimizer": opt.state_dict(), "step": step},
                       ckpt)
    os.kill(os.getpid(), signal.SIGKILL)


def launch(rank, world, port, socket, steps, kill=False):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    m = zhelpers.model(seed=11)
    opt = zt.AdamW(m.parameters(), lr=LR, socket=socket)
    print(f"JOB {opt.job} {opt.resumed_step}", flush=True)
    for _ in trained(m, opt, steps):
        pass
    dist.barrier()
    if kill:
        os.kill(os.getpid(), signal.SIGKILL)
    opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "train":
        train(args[0], args[1], int(args[2]), args[3], int(args[4]) if len(args) > 4 else None)
    elif mode == "zero":
        zero(int(args[0]), int(args[1]), int(args[2]), args[3], args[4], int(args[5]), args[6],
             *args[7:])
    elif mode == "ddp":
        ddp(int(args[0]), int(args[1]), int(args[2]), args[3], args[4], int(args[5]),
            args[6] == "1", args[7])
    elif mode == "nanogpt":
        nanogpt(args[0], args[1], int(args[2]), int(args[3]), args[4])
    elif mode == "launch":
        launch(int(args[0]), int(args[1]), int(args[2]), args[3], int(args[4]),
               len(args) > 5 and args[5] == "kill")
    else:
        sys.exit(f"unknown mode {mode}")
