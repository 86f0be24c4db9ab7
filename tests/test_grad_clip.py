"""Gradient clipping (seektrain/train/grad.py) scales the gradients to ``train.grad_clip``."""

from __future__ import annotations

import pytest
import torch

from seektrain.train.grad import clip_grad_norm


def test_clipping_scales_gradients_to_max_norm():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    a.grad, b.grad = torch.full((3,), 4.0), torch.full((4,), 3.0)  # global norm sqrt(48 + 36)
    norm = clip_grad_norm([a, b], max_norm=1.0)
    assert norm.item() == pytest.approx(84**0.5)  # the norm before clipping is returned
    assert torch.cat([a.grad, b.grad]).norm().item() == pytest.approx(
        1.0, rel=1e-6 / 84**0.5 + 7 * 2**-24
    )  # coefficient 1 / (norm + 1e-6); 7 roundings


def test_max_norm_zero_only_measures():
    a = torch.nn.Parameter(torch.zeros(2))
    a.grad = torch.tensor([3.0, 4.0])
    assert clip_grad_norm([a], max_norm=0).item() == pytest.approx(5.0)
    assert a.grad.tolist() == [3.0, 4.0]
