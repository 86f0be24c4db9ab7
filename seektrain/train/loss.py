"""Next-token cross-entropy, summed per token so accumulation and data parallelism average correctly,
plus the multi-token-prediction loss of DeepSeek-V3."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from seektrain.models.linear_cross_entropy import IGNORE, shift_labels
from seektrain.models.transformer import HeadLosses


def token_ce_sum(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of fp32 cross-entropy over labelled tokens, and how many tokens were labelled (at least 1)."""
    loss = F.cross_entropy(logits_BTV.flatten(0, 1).float(), labels_BT.flatten(), ignore_index=IGNORE,
                           reduction="sum")
    if isinstance(loss, DTensor):  # vocabulary-sharded logits under loss_parallel (tensor parallelism)
        loss = loss.full_tensor()
    return loss, _labelled(labels_BT)


def _labelled(labels_BT: torch.Tensor) -> torch.Tensor:
    """How many tokens carry a label (are not IGNORE), at least 1 (the divisor of a mean), as a tensor on
    the labels' device: an ``int`` would wait for the device every micro-batch. Dividing by it gives the
    same fp32 value as dividing by the Python int (on CUDA up to the last bit, where torch multiplies by
    the reciprocal of a host scalar)."""
    return (labels_BT != IGNORE).sum().clamp_min(1)


def model_loss(output, labels_BT: torch.Tensor, mtp_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean next-token loss (+ weighted mean MTP loss) of one micro-batch and its parts for logging.

    ``output`` is what the model returned: logits, (logits, *MTP logits), or the fused path's
    ``HeadLosses`` of cross-entropy sums."""
    if isinstance(output, HeadLosses):
        main = output.main / _labelled(labels_BT)
        mtp_sums = [(s, _labelled(shift_labels(labels_BT, d))) for d, s in enumerate(output.mtp, start=1)]
    else:
        logits, *mtp_logits = output if isinstance(output, tuple) else (output,)
        ce_sum, n = token_ce_sum(logits, labels_BT)
        main = ce_sum / n
        mtp_sums = [token_ce_sum(lg, shift_labels(labels_BT, d)) for d, lg in enumerate(mtp_logits, start=1)]
    parts = {"lm_loss": main.detach()}
    total = main
    if mtp_sums:
        mtp_losses = [s / m for s, m in mtp_sums]
        mtp = torch.stack(mtp_losses).mean()
        parts["mtp_loss"] = mtp.detach()
        total = total + mtp_weight * mtp
    return total, parts
