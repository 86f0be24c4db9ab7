"""The run plan: everything a run derives from (job config, model, world size, device), resolved and
validated once.

Why one object: every degree is read and validated in one place. The launcher resolves a ``RunPlan``
before any worker starts (refusing a bad layout with one line), every worker resolves the same plan
again from the same inputs, and ``parallelize_model``, the step and the trainer read degrees, counts
and flags only from it. The plan is a pure frozen value: the DeviceMeshes a worker builds from it
(``seektrain.parallel.mesh.build_meshes``) need process groups, so they stay beside it, in the
worker's ``Meshes``, which the trainer passes to whatever needs them.

Resolving needs no process group and no torch.distributed state, so the planner (``seektrain plan``)
can enumerate candidate plans on any machine.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch

from seektrain.config.loader import ConfigError
from seektrain.config.schema import JobConfig
from seektrain.models.config import ModelConfig
from seektrain.models.lora import LoraSpec, adapter_weights
from seektrain.observe.trackers import check_installed
from seektrain.plan import layout_checks
from seektrain.platform.compute_dtype import DtypeChoice, choose_dtype
from seektrain.platform.float8_support import float8_environment_problem


def lora_spec(job: JobConfig) -> LoraSpec | None:
    """The model side's view of ``[lora]`` (``models/lora.py``); None when ``lora.enabled`` is false."""
    lo = job.lora
    return LoraSpec.from_values(lo.rank, lo.alpha, lo.dropout, lo.target_modules) if lo.enabled else None


