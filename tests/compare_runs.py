"""Is a parallel run the layout it asked for, and the same computation as one process? One comparison
shared by every layout test.

First the layout: ``run_layout`` checks what the run recorded from its parallelised objects
(``summary.json``'s ``layout_ran``) against its config (``assert_layout_ran``), so a layout that silently
fell back (EP not applied, HSDP as plain FSDP, TP×EP as TP) fails even where its numbers would pass.

Then the numbers. Losses alone are a weak guard: AdamW divides each gradient by its own running RMS, so a gradient that
is 2x too large (a sum instead of a mean over 2 ranks) barely moves the parameters, and 5-step losses
moved by at most 9.2e-5 relative under such a probe. So every layout test compares, with the run of
one process:

* the loss and the global gradient norm of every step (``metrics.jsonl``);
* every parameter after the steps (the run's final DCP checkpoint, read into one plain model):
  its change from the initial weights, per tensor and, for the stacked routed experts, per expert;
* every buffer (the V3 balancing biases) after the steps.

For the parameter change to follow the gradient, the runs use ``LAYOUT_SETTINGS``: ``optim.eps=1.0``
is far above the gradients' size (<= 0.1 per element in the tiny models), so AdamW's step is about
lr × the running mean of the gradient; no weight decay and no clipping add or rescale anything (the
tests of clipping under a layout add ``train.grad_clip`` on both sides). A group whose gradient is 2x
too large then changes about 2x too much: a relative difference of ~1 against ``Tolerance.param_rtol``
= 2e-3 (measured between one process and every CI layout: see docs/parallelism.md, "Where the
tolerances come from"; ``TOLERANCE_LOG`` records them). tests/test_compare_runs.py proves on real runs
that doubling any one group's change is reported.
"""

from __future__ import annotations

import functools
import json
import os
import tomllib
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from run_cli import metrics, train

# lr 3e-2: with eps=1 the step is ~lr × gradient, 10x the default lr keeps the loss falling visibly.
TOLERANCE_LOG = "LAYOUT_TOLERANCE_LOG"  # a file: each comparison appends its measured differences
LAYOUT_SETTINGS = ("optim.eps=1.0", "optim.weight_decay=0", "train.grad_clip=0", "optim.lr=3e-2")


@dataclass(frozen=True)
class Tolerance:
    loss_rel: float = 1e-4
    loss_abs: float = 1e-4
    grad_norm_rel: float = 1e-4
    param_rtol: float = 2e-3  # |Δgot − Δwant| / |Δwant| per group; a 2x error in a group gives ~1
    param_atol: float = 1e-6  # groups that do not move (gradient below fp32 resolution of the weight)
    buffer_atol: float = 1e-6  # the balancing biases (steps of train.bias_update_speed)
    same_balance: bool = True  # the per-step expert_imbalance statistic is equal
    per_expert: bool = True  # compare each routed expert's slice on its own, not only the stacked tensor


FP32 = Tolerance()
EXACT = Tolerance(loss_rel=0, loss_abs=0, grad_norm_rel=0, param_rtol=0, param_atol=0, buffer_atol=0)
# Under bf16 autocast a parallel layout rounds at other points than one process and routing flips near
# ties, so a rarely chosen expert's change can differ by ~90% (tiny-v3, TP=2): only whole tensors are
# compared (measured <= 15%), and the loss and norm within 2e-2 (measured 3e-4 and 0.2%).
BF16 = Tolerance(
    loss_rel=0,
    loss_abs=2e-2,
    grad_norm_rel=2e-2,
    param_rtol=0.4,
    buffer_atol=float("inf"),
    same_balance=False,
    per_expert=False,
)


@dataclass
class Run:
    """A finished training run: its folder and its per-step metrics."""

    dir: Path
    metrics: list[dict]
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers of the final checkpoint, as one unsharded fp32 state dict (a LoRA run's
        adapters on its base, which its checkpoints do not hold: rebuilt from where the run read it)."""
        if "weights" not in self._cache:
            from seektrain.checkpoint.export import load_run_checkpoint

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model, _ = load_run_checkpoint(self.dir)
            self._cache["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return self._cache["weights"]

    @property
    def lora(self):
        """The run's ``LoraSpec`` (``[lora]``), None for a full fine-tune."""
        from seektrain.config.loader import load_config
        from seektrain.plan.run_plan import lora_spec

        return lora_spec(load_config(self.dir / "config.toml"))

    @property
    def config(self) -> dict:
        """The resolved config the run wrote (``config.toml``)."""
        return tomllib.loads((self.dir / "config.toml").read_text())

    @property
    def initial(self) -> tuple[dict[str, torch.Tensor], frozenset[str]]:
        """(state dict before step 1, names of the parameters): the model of the run's
        ``model_config.json`` initialised with its ``train.seed``, as the trainer does on every layout."""
        model_json = (self.dir / "model_config.json").read_text()
        return initial_weights(model_json, self.config["train"]["seed"], self.lora)


