"""LoRA's model side (seektrain/models/lora.py): what each target selects, that a zero adapter changes
nothing, that training moves the adapters only, and the routed experts' grouped adapters against a
plain per-expert reference."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from seektrain.errors import UserError
from seektrain.models import build_model, get_preset
from seektrain.models.lora import (
    GROUPS,
    LoraSpec,
    adapter_weights,
    add_adapters,
    freeze_base,
    is_adapter,
    trainable_counts,
)
from seektrain.models.moe import grouped_swiglu
from seektrain.train.optim import build_optimizer

MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
SWIGLU = ("gate_proj", "up_proj", "down_proj")


def _blocks(cfg):
    """(prefix, config layer index) of every decoder block, MTP blocks included."""
    return [(f"layers.{i}.", i) for i in range(cfg.num_hidden_layers)] + [
        (f"mtp.{k}.block.", cfg.num_hidden_layers + k) for k in range(cfg.num_nextn_predict_layers)
    ]


def _expected(cfg, group: str) -> set[str]:
    """The base weight names a target group must select, written out from the architecture."""
    out = set()
    for prefix, block in _blocks(cfg):
        moe = cfg.is_moe_layer(block)
        if group == "attention":
            if not cfg.is_mla:
                projs = ("q_proj", "k_proj", "v_proj", "o_proj")
            elif cfg.q_lora_rank is None:
                projs = ("q_proj", *MLA[2:])
            else:
                projs = MLA
            out |= {f"{prefix}self_attn.{p}.weight" for p in projs}
        elif group == "mlp" and not moe:
            out |= {f"{prefix}mlp.{p}.weight" for p in SWIGLU}
        elif group == "shared_experts" and moe and cfg.n_shared_experts:
            out |= {f"{prefix}mlp.shared_experts.{p}.weight" for p in SWIGLU}
        elif group == "experts" and moe:
            out |= {f"{prefix}mlp.experts.gate_up_proj", f"{prefix}mlp.experts.down_proj"}
    return out


@pytest.mark.parametrize("preset", ["tiny-v3", "tiny-v2", "tiny-dense"])
def test_every_target_group_selects_what_it_says(preset):
    cfg = get_preset(preset)
    every = set()
    for group in GROUPS:
        want = _expected(cfg, group)
        every |= want
        if not want:  # the model has none: named alone it is refused
            with pytest.raises(UserError, match="has no"):
                adapter_weights(cfg, LoraSpec(2, 4.0, targets=(group,)))
            continue
        assert set(adapter_weights(cfg, LoraSpec(2, 4.0, targets=(group,)))) == want, group
    # the default list (every group) is "every adaptable module", on a dense model too
    chosen = adapter_weights(cfg, LoraSpec(2, 4.0))
    assert set(chosen) == every
    model = build_model(cfg, device="meta")
    add_adapters(model, LoraSpec(2, 4.0))
    names = dict(model.named_parameters())
    for base, shapes in chosen.items():
        assert base in names, base  # the base keeps its name
        assert tuple(names[shapes.a_name].shape) == shapes.a and tuple(names[shapes.b_name].shape) == shapes.b
    assert {n for n in names if is_adapter(n)} == {s for a in chosen.values() for s in (a.a_name, a.b_name)}
    assert not any(is_adapter(n) for n in names if n.startswith(("embed_tokens", "lm_head")) or "norm" in n)


def test_routed_expert_adapters_are_grouped_per_expert():
    cfg = get_preset("tiny-v3")
    shapes = adapter_weights(cfg, LoraSpec(4, 8.0, targets=("experts",)))["layers.1.mlp.experts.gate_up_proj"]
    E, F, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    assert (shapes.a_name, shapes.a, shapes.b) == (
        "layers.1.mlp.experts.gate_up_proj_lora_A",
        (E, 4, D),
        (E, 2 * F, 4),
    )
    down = adapter_weights(cfg, LoraSpec(4, 8.0, targets=("experts",)))["layers.1.mlp.experts.down_proj"]
    assert (down.b_name, down.a, down.b) == ("layers.1.mlp.experts.down_proj_lora_B", (E, 4, F), (E, D, 4))


def test_a_pattern_selects_by_module_path():
    cfg = get_preset("tiny-v3")
    chosen = adapter_weights(cfg, LoraSpec(2, 4.0, targets=("*.self_attn.o_proj", "layers.1.mlp.experts")))
    want = {f"{p}self_attn.o_proj.weight" for p, _ in _blocks(cfg)}
    assert set(chosen) == want | {"layers.1.mlp.experts.gate_up_proj", "layers.1.mlp.experts.down_proj"}


def _expert_inputs(E=4, D=16, F=8, r=3, n=19, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor([7, 0, 5, 7])[:E]
    rand = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return (
        rand(n, D),
        counts,
        rand(E, 2 * F, D),
        rand(E, D, F),
        [rand(E, r, D), rand(E, 2 * F, r), rand(E, r, F), rand(E, D, r)],
    )


@pytest.mark.parametrize("grouped,rank", [(True, 4), (False, 4), (True, 3)])
def test_grouped_expert_adapters_match_a_loop_over_experts(grouped, rank):
    """The grouped GEMM and the padded-bmm fallback (the platform's choice, or a rank whose rows the
    grouped GEMM cannot take: 3 fp32 values are not 16 bytes) against each expert computed alone."""
    from seektrain.models.kernels import Kernels
    from seektrain.models.lora import ExpertAdapters

    x, counts, w1, w2, ad = _expert_inputs(r=rank)
    adapters = ExpertAdapters(*ad, scaling=0.5, dropout=0.0, training=True)
    kernels = Kernels() if grouped else Kernels(grouped_mm_dtypes=())
    got = grouped_swiglu(x, counts, w1, w2, kernels, adapters)
    rows, start = [], 0
    for e, c in enumerate(counts.tolist()):
        xe = x[start : start + c]
        gu = xe @ w1[e].T + 0.5 * (xe @ ad[0][e].T) @ ad[1][e].T
        gate, up = gu.chunk(2, -1)
        h = torch.nn.functional.silu(gate) * up
        rows.append(h @ w2[e].T + 0.5 * (h @ ad[2][e].T) @ ad[3][e].T)
        start += c
    torch.testing.assert_close(got, torch.cat(rows), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["tiny-v3", "tiny-dense"])
def test_zero_adapters_change_nothing(preset):
    cfg = get_preset(preset)
    base = build_model(cfg, seed=3)
    adapted = copy.deepcopy(base)
    add_adapters(adapted, LoraSpec(4, 16.0))
    adapted.init_weights(3)  # the same base values (names unchanged), B = 0
    assert all(torch.equal(p, adapted.state_dict()[k]) for k, p in base.state_dict().items())
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(adapted(tokens).logits, base(tokens).logits)
    a = dict(adapted.named_parameters())
    assert all(a[n].abs().sum() == 0 for n in a if "lora_B" in n)
    assert all(a[n].abs().sum() > 0 for n in a if "lora_A" in n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_moves_only_the_adapters(dtype):
    """A few AdamW steps of tiny-v3 (routed experts included): the base bit-identical, in the compute
    dtype and without gradients or optimizer state; every adapter tensor changed; only adapters in the
    optimizer."""
    cfg = get_preset("tiny-v3")
    model = build_model(cfg, device="meta")
    add_adapters(model, LoraSpec(4, 8.0))
    freeze_base(model, dtype)
    model.to_empty(device="cpu")
    model.init_weights(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    from seektrain.config.schema import OptimSection

    opt = build_optimizer(model, OptimSection(lr=1e-2))
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    names = dict(model.named_parameters())
    assert in_opt == {id(p) for n, p in names.items() if is_adapter(n)}
    assert all(p.dtype == torch.float32 for n, p in names.items() if is_adapter(n))
    assert all(p.dtype == dtype and not p.requires_grad for n, p in names.items() if not is_adapter(n))
    g = torch.Generator().manual_seed(1)
    ctx = (
        torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else torch.autocast("cpu", enabled=False)
    )
    for _ in range(3):
        tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
        with ctx:
            out = model(tokens, mtp_tokens=tokens, labels=tokens)
        (out.loss_sum + sum(out.mtp)).backward()
        assert all(p.grad is None for n, p in names.items() if not is_adapter(n))
        opt.step()
        opt.zero_grad()
    after = model.state_dict()
    for name, value in after.items():
        if is_adapter(name):
            assert not torch.equal(value, before[name]), f"{name} did not train"
        else:
            assert torch.equal(value, before[name]), f"{name} changed"
    with_state = {id(p) for p in opt.state}
    assert with_state == {id(p) for n, p in names.items() if is_adapter(n)}  # no state for the base
    trainable, frozen = trainable_counts(model)
    assert trainable == sum(a.numel for a in adapter_weights(cfg, LoraSpec(4, 8.0)).values())
    assert frozen == sum(p.numel() for n, p in names.items() if not is_adapter(n))


def test_rank_above_a_targets_smallest_dimension_is_refused():
    cfg = get_preset("tiny-v3")
    with pytest.raises(UserError, match=r"lora.rank=100000 exceeds the smallest dimension"):
        adapter_weights(cfg, LoraSpec(100000, 1.0))


def test_a_pattern_matching_nothing_is_refused():
    with pytest.raises(UserError, match=r"'\*.nothing' matches no adaptable module"):
        adapter_weights(get_preset("tiny-v3"), LoraSpec(2, 4.0, targets=("*.nothing",)))
    with pytest.raises(UserError, match="matches no adaptable"):  # the head is never adapted
        adapter_weights(get_preset("tiny-v3"), LoraSpec(2, 4.0, targets=("lm_head",)))


def test_a_pipeline_stage_gets_only_its_own_adapters():
    model = build_model(get_preset("tiny-v3"), device="meta")
    for key in ("0", "1"):
        del model.layers[key]
    model.embed_tokens = None
    adapted = add_adapters(model, LoraSpec(2, 4.0))
    assert adapted and all(not p.startswith(("layers.0.", "layers.1.")) for p in adapted)
    assert any(p.startswith("layers.2.") for p in adapted) and any(p.startswith("mtp.0.") for p in adapted)


def test_linear_adapter_math():
    lin = nn.Linear(6, 5)
    model = nn.Module()
    model.lin = lin
    torch.manual_seed(0)
    x = torch.randn(3, 6)
    base = lin(x)
    # the hook on a bare linear (add_adapters needs a family model; the hook is the same)
    from seektrain.models.lora import _linear_adapter

    lin.lora_A, lin.lora_B = nn.Parameter(torch.randn(2, 6)), nn.Parameter(torch.randn(5, 2))
    lin.lora_scaling, lin.lora_dropout = 1.5, 0.0
    lin.register_forward_hook(_linear_adapter)
    torch.testing.assert_close(lin(x), base + 1.5 * x @ lin.lora_A.T @ lin.lora_B.T)
