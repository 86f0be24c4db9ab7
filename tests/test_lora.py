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
from seektrain.models.deepseek.moe import grouped_swiglu
from seektrain.models.lora import (
    GROUPS,
    LoraSpec,
    adapter_weights,
    add_adapters,
    freeze_base,
    is_adapter,
    trainable_counts,
)
from seektrain.train.optim import build_optimizer
from tolerances import fp32_matmul_tol

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
    want = torch.cat(rows)
    # the kernels sum each product in another order than the loop's mm (their own SIMD blocking): the
    # tolerance grows with the chain's reduction length (D, then F) and the outputs' scale, not fixed
    D, F = w2.shape[1], w2.shape[2]
    torch.testing.assert_close(got, want, **fp32_matmul_tol(D + F, want.abs().max()))


def test_adapters_scale_by_alpha_over_rank_from_the_config():
    """Oracle for the adapter's scale: ``[lora]`` rank and alpha (alpha != r) through the trainer's own
    ``lora_spec``, known non-zero A and B on an attention linear and the routed experts of tiny-v3, against
    ``W x + (alpha / r) B A x`` written out here in float64 (the experts: a loop over each token's chosen
    experts, weighted by the router's weights)."""
    from seektrain.config.loader import load_config
    from seektrain.plan.run_plan import lora_spec

    alpha, r = 16.0, 4
    job = load_config(None, ["lora.enabled=true", f"lora.rank={r}", f"lora.alpha={alpha}"])
    spec = lora_spec(job)
    assert spec is not None and (spec.rank, spec.alpha) == (r, alpha)
    scale = alpha / r  # the oracle: the documented update alpha / r * B @ A
    why = f"adapter scale: want W x + (alpha / r) B A x with alpha={alpha}, r={r}, alpha / r={scale}"
    cfg = get_preset("tiny-v3")
    model = build_model(cfg, device="meta")
    add_adapters(model, spec)
    model.to_empty(device="cpu")
    model.init_weights(0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter(name):
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    model.eval()
    D = cfg.hidden_size

    # a plain linear: its base weight, its A and B, and the update computed by hand
    proj = model.get_submodule("layers.0.self_attn.o_proj")
    assert isinstance(proj, nn.Linear) and proj.bias is None
    x = torch.randn(6, proj.in_features, generator=g)
    with torch.no_grad():
        got = proj(x).double()
    W, A, B = (t.detach().double() for t in (proj.weight, proj.lora_A, proj.lora_B))
    x64 = x.double()
    base, update = x64 @ W.T, (x64 @ A.T) @ B.T
    measured = float(((got - base) * update).sum() / (update * update).sum())
    assert measured == pytest.approx(scale, rel=1e-4), f"{why}; the linear's update is {measured:.4g} B A x"
    want = base + scale * update
    tol = fp32_matmul_tol(proj.in_features + r, want.abs().max())
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{why} (o_proj): {m}")

    # the routed experts: every token to K distinct experts with router weights, a loop per token here
    experts = model.get_submodule("layers.1.mlp.experts")
    E, K, N = cfg.n_routed_experts, cfg.num_experts_per_tok, 10
    x = torch.randn(N, D, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    weights = torch.rand(N, K, generator=g)
    counts = torch.bincount(idx.flatten(), minlength=E)
    assert (counts > 0).sum() > 1  # more than one expert is exercised
    with torch.no_grad():
        got = experts(x, weights, idx, counts).double()
    w = {n: p.detach().double() for n, p in experts.named_parameters()}
    assert all(t.abs().sum() > 0 for t in w.values())  # base and adapters all non-zero
    rows = []
    for n in range(N):
        xn, out = x[n].double(), torch.zeros(D, dtype=torch.float64)
        for k in range(K):
            e = int(idx[n, k])
            gate_up = w["gate_up_proj"][e] @ xn + scale * (
                w["gate_up_proj_lora_B"][e] @ (w["gate_up_proj_lora_A"][e] @ xn)
            )
            gate, up = gate_up.chunk(2)
            h = torch.nn.functional.silu(gate) * up
            y = w["down_proj"][e] @ h + scale * (w["down_proj_lora_B"][e] @ (w["down_proj_lora_A"][e] @ h))
            out += float(weights[n, k]) * y
        rows.append(out)
    want = torch.stack(rows)
    tol = fp32_matmul_tol(D + cfg.moe_intermediate_size + 2 * r, want.abs().max())
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{why} (routed experts): {m}")


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
    """Two AdamW steps of tiny-v3 (routed experts included): the base bit-identical, in the compute
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
    for _ in range(2):  # B moves at step 1, A (whose gradient is 0 while B is) at step 2
        tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=g)
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


def test_the_config_knows_the_same_groups():
    """config/ and models/ are independent layers: the config's check of ``lora.target_modules`` keeps
    its own copy of the group names."""
    from seektrain.config.loader import LORA_GROUPS

    assert LORA_GROUPS == GROUPS


def test_fp8_base_keeps_its_adapters():
    """``precision.fp8`` converts the base first (torchao swaps the linears), the adapters go on the
    converted modules: an FP8 base matmul plus a bf16 adapter. FP8 cannot run on CPU; the conversion
    and the placement can (as tests/test_float8.py tests them)."""
    from torchao.float8.float8_linear import Float8Linear

    from seektrain.parallel.float8 import apply_float8

    model = build_model(get_preset("tiny-v3"), device="meta")
    choice = apply_float8(model, "rowwise", experts=True)
    adapted = add_adapters(model, LoraSpec(4, 8.0))
    freeze_base(model, torch.bfloat16)
    fp8_adapted = [n for n in adapted if n in choice.linears]
    assert fp8_adapted and set(choice.linears) <= set(adapted)  # every FP8 linear is a target here
    for name in fp8_adapted:
        module = model.get_submodule(name)
        assert type(module) is Float8Linear and module.lora_A.dtype == torch.float32
        assert module.lora_A.requires_grad and not module.weight.requires_grad
        assert module.weight.dtype == torch.bfloat16
    assert set(choice.experts) <= set(adapted)  # the FP8 routed experts carry grouped adapters


@pytest.fixture
def fake_tp_mesh():
    """A 2-rank ``tp`` mesh on torch's fake process group (no peers, no communication): enough to
    apply the TP plan to a meta model and read the placements."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("preset", ["tiny-v3", "tiny-dense"])
def test_tp_places_each_adapter_by_its_base_style(fake_tp_mesh, preset):
    """Column-wise base: A replicated, B Shard(0); row-wise: A Shard(1), B replicated; replicated:
    both replicated; routed experts: split by expert. (DTensor would compute a wrongly placed adapter
    correctly, at the price of extra collectives, so only the placements show it.) The frozen base
    stays frozen through torch's styles."""
    from torch.distributed.tensor import Replicate, Shard

    from seektrain.models.deepseek.shapes import COLWISE, EXPERT, REPLICATED, ROWWISE, ROWWISE_PARTIAL
    from seektrain.parallel.tensor_parallel import apply_tensor_parallel

    want = {
        COLWISE: (Replicate(), Shard(0)),
        ROWWISE: (Shard(1), Replicate()),
        ROWWISE_PARTIAL: (Shard(1), Replicate()),
        REPLICATED: (Replicate(), Replicate()),
        EXPERT: (Shard(0), Shard(0)),
    }
    cfg = get_preset(preset)
    model = build_model(cfg, device="meta")
    add_adapters(model, LoraSpec(4, 8.0))
    freeze_base(model, torch.float32)
    apply_tensor_parallel(model, fake_tp_mesh)
    params = dict(model.named_parameters())
    for shapes in adapter_weights(cfg, LoraSpec(4, 8.0)).values():
        a, b = params[shapes.a_name], params[shapes.b_name]
        assert (a.placements[0], b.placements[0]) == want[shapes.weight.tp], shapes.weight.path
        assert a.requires_grad and b.requires_grad
    assert not [n for n, p in params.items() if p.requires_grad and not is_adapter(n)]


def _adapter_grads(model, tokens) -> dict[str, torch.Tensor]:
    model.zero_grad()
    torch.manual_seed(5)  # the adapters' dropout masks
    out = model(tokens, labels=tokens)
    out.loss_sum.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_the_adapters_the_same_gradients(mode):
    """Recomputed layers (with the adapters' dropout on, whose masks the recomputation must redraw
    equal) give the adapters the gradients of no checkpointing; the base gets none either way."""
    from seektrain.parallel.activation_checkpoint import apply_activation_checkpointing

    cfg = get_preset("tiny-v3").replace(num_nextn_predict_layers=0)
    model = build_model(cfg, device="meta")
    add_adapters(model, LoraSpec(4, 8.0, dropout=0.1))
    freeze_base(model, torch.float32)
    model.to_empty(device="cpu")
    model.init_weights(0)
    for name, p in model.named_parameters():  # B = 0 would leave A without gradient
        if "lora_B" in name:
            p.data.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    model.train()
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    want = _adapter_grads(model, tokens)
    checkpointed = copy.deepcopy(model)
    assert apply_activation_checkpointing(checkpointed, mode, preserve_rng_state=True) > 0
    got = _adapter_grads(checkpointed, tokens)
    assert {n.replace("._checkpoint_wrapped_module", "") for n in got} == set(want)
    assert all(is_adapter(n) for n in want)
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name.replace("._checkpoint_wrapped_module", "")])


