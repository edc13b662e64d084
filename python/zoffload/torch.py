"""torch.optim optimizers whose state lives in zoffloadd, the node's optimizer-offload daemon.

Switching a script is one line::

    opt = zoffload.torch.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

``AdamW``, ``Adam``, ``Adagrad`` and ``Lion`` take the installed torch's constructor arguments
and defaults and keep its param-group keys (``foreach`` and ``fused`` change nothing;
``amsgrad``, ``capturable`` and ``differentiable`` are refused), plus zoffload's own (keyword
only):

- ``job``: the job's name, shared by the ranks of one training run.  Default
  ``$ZOFFLOAD_JOB``, else ``torchrun-$TORCHELASTIC_RUN_ID`` under torchrun; torchrun's
  ``none`` (no ``--rdzv-id``) is no name: rank 0 draws one for the launch.
- ``resume``: what to do with the state a dead process of this job and rank left (below).
- ``socket``: the daemon's socket (default ``$ZOFFLOAD_SOCKET``, else the built-in one).
- ``reconnect_ms``: when the connection to the daemon goes (it restarted, crashed), how long
  to keep reconnecting and reattaching the job, in milliseconds; ``step()`` meanwhile only
  takes longer.  Default ``$ZOFFLOAD_RECONNECT_MS``, else 60000; ``-1`` no bound; ``0``
  fails at once with ``ECONNRESET``.  A daemon that comes back without the job's state is
  an error (``ESTALE``), never a silent new start.  ``conn_stats()`` counts reconnects.
- ``policy``: where the job's state lives: ``"cpu"``, ``"nvme"``, ``"auto"`` (default: the
  daemon's ``memory.policy``); ``pinned_budget``: the job's pinned bytes before ``auto``
  spills to NVMe.
- ``state_format``: how the daemon keeps the job's state (default: its
  ``memory.state_format``): ``"fp32"``; ``"bf16-moments"`` or ``"q8-moments"``, exp_avg and
  exp_avg_sq in 16 or 8 bits (per 256-element block) with an fp32 master, for AdamW and Adam:
  fewer bytes per step and on the tiers, at the moments' precision; ``"bf16-master+q8"``
  also keeps the master weights in bf16, rounded stochastically each step (the params are
  that bf16 value; writing master weights rounds them to nearest).  ``state_dict()`` gives
  the state in fp32 as the format decoded it; ``load_state_dict()`` quantizes it.
  The job's first rank decides; ``state_format`` on the optimizer is what the daemon chose.
- ``grad_dtype``: what gradients are handed over in (default: the param's dtype).
- ``overlap``: submit each param's step from a gradient hook as soon as backward produced
  its gradient, so that the daemon works while backward goes on; ``step()`` then only waits.
  One backward per step (a second before ``step()`` raises).  Under FSDP2 the hook is the
  shard's post-accumulate-grad hook, which FSDP2 calls after each module's reduce-scatter
  (see _dtensor.py); the shards stay their slots' views.
- ``rank`` / ``world_size``: default ``torch.distributed``'s when initialized, else 0 / 1.

The fp32 master weights and the moments stay in the daemon; the gradients go through each
tensor's shared-memory grad slot and the new parameters come back through its param slot:
- ``param_views`` (default True): a CPU param that owns its whole storage is made a view of
  its param slot (a private writable mapping of it), so a step's new params are in it with
  no copy out.  A write into it outside ``step()`` (``model.load_state_dict()``,
  ``p.data.normal_()``, numpy) is found at the next ``step()`` (the pages the process wrote
  become its own) and becomes the daemon's master, as torch's optimizers would take it;
  ``p.data = ...`` makes p a copy again.  A DTensor param's shard under FSDP2 on the CPU is a
  view the same way (FSDP2's storage of the shard is the slot; see _dtensor.py).  Other params
  (CUDA, padded or pinned DTensor shards, views into a bigger buffer, ``overlap`` but
  under FSDP2) are copied
  into after each step; a write into such a CPU
  param between steps is found at the next ``step()`` by comparing it bit for bit with its
  slot (4 bytes a param more read) and becomes the master in the same way.  A write into a
  CUDA param between steps is not seen (the comparison would cost the copy back it saves):
  the next step starts from the daemon's master and overwrites it.
- After the first step ``p.grad`` is the grad slot (CPU, same dtype, no ``overlap``):
  ``zero_grad(set_to_none=False)`` zeroes it in place and backward accumulates into it.
  A fresh ``p.grad`` (``zero_grad()``'s default, ``set_to_none``) is copied in as backward
  makes it (a post-accumulate-grad hook, torch >= 2.1; in ``step()`` under 1.13), with
  streaming stores, and the slot becomes ``p.grad``.  Under FSDP2 on the CPU the
  reduce-scatter writes the sharded gradients straight into the grad slots (see _graft.py).
``copy_stats()`` counts the copies and says why a param is no view.

A process that dies keeps its state in the daemon for ``limits.detach_grace_s``.  A new
process of the same job and rank takes it back only when that is surely the same run:
``resume=True``, or torchrun restarted this run's workers (``TORCHELASTIC_RESTART_COUNT`` of 1
or more).  Then the parameters are overwritten with the daemon's, ``resumed_step`` says the
step it resumes after, and a warning says so; a ``load_state_dict()`` before the first step
restores the parameters as they were given and the state loaded.  ``resume=False`` frees the
dead process's state.  Otherwise the constructor raises and leaves that state as it was.
``close()`` frees the state.

``clip_grad_norm_(max_norm)`` before ``step()`` clips by the norm over every rank's shard
(DTensor params) or this rank's params, computed by the daemon, and skips the next step on
every rank when a gradient is inf or NaN (see _clip.py).

``save_checkpoint(dir)`` / ``load_checkpoint(dir)`` save and restore through the daemon's
streaming checkpoint, for models too big for ``state_dict()`` (see _checkpoint.py).

DTensor params (FSDP2's ``fully_shard``): each rank registers and steps its own shard
(``to_local()``), and ``state_dict()`` gives the moments as DTensors of the param's shape and
placements, as torch's optimizers keep them, for ``torch.distributed.checkpoint`` (see
_dtensor.py for what is refused).
"""
import collections
import contextlib
import errno
import functools
import logging
import os
import secrets
import time
import warnings
from itertools import chain

import torch

from . import _checkpoint, _clip, _dtensor, _graft, _zclient
from ._zclient import ZoffloadError

__all__ = ["AdamW", "Adam", "Adagrad", "Lion", "ZoffloadError"]

