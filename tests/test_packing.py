"""Packed rows are the same computation as their documents run alone: per-token logits (next-token and
every MTP depth) and the gradients of the summed loss, for the dense, V2 and V3 (MTP) models in fp32,
with the CPU policy's kernels (the trainer's). Loss-masked tokens change neither the loss nor any
gradient. Without positions and document ids the model keeps its plain causal path."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from packed_batches import document, pack
from seektrain.data.batch import Batch
from seektrain.models import build_model, get_preset
from seektrain.models import flex_attention as flex
from seektrain.models.kernels import Kernels, causal_attention, document_causal_mask
from seektrain.models.layers import rope_cos_sin
from seektrain.models.linear_cross_entropy import IGNORE, shift_labels
from seektrain.platform import policy_for
from tolerances import fp32_matmul_tol, model_rel, model_tol

SEQ = 40


def _docs(cfg, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [
        document(13, cfg.vocab_size, gen, 0.7),
        document(9, cfg.vocab_size, gen, 1.0),
        document(12, cfg.vocab_size, gen, 0.4),
    ]  # + 6 tokens of padding


def _run(model, batch: Batch):
    """(logits, MTP logits, gradients of every head's cross-entropy sum) of ``batch``."""
    model.zero_grad(set_to_none=True)
    out = model(
        batch.tokens, mtp_tokens=batch.tokens, positions=batch.positions, document_ids=batch.document_ids
    )
    loss = out.logits.new_zeros(())
    for depth, logits in enumerate((out.logits, *out.mtp)):
        targets = batch.labels if depth == 0 else shift_labels(batch.labels, depth, batch.document_ids)
        loss = loss + torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum"
        )
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), [m.detach() for m in out.mtp], grads


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-v2", "tiny-v3"])
def test_packed_row_equals_its_documents_alone(preset):
    cfg = get_preset(preset)
    model = build_model(cfg, seed=2, kernels=policy_for("cpu").model_kernels())
    docs = _docs(cfg)
    packed = pack(docs, SEQ)
    p_logits, p_mtp, p_grads = _run(model, packed)
    grads, start = None, 0
    for tokens, mask in docs:
        alone = pack([(tokens, mask)], len(tokens))
        logits, mtp, g = _run(model, Batch(alone.tokens, alone.labels))  # one document: the plain path
        n = len(tokens)
        tol = model_tol(cfg, SEQ, logits.abs().max())  # same sums, other reduction order (longer rows)
        torch.testing.assert_close(p_logits[:, start : start + n], logits, **tol)
        for depth, (p_m, m) in enumerate(zip(p_mtp, mtp, strict=True), start=1):  # where the target is inside
            torch.testing.assert_close(
                p_m[:, start : start + n - depth], m[:, : n - depth], **model_tol(cfg, SEQ, m.abs().max())
            )
        grads = g if grads is None else {k: grads[k] + g[k] for k in grads}
        start += n
    assert (len(p_mtp) > 0) == (preset == "tiny-v3")
    assert p_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert (p_grads[name] - grad).abs().max() <= 1e-4 * grad.abs().max() + 1e-7, name