@pytest.mark.slow  # compiling on CPU takes a minute; the hook is plain module code torch.compile traces
def test_compiled_blocks_give_the_adapters_the_same_gradients():
    from seektrain.parallel.compile import apply_compile

    cfg = get_preset("tiny-dense")
    model = build_model(cfg, device="meta")
    add_adapters(model, LoraSpec(4, 8.0))
    freeze_base(model, torch.float32)
    model.to_empty(device="cpu")
    model.init_weights(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    want = _adapter_grads(model, tokens)
    compiled = copy.deepcopy(model)
    assert apply_compile(compiled) > 0
    got = {n.replace("._orig_mod", ""): g for n, g in _adapter_grads(compiled, tokens).items()}
    assert set(got) == set(want) and all(is_adapter(n) for n in want)
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-4, atol=1e-6)


def test_a_base_from_hf_weights_gets_fresh_adapters(tmp_path):
    """``model.hf_path``: the base loads from the folder (which holds no adapters), then the adapters are
    initialised; a base weight the model has but the folder's model lacks is still refused."""
    from seektrain.models.deepseek.hf_io import save_pretrained
    from seektrain.parallel.parallelize import load_pretrained

    cfg = get_preset("tiny-v3")
    base = build_model(cfg, seed=7)
    save_pretrained(base, tmp_path / "hf")
    model = build_model(cfg, device="meta")
    add_adapters(model, LoraSpec(4, 8.0))
    model.to_empty(device="cpu")
    load_pretrained(model, str(tmp_path / "hf"), 0)
    tokens = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, base(tokens).logits)
    assert all(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_A" in n)
    model.register_buffer("extra_table", torch.zeros(3))  # a tensor of the model no folder holds
    with pytest.raises(ValueError, match="holds no tensor for extra_table"):
        load_pretrained(model, str(tmp_path / "hf"), 0)
