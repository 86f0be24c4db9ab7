"""Decoding with the KV cache (models/deepseek/kv_cache.py, train/decode.py) computes what rerunning the
whole sequence computes: greedy generation is the same token for token (dense GQA, V2 and V3 MLA with
MoE), a cached step's logits equal the full forward's last position within the rounding of a different
reduction order (MLA's absorbed form multiplies in another order), rows of a left-padded batch decode as
they would alone, the window slides past the context as without the cache, and LoRA on ``kv_b_proj``
reaches the absorbed form. What the cache stores per token is the documented formula."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from seektrain.models import build_model, get_preset
from seektrain.models.lora import LoraSpec, add_adapters
from seektrain.train.generate import generate, generate_batch
from tolerances import model_tol

PRESETS = ["tiny-dense", "tiny-v2", "tiny-v3"]
PROMPT = [5, 17, 99, 3, 200, 41, 7, 250]


@pytest.fixture(autouse=True)
def one_thread():
    """Decoding is many small products: on a shared CPU more threads only wait on each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(name: str, **changes):
    cfg = dataclasses.replace(get_preset(name), **changes)
    return build_model(cfg, seed=3).eval()


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_generation_with_the_cache_equals_without(preset):
    model = _model(preset)
    cached = generate(model, PROMPT, 200, temperature=0, use_cache=True)
    assert len(cached) == 200 and len(set(cached)) > 1  # a real continuation, not one token repeated
    assert cached == generate(model, PROMPT, 200, temperature=0, use_cache=False)


@pytest.mark.parametrize("preset", PRESETS)
def test_cached_steps_logits_equal_the_full_forward(preset):
    model = _model(preset)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens).logits
        cache = model.init_cache(2, 24)
        prefill = model(tokens[:, :20], cache=cache).logits
        steps = torch.cat([model(tokens[:, t : t + 1], cache=cache).logits for t in range(20, 24)], dim=1)
    tol = model_tol(model.cfg, 24, full.abs().max())
    torch.testing.assert_close(prefill, full[:, :20], **tol)
    torch.testing.assert_close(steps, full[:, 20:], **tol)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-v3"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_left_padded_rows_decode_as_they_would_alone(preset, use_cache):
    model = _model(preset)
    prompts = [PROMPT, [9, 8], [60] * 13, [1]]
    alone = [generate(model, p, 24, temperature=0, use_cache=use_cache) for p in prompts]
    assert generate_batch(model, prompts, 24, temperature=0, use_cache=use_cache) == alone


def test_a_row_ends_at_its_stop_id_and_the_others_go_on():
    model = _model("tiny-v3")
    prompts = [PROMPT, [60] * 5]
    free = generate_batch(model, prompts, 16, temperature=0)
    stop = free[0][5]
    ended = generate_batch(model, prompts, 16, temperature=0, stop_ids=[stop])
    assert ended[0] == free[0][: free[0].index(stop) + 1]
    assert ended[1] == (free[1][: free[1].index(stop) + 1] if stop in free[1] else free[1])


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-v3"])
def test_past_the_context_the_window_slides_as_without_the_cache(preset):
    model = _model(preset, max_position_embeddings=24)
    cached = generate(model, PROMPT, 40, temperature=0, use_cache=True)
    assert cached == generate(model, PROMPT, 40, temperature=0, use_cache=False)


def test_lora_on_kv_b_proj_reaches_the_absorbed_form():
    model = _model("tiny-v3")
    add_adapters(model, LoraSpec(4, 8.0, targets=("attention",)))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
        tokens = torch.tensor([PROMPT])
        full = model(tokens).logits
        cache = model.init_cache(1, len(PROMPT))
        model(tokens[:, :-1], cache=cache)
        step = model(tokens[:, -1:], cache=cache).logits
    torch.testing.assert_close(
        step[:, -1], full[:, -1], **model_tol(model.cfg, len(PROMPT), full.abs().max())
    )


@pytest.mark.parametrize("preset", PRESETS)
def test_the_cache_holds_the_documented_bytes_per_token(preset):
    model = _model(preset)
    cfg = model.cfg
    per_layer = (
        cfg.kv_lora_rank + cfg.qk_rope_head_dim if cfg.is_mla else 2 * cfg.num_key_value_heads * cfg.head_dim
    )
    assert model.init_cache(1, 4).bytes_per_token() == cfg.num_hidden_layers * per_layer * 4  # fp32
