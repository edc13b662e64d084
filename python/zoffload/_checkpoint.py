"""save_checkpoint / load_checkpoint of the zoffload.torch optimizers, over the daemon's
streaming checkpoint (zc_checkpoint_save, zc_tensor_register_checkpoint).

A checkpoint directory holds, per rank, the daemon's ``rank-RRRRR-of-WWWWW.safetensors``
(master, moments, step per tensor, CRC-checked; see README "Checkpoints") and this module's
``zoffload-torch-rank-RRRRR-of-WWWWW.json``: the optimizer, the param groups'
hyperparameters, and per parameter its global name, shape, dtype and place.  Each rank
writes its own JSON file (temporary name, fsync, rename, fsync of the directory), after its
state file, so that a rank's pair is complete once its JSON file exists.

Global names: ``names`` / ``places`` map a param to its name (``{p: "layer.weight"}``) or to
its place ``(name, offset, numel of the whole parameter)`` for a shard, or (``places``) to a
list of pieces ``(offset, count, name, offset in it, its numel)`` for a flat buffer that holds
parts of several parameters (DeepSpeed's ZeRO partitions): each piece is saved under its
parameter's name, and the elements in no piece (padding) are not saved and restore as zero.
Without them a param is ``group{g}.param{i}`` (its position in param_groups), prefixed with
``rank{r}.`` when the world size is above 1: positions are those of what this rank's
optimizer sees (under ZeroRedundancyOptimizer, its partition), which another world size does
not share.  Names that are the model's (``model.named_parameters()``) restore into any world
size.

DTensor params (FSDP2's ``fully_shard``) are this rank's shard, placed in the logical param
by their placements (see _dtensor.py): ``names`` alone names the whole param, and without
names a DTensor param is ``group{g}.param{i}`` with no rank prefix (under FSDP2 every rank's
optimizer holds every param, in one order), so that N ranks' checkpoint restores into M.  A
rank with no elements of a param (a dim 0 shorter than the world) has nothing of it to save,
nor has an HSDP replica that another rank steps.
"""
import glob
import json
import os
import re

import torch

from . import _dtensor

_META = "zoffload-torch-rank-{:05d}-of-{:05d}.json"
_META_RE = re.compile(r"zoffload-torch-rank-(\d{5})-of-(\d{5})\.json$")
_FORMAT = "zoffload.torch/1"


def _pieces(p, position, given):
    """A flat buffer's pieces: [(offset, count, name, global offset, global numel)], checked."""
    n = _dtensor.local(p).numel()
    out = []
    for piece in given:
        try:
            off, count, name, goff, gnumel = piece
            off, count, goff, gnumel = int(off), int(count), int(goff), int(gnumel)
        except (TypeError, ValueError):
            raise TypeError(f"zoffload: parameter {position}: a piece is (offset, count, "
                            f"global name, global offset, global numel), not {piece!r}") from None
        if not isinstance(name, str) or not name:
            raise TypeError(f"zoffload: parameter {position}: its global name must be a "
                            f"non-empty str, not {name!r}")
        if count <= 0 or off < 0 or off + count > n or goff < 0 or goff + count > gnumel:
            raise ValueError(f"zoffload: parameter {position}: piece {piece!r} does not fit "
                             f"its {n} elements or '{name}' of {gnumel}")
        out.append((off, count, name, goff, gnumel))
    if not out:
        raise ValueError(f"zoffload: parameter {position}: an empty list of pieces")
    return out


def _places(opt, names, places):
    """(p, global name, offset, global numel, position, pieces) for every param, in group
    order; pieces None, or a flat buffer's [(offset, count, name, global offset, global
    numel)] (global name, offset and numel then None)."""
    out = []
    seen = set()
    prefix = f"rank{opt.rank}." if opt.world_size > 1 else ""
    for g, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            position = f"group{g}.param{i}"
            if p in opt._empty:
                continue
            dt = _dtensor.is_dtensor(p)
            if places is not None and isinstance(places.get(p), list):
                pieces = _pieces(p, position, places[p])
                for _, _, name, goff, _ in pieces:
                    if (name, goff) in seen:
                        raise ValueError(f"zoffload: parameter {position}: global name "
                                         f"'{name}' at offset {goff} is given to two "
                                         "parameters")
                    seen.add((name, goff))
                out.append((p, None, None, None, position, pieces))
                continue
            if places is not None and p in places:
                name, offset, gnumel = places[p]
                offset, gnumel = int(offset), int(gnumel)
            else:
                name = (names[p] if names is not None and p in names
                        else (position if dt else prefix + position))
                offset, gnumel = _dtensor.place(p)
            if not isinstance(name, str) or not name:
                raise TypeError(f"zoffload: parameter {position}: its global name must be a "
                                f"non-empty str, not {name!r}")
            if (name, offset) in seen:
                raise ValueError(f"zoffload: parameter {position}: global name '{name}' at "
                                 f"offset {offset} is given to two parameters")
            seen.add((name, offset))
            out.append((p, name, offset, gnumel, position, None))
    return out


