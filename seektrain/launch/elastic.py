"""Start ``seektrain train`` workers through PyTorch's elastic launcher (torch.distributed.run).

One node uses ``--standalone`` (a private c10d rendezvous on a free port), which is also the only mode
in which restarting workers after a failure works reliably with gloo; several nodes use the c10d
rendezvous backend at ``--rdzv-endpoint``. The workers re-run this CLI, so what they execute is
exactly the command the user typed, minus the launcher options.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass
class LaunchOptions:
    nproc_per_node: int = 1
    nnodes: str = "1"
    node_rank: int | None = None
    rdzv_endpoint: str = ""
    rdzv_id: str = "seektrain"
    max_restarts: int = 0

    @property
    def multi_node(self) -> bool:
        return self.nnodes not in ("1", "1:1")

    def fixed_world_size(self) -> int | None:
        """World size when the node count is fixed (elastic ranges like 2:4 give None)."""
        return self.nproc_per_node * int(self.nnodes) if self.nnodes.isdigit() else None


def torchrun_args(opts: LaunchOptions, worker_argv: list[str]) -> list[str]:
    args = [f"--nproc-per-node={opts.nproc_per_node}", f"--max-restarts={opts.max_restarts}"]
    if opts.multi_node:
        if not opts.rdzv_endpoint:
            raise ValueError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
        args += [f"--nnodes={opts.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={opts.rdzv_endpoint}",
                 f"--rdzv-id={opts.rdzv_id}"]
        if opts.node_rank is not None:
            args.append(f"--node-rank={opts.node_rank}")
    else:
        args.append("--standalone")
    return args + ["-m", "seektrain.cli.main", *worker_argv]


def launch(opts: LaunchOptions, worker_argv: list[str]) -> int:
    """Run the workers to completion; returns a process exit code (0 = every worker succeeded). A failed
    worker's one line is printed once, by ``report_failures`` (launch/worker_errors.py)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from seektrain.launch.worker_errors import report_failures, worker_error_folder

    with worker_error_folder(quiet=opts.max_restarts == 0) as errors:
        try:
            run(parse_args(torchrun_args(opts, worker_argv)))
        except SignalException as err:  # preemption: the workers saved a checkpoint on their way out
            print(f"seektrain: stopped by signal {err.sigval.name}; the workers saved a checkpoint to resume "
                  "from (run the same command again)", file=sys.stderr)
            return 128 + int(err.sigval)
        except ChildFailedError as err:
            return report_failures(err.failures, errors)
    return 0
