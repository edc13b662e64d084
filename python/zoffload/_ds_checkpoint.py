"""zoffload.deepspeed.save_checkpoint / load_checkpoint: DeepSpeed's checkpoint with the
optimizer's state streamed by the daemon, placed by the model's parameter names.

``engine.save_checkpoint`` gets the optimizer's state through ``state_dict()``: every moment
read out of the daemon into the trainer's memory (8 B a parameter more, all of it at once,
and NVMe state read in first), then pickled by one rank file per rank.  These two functions
keep DeepSpeed's own files for everything else (the model's weights, the learning-rate
scheduler, the engine's counters, the client state) and write no ZeRO optimizer files;
the optimizer's state (master, moments, step) goes into ``SAVE_DIR/TAG/zoffload``, which
the daemon streams from wherever the state lives, as zoffload.torch's save_checkpoint does.
Under ZeRO-3 DeepSpeed's ZeRO files are still written, for the weights they carry, with a
reference to the streamed state in place of the optimizer's (see _StateByReference).

Each flat partition DeepSpeed hands the optimizer holds parts of several model parameters
and padding.  It is saved as one piece a parameter, under the parameter's name
(``engine.module.named_parameters()``) and at its offset in the parameter:

- ZeRO-1/2: each parameter's ``_hp_mapping`` (DeepSpeed's own map of which of its elements
  sit where in this rank's partition);
- ZeRO-3: each sub-group's partition is its parameters' partitions end to end, each
  ``partition_numel()`` long, this rank's elements ``[rank * partition_numel, ...)`` of the
  parameter, the rest of the last rank's padding.

So the state restores into any layout of those parameters: another data-parallel world
size under ZeRO-1/2 (DeepSpeed's own rigid ZeRO checkpoint only restores into the one it
was saved with), or zoffload.torch outside DeepSpeed.  Under ZeRO-3, DeepSpeed's files need
the world size they were saved with.  The loss scaler (fp16's scale and
its counters), which DeepSpeed keeps in the ZeRO files, travels in the client state under
``"zoffload.deepspeed"``.
"""
import os

_KEY = "zoffload.deepspeed"


def _zero(engine):
    from . import torch as zt

    zero = engine.optimizer
    opt = getattr(zero, "optimizer", None)
    if not isinstance(opt, zt._ZoffloadOptimizer) or not engine.zero_optimization():
        raise TypeError("zoffload.deepspeed: save_checkpoint / load_checkpoint are for an "
                        "engine under ZeRO whose optimizer is zoffload's (made by "
                        "zoffload.deepspeed.initialize); use engine.save_checkpoint otherwise")
    return zero, opt


def _names(engine):
    names = {}
    for name, p in engine.module.named_parameters():
        names.setdefault(p, name)
    return names


def _stage3(zero):
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    return isinstance(zero, DeepSpeedZeroOptimizer_Stage3)


def _unnamed(p):
    raise ValueError(f"zoffload.deepspeed: a parameter of shape {list(p.shape)} that DeepSpeed "
                     "partitions is not one of engine.module's named parameters")


def places(engine):
    """{flat partition: [(offset, count, parameter name, offset in it, its numel)]} of this
    rank (see the module's doc); under ZeRO-3 the partitions of every sub-group."""
    import deepspeed.comm as dist

    zero, _ = _zero(engine)
    names = _names(engine)
    out = {}
    if _stage3(zero):
        for i, (group, flat) in enumerate(zip(zero.fp16_groups, zero.fp32_partitioned_groups_flat)):
            rank = dist.get_rank(group=zero.sub_group_process_groups[i])
            at, pieces = 0, []
            for p in group:
                n = p.partition_numel()
                start = rank * n
                count = min(n, p.ds_numel - start)
                if count > 0:
                    pieces.append((at, count, names.get(p) or _unnamed(p), start, p.ds_numel))
                at += n
            if at != flat.numel():
                raise RuntimeError(f"zoffload.deepspeed: ZeRO-3 sub-group {i}'s partition holds "
                                   f"{flat.numel()} elements, its parameters' partitions "
                                   f"{at}: a layout this module does not know")
            if pieces:
                out[flat] = pieces
        return out
    for i, flat in enumerate(zero.single_partition_of_fp32_groups):
        pieces = []
        for lp in zero.bit16_groups[i]:
            m = getattr(lp, "_hp_mapping", None)
            if m is None:
                continue        # none of its elements in this rank's partition
            hp, lpa = m.get_hp_fragment_address(), m.lp_fragment_address
            pieces.append((hp.start, hp.numel, names.get(lp) or _unnamed(lp), lpa.start,
                           lp.numel()))
        if pieces:
            out[flat] = sorted(pieces)
    return out


class _Fp32Groups:
    """Under ZeRO-3 DeepSpeed puts the sub-groups' partitions into the optimizer's param
    groups only around its calls (as its own state_dict does)."""

    def __init__(self, zero):
        self.zero = zero if _stage3(zero) else None

    def __enter__(self):
        if self.zero is not None:
            self.zero._set_fp32_optimizer_param_groups()

    def __exit__(self, *exc):
        if self.zero is not None:
            self.zero._clear_fp32_optimizer_param_groups()


