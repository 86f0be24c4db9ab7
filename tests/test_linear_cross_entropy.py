"""The fused head + cross-entropy equals the plain path (lm_head -> fp32 logits -> cross_entropy): loss and
gradients, with ignored labels, in fp32 and bf16, under autocast, without grad, and through the model's
training forward (``model(tokens, labels=...)``) with MTP."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from seektrain.models import build_model, get_preset
from seektrain.models import linear_cross_entropy as lce
from seektrain.train.loss import model_loss
from tolerances import fp32_matmul_tol, model_tol


def _inputs(dtype, n=70, d=24, v=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(v, d, generator=gen) * 0.3).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[::7] = lce.IGNORE
    return h, w, labels


def _grads(fn, h, w, labels, scale=1.0):
    h.grad = w.grad = None
    loss = fn(h, w, labels)
    (loss * scale).backward()
    return loss.detach().float(), h.grad.float().clone(), w.grad.float().clone()


def _plain(h, w, labels):
    return F.cross_entropy((h @ w.t()).float(), labels, ignore_index=lce.IGNORE, reduction="sum")


@pytest.mark.parametrize("block_bytes", [1 << 20, 4 * 50 * 3])  # one block; blocks of 3 rows (ragged tail)
def test_matches_plain_path_fp32(monkeypatch, block_bytes):
    monkeypatch.setitem(lce._BLOCK_BYTES, "cpu", block_bytes)
    h, w, labels = _inputs(torch.float32)
    ref, fused = _grads(_plain, h, w, labels, 0.37), _grads(lce.linear_cross_entropy, h, w, labels, 0.37)
    k = h.shape[1] + w.shape[0] + h.shape[0]  # logits over d, softmax over v, sums over the n rows
    for a, b in zip(ref, fused):
        torch.testing.assert_close(b, a, **fp32_matmul_tol(k, a.abs().max()))


@pytest.mark.parametrize("scale", [1.0, 0.3 / 1081])  # the second is 0.34% off in bf16 (MTP weight / count)
def test_matches_plain_path_bf16_to_rounding(scale):
    h, w, labels = _inputs(torch.bfloat16)
    ref, fused = _grads(_plain, h, w, labels, scale), _grads(lce.linear_cross_entropy, h, w, labels, scale)
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-4, atol=1e-3)
    for a, b in zip(ref[1:], fused[1:]):  # both round d(logits) to bf16 once
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2 * a.abs().max().item())
        assert abs(b.norm() / a.norm() - 1) < 1e-3  # no systematic error in the gradient's scale


def test_all_labels_ignored_gives_zero_loss_and_grads():
    h, w, labels = _inputs(torch.float32)
    loss, gh, gw = _grads(lce.linear_cross_entropy, h, w, torch.full_like(labels, lce.IGNORE))
    assert loss.item() == 0.0 and gh.abs().max().item() == 0.0 and gw.abs().max().item() == 0.0


def test_autocast_computes_in_bf16_and_returns_fp32_loss():
    h, w, labels = _inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _gh, _gw = _grads(lce.linear_cross_entropy, h, w, labels)
        ref = _grads(lambda *a: _plain(a[0].bfloat16(), a[1].bfloat16(), a[2]), h, w, labels)
    assert loss.dtype == torch.float32 and h.grad.dtype == torch.float32
    torch.testing.assert_close(loss, ref[0], rtol=1e-4, atol=1e-3)


def test_no_grad_path_gives_the_same_loss():
    h, w, labels = _inputs(torch.float32)
    with torch.no_grad():
        loss = lce.linear_cross_entropy(h, w, labels)
    want = _plain(h, w, labels).detach()
    torch.testing.assert_close(loss, want, **fp32_matmul_tol(h.shape[1] + w.shape[0] + h.shape[0], want))


@pytest.mark.parametrize("preset", ["tiny-v3", "tiny-dense"])
def test_model_training_forward_matches_logits_path(preset):
    cfg = get_preset(preset)
    model = build_model(cfg, seed=5)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    mtp = inputs if cfg.num_nextn_predict_layers else None
    results = []
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        out = model(inputs, mtp_tokens=mtp, labels=labels if fused else None)
        loss, _parts = model_loss(out, labels, 0.3)
        loss.backward()
        results.append(
            (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        )
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-6)
    assert g0.keys() == g1.keys()
    for name in g0:
        tol = model_tol(cfg, inputs.shape[1], g0[name].abs().max(), backward=True)
        torch.testing.assert_close(g1[name], g0[name], **tol, msg=name)
