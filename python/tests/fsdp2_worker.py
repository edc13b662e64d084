"""One rank of an FSDP2 (fully_shard) run over gloo on the CPU, for test_fsdp2.py:
python fsdp2_worker.py MODE RANK WORLD PORT SOCKET JOB OUT [ARGS...]
With ZOFFLOAD_TEST_DEVICE=cuda (test_gpu.py), train runs on the GPU over NCCL, one GPU a rank:
the model and the batches on the GPU, CPUOffloadPolicy's shards pinned.

train OFFLOAD POLICY STEPS (OFFLOAD: offload, CPUOffloadPolicy; mesh, none; hsdp, HSDP over a
    2-D mesh with CPUOffloadPolicy): zoffload.torch.AdamW and torch.optim.AdamW on two copies of one
    model under fully_shard, in lockstep: ours runs forward, backward and clip_grad_norm_ on
    its DTensor grads, the reference takes the same clipped grads (so that nothing but the
    update differs), both step.  Rank 0 saves to OUT both runs' full params, the clip norms
    against an independent one (from the gathered full grads), and the final losses; under
    hsdp also whether DCP and the streaming checkpoint restore the state bit for bit.
overlap STEPS: zoffload.torch.AdamW(overlap=True) (each shard's step submitted from its
    post-accumulate-grad hook, in backward) and torch.optim.AdamW in lockstep, under
    CPUOffloadPolicy, without clipping; every third step takes two micro-batches, the first
    without a reduce-scatter (set_requires_gradient_sync(False)).  Rank 0 saves both runs'
    full params and state, every rank's copy_stats(), the final losses, and the errors of a
    step() after torch's clip_grad_norm_ and of a second reduce-scatter before step() (two
    synced backwards).
save STEPS: first what is refused, by name (REFUSED lines): a Partial() placement,
    overlap=True with a DTensor outside fully_shard.  Then ours trains STEPS steps, saves
    through DCP (OUT/dcp) and through the streaming checkpoint (OUT/own), with the full
    state at that point (OUT/state.pt); trains STEPS more (OUT/after.pt), then a fresh model
    and optimizer load OUT/dcp and train the same STEPS (OUT/resumed.pt).
clip LAYOUT STEPS SKIP_AT (LAYOUT: flat, a 1-D mesh; hsdp, as train's): ours clips with its own global clip (opt.clip_grad_norm_, the daemon's
    gradient pass, the ranks' shares all-reduced), torch.optim.AdamW on a copy takes the same
    unclipped grads and torch.nn.utils.clip_grad_norm_ over its DTensor grads: both step, in
    lockstep, STEPS steps.  At step SKIP_AT the ranks of the last shard coordinate (the last
    rank; under HSDP both replicas of that shard, as its all-reduced grad would be) make one
    gradient element inf: ours must skip that step on every rank (the reference skips it too, as GradScaler would).
    Rank 0 saves both runs' full params and state, every step's two norms, each rank's
    norms, and the params and step counts around the skip (OUT).
graft STEPS: FSDP2's reduce-scatter into the grad slots (zoffload/_graft.py), on a model
    whose shards start on page boundaries of the reduce-scatter output (three 64-column
    layers of their own, one padded over 2 ranks) and whose root module has one that does not
    (w, after scale's 3 elements a rank): zoffload.torch.AdamW and torch.optim.AdamW in
    lockstep under CPUOffloadPolicy, STEPS steps, step 4 after zero_grad(set_to_none=False)
    and every third step with two synced backward passes (the second reduce-scatter adds into
    the gradients of the first).  Both models run the backward passes; the reference then
    takes ours' grads.  Rank 0 saves both runs' full params and state, the final losses, and
    every rank's copy_stats() with the largest difference of its grads from the reference's.
load KINDS STEPS: for each of KINDS (dcp,own), a fresh model and ours load OUT/dcp (dcp) or
    OUT/own (own) in this world size; rank 0 saves the full state just loaded
    (OUT/loaded-KIND-WORLD.pt).  For dcp, torch.optim.AdamW loads the same checkpoint and
    both step STEPS in lockstep (OUT/lockstep-WORLD.pt).
"""
import copy
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

sys.path.insert(0, os.path.dirname(__file__))
import zhelpers  # noqa: E402
import zoffload.torch as zt  # noqa: E402

LR, WD, MAX_NORM = 2e-3, 0.05, 0.25
DEVICE = os.environ.get("ZOFFLOAD_TEST_DEVICE", "cpu")
FULL = StateDictOptions(full_state_dict=True)


