"""DTensor parameters (FSDP2's ``fully_shard``) for the zoffload.torch optimizers.

Under FSDP2 every parameter is a DTensor of the logical (global) shape whose local part,
``to_local()``, is this rank's shard: a view of the rank's padded shard storage (FSDP2 pads
dim 0 to a multiple of the world size; the padding is not part of the view).  The daemon
holds and steps only that local shard: registered by its own numel, gradients taken from
``grad.to_local()``, new params written back into the local view, in place, so that FSDP2's
next all-gather reads them.  With ``CPUOffloadPolicy`` the shard is a CPU tensor and the
copies are the plain-tensor ones (a memcpy each way); without it the shard lives where the
mesh does (on a CPU run that is a CPU tensor too: the same path; on a GPU, the CUDA copies).

Placements: ``Shard(d)`` on any mesh dimension, and ``Replicate()`` on one (HSDP's replicate
dimension, over any number of ranks).  A replicated shard is stepped once per shard group,
not once per replica: by the replica at coordinate 0 of the replicate dimension (the one rank
of the group every rank can name without asking, and the source rank 0 of the mesh's
replicate process group), which alone registers it; after each ``step()`` it broadcasts the
new shard over that group, in param order on every rank.  The replicas' gradients are equal
(HSDP all-reduces them over the group), so stepping them all would compute the same update
each time for the daemon's work and state times the replicas; the broadcast is one shard's
bytes per replica.  ``state_dict()`` broadcasts the moments the same way, so that every
replica returns them (DCP saves one copy of what is replicated): a collective, as DCP's
calls are.  ``Replicate()`` on two mesh dimensions and ``Partial()`` are refused.

A shard under ``fully_shard`` on the CPU (``CPUOffloadPolicy``, or a CPU mesh) is made a view
of its param slot, as a plain CPU param is (torch.py, ``param_views``): FSDP2 all-gathers
from the padded 1-D storage it keeps for the shard (``FSDPParam._sharded_param_data``), whose
first rows are the local tensor; that storage becomes the slot, so each step's new params
are what the next all-gather reads, with no copy out.  FSDP2 keeps a storage it finds
already padded (``reset_sharded_param`` compares storages), so its later resets leave the
view alone.  The slot holds the shard's elements and no more, so a padded shard (the last
ranks' when dim 0 does not divide by the shard group) stays a copy, as does one FSDP2 pins
(``pin_memory``: it would copy the shard into pinned memory of its own).

With ``overlap=True`` each shard's step is submitted as soon as FSDP2 hands over its
sharded gradient: FSDP2 calls the param's post-accumulate-grad hooks right after it assigns
(or accumulates) the gradient of its reduce-scatter, in backward, module by module.  The
daemon then steps the shards of the modules whose backward is done while backward goes on
through the others, and ``step()`` only waits (and submits any shard whose hook did not
run).  The shard may stay its slot's view then: FSDP2 reads a shard only to all-gather it,
for a module's forward and, resharded after forward, before the module's backward, never
after that module's reduce-scatter in the same backward; the new params are in the shard
once the daemon has written them, before ``step()`` returns.  Gradients accumulated over
micro-batches go without a reduce-scatter but the last one's
(``set_requires_gradient_sync(False)`` before the others): a second reduce-scatter of a
shard before ``step()`` raises, as a second backward does for plain params.

The shard's place in the logical parameter, ``(offset, numel of the whole)``, is what the
streaming checkpoint stores, so that a checkpoint made by N ranks restores into M: it is
exact for shards along dim 0 (FSDP2's default), whose flattened local part is one range of
the flattened whole; a shard along another dim is not one range and is refused there.
"""
import math
import weakref

import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:             # torch 1.13: no DTensor, nothing here applies
    DTensor = None
try:
    # Where fully_shard keeps each module's FSDPState (and so its FSDPParams): torch's own.
    from torch.distributed import _composable_state
except ImportError:
    _composable_state = None


def is_dtensor(t):
    return DTensor is not None and isinstance(t, DTensor)


def local(t):
    """t's local shard for a DTensor (a view, not a copy: written in place), else t."""
    if is_dtensor(t):
        # Outside autograd the local tensor itself (no view op is recorded).  step() runs
        # under no_grad already: entering it again, four times a param, was 2 ms of the
        # 5.8 ms a step of step()'s own Python under FSDP2 (100 M params, 48 shards).
        if not torch.is_grad_enabled():
            return t.to_local()
        with torch.no_grad():
            return t.to_local()
    return t