def test_masked_tokens_change_neither_loss_nor_gradients():
    """The training loss (fused head) of a row with loss masks equals the loss of the logits weighted by
    the mask, and so do the gradients: the targets of masked positions, and MTP targets past a document
    boundary, are read nowhere."""
    cfg = get_preset("tiny-v3")
    model = build_model(cfg, seed=4, kernels=policy_for("cpu").model_kernels())
    batch = pack(_docs(cfg, seed=1), SEQ)
    results = []
    for fused in (True, False):
        model.zero_grad(set_to_none=True)
        if fused:
            out = model(
                batch.tokens,
                mtp_tokens=batch.tokens,
                labels=batch.labels,
                positions=batch.positions,
                document_ids=batch.document_ids,
            )
            loss = out.loss_sum + sum(out.mtp)
        else:  # every position's cross-entropy against the real next token, weighted by its mask
            out = model(
                batch.tokens,
                mtp_tokens=batch.tokens,
                positions=batch.positions,
                document_ids=batch.document_ids,
            )
            nxt = torch.cat([batch.tokens[:, 1:], batch.tokens[:, :1]], dim=1)
            loss = out.logits.new_zeros(())
            for depth, logits in enumerate((out.logits, *out.mtp)):
                targets = (
                    batch.labels if depth == 0 else shift_labels(batch.labels, depth, batch.document_ids)
                )
                weight = (targets != IGNORE).flatten().float()
                wanted = nxt.roll(-depth, dims=1).flatten()
                ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), wanted, reduction="none")
                loss = loss + (ce * weight).sum()
        loss.backward()
        results.append(
            (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        )
    (fused_loss, fused_grads), (ref_loss, ref_grads) = results
    torch.testing.assert_close(fused_loss, ref_loss, rtol=model_rel(cfg, SEQ), atol=0)
    for name, grad in ref_grads.items():
        assert (fused_grads[name] - grad).abs().max() <= 1e-4 * grad.abs().max() + 1e-7, name


def test_no_positions_no_documents_is_the_plain_path():
    """``None`` positions and document ids never build a mask (the fused causal kernel runs), and
    explicit positions 0 .. T-1 give RoPE the very same tables."""

    def no_mask(_ids):
        raise AssertionError("a document mask was built for an unpacked batch")

    cfg = get_preset("tiny-v3")
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model = build_model(cfg, seed=1, kernels=Kernels(document_mask=no_mask))
    reference = build_model(cfg, seed=1)
    torch.testing.assert_close(model(tokens).logits, reference(tokens, positions=None).logits, rtol=0, atol=0)
    plain = rope_cos_sin(cfg, 16, "cpu", torch.float32)
    gathered = rope_cos_sin(cfg, 16, "cpu", torch.float32, torch.arange(16).expand(2, 16))
    for table, rows in zip(plain, gathered, strict=True):
        assert torch.equal(rows, table.expand(2, 1, 16, -1))


def test_rope_restarts_at_each_document():
    """Each document of a packed row gets RoPE's tables of its own positions 0 .. n-1, and the model reads
    ``positions``. (Attention scores under RoPE depend only on the distance between positions, so the
    packed-equals-alone test cannot see positions that fail to restart: hence this one.)"""
    cfg = get_preset("tiny-v3")
    batch = pack(_docs(cfg), SEQ)
    cos, sin = rope_cos_sin(cfg, SEQ, "cpu", torch.float32, batch.positions)
    start = 0
    for n in (13, 9, 12):
        own_cos, own_sin = rope_cos_sin(cfg, n, "cpu", torch.float32)
        assert torch.equal(cos[0, 0, start : start + n], own_cos) and torch.equal(
            sin[0, 0, start : start + n], own_sin
        )
        start += n
    model = build_model(cfg, seed=1)
    shuffled = torch.randperm(SEQ, generator=torch.Generator().manual_seed(0))[None]
    assert not torch.allclose(
        model(batch.tokens, positions=shuffled).logits, model(batch.tokens).logits, atol=1e-3
    )


def test_flex_block_mask_is_the_document_mask(monkeypatch):
    """The accelerators' FlexAttention block mask attends exactly where the CPU's boolean mask does
    (FlexAttention's forward runs on the CPU, uncompiled)."""
    monkeypatch.setattr(flex, "_compiled_flex", lambda: flex_attention)
    cfg = get_preset("tiny-dense")
    ids = pack(_docs(cfg), SEQ).document_ids.expand(2, SEQ).clone()
    ids[1] = 0  # a row of one document
    q, k, v = torch.randn(3, 2, 4, SEQ, 16, generator=torch.Generator().manual_seed(0)).unbind(0)
    want = causal_attention(q, k, v, 0.25, document_causal_mask(ids))
    got = flex.flex_causal_attention(q, k, v, 0.25, flex.document_block_mask(ids))
    tol = fp32_matmul_tol(16 + SEQ, want.abs().max())  # scores over the head dim, values over the keys
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(want[1], causal_attention(q, k, v, 0.25)[1], **tol)


@pytest.mark.slow  # CPU compile: 150 s on 2 shared cores
def test_compiled_blocks_take_packed_rows():
    """Regional ``torch.compile`` (train.compile) of blocks that take RoPE tables per token and a
    document mask gives the eager model's logits and gradients on a packed row."""
    from seektrain.parallel.compile import apply_compile

    cfg = get_preset("tiny-dense").replace(num_hidden_layers=2)
    eager = build_model(cfg, seed=3, kernels=policy_for("cpu").model_kernels())
    compiled = build_model(cfg, seed=3, kernels=policy_for("cpu").model_kernels())
    apply_compile(compiled)
    batch = pack(_docs(cfg), SEQ)
    (e_logits, _, e_grads), (c_logits, _, c_grads) = _run(eager, batch), _run(compiled, batch)
    torch.testing.assert_close(c_logits, e_logits, **model_tol(cfg, SEQ, e_logits.abs().max()))
    for name, grad in e_grads.items():
        assert (c_grads[name] - grad).abs().max() <= 1e-4 * grad.abs().max() + 1e-7, name