def _lora_model(model_config_json: str, lora):
    """A plain fp32 model of the run's ``model_config.json`` with the adapters of ``lora`` (on meta)."""
    from seektrain.models import build_model
    from seektrain.models.config import ModelConfig
    from seektrain.models.lora import add_adapters

    model = build_model(ModelConfig.from_dict(json.loads(model_config_json)), device="meta")
    add_adapters(model, lora)
    return model.to_empty(device="cpu")


@functools.cache
def initial_weights(
    model_config_json: str, seed: int, lora=None
) -> tuple[dict[str, torch.Tensor], frozenset[str]]:
    from seektrain.models import build_model
    from seektrain.models.config import ModelConfig

    if lora is None:
        model = build_model(ModelConfig.from_dict(json.loads(model_config_json)), seed=seed)
    else:
        model = _lora_model(model_config_json, lora)
        model.init_weights(seed)
    return (
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        frozenset(name for name, _ in model.named_parameters()),
    )


def run_layout(
    run_dir: Path, model: str, nproc: int, *overrides: str, global_batch: int = 4, steps: int = 5
) -> Run:
    """A ``steps``-step run of ``model`` with the tiny settings and ``LAYOUT_SETTINGS`` on ``nproc``
    ranks (``checkpoint.interval=0`` still writes the final checkpoint that ``Run.weights`` reads),
    which trained the layout it asked for (``assert_layout_ran``)."""
    train(
        run_dir,
        *LAYOUT_SETTINGS,
        f"train.steps={steps}",
        f"model.preset={model}",
        f"train.global_batch_size={global_batch}",
        *overrides,
        nproc=nproc,
        timeout=600,
    )
    run = Run(Path(run_dir), metrics(run_dir))
    assert_layout_ran(run, nproc)
    return run


def expected_layout(parallel: dict, nproc: int) -> dict:
    """What ``summary.json``'s ``layout_ran`` must hold on rank 0 for the run's ``[parallel]`` config
    section on ``nproc`` ranks (seektrain/parallel/layout_record.py describes the keys)."""
    pp, rep, tp, ep = parallel["pp"], parallel["dp_replicate"], parallel["tp"], parallel["ep"]
    cp = parallel["cp"]
    shard = parallel["dp_shard"] if parallel["dp_shard"] != -1 else nproc // (pp * rep * cp * tp)
    dp = rep * shard
    if parallel["data_parallel"] == "fsdp" and (dp * cp > 1 or parallel["cpu_offload"]):
        kind = "hsdp" if rep > 1 else "fsdp"
    elif parallel["data_parallel"] == "ddp" and dp * cp > 1:
        kind = "replicate" if tp > 1 else "ddp"
    else:
        kind = "none"
    want = {
        "mesh": {"pp": pp, "dp_replicate": rep, "dp_shard": shard, "cp": cp, "tp": tp},
        "data_parallel": kind,
        # FSDP shards over dp_shard × cp; DDP and replicate mode average over dp_replicate × cp
        "shard_group_size": shard * cp if kind in ("fsdp", "hsdp") else 1,
        "replicate_group_size": {"hsdp": rep, "replicate": rep * cp, "ddp": dp * cp}.get(kind, 1),
        "tp": tp,
        "ep": ep,
        "cp": cp,
    }
    if pp > 1:
        from seektrain.parallel.pipeline import SCHEDULES

        want["pp_schedule"] = SCHEDULES[parallel["pp_schedule"]].__name__
    else:
        want.update(pp_stages=[0], pp_schedule=None)
    return want