def _replicate_dims(p):
    mesh = p.device_mesh
    return [d for d, pl in enumerate(p.placements)
            if isinstance(pl, Replicate) and mesh.size(d) > 1]


def check(p, overlap, fp):
    """Refuses, by name, what the optimizer cannot step correctly as a DTensor param (fp: its
    FSDPParam, or None outside fully_shard)."""
    if not is_dtensor(p):
        return
    mesh = p.device_mesh
    for dim, pl in enumerate(p.placements):
        if isinstance(pl, (Shard, Replicate)):
            continue
        raise NotImplementedError(f"zoffload: a DTensor parameter placed as {pl} on mesh "
                                  f"dimension {dim}: only Shard() and Replicate() "
                                  "placements (FSDP2's and HSDP's) are supported")
    if len(_replicate_dims(p)) > 1:
        raise NotImplementedError(
            f"zoffload: a DTensor parameter replicated over mesh dimensions "
            f"{_replicate_dims(p)}: one replicate dimension (HSDP's) is supported")
    if overlap and fp is None:
        raise ValueError("zoffload: overlap=True with a DTensor parameter outside fully_shard: "
                         "only FSDP2 hands over a sharded gradient early (through the "
                         "parameter's post-accumulate-grad hooks, after its reduce-scatter)")


def replicated(p):
    """Whether p is replicated over more than one rank (HSDP's replicate dimension)."""
    return is_dtensor(p) and bool(_replicate_dims(p))


def steps_here(p):
    """Whether this rank steps p: always, but for a replica another rank steps (above)."""
    if not replicated(p):
        return True
    return p.device_mesh.get_local_rank(_replicate_dims(p)[0]) == 0


def from_stepper(p, t):
    """t, on every replica of p, as the rank that steps p has it (a broadcast over p's
    replicate group; every replica calls it, in the same order).  Returns t, or a copy on
    p's device when t is elsewhere (the group's backend needs it there)."""
    if not replicated(p) or t.numel() == 0:
        return t
    group = p.device_mesh.get_group(_replicate_dims(p)[0])
    dev = local(p).device
    moved = t if t.device == dev and t.is_contiguous() else t.to(dev).contiguous()
    dist.broadcast(moved, src=dist.get_global_rank(group, 0), group=group)
    if moved is not t and t.device == dev:
        t.copy_(moved)
        return t
    return moved


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


def fsdp_param_groups():
    """Every FSDPParamGroup of the modules fully_shard has sharded."""
    out = []
    mapping = getattr(_composable_state, "_module_state_mapping", None) or {}
    for ref in list(mapping.values()):
        state = ref() if isinstance(ref, weakref.ref) else ref
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        out.extend(g for g in groups if g is not None)
    return out


def _fsdp_index():
    """{id(sharded param): FSDPParam} over every module fully_shard has sharded."""
    return {id(fp.sharded_param): fp for group in fsdp_param_groups()
            for fp in getattr(group, "fsdp_params", ())}


def fsdp_param(p, cache):
    """The FSDPParam (fully_shard's record of a sharded param) whose sharded param p is, or
    None.  cache: a dict the caller keeps, filled again on a miss."""
    if not is_dtensor(p):
        return None
    fp = cache.get(id(p))
    if fp is None or fp.sharded_param is not p:
        cache.clear()
        cache.update(_fsdp_index())
        fp = cache.get(id(p))
    return fp if fp is not None and fp.sharded_param is p else None


def view_refusal(p, fp):
    """Why p's shard cannot be its param slot's view (None when it can; see above)."""
    if fp is None:
        return "DTensor outside fully_shard"
    t = local(p)
    data = getattr(fp, "_sharded_param_data", None)
    if type(data) is not torch.Tensor or type(t) is not torch.Tensor:
        return "FSDP2's shard storage"
    if tuple(getattr(fp, "padded_sharded_param_size", ())) != tuple(t.shape):
        return "padded shard"
    if getattr(fp, "pin_memory", False):
        return "FSDP2 pins its shard"
    if not t.is_contiguous() or data.data_ptr() != t.data_ptr():
        return "FSDP2's shard storage"
    return None


def set_shard(p, fp, flat):
    """p's shard and FSDP2's storage of it become flat (the shard's elements, 1-D): what the
    next all-gather reads and what p.to_local() is."""
    shape = local(p).shape
    fp._sharded_param_data = flat
    p._local_tensor = flat.view(shape)


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
