"""DTensor parameters (FSDP2's ``fully_shard``) for the zoffload.torch optimizers.

Under FSDP2 every parameter is a DTensor of the logical (global) shape whose local part,
``to_local()``, is this rank's shard: a view of the rank's padded shard storage (FSDP2 pads
dim 0 to a multiple of the world size; the padding is not part of the view).  The daemon
holds and steps only that local shard: registered by its own numel, gradients taken from
``grad.to_local()``, new params written back into the local view, in place, so that FSDP2's
next all-gather reads them.  With ``CPUOffloadPolicy`` the shard is a CPU tensor and the
copies are the plain-tensor ones (a memcpy each way); without it the shard lives where the
mesh does (on a CPU run that is a CPU tensor too: the same path; on a GPU, the CUDA copies).

Placements: ``Shard(d)`` on any mesh dimension, and ``Replicate()`` on a mesh dimension of
size 1.  ``Replicate()`` over more than one rank (HSDP's replicate dimension) is refused:
every replica would step the same shard (the daemon's work and state times the replicas), and
stepping one of them needs a broadcast of the new params over the replicate group inside
``step()``, which is not built.  ``Partial()`` is not a parameter's placement.

The shard's place in the logical parameter, ``(offset, numel of the whole)``, is what the
streaming checkpoint stores, so that a checkpoint made by N ranks restores into M: it is
exact for shards along dim 0 (FSDP2's default), whose flattened local part is one range of
the flattened whole; a shard along another dim is not one range and is refused there.
"""
import math

import torch

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:             # torch 1.13: no DTensor, nothing here applies
    DTensor = None


def is_dtensor(t):
    return DTensor is not None and isinstance(t, DTensor)


def local(t):
    """t's local shard for a DTensor (a view, not a copy: written in place), else t."""
    if is_dtensor(t):
        # Outside autograd the local tensor itself (no view op is recorded).
        with torch.no_grad():
            return t.to_local()
    return t


def check(p, overlap):
    """Refuses, by name, what the optimizer cannot step correctly as a DTensor param."""
    if not is_dtensor(p):
        return
    mesh = p.device_mesh
    for dim, pl in enumerate(p.placements):
        if isinstance(pl, Shard) or (isinstance(pl, Replicate) and mesh.size(dim) == 1):
            continue
        if isinstance(pl, Replicate):
            raise NotImplementedError(
                f"zoffload: a DTensor parameter replicated over mesh dimension {dim} "
                f"({mesh.size(dim)} ranks; HSDP's replicate dimension) is not supported: each "
                "replica would step the same shard.  Shard it over every rank (fully_shard on "
                "a 1-D mesh) instead")
        raise NotImplementedError(f"zoffload: a DTensor parameter placed as {pl} on mesh "
                                  f"dimension {dim}: only Shard() and Replicate() on a "
                                  "one-rank dimension are supported")
    if overlap:
        raise ValueError("zoffload: overlap=True with DTensor parameters (FSDP2): FSDP2 hands "
                         "over the sharded gradient after its reduce-scatter, not through the "
                         "parameter's gradient hook, so nothing would be submitted early")


def like(p, flat):
    """flat (this rank's shard, flattened) shaped as p: for a DTensor a DTensor of p's global
    shape, mesh and placements whose local part is flat (torch's own optimizers keep their
    moments so under FSDP2, and distributed checkpoints save them as such); else flat
    viewed as p."""
    if not is_dtensor(p):
        return flat.view(p.shape)
    loc = local(p)
    value = flat.view(loc.shape).to(loc.device)
    return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def place(p):
    """(offset, numel of the whole) of p's local shard in its flattened logical parameter;
    (0, numel) for a plain tensor."""
    if not is_dtensor(p):
        return 0, p.numel()
    loc = local(p)
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh,
                                                          p.placements)
    if tuple(shape) != tuple(loc.shape):
        raise RuntimeError(f"zoffload: a DTensor's local shard is {list(loc.shape)}, its "
                           f"placements say {list(shape)}")
    # One range of the flattened whole: every dim after the first whole.
    if any(o != 0 for o in offset[1:]) or tuple(shape[1:]) != tuple(p.shape[1:]):
        raise NotImplementedError(
            f"zoffload: a DTensor parameter of shape {list(p.shape)} sharded as "
            f"{list(p.placements)}: its local shard is not one range of the flattened "
            "parameter, which the streaming checkpoint stores (shard along dim 0, FSDP2's "
            "default, or save through torch.distributed.checkpoint)")
    row = math.prod(p.shape[1:])
    return (offset[0] if len(offset) else 0) * row, p.numel()
