"""Next-token cross-entropy, summed per token so accumulation and data parallelism average correctly,
plus the multi-token-prediction loss of DeepSeek-V3."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

IGNORE = -100


def token_ce_sum(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sum of fp32 cross-entropy over labelled tokens, and how many tokens were labelled."""
    loss = F.cross_entropy(logits_BTV.flatten(0, 1).float(), labels_BT.flatten(), ignore_index=IGNORE,
                           reduction="sum")
    if isinstance(loss, DTensor):  # vocabulary-sharded logits under loss_parallel (tensor parallelism)
        loss = loss.full_tensor()
    return loss, int((labels_BT != IGNORE).sum())


def mtp_labels(labels_BT: torch.Tensor, depth: int) -> torch.Tensor:
    """Targets of MTP depth ``depth`` (1-based): the label ``depth`` positions ahead; the tail is ignored."""
    shifted = torch.full_like(labels_BT, IGNORE)
    shifted[:, :-depth] = labels_BT[:, depth:]
    return shifted


def model_loss(output, labels_BT: torch.Tensor, mtp_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean next-token loss (+ weighted mean MTP loss) of one micro-batch and its parts for logging."""
    if isinstance(output, tuple):
        logits, mtp_logits = output
    else:
        logits, mtp_logits = output, []
    ce_sum, n = token_ce_sum(logits, labels_BT)
    main = ce_sum / max(n, 1)
    parts = {"lm_loss": main.detach()}
    total = main
    if mtp_logits:
        mtp_losses = []
        for depth, lg in enumerate(mtp_logits, start=1):
            s, m = token_ce_sum(lg, mtp_labels(labels_BT, depth))
            mtp_losses.append(s / max(m, 1))
        mtp = torch.stack(mtp_losses).mean()
        parts["mtp_loss"] = mtp.detach()
        total = total + mtp_weight * mtp
    return total, parts
