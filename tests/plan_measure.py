"""Measure what the planner predicts, on a real parallelised model built as the trainer builds it: local
bytes of parameters, of gradients after a backward and of AdamW state after a step, and the peak
activation bytes of one forward + backward (``MemTracker``'s ACT + TEMP, not RSS; under pipeline
parallelism they include the gradients, see ``_NoModuleHooks``)."""

from __future__ import annotations

import json
import os
from typing import ClassVar

import torch
import torch.distributed as dist


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


class _NoHook:
    def remove(self) -> None:
        pass


def _skip_frozen(tracker) -> None:
    """MemTracker registers a gradient hook on every parameter of a module it enters (FSDP's unsharded
    ones included), which fails on a frozen one (LoRA's base: "cannot register a hook on a tensor that
    doesn't require gradient"): report those as hooked already. Their bytes still count as parameters."""
    from torch.utils.weak import WeakIdKeyDictionary

    class FrozenHooked(WeakIdKeyDictionary):
        def get(self, key, default=None):
            return (_NoHook(), _NoHook()) if not key.requires_grad else super().get(key, default)

    tracker._param_to_grad_hook_handles = FrozenHooked()


class _NoModuleHooks:
    """Stands in for MemTracker's ModTracker: no module or multi-grad hooks (which fail inside the
    pipeline schedule's ``autograd.grad``), so every allocation, gradients included, is filed as ACT."""

    is_bw = False
    parents: ClassVar[set] = set()

    def register_user_hooks(self, *hooks) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *args) -> None:
        pass


def measure(job, model_cfg, world: int, device: torch.device) -> dict:
    """One training step of ``job`` on this rank: the measured numbers as a dict."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from seektrain.data.batch import Batch
    from seektrain.models import build_model
    from seektrain.parallel.context_parallel import local_batch
    from seektrain.parallel.parallelize import parallelize_model
    from seektrain.plan.run_plan import RunPlan
    from seektrain.train.loss import model_loss
    from seektrain.train.optim import build_optimizer
    from seektrain.train.pipeline_step import PipelineLoss
    from seektrain.train.precision import DynamicLossScaler
    from seektrain.train.step import model_inputs

    plan = RunPlan.resolve(job, model_cfg, world, device.type)
    loss_fn = (
        PipelineLoss(DynamicLossScaler(False, 1.0, 1), job.train.mtp_loss_weight) if plan.pp > 1 else None
    )
    pm = parallelize_model(
        build_model(plan.model, device="meta", kernels=plan.platform.model_kernels(plan.compute_dtype)),
        plan,
        device,
        loss_fn=loss_fn,
    )
    model = pm.model
    optimizer = build_optimizer(model, job.optim)
    dp_rank = plan.meshes.dp.get_local_rank()
    gen = torch.Generator().manual_seed(dp_rank)
    local = job.train.micro_batch_size * (plan.accum_steps if plan.pp > 1 else 1)
    tokens = torch.randint(0, model_cfg.vocab_size, (local, job.train.seq_len), generator=gen)
    tracker = MemTracker()
    if plan.pp > 1:  # its module hooks clash with the schedule's autograd.grad: count allocations only
        tracker._mod_tracker = _NoModuleHooks()
    tracker.track_external(*pm.parts, optimizer)
    _skip_frozen(tracker)
    with tracker:
        with plan.autocast(device), plan.loss_context():
            if plan.pp > 1:
                args = ((tokens, tokens) if plan.use_mtp else (tokens,)) if pm.has_first_stage else ()
                if pm.has_last_stage:
                    pm.schedule.step(*args, target=tokens, losses=[])
                else:
                    pm.schedule.step(*args)
            else:
                # this rank's context-parallel chunks (the batch itself without cp), as the step trains them
                batch = local_batch(plan, Batch(tokens=tokens, labels=tokens))
                out = model(batch.tokens, **model_inputs(plan, batch))
                loss, _ = model_loss(out, batch.labels, job.train.mtp_loss_weight)
                loss.backward()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    acts = sum(v for k, v in peak.items() if str(k).endswith(("ACT", "TEMP")))
    grads = _local_bytes(p.grad for p in model.parameters() if p.grad is not None)
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return {
        "params": _local_bytes(model.parameters()),
        "grads": grads,
        "optimizer": _local_bytes(state),
        "activations": acts,
    }


def worker(rank: int, out_dir: str) -> None:
    """Spawned rank (tests/spawn_ranks.py): measure every case of ``cases.json`` in ``out_dir`` (each a
    model and overrides) on the spawned world."""
    from seektrain.config.loader import load_config
    from seektrain.models.deepseek.presets import get_preset

    cases = json.loads(open(os.path.join(out_dir, "cases.json")).read())
    world = dist.get_world_size()
    results = {}
    for name, case in cases["cases"].items():
        job = load_config(None, case["overrides"])
        results[name] = measure(job, get_preset(case["model"]), world, torch.device("cpu"))
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
