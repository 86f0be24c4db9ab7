"""Put the checks together: for this process (``seektrain doctor``) or for every worker of a torchrun
launch (``--nproc-per-node N``, ``--nnodes``, or run under torchrun), where local rank 0 of each node
checks its node, all ranks check that run.dir is shared, and ``--comm`` measures collectives. Rank 0
prints the one report; its exit status is 1 when anything is a blocker.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from seektrain.doctor import environment, network_checks, storage_checks, system
from seektrain.doctor.check_report import Check, Report


@dataclass
class DoctorOptions:
    run_dir: Path
    min_free_gib: float = 1.0
    write_mib: int = 64
    ports: list[int] | None = None  # None: torchrun's default port (or MASTER_PORT), a busy one only warns
    comm: bool = False
    sizes: tuple[int, ...] = ()
    iters: int = 5
    multi_node: bool = False
    checkpoint_bytes: int | None = None  # what checkpoint.keep + 1 checkpoints of the model take
    hf_folder: Path | None = None  # model.hf_path's folder: its raw read rate is measured
    read_mib: int = 1024


def node_checks(opts: DoctorOptions, in_launch: bool = False) -> list[Check]:
    """Everything one node can check on its own. Under a launch the rendezvous port is taken by design,
    so only ports asked for with ``--ports`` are checked there."""
    checks = system.version_checks() + system.gpu_checks()
    checks += network_checks.interface_checks() + network_checks.infiniband_checks()
    checks += environment.environment_checks(opts.multi_node)
    if not in_launch or opts.ports is not None:
        checks += network_checks.port_checks(opts.ports)
    checks += storage_checks.disk_checks(
        opts.run_dir, opts.min_free_gib, opts.write_mib, opts.checkpoint_bytes
    )
    checks += storage_checks.model_read_checks(opts.hf_folder, opts.read_mib)
    return checks


def doctor_here(opts: DoctorOptions) -> Report:
    report = Report()
    report.extend(node_checks(opts))
    report.extend(
        [
            Check(
                "info",
                "shared storage",
                "one process: run with --nproc-per-node N (and --nnodes) or "
                "under torchrun to check that every rank sees run.dir",
            )
        ]
    )
    return report


def doctor_worker(opts: DoctorOptions, timeout_s: float) -> Report | None:
    """Run on every worker of a launch; returns the report on rank 0, None elsewhere."""
    import torch.distributed as dist

    from seektrain.parallel.process_group import init_distributed

    env = init_distributed(timeout_s)
    try:
        mine = node_checks(opts, in_launch=True) if env.local_rank == 0 else []
        for check in mine:
            check.host = socket.gethostname()
        gathered = [None] * env.world_size
        dist.all_gather_object(gathered, mine)
        report = Report()
        nodes = sum(1 for part in gathered if part)
        for part in gathered:
            report.extend(part if nodes > 1 else [Check(c.status, c.name, c.detail) for c in part])

        def gather(obj):
            out = [None] * env.world_size
            dist.all_gather_object(out, obj)
            return out

        report.extend(
            [
                storage_checks.shared_storage_check(
                    opts.run_dir, env.rank, env.world_size, dist.barrier, gather
                )
            ]
        )
        if opts.comm and env.world_size < 2:
            report.extend(
                [Check("warn", "comm", "one rank: no collective to measure; use --nproc-per-node >= 2")]
            )
        elif opts.comm:
            from seektrain.doctor import comm

            report.comm = comm.measure(env.device, list(opts.sizes or comm.DEFAULT_SIZES), opts.iters)
            found = comm.slowest_link(report.comm)
            if found and found[2]:
                link = found[0]
                report.extend(
                    [
                        Check(
                            "warn",
                            "slow link",
                            f"rank {link['src']} ({link['src_host']}) -> rank "
                            f"{link['dst']} ({link['dst_host']}): {link['gbps']:.3f} "
                            f"GB/s, under half the median {found[1]:.3f} GB/s",
                        )
                    ]
                )
        dist.barrier()
        return report if env.rank == 0 else None
    finally:
        dist.destroy_process_group()