@dataclass(frozen=True)
class RunPlan:
    job: JobConfig
    model: ModelConfig
    world_size: int
    device_type: str  # "cpu" | "cuda": the process group backend and the platform policy follow it
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    ep: int
    data_parallel: str  # "fsdp" | "ddp"
    accum_steps: int  # micro-batches per optimizer step on one data-parallel rank
    precision: DtypeChoice  # the compute dtype (``precision.dtype``, ``auto`` decided for the device) and why
    pp_microbatches: int = 1  # micro-batches the pipeline schedule splits a step into
    pp_stage_layers: tuple[tuple[int, ...], ...] = field(default=())  # decoder layers of each stage
    cp: int = 1  # context-parallel ranks: each sequence is split over them (parallel.cp)

    # ------------------------------------------------------------------ resolving
    @classmethod
    def resolve(
        cls,
        job: JobConfig,
        model: ModelConfig,
        world_size: int,
        device_type: str = "cpu",
        precision: DtypeChoice | None = None,
        this_machine: bool = False,
    ) -> RunPlan:
        """The plan for ``world_size`` processes, or a ``ConfigError`` naming the setting to change.
        ``precision``: the compute dtype when the device is not this process's own (the planner's);
        by default ``precision.dtype`` is decided for this process's ``device_type``.
        ``this_machine``: the plan is to run here (the launcher's and the workers', through
        ``seektrain.train.startup``), so the device must also be able to run it (``precision.fp8``);
        the planner's candidates are for hardware elsewhere and skip that check."""
        p, t = job.parallel, job.train
        others = p.dp_replicate * p.cp * p.tp * p.pp
        dp_shard = p.dp_shard
        if dp_shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"world size {world_size} is not divisible by parallel.dp_replicate × cp × tp × pp = {others}; "
                    "change the degrees or the number of processes"
                )
            dp_shard = world_size // others
        layout_checks.check_degrees(
            world_size, p.pp, p.dp_replicate, dp_shard, p.tp, p.ep, p.data_parallel, p.cp
        )
        layout_checks.check_context_parallel(job, model, p.cp)
        layout_checks.check_cpu_offload(p.cpu_offload, p.data_parallel)
        layout_checks.check_float8(job.precision.fp8, p.tp)
        if this_machine:
            problem = float8_environment_problem(job.precision.fp8, device_type)
            if problem:
                raise ConfigError(problem)
        dp = p.dp_replicate * dp_shard
        per_step = t.micro_batch_size * dp
        if t.global_batch_size % per_step:
            raise ConfigError(
                f"train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size × "
                f"data-parallel size = {t.micro_batch_size}×{dp} = {per_step}; adjust one of them"
            )
        accum = t.global_batch_size // per_step
        layout_checks.check_model(model, p.tp, p.ep, dp_shard, p.cp)
        spec = lora_spec(job)
        if spec is not None:
            adapter_weights(model, spec)  # one line for a target that selects nothing or a rank too large
        n_micro = 1
        stages: tuple[tuple[int, ...], ...] = ()
        if p.pp > 1:
            n_micro = layout_checks.pipeline_microbatches(
                p.pp_microbatches or accum, accum * t.micro_batch_size
            )
            stages = layout_checks.check_pipeline(model, p, n_micro, dp)
            layout_checks.check_pipeline_checkpointing(t.activation_checkpoint, p)
        if precision is None:
            precision = choose_dtype(job.precision.dtype, device_type)
        check_installed(job.metrics)  # metrics.trackers
        return cls(
            job,
            model,
            world_size,
            device_type,
            p.dp_replicate,
            dp_shard,
            p.tp,
            p.pp,
            p.ep,
            p.data_parallel,
            accum,
            precision,
            n_micro,
            stages,
            p.cp,
        )

    # ------------------------------------------------------------------ derived sizes and flags
    @property
    def dp(self) -> int:
        """Data-parallel ranks: the ones that read different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Ranks whose tokens differ: data-parallel × context-parallel. The loss, its trained-token counts
        and the expert loads are summed over them, and gradients averaged over them."""
        return self.dp * self.cp

    @property
    def cpu_offload(self) -> bool:
        """FSDP2's ``CPUOffloadPolicy``: sharded parameters, their gradients and the optimizer state live in
        host memory; each block's parameters are copied to the device for its forward and backward."""
        return self.job.parallel.cpu_offload

    @property
    def uses_fsdp(self) -> bool:
        """FSDP only where there is something to shard over; one data-parallel rank trains the plain model,
        unless it offloads to the CPU (offloading is FSDP's, so FSDP then runs over a mesh of one rank)."""
        return self.data_parallel == "fsdp" and (self.dp_cp > 1 or self.cpu_offload)

    @property
    def uses_ddp(self) -> bool:
        """DistributedDataParallel proper (a tensor-parallel model replicates with FSDP2's replicate instead)."""
        return self.data_parallel == "ddp" and self.dp_cp > 1 and self.tp == 1

    @property
    def reshard_after_forward(self) -> bool:
        """Under pipelining, parameters stay gathered across the micro-batches of one step."""
        return self.job.parallel.reshard_after_forward and self.pp == 1

    @property
    def fused_loss(self) -> bool:
        """Head + cross-entropy fused in the model: needs a head that is not vocabulary-sharded (no TP)
        and the whole model on this rank (no pipeline, whose last stage hands logits to the schedule)."""
        return self.tp == 1 and self.pp == 1

    @property
    def loss_parallel(self) -> bool:
        """The logits are a vocabulary-sharded DTensor: compute the loss under ``loss_parallel()``."""
        return self.tp > 1

    @property
    def use_mtp(self) -> bool:
        return self.model.num_nextn_predict_layers > 0 and self.job.train.mtp_loss_weight > 0

    @property
    def lora(self) -> LoraSpec | None:
        """The adapters to train on a frozen base (``[lora]``), None for a full fine-tune."""
        return lora_spec(self.job)

    @property
    def bias_update_speed(self) -> float:
        """DeepSeek-V3's auxiliary-loss-free balancing step; 0 for models that route without a bias, and
        under LoRA, whose base (routing included) is frozen."""
        if self.model.topk_method != "noaux_tc" or self.job.lora.enabled:
            return 0.0
        return self.job.train.bias_update_speed

    @property
    def aux_loss_grad_scale(self) -> float:
        """Gradient scale of the balance loss per micro-batch: the pipeline schedule divides every gradient
        by its micro-batch count itself, accumulation needs 1/accum_steps."""
        return 1.0 if self.pp > 1 else 1.0 / self.accum_steps

    @property
    def pp_stages_per_rank(self) -> int:
        return max(1, len(self.pp_stage_layers) // self.pp)

    @property
    def tokens_per_step(self) -> int:
        return self.job.train.global_batch_size * self.job.train.seq_len

    @property
    def compute_dtype(self) -> torch.dtype:
        """What the matmuls run in; read this (or ``precision.name``), never ``job.precision.dtype``, which
        may be ``auto``."""
        return self.precision.torch_dtype

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Autocast where parameters are fp32 in compute; FSDP's mixed-precision policy casts them itself."""
        if self.precision.name == "fp32" or self.uses_fsdp:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute_dtype)

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Wraps the loss and its backward: ``loss_parallel()`` under tensor parallelism."""
        if not self.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    @functools.cached_property
    def platform(self):
        """What this device type needs that others must not see (``seektrain.platform``): CPU/gloo
        workarounds live behind it, and the CUDA path never imports them."""
        from seektrain.platform import policy_for

        return policy_for(torch.device(self.device_type))

    def describe(self) -> str:
        text = (
            f"world={self.world_size} pp={self.pp} dp_replicate={self.dp_replicate} "
            f"dp_shard={self.dp_shard} tp={self.tp} ep={self.ep} ({self.data_parallel})"
        )
        text += f" cp={self.cp}" if self.cp > 1 else ""
        text += f" pp_schedule={self.job.parallel.pp_schedule}" if self.pp > 1 else ""
        return text + (" cpu_offload" if self.cpu_offload else "")