def assert_layout_ran(run: Run, nproc: int) -> None:
    """The layout the run recorded from its parallelised objects (``summary.json``, ``layout_ran``) is
    the one its config asked for: mesh, data-parallel wrapper and group sizes, tensor-parallel
    shards, experts per rank and all-to-alls, pipeline stages and schedule. A layout that silently
    fell back (EP not applied, HSDP as plain FSDP, TP×EP as TP alone) fails here even where its
    numbers pass ``assert_same_run``."""
    from seektrain.plan.pipeline_split import MULTI_STAGE

    ran = json.loads((run.dir / "summary.json").read_text())["layout_ran"]
    parallel = run.config["parallel"]
    n_experts = json.loads((run.dir / "model_config.json").read_text())["n_routed_experts"]
    want = expected_layout(parallel, nproc)
    cp = parallel["cp"]
    wrong = [f"{k} ran {ran[k]!r}, asked {v!r}" for k, v in want.items() if ran[k] != v]
    assert not wrong, (
        f"the run trained another layout than it asked for: {'; '.join(wrong)} (recorded: {ran})"
    )
    assert (ran["fsdp_units"] > 0) == (want["data_parallel"] in ("fsdp", "hsdp", "replicate")), ran
    assert (ran["tp_sharded_params"] > 0) == (want["tp"] > 1), ran
    if want["mesh"]["pp"] > 1:
        assert ran["pp_stages"][0] == 0 and (len(ran["pp_stages"]) > 1) == (
            parallel["pp_schedule"] in MULTI_STAGE
        ), ran
    if n_experts:
        split = want["ep"] if want["ep"] > 1 else want["tp"]
        assert ran["experts_per_rank"] == n_experts // split and ran["moe_layers"] > 0, ran
        assert ran["ep_layers"] == (ran["moe_layers"] if want["ep"] > 1 else 0), ran
    if want["ep"] > 1:  # each layer exchanges counts, slots and results forward, slots and results backward
        assert ran["all_to_all_per_step"] >= 5 * ran["ep_layers"], ran
    else:
        assert ran["all_to_all_per_step"] == 0, ran
    # every attention layer (MTP's too) runs the ring: cp - 1 hops forward, cp backward
    assert (ran["cp_attention_layers"] > 0) == (cp > 1), ran
    if cp > 1:
        assert ran["cp_hops_per_step"] >= (2 * cp - 1) * ran["cp_attention_layers"], ran
    else:
        assert ran["cp_hops_per_step"] == 0, ran
    assert_lora_ran(run, ran)


def assert_lora_ran(run: Run, ran: dict) -> None:
    """A LoRA run trained adapters on a frozen base (``layout_ran["lora"]``), where its layout puts them:
    every routed-expert group this rank holds has its adapters when the experts are targeted, and
    tensor parallelism shards some of them; a full fine-tune has none."""
    lora = ran.get("lora")
    if run.lora is None:
        assert lora is None, ran
        return
    assert lora is not None, f"lora.enabled=true but the run trained no adapters: {ran}"
    assert lora["base_frozen"] and lora["adapters_trainable"] and lora["adapters"] > 0, lora
    assert 0 < lora["trainable_elements"] < lora["frozen_elements"], lora
    if "experts" in run.lora.targets:
        assert lora["expert_adapter_groups"] == ran["moe_layers"], ran
    assert (lora["tp_sharded_adapters"] > 0) == (ran["tp"] > 1), lora


def groups(name: str, tensor: torch.Tensor, per_expert: bool = True) -> list[tuple[str, torch.Tensor]]:
    """(label, part) for each parameter group of a tensor: the whole tensor, or each expert's slice of
    the stacked routed-expert weights ``[E, ...]`` (so one wrong expert cannot hide among the others)."""
    if per_expert and ".experts." in name and tensor.ndim == 3:
        return [(f"{name}[expert {e}]", tensor[e]) for e in range(tensor.shape[0])]
    return [(name, tensor)]


def weight_mismatches(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    initial: dict[str, torch.Tensor],
    param_names: frozenset[str],
    tol: Tolerance = FP32,
) -> list[str]:
    """One line per parameter group whose change from ``initial`` differs between ``got`` and
    ``want`` by more than ``tol.param_rtol`` of the wanted change (+ ``tol.param_atol``), and per
    buffer that differs; empty when the runs agree."""
    problems = []
    if set(got) != set(want):
        problems.append(
            f"different tensors: missing {sorted(set(want) - set(got))}, extra {sorted(set(got) - set(want))}"
        )
    for name in sorted(set(got) & set(want)):
        if name not in param_names:  # a buffer (balancing bias): the same values
            diff = (got[name].float() - want[name].float()).abs().max().item() if want[name].numel() else 0.0
            if diff > tol.buffer_atol:
                problems.append(f"buffer {name}: differs by up to {diff:.3g}")
            continue
        for (label, g), (_, w), (_, w0) in zip(
            *(groups(name, t[name], tol.per_expert) for t in (got, want, initial))
        ):
            change = (w - w0).norm().item()
            diff = (g - w).norm().item()  # = |Δgot − Δwant|
            if not diff <= tol.param_rtol * change + tol.param_atol:
                problems.append(
                    f"{label}: change from init differs by {diff:.3g} "
                    f"({diff / change if change else float('inf'):.2%} of the wanted change {change:.3g})"
                )
    return problems


