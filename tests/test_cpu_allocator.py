"""cpu.keep_freed_memory: with glibc told to keep freed memory, a freed 256 MB tensor stays resident
(to be reused without page faults within the step) instead of being unmapped, and release_free_memory
(run after every step) hands it back to the OS."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys, torch
from seektrain.platform.cpu_allocator import keep_freed_memory, release_free_memory
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
if sys.argv[1] == "keep":
    assert keep_freed_memory()
x = torch.ones(64 << 20)  # 256 MB
before_free = rss()
del x
after_free = rss()
release_free_memory()
print(before_free - after_free, after_free - rss())
"""


def _probe(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    freed, released = (int(v) for v in out.stdout.split())
    return freed, released


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_freed_memory_stays_until_released():
    freed, _ = _probe("system")
    assert freed > (200 << 20)  # glibc's default: the block is unmapped at once
    freed, released = _probe("keep")
    assert freed < (16 << 20)  # kept resident for reuse
    assert released > (200 << 20)  # and given back by release_free_memory