def _hyper(group):
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()
            if k != "params"}


def _write_atomic(path, text):
    d = os.path.dirname(path)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(opt, dir, names, places):
    if opt._conn.closed:
        raise RuntimeError("zoffload: save_checkpoint() after close()")
    opt._finish()
    opt._follow()       # tensors a framework swapped in since the last step
    opt._flush_loaded_state()
    items = _places(opt, names, places)
    os.makedirs(dir, exist_ok=True)
    step = max((int(opt.state[p]["step"].item()) for p, *_ in items
                if "step" in opt.state.get(p, {})), default=0)
    entries = []
    for p, name, offset, gnumel, _, pieces in items:
        zt = opt._entries[p].zt
        if pieces is None:
            entries.append((zt, name, offset, gnumel))
        else:
            entries.extend((zt, n, goff, gn, off, count) for off, count, n, goff, gn in pieces)
    try:
        groups = [_hyper(g) for g in opt.param_groups]
        json.dumps(groups)
    except TypeError as ex:
        # Before anything is written: no state file without its JSON file.
        raise TypeError(f"zoffload: save_checkpoint: a param group holds a value JSON cannot "
                        f"store ({ex})") from None
    if entries:
        # A rank with nothing of its own (under HSDP, a replica another rank steps; a rank
        # with no rows of any param) writes no rank file, only its JSON file: the restore
        # takes each range from whichever rank files hold it.
        opt._conn.checkpoint_save(os.fspath(dir), entries, optim=opt._optim, step=step,
                                  **opt._group_args(opt.param_groups[0]))
    by_pos = {}
    params = {}
    for p, name, offset, gnumel, position, pieces in items:
        dtype = str(p.dtype).replace("torch.", "")
        if pieces is None:
            by_pos[position] = name
            # shape: the logical param's (a DTensor's global shape); numel: this rank's part.
            params[name] = {"shape": list(p.shape), "dtype": dtype, "offset": offset,
                            "numel": _dtensor.local(p).numel(), "global_numel": gnumel}
            continue
        by_pos[position] = [n for _, _, n, _, _ in pieces]
        for _, count, n, goff, gn in pieces:
            params[n] = {"shape": [gn], "dtype": dtype, "offset": goff, "numel": count,
                         "global_numel": gn}
    for g, group in enumerate(opt.param_groups):
        # Those this rank saved (not its empty shards, nor replicas another rank steps).
        groups[g]["params"] = [by_pos[f"group{g}.param{i}"]
                               for i in range(len(group["params"]))
                               if f"group{g}.param{i}" in by_pos]
    meta = {
        "format": _FORMAT,
        "optimizer": opt._optim,
        "class": type(opt).__name__,
        "rank": opt.rank,
        "world_size": opt.world_size,
        "step": step,
        "param_groups": groups,
        "params": params,
    }
    _write_atomic(os.path.join(dir, _META.format(opt.rank, opt.world_size)),
                  json.dumps(meta, indent=1, sort_keys=True))


def _read_metas(dir):
    metas = {}
    for path in sorted(glob.glob(os.path.join(glob.escape(os.fspath(dir)),
                                              "zoffload-torch-rank-*.json"))):
        m = _META_RE.search(os.path.basename(path))
        if m is None:
            continue
        try:
            with open(path) as f:
                meta = json.load(f)
        except (OSError, ValueError) as ex:
            raise ValueError(f"zoffload: checkpoint file {path} cannot be read: {ex}") from None
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
            raise ValueError(f"zoffload: checkpoint file {path} is not a {_FORMAT} file")
        metas[path] = meta
    if not metas:
        raise FileNotFoundError(f"zoffload: no zoffload.torch checkpoint in {dir} (no "
                                "zoffload-torch-rank-*.json there; saved by save_checkpoint)")
    worlds = {m["world_size"] for m in metas.values()}
    if len(worlds) != 1:
        raise ValueError(f"zoffload: checkpoint {dir} mixes world sizes {sorted(worlds)}: "
                         "save each checkpoint into a directory of its own")
    return metas


