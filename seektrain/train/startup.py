"""Start-up: from a job config to the run plan, one function for the launcher and every worker.

Why one: the launcher resolves the plan before any worker starts, so a layout that cannot work (or a model
that differs from the one the run dir holds) is refused once, with one line, and every worker resolves
the same plan again from the same inputs. The sequence (which checkpoint and model to start from →
``parallel.auto``'s layout → ``RunPlan.resolve`` with every check, the device's included) was written in
both places and had drifted once (the FP8 check sat outside ``resolve``); here it is written once.

The two callers differ only in how the checkpoint is chosen: the launcher reads the run dir and changes
nothing (``resolve_resume``); the workers' rank 0 also tidies it and shares the choice
(``CheckpointManager.resume_choice``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from seektrain.checkpoint.finder import read_trainer_state
from seektrain.checkpoint.lora_checkpoint import check_lora_resume
from seektrain.checkpoint.resume import ResumeChoice, resolve_resume, rope_text
from seektrain.config.schema import JobConfig
from seektrain.errors import UserError
from seektrain.models import with_rope_overrides
from seektrain.models.config import ModelConfig
from seektrain.models.job_model import configured_model_config, rope_overrides
from seektrain.plan.auto import auto_layout
from seektrain.plan.run_plan import RunPlan

ChooseResume = Callable[[str, ModelConfig], ResumeChoice]  # (checkpoint.resume, configured model) -> choice


@dataclass(frozen=True)
class Start:
    plan: RunPlan
    resume: ResumeChoice  # the checkpoint to load (None: a fresh start) and the model it holds
    auto_why: str  # parallel.auto's one line on the layout it chose; "" when off


def resolve_start(
    job: JobConfig,
    world_size: int,
    device_type: str,
    choose_resume: ChooseResume | None = None,
    ranks_per_node: int | None = None,
) -> Start:
    """The plan this job runs with on ``world_size`` processes of ``device_type``, or the one-line
    ``UserError`` that refuses it. ``choose_resume`` defaults to the read-only choice."""
    choose = choose_resume or (lambda spec, configured: resolve_resume(job.run.dir, spec, configured))
    resume = _rope_on_converted(choose(job.checkpoint.resume, configured_model_config(job)), job)
    if resume.checkpoint is not None:  # [lora] the same settings and base, or one line naming both
        check_lora_resume(resume.checkpoint, job, resume.model)
    job, why = auto_layout(job, resume.model, world_size, device_type, ranks_per_node)
    plan = RunPlan.resolve(job, resume.model, world_size, device_type, this_machine=True)
    return Start(plan, resume, why)


def _rope_on_converted(resume: ResumeChoice, job: JobConfig) -> ResumeChoice:
    """A run dir made by ``seektrain convert --to-checkpoint`` defines its model (``model.preset`` and
    ``model.hf_path`` are not used), but ``[model.rope_scaling]`` still applies on top of it: that is how
    a converted release is extended. Its weights-only checkpoint takes the overrides; a training
    checkpoint written since must already hold them (the same refusal as any other model change)."""
    if resume.converted_from is None or resume.checkpoint is None:
        return resume
    model = with_rope_overrides(resume.model, rope_overrides(job))
    if model == resume.model:
        return resume
    if not read_trainer_state(resume.checkpoint).get("weights_only"):
        raise UserError(
            f"checkpoint {resume.checkpoint} was trained with rope_scaling={rope_text(resume.model)} but "
            f"model.rope_scaling asks for {rope_text(model)}: keep the checkpoint's values, or start "
            "a new run.dir from its weights (seektrain convert, docs/training.md)"
        )
    return dataclasses.replace(resume, model=model)
