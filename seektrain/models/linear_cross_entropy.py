"""The output head and its cross-entropy as one autograd function that never builds fp32 logits.

The plain path (``lm_head`` -> ``logits.float()`` -> ``log_softmax`` -> NLL, and the reverse in backward)
writes and reads several fp32 copies of the [tokens, vocab] logits: at small widths that memory traffic
costs as much as the head's matmuls. Here the logits are made by one matmul in the compute dtype and
turned, in place and a few rows at a time while they are still in cache, into their gradient
``softmax - onehot``; backward is then two matmuls. The only [tokens, vocab] tensor is that one buffer,
half the size of a single fp32 copy in bf16. Results equal the plain path's up to rounding order.
"""

from __future__ import annotations

import torch

IGNORE = -100
# fp32 bytes of logits turned into gradients at a time: on CPU about one core's L2 cache; on GPUs big
# blocks (few kernel launches) matter more than caches
_BLOCK_BYTES = {"cpu": 1 << 20}
_DEFAULT_BLOCK_BYTES = 1 << 28


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
        n, vocab = h_ND.shape[0], w_VD.shape[0]
        logits_NV = h_ND @ w_VD.t()  # becomes d(loss)/d(logits) in place below
        rows = max(1, _BLOCK_BYTES.get(h_ND.device.type, _DEFAULT_BLOCK_BYTES) // (4 * vocab))
        valid_N = labels_N != IGNORE
        target_N1 = labels_N.clamp_min(0).unsqueeze(1)
        loss = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        for s in range(0, n, rows):
            block = logits_NV[s : s + rows]
            logp = torch.log_softmax(block.float(), dim=1)
            target, valid = target_N1[s : s + rows], valid_N[s : s + rows]
            loss -= logp.gather(1, target).squeeze(1).masked_fill(~valid, 0.0).sum()
            probs = logp.exp_()
            probs.scatter_add_(1, target, valid.to(probs.dtype).neg().unsqueeze(1))
            block.copy_(probs)  # an ignored row keeps its softmax here: backward zeroes its [N, D] rows
        ctx.save_for_backward(h_ND, w_VD, logits_NV, valid_N)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        # Ignored rows are zeroed in the [N, D] operands, not in the [N, V] buffer: a masked fill of the
        # buffer costs a pass over it, and skipping it only when every label is valid would read that
        # fact on the host (a device sync per micro-batch). Zero rows contribute exact zeros either way.
        h_ND, w_VD, dlogits_NV, valid_N = ctx.saved_tensors
        ignored_N1 = ~valid_N.unsqueeze(1)
        g = grad_loss.float()  # scaled in fp32: a bf16 copy of e.g. 0.3 / 1023 would be off by up to 0.4%
        grad_h = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_h = (dlogits_NV @ w_VD).float().mul_(g).masked_fill_(ignored_N1, 0.0).to(h_ND.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = dlogits_NV.t() @ (h_ND.float() * g).masked_fill_(ignored_N1, 0.0).to(h_ND.dtype)
        return grad_h, grad_w, None


def linear_cross_entropy(h_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    """Sum over labelled rows of cross-entropy(h @ weight.T, labels), computed in fp32 from logits in the
    compute dtype (the autocast dtype when autocast is on). Rows labelled -100 are ignored."""
    device_type = h_ND.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        h_ND, weight_VD = h_ND.to(dtype), weight_VD.to(dtype)
    elif weight_VD.dtype != h_ND.dtype:
        h_ND = h_ND.to(weight_VD.dtype)
    if not (torch.is_grad_enabled() and (h_ND.requires_grad or weight_VD.requires_grad)):
        logits = (h_ND @ weight_VD.t()).float()
        return torch.nn.functional.cross_entropy(logits, labels_N, ignore_index=IGNORE, reduction="sum")
    with torch.autocast(device_type, enabled=False):
        return _LinearCrossEntropy.apply(h_ND, weight_VD, labels_N)


def head_target(
    labels: torch.Tensor, depth: int, document_ids_BT: torch.Tensor | None = None
) -> torch.Tensor:
    """Targets of head ``depth`` (0: the next token, k: MTP depth k) from ``labels``: the next-token
    labels [B, T], shifted here (``shift_labels``), or every head's targets already [B, T, 1 + depths]
    (context parallelism shifts the whole row before it splits it into chunks)."""
    if labels.dim() == 3:
        return labels[..., depth]
    return labels if depth == 0 else shift_labels(labels, depth, document_ids_BT)


def shift_labels(
    labels_BT: torch.Tensor, depth: int, document_ids_BT: torch.Tensor | None = None
) -> torch.Tensor:
    """Targets of MTP depth ``depth`` (1-based): the label ``depth`` positions ahead; the tail is ignored,
    and so is every position whose target lies in another document of a packed row."""
    shifted = torch.full_like(labels_BT, IGNORE)
    shifted[:, :-depth] = labels_BT[:, depth:]
    if document_ids_BT is not None:
        crosses = torch.zeros_like(document_ids_BT, dtype=torch.bool)
        crosses[:, :-depth] = document_ids_BT[:, :-depth] != document_ids_BT[:, depth:]
        shifted = shifted.masked_fill(crosses, IGNORE)
    return shifted
