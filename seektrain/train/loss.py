"""Next-token cross-entropy and DeepSeek-V3's multi-token-prediction loss, normalised over the trained
tokens of the whole global batch.

Why not a mean per micro-batch: with loss masks (chat data, packing) micro-batches hold very different
numbers of trained tokens, and a mean of per-micro-batch means weighs a token of a short one more than a
token of a long one (the gradient-accumulation pitfall). So every micro-batch's cross-entropy *sum* is
divided by ``denominators``: the step's trained-token count over all its micro-batches and all
data-parallel and context-parallel ranks (``global_denominators``; a cp rank holds chunks of the rows its
peers hold), divided by their number, because FSDP and DDP average gradients over those ranks. Summed
over the micro-batches and averaged over the ranks, the losses are then the per-token mean of the step,
and so are the gradients. MTP depths are normalised the same way, each by its own count (a depth has
fewer targets: the row's tail and document boundaries).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from seektrain.models import ModelOutput
from seektrain.models.linear_cross_entropy import IGNORE, head_target


def token_ce_sum(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """Sum of fp32 cross-entropy over labelled tokens."""
    loss = F.cross_entropy(
        logits_BTV.flatten(0, 1).float(), labels_BT.flatten(), ignore_index=IGNORE, reduction="sum"
    )
    if isinstance(loss, DTensor):  # vocabulary-sharded logits under loss_parallel (tensor parallelism)
        loss = loss.full_tensor()
    return loss


def head_labels(
    labels_BT: torch.Tensor, mtp_depths: int, document_ids_BT: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """The targets of the next-token head, then of each MTP depth (``labels_BT``: see ``head_target``)."""
    return [head_target(labels_BT, d, document_ids_BT) for d in range(mtp_depths + 1)]


def trained_counts(
    labels_BT: torch.Tensor, mtp_depths: int, document_ids_BT: torch.Tensor | None = None
) -> torch.Tensor:
    """[1 + mtp_depths] int64 on the labels' device: how many targets each head is trained on. A device
    tensor: an ``int`` would wait for the device every micro-batch."""
    return _counts(head_labels(labels_BT, mtp_depths, document_ids_BT))


def _counts(targets: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([(t != IGNORE).sum() for t in targets])


def global_denominators(counts: torch.Tensor, dp: int, dp_group=None) -> torch.Tensor:
    """``denominators`` of ``model_loss`` from this rank's ``trained_counts`` summed over the step's
    micro-batches: summed over the data-parallel ranks (one all-reduce per step, on the device), at
    least 1, divided by ``dp`` (gradients are averaged over the ranks)."""
    counts = counts.to(torch.float64)
    if dp > 1:
        dist.all_reduce(counts, group=dp_group)
    return (counts.clamp_min(1) / dp).float()


def step_denominators(plan, meshes, batches) -> torch.Tensor:
    """``model_loss``'s denominators for a step's (or an evaluation's) micro-batches ``batches`` on
    this rank under the run plan ``plan``, the counts summed over ``meshes.dp_cp``
    (``seektrain.parallel.mesh.Meshes``)."""
    depths = plan.model.num_nextn_predict_layers if plan.use_mtp else 0
    counts = sum(trained_counts(b.labels, depths, b.document_ids) for b in batches)
    assert isinstance(counts, torch.Tensor), "a step has at least one micro-batch"
    return global_denominators(counts, plan.dp_cp, meshes.dp_cp.get_group() if plan.dp_cp > 1 else None)


def model_loss(
    output: ModelOutput,
    labels_BT: torch.Tensor,
    mtp_weight: float,
    document_ids_BT: torch.Tensor | None = None,
    denominators: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the step's loss (next-token + ``mtp_weight`` x mean over MTP depths),
    and its parts for logging: each head's cross-entropy sum over ``denominators`` (see the module
    docstring; ``None``: this micro-batch's own counts, its per-token mean)."""
    targets = head_labels(labels_BT, len(output.mtp), document_ids_BT)
    if output.loss_sum is not None:  # the fused head: cross-entropy sums already
        sums = [output.loss_sum, *output.mtp]
    else:
        assert output.logits is not None, "a model without the fused head returns its logits"
        sums = [token_ce_sum(lg, t) for lg, t in zip((output.logits, *output.mtp), targets, strict=True)]
    if denominators is None:
        denominators = _counts(targets).clamp_min(1)
    main = sums[0] / denominators[0]
    parts = {"lm_loss": main.detach()}
    total = main
    if output.mtp:
        mtp = torch.stack([s / n for s, n in zip(sums[1:], denominators[1:], strict=True)]).mean()
        parts["mtp_loss"] = mtp.detach()
        total = total + mtp_weight * mtp
    return total, parts
