"""DeepSpeed's ZeRO with zoffloadd holding the optimizer: a DeepSpeed script changes one import::

    import zoffload.deepspeed as deepspeed      # was: import deepspeed
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model,
                                                   model_parameters=model.parameters())

``initialize`` takes ``deepspeed.initialize``'s arguments, and zoffload's own (keyword only:
``job``, ``socket``, ``reconnect_ms``, ``resume``, ``state_format``, ``pinned_budget``; see
zoffload.torch).  From the DeepSpeed config (``config``, ``config_params`` or
``args.deepspeed_config``; a path or a dict, never changed in place) it:

- builds the zoffload optimizer from the ``optimizer`` block: ``type`` AdamW, Adam (AdamW
  unless ``adam_w_mode`` is false, as DeepSpeed's), Adagrad or Lion, and its ``lr``,
  ``betas``, ``eps``, ``weight_decay``.  Any other type, or a parameter the zoffload step has
  not, is refused by name; so is an ``optimizer=`` argument that is not a zoffload
  optimizer (its state would not be in the daemon);
- sets the keys DeepSpeed needs to step it under ZeRO: ``zero_allow_untested_optimizer`` and
  ``zero_force_ds_cpu_optimizer: false``;
- maps ``zero_optimization.offload_optimizer`` to the job's policy: ``device: "cpu"`` is
  ``policy="cpu"``; ``device: "nvme"`` is ``policy="nvme"`` (the state on the daemon's swap
  paths), and ``nvme_path`` must be one of the daemon's ``swap.paths`` (or inside one), else
  the call fails saying which paths the daemon has.  DeepSpeed itself is given
  ``device: "cpu"``: its fp32 partitions stay in host memory, where the daemon's step reads
  the gradients and writes the parameters, and its own NVMe swapper does not run;
- takes the job's name from ``job``, else the launcher's environment (``$ZOFFLOAD_JOB``, or
  torchrun's run id, as zoffload.torch); a launch that gives neither (DeepSpeed's own
  launcher has no run id) gets a name rank 0 draws and shares over the process group, new at
  every launch.

Under ZeRO-1/2/3 the gradients' unscale and clip (``gradient_clipping``, fp16's loss scale),
a pass DeepSpeed makes over every gradient before the step, is folded into the daemon's step
(``_fold_unscale``): the same bits, one pass fewer.

Every other name of the module is DeepSpeed's own (``deepspeed.zero``, ``add_config_arguments``,
``init_distributed``, ...).

Under ZeRO, DeepSpeed hands the optimizer its flat fp32 partitions, not the model's params;
zoffload.torch registers each at its first step (see ``_follow`` there).
``engine.save_checkpoint`` / ``load_checkpoint`` go through the optimizer's ``state_dict`` /
``load_state_dict`` and resume bit for bit.  For a big model, ``save_checkpoint(engine, dir)``
and ``load_checkpoint(engine, dir)`` of this module take the same arguments and write
DeepSpeed's files but the ZeRO optimizer's: the daemon streams the optimizer's state from
its tiers into the checkpoint, placed by the model's parameter names, and it restores into
another data-parallel world size (see _ds_checkpoint.py).
"""
import copy
import json
import os
import secrets

import torch

from . import _clip, _zclient
from . import torch as zt
from ._ds_checkpoint import load_checkpoint, save_checkpoint

__all__ = ["initialize", "optimizer_from_config", "save_checkpoint", "load_checkpoint"]

_ZOFFLOAD_KEYS = ("job", "socket", "reconnect_ms", "resume", "state_format", "pinned_budget")
_TYPES = {"adamw": "AdamW", "adam": "Adam", "adagrad": "Adagrad", "lion": "Lion"}
# The block's params each class takes; DeepSpeed's implementation switches, read or moot.
_PARAMS = {
    "AdamW": ("lr", "betas", "eps", "weight_decay"),
    "Adam": ("lr", "betas", "eps", "weight_decay"),
    "Adagrad": ("lr", "eps", "weight_decay", "lr_decay"),
    "Lion": ("lr", "betas", "weight_decay"),
}
_IGNORED = ("adam_w_mode", "torch_adam", "fused")