def measured_differences(got: Run, want: Run, tol: Tolerance) -> dict:
    """The largest differences between two runs, as ``tol``'s fields measure them: loss and gradient
    norm (relative), and |Δgot − Δwant| / |Δwant| over the parameter groups that moved by more than
    ``tol.param_atol``."""
    initial, param_names = want.initial
    worst, where = 0.0, None
    for name in sorted(param_names):
        for (label, g), (_, w), (_, w0) in zip(
            *(groups(name, t[name], tol.per_expert) for t in (got.weights, want.weights, initial))
        ):
            change = (w - w0).norm().item()
            if change > tol.param_atol and (g - w).norm().item() / change > worst:
                worst, where = (g - w).norm().item() / change, label
    rel = [abs(a - b) / abs(b) for a, b in zip(got.losses, want.losses)]
    norms = [abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(got.metrics, want.metrics)]
    return {"loss_rel": max(rel), "grad_norm_rel": max(norms), "param_rel": worst, "param_group": where}


def assert_same_layer_health(got: Run, want: Run, tol: Tolerance) -> None:
    """Every MoE layer's health metrics (seektrain/train/balance.py) are those of one process: the
    counts summed over the right ranks (data-parallel, not tensor-parallel twice), every pipeline
    stage's layers on rank 0. Loads are whole-number counts, so their ratios are equal; the entropy is
    a float sum in another order."""
    keys = sorted(k for k in want.metrics[0] if "/layer" in k)
    assert keys, "no per-layer MoE metrics in the one-process run"
    for g, w in zip(got.metrics, want.metrics):
        assert sorted(k for k in g if "/layer" in k) == keys
        for key in keys:
            if key.startswith("moe_router_entropy"):
                assert g[key] == pytest.approx(w[key], rel=1e-4), key
            elif key.startswith("moe_bias_spread"):
                assert g[key] == pytest.approx(w[key], abs=2 * tol.buffer_atol), key
            else:
                assert g[key] == w[key], key


def assert_same_run(got: Run, want: Run, tol: Tolerance = FP32) -> None:
    """``got`` is the computation of ``want``: same losses, gradient norms, balancing statistics,
    parameters and buffers after the steps (see the module docstring for why all of them)."""
    assert len(got.metrics) == len(want.metrics) > 0
    assert got.losses == pytest.approx(want.losses, rel=tol.loss_rel, abs=tol.loss_abs)
    assert [m["grad_norm"] for m in got.metrics] == pytest.approx(
        [m["grad_norm"] for m in want.metrics], rel=tol.grad_norm_rel
    )
    if "expert_imbalance" in want.metrics[0] and tol.same_balance:
        got_imbalance = [m["expert_imbalance"] for m in got.metrics]
        want_imbalance = [m["expert_imbalance"] for m in want.metrics]
        if got.config["parallel"]["pp"] == 1:
            assert got_imbalance == want_imbalance
        else:  # rank 0 logs the worst MoE layer of its own stages, a subset of the model's layers
            assert all(g <= w for g, w in zip(got_imbalance, want_imbalance)), (got_imbalance, want_imbalance)
        assert_same_layer_health(got, want, tol)
    initial, param_names = want.initial
    if os.environ.get(TOLERANCE_LOG):  # how the tolerances were measured (docs/parallelism.md)
        with open(os.environ[TOLERANCE_LOG], "a") as log:
            log.write(json.dumps({"run": str(got.dir), **measured_differences(got, want, tol)}) + "\n")
    problems = weight_mismatches(got.weights, want.weights, initial, param_names, tol)
    assert not problems, f"{len(problems)} parameter groups differ from one process:\n" + "\n".join(
        problems[:20]
    )
