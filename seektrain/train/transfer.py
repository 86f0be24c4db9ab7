"""Moving values between the host and the device without waiting for the device's queued work.

A blocking copy (``tensor.tolist()``, ``.to(device)`` without ``non_blocking``) waits for everything
queued on the stream before it. ``to_device`` sends a host batch from pinned memory, so the copy is
queued like a kernel. ``HostCopy`` queues a device tensor's copy to the host as soon as its values are
produced and records an event behind it; ``values()`` waits for that event only. Read a step later, the
values cost no device idle time: the next step's work is already queued.
"""

from __future__ import annotations

import torch


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch on ``device``, queued: from pageable memory the driver may first wait for the stream."""
    if device.type != "cpu":
        batch = batch.pin_memory()
    return batch.to(device, non_blocking=True)


class HostCopy:
    def __init__(self, tensor: torch.Tensor):
        self._done = None
        if tensor.device.type == "cpu":  # already on the host: nothing to wait for
            self._host = tensor
        else:
            self._host = tensor.to("cpu", non_blocking=True)  # pinned destination, queued on the stream
            self._done = torch.Event(device=tensor.device)
            self._done.record()

    def values(self) -> list:
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()
