"""FSDP2's reduce-scatter straight into the grad slots, for the zoffload.torch optimizers.

FSDP2 reduce-scatters a module's gradients into one flat output buffer and makes each
sharded gradient a view of it, at an offset of FSDP2's (the shards back to back, each padded
as its param's shard is).  A fresh buffer each backward: ``step()`` would copy every sharded
gradient into its grad slot, 8 bytes a param read and written beside the step's 28.

Here the output buffer *is* the grad slots.  FSDP2 lets a module's reduce-scatter allocate
its own buffers (``set_custom_reduce_scatter``); ours hands out a graft
(``Conn.graft_grad_slots``): one buffer in which each shard's grad slot is mapped at that
shard's offset.  The reduce-scatter writes the gradients into the slots, the daemon steps
from them, and nothing is copied.

- The layout is learned, not computed from FSDP2's internals: a module's first
  reduce-scatter goes to a buffer torch allocates, as FSDP2's own would; at ``step()`` the
  gradients that are views of it say where each shard lies (their storage offsets), and the
  graft is made from that.  A shard that is no fp32 CPU daemon tensor of this optimizer, or
  not on a page boundary of the buffer (4096 bytes: an offset that is a multiple of 1024
  elements), is left out of the graft: its region is scratch memory, and its gradient,
  there, is copied as any other.
- The graft is handed out for a reduce-scatter whose output has its size, and only while no
  param of the module holds a gradient: a second reduce-scatter before the gradients were
  let go of (accumulation that syncs every micro-batch, ``zero_grad(set_to_none=False)``)
  would write over gradients FSDP2 then adds it to.  That one gets a buffer of torch's,
  which FSDP2 adds into the grafted gradients in place.
- A reconnect that maps other slot files, or an unregister, makes the graft stale (the
  tensors' slots hook says when): its mappings hold the old files, so gradients in it are
  copied, and the next ``step()`` learns the layout again.
- Installed only where the module's reduce-scatter is FSDP2's default, so a custom one of the
  user's stays; a CUDA module's buffers are CUDA memory, which the graft leaves to torch.
"""
import logging
import math
import mmap

import torch

from . import _dtensor

try:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
except (ImportError, ValueError):
    # A torch without FSDP2's custom reduce-scatter; 1.13's torch.distributed.fsdp does not
    # even import under Python 3.11 (a dataclass default that 3.11 refuses: ValueError).
    DefaultReduceScatter = None

_PAGE = mmap.PAGESIZE            # what graft_grad_slots maps a slot on
log = logging.getLogger("zoffload")


class _Graft:
    """A Conn.graft_grad_slots buffer as one flat fp32 tensor, with the parts' offsets."""
    __slots__ = ("buf", "tensor", "numel", "offsets", "stale")

    def __init__(self, conn, numel, parts):
        self.buf = conn.graft_grad_slots(numel * 4, [(e.zt, off * 4) for off, e in parts])
        self.tensor = torch.frombuffer(self.buf, dtype=torch.float32)
        self.numel = numel
        self.offsets = {id(e): off for off, e in parts}
        self.stale = False
        for _, e in parts:
            e.zt.set_slots_hook(self.slots_changed)

    def slots_changed(self, why):
        # Inside a libzclient call, under the connection's lock: nothing but the flag.
        self.stale = True

    def holds(self, e, grad):
        """Whether grad (a local shard's gradient) is e's grad slot, through this graft."""
        off = self.offsets.get(id(e))
        return (off is not None and not self.stale and grad.dtype == torch.float32
                and grad.is_contiguous()
                and grad.data_ptr() == self.buf.address + off * 4)