log = logging.getLogger("zoffload")

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}
_MAX_SET = 4096         # tensors in one submit (ZP_MAX_STEP_TENSORS)
_UNSEEN = object()      # _Entry.taken_grad: p.grad not known when its step was submitted
# Gradients copied into their slots before the tensors so far are submitted: the daemon's
# step of those overlaps the copies of the next (a copy per gradient-holding tensor above
# this size; small tensors are batched, each submit is a round trip).
_PIPELINE_BYTES = 8 << 20

# The step talks to the daemon through the C extension, which torch.compile cannot trace: it
# would break the graph at every call (several per param).  Disabled, a compiled training
# step breaks once, at opt.step(), and the step runs eagerly (torch 1.13 has no dynamo).
_not_traced = getattr(torch, "_disable_dynamo", lambda fn: fn)


def _default_job(job):
    if job is not None:
        return job
    if os.environ.get("ZOFFLOAD_JOB"):
        return os.environ["ZOFFLOAD_JOB"]
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return "torchrun-" + run_id
    if run_id == "none":
        # torchrun without --rdzv-id says "none" for every launch: as a job name it would
        # hand one run's state to the next.  A name drawn by rank 0 and shared over the
        # process group is the same for the ranks of this launch and new at every launch.
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            drawn = [secrets.token_hex(8) if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(drawn, src=0)
            return "torchrun-" + drawn[0]
        raise ValueError("zoffload: torchrun gave no run id (TORCHELASTIC_RUN_ID=none) and "
                         "torch.distributed is not initialized: pass --rdzv-id to torchrun, "
                         "set $ZOFFLOAD_JOB or job='...', or init_process_group() first")
    raise ValueError("zoffload: name the job the optimizer state belongs to: job='...' or "
                     "$ZOFFLOAD_JOB (under torchrun it defaults to the run id)")


def _launcher_restarted():
    """torchrun restarted this run's workers (--max-restarts): the same run, surely."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    except ValueError:
        return False


def _grad_dtype_name(grad_dtype, param):
    if grad_dtype is None:
        grad_dtype = param.dtype
    if isinstance(grad_dtype, torch.dtype):
        if grad_dtype not in _DTYPES:
            raise TypeError(f"zoffload: grad_dtype {grad_dtype} is not float32, bfloat16 or "
                            "float16")
        return _DTYPES[grad_dtype]
    return grad_dtype


def _plain(t, dtype):
    """A CPU tensor laid out as its slot: copied with a memcpy (see Tensor.param_into)."""
    return t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()


def _written_copy(t, slot):
    """Whether t, a copy of its param slot, was written since: bit for bit, so that a NaN
    or a -0.0 the user wrote counts, and a NaN the step left there does not."""
    s = slot.view(t.shape)
    if s.dtype != t.dtype:
        s = s.to(t.dtype)
    return not torch.equal(_bits(t), _bits(s))


def _bits(t):
    """t as same-size integers: only the bytes matter."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _raw(t):
    # numpy has no bfloat16.
    return _bits(t).numpy()


class _Entry:
    """One parameter's tensor in the daemon and no-copy views of its slots."""
    __slots__ = ("zt", "grad", "param", "view", "in_flight", "pins", "grad_view_ok", "gd",
                 "fsdp", "taken_grad", "samples", "hook_copied", "hook_off")

    def __init__(self, zt, grad_dtype, param_dtype):
        self.zt = zt
        self.gd = grad_dtype
        self.grad = torch.frombuffer(zt.grad, dtype=_TORCH_DTYPES[grad_dtype])
        with warnings.catch_warnings():
            # The param slot is read-only shared memory: the daemon writes it.
            warnings.simplefilter("ignore", UserWarning)
            self.param = torch.frombuffer(zt.param, dtype=_TORCH_DTYPES[param_dtype])
        # The param view (see _view_refusal), once it is p's storage; else None.
        self.view = None
        self.fsdp = None            # a viewed DTensor shard's FSDPParam (see _dtensor.py)
        self.in_flight = 0          # step submitted and not yet waited for
        self.pins = None            # _CudaPins: the slots registered with CUDA
        # overlap: p.grad as a post-accumulate-grad hook handed it over (FSDP2), or _UNSEEN
        # where a gradient hook handed over what became p.grad; step() refuses a grad
        # changed since, which no step saw.
        self.taken_grad = None
        self.samples = None         # the 16 indices _check_taken_grads compares, once made
        # The slot hook (_make_slot_hook) copied this backward's gradient in; it stops for
        # good once p.grad was no longer the slot at step() (see there).
        self.hook_copied = False
        self.hook_off = False


class _CudaPins:
    """A tensor's two slots registered with CUDA (cudaHostRegister), so that the copies to
    and from them are asynchronous.  The pages must be let go of before they change: the
    slots hook (Tensor.set_slots_hook) says when.  On "remap" (a reconnect maps the daemon's
    other slot files over the same addresses) they are unregistered and registered again
    before the next copy (repin); on "unmap" for good.  Until then copies go through pageable
    memory, which is only slower."""
    __slots__ = ("ranges", "pinned")

    def __init__(self, zt):
        # The addresses stay: a remap maps the new files at the same place (MAP_FIXED).
        self.ranges = [(zt.grad.address, zt.grad.nbytes, 0),
                       (zt.param.address, zt.param.nbytes, 8)]  # 8: cudaHostRegisterReadOnly
        self.pinned = []

    def pin(self):
        cudart = torch.cuda.cudart()
        for addr, nbytes, flags in self.ranges:
            r = cudart.cudaHostRegister(addr, nbytes, flags)
            if int(r) != 0:
                self.unpin()
                raise RuntimeError(f"zoffload: cudaHostRegister of a slot failed ({r})")
            self.pinned.append(addr)

    def repin(self):
        if self.ranges and not self.pinned:
            self.pin()

    def unpin(self):
        if not self.pinned:
            return
        # A copy still in flight would read or write the old pages.
        torch.cuda.synchronize()
        cudart = torch.cuda.cudart()
        for addr in self.pinned:
            cudart.cudaHostUnregister(addr)
        self.pinned = []

    def slots_changed(self, why):
        # Called from inside a libzclient call (under the connection's lock): CUDA only.
        self.unpin()
        if why == "unmap":
            self.ranges = []


class _ZoffloadOptimizer(torch.optim.Optimizer):
    _optim = None               # the daemon's name for the update
    _state_keys = {}            # torch's state name -> the daemon's

    def __init__(self, params, defaults, *, job=None, socket=None, policy=None,
                 pinned_budget=0, state_format=None, grad_dtype=None, overlap=False, rank=None,
                 world_size=None, reconnect_ms=None, resume=None, param_views=True):
        if resume not in (None, True, False):
            raise ValueError(f"zoffload: resume must be True, False or None, not {resume!r}")
        if rank is None or world_size is None:
            dist = torch.distributed
            initialized = dist.is_available() and dist.is_initialized()
            rank = (dist.get_rank() if initialized else 0) if rank is None else rank
            world_size = ((dist.get_world_size() if initialized else 1)
                          if world_size is None else world_size)
        self.job = _default_job(job)
        self.rank, self.world_size = rank, world_size
        self.overlap = overlap
        self.param_views = bool(param_views)
        # What each param costs a step beyond the kernel (copy_stats()).
        self._copies = collections.Counter()
        self._fallbacks = collections.Counter()
        self.resumed_step = 0
        self._resume = resume
        self._given = {}            # taken back: the params as given, until the first step
        self._grad_dtype = grad_dtype
        self._entries = {}
        self._submitted = []        # (p, entry) in the order their steps were submitted
        # DTensor params this rank has no daemon tensor for: no elements of them here, or a
        # replica that another rank of its replicate group steps (HSDP; see _dtensor.py).
        self._empty = set()
        self._replicated = []       # HSDP's replicated params, in registration order
        self._group_index = {}
        self._fsdp_cache = {}       # _dtensor.fsdp_param's
        self._hooks = []
        self._next_index = 0
        self._clip = None           # _clip.Clip: what clip_grad_norm_ left for step()
        # Called once close() has replaced the slot views a framework was handed (p's storage,
        # p.grad) by copies: its own views of them must go too (zoffload.deepspeed).
        self._views_dropped_hooks = []
        self._conn = _zclient.Connection(socket, reconnect_ms=reconnect_ms)
        self._conn.job_open(self.job, rank, world_size, policy=policy,
                            pinned_budget=pinned_budget, state_format=state_format)
        self.state_format = self._conn.state_format
        self._grafts = _graft.Grafts(self._conn)   # FSDP2's reduce-scatters into the slots
        try:
            super().__init__(params, defaults)
        except BaseException:
            # What was registered goes now: a refused constructor leaves nothing to take back.
            # (A dead process's state it refused to take is not ours to free: see _register.)
            self.close()
            raise
        # Every replica of an HSDP shard starts from what its stepping rank has (a state taken
        # back from a dead process sets that rank's params only).
        self._sync_replicas()
        if self.resumed_step:
            self._warn_resumed(stacklevel=4)

    def _warn_resumed(self, stacklevel):
        msg = (f"zoffload: job '{self.job}' rank {self.rank}: took back the optimizer state of "
               f"a process that died; resuming after step {self.resumed_step}")
        log.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=stacklevel)

    # Registration: every param, as torch's constructor or add_param_group hands it over.
    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            if p not in self._entries:
                self._group_index[p] = len(self.param_groups) - 1
                self._register(p)
        self._grafts.install(p for p in self.param_groups[-1]["params"] if p in self._entries)

    def _follow(self):
        """Registers the tensors step() is given that it has not seen, from their current
        values: DeepSpeed's ZeRO replaces the param lists with its own flat fp32 partitions
        (ZeRO-1/2 once, ZeRO-3 before each step, emptied after).  A new one is named by its
        place in the order of registration, as the constructor's are, so that the same
        model in the same order finds its state again after a restart.  Then the tensors
        that were replaced before their first step (the model's params DeepSpeed took the
        optimizer's groups from) are freed: nothing was learnt in them, and their copies
        in the daemon would double its memory.  The position of each param's group is the
        one in the param_groups this step sees (ZeRO-1/2 steps one group at a time)."""
        new = []
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                self._group_index[p] = gi
                if p not in self._entries and p not in self._empty:
                    new.append(p)
        if not new:
            return
        given = {id(p) for g in self.param_groups for p in g["params"]}
        replaced = {p: e for p, e in self._entries.items()
                    if id(p) not in given and not e.in_flight and not self._stepped(p)}
        _drop_views(replaced)
        for p, e in replaced.items():
            e.zt.unregister()
            del self._entries[p]
            self._group_index.pop(p, None)
            self._given.pop(p, None)
            self.state.pop(p, None)
        resumed = self.resumed_step
        for p in new:
            self._register(p)
        if self.resumed_step > resumed:
            self._warn_resumed(stacklevel=5)

    def _stepped(self, p):
        step = self.state.get(p, {}).get("step", 0)
        return bool(step.item() if torch.is_tensor(step) else step)

    def _register(self, p):
        if p.dtype not in _DTYPES:
            raise TypeError(f"zoffload: parameter of dtype {p.dtype}: float32, bfloat16 or "
                            "float16 only")
        _dtensor.check(p, self.overlap, _dtensor.fsdp_param(p, self._fsdp_cache))
        t = _dtensor.local(p)       # what this rank steps: p, or its shard of a DTensor
        if _dtensor.replicated(p):
            self._replicated.append(p)
        if (t.numel() == 0 and _dtensor.is_dtensor(p)) or not _dtensor.steps_here(p):
            # FSDP2 gives a rank no rows of a dim 0 shorter than the world, and under HSDP
            # another replica steps this shard: only a step count here.
            self._empty.add(p)
            return
        if t.numel() == 0:
            raise ValueError("zoffload: empty parameters have nothing to optimize")
        index = self._next_index
        self._next_index += 1
        # Stable across restarts (same model, same order), so a new process finds its state.
        name = f"p{index}/{t.numel()}"
        gd, pd = _grad_dtype_name(self._grad_dtype, p), _DTYPES[p.dtype]
        init = t.detach().reshape(-1).to(device="cpu", dtype=torch.float32).contiguous()
        refusal = self._view_refusal(p)
        if refusal:
            self._fallbacks[refusal] += 1
        view = not refusal
        zt = self._register_tensor(name, init, gd, pd, view)
        if zt.last_step and not self._take_back(zt):
            zt.unregister()         # resume=False: the dead process's state goes
            zt = self._register_tensor(name, init, gd, pd, view)
        elif zt.last_step:
            # Kept for load_state_dict before the first step: what the user loaded, not
            # the daemon's leftovers, is then what they asked for.
            self._given[p] = t.detach().to(device="cpu", copy=True)
        last = self._attach(p, zt, gd, pd)
        if last:
            self.resumed_step = max(self.resumed_step, last)
        else:
            self._init_state(p, zt)
        if self.overlap and _dtensor.is_dtensor(p):
            # FSDP2 assigns the sharded grad after its reduce-scatter and then calls these.
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_post_hook(p)))
        elif self.overlap:
            self._hooks.append(p.register_hook(self._make_hook(p)))
        elif self._entries[p].grad_view_ok and hasattr(p, "register_post_accumulate_grad_hook"):
            # torch >= 2.1; under 1.13 step() copies a fresh p.grad in.
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_slot_hook(p)))

    def _view_refusal(self, p):
        """Why p's storage cannot be its param view: a private, writable mapping of the
        param slot that reads each step's new params with no copy (the daemon's writes
        show through on every page the process has not written; see _take_writes for
        the pages it has).  None when it can."""
        if not self.param_views:
            return "param_views=False"
        if self.overlap and not _dtensor.is_dtensor(p):
            # The daemon would write p while backward still runs (FSDP2's shard: see
            # _dtensor.py, nothing reads it then).
            return "overlap"
        if p.device.type != "cpu":
            return "not a CPU tensor"
        if _dtensor.is_dtensor(p):
            return _dtensor.view_refusal(p, _dtensor.fsdp_param(p, self._fsdp_cache))
        if p.layout != torch.strided or not p.is_contiguous():
            return "not contiguous"
        # torch 1.13 has _storage() (typed, sized in elements); 2.x untyped_storage().
        storage = p.untyped_storage() if hasattr(p, "untyped_storage") else p._storage()
        if p.storage_offset() != 0 or storage.nbytes() != p.numel() * p.element_size():
            # Part of a bigger buffer (a flat parameter): the others would lose it.
            return "shares its storage"
        return None

    def _register_tensor(self, name, init, gd, pd, view=False):
        for attempt in range(200):
            try:
                return self._conn.register(name, init.numpy(), grad_dtype=gd, param_dtype=pd,
                                           param_view=view)
            except ZoffloadError as ex:
                # Taken back while a step the dead process submitted still runs on it.
                if ex.errno != errno.EAGAIN or attempt == 199:
                    raise
                time.sleep(0.05)

    def _take_back(self, zt):
        """Whether to go on from the state a dead process of this job and rank left (zt
        holds it).  Only when that is surely this run: resume=True, or torchrun restarted
        this run's workers.  resume=False: no (the state is freed).  Otherwise refused, and
        the state is left as it was (zt is dropped unused; the connection's end detaches
        it again), so that the user decides."""
        if self._resume is not None:
            return self._resume
        if _launcher_restarted():
            return True
        raise RuntimeError(
            f"zoffload: job '{self.job}' rank {self.rank} holds the optimizer state of a "
            f"process that died after step {zt.last_step} (tensor '{zt.name}'); a new "
            "process takes it only when asked: resume=True to go on from it, resume=False to "
            "free it and start from these parameters (or job='...' for a job of its own)")

    def _attach(self, p, zt, gd, pd):
        """Makes zt p's tensor; a zt with state (taken back, restored) sets p and its step."""
        e = _Entry(zt, gd, pd)
        # Not with overlap (AccumulateGrad would write a slot under a step), nor for a slot of
        # another dtype or device.  A framework's tensor too: DeepSpeed's ZeRO-1/2 writes and
        # accumulates its partition's gradient through p.grad (its own buffer is then freed);
        # ZeRO-3 assigns p.grad anew each step, and _put_grad copies that one in.  Nor for a
        # DTensor: FSDP2 assigns each step's sharded grad itself.
        e.grad_view_ok = (not self.overlap and not p.is_cuda and gd == pd
                          and not _dtensor.is_dtensor(p))
        self._entries[p] = e
        last = zt.last_step
        view = zt.param_view if self._view_refusal(p) is None else None
        if view is not None:
            # p's storage becomes the view: it holds what the daemon's param slot holds
            # (these params, or a taken-back state's), and p's own storage goes.  A DTensor's
            # shard: FSDP2's storage of it (see _dtensor.py).
            flat = torch.frombuffer(view, dtype=p.dtype)
            e.view = flat.view(_dtensor.local(p).shape)
            if _dtensor.is_dtensor(p):
                e.fsdp = _dtensor.fsdp_param(p, self._fsdp_cache)
                _dtensor.set_shard(p, e.fsdp, flat)
            else:
                with torch.no_grad():
                    p.data = e.view
        elif last:
            t = _dtensor.local(p)
            master = torch.empty(t.numel(), dtype=torch.float32)
            zt.read("master", master.numpy())
            with torch.no_grad():
                t.copy_(master.view(t.shape))
        if last:
            self.state[p]["step"] = torch.tensor(float(last))
        if p.is_cuda:
            self._cuda_register(e)
        return last

    def _init_state(self, p, zt):
        pass

    def _cuda_register(self, e):
        # Slots registered with CUDA: the copies to and from them are asynchronous on the
        # current stream.  Run here against a stand-in of torch's cudart (test_cuda_pins.py).
        pins = _CudaPins(e.zt)
        pins.pin()
        e.pins = pins
        e.zt.set_slots_hook(pins.slots_changed)

    # The step.
    def _update_of(self, group):
        """The daemon's update for group (a group may say decoupled_weight_decay)."""
        return self._optim

    def _group_args(self, group):
        raise NotImplementedError

    def _put_grad(self, p, e, grad, group):
        if grad.is_sparse:
            raise RuntimeError("zoffload: sparse gradients are not supported")
        if e.pins is not None:
            e.pins.repin()          # let go of at a reconnect that remapped the slots
        grad = _dtensor.local(grad)
        g = e.grad.view(_dtensor.local(p).shape)
        if e.hook_copied and grad.data_ptr() != g.data_ptr():
            # Made p.grad in backward, the slot was replaced after (DDP's
            # gradient_as_bucket_view makes p.grad its bucket): the hook's copy was wasted.
            e.hook_off = True
        e.hook_copied = False
        if grad.data_ptr() == g.data_ptr() or self._grafts.holds(p, e, grad):
            # p.grad is the slot itself (see _finish): backward wrote it there; or FSDP2's
            # reduce-scatter did, through the slot's graft (_graft.py).
            if group.get("maximize", False):
                g.neg_()
            return 0
        self._grafts.note(p, e, grad)
        self._copies["grad_copies"] += 1
        if group.get("maximize", False):
            torch.neg(grad, out=g) if grad.dtype == g.dtype else g.copy_(grad).neg_()
        elif _plain(grad, g.dtype):
            e.zt.grad_from(_raw(grad))
        else:
            g.copy_(grad, non_blocking=p.is_cuda)
        return g.numel() * g.element_size()

    def _submit(self, group, items, clip_coef=0.0):
        """Queue the steps of (p, entry) pairs of one group, one set per step number."""
        by_step = {}
        for p, e in items:
            step = int(self.state[p].setdefault("step", torch.tensor(0.0)).item()) + 1
            by_step.setdefault(step, []).append((p, e))
        if any(p.is_cuda for p, _ in items):
            torch.cuda.current_stream().synchronize()       # grads are in the slots
        args = self._group_args(group)
        for step, pes in by_step.items():
            for i in range(0, len(pes), _MAX_SET):
                chunk = pes[i:i + _MAX_SET]
                self._conn.submit([e.zt for _, e in chunk], optim=self._update_of(group),
                                  step=step, clip_coef=clip_coef, **args)
                for _, e in chunk:
                    e.in_flight = step
                self._submitted.extend(chunk)

    def _make_hook(self, p):
        def hook(grad):
            e = self._entries.get(p)
            if e is not None:
                # What AccumulateGrad is about to store in p.grad (a zero grad adds exactly).
                self._submit_in_backward(p, e, grad if p.grad is None else p.grad + grad,
                                         "call step() before the next backward")
            return None
        return hook

    def _make_slot_hook(self, p):
        """A fresh p.grad (zero_grad()'s default, set_to_none) is copied into its slot as
        soon as backward has made it, and the slot becomes p.grad: the copy reads the
        gradient while it is still in the caches, its memory goes back at once (to the next
        layer's gradient, instead of every gradient of the model being held until step()),
        and step() finds the gradient in the slot.  Another backward before step()
        accumulates into the slot in place; a gradient that is already the slot, or not
        laid out as it, is left to step(), and so is every gradient of a param whose p.grad
        something replaced after the hook made it the slot (DDP's gradient_as_bucket_view).
        Not traced: under torch.compile, backward's hooks would each be a graph of their
        own."""
        @_not_traced
        def hook(param):
            e = self._entries.get(p)
            grad = param.grad
            if (e is None or e.hook_off or grad is None or e.in_flight
                    or grad.layout != torch.strided):
                return
            g = e.grad.view(param.shape)
            if (grad.data_ptr() == g.data_ptr() or not _plain(grad, g.dtype)
                    or self._group_of(p).get("maximize", False)):
                # maximize: step() negates the slot in place, which p.grad must not see.
                return
            self._copies["grad_copies"] += 1
            e.zt.grad_from(_raw(grad))
            param.grad = g
            e.hook_copied = True
        return hook

    def _make_post_hook(self, p):
        def hook(param):
            e = self._entries.get(p)
            if e is not None and param.grad is not None:
                # param.grad: the very object FSDP2 assigned, which step() finds again.
                self._submit_in_backward(p, e, param.grad, "accumulate micro-batches "
                                         "without a reduce-scatter (FSDP2's "
                                         "set_requires_gradient_sync(False)) but the last, "
                                         "or call step() before the next backward",
                                         taken=param.grad)
        return hook

    def _check_taken_grads(self):
        """A gradient changed after backward handed it to its step (torch's clip_grad_norm_
        or a scaler's unscale_, which scale every element in place; or a new p.grad) is
        refused: the step went with the gradient as it was.  Found by comparing 16 elements
        spread over it with the grad slot, bit for bit (a DTensor's in-place ops leave no
        version count to go by; the whole of it would cost a read of every gradient).  Only
        overlap's hooks hand gradients over before step(): no walk over the params else."""
        if not self.overlap:
            return
        changed = []
        for p, e in self._entries.items():
            g, e.taken_grad = e.taken_grad, None
            if g is None:
                continue
            if p.grad is None or (g is not _UNSEEN and p.grad is not g):
                changed.append(p)
                continue
            flat = _dtensor.local(p.grad).detach().reshape(-1)
            if e.samples is None or e.samples.device != flat.device:
                e.samples = torch.linspace(0, flat.numel() - 1, min(16, flat.numel()),
                                           device=flat.device).long()
            at = e.samples
            want = flat[at].to(device="cpu", dtype=e.grad.dtype)
            if self._group_of(p).get("maximize", False):
                want = want.neg()
            if not torch.equal(_bits(want), _bits(e.grad[at.cpu()])):
                changed.append(p)
        if changed:
            self._finish()
            raise RuntimeError(
                f"zoffload: with overlap=True, {len(changed)} gradients were changed after "
                "backward handed them to their steps (torch.nn.utils.clip_grad_norm_, a "
                "GradScaler's unscale_, or a new p.grad): those steps took the gradients as "
                "backward left them.  Clip with opt.clip_grad_norm_ and overlap=False, or "
                "leave the gradients as they are (the Hugging Face Trainer: max_grad_norm=0)")

    def _submit_in_backward(self, p, e, grad, advice, taken=_UNSEEN):
        """overlap=True: p's step submitted from a hook of backward, with grad; taken is
        p.grad as step() should find it (_UNSEEN: stored by AccumulateGrad after the hook)."""
        if e.in_flight:
            raise RuntimeError(f"zoffload: overlap=True takes one backward per step; "
                               f"{advice}")
        group = self._group_of(p)
        self._flush_loaded_state()
        self._given = {}
        self._take_writes(p, e)
        self._put_grad(p, e, grad, group)
        self._submit(group, [(p, e)])
        self._copies["steps_in_backward"] += 1
        e.taken_grad = taken

    def _group_of(self, p):
        # By position: load_state_dict replaces the group dicts but keeps their order.
        return self.param_groups[self._group_index[p]]

    @_not_traced
    @torch.no_grad()
    def step(self, closure=None):
        if self._conn.closed:
            raise RuntimeError("zoffload: step() after close()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._follow()
        self._check_taken_grads()
        self._flush_loaded_state()
        self._given = {}            # the taken-back state is what this run goes on from
        clip, self._clip = self._clip, None
        if clip is not None and clip.skip:
            return loss             # an inf/NaN gradient on some rank: every rank skips
        for group in self.param_groups:
            items, copied = [], 0
            for p in group["params"]:
                if p in self._empty:
                    self._step_empty(p)
                    continue
                e = self._entries[p]
                if p.grad is None or e.in_flight:
                    continue        # no gradient (as torch), or submitted by its hook
                self._take_writes(p, e)
                copied += self._put_grad(p, e, p.grad, group)
                items.append((p, e))
                if copied >= _PIPELINE_BYTES:
                    # The daemon steps these while the next gradients are copied in.
                    self._submit(group, items, clip.coef if clip is not None else 0.0)
                    items, copied = [], 0
            if items:
                self._submit(group, items, clip.coef if clip is not None else 0.0)
        self._finish()
        self._grafts.learn()
        self._sync_replicas()
        return loss

    def _take_writes(self, p, e):
        """What the user did to a viewed param since the last step reaches the daemon
        before this one: writes into it (a model's load_state_dict, p.data.normal_(),
        numpy), found as the view's pages the process made its own; or a new storage
        (p.data = ...), which p then keeps, copied into after each step.  A param that is
        a copy: any bit of it that is no longer its slot's."""
        if e.view is None:
            # A copy holds the slot's bits from the last copy out until somebody writes it.
            # Not on the GPU: comparing there would cost the very copy back it saves.
            if not p.is_cuda and _written_copy(_dtensor.local(p).detach(), e.param):
                self._copies["param_writes_taken"] += 1
                self._write_master(p, e)
            return
        t = _dtensor.local(p)
        if t.data_ptr() != e.view.data_ptr() or t.dtype != e.view.dtype:
            # p.data = ..., or FSDP2 reset its shard (model.to(), load_state_dict(assign=True)).
            e.view = None
            self._fallbacks["p.data replaced"] += 1
            self._write_master(p, e)
            return
        if e.zt.view_written():
            self._copies["param_writes_taken"] += 1
            self._write_master(p, e)

    def _write_master(self, p, e):
        """p's values as the new master (the moments stay); a view follows the slot again."""
        t = _dtensor.local(p)
        # A copy first: the view's pages are what is being written.
        master = t.detach().reshape(-1).to(device="cpu", dtype=torch.float32, copy=True)
        e.zt.write("master", master.numpy())
        if e.view is not None:
            e.zt.view_reset()

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, group=None):
        """torch.nn.utils.clip_grad_norm_ over this optimizer's params on every rank, applied
        by the daemon in the next step(), which is skipped on every rank when any gradient is
        inf or NaN; returns the global L2 norm (inf then).  p.grad is left as it was, and
        step() takes the gradients as they are then.  ``group``: the process group whose
        shares make the norm (default: all ranks for DTensor params, else this rank's own;
        see _clip.py)."""
        return _clip.clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite, group)

    def _sync_replicas(self):
        """The stepping replica's params to the others, in the same order on every rank."""
        with torch.no_grad():
            for p in self._replicated:
                _dtensor.from_stepper(p, _dtensor.local(p))

    def _step_empty(self, p):
        # torch's optimizers count the step of a param with a grad, elements or none.
        if p.grad is not None:
            st = self.state[p]
            st["step"] = torch.tensor(float(st.get("step", 0)) + 1.0)

    def _finish(self):
        """Waits for every step in flight and copies the new params out of the slots."""
        submitted, self._submitted = self._submitted, []
        waiting = [(p, e) for p, e in submitted if e.in_flight]
        if not waiting:
            return
        error = None
        # Each param is copied out as soon as its own step is done, in the order the steps
        # were submitted (the daemon's order), while the daemon steps the ones after it:
        # waiting for all of them first left the daemon idle through every copy.  With
        # nothing to copy (views), one wait for all saves a wake-up a tensor.
        if all(e.view is not None for _, e in waiting):
            try:
                self._conn.wait_all()
            except ZoffloadError as ex:
                error = ex
        for p, e in waiting:
            e.in_flight = 0
            try:
                res = e.zt.wait()       # raises with the daemon's reason when it failed
            except ZoffloadError as ex:
                error = error or ex
                continue
            if res["status"] != "applied":
                continue
            self.state[p]["step"] = torch.tensor(float(res["step"]))
            t = _dtensor.local(p)   # a DTensor's shard is written in place
            if e.view is not None:
                pass                # p is the view: the new params are in it
            elif _plain(t, e.param.dtype):
                self._copies["param_copies"] += 1
                e.zt.param_into(_raw(t.detach()))
            else:
                self._copies["param_copies"] += 1
                with torch.no_grad():
                    t.copy_(e.param.view(t.shape), non_blocking=p.is_cuda)
            if (e.grad_view_ok and p.grad is not None and p.grad.layout == torch.strided
                    and not self._group_of(p).get("maximize", False)):
                # The slot holds what p.grad holds; made p.grad, zero_grad() zeroes it in place
                # and the next backward accumulates straight into it: no copy next step.
                p.grad = e.grad.view(p.shape)
        if error is not None:
            raise error

    # State in torch's format, read from and written to the daemon.
    def _flush_loaded_state(self):
        """Writes state loaded into self.state (load_state_dict, ZeroRedundancyOptimizer)."""
        for p in self._empty:
            st = self.state.get(p)
            if st and any(k in st for k in self._state_keys):
                for key in self._state_keys:
                    st.pop(key, None)
                step = st.get("step", 0)
                st["step"] = torch.tensor(float(step.item() if torch.is_tensor(step) else step))
        for p, e in self._entries.items():
            st = self.state.get(p)
            if not st or not any(k in st for k in self._state_keys):
                continue
            if e.in_flight:
                raise RuntimeError("zoffload: state loaded while a step is in flight")
            t = _dtensor.local(p)
            if e.view is not None:
                self._take_writes(p, e)     # else the master is already what p shows
            else:
                self._write_master(p, e)
            for key, which in self._state_keys.items():
                if key in st:
                    # A DTensor's moments (load_state_dict, DCP): this rank's shard of them.
                    value = _dtensor.local(st.pop(key)).detach().reshape(-1)
                    if value.numel() != t.numel():
                        raise ValueError(f"zoffload: state '{key}' holds {value.numel()} "
                                         f"values for a parameter of {t.numel()}")
                    value = value.to(device="cpu", dtype=torch.float32).contiguous()
                    e.zt.write(which, value.numpy())
            step = st.get("step", 0)
            step = int(step.item() if torch.is_tensor(step) else step)
            st["step"] = torch.tensor(float(step))
            e.zt.set_step(step)

    def _hooks_of(self, what):
        """torch 2.x's state_dict hooks (absent in 1.13): ours run them around the daemon's
        state, not around the part torch's own state_dict sees."""
        return list(getattr(self, f"_optimizer_{what}_hooks", {}).values())

    @contextlib.contextmanager
    def _torch_hooks_held(self, *whats):
        held = {}
        for what in whats:
            name = f"_optimizer_{what}_hooks"
            if hasattr(self, name):
                held[name] = getattr(self, name)
                setattr(self, name, collections.OrderedDict())
        try:
            yield
        finally:
            for name, hooks in held.items():
                setattr(self, name, hooks)

    @_not_traced
    def state_dict(self):
        self._finish()
        self._flush_loaded_state()
        for hook in self._hooks_of("state_dict_pre"):
            hook(self)
        with self._torch_hooks_held("state_dict_pre", "state_dict_post"):
            sd = super().state_dict()
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        # In param order, as torch's own optimizers have it: an empty shard's step count is
        # kept before the others' (step()), and DCP's full state dict gathers each param's
        # moments in this order on every rank.
        sd["state"] = dict(sorted(sd["state"].items()))
        for index, st in sd["state"].items():
            p = params[index]
            e = self._entries.get(p)        # None in _empty: an empty shard, or a replica
            if e is None and p not in self._empty:
                continue            # loaded, not stepped yet: self.state holds all of it
            st = dict(st)
            for key, which in self._state_keys.items():
                n = _dtensor.local(p).numel()
                value = torch.empty(n) if e else torch.zeros(n)
                if e:
                    e.zt.read(which, value.numpy())
                value = _dtensor.from_stepper(p, value)     # HSDP: the stepping replica's
                # A DTensor param's moments are DTensors of its shape, as torch's are.
                st[key] = _dtensor.like(p, value)
            sd["state"][index] = st
        for hook in self._hooks_of("state_dict_post"):
            sd = hook(self, sd) or sd
        return sd

    @_not_traced
    def load_state_dict(self, state_dict):
        if isinstance(state_dict, dict) and "zoffload.deepspeed" in state_dict:
            raise ValueError("zoffload: this optimizer state is a reference to a streamed "
                             "checkpoint saved by zoffload.deepspeed.save_checkpoint, not the "
                             "state: load it with zoffload.deepspeed.load_checkpoint")
        self._finish()
        for hook in self._hooks_of("load_state_dict_pre"):
            state_dict = hook(self, state_dict) or state_dict
        with self._torch_hooks_held("load_state_dict_pre", "load_state_dict_post"):
            self._load_state_dict(state_dict)
        for hook in self._hooks_of("load_state_dict_post"):
            hook(self)

    def _load_state_dict(self, state_dict):
        saved = state_dict["param_groups"]
        moments = {}
        stripped = {}
        for index, st in state_dict["state"].items():
            moments[index] = {k: v for k, v in st.items() if k in self._state_keys}
            stripped[index] = {k: v for k, v in st.items() if k not in self._state_keys}
        # torch's own load casts the moments to the params' dtype; they stay fp32 here.
        super().load_state_dict({"state": stripped, "param_groups": saved})
        # Loaded over state taken back from a dead process (nanoGPT's order: the model's
        # weights, then the optimizer, then its state): the master is the params the user
        # had loaded, not the ones the takeover wrote into them.
        given, self._given = self._given, {}
        with torch.no_grad():
            for p, value in given.items():
                _dtensor.local(p).copy_(value)
        id_map = dict(zip(chain.from_iterable(g["params"] for g in saved),
                          chain.from_iterable(g["params"] for g in self.param_groups)))
        for index, ms in moments.items():
            if index in id_map and ms:
                p = id_map[index]
                for key, value in ms.items():
                    if value.numel() != p.numel():
                        raise ValueError(f"zoffload: state '{key}' holds {value.numel()} "
                                         f"values for a parameter of {p.numel()}")
                self.state[p].update(ms)
        # A param the saved state does not cover starts afresh, as in torch (lazily there).
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                self._group_index[p] = gi
                if (p in self._entries or p in self._empty) and "step" not in self.state[p]:
                    self.state[p].update(self._fresh_state(p), step=torch.tensor(0.0))
        # Into the daemon at the next step() (or state_dict(), save_checkpoint()), the master
        # from the params as they are then: DeepSpeed restores its fp32 partitions after
        # the optimizer's state.  A tensor not registered yet takes it at its registration.

    def _fresh_state(self, p):
        return {key: torch.zeros(_dtensor.local(p).shape) for key in self._state_keys}

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def stats(self):
        """The daemon's stats (zoffctl stats --json), as a str of JSON."""
        return self._conn.stats()

    def jobs(self):
        """The daemon's jobs (zoffctl jobs --json), as a str of JSON."""
        return self._conn.jobs()

    def conn_stats(self):
        """This process's reconnects to the daemon: dict(reconnects, reconnect_ns,
        steps_resubmitted, steps_completed_away, slots_remapped)."""
        return self._conn.conn_stats()

    def copy_stats(self):
        """What the step costs beyond the daemon's kernel, per param, as counts since the
        constructor: ``params_viewed`` params are their param views now (no copy out);
        ``param_copies`` copies of new params out of the param slot (params that are no
        view); ``param_writes_taken`` times a viewed param written outside step() was
        handed to the daemon as its new master; ``grad_copies`` gradients copied into a
        grad slot, in backward or in step() (``p.grad`` was not the slot: a fresh one each
        step, say zero_grad's set_to_none); ``fallbacks``: why params are no view, with counts;
        ``view_tracking``: how the views' writes are found, with counts ("userfaultfd", a
        fraction of a millisecond a step; "pagemap" where the kernel or a seccomp filter
        refuses userfaultfd, tens of milliseconds per 100 M params); ``steps_in_backward``:
        param steps submitted from backward's hooks (``overlap``), the rest by ``step()``;
        ``reduce_scatters_into_slots``: FSDP2 reduce-scatters whose output was the grad
        slots (_graft.py), whose gradients were not copied."""
        viewed = [e for e in self._entries.values() if e.view is not None]
        tracking = collections.Counter(e.zt.view_tracking for e in viewed)
        return {"params_viewed": len(viewed), "view_tracking": dict(tracking),
                "param_copies": self._copies["param_copies"],
                "param_writes_taken": self._copies["param_writes_taken"],
                "grad_copies": self._copies["grad_copies"], "fallbacks": dict(self._fallbacks),
                "steps_in_backward": self._copies["steps_in_backward"],
                "reduce_scatters_into_slots": self._grafts.handed()}

    def close(self):
        """Frees the state in the daemon (a process that just exits keeps it for a restart)."""
        if self._conn.closed:
            return
        self._finish()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._grafts.uninstall()
        entries, self._entries = self._entries, {}
        _drop_views(entries)
        for hook in self._views_dropped_hooks:
            hook()
        for e in entries.values():
            e.zt.unregister()
        self._conn.close()

    # The daemon's streaming checkpoint (see _checkpoint.py).
    def save_checkpoint(self, dir, names=None, places=None):
        """Saves this rank's state into dir: one safetensors file streamed by the daemon
        from wherever the state lives, and a JSON file of the param groups."""
        _checkpoint.save(self, dir, names, places)

    def load_checkpoint(self, dir, names=None, places=None, convert=False):
        """Restores a fresh optimizer (no step taken) from dir; returns the step it resumes
        after.  Params are set from the restored fp32 master.  State saved in another
        state_format than this job's is refused unless convert (then re-encoded)."""
        return _checkpoint.load(self, dir, names, places, convert)


