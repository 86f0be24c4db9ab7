"""With freed memory kept (train.cpu_keep_freed_memory), a big tensor allocated again after being freed
reuses pages already mapped instead of page-faulting all of them in again."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import resource, sys, torch
from seektrain.train.cpu_allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def faults_of_second_allocation():
    torch.ones(64 << 20)  # 256 MB, freed at once
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(64 << 20)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(faults_of_second_allocation())
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_kept_memory_is_not_faulted_in_again():
    pages = (256 << 20) // 4096
    assert _faults("system") > pages // 2  # glibc's default: a fresh mmap, every page faulted
    assert _faults("keep") < pages // 20