class Model(zhelpers.TinyTransformer):
    """The small transformer, whose dims 37, 12, 32, 72, 96 shard unevenly over 2, 3 and 4
    ranks, and a gate of 2 rows: over 3 ranks one rank holds none of it, over 4 two."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Parameter(torch.tensor([0.9, 1.1]))

    def forward(self, x):
        return super().forward(x) * self.gate.mean()


def build(world, offload, seed=21, hsdp=False):
    torch.manual_seed(seed)
    m = Model().to(DEVICE)
    # HSDP: replicated over world / 2 groups of 2 ranks, sharded within each.
    mesh = (init_device_mesh(DEVICE, (world // 2, 2), mesh_dim_names=("replicate", "shard"))
            if hsdp else init_device_mesh(DEVICE, (world,)))
    kw = dict(mesh=mesh)
    if offload:
        # Pinned memory needs CUDA.
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=DEVICE == "cuda")
    return m, kw


def shard(m, kw):
    fully_shard(m.layer, **kw)
    fully_shard(m, **kw)
    return m


def loss_of(m, step, rank):
    # Data parallel: every rank its own batch.
    x, y = (t.to(DEVICE) for t in zhelpers.batch(step * 16 + rank))
    logits = m(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             y.reshape(-1))


def full_params(m):
    return {k: v.detach().cpu().clone()
            for k, v in get_model_state_dict(m, options=FULL).items()}


def full_state(m, opt):
    return {"params": full_params(m), "optim": get_optimizer_state_dict(m, opt, options=FULL)}


def lockstep(ours, opt, ref, ref_opt, rank, steps, first=1, clip=True):
    norms = []
    for step in range(first, first + steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss_of(ours, step, rank).backward()
        if clip:
            got = torch.nn.utils.clip_grad_norm_(ours.parameters(), MAX_NORM)
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            norms.append(float(got))
        for p, q in zip(ours.parameters(), ref.parameters()):
            q.grad = p.grad.detach().clone()
        opt.step()
        ref_opt.step()
    return norms


def independent_norm(m, rank):
    """The total grad norm from the gathered full grads, as plain tensors: torch's
    clip_grad_norm_ formula written out, not its DTensor path."""
    full = [p.grad.full_tensor().double() for p in m.parameters()]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g)
                                                       for g in full])))


def train(rank, world, sock, job, out, offload, policy, steps):
    base, kw = build(world, offload in ("offload", "hsdp"), hsdp=offload == "hsdp")
    ref = shard(copy.deepcopy(base), kw)
    ours = shard(base, kw)
    opt = zt.AdamW(ours.parameters(), lr=LR, weight_decay=WD, job=job, socket=sock,
                   policy=None if policy == "default" else policy)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    with torch.no_grad():
        first_loss = float(loss_of(ours, 0, 0))
    # The clip norm against the independent one, at the first step (grads not yet clipped).
    opt.zero_grad()
    loss_of(ours, 1, rank).backward()
    want = independent_norm(ours, rank)
    got = torch.nn.utils.clip_grad_norm_(ours.parameters(), MAX_NORM).full_tensor()
    scaled = independent_norm(ours, rank)
    for p, q in zip(ours.parameters(), ref.parameters()):
        q.grad = p.grad.detach().clone()
    opt.step()
    ref_opt.step()
    norms = lockstep(ours, opt, ref, ref_opt, rank, steps - 1, first=2)
    with torch.no_grad():
        # Forward through FSDP2's all-gather: it sees what the step wrote into the shards.
        final = (float(loss_of(ours, 0, 0)), float(loss_of(ref, 0, 0)))
    result = {"ours": full_params(ours), "ref": full_params(ref), "first_norm": (float(got), want),
              "clipped_norm": scaled, "norms": norms, "first_loss": first_loss,
              "final_loss": final, "ours_state": full_state(ours, opt)["optim"],
              "ref_state": full_state(ref, ref_opt)["optim"],
              "local_numels": [p.to_local().numel() for p in ours.parameters()],
              "jobs": opt.jobs()}
    # Which ranks hold (and step) a daemon tensor of their shard: (rank, replicate coord).
    # And every rank's shards, with its mesh coordinate: HSDP's replicas must have the same.
    held = [None] * world
    coord = tuple(ours.pos.device_mesh.get_coordinate())
    dist.all_gather_object(held, (len(opt._entries), coord,
                                  [p.to_local().detach().cpu().clone()
                                   for p in ours.parameters()]))
    result["held"] = held
    stats = [None] * world
    dist.all_gather_object(stats, opt.copy_stats())
    result["copy_stats"] = stats
    if offload == "hsdp":
        result["restored"] = restored_hsdp(world, sock, job, out, ours, opt)
    # Closed, the optimizer's slots go: the shards that were their views are FSDP2's again.
    opt.close()
    with torch.no_grad():
        result["loss_after_close"] = float(loss_of(ours, 0, 0))
    if rank == 0:
        torch.save(result, out)
    dist.barrier()


def overlap(rank, world, sock, job, out, steps):
    base, kw = build(world, True)
    ref = shard(copy.deepcopy(base), kw)
    ours = shard(base, kw)
    opt = zt.AdamW(ours.parameters(), lr=LR, weight_decay=WD, job=job, socket=sock,
                   overlap=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    in_flight = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        ref_opt.zero_grad()
        if step % 3 == 0:
            ours.set_requires_gradient_sync(False)
            loss_of(ours, 1000 + step, rank).backward()
            ours.set_requires_gradient_sync(True)
        loss_of(ours, step, rank).backward()
        # Submitted from the hooks: in flight (or done) before step() is called.
        in_flight.append(sum(1 for e in opt._entries.values() if e.in_flight))
        for p, q in zip(ours.parameters(), ref.parameters()):
            q.grad = p.grad.detach().clone()
        opt.step()
        ref_opt.step()
    with torch.no_grad():
        final = (float(loss_of(ours, 0, 0)), float(loss_of(ref, 0, 0)))
    result = {"ours": full_params(ours), "ref": full_params(ref), "final_loss": final,
              "ours_state": full_state(ours, opt)["optim"],
              "ref_state": full_state(ref, ref_opt)["optim"], "in_flight": in_flight}
    stats = [None] * world
    dist.all_gather_object(stats, (len(opt._entries), opt.copy_stats()))
    result["copy_stats"] = stats
    # torch's clip_grad_norm_ after backward would change grads the steps already took
    # (1e-4: far below the norm, so that it scales every grad).
    opt.zero_grad()
    loss_of(ours, 0, rank).backward()
    torch.nn.utils.clip_grad_norm_(ours.parameters(), 1e-4)
    try:
        opt.step()
        result["clipped_after"] = None
    except RuntimeError as ex:
        result["clipped_after"] = str(ex)
    # A second synced backward before step(): the shards' steps are in flight already.
    opt.zero_grad()
    loss_of(ours, 0, rank).backward()
    try:
        loss_of(ours, 0, rank).backward()
        result["second_backward"] = None
    except RuntimeError as ex:
        result["second_backward"] = str(ex)
    opt.close()
    if rank == 0:
        torch.save(result, out)
    dist.barrier()


def clip(rank, world, sock, job, out, layout, steps, skip_at):
    base, kw = build(world, True, hsdp=layout == "hsdp")
    ref = shard(copy.deepcopy(base), kw)
    ours = shard(base, kw)
    opt = zt.AdamW(ours.parameters(), lr=LR, weight_decay=WD, job=job, socket=sock)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    norms, ref_norms, around = [], [], {}
    for step in range(1, steps + 1):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss_of(ours, step, rank).backward()
        last = kw["mesh"].get_coordinate()[-1] == kw["mesh"].size(-1) - 1
        if step == skip_at and last:
            # One element of one rank's shard: the other ranks learn of it only through the
            # all-reduce of the shares.
            next(p for p in ours.parameters() if p.to_local().numel()).grad.to_local()[0] = \
                float("inf")
        for p, q in zip(ours.parameters(), ref.parameters()):
            q.grad = p.grad.detach().clone()
        norms.append(float(opt.clip_grad_norm_(MAX_NORM)))
        if step == skip_at:
            around["before"] = full_params(ours)
            opt.step()
            around["after"] = full_params(ours)
            around["steps"] = sorted({float(s["step"]) for s in opt.state.values()})
            (j,) = [j for j in json.loads(opt.jobs())["jobs"] if j["name"] == job]
            around["daemon_step"] = j["last_step"]
            ref_norms.append(float("inf"))
            continue        # the reference skips it too
        got = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        ref_norms.append(float(got.full_tensor() if hasattr(got, "full_tensor") else got))
        opt.step()
        ref_opt.step()
    mine = torch.tensor(norms, dtype=torch.float64)
    each = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(each, mine)
    result = {"ours": full_params(ours), "ref": full_params(ref), "norms": norms,
              "ref_norms": ref_norms, "each_rank": [t.tolist() for t in each],
              "around": around, "ours_state": full_state(ours, opt)["optim"],
              "ref_state": full_state(ref, ref_opt)["optim"],
              "local_numels": [p.to_local().numel() for p in ours.parameters()]}
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    opt.close()


def restored_hsdp(world, sock, job, out, m, opt):
    """Under HSDP: the state saved through DCP and through the streaming checkpoint, loaded
    into a fresh HSDP model and optimizer; whether each is the saved full state, bit for bit."""
    want = full_state(m, opt)
    dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)},
             checkpoint_id=f"{out}.dcp")
    opt.save_checkpoint(f"{out}.own")
    same = {}
    for kind in ("dcp", "own"):
        m2, kw = build(world, True, seed=99, hsdp=True)
        m2 = shard(m2, kw)
        opt2 = zt.AdamW(m2.parameters(), lr=LR, weight_decay=WD, job=f"{job}-{kind}",
                        socket=sock)
        if kind == "dcp":
            load_dcp(m2, opt2, f"{out}.dcp")
        else:
            opt2.load_checkpoint(f"{out}.own")
        got = full_state(m2, opt2)
        same[kind] = (all(torch.equal(got["params"][k], v) for k, v in want["params"].items())
                      and all(torch.equal(got["optim"]["state"][k][key], v[key])
                              for k, v in want["optim"]["state"].items()
                              for key in ("step", "exp_avg", "exp_avg_sq")))
        opt2.close()
    return same


def ours_of(world, sock, job, seed=21):
    m, kw = build(world, True, seed=seed)
    m = shard(m, kw)
    return m, zt.AdamW(m.parameters(), lr=LR, weight_decay=WD, job=job, socket=sock)


def plain_steps(m, opt, rank, steps, first):
    for step in range(first, first + steps):
        opt.zero_grad()
        loss_of(m, step, rank).backward()
        opt.step()


def refused(world, sock, job):
    """Prints REFUSED and the error for each thing DTensor params refuse."""
    from torch.distributed.tensor import DTensor, Partial, Shard
    mesh = init_device_mesh("cpu", (world,))
    partial = [torch.nn.Parameter(DTensor.from_local(torch.ones(4), mesh, [Partial()]))]
    loose = [torch.nn.Parameter(DTensor.from_local(torch.ones(4), mesh, [Shard(0)]))]
    for what, params, kw in (("partial", partial, {}),
                             ("overlap", loose, {"overlap": True})):
        try:
            zt.AdamW(params, job=f"{job}-{what}", socket=sock, **kw).close()
        except (NotImplementedError, ValueError) as ex:
            print(f"REFUSED {what}: {type(ex).__name__}: {ex}", flush=True)


def save(rank, world, sock, job, out, steps):
    refused(world, sock, job)
    m, opt = ours_of(world, sock, job)
    plain_steps(m, opt, rank, steps, 1)
    dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)},
             checkpoint_id=os.path.join(out, "dcp"))
    opt.save_checkpoint(os.path.join(out, "own"))
    state = full_state(m, opt)
    if rank == 0:
        torch.save(state, os.path.join(out, "state.pt"))
    plain_steps(m, opt, rank, steps, steps + 1)
    after = full_params(m)
    opt.close()
    # A fresh model (other initial params) and optimizer from the DCP checkpoint.
    m2, opt2 = ours_of(world, sock, job + "-resumed", seed=99)
    load_dcp(m2, opt2, os.path.join(out, "dcp"))
    plain_steps(m2, opt2, rank, steps, steps + 1)
    resumed = full_params(m2)
    if rank == 0:
        torch.save(after, os.path.join(out, "after.pt"))
        torch.save(resumed, os.path.join(out, "resumed.pt"))
    dist.barrier()
    opt2.close()


def load_dcp(m, opt, path=None):
    sd = {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(m, sd["model"])
    set_optimizer_state_dict(m, opt, sd["optim"])


def load(rank, world, sock, job, out, kinds, steps):
    for kind in kinds.split(","):
        load_one(rank, world, sock, f"{job}-{kind}", out, kind, steps)


def load_one(rank, world, sock, job, out, kind, steps):
    m, opt = ours_of(world, sock, job, seed=99)
    if kind == "dcp":
        load_dcp(m, opt, os.path.join(out, "dcp"))
    else:
        opt.load_checkpoint(os.path.join(out, "own"))
    state = full_state(m, opt)
    if rank == 0:
        torch.save(state, os.path.join(out, f"loaded-{kind}-{world}.pt"))
    if kind == "dcp":
        ref, kw = build(world, True, seed=98)
        ref = shard(ref, kw)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
        load_dcp(ref, ref_opt, os.path.join(out, "dcp"))
        first = int(max(float(s["step"]) for s in state["optim"]["state"].values())) + 1
        lockstep(m, opt, ref, ref_opt, rank, steps, first=first, clip=False)
        got = {"ours": full_params(m), "ref": full_params(ref)}
        if rank == 0:
            torch.save(got, os.path.join(out, f"lockstep-{world}.pt"))
    dist.barrier()
    opt.close()


class Aligned(torch.nn.Module):
    """graft's model: l1, l2 (64 x 64) and l3 (33 x 64: 17 rows on rank 0, 16 and a padding
    row on rank 1) sharded on their own, one param each at offset 0 of its module's
    reduce-scatter output; the root's scale (6: 3 a rank) at 0 and w (64 x 64) at element 3,
    off a page boundary."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(64, 64, bias=False)
        self.l2 = torch.nn.Linear(64, 64, bias=False)
        self.l3 = torch.nn.Linear(64, 33, bias=False)
        self.scale = torch.nn.Parameter(torch.linspace(0.8, 1.2, 6))
        self.w = torch.nn.Parameter(torch.randn(33, 64) * 0.1)

    def forward(self, x):
        h = self.l3(torch.relu(self.l2(torch.relu(self.l1(x))))) * self.scale.mean()
        return h @ self.w