def _drop_views(entries):
    """Lets go of every view of the entries' slots, which go away with their tensors."""
    for p, e in entries.items():
        if p.grad is not None and _dtensor.local(p.grad).data_ptr() == e.grad.data_ptr():
            p.grad = p.grad.clone()     # the slot goes away with the tensor
        if e.view is not None and _dtensor.local(p).data_ptr() == e.view.data_ptr():
            # And so does the param view (for a DTensor shard, FSDP2's storage of it).
            if e.fsdp is not None:
                _dtensor.set_shard(p, e.fsdp, e.view.reshape(-1).clone())
            else:
                with torch.no_grad():
                    p.data = p.data.clone()
        e.view = e.fsdp = None
        if e.pins is not None:
            e.pins.unpin()          # before unregister() unmaps (its hook would as well)
        e.grad = e.param = None


def _check(cond, what):
    if not cond:
        raise ValueError(f"Invalid {what}")


def _refused(name, value, why):
    if value:
        raise ValueError(f"zoffload: {name}=True is not supported: {why}")


_CAPTURABLE = "the daemon steps on the CPU, outside any CUDA graph"
_DIFFERENTIABLE = "the daemon's step is not part of torch's autograd graph"


@functools.lru_cache(maxsize=None)
def _torch_group_defaults(torch_cls):
    """This torch's own param-group keys and defaults for torch_cls: torch adds keys between
    releases (fused, differentiable, decoupled_weight_decay), and a state_dict that torch's
    own optimizer loads has the same ones."""
    return {k: v for k, v in torch_cls([torch.zeros(1, requires_grad=True)]).param_groups[0].items()
            if k != "params"}


