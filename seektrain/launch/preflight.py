"""The launcher's check before any worker starts, shared by ``seektrain train`` and the Slurm and
Kubernetes launchers: the run plan resolved for the world size the job will have."""

from __future__ import annotations


def check_layout(cfg, world_size: int, ranks_per_node: int | None = None) -> None:
    """Resolve the run plan before any worker starts, so a layout that cannot work (or a model that
    differs from the one the run dir holds) is refused here with one line; every worker resolves the
    same plan again. Reads the run dir, changes nothing."""
    import torch

    from seektrain.checkpoint.resume import resolve_resume
    from seektrain.plan.auto import auto_layout
    from seektrain.plan.run_plan import RunPlan
    from seektrain.train.setup_model import configured_model_config

    model = resolve_resume(cfg.run.dir, cfg.checkpoint.resume, configured_model_config(cfg)).model
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    cfg, _ = auto_layout(cfg, model, world_size, device_type, ranks_per_node)
    RunPlan.resolve(cfg, model, world_size, device_type)
    from seektrain.parallel.float8 import check_float8_environment

    check_float8_environment(cfg.precision.fp8, device_type)