def __getattr__(name):
    """Everything else is DeepSpeed's (deepspeed.zero, add_config_arguments, init_distributed,
    comm...), so that a script that imports this module as deepspeed changes nothing else."""
    if name.startswith("__"):
        raise AttributeError(name)
    import deepspeed
    return getattr(deepspeed, name)


def _load_config(config):
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            return json.load(f)
    if not isinstance(config, dict):
        raise TypeError(f"zoffload.deepspeed: the DeepSpeed config must be a path or a dict, "
                        f"not {type(config).__name__}")
    return copy.deepcopy(config)


def optimizer_from_config(block):
    """(zoffload.torch class, its keyword arguments) for a DeepSpeed ``optimizer`` block."""
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise ValueError("zoffload.deepspeed: the config's optimizer block needs a \"type\"")
    name = _TYPES.get(block["type"].lower())
    if name is None:
        raise ValueError(f"zoffload.deepspeed: optimizer type '{block['type']}' has no "
                         "zoffload equivalent: the daemon steps AdamW, Adam, Adagrad and Lion")
    params = dict(block.get("params") or {})
    if name == "Adam" and params.get("adam_w_mode", True):
        name = "AdamW"          # DeepSpeed's Adam is AdamW unless adam_w_mode is false
    kwargs = {}
    for key, value in params.items():
        if value == "auto":
            raise ValueError(f"zoffload.deepspeed: optimizer.params.{key} is \"auto\" (the HF "
                             "Trainer fills it in at run time): give the value")
        if key in _IGNORED:
            continue
        if key == "amsgrad" and not value:
            continue
        if key == "bias_correction" and value:
            continue
        if key not in _PARAMS[name]:
            raise ValueError(f"zoffload.deepspeed: optimizer.params.{key} ({value!r}) has no "
                             f"equivalent in zoffload's {name} step")
        kwargs[key] = tuple(value) if key == "betas" else value
    return getattr(zt, name), kwargs


def _check_nvme_path(socket, nvme_path):
    """nvme_path must be one of the daemon's swap paths, or inside one (asked before any
    state is registered there)."""
    conn = _zclient.Connection(socket)
    try:
        stats = json.loads(conn.stats())
    finally:
        conn.close()
    paths = [p["path"] for p in stats["tiers"].get("nvme", {}).get("paths", [])]
    if not paths:
        raise ValueError("zoffload.deepspeed: offload_optimizer.device is \"nvme\" but the "
                         "daemon has no swap.paths: add nvme_path to its zoffload.conf "
                         "(zoffctl import-deepspeed prints the block)")
    if nvme_path is None:
        return
    want = os.path.realpath(os.fspath(nvme_path))
    for p in paths:
        real = os.path.realpath(p)
        if want == real or want.startswith(real.rstrip("/") + "/"):
            return
    raise ValueError(f"zoffload.deepspeed: offload_optimizer.nvme_path {nvme_path} is not "
                     f"one of the daemon's swap paths ({', '.join(paths)}): the daemon keeps "
                     "the state on its own swap.paths; add it there or name one of those")


