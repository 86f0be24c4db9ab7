"""Turn a plain model into the parallelised, initialised parts this rank trains, as the run plan says
(torchtitan's recipe): cut out this rank's pipeline stages, convert their matmuls to FP8
(``precision.fp8``; before anything else, since torchao swaps plain ``nn.Linear`` modules and FSDP must
shard the converted ones), add LoRA adapters and freeze the base in the compute dtype (``[lora]``),
give attention the context-parallel ring (``parallel.cp``), apply expert and
tensor parallelism (experts
first: the tensor-parallel plan of an MoE block leaves expert-parallel experts alone), activation
checkpointing, regional ``torch.compile`` (``train.compile``) and FSDP/HSDP (with CPU offload when the plan
says so), materialise only this rank's shards, then initialise them. DDP wraps the
initialised model last, because it needs real tensors; a tensor-parallel model takes FSDP2's replicate
mode instead, applied like FSDP (``_replicate_tensor_parallel``).

Nothing here validates: the plan has (seektrain/plan/layout_checks.py). Nothing here is platform-specific
either: the plan's platform policy adds what one platform needs (e.g. gloo's collectives on CPU).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from seektrain.checkpoint.local_shards import local_shards
from seektrain.models import init_adapters
from seektrain.models.lora import add_adapters, freeze_base, is_adapter
from seektrain.models.registry import config_of, family_of, is_family_model, model_blocks
from seektrain.models.safetensors_slices import HFWeightsError
from seektrain.parallel.activation_checkpoint import apply_activation_checkpointing
from seektrain.parallel.data_parallel import apply_ddp, apply_fsdp, fsdp_mixed_precision
from seektrain.parallel.mesh import Meshes

log = logging.getLogger("seektrain.parallel")


@dataclass
class ParallelModel:
    """What one rank trains. ``model`` is a single module with the whole model's parameter names for
    the parts this rank holds (optimizer, checkpoints and clipping use it); ``parts`` are the pipeline
    stages run by ``schedule`` (one part and no schedule without pipeline parallelism)."""

    model: nn.Module
    parts: list[nn.Module]
    stage_ids: list[int]
    schedule: object | None = None
    load_reports: list = field(default_factory=list)  # one per part read from model.hf_path

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.schedule is None or any(p.norm is not None for p in self.parts)


def _parallelize_part(part: nn.Module, plan, meshes: Meshes, device: torch.device) -> None:
    if plan.job.precision.fp8 != "none":
        from seektrain.parallel.float8 import apply_float8, fp8_grouped_gemm_supported

        choice = apply_float8(part, plan.job.precision.fp8, experts=fp8_grouped_gemm_supported(device))
        log.info(choice.describe(plan.job.precision.fp8))
    if plan.lora is not None:  # after FP8 (which swaps the linears), before anything shards them
        add_adapters(part, plan.lora)
        freeze_base(part, plan.compute_dtype)
    if plan.cp > 1:
        from seektrain.parallel.context_parallel import apply_context_parallel

        apply_context_parallel(part, meshes.cp)
    if plan.ep > 1:
        from seektrain.parallel.expert_parallel import apply_expert_parallel

        assert meshes.ep is not None  # build_meshes makes it when plan.ep > 1
        apply_expert_parallel(part, meshes.ep, meshes.tp if plan.tp > 1 else None)
    if plan.tp > 1:
        from seektrain.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(part, meshes.tp, sequence_parallel=True)
    random_layers = plan.lora is not None and plan.lora.dropout > 0  # the adapters' dropout
    apply_activation_checkpointing(part, plan.job.train.activation_checkpoint, random_layers)
    if plan.job.train.compile:
        from seektrain.parallel.compile import apply_compile

        log.info("train.compile: %d blocks compile at their first call", apply_compile(part))
    if plan.uses_fsdp:
        mp = fsdp_mixed_precision(plan.precision.name, plan.job.precision.reduce_dtype)
        offload = plan.platform.cpu_offload_policy() if plan.cpu_offload else None
        if plan.ep > 1:  # experts first, on their own mesh; the per-layer FSDP then skips them
            from seektrain.parallel.expert_parallel import shard_experts

            assert meshes.efsdp is not None  # build_meshes makes it when plan.ep > 1
            shard_experts(part, meshes.efsdp, mp, plan.reshard_after_forward, offload)
        apply_fsdp(part, meshes.fsdp, mp, plan.reshard_after_forward, offload)
        plan.platform.configure_fsdp(part, mp)
    elif plan.tp > 1 and plan.dp_cp > 1:  # data_parallel=ddp
        _replicate_tensor_parallel(part, meshes.grad_replicate)


def _buffers_to(module: nn.Module, device: torch.device) -> None:
    for sub in module.modules():
        for name, buf in sub.named_buffers(recurse=False):
            sub._buffers[name] = buf.to(device)


def _replicate_tensor_parallel(part: nn.Module, dp_mesh) -> None:
    """DDP for a tensor-parallel model. ``DistributedDataParallel`` cannot take DTensor parameters (its
    start-up broadcast has no DTensor rule), so FSDP2's replicate mode does the same job: no sharding,
    gradients averaged over ``dp_mesh`` per block during backward (like DDP's buckets), parameters
    DTensors on the ``(dp_replicate, tp)`` mesh, so clipping and checkpoints work as under FSDP. Mixed
    precision stays autocast's, as with DDP."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for block in model_blocks(part):
        replicate(block, mesh=dp_mesh)
    replicate(part, mesh=dp_mesh)


def parallelize_model(
    model: nn.Module,
    plan,
    meshes: Meshes,
    device: torch.device,
    hf_path: str | None = None,
    loss_fn=None,
) -> ParallelModel:
    """The parts of ``model`` (a plain model of a registered family, on the meta device) this rank trains
    under ``plan``, sharded over ``meshes`` (``seektrain.parallel.mesh.build_meshes(plan)``).
    ``hf_path`` (a Hugging Face folder) replaces random init, each rank reading only its own slices;
    ``loss_fn(output, labels)`` is the pipeline schedule's loss."""
    if plan.pp == 1:
        parts, ids = [model], [0]
    else:
        from seektrain.parallel import pipeline

        parts, ids = pipeline.rank_stages(model, plan, meshes.pp_rank)
    reports = []
    for part in parts:
        _parallelize_part(part, plan, meshes, device)
        # Offloaded shards are materialised in host memory; buffers (the balancing biases) are not FSDP's
        # and stay with the compute on the device.
        part.to_empty(device="cpu" if plan.cpu_offload else device)
        if hf_path is None:
            part.init_weights(plan.job.train.seed)  # type: ignore[operator]  # nn.Module's stubs: Tensor | Module; families have it
        else:
            reports.append(load_pretrained(part, hf_path, plan.job.train.seed))
            log.info(reports[-1].describe(f"model.hf_path={hf_path}"))
        if plan.cpu_offload:
            _buffers_to(part, device)
    if plan.uses_ddp:
        parts = [apply_ddp(parts[0], meshes.dp_cp)]
    if plan.pp == 1:
        return ParallelModel(parts[0], parts, ids, load_reports=reports)
    schedule = pipeline.build_schedule(parts, ids, plan, meshes, device, loss_fn)
    return ParallelModel(_merged_view(parts), parts, ids, schedule, reports)


class _PartsView(nn.Module):
    """Holds (does not copy) several pipeline parts' submodules under the whole model's names."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        rules = family_of(parts[0]).pipeline
        ends = rules.first + rules.last
        for name in ends:
            setattr(self, name, None)
        merged = nn.ModuleDict()
        setattr(self, rules.layers, merged)
        for part in sorted(
            parts, key=lambda p: min((int(k) for k in getattr(p, rules.layers).keys()), default=0)
        ):
            for key, layer in getattr(part, rules.layers).items():
                merged[key] = layer
            for name in ends:
                if getattr(part, name) is not None:
                    setattr(self, name, getattr(part, name))


def _merged_view(parts: list[nn.Module]) -> nn.Module:
    return parts[0] if len(parts) == 1 else _PartsView(parts)


def load_pretrained(part: nn.Module, hf_path: str, seed: int):
    """Fill a materialised (possibly sharded) model part from a Hugging Face folder, this rank's slices
    only, through its family's loader; LoRA adapters, which no release holds, are initialised new.
    Returns the loader's report (bytes, seconds)."""
    report = family_of(part).load_hf(local_shards(part), config_of(part), hf_path)
    missing = [name for name in report.not_loaded if not is_adapter(name)]
    if missing:
        raise HFWeightsError(
            f"{hf_path}: holds no tensor for {missing[0]} ({len(missing)} of the model's tensors); "
            "the folder is not this model"
        )
    init_adapters(part, seed)
    return report


def unwrap(model: nn.Module) -> nn.Module:
    """The family model (``Transformer``...) inside DDP (FSDP2 and checkpoint wrappers keep the module itself)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) and is_family_model(inner) else model