def _group_defaults(torch_cls, given, implied=()):
    """given over torch_cls's defaults; a key this torch lacks is kept only when it says
    something (Adam's decoupled_weight_decay=True under torch 1.13), never when the class
    implies it (AdamW's)."""
    theirs = _torch_group_defaults(torch_cls) if torch_cls is not None else {}
    d = dict(theirs)
    for key, value in given.items():
        if key in theirs or (value not in (False, None) and key not in implied):
            d[key] = value
    return d


def _adam_defaults(torch_cls, lr, betas, eps, weight_decay, amsgrad, foreach, maximize,
                   capturable, differentiable, fused, decoupled_weight_decay, implied=()):
    _check(0.0 <= lr, f"learning rate: {lr}")
    _check(0.0 <= eps, f"epsilon value: {eps}")
    _check(0.0 <= betas[0] < 1.0, f"beta parameter at index 0: {betas[0]}")
    _check(0.0 <= betas[1] < 1.0, f"beta parameter at index 1: {betas[1]}")
    _check(0.0 <= weight_decay, f"weight_decay value: {weight_decay}")
    _refused("amsgrad", amsgrad, "the daemon keeps no max_exp_avg_sq (yet)")
    _refused("capturable", capturable, _CAPTURABLE)
    _refused("differentiable", differentiable, _DIFFERENTIABLE)
    return _group_defaults(torch_cls, dict(
        lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
        foreach=foreach, maximize=maximize, capturable=capturable,
        differentiable=differentiable, fused=fused,
        decoupled_weight_decay=decoupled_weight_decay), implied)