def _job_name(job):
    try:
        return zt._default_job(job)
    except ValueError:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            raise
        # No name from the launcher (DeepSpeed's own sets no run id): rank 0 draws one for
        # this launch, as for torchrun without --rdzv-id.
        drawn = [secrets.token_hex(8) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(drawn, src=0)
        return "deepspeed-" + drawn[0]


# Tests turn it off to compare against DeepSpeed's own pass.
_FOLD_UNSCALE = True


def _fold_unscale(zero, optimizer):
    """Under ZeRO, DeepSpeed multiplies each flat gradient partition (ZeRO-1/2) or sub-group
    (ZeRO-3) by 1 / (loss scale x clip factor) just before the optimizer steps it, wherever
    gradient_clipping or a loss scale is set: a pass over every gradient (read and write, 8 B
    a parameter), most steps by 1.  Here the daemon's step multiplies by the same factor as it
    loads each gradient (the kernel's clip coefficient, an fp32 multiply as DeepSpeed's mul_
    is), so the step's result is the same bits and the pass is gone.  The factor is
    DeepSpeed's own: its method is run on a one-element tensor of ones, which it leaves
    holding the fp32 factor it would multiply by (or leaves at 1 where it would not
    multiply).  The factor is the next step()'s alone, which is the one of that partition or
    sub-group."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    if zero.optimizer is not optimizer:
        return
    unscale = zero.unscale_and_clip_grads
    if isinstance(zero, DeepSpeedZeroOptimizer):
        def factor_of(grad_groups_flat, total_norm):
            first = grad_groups_flat[0] if grad_groups_flat else None
            while isinstance(first, list):
                first = first[0] if first else None
            if first is None or first.dtype != torch.float32:
                return None
            probe = torch.ones(1, dtype=first.dtype)
            unscale([probe], total_norm)
            return probe
    elif isinstance(zero, DeepSpeedZeroOptimizer_Stage3):
        class _Probe:
            """Stands for fp32_partitioned_groups_flat during one call of DeepSpeed's method:
            every sub-group's gradient is the probe."""
            def __init__(self, grad):
                self.grad = grad

            def __getitem__(self, sub_group_id):
                return self

        def factor_of(sub_group_id, total_norm):
            groups = zero.fp32_partitioned_groups_flat
            grad = groups[sub_group_id].grad
            if grad is None or grad.dtype != torch.float32:
                return None
            probe = torch.ones(1, dtype=grad.dtype)
            zero.fp32_partitioned_groups_flat = _Probe(probe)
            try:
                unscale(sub_group_id, total_norm)
            finally:
                zero.fp32_partitioned_groups_flat = groups
            return probe
    else:
        return

    def unscale_and_clip_grads(grads, total_norm):
        probe = None if optimizer._clip is not None else factor_of(grads, total_norm)
        if probe is None:
            return unscale(grads, total_norm)
        factor = probe.item()
        if factor != 1.0:
            optimizer._clip = _clip.Clip(factor, False)
        unscale_and_clip_grads.folded += 1

    unscale_and_clip_grads.folded = 0
    zero.unscale_and_clip_grads = unscale_and_clip_grads


def _relink_after_steps(zero, optimizer):
    """Under ZeRO-1/2 DeepSpeed maps each model param to views of its flat fp32 partition and
    of the partition's gradient (its _hp_mapping and offload_gradient_dict), made once at
    initialize.  zoffload.torch makes the partition's storage the param slot's view and its
    gradient the grad slot at the first step, so those views went on reading the storages
    it replaced: deepspeed.utils' safe_get_full_fp32_param gave the initial masters,
    safe_get_full_grad no gradient, a safe_set_full_fp32_param was lost, and the dead
    storages (8 B a parameter) were never freed.  After a step that replaced a storage,
    DeepSpeed's own linking is run again over the storages as they are now; its optimizer
    state's views are made anew at the next step, as DeepSpeed makes them at the first.
    The same when close() hands the partitions private copies of the slots, which go away
    (after engine.destroy(), which drops the param maps, only the gradient views are left to
    let go of).  ZeRO-3 reads its partitions afresh at each access."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(zero, DeepSpeedZeroOptimizer) or zero.optimizer is not optimizer:
        return
    step = zero.step

    def storages():
        return [(p.data_ptr(), None if p.grad is None else p.grad.data_ptr())
                for p in zero.single_partition_of_fp32_groups]

    linked = storages()

    def relinking_step(*args, **kwargs):
        nonlocal linked
        out = step(*args, **kwargs)
        now = storages()
        if now != linked and not (zero.cpu_offload and any(g is None for _, g in now)):
            zero._link_all_hp_params()
            zero._hp_optimizer_states_linked = False
            linked = now
        return out

    def views_dropped():
        if any(getattr(lp, "_hp_mapping", None) is not None
               for group in zero.bit16_groups for lp in group):
            zero._link_all_hp_params()
        elif zero.cpu_offload:
            zero.offload_gradient_dict.clear()

    zero.step = relinking_step
    optimizer._views_dropped_hooks.append(views_dropped)


def initialize(args=None, model=None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port=None, mpu=None,
               dist_init_required=None, collate_fn=None, config=None, mesh_param=None,
               config_params=None, **zoffload):
    """deepspeed.initialize with the optimizer's state and step in zoffloadd (module doc)."""
    import deepspeed

    unknown = set(zoffload) - set(_ZOFFLOAD_KEYS)
    if unknown:
        raise TypeError(f"zoffload.deepspeed.initialize: unexpected keyword arguments "
                        f"{sorted(unknown)}")
    if config is None:
        config = config_params
    if getattr(args, "deepspeed_config", None) is not None:
        if config is not None:
            raise ValueError("zoffload.deepspeed: a DeepSpeed config in both args.deepspeed_config "
                             "and config=: give one")
        config = args.deepspeed_config
        args = copy.copy(args)
        args.deepspeed_config = None
    if config is None:
        raise ValueError("zoffload.deepspeed: no DeepSpeed config (config=, config_params= or "
                         "args.deepspeed_config)")
    cfg = _load_config(config)
    zero = cfg.get("zero_optimization") or {}
    offload = dict(zero.get("offload_optimizer") or {})
    device = offload.get("device", "none")
    policy = {"cpu": "cpu", "nvme": "nvme"}.get(device)
    if device == "nvme":
        offload["device"] = "cpu"       # DeepSpeed's own swapper must not run
        nvme_path = offload.pop("nvme_path", None)
        for key in ("buffer_count", "pipeline_read", "pipeline_write", "fast_init"):
            offload.pop(key, None)      # its swapper's settings: the daemon has its own
        cfg["zero_optimization"] = dict(zero, offload_optimizer=offload)

    if torch.distributed.is_available() and not torch.distributed.is_initialized() \
            and dist_init_required is not False:
        # As deepspeed.initialize would, and before the optimizer: it takes its rank, world
        # size and (where the launcher names none) its job's name from the process group.
        kw = {} if distributed_port is None else {"distributed_port": distributed_port}
        deepspeed.init_distributed(dist_init_required=dist_init_required, **kw)

    if device == "nvme":
        _check_nvme_path(zoffload.get("socket"), nvme_path)
    block = cfg.pop("optimizer", None)
    built = optimizer is None
    if optimizer is None:
        if block is None:
            raise ValueError("zoffload.deepspeed: the DeepSpeed config has no optimizer block "
                             "and no optimizer= was given: say which optimizer to step")
        cls, kwargs = optimizer_from_config(block)
        params = model_parameters if model_parameters is not None else \
            [p for p in model.parameters() if p.requires_grad]
        zkw = {k: v for k, v in zoffload.items() if k != "job"}
        optimizer = cls(params, **kwargs, job=_job_name(zoffload.get("job")), policy=policy,
                        **zkw)
    elif not isinstance(optimizer, zt._ZoffloadOptimizer):
        raise TypeError(f"zoffload.deepspeed: optimizer= is a {type(optimizer).__name__}, not "
                        "a zoffload.torch optimizer: its state would not be in the daemon "
                        "(leave optimizer= out and say it in the config's optimizer block)")
    elif block is not None:
        raise ValueError("zoffload.deepspeed: an optimizer both in the config and as "
                         "optimizer=: give one")
    elif policy is not None:
        jobs = json.loads(optimizer.jobs())["jobs"]
        has = next((j["policy"] for j in jobs if j["name"] == optimizer.job), None)
        if has != policy:
            raise ValueError(f"zoffload.deepspeed: offload_optimizer.device is \"{device}\" "
                             f"but the optimizer's job '{optimizer.job}' has policy {has}: "
                             f"build it with policy=\"{policy}\", or leave optimizer= out")
    try:
        cfg["zero_allow_untested_optimizer"] = True
        cfg["zero_force_ds_cpu_optimizer"] = False
        kw = {} if distributed_port is None else {"distributed_port": distributed_port}
        out = deepspeed.initialize(args=args, model=model, optimizer=optimizer,
                                   model_parameters=None, training_data=training_data,
                                   lr_scheduler=lr_scheduler, mpu=mpu,
                                   dist_init_required=dist_init_required,
                                   collate_fn=collate_fn, config=cfg, mesh_param=mesh_param,
                                   **kw)
        if _FOLD_UNSCALE:
            _fold_unscale(out[0].optimizer, optimizer)
        _relink_after_steps(out[0].optimizer, optimizer)
        return out
    except BaseException:
        if built:
            optimizer.close()
        raise
