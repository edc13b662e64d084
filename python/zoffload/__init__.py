"""zoffload: optimizer state in zoffloadd, the node's optimizer-offload daemon.

``zoffload._zclient`` binds libzclient (connections, jobs, tensors, steps, state);
``zoffload.torch`` has the ``torch.optim`` optimizers built on it.
"""
from ._zclient import Connection, Tensor, Slot, ZoffloadError

__all__ = ["Connection", "Tensor", "Slot", "ZoffloadError"]