class AdamW(_ZoffloadOptimizer):
    """torch.optim.AdamW with its state in zoffloadd (decoupled weight decay)."""
    _optim = "adamw"
    _state_keys = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, **zoffload):
        # foreach and fused say how torch runs its own kernels; the daemon has one way.
        # Accepted, kept in the param groups as torch keeps them, and change nothing.
        super().__init__(params, _adam_defaults(
            torch.optim.AdamW, lr, betas, eps, weight_decay, amsgrad, foreach, maximize,
            capturable, differentiable, fused, True, ("decoupled_weight_decay",)), **zoffload)

    def _update_of(self, g):
        # torch 2.x's AdamW is Adam with decoupled_weight_decay in its groups; a group that
        # says False is Adam's L2 update, as in torch.
        return "adamw" if g.get("decoupled_weight_decay", True) else "adam"

    def _group_args(self, g):
        return dict(lr=float(g["lr"]), beta1=float(g["betas"][0]), beta2=float(g["betas"][1]),
                    eps=g["eps"], weight_decay=g["weight_decay"])


class Adam(AdamW):
    """torch.optim.Adam with its state in zoffloadd (weight decay as L2 in the gradient, or
    decoupled with decoupled_weight_decay=True, as torch 2.x's Adam)."""
    _optim = "adam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False, **zoffload):
        _ZoffloadOptimizer.__init__(self, params, _adam_defaults(
            torch.optim.Adam, lr, betas, eps, weight_decay, amsgrad, foreach, maximize,
            capturable, differentiable, fused, decoupled_weight_decay), **zoffload)

    def _update_of(self, g):
        return "adamw" if g.get("decoupled_weight_decay", False) else "adam"


