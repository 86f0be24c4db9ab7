"""The model-family registry (models/registry.py): every preset is the DeepSeek family's, lookups fail in one
line, and a second family registered with its own entry is what build_model, the pipeline split and the
FSDP/compile block list use, with no other file changed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from seektrain.errors import UserError
from seektrain.models import registry
from seektrain.models.config import ModelConfig
from seektrain.models.deepseek.presets import PRESETS, get_preset
from seektrain.models.deepseek.transformer import Transformer
from seektrain.parallel.pipeline import build_stage_model


def test_every_preset_is_the_deepseek_family():
    for name in PRESETS:
        assert registry.family_for(get_preset(name)) is registry.get_family("deepseek")
    family = registry.get_family("deepseek")
    assert set(family.archs) == {"llama", "deepseek_v2", "deepseek_v3"}
    assert "DeepseekV3ForCausalLM" in family.hf_architectures
    model = registry.build_model(get_preset("tiny-v3"), device="meta")
    assert type(model) is Transformer and registry.family_of(model) is family


def test_lookups_fail_in_one_line():
    with pytest.raises(UserError, match="unknown model family 'mamba'; known: deepseek"):
        registry.get_family("mamba")
    with pytest.raises(UserError, match="no model family builds arch='mamba'"):
        registry.family_for(get_preset("tiny-dense").replace(arch="mamba"))
    with pytest.raises(TypeError, match="Linear is not the module class"):
        registry.family_of(torch.nn.Linear(2, 2))


@dataclasses.dataclass
class ToyConfig(ModelConfig):
    """A second family's config: DeepSeek's fields under arch 'toy'."""

    def validate(self) -> ToyConfig:
        ModelConfig.validate(dataclasses.replace(self, arch="llama"))
        return self


class ToyModel(Transformer):
    """A second family's module class."""


def test_a_second_family_is_one_entry(monkeypatch):
    cast = []
    deepseek = registry.get_family("deepseek")
    toy = dataclasses.replace(
        deepseek,
        name="toy",
        config_class=ToyConfig,
        archs=("toy",),
        module_class=ToyModel,
        pipeline=dataclasses.replace(deepseek.pipeline, first=()),  # toy stages all keep the embedding
        keep_fp32=lambda model: cast.append(type(model).__name__),
    )
    monkeypatch.setitem(registry.FAMILIES, "toy", toy)
    cfg = ToyConfig(**{**dataclasses.asdict(get_preset("tiny-dense")), "arch": "toy", "rope_scaling": None})

    model = registry.build_model(cfg, device="meta", dtype=torch.bfloat16)
    assert type(model) is ToyModel and registry.family_of(model) is toy and cast == ["ToyModel"]
    stage = build_stage_model(model, [1], first=False, last=False)
    assert stage.embed_tokens is not None and stage.norm is None and list(stage.layers) == ["1"]
    deepseek_stage = build_stage_model(
        registry.build_model(get_preset("tiny-dense"), device="meta"), [1], first=False, last=False
    )
    assert deepseek_stage.embed_tokens is None
    monkeypatch.setitem(
        registry.FAMILIES,
        "toy",
        dataclasses.replace(toy, pipeline=dataclasses.replace(toy.pipeline, blocks=("layers",))),
    )
    assert registry.model_blocks(model) == list(model.layers.values())


def test_register_family_refuses_a_taken_name_arch_or_preset(monkeypatch):
    """A second registration under the DeepSeek family's name, one of its archs or one of its presets is
    one line naming what is taken; nothing is added."""
    import dataclasses

    deepseek = registry.get_family("deepseek")
    monkeypatch.setattr(registry, "FAMILIES", dict(registry.FAMILIES))
    before = set(registry.FAMILIES)
    cases = {
        "name": (dataclasses.replace(deepseek, archs=("toy",), presets={}), "deepseek is registered already"),
        "arch": (
            dataclasses.replace(deepseek, name="toy", archs=("toy", "deepseek_v3"), presets={}),
            "deepseek_v3 is registered already",
        ),
        "preset": (
            dataclasses.replace(deepseek, name="toy", archs=("toy",), presets={"tiny-v3": get_preset}),
            "tiny-v3 is registered already",
        ),
    }
    for case, (family, needle) in cases.items():
        with pytest.raises(UserError, match=needle):
            registry.register_family(family)
        assert set(registry.FAMILIES) == before, case
    ok = registry.register_family(dataclasses.replace(deepseek, name="toy", archs=("toy",), presets={}))
    assert registry.FAMILIES["toy"] is ok