if DefaultReduceScatter is not None:
    class _SlotReduceScatter(DefaultReduceScatter):
        """One FSDP2 param group's reduce-scatter, its output allocated as its graft."""

        def __init__(self, group):
            super().__init__()
            self.group = group
            # A world of one (one shard, no replicas): no reduce-scatter, FSDP2 copies its
            # input buffer into its output, both of the output's size, so the graft goes to
            # both: torch's copy_ of a tensor onto a view of the same memory returns at once
            # (else a pass of 8 bytes a param), and the copy-in that fills the input is what
            # fills the slots.  Replicas over one shard (HSDP) all-reduce after the copy:
            # their outputs are left to torch, as before.
            info = getattr(group, "mesh_info", None)
            shards = getattr(info, "shard_mesh_size", 1)
            self.can_graft = shards > 1 or getattr(info, "replicate_mesh_size", 1) == 1
            self.graft = None
            self.made = []          # (storage address, numel) of this backward's torch buffers
            self.handed = 0         # backwards reduced into the graft (copy_stats)
            self.handed_now = False  # since the last step(): a world of one asks twice
            self.refused = False    # a graft could not be made: not tried again

        def allocate(self, size, *, dtype, device):
            numel = math.prod(int(s) for s in size)
            g = self.graft
            if (g is not None and not g.stale and numel == g.numel and dtype == torch.float32
                    and self.can_graft and torch.device(device).type == "cpu"
                    and all(fp.sharded_param.grad is None for fp in self.group.fsdp_params)):
                if not self.handed_now:
                    self.handed += 1
                    self.handed_now = True
                return g.tensor.view(size)
            t = super().allocate(size, dtype=dtype, device=device)
            self.made.append((t.untyped_storage().data_ptr(), numel))
            return t
else:
    _SlotReduceScatter = None


class Grafts:
    """The optimizer's side: installs the reduce-scatters, finds what step() need not copy,
    and learns the layouts from the gradients step() did copy."""

    def __init__(self, conn):
        self._conn = conn
        self._comms = {}            # id(FSDPParamGroup) -> its _SlotReduceScatter
        self._by_param = {}         # id(sharded param) -> that comm
        self._seen = {}             # id(comm) -> (comm, output numel, [(offset, entry)])
        self._handed_before = 0     # handed() of the comms uninstall() let go of

    def install(self, params):
        """Our reduce-scatter on each FSDP2 param group of params that still has FSDP2's
        default one."""
        if _SlotReduceScatter is None:
            return
        ours = {id(p) for p in params}
        for group in _dtensor.fsdp_param_groups():
            if id(group) in self._comms or not any(
                    id(fp.sharded_param) in ours for fp in group.fsdp_params):
                continue
            if type(getattr(group, "_reduce_scatter_comm", None)) is not DefaultReduceScatter:
                continue
            comm = _SlotReduceScatter(group)
            group._reduce_scatter_comm = comm
            self._comms[id(group)] = comm
            for fp in group.fsdp_params:
                self._by_param[id(fp.sharded_param)] = comm

    def holds(self, p, e, grad):
        """Whether p's local gradient grad is already in e's grad slot (no copy)."""
        comm = self._by_param.get(id(p))
        return comm is not None and comm.graft is not None and comm.graft.holds(e, grad)

    def note(self, p, e, grad):
        """p's gradient was copied: if it is a view of a buffer its module's reduce-scatter
        made this backward, remember where, for learn()."""
        comm = self._by_param.get(id(p))
        if comm is None or not comm.made or grad.dtype != torch.float32:
            return
        storage = grad.untyped_storage().data_ptr()
        for addr, numel in comm.made:
            if addr == storage:
                off = grad.storage_offset()
                if ((off * 4) % _PAGE == 0 and grad.is_contiguous() and grad.numel() == e.zt.numel
                        and off + grad.numel() <= numel):
                    self._seen.setdefault(id(comm), (comm, numel, []))[2].append((off, e))
                return

    def learn(self):
        """After step(): a graft for each module whose gradients were noted."""
        for comm, numel, parts in self._seen.values():
            if comm.refused or (comm.graft is not None and not comm.graft.stale
                                and comm.graft.numel == numel):
                continue
            try:
                comm.graft = _Graft(self._conn, numel, sorted(parts, key=lambda x: x[0]))
            except (OSError, ValueError) as err:
                # Not tried again: this module's gradients stay copies, as without us.
                comm.graft, comm.refused = None, True
                log.warning("zoffload: FSDP2's reduce-scatter into the grad slots refused "
                            "(its gradients are copied in): %s", err)
        self._seen = {}
        for comm in self._comms.values():
            comm.made = []
            comm.handed_now = False

    def uninstall(self):
        """FSDP2's own reduce-scatter back on each group (close()): the grafts' mappings
        go with the last gradient that views them."""
        for comm in self._comms.values():
            if comm.group._reduce_scatter_comm is comm:
                comm.group._reduce_scatter_comm = DefaultReduceScatter()
            comm.graft = None
        self._handed_before = self.handed()
        self._comms, self._by_param, self._seen = {}, {}, {}

    def handed(self):
        return self._handed_before + sum(c.handed for c in self._comms.values())
