"""Validation loss on the prepared ``val`` split, every ``train.eval_interval`` steps.

Each evaluation reads the same ``train.eval_steps`` micro-batches per data-parallel rank from the start
of the split (a fresh loader with the run's seed), so successive ``val_loss`` values differ only
because the model changed. The value is the next-token cross-entropy (MTP excluded), averaged over the
micro-batches and the data-parallel ranks, like ``lm_loss`` in training.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from seektrain.data.dataset import TokenDataset
from seektrain.data.loader import DistributedBatchLoader
from seektrain.train.loss import model_loss

log = logging.getLogger("seektrain.train")


class Evaluator:
    def __init__(self, plan, data_path: Path, dp_rank: int, device: torch.device):
        self.plan, self.device = plan, device
        self.interval, self.steps = plan.job.train.eval_interval, plan.job.train.eval_steps
        if plan.pp > 1:  # the schedule takes whole steps' worth of micro-batches
            self.steps = -(-self.steps // plan.accum_steps) * plan.accum_steps
        self.loader = None
        if self.interval and plan.pp > 1 and plan.job.parallel.pp_schedule == "zbv":
            # torch's zero-bubble V schedule has no forward-only pass (its eval() still hands gradients
            # between the two stages of a rank and fails); the other schedules evaluate
            log.warning("no validation loss under parallel.pp_schedule=zbv: the schedule cannot run forward only")
        elif self.interval:
            t = plan.job.train
            try:
                val = TokenDataset(data_path, split="val")
                self.loader = DistributedBatchLoader(val, t.seq_len, t.micro_batch_size, dp_rank, plan.dp, t.seed,
                                                     plan.job.data.packing, plan.job.data.document_mask)
            except ValueError as err:  # no or too small a val split: train on, say why once
                log.warning("no validation loss: %s", err)

    def due(self, step: int) -> bool:
        last = step == self.plan.job.train.steps
        return self.loader is not None and (step % self.interval == 0 or last)

    @torch.no_grad()
    def val_loss(self, ctx) -> float:
        """Mean validation loss of ``ctx`` (a ``StepContext``) over ``eval_steps`` micro-batches per rank."""
        plan = self.plan
        ctx.model.eval()
        try:
            total = torch.zeros((), device=self.device)
            batches = list(itertools.islice(iter(self.loader), self.steps))
            if plan.pp > 1:
                total += self._pipeline_losses(ctx, batches)
            else:
                for batch in batches:
                    tokens, labels = batch.tokens.to(self.device), batch.labels.to(self.device)
                    with ctx.autocast:
                        out = ctx.model(tokens, labels=labels if plan.fused_loss else None)
                    with plan.loss_context():
                        total += model_loss(out, labels, 0.0)[1]["lm_loss"].float()
            total /= len(batches)
            if plan.dp > 1:
                dist.all_reduce(total, group=plan.meshes.dp.get_group())
                total /= plan.dp
            return float(total)
        finally:
            ctx.model.train()

    def _pipeline_losses(self, ctx, batches) -> torch.Tensor:
        """Sum over ``batches`` of the lm loss, through the pipeline schedule's forward-only pass, one
        step's worth (``accum_steps`` micro-batches) at a time."""
        pm, loss_fn, accum = ctx.parallel, ctx.pipeline_loss, self.plan.accum_steps
        lm = torch.zeros((), device=self.device)
        for i in range(0, len(batches), accum):
            tokens = torch.cat([b.tokens for b in batches[i:i + accum]]).to(self.device)
            labels = torch.cat([b.labels for b in batches[i:i + accum]]).to(self.device)
            args = ((tokens, labels) if self.plan.use_mtp else (tokens,)) if pm.has_first_stage else ()
            loss_fn.records.clear()
            with ctx.autocast, self.plan.loss_context():
                if pm.has_last_stage:
                    pm.schedule.eval(*args, target=labels, losses=[])
                    lm += torch.stack(loss_fn.records)[:, 1].mean() * accum
                else:
                    pm.schedule.eval(*args)
        dist.all_reduce(lm, group=self.plan.meshes.pp.get_group())  # the last stage's sum, on every rank
        return lm
