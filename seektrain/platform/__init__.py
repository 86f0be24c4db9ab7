"""What differs by platform, behind one policy object chosen by device (``policy_for``).

The generic policy (CUDA and every other device) does nothing special and imports nothing CPU-only; the
CPU policy and its workarounds live in ``cpu_*.py`` and are imported only when a CPU device asks.
"""

from seektrain.platform.policy import PlatformPolicy, policy_for

__all__ = ["PlatformPolicy", "policy_for"]