def graft(rank, world, sock, job, out, steps):
    torch.manual_seed(5)
    base = Aligned()
    kw = dict(mesh=init_device_mesh("cpu", (world,)),
              offload_policy=CPUOffloadPolicy(pin_memory=False))

    def sharded(m):
        for layer in (m.l1, m.l2, m.l3):
            fully_shard(layer, **kw)
        return fully_shard(m, **kw)
    ref = sharded(copy.deepcopy(base))
    ours = sharded(base)
    opt = zt.AdamW(ours.parameters(), lr=LR, weight_decay=WD, job=job, socket=sock)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)

    def loss(m, step):
        g = torch.Generator().manual_seed(step * 16 + rank)
        x, y = torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)
        return torch.nn.functional.mse_loss(m(x), y)
    grad_err = 0.0
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=step != 4)
        ref_opt.zero_grad(set_to_none=step != 4)
        for m in (ours, ref):
            if step % 3 == 0:
                loss(m, 1000 + step).backward()
            loss(m, step).backward()
        # The grads the slots got against FSDP2's own reduce-scatter of the same model's.
        for p, q in zip(ours.parameters(), ref.parameters()):
            a, b = p.grad.to_local(), q.grad.to_local()
            grad_err = max(grad_err, float((a - b).abs().max() / b.abs().max()))
            q.grad = p.grad.detach().clone()
        opt.step()
        ref_opt.step()
    with torch.no_grad():
        final = (float(loss(ours, 0)), float(loss(ref, 0)))
    result = {"ours": full_params(ours), "ref": full_params(ref), "final_loss": final,
              "ours_state": full_state(ours, opt)["optim"],
              "ref_state": full_state(ref, ref_opt)["optim"]}
    stats = [None] * world
    dist.all_gather_object(stats, (opt.copy_stats(), grad_err))
    result["copy_stats"] = stats
    opt.close()
    if rank == 0:
        torch.save(result, out)
    dist.barrier()


def main():
    mode, rank, world, port, sock, job, out, *args = sys.argv[1:]
    rank, world = int(rank), int(world)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", rank=rank,
                            world_size=world)
    try:
        if mode == "train":
            train(rank, world, sock, job, out, args[0], args[1], int(args[2]))
        elif mode == "overlap":
            overlap(rank, world, sock, job, out, int(args[0]))
        elif mode == "clip":
            clip(rank, world, sock, job, out, args[0], int(args[1]), int(args[2]))
        elif mode == "graft":
            graft(rank, world, sock, job, out, int(args[0]))
        elif mode == "save":
            save(rank, world, sock, job, out, int(args[0]))
        elif mode == "load":
            load(rank, world, sock, job, out, args[0], int(args[1]))
        else:
            sys.exit(f"unknown mode {mode}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
