"""Validation loss on the prepared ``val`` split, every ``train.eval_interval`` steps.

Each evaluation reads the same ``train.eval_steps`` micro-batches per data-parallel rank from the start
of the split (a fresh loader with the run's seed), so successive ``val_loss`` values differ only
because the model changed. The value is the next-token cross-entropy (MTP excluded), averaged over the
trained tokens (labels not ``IGNORE``) of all the micro-batches on all data-parallel ranks, like
``lm_loss`` in training (``train/loss.py``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from seektrain.data.agreed import agreed
from seektrain.data.batch_loader import DistributedBatchLoader
from seektrain.data.dataset import TokenDataset
from seektrain.parallel.context_parallel import local_batch
from seektrain.train.loss import model_loss, step_denominators
from seektrain.train.pipeline_step import pipeline_inputs, pipeline_target

log = logging.getLogger("seektrain.train")


class Evaluator:
    """``meshes`` (``seektrain.parallel.mesh.Meshes``): this rank's data-parallel place (which rows of
    the split it reads), its context-parallel chunks and the groups the loss is summed over."""

    def __init__(self, plan, meshes, data_path: Path, device: torch.device):
        self.plan, self.meshes, self.device = plan, meshes, device
        self.interval, self.steps = plan.job.train.eval_interval, plan.job.train.eval_steps
        if plan.pp > 1:  # the schedule takes whole steps' worth of micro-batches
            self.steps = -(-self.steps // plan.accum_steps) * plan.accum_steps
        self.loader = None
        if self.interval and plan.pp > 1 and plan.job.parallel.pp_schedule == "zbv":
            # torch's zero-bubble V schedule has no forward-only pass (its eval() still hands gradients
            # between the two stages of a rank and fails); the other schedules evaluate
            log.warning(
                "no validation loss under parallel.pp_schedule=zbv: the schedule cannot run forward only"
            )
        elif self.interval:
            t = plan.job.train
            try:
                val = TokenDataset(data_path, split="val")
                loader = DistributedBatchLoader(
                    val,
                    t.seq_len,
                    t.micro_batch_size,
                    meshes.dp_rank,
                    plan.dp,
                    t.seed,
                    plan.job.data.packing,
                    plan.job.data.document_mask,
                )
                # [data] every rank stops at the same batch when one finds a damaged block (data/agreed.py)
                self.loader = agreed(loader, plan.job.dist.collective_timeout_s)
            except ValueError as err:  # no or too small a val split: train on, say why once
                log.warning("no validation loss: %s", err)
        # the loader's position at the split's start: every evaluation goes back to it (a loader
        # iterates on from where it stopped, so without it each evaluation read the next windows and a
        # resumed run, whose loader starts afresh, measured other data than an uninterrupted one)
        self.start = self.loader.state_dict() if self.loader is not None else None

    def due(self, step: int) -> bool:
        last = step == self.plan.job.train.steps
        return self.loader is not None and (step % self.interval == 0 or last)

    def batches(self) -> list:
        """This rank's ``eval_steps`` micro-batches from the start of the split, the same every time."""
        assert self.loader is not None, "due() is False without a validation loader"
        self.loader.load_state_dict(self.start)
        batches = itertools.islice(iter(self.loader), self.steps)
        return [local_batch(self.plan, self.meshes, b.to(self.device)) for b in batches]

    @torch.no_grad()
    def val_loss(self, ctx, stop: Callable[[], bool] | None = None) -> float | None:
        """Validation loss of ``ctx`` (a ``StepContext``): the next-token cross-entropy summed over the
        trained tokens of ``eval_steps`` micro-batches per rank, over their count on all ranks.
        ``stop`` (collective, the same answer on every rank: ``Preemption.agreed``) is asked before each
        micro-batch (under a pipeline, each step's worth); when it says so the evaluation is abandoned
        and None returned, so a SIGTERM never waits for a long evaluation."""
        plan = self.plan
        ctx.model.eval()
        try:
            batches = self.batches()
            denominators = step_denominators(plan, self.meshes, batches)
            total = torch.zeros((), device=self.device)
            if plan.pp > 1:
                lm = self._pipeline_losses(ctx, batches, denominators, stop)
                if lm is None:
                    return None
                total += lm
            else:
                for batch in batches:
                    if stop is not None and stop():
                        return None
                    with ctx.autocast:
                        out = ctx.model(
                            batch.tokens,
                            labels=batch.labels if plan.fused_loss else None,
                            positions=batch.positions,
                            document_ids=batch.document_ids,
                        )
                    with plan.loss_context():
                        parts = model_loss(out, batch.labels, 0.0, batch.document_ids, denominators)[1]
                    total += parts["lm_loss"].float()
            if plan.dp_cp > 1:
                dist.all_reduce(total, group=self.meshes.dp_cp.get_group())
                total /= plan.dp_cp
            return float(total)
        finally:
            ctx.model.train()

    def _pipeline_losses(self, ctx, batches, denominators: torch.Tensor, stop) -> torch.Tensor | None:
        """Sum over ``batches`` of their lm loss shares, through the pipeline schedule's forward-only pass,
        one step's worth (``accum_steps`` micro-batches) at a time; None when ``stop`` said so."""
        pm, loss_fn, accum = ctx.parallel, ctx.pipeline_loss, self.plan.accum_steps
        lm = torch.zeros((), device=self.device)
        for i in range(0, len(batches), accum):
            if stop is not None and stop():
                return None
            args, kwargs, cat = pipeline_inputs(self.plan, pm, batches[i : i + accum], self.device)
            loss_fn.records.clear()
            loss_fn.denominators = denominators
            with ctx.autocast, self.plan.loss_context():
                if pm.has_last_stage:
                    pm.schedule.eval(*args, target=pipeline_target(cat), losses=[], **kwargs)
                    # the last pp_microbatches: a shape-inference pass may have come first
                    lm += torch.stack(loss_fn.records[-self.plan.pp_microbatches :])[:, 1].sum()
                else:
                    pm.schedule.eval(*args, **kwargs)
        dist.all_reduce(lm, group=self.meshes.pp.get_group())  # the last stage's sum, on every rank
        return lm