def load(opt, dir, names, places, convert=False):
    if opt._conn.closed:
        raise RuntimeError("zoffload: load_checkpoint() after close()")
    opt._finish()
    opt._follow()
    items = _places(opt, names, places)
    for p, _, _, _, position, _ in items:
        st = opt.state.get(p, {})
        done = int(st["step"].item()) if torch.is_tensor(st.get("step")) else 0
        if done or any(k in st for k in opt._state_keys):
            raise RuntimeError(f"zoffload: load_checkpoint() restores into a fresh optimizer; "
                               f"parameter {position} already has state (step {done}): build "
                               "a new optimizer and load into it")
    metas = _read_metas(dir)
    cls = type(opt).__name__
    saved = {}
    for path, meta in metas.items():
        if meta["optimizer"] != opt._optim:
            raise ValueError(f"zoffload: checkpoint file {path} was saved by "
                             f"{meta['class']}, not {cls}")
        for name, info in meta["params"].items():
            saved.setdefault(name, (path, info))
    for p, name, offset, gnumel, position, pieces in items:
        for _, _, n, _, gn in pieces or ():
            if n not in saved:
                raise ValueError(f"zoffload: parameter {position}: its piece of '{n}' is not "
                                 f"in checkpoint {dir}")
            if gn != saved[n][1]["global_numel"]:
                raise ValueError(f"zoffload: parameter {position}: '{n}' has {gn} elements "
                                 f"here, {saved[n][1]['global_numel']} in {saved[n][0]}")
        if pieces is not None:
            continue
        if name not in saved:
            raise ValueError(f"zoffload: parameter {position} ('{name}', shape "
                             f"{list(p.shape)}) is not in checkpoint {dir}")
        path, info = saved[name]
        if gnumel != info["global_numel"]:
            raise ValueError(f"zoffload: parameter {position} ('{name}'): "
                             f"{gnumel} elements here, {info['global_numel']} in {path}")
        # Shapes compare between whole params (a shard's is its own).
        whole = ((offset, gnumel) == (0, _dtensor.local(p).numel())
                 and info["numel"] == info["global_numel"])
        if whole and list(p.shape) != info["shape"]:
            raise ValueError(f"zoffload: parameter {position} ('{name}'): shape "
                             f"{list(p.shape)} here, {info['shape']} in {path}")
    # Hyperparameters: this rank's file when the world size is the same, else rank 0's.
    world = next(iter(metas.values()))["world_size"]
    own = os.path.join(dir, _META.format(opt.rank, world))
    meta = metas.get(own) or metas.get(os.path.join(dir, _META.format(0, world)))
    if meta is None:
        raise FileNotFoundError(f"zoffload: checkpoint {dir} has no {_META.format(0, world)}")
    if len(meta["param_groups"]) != len(opt.param_groups):
        raise ValueError(f"zoffload: checkpoint {dir} has {len(meta['param_groups'])} param "
                         f"groups, this optimizer {len(opt.param_groups)}")

    # Every param's tensor is replaced by one registered from the checkpoint, under its
    # daemon name (so that a later crash still finds it).  All or none: when the restore
    # fails, fresh tensors are registered again, as the constructor left them.
    from .torch import _DTYPES, _drop_views
    olds = {p: opt._entries[p] for p, *_ in items}
    request = [(olds[p].zt.name, olds[p].zt.numel, olds[p].gd, _DTYPES[p.dtype], name, offset,
                gnumel) if pieces is None else
               (olds[p].zt.name, olds[p].zt.numel, olds[p].gd, _DTYPES[p.dtype], list(pieces))
               for p, name, offset, gnumel, _, pieces in items]
    _drop_views(olds)
    for e in olds.values():
        e.zt.unregister()
    for p in olds:
        del opt._entries[p]
    try:
        tensors = []
        if request:
            tensors, _ = opt._conn.register_checkpoint(os.fspath(dir), request,
                                                       optim=opt._optim, convert=convert,
                                                       param_views=opt.param_views)
    except BaseException:
        for (n, k, gd, pd, *_), (p, *_) in zip(request, items):
            init = _dtensor.local(p).detach().reshape(-1).to(device="cpu",
                                                             dtype=torch.float32).contiguous()
            zt = opt._conn.register(n, init.numpy(), grad_dtype=gd, param_dtype=pd)
            opt._attach(p, zt, gd, pd)
            opt._init_state(p, zt)
        raise
    for zt, (n, k, gd, pd, *_), (p, *_) in zip(tensors, request, items):
        if not opt._attach(p, zt, gd, pd):
            # Saved before any step: _attach set nothing; the master is still the saved one.
            t = _dtensor.local(p)
            master = torch.empty(t.numel(), dtype=torch.float32)
            zt.read("master", master.numpy())
            with torch.no_grad():
                t.copy_(master.view(t.shape))
        opt.state[p]["step"] = torch.tensor(float(zt.last_step))
    for group, hyper in zip(opt.param_groups, meta["param_groups"]):
        for key, value in hyper.items():
            if key == "params":
                continue
            if isinstance(group.get(key), tuple) and isinstance(value, list):
                value = tuple(value)
            group[key] = value
    # A rank with no tensors of its own goes on from the step the checkpoint was saved at.
    last = max((zt.last_step for zt in tensors),
               default=max(int(m.get("step", 0)) for m in metas.values()))
    for p in opt._empty:
        # No elements here, only the step count: the others', as if it had stepped with them
        # (every rank's state then covers the same params, as DCP's gathers need).
        opt.state[p]["step"] = torch.tensor(float(last))
    opt._sync_replicas()            # HSDP: the replicas take the restored params
    return last
