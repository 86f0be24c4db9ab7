"""A worker does not outlive the agent that started it.

Why: torchrun's agent is what restarts a node's workers and what the other nodes' agents see in the
rendezvous. When the agent is killed (``kill -9``, the OOM killer, a crashed launcher) its workers used to
train on as orphans: measured across two network namespaces under ``--nnodes 1:2 --max-restarts 1``,
node 1's worker finished the run without its agent, so the surviving node never re-formed the group and
its agent then sat in torchrun's exit barrier, and a second fault on that node would have had nobody to
restart it. Here each worker asks the kernel to SIGKILL it when its parent exits (Linux's
``PR_SET_PDEATHSIG``), so losing a node's agent is losing the node: the other nodes' workers fail with one
line naming the lost peer, their agents restart them (``--max-restarts``), and under ``--nnodes MIN:MAX``
the group re-forms with the nodes that are left and resumes from the last checkpoint.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

AGENT_PID_VAR = "SEEKTRAIN_AGENT_PID"  # set by launch/elastic.py for the workers it starts
_PR_SET_PDEATHSIG = 1


def end_with_agent() -> None:
    """Under our launcher on Linux: SIGKILL this worker when its agent exits (at once if it already has).
    Elsewhere nothing (other systems have no such request; torchrun alone does not set it)."""
    agent = os.environ.get(AGENT_PID_VAR, "")
    if sys.platform != "linux" or not agent.isdigit():
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # refused (a seccomp profile): the worker lives on as before
    if os.getppid() != int(agent):  # the agent died before the request was made
        os.kill(os.getpid(), signal.SIGKILL)