class _StateByReference:
    """Under ZeRO-3 DeepSpeed's own files are written and read as they are (its model files
    hold no ZeRO-3 weights: its ZeRO files' fp32 partitions do, and it reads nothing else
    when it loads them), but the optimizer's state_dict there is a reference to the
    streamed state, not the state: no moment goes through the trainer's memory.  A
    reference reaching the optimizer's own load_state_dict is refused by name (see
    zoffload.torch), so that DeepSpeed's engine.load_checkpoint of such a checkpoint never
    starts from moments it did not restore."""

    def __init__(self, opt, where):
        self.opt, self.where, self.seen = opt, where, False

    def state_dict(self):
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
        return {"state": {}, "param_groups": [dict(g, params=[]) for g in groups],
                _KEY: self.where}

    def load_state_dict(self, state_dict):
        if not isinstance(state_dict, dict) or _KEY not in state_dict:
            raise ValueError("zoffload.deepspeed.load_checkpoint: the checkpoint's optimizer "
                             "state is DeepSpeed's own, not a streamed one: load it with "
                             "engine.load_checkpoint")
        self.seen = True

    def __enter__(self):
        self.opt.state_dict, self.opt.load_state_dict = self.state_dict, self.load_state_dict
        return self

    def __exit__(self, *exc):
        del self.opt.state_dict, self.opt.load_state_dict


def save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest=True,
                    exclude_frozen_parameters=False):
    """engine.save_checkpoint with the optimizer's state streamed by the daemon into
    SAVE_DIR/TAG/zoffload (module doc); the same arguments."""
    zero, opt = _zero(engine)
    if tag is None:
        tag = f"global_step{engine.global_steps}"
    tag = str(tag)
    client_state = dict(client_state or {})
    if _KEY in client_state:
        raise ValueError(f"zoffload.deepspeed: client_state key '{_KEY}' is this module's")
    client_state[_KEY] = {"loss_scaler": zero.loss_scaler,
                          "dynamic_loss_scale": zero.dynamic_loss_scale,
                          "overflow": zero.overflow}
    # The state first: DeepSpeed's 'latest' names the tag only once both are whole.
    where = os.path.join(save_dir, tag, "zoffload")
    with _Fp32Groups(zero):
        opt.save_checkpoint(where, places=places(engine))
    kw = dict(tag=tag, client_state=client_state, save_latest=save_latest,
              exclude_frozen_parameters=exclude_frozen_parameters)
    if _stage3(zero):
        with _StateByReference(opt, "zoffload"):
            return engine.save_checkpoint(save_dir, **kw)
    kept = engine.save_zero_checkpoint
    engine.save_zero_checkpoint = False
    try:
        return engine.save_checkpoint(save_dir, **kw)
    finally:
        engine.save_zero_checkpoint = kept


def load_checkpoint(engine, load_dir, tag=None, load_module_strict=True,
                    load_lr_scheduler_states=True):
    """engine.load_checkpoint of a checkpoint save_checkpoint made, into a fresh engine
    (no step taken); returns (load_path, client_state) as DeepSpeed's, (None, None) when
    there is none."""
    zero, opt = _zero(engine)
    kw = dict(tag=tag, load_module_strict=load_module_strict,
              load_lr_scheduler_states=load_lr_scheduler_states)
    if _stage3(zero):
        # DeepSpeed's ZeRO files give the weights (and refuse another world size, as
        # DeepSpeed's own ZeRO-3 load does).
        with _StateByReference(opt, "zoffload") as ref:
            path, client = engine.load_checkpoint(load_dir, load_optimizer_states=True, **kw)
        if path is not None and not ref.seen:
            raise ValueError(f"zoffload.deepspeed: {load_dir} has no ZeRO files of a streamed "
                             "checkpoint (not saved by zoffload.deepspeed.save_checkpoint)")
    else:
        # No ZeRO files are read: the weights come from DeepSpeed's model file, the
        # partitions of any world size from the streamed state.
        path, client = engine.load_checkpoint(load_dir, load_optimizer_states=False, **kw)
    if path is None:
        return None, None
    client = dict(client or {})
    saved = client.pop(_KEY, None)
    where = os.path.join(os.path.dirname(path), "zoffload")
    if saved is None or not os.path.isdir(where):
        raise ValueError(f"zoffload.deepspeed: {os.path.dirname(path)} was not saved by "
                         "zoffload.deepspeed.save_checkpoint (no optimizer state in "
                         f"{where}); engine.load_checkpoint loads DeepSpeed's own")
    zero.loss_scaler = saved["loss_scaler"]
    zero.dynamic_loss_scale = saved["dynamic_loss_scale"]
    zero.overflow = saved["overflow"]
    with _Fp32Groups(zero):
        opt.load_checkpoint(where, places=places(engine))
    if not _stage3(zero):
        # DeepSpeed's views of the partitions (safe_get_full_fp32_param...) onto the
        # restored tensors, before any step.  (Under ZeRO-3 DeepSpeed read its low-precision
        # partitions from its own files' masters, which the same save wrote alike.)
        zero._link_all_hp_params()
        zero._hp_optimizer_states_linked = False
    return path, client