class Adagrad(_ZoffloadOptimizer):
    """torch.optim.Adagrad with its state ('sum') in zoffloadd."""
    _optim = "adagrad"
    _state_keys = {"sum": "exp_avg"}

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0,
                 eps=1e-10, foreach=None, *, maximize=False, differentiable=False, fused=None,
                 **zoffload):
        _check(0.0 <= lr, f"learning rate: {lr}")
        _check(0.0 <= lr_decay, f"lr_decay value: {lr_decay}")
        _check(0.0 <= weight_decay, f"weight_decay value: {weight_decay}")
        _check(0.0 <= initial_accumulator_value,
               f"initial_accumulator_value value: {initial_accumulator_value}")
        _check(0.0 <= eps, f"epsilon value: {eps}")
        _refused("differentiable", differentiable, _DIFFERENTIABLE)
        super().__init__(params, _group_defaults(torch.optim.Adagrad, dict(
            lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value, foreach=foreach,
            maximize=maximize, differentiable=differentiable, fused=fused)), **zoffload)

    def _init_state(self, p, zt):
        value = self._group_of(p)["initial_accumulator_value"]
        if value:
            zt.write("exp_avg", torch.full((zt.numel,), float(value)).numpy())

    def _fresh_state(self, p):
        return {"sum": torch.full(_dtensor.local(p).shape,
                                  float(self._group_of(p)["initial_accumulator_value"]))}

    def _group_args(self, g):
        return dict(lr=float(g["lr"]), lr_decay=g["lr_decay"], eps=g["eps"],
                    weight_decay=g["weight_decay"])


class Lion(_ZoffloadOptimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), as
    lion-pytorch writes it: decoupled weight decay, sign of the beta1 interpolation, then
    the beta2 moment.  torch has no Lion of its own."""
    _optim = "lion"
    _state_keys = {"exp_avg": "exp_avg"}

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize=False,
                 foreach=None, **zoffload):
        _check(0.0 <= lr, f"learning rate: {lr}")
        _check(0.0 <= betas[0] <= 1.0, f"beta parameter at index 0: {betas[0]}")
        _check(0.0 <= betas[1] <= 1.0, f"beta parameter at index 1: {betas[1]}")
        _check(0.0 <= weight_decay, f"weight_decay value: {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay,
                                      maximize=maximize, foreach=foreach), **zoffload)

    def _group_args(self, g):
        return dict(lr=float(g["lr"]), beta1=float(g["betas"][0]), beta2=float(g["betas"][1]),
                    weight_decay=g["weight_decay"])
