"""The launcher's check before any worker starts, shared by ``seektrain train`` and the Slurm and
Kubernetes launchers: the run plan resolved for the world size the job will have."""

from __future__ import annotations


def check_layout(cfg, world_size: int, ranks_per_node: int | None = None) -> None:
    """Resolve the run plan before any worker starts (``seektrain.train.startup``), so a layout that
    cannot work (or a model that differs from the one the run dir holds) is refused here with one line;
    every worker resolves the same plan again. Reads the run dir, changes nothing."""
    import torch

    from seektrain.train.startup import resolve_start

    resolve_start(
        cfg, world_size, "cuda" if torch.cuda.is_available() else "cpu", ranks_per_node=ranks_per_node
    )
