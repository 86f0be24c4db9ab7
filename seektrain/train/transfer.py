"""Reading a device tensor on the host without waiting for the device's later work.

A blocking copy (``tensor.tolist()``) is queued at the end of the stream and waits for everything queued
before it, including work queued after the tensor was made. ``HostCopy`` queues the copy (into pinned
memory) as soon as the values are produced and records an event behind it; ``values()`` waits for that
event only. Read a step later, the values cost no device idle time: the next step's work is queued.
"""

from __future__ import annotations

import torch


class HostCopy:
    def __init__(self, tensor: torch.Tensor):
        self._done = None
        if tensor.device.type == "cpu":  # already on the host: nothing to wait for
            self._host = tensor
        else:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)  # pinned: truly async
            self._host.copy_(tensor, non_blocking=True)  # queued on the stream, right behind the values
            self._done = torch.Event(device=tensor.device)
            self._done.record()

    def values(self) -> list:
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()
