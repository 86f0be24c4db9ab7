"""``train.compile`` compiles every decoder block and trains the same model: fp32 losses of a compiled
tiny run equal the eager run's."""

from __future__ import annotations

import pytest
from run_cli import losses, train


def test_compiled_blocks_train_like_eager(tmp_path):
    common = ("train.steps=3", "model.preset=tiny-dense")
    train(tmp_path / "eager", *common)
    proc = train(tmp_path / "compiled", *common, "train.compile=true")
    assert "train.compile: 4 blocks compile at their first call" in proc.stdout
    assert losses(tmp_path / "compiled") == pytest.approx(losses(tmp_path / "eager"), rel=1e-5, abs=1e-6)
