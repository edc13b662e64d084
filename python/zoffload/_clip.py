"""The optimizers' own global gradient clipping, ``opt.clip_grad_norm_(max_norm)``: the norm
over every rank's gradients, computed by the daemon from the grad slots (zc_grad_pass), and an
overflow skip that every rank takes together.

torch.nn.utils.clip_grad_norm_ reads every gradient in Python and scales it in place; here the
gradients go into their grad slots (the copy step() makes anyway), the daemon sums their
squares in double, the ranks all-reduce those sums and their inf/NaN counts (two doubles),
and the next ``step()`` submits with torch's coefficient, ``max_norm / (norm + 1e-6)`` capped
at 1 (zc_clip_coef), which the daemon multiplies into each gradient as it steps.  p.grad is
left as it was.  When any rank has an inf or NaN gradient, every rank's next ``step()`` is
skipped: no param, moment or step count changes (what GradScaler does for fp16).

Whose shares are summed: ``group`` (a process group) when given.  Otherwise, when the
optimizer holds DTensor params (FSDP2, HSDP) and torch.distributed is initialized, the
default group: each rank holds a disjoint shard (an HSDP replica that does not step a shard
holds none of it, see _dtensor.py), so the sum over all ranks is the whole model's (under
HSDP the stepping replica's gradients are counted, the replicas' being equal after HSDP's
all-reduce).  Plain params (each rank a whole replica, as under DDP) are this rank's alone.
"""
import math

import torch

from . import _dtensor

_MAX_SET = 4096         # tensors in one gradient pass (ZP_MAX_STEP_TENSORS)


class Clip:
    """What clip_grad_norm_ left for the next step(): the coefficient, or a skip."""
    __slots__ = ("coef", "skip")

    def __init__(self, coef, skip):
        self.coef, self.skip = coef, skip


def _default_group(opt):
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    params = (p for g in opt.param_groups for p in g["params"])
    return dist.group.WORLD if any(_dtensor.is_dtensor(p) for p in params) else None


def clip_grad_norm_(opt, max_norm, norm_type=2.0, error_if_nonfinite=False, group=None):
    """The optimizer's clip_grad_norm_ (see its doc): returns the global norm."""
    if float(norm_type) != 2.0:
        raise ValueError(f"zoffload: clip_grad_norm_ with norm_type={norm_type}: the daemon "
                         "computes the L2 norm only (norm_type=2)")
    max_norm = float(max_norm)
    if not (max_norm > 0 and math.isfinite(max_norm)):
        raise ValueError(f"zoffload: clip_grad_norm_'s max_norm must be a positive number, not "
                         f"{max_norm}")
    if opt.overlap:
        raise ValueError("zoffload: clip_grad_norm_ with overlap=True: each param's step was "
                         "submitted from its gradient hook, before the norm of them all is known")
    if opt._conn.closed:
        raise RuntimeError("zoffload: clip_grad_norm_() after close()")
    opt._finish()
    opt._follow()
    tensors = []
    for g in opt.param_groups:
        for p in g["params"]:
            e = opt._entries.get(p)
            if e is None or p.grad is None:
                continue
            opt._put_grad(p, e, p.grad, g)
            tensors.append(e.zt)
    sumsq, nonfinite = 0.0, 0
    for i in range(0, len(tensors), _MAX_SET):
        part = opt._conn.grad_pass(tensors[i:i + _MAX_SET])
        sumsq += part["sumsq"]
        nonfinite += part["nonfinite"]
    if group is None:
        group = _default_group(opt)
    if group is not None:
        # Where the group's backend takes it: NCCL only reduces CUDA tensors (gloo, and a
        # "cpu:gloo,cuda:nccl" group, take CPU ones).
        dev = ("cuda" if str(torch.distributed.get_backend(group)) == "nccl" else "cpu")
        shares = torch.tensor([sumsq, float(nonfinite)], dtype=torch.float64, device=dev)
        torch.distributed.all_reduce(shares, group=group)
        sumsq, nonfinite = shares[0].item(), int(shares[1].item())
    if nonfinite:
        if error_if_nonfinite:
            opt._clip = None
            raise RuntimeError(f"zoffload: the total norm of the gradients is non-finite "
                               f"({nonfinite} inf/NaN elements), so it cannot be clipped "
                               "(error_if_nonfinite=True)")
        opt._clip = Clip(1.0, True)
        return torch.tensor(float("inf"))
    opt._clip = Clip(opt._conn.clip_coef(max_norm, sumsq), False)
    return torch.tensor(math.sqrt(sumsq))
