"""The table of bad inputs for tests/test_bad_input.py: one row per mistake a user can make.

A row is the command (``argv``, with ``{ws}`` = the row's own empty folder and ``{data}``, ``{run}``,
``{hf}``, ``{tok}`` = shared fixtures: a prepared data folder, a trained run dir with a checkpoint, a
Hugging Face folder, a tokenizer folder), an optional ``setup(ws, fx)`` that makes the bad input inside
``ws``, the exit code, and the words the one error line must contain (the key, file or flag at fault).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from seektrain.config.loader import leaf_keys
from seektrain.config.schema import JobConfig


@dataclass
class Case:
    id: str
    argv: list[str]
    names: list[str]  # substrings the error line must hold
    setup: Callable[[Path, dict], None] | None = None
    code: int = 2
    subprocess: bool = False  # needs a real process (the launcher and its workers)


def write(rel: str, text: str | bytes) -> Callable[[Path, dict], None]:
    def setup(ws: Path, fx: dict) -> None:
        path = ws / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text if isinstance(text, bytes) else text.encode())

    return setup


def both(*steps: Callable[[Path, dict], None]) -> Callable[[Path, dict], None]:
    def setup(ws: Path, fx: dict) -> None:
        for step in steps:
            step(ws, fx)

    return setup


def copy(name: str, to: str | None = None) -> Callable[[Path, dict], None]:
    def setup(ws: Path, fx: dict) -> None:
        shutil.copytree(fx[name], ws / (to or name))

    return setup


STEP = "run/checkpoints/step-00000001"


def edit_json(
    rel: str, change: Callable[[object], object], rehash: bool = False
) -> Callable[[Path, dict], None]:
    """Rewrite a JSON file of the row's copy; ``rehash`` updates the checkpoint's checksums.json so that
    only the shape of the file is wrong, not its checksum."""

    def setup(ws: Path, fx: dict) -> None:
        path = ws / rel
        path.write_text(json.dumps(change(json.loads(path.read_text()))))
        if rehash:
            sums_path = path.parent / "checksums.json"
            sums = json.loads(sums_path.read_text())
            sums[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
            sums_path.write_text(json.dumps(sums))

    return setup


def set_key(key: str, value):
    def change(d):
        d = dict(d)
        if value is _DROP:
            d.pop(key)
        else:
            d[key] = value
        return d

    return change


_DROP = object()


def nested_set(path: list, value):
    def change(d):
        target = d
        for k in path[:-1]:
            target = target[k]
        if value is _DROP:
            del target[path[-1]]
        else:
            target[path[-1]] = value
        return d

    return change


# ----------------------------------------------------------------------- config: every key, generated
def _schema_rows() -> list[Case]:
    """For every config key: a value of the wrong type, and one outside its declared range (NaN and inf
    for floats), each refused by `config show` with the key named."""
    rows = []
    for key, section, f in leaf_keys(JobConfig()):  # sub-tables' keys too (model.rope_scaling.factor)
        typ, bounds = typing.get_type_hints(type(section))[f.name], f.metadata.get("bounds")
        bad: list[str] = []
        if typ is int:
            bad.append("abc")
            if bounds and bounds.min is not None:
                bad.append(
                    str(int(bounds.min) - 1 if bounds.min - 1 not in bounds.also else int(bounds.min) - 2)
                )
            if bounds and bounds.max is not None:
                bad.append(str(int(bounds.max) + 1))
        elif typ is float:
            bad += ["abc", "nan", "inf"]
            low = bounds.min if bounds and bounds.min is not None else bounds.above if bounds else None
            if low is not None:
                bad.append(str(low - 0.5 if low - 0.5 not in bounds.also else low - 2))
        elif typ is bool:
            bad.append("maybe")
        elif typ is str and bounds and bounds.choices:
            bad.append("bogus")
        elif typ is str and bounds and bounds.nonempty:
            bad.append(" ")
        elif typing.get_origin(typ) is list:
            bad.append("[x, y]" if typing.get_args(typ)[0] is int else "[bogus]")
        for value in bad:
            rows.append(
                Case(
                    f"config-{key}={value.strip() or 'empty'}",
                    ["config", "show", "--set", f"{key}={value}"],
                    [key],
                )
            )
    return rows


# ------------------------------------------------------------------------ config: files and overrides
CONFIG_ROWS = [
    # the examples, by name
    Case(
        "loss_scale_init=0", ["train", "--set", "precision.loss_scale_init=0"], ["precision.loss_scale_init"]
    ),
    Case("log_interval=0", ["train", "--set", "run.log_interval=0"], ["run.log_interval"]),
    Case("lr=1e999", ["train", "--set", "optim.lr=1e999"], ["optim.lr", "finite"]),
    Case("weight_decay=-0.1", ["config", "show", "--set", "optim.weight_decay=-0.1"], ["optim.weight_decay"]),
    Case(
        "mtp_loss_weight=nan",
        ["config", "show", "--set", "train.mtp_loss_weight=nan"],
        ["train.mtp_loss_weight"],
    ),
    Case(
        "aux_loss_alpha=-1", ["config", "show", "--set", "train.aux_loss_alpha=-1"], ["train.aux_loss_alpha"]
    ),
    Case(
        "pp_microbatches=-3",
        ["config", "show", "--set", "parallel.pp_microbatches=-3"],
        ["parallel.pp_microbatches"],
    ),
    Case(
        "pp_schedule=bogus",
        ["config", "show", "--set", "parallel.pp_schedule=bogus"],
        ["parallel.pp_schedule", "zbv"],
    ),
    Case("flops-bad-config", ["flops", "--set", "train.seq_len=0"], ["train.seq_len"]),
    Case(
        "batch-not-multiple",
        ["config", "show", "--set", "train.global_batch_size=5", "--set", "train.micro_batch_size=2"],
        ["train.global_batch_size", "train.micro_batch_size"],
    ),
    Case(
        "activation-checkpoint-every0",
        ["config", "show", "--set", "train.activation_checkpoint=every:0"],
        ["train.activation_checkpoint"],
    ),
    Case("unknown-preset", ["config", "show", "--set", "model.preset=gpt5"], ["model.preset", "tiny-v3"]),
    Case(
        "rope-beta-fast-not-above-beta-slow",
        ["train", "--set", "model.rope_scaling.factor=4", "--set", "model.rope_scaling.beta_slow=40"],
        ["model.rope_scaling.beta_fast", "beta_slow=40"],
    ),
    Case(
        "rope-table-given-a-value",
        ["config", "show", "--set", "model.rope_scaling=8"],
        ["model.rope_scaling", "factor"],
    ),
    Case("resume-bogus", ["config", "show", "--set", "checkpoint.resume=latest"], ["checkpoint.resume"]),
    Case("set-without-equals", ["config", "show", "--set", "train.steps"], ["--set", "train.steps"]),
    Case("unknown-section", ["config", "show", "--set", "trainer.steps=3"], ["trainer.steps"]),
    Case("unknown-key", ["config", "show", "--set", "train.stepz=3"], ["train.stepz", "train"]),
    Case(
        "renamed-key",
        ["config", "show", "--set", "train.cpu_keep_freed_memory=true"],
        ["cpu.keep_freed_memory"],
    ),
    Case(
        "steps-64bit",
        ["config", "show", "--set", "train.steps=99999999999999999999"],
        ["train.steps", "64 bits"],
    ),
    Case("toml-missing", ["config", "show", "--config", "{ws}/none.toml"], ["none.toml"]),
    Case("toml-a-folder", ["config", "show", "--config", "{ws}"], ["--config"]),
    Case(
        "toml-invalid",
        ["config", "show", "--config", "{ws}/c.toml"],
        ["c.toml", "TOML"],
        write("c.toml", "[train\nsteps="),
    ),
    Case(
        "toml-not-utf8",
        ["config", "show", "--config", "{ws}/c.toml"],
        ["c.toml"],
        write("c.toml", b"[train]\nsteps = \xff\xfe\n"),
    ),
    Case(
        "toml-deep-array",
        ["config", "show", "--config", "{ws}/c.toml"],
        ["c.toml"],
        write("c.toml", "[train]\nsteps = " + "[" * 5000 + "]" * 5000 + "\n"),
    ),
    Case(
        "toml-top-level-scalar",
        ["config", "show", "--config", "{ws}/c.toml"],
        ["c.toml", "steps"],
        write("c.toml", "steps = 3\n"),
    ),
    Case(
        "toml-table-for-int",
        ["config", "show", "--config", "{ws}/c.toml"],
        ["train.steps"],
        write("c.toml", "[train.steps]\nx = 1\n"),
    ),
    Case(
        "toml-list-for-int",
        ["config", "show", "--config", "{ws}/c.toml"],
        ["train.steps"],
        write("c.toml", "[train]\nsteps = [1]\n"),
    ),
    Case(
        "toml-string-for-bool",
        ["config", "show", "--config", "{ws}/c.toml"],
        ["train.compile"],
        write("c.toml", '[train]\ncompile = "perhaps"\n'),
    ),
    Case(
        "toml-bool-for-int",
        ["config", "show", "--config", "{ws}/c.toml"],
        ["train.seed"],
        write("c.toml", "[train]\nseed = true\n"),
    ),
    Case(
        "toml-nested-list",
        ["config", "show", "--config", "{ws}/c.toml"],
        ["parallel.pp_split"],
        write("c.toml", "[parallel]\npp_split = [[1, 2]]\n"),
    ),
    Case(
        "toml-float-inf",
        ["config", "show", "--config", "{ws}/c.toml"],
        ["optim.eps"],
        write("c.toml", "[optim]\neps = inf\n"),
    ),
    Case(
        "toml-unknown-key",
        ["train", "--config", "{ws}/c.toml"],
        ["model.bogus"],
        write("c.toml", "[model]\nbogus = 1\n"),
    ),
    Case("beta1=1", ["config", "show", "--set", "optim.beta1=1"], ["optim.beta1"]),
    Case("dp_shard=0", ["config", "show", "--set", "parallel.dp_shard=0"], ["parallel.dp_shard", "-1"]),
    Case(
        "port-65536",
        ["config", "show", "--set", "metrics.prometheus_port=65536"],
        ["metrics.prometheus_port"],
    ),
    Case(
        "trackers-twice", ["config", "show", "--set", "metrics.trackers=[wandb, wandb]"], ["metrics.trackers"]
    ),
    Case(
        "fp8-with-fp16",
        ["config", "show", "--set", "precision.fp8=rowwise", "--set", "precision.dtype=fp16"],
        ["precision.fp8", "precision.dtype=bf16"],
    ),
    Case(
        "fp8-on-cpu",
        ["train", "--set", "precision.fp8=rowwise", "--set", "model.preset=tiny-dense"],
        ["precision.fp8=rowwise", "H100", "--set precision.fp8=none"],
    ),
    Case(
        "fp8-blockwise-tp",
        [
            "train",
            "--nproc-per-node",
            "2",
            "--set",
            "parallel.tp=2",
            "--set",
            "precision.fp8=blockwise",
            "--set",
            "model.preset=tiny-dense",
        ],
        ["precision.fp8=blockwise", "parallel.tp=2"],
    ),
    Case(
        "cp-seq-len-not-in-chunks",
        ["train", "--nproc-per-node", "2", "--set", "parallel.cp=2", "--set", "train.seq_len=30"],
        ["train.seq_len=30", "parallel.cp", "multiple of 4"],
    ),
    Case(
        "cp-tp-ep-not-whole-groups",
        [
            "train",
            "--nproc-per-node",
            "8",
            "--set",
            "parallel.cp=2",
            "--set",
            "parallel.tp=2",
            "--set",
            "parallel.ep=2",
            "--set",
            "model.preset=tiny-v3",
        ],
        ["parallel.ep=2", "parallel.cp × tp = 2×2 = 4", "parallel.dp_shard=2"],
    ),
    # [lora]: refused by the run plan before any worker starts (models/lora.py)
    Case(
        "lora-rank-too-large",
        ["train", "--set", "lora.enabled=true", "--set", "lora.rank=4096", "--set", "model.preset=tiny-v3"],
        ["lora.rank=4096", "smallest dimension", "lora.target_modules"],
    ),
    Case(
        "lora-pattern-matches-nothing",
        ["train", "--set", "lora.enabled=true", "--set", "lora.target_modules=['*.no_such_proj']"],
        ["lora.target_modules", "'*.no_such_proj'", "matches no adaptable module"],
    ),
    Case(
        "lora-target-model-lacks",
        [
            "train",
            "--set",
            "lora.enabled=true",
            "--set",
            "lora.target_modules=[attention, experts]",
            "--set",
            "model.preset=tiny-dense",
        ],
        ["lora.target_modules", "tiny-dense", "routed experts", "'experts'"],
    ),
]

# DeepSpeed files (seektrain/config/deepspeed*.py): what a ds_config.json can be that is not one
_DS_DECAY = {
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 8,
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto", "total_num_steps": 10},
    },
}
CONFIG_ROWS += [
    Case(
        "deepspeed-utf16",
        ["config", "from-deepspeed", "{ws}/ds.json"],
        ["ds.json", "UTF-16", "save it as UTF-8"],
        write("ds.json", '{"train_batch_size": 8}'.encode("utf-16")),
    ),
    Case(
        "deepspeed-binary",
        ["config", "from-deepspeed", "{ws}/ds.json"],
        ["ds.json", "not UTF-8"],
        write("ds.json", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xd8"),
    ),
    Case(  # the warmup_max_lr "auto" takes optim.lr, which is 0: the ratio min/max once divided by it
        "deepspeed-scheduler-lr-0",
        ["config", "from-deepspeed", "{ws}/ds.json", "--set", "optim.lr=0"],
        ["optim.lr"],
        write("ds.json", json.dumps(_DS_DECAY)),
    ),
]

# --------------------------------------------------------------------------------- CLI flags
CLI_ROWS = [
    Case("sample-temperature-nan", ["sample", "--run", "{run}", "--temperature", "nan"], ["--temperature"]),
    Case("sample-temperature-inf", ["sample", "--run", "{run}", "--temperature", "inf"], ["--temperature"]),
    Case("sample-temperature-neg", ["sample", "--run", "{run}", "--temperature", "-1"], ["--temperature"]),
    Case("sample-top-k-neg", ["sample", "--run", "{run}", "--top-k", "-1"], ["--top-k"]),
    Case("sample-top-k-text", ["sample", "--run", "{run}", "--top-k", "many"], ["--top-k"]),
    Case("sample-max-new-neg", ["sample", "--run", "{run}", "--max-new-tokens", "-1"], ["--max-new-tokens"]),
    Case("sample-seed-neg", ["sample", "--run", "{run}", "--seed", "-1"], ["--seed"]),
    Case("sample-no-run", ["sample"], ["--run"]),
    Case("chat-no-source", ["chat", "--prompt", "hi"], ["--run", "--hf"]),
    Case("chat-both-sources", ["chat", "--run", "{run}", "--hf", "{hf}"], ["--hf", "--run"]),
    Case("chat-top-p-above-1", ["chat", "--run", "{run}", "--top-p", "1.5"], ["--top-p"]),
    Case("chat-top-p-0", ["chat", "--run", "{run}", "--top-p", "0"], ["--top-p"]),
    Case("chat-max-new-0", ["chat", "--run", "{run}", "--max-new-tokens", "0"], ["--max-new-tokens"]),
    Case("chat-empty-prompt", ["chat", "--run", "{run}", "--prompt", " "], ["--prompt"]),
    Case(
        "chat-unknown-template", ["chat", "--run", "{run}", "--chat-template", "llama"], ["--chat-template"]
    ),
    # the fixture run trained on plain text with the byte tokenizer: there is no template to chat through
    Case(
        "chat-run-without-template",
        ["chat", "--run", "{run}", "--prompt", "hi"],
        ["no chat template", "--chat-template"],
    ),
    Case("chat-run-missing", ["chat", "--run", "{ws}/none", "--prompt", "hi"], ["config.toml"]),
    Case(
        "chat-hf-without-tokenizer",
        ["chat", "--hf", "{hf}", "--prompt", "hi"],
        ["tokenizer.json", "--tokenizer"],
    ),
    Case("chat-hf-missing", ["chat", "--hf", "{ws}/none", "--prompt", "hi"], ["--hf", "no such folder"]),
    Case(
        "convert-tokenizer-missing",
        ["convert", "--preset", "tiny-dense", "--to-hf", "{ws}/o", "--tokenizer", "{ws}/none"],
        ["--tokenizer"],
    ),
    Case("flops-batch-0", ["flops", "--batch", "0"], ["--batch"]),
    Case("flops-depth-neg", ["flops", "--depth", "-1"], ["--depth"]),
    Case(
        "prepare-max-tokens-neg",
        ["data", "prepare", "--input", "{ws}", "--output", "{ws}/o", "--max-tokens", "-5"],
        ["--max-tokens"],
    ),
    Case(
        "prepare-max-tokens-0",
        ["data", "prepare", "--input", "{ws}", "--output", "{ws}/o", "--max-tokens", "0"],
        ["--max-tokens"],
    ),
    Case(
        "prepare-shard-tokens-0",
        ["data", "prepare", "--input", "{ws}", "--output", "{ws}/o", "--shard-tokens", "0"],
        ["--shard-tokens"],
    ),
    Case(
        "prepare-val-fraction-1",
        ["data", "prepare", "--input", "{ws}", "--output", "{ws}/o", "--val-fraction", "1"],
        ["--val-fraction"],
    ),
    Case(
        "prepare-val-fraction-neg",
        ["data", "prepare", "--input", "{ws}", "--output", "{ws}/o", "--val-fraction", "-0.1"],
        ["--val-fraction"],
    ),
    Case(
        "prepare-val-fraction-nan",
        ["data", "prepare", "--input", "{ws}", "--output", "{ws}/o", "--val-fraction", "nan"],
        ["--val-fraction"],
    ),
    Case(
        "prepare-text-field-empty",
        ["data", "prepare", "--input", "{ws}", "--output", "{ws}/o", "--text-field", ""],
        ["--text-field"],
    ),
    Case(
        "prepare-format-bogus",
        ["data", "prepare", "--input", "{ws}", "--output", "{ws}/o", "--format", "csv"],
        ["--format"],
    ),
    Case("prepare-no-output", ["data", "prepare", "--input", "{ws}"], ["--output"]),
    Case(
        "convert-shard-size-0",
        ["convert", "--preset", "tiny-dense", "--to-hf", "{ws}/o", "--max-shard-size", "0"],
        ["--max-shard-size"],
    ),
    Case(
        "convert-shard-size-text",
        ["convert", "--preset", "tiny-dense", "--to-hf", "{ws}/o", "--max-shard-size", "big"],
        ["--max-shard-size"],
    ),
    Case(
        "convert-seed-neg",
        ["convert", "--preset", "tiny-dense", "--to-hf", "{ws}/o", "--seed", "-3"],
        ["--seed"],
    ),
    Case(
        "convert-dtype-bogus",
        ["convert", "--preset", "tiny-dense", "--to-hf", "{ws}/o", "--dtype", "fp7"],
        ["--dtype"],
    ),
    Case(
        "convert-two-sources",
        ["convert", "--preset", "tiny-dense", "--from-hf", "{hf}", "--to-hf", "{ws}/o"],
        ["--from-hf", "--preset"],
    ),
    Case("convert-no-destination", ["convert", "--preset", "tiny-dense"], ["--to-hf"]),
    Case("convert-unknown-preset", ["convert", "--preset", "gpt5", "--to-hf", "{ws}/o"], ["gpt5"]),
    Case("train-nproc-0", ["train", "--nproc-per-node", "0"], ["--nproc-per-node"]),
    Case("train-nproc-text", ["train", "--nproc-per-node", "two"], ["--nproc-per-node"]),
    Case("unknown-command", ["trian"], ["trian"]),
    Case("unknown-flag", ["config", "show", "--sett", "x=1"], ["--sett"]),
]


# --------------------------------------------------------------------------------------- data
def _without_eos(d: dict) -> dict:
    d["added_tokens"] = []
    d["model"]["vocab"] = {w: i for w, i in d["model"]["vocab"].items() if w != "<eos>"}
    return d


TEXT = write("in/a.txt", "some words for a dataset\n")
DATA_ROWS = [
    Case(
        "force-output-is-input",
        ["data", "prepare", "--input", "{ws}/in", "--output", "{ws}/in", "--force"],
        ["--output", "--input"],
        TEXT,
    ),
    Case(
        "force-output-holds-input",
        ["data", "prepare", "--input", "{ws}/in/a.txt", "--output", "{ws}/in", "--force"],
        ["--output"],
        TEXT,
    ),
    Case(
        "force-output-run-dir",
        ["data", "prepare", "--input", "{ws}/in", "--output", "{ws}/run", "--force"],
        ["--output", "--force"],
        both(TEXT, copy("run")),
    ),
    Case(
        "force-output-foreign",
        ["data", "prepare", "--input", "{ws}/in", "--output", "{ws}/mine", "--force"],
        ["--output", "--force"],
        both(TEXT, write("mine/notes.md", "keep me")),
    ),
    Case(
        "force-data-with-extra-file",
        ["data", "prepare", "--input", "{ws}/in", "--output", "{ws}/data", "--force"],
        ["notes.md", "--force"],
        both(TEXT, copy("data"), write("data/notes.md", "keep me")),
    ),
    Case(
        "output-is-prepared",
        ["data", "prepare", "--input", "{ws}/in", "--output", "{ws}/data"],
        ["--output", "--force"],
        both(TEXT, copy("data")),
    ),
    Case(
        "output-is-file",
        ["data", "prepare", "--input", "{ws}/in", "--output", "{ws}/in/a.txt"],
        ["--output"],
        TEXT,
    ),
    Case("input-missing", ["data", "prepare", "--input", "{ws}/nothing", "--output", "{ws}/o"], ["--input"]),
    Case(
        "input-unknown-ext",
        ["data", "prepare", "--input", "{ws}/a.xyz", "--output", "{ws}/o"],
        ["--input", "--format"],
        write("a.xyz", "a,b\n"),
    ),
    Case(
        "input-empty-text",
        ["data", "prepare", "--input", "{ws}/e.txt", "--output", "{ws}/o"],
        ["no text"],
        write("e.txt", ""),
    ),
    Case(
        "jsonl-bad-line",
        ["data", "prepare", "--input", "{ws}/a.jsonl", "--output", "{ws}/o"],
        ["a.jsonl:2"],
        write("a.jsonl", '{"text": "ok"}\n{"text": \n'),
    ),
    Case(
        "jsonl-no-field",
        ["data", "prepare", "--input", "{ws}/a.jsonl", "--output", "{ws}/o"],
        ["a.jsonl:1", "--text-field"],
        write("a.jsonl", '{"body": "ok"}\n'),
    ),
    Case(
        "jsonl-int-field",
        ["data", "prepare", "--input", "{ws}/a.jsonl", "--output", "{ws}/o"],
        ["a.jsonl:1", "text"],
        write("a.jsonl", '{"text": 5}\n'),
    ),
    Case(
        "jsonl-a-list",
        ["data", "prepare", "--input", "{ws}/a.jsonl", "--output", "{ws}/o"],
        ["a.jsonl:1"],
        write("a.jsonl", "[1, 2]\n"),
    ),
    Case(
        "parquet-int-column",
        ["data", "prepare", "--input", "{ws}/a.parquet", "--output", "{ws}/o"],
        ["a.parquet", "text"],
        lambda ws, fx: _parquet(ws / "a.parquet", {"text": [1, 2, 3]}),
    ),
    Case(
        "parquet-no-column",
        ["data", "prepare", "--input", "{ws}/a.parquet", "--output", "{ws}/o"],
        ["a.parquet", "--text-field"],
        lambda ws, fx: _parquet(ws / "a.parquet", {"body": ["x"]}),
    ),
    Case(
        "parquet-corrupt",
        ["data", "prepare", "--input", "{ws}/a.parquet", "--output", "{ws}/o"],
        ["a.parquet"],
        write("a.parquet", b"PAR1 not really"),
    ),
    Case(
        "tokenizer-missing",
        [
            "data",
            "prepare",
            "--input",
            "{ws}/in",
            "--output",
            "{ws}/o",
            "--tokenizer",
            "{ws}/no/tokenizer.json",
        ],
        ["tokenizer"],
        TEXT,
    ),
    Case(
        "tokenizer-garbage",
        ["data", "prepare", "--input", "{ws}/in", "--output", "{ws}/o", "--tokenizer", "{ws}/tok"],
        ["tokenizer.json"],
        both(TEXT, write("tok/tokenizer.json", "{not json")),
    ),
    Case(
        "tokenizer-config-garbage",
        ["data", "prepare", "--input", "{ws}/in", "--output", "{ws}/o", "--tokenizer", "{ws}/tok"],
        ["tokenizer_config.json"],
        both(TEXT, copy("tok"), write("tok/tokenizer_config.json", "{oops")),
    ),
    Case(
        "tokenizer-config-list",
        ["data", "prepare", "--input", "{ws}/in", "--output", "{ws}/o", "--tokenizer", "{ws}/tok"],
        ["tokenizer_config.json"],
        both(TEXT, copy("tok"), write("tok/tokenizer_config.json", "[1]")),
    ),
    Case(
        "tokenizer-config-eos-typo",
        ["data", "prepare", "--input", "{ws}/in", "--output", "{ws}/o", "--tokenizer", "{ws}/tok"],
        ["tokenizer_config.json", "<nope>"],
        both(TEXT, copy("tok"), write("tok/tokenizer_config.json", '{"eos_token": "<nope>"}')),
    ),
    Case(
        "tokenizer-no-eos",
        ["data", "prepare", "--input", "{ws}/in", "--output", "{ws}/o", "--tokenizer", "{ws}/tok"],
        ["end-of-sequence"],
        both(
            TEXT,
            copy("tok"),
            lambda ws, fx: (ws / "tok/tokenizer_config.json").unlink(),
            edit_json("tok/tokenizer.json", _without_eos),
        ),
    ),
    Case("info-missing-dir", ["data", "info", "{ws}/none"], ["none"]),
    Case("info-no-manifest", ["data", "info", "{ws}"], ["manifest.json"]),
    Case(
        "train-data-path-missing",
        ["train", "--set", "data.path={ws}/none", "--nproc-per-node", "2"],
        ["data.path"],
        subprocess=True,
    ),
]


def _manifest_row(name: str, change, names: list[str], verb: str = "info") -> Case:
    return Case(
        f"manifest-{name}",
        ["data", verb, "{ws}/data"],
        ["manifest.json", *names],
        both(copy("data"), edit_json("data/manifest.json", change)),
    )


DATA_ROWS += [
    _manifest_row("a-list", lambda d: [d], ["JSON object"]),
    _manifest_row("no-tokenizer", set_key("tokenizer", _DROP), ["tokenizer"]),
    _manifest_row("tokenizer-a-string", set_key("tokenizer", "byte"), ["tokenizer"]),
    _manifest_row("unknown-dtype", set_key("dtype", "float64"), ["dtype", "float64"]),
    _manifest_row("dtype-int", set_key("dtype", 16), ["dtype"]),
    _manifest_row("wrong-format", set_key("format", "other"), ["format"]),
    _manifest_row("wrong-version", set_key("version", 99), ["version"]),
    _manifest_row("train-a-list", set_key("train", []), ["train"]),
    _manifest_row("shards-a-dict", nested_set(["train", "shards"], {}), ["train.shards"]),
    _manifest_row(
        "shard-a-string", nested_set(["train", "shards"], ["shard-00000.bin"]), ["train.shards[0]"]
    ),
    _manifest_row(
        "shard-path-escape",
        nested_set(["train", "shards", 0, "file"], "../../etc/passwd"),
        ["train.shards[0].file"],
    ),
    _manifest_row(
        "shard-tokens-neg", nested_set(["train", "shards", 0, "tokens"], -4), ["train.shards[0].tokens"]
    ),
    _manifest_row(
        "shard-tokens-text", nested_set(["train", "shards", 0, "tokens"], "many"), ["train.shards[0].tokens"]
    ),
    _manifest_row("shard-no-sha", nested_set(["train", "shards", 0, "sha256"], _DROP), ["sha256"]),
    _manifest_row("tokens-sum", nested_set(["train", "tokens"], 5), ["train.tokens"]),
    _manifest_row("vocab-a-string", nested_set(["tokenizer", "vocab_size"], "259"), ["vocab_size"]),
    _manifest_row("eos-beyond-vocab", nested_set(["tokenizer", "eos_id"], 100000), ["eos_id"]),
    _manifest_row("val-fraction-2", set_key("val_fraction", 2), ["val_fraction"]),
    _manifest_row("not-json", None, ["manifest.json"]),
    Case(
        "verify-shard-corrupt",
        ["data", "verify", "{ws}/data"],
        ["shard-00000.bin", "sha256"],
        both(copy("data"), lambda ws, fx: _flip_byte(ws / "data/shard-00000.bin")),
    ),
    Case(
        "verify-shard-missing",
        ["data", "verify", "{ws}/data"],
        ["shard-00000.bin"],
        both(copy("data"), lambda ws, fx: (ws / "data/shard-00000.bin").unlink()),
    ),
    Case(
        "verify-shard-truncated",
        ["data", "verify", "{ws}/data"],
        ["shard-00000.bin"],
        both(copy("data"), lambda ws, fx: _truncate(ws / "data/shard-00000.bin")),
    ),
]
DATA_ROWS[-4].setup = both(copy("data"), write("data/manifest.json", "{not json"))  # the not-json row


def _chat_row(name: str, lines: list, names: list[str], extra: list[str] | None = None) -> Case:
    """``data prepare`` of a chat JSONL file (byte tokenizer, DeepSeek-V3's template) holding ``lines``."""
    text = "".join(json.dumps(line) + "\n" for line in lines)
    return Case(
        f"chat-{name}",
        [
            "data",
            "prepare",
            "--input",
            "{ws}/a.jsonl",
            "--output",
            "{ws}/o",
            "--chat-template",
            "deepseek-v3",
            *(extra or []),
        ],
        names,
        write("a.jsonl", text),
    )


_USER, _ANSWER = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}
DATA_ROWS += [
    _chat_row(
        "unknown-role",
        [{"messages": [_USER, _ANSWER]}, {"messages": [{"role": "robot", "content": "x"}, _ANSWER]}],
        ["a.jsonl:2", "robot"],
    ),
    _chat_row("missing-content", [{"messages": [{"role": "user"}, _ANSWER]}], ["a.jsonl:1", "no content"]),
    _chat_row(
        "content-a-list",
        [{"messages": [_USER, {"role": "assistant", "content": [1]}]}],
        ["a.jsonl:1", "string"],
    ),
    _chat_row("no-assistant", [{"messages": [_USER]}], ["a.jsonl:1", "no assistant turn"]),
    _chat_row(
        "messages-not-a-list", [{"messages": "hi"}], ["a.jsonl:1", "'messages'", "not a non-empty list"]
    ),
    _chat_row("message-a-string", [{"messages": ["hi", _ANSWER]}], ["a.jsonl:1", "message 1"]),
    _chat_row(
        "row-without-messages", [{"messages": [_USER, _ANSWER]}, {"text": "x"}], ["a.jsonl:2", "'messages'"]
    ),
    _chat_row(
        "reasoning-on-user",
        [{"messages": [dict(_USER, reasoning_content="x"), _ANSWER]}],
        ["a.jsonl:1", "reasoning_content"],
    ),
    _chat_row(
        "completion-int-prompt",
        [{"prompt": 1, "completion": "x"}],
        ["a.jsonl:1", "'prompt'"],
        ["--format", "completion"],
    ),
    _chat_row(
        "unknown-template",
        [{"messages": [_USER, _ANSWER]}],
        ["--chat-template"],
        ["--chat-template", "llama"],
    ),
    Case(
        "chat-no-template",
        ["data", "prepare", "--input", "{ws}/a.jsonl", "--output", "{ws}/o", "--tokenizer", "{tok}"],
        ["chat template", "--chat-template"],
        write("a.jsonl", json.dumps({"messages": [_USER, _ANSWER]}) + "\n"),
    ),
    Case(
        "chat-parquet-bad-row",
        [
            "data",
            "prepare",
            "--input",
            "{ws}/a.parquet",
            "--output",
            "{ws}/o",
            "--chat-template",
            "deepseek-v3",
        ],
        ["a.parquet: row 2", "role"],
        lambda ws, fx: _parquet(
            ws / "a.parquet", {"messages": [[_USER, _ANSWER], [dict(_USER, role="bot"), _ANSWER]]}
        ),
    ),
    _chat_row(
        "mixed-formats",
        [
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
            {"instruction": "q", "output": "a"},
        ],
        ["a.jsonl:2", "alpaca", "sharegpt"],
    ),
    _chat_row(
        "fits-no-format",
        [{"question": "q", "answer": "a"}],
        ["a.jsonl:1", "sharegpt", "alpaca", "completion", "--columns"],
    ),
    _chat_row(
        "sharegpt-unknown-role",
        [{"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "yo"}]}],
        ["a.jsonl:1", "'bot'"],
    ),
    _chat_row(
        "sharegpt-not-alternating",
        [{"conversations": [{"from": "human", "value": "hi"}, {"from": "human", "value": "yo"}]}],
        ["a.jsonl:1", "alternates"],
    ),
    _chat_row(
        "alpaca-empty-output", [{"instruction": "q", "input": "", "output": ""}], ["a.jsonl:1", "'output'"]
    ),
    _chat_row(
        "columns-unknown-key",
        [{"messages": [_USER, _ANSWER]}],
        ["--columns", "'turns'"],
        ["--columns", "turns=conv"],
    ),
    _chat_row(
        "roles-unknown-key", [{"messages": [_USER, _ANSWER]}], ["--roles", "'bot'"], ["--roles", "bot=x"]
    ),
    Case(
        "input-weight-0",
        ["data", "prepare", "--input", "{ws}/in/a.txt:0", "--input", "{ws}/in/a.txt:1", "--output", "{ws}/o"],
        ["--input", "a.txt:0", "above 0"],
        TEXT,
    ),
    Case(
        "input-not-a-datasets-folder",
        ["data", "prepare", "--input", "{ws}/ds", "--output", "{ws}/o"],
        ["--input", "state.json"],
        write("ds/data-00000-of-00001.arrow", b"not arrow"),
    ),
    Case(
        "chat-max-len-0",
        ["data", "prepare", "--input", "{ws}/a.jsonl", "--output", "{ws}/o", "--max-len", "0"],
        ["--max-len"],
    ),
    Case(
        "train-chat-longer-than-seq-len",
        [
            "train",
            "--set",
            "data.path={ws}/chat",
            "--set",
            "data.packing=true",
            "--set",
            "train.seq_len=16",
            "--set",
            "model.preset=tiny-dense",
        ],
        ["train.seq_len=16", "--max-len 16"],
        lambda ws, fx: _chat_data(ws / "chat"),
    ),
    Case("show-index-beyond", ["data", "show", "{data}", "--index", "5"], ["--index", "1 documents"]),
    Case("show-val-empty", ["data", "show", "{data}", "--split", "val"], ["val", "empty"]),
    _manifest_row(
        "mask-not-aligned",
        nested_set(["train", "mask"], [{"file": "shard-00000.mask", "tokens": 1, "sha256": "0" * 64}]),
        ["train.mask"],
    ),
    _manifest_row(
        "ends-bad-name",
        nested_set(["train", "ends"], {"file": "../x.bin", "tokens": 1, "sha256": "0" * 64}),
        ["train.ends.file"],
    ),
]


def _chat_data(out: Path) -> None:
    """A prepared chat folder (byte tokenizer, DeepSeek-LLM's template) of 30-token conversations."""
    from seektrain.data import prepare_dataset
    from seektrain.data.prepare import RowOptions

    rows = out.parent / "chat.jsonl"
    rows.write_text(json.dumps({"messages": [_USER, _ANSWER]}) + "\n")
    prepare_dataset([rows], out, "byte", val_fraction=0.0, rows=RowOptions("deepseek-llm"))


def _parquet(path: Path, columns: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[10] ^= 1
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-6])


# --------------------------------------------------------------------------------- checkpoints
def _ckpt_row(name: str, setup, names: list[str], argv=None) -> Case:
    argv = argv or ["convert", "--from-checkpoint", "{ws}/run", "--to-hf", "{ws}/out"]
    return Case(f"ckpt-{name}", argv, names, both(copy("run"), setup))


TRAIN_RESUME = [
    "train",
    "--set",
    "run.dir={ws}/run",
    "--set",
    "model.preset=tiny-dense",
    "--set",
    "data.path={data}",
]
CKPT_ROWS = [
    _ckpt_row("checksums-a-list", edit_json(f"{STEP}/checksums.json", lambda d: list(d)), ["checksums.json"]),
    _ckpt_row("checksums-empty", edit_json(f"{STEP}/checksums.json", lambda d: {}), ["checksums.json"]),
    _ckpt_row(
        "checksums-int-digest",
        edit_json(f"{STEP}/checksums.json", lambda d: dict.fromkeys(d, 1)),
        ["checksums.json"],
    ),
    _ckpt_row(
        "checksums-escape",
        edit_json(f"{STEP}/checksums.json", lambda d: {**d, "../../config.toml": "00"}),
        ["checksums.json"],
    ),
    _ckpt_row("checksums-not-json", write(f"{STEP}/checksums.json", "{"), ["checksums.json"]),
    _ckpt_row("distcp-corrupt", lambda ws, fx: _flip_byte(ws / STEP / "__0_0.distcp"), ["__0_0.distcp"]),
    _ckpt_row(
        "trainer-state-a-list",
        edit_json(f"{STEP}/trainer_state.json", lambda d: [d], rehash=True),
        ["trainer_state.json"],
        TRAIN_RESUME,
    ),
    _ckpt_row(
        "trainer-state-scheduler-a-list",
        edit_json(f"{STEP}/trainer_state.json", set_key("scheduler", [0]), rehash=True),
        ["trainer_state.json", "scheduler"],
        TRAIN_RESUME,
    ),
    _ckpt_row(
        "trainer-state-step-text",
        edit_json(f"{STEP}/trainer_state.json", set_key("step", "one"), rehash=True),
        ["trainer_state.json", "step"],
        TRAIN_RESUME,
    ),
    _ckpt_row(
        "trainer-state-data-a-list",
        edit_json(f"{STEP}/trainer_state.json", set_key("data", [1]), rehash=True),
        ["trainer_state.json", "data"],
        TRAIN_RESUME,
    ),
    _ckpt_row("model-config-garbage", write("run/model_config.json", "{garbage"), ["model_config.json"]),
    _ckpt_row("model-config-a-list", write("run/model_config.json", "[]"), ["model_config.json"]),
    _ckpt_row(
        "model-config-float-width",
        edit_json("run/model_config.json", set_key("hidden_size", 64.5)),
        ["model_config.json", "hidden_size"],
    ),
    _ckpt_row(
        "model-config-unknown-field",
        edit_json("run/model_config.json", set_key("colour", "red")),
        ["model_config.json", "colour"],
    ),
    _ckpt_row(
        "model-config-other-model",
        edit_json("run/model_config.json", set_key("hidden_size", 256)),
        ["does not fit", "embed_tokens"],
    ),
    _ckpt_row(
        "config-toml-garbage",
        write("run/config.toml", "[train\n"),
        ["config.toml"],
        ["sample", "--run", "{ws}/run"],
    ),
    _ckpt_row(
        "config-toml-bad-value",
        write("run/config.toml", "[optim]\nlr = -1.0\n"),
        ["optim.lr"],
        ["sample", "--run", "{ws}/run"],
    ),
    _ckpt_row(
        "config-toml-missing",
        lambda ws, fx: (ws / "run/config.toml").unlink(),
        ["config.toml"],
        ["sample", "--run", "{ws}/run"],
    ),
    _ckpt_row("only-tmp-checkpoint", lambda ws, fx: (ws / STEP).rename(ws / (STEP + ".tmp")), ["checkpoint"]),
    _ckpt_row(
        "resume-missing-step",
        lambda ws, fx: None,
        ["checkpoint.resume=7"],
        [*TRAIN_RESUME, "--set", "checkpoint.resume=7"],
    ),
    _ckpt_row(
        "resume-other-rope-scaling",
        lambda ws, fx: None,
        ["model.rope_scaling", "convert --from-checkpoint"],
        [*TRAIN_RESUME, "--set", "model.rope_scaling.factor=2"],
    ),
    _ckpt_row(
        "to-checkpoint-into-run",
        lambda ws, fx: None,
        ["checkpoints"],
        ["convert", "--preset", "tiny-dense", "--to-checkpoint", "{ws}/run"],
    ),
    Case("sample-run-missing", ["sample", "--run", "{ws}/none"], ["config.toml"]),
    Case("sample-run-is-data", ["sample", "--run", "{data}"], ["config.toml"]),
    Case(
        "from-checkpoint-missing",
        ["convert", "--from-checkpoint", "{ws}/none", "--to-hf", "{ws}/o"],
        ["none"],
    ),
    # nothing lost: sample reads a run while a save is in progress, and leaves that save alone
    _ckpt_row(
        "sample-leaves-tmp-alone",
        write("run/checkpoints/step-00000002.tmp/__0_0.distcp", "being written"),
        [],
        ["sample", "--run", "{ws}/run", "--max-new-tokens", "2"],
    ),
]
CKPT_ROWS[-1].code = 0

# ---------------------------------------------------------------------------------- HF folders
HF_CONVERT = ["convert", "--from-hf", "{ws}/hf", "--to-hf", "{ws}/out"]


def _hf_row(name: str, setup, names: list[str], argv=None, code: int = 2) -> Case:
    return Case(f"hf-{name}", argv or HF_CONVERT, names, both(copy("hf"), setup), code)


def _sharded(ws: Path, fx: dict) -> None:
    """Re-save the HF fixture in two shards with an index, for the index rows."""
    from seektrain.models.deepseek.hf_io import from_pretrained, save_pretrained

    shutil.rmtree(ws / "hf")
    save_pretrained(from_pretrained(fx["hf"]), ws / "hf", max_shard_bytes=1_500_000)


INDEX = "hf/model.safetensors.index.json"


def _swap_first_shard(d):
    keys = sorted(d["weight_map"])
    shards = sorted(set(d["weight_map"].values()))
    first = next(k for k in keys if d["weight_map"][k] == shards[0])
    d["weight_map"][first] = shards[1]
    return d


HF_ROWS = [
    _hf_row("no-config", lambda ws, fx: (ws / "hf/config.json").unlink(), ["config.json"]),
    _hf_row("config-garbage", write("hf/config.json", "{x"), ["config.json"]),
    _hf_row("config-a-list", write("hf/config.json", "[]"), ["config.json"]),
    _hf_row(
        "config-arch",
        edit_json("hf/config.json", set_key("architectures", ["GPT2LMHeadModel"])),
        ["config.json", "architecture"],
    ),
    _hf_row(
        "config-no-hidden",
        edit_json("hf/config.json", set_key("hidden_size", _DROP)),
        ["config.json", "hidden_size"],
    ),
    _hf_row(
        "config-hidden-text", edit_json("hf/config.json", set_key("hidden_size", "wide")), ["config.json"]
    ),
    _hf_row(
        "config-layers-neg",
        edit_json("hf/config.json", set_key("num_hidden_layers", -1)),
        ["config.json", "num_hidden_layers"],
    ),
    _hf_row(
        "config-act",
        edit_json("hf/config.json", set_key("hidden_act", "gelu")),
        ["config.json", "hidden_act"],
    ),
    _hf_row("weights-missing", lambda ws, fx: (ws / "hf/model.safetensors").unlink(), ["model.safetensors"]),
    _hf_row(
        "weights-corrupt",
        write("hf/model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage"),
        ["model.safetensors"],
    ),
    _hf_row(
        "weights-pickle-only",
        both(lambda ws, fx: (ws / "hf/model.safetensors").unlink(), write("hf/pytorch_model.bin", b"x")),
        ["safetensors"],
    ),
    _hf_row("config-wider", edit_json("hf/config.json", set_key("hidden_size", 256)), ["expected shape"]),
    _hf_row(
        "index-wrong-shard", both(_sharded, edit_json(INDEX, _swap_first_shard)), ["index", "does not hold"]
    ),
    _hf_row("index-not-json", both(_sharded, write(INDEX, "{")), [INDEX.split("/")[1]]),
    _hf_row("index-map-a-list", both(_sharded, edit_json(INDEX, set_key("weight_map", []))), ["index"]),
    _hf_row(
        "index-shard-missing",
        both(_sharded, lambda ws, fx: sorted((ws / "hf").glob("model-0*"))[-1].unlink()),
        ["missing shard"],
    ),
    _hf_row(
        "index-path-escape",
        both(_sharded, edit_json(INDEX, nested_set(["weight_map", "lm_head.weight"], "../x"))),
        ["index"],
    ),
    _hf_row(
        "from-hf-missing",
        lambda ws, fx: None,
        ["nothing"],
        ["convert", "--from-hf", "{ws}/nothing", "--to-hf", "{ws}/out"],
    ),
    _hf_row(
        "hub-id-not-cached",
        lambda ws, fx: None,
        ["hf download"],
        ["convert", "--from-hf", "nobody-xyz/absent", "--to-hf", "{ws}/o"],
    ),
    # nothing lost: convert --to-hf never replaces what it did not write, nor another model without --force
    _hf_row(
        "to-hf-other-model",
        lambda ws, fx: None,
        ["--to-hf", "--force"],
        ["convert", "--preset", "tiny-v2", "--to-hf", "{ws}/hf"],
    ),
    _hf_row(
        "to-hf-foreign-file",
        write("hf/README.md", "mine"),
        ["README.md"],
        ["convert", "--preset", "tiny-dense", "--to-hf", "{ws}/hf", "--force"],
    ),
    _hf_row(
        "to-hf-is-source",
        lambda ws, fx: None,
        ["--to-hf"],
        ["convert", "--from-hf", "{ws}/hf", "--to-hf", "{ws}/hf", "--force"],
    ),
    _hf_row(
        "to-hf-a-file",
        lambda ws, fx: None,
        ["--to-hf"],
        ["convert", "--preset", "tiny-dense", "--to-hf", "{ws}/hf/config.json"],
    ),
    _hf_row(
        "model-hf-path-missing",
        lambda ws, fx: None,
        ["model.hf_path"],
        ["train", "--set", "model.hf_path={ws}/nothing"],
    ),
]

HF_ROWS += [
    _hf_row(
        "config-hidden-a-numeric-string",
        edit_json("hf/config.json", set_key("hidden_size", "64")),
        ["hidden_size"],
    ),
    _hf_row(
        "config-kv-heads-0",
        edit_json("hf/config.json", set_key("num_key_value_heads", 0)),
        ["config.json", "num_key_value_heads"],
    ),
]
CKPT_ROWS += [
    _ckpt_row(
        "checksums-an-empty-list", edit_json(f"{STEP}/checksums.json", lambda d: []), ["checksums.json"]
    ),
]

# ------------------------------------------------------------ plan, doctor, launchers (issue 22, item 9)
PLAN = ["plan", "--model", "tiny-dense", "--gpu", "h100-80g"]
K8S = ["launch", "k8s", "--nodes", "1", "--gpus-per-node", "1"]
SLURM = ["launch", "slurm", "--config", "{ws}/c.toml", "--nodes", "1", "--gpus-per-node", "0"]


def _config_in(ws: Path, fx: dict) -> None:
    (ws / "c.toml").write_text(f'[run]\ndir = "{ws}/run"\n')


LAUNCH_ROWS = [
    Case("plan-seq-0", [*PLAN, "--gpus", "8", "--seq", "0"], ["--seq"]),
    Case("plan-global-batch-0", [*PLAN, "--gpus", "8", "--global-batch", "0"], ["--global-batch"]),
    Case("plan-gpus-a-billion", [*PLAN, "--gpus", "1000000000"], ["--gpus", "65536"]),
    Case("plan-nodes-0", [*PLAN, "--gpus", "8", "--nodes", "0"], ["--nodes"]),
    Case(
        "auto-with-tp",
        [
            "train",
            "--set",
            "parallel.auto=true",
            "--set",
            "parallel.tp=2",
            "--set",
            "model.preset=tiny-dense",
        ],
        ["parallel.auto", "parallel.tp=2"],
    ),
    Case("set-unclosed-array", ["config", "show", "--set", "parallel.pp_split=[1, 2"], ["parallel.pp_split"]),
    Case(
        "set-unclosed-trackers", ["config", "show", "--set", "metrics.trackers=[wandb"], ["metrics.trackers"]
    ),
    Case("doctor-node-rank-out-of-range", ["doctor", "--node-rank", "3"], ["--node-rank"]),
    Case("doctor-node-rank-negative", ["doctor", "--node-rank", "-1"], ["--node-rank"]),
    Case("doctor-min-free-nan", ["doctor", "--min-free-gib", "nan"], ["--min-free-gib"]),
    Case("doctor-ports-huge-range", ["doctor", "--ports", "1-1000000000000"], ["--ports"]),
    Case("doctor-timeout-negative", ["doctor", "--timeout-s", "-5"], ["--timeout-s"]),
    Case("doctor-rdzv-timeout-inf", ["doctor", "--rdzv-timeout", "inf"], ["--rdzv-timeout"]),
    Case("train-rdzv-timeout-nan", ["train", "--rdzv-timeout", "nan"], ["--rdzv-timeout"]),
    Case("train-rdzv-timeout-inf", ["train", "--rdzv-timeout", "inf"], ["--rdzv-timeout"]),
    Case("train-rdzv-timeout-negative", ["train", "--rdzv-timeout", "-3"], ["--rdzv-timeout"]),
    Case("train-node-rank-negative", ["train", "--node-rank", "-1"], ["--node-rank"]),
    Case("k8s-name-uppercase", [*K8S, "--name", "MyJob"], ["--name"]),
    Case("k8s-pvc-double-dot", [*K8S, "--pvc", "a..b"], ["--pvc"]),
    Case("k8s-storage-class-double-dot", [*K8S, "--storage-class", "fast..ssd"], ["--storage-class"]),
    Case("k8s-pvc-size-0", [*K8S, "--pvc-size", "0"], ["--pvc-size"]),
    Case("k8s-image-newline", [*K8S, "--image", "seektrain:1\ntouch PWNED"], ["--image"]),
    Case("k8s-data-path-on-host", [*K8S, "--set", "data.path=/home/me/data"], ["data.path", "/workspace"]),
    Case("k8s-output-in-proc", [*K8S, "-o", "/proc/seektrain.yaml"], ["--output"]),
    Case(
        "k8s-output-foreign",
        [*K8S, "-o", "{ws}/notes.md"],
        ["--output", "--force"],
        write("notes.md", "mine"),
    ),
    Case(
        "k8s-output-is-config",
        [*K8S, "--config", "{ws}/c.toml", "-o", "{ws}/c.toml", "--force"],
        ["--output", "--config"],
        write("c.toml", "[train]\nsteps = 2\n"),
    ),
    Case(
        "slurm-partition-semicolon", [*SLURM, "--partition", "gpu;touch PWNED"], ["--partition"], _config_in
    ),
    Case("slurm-account-newline", [*SLURM, "--account", "p\ntouch PWNED #"], ["--account"], _config_in),
    Case("slurm-image-subshell", [*SLURM, "--image", "x$(touch PWNED)"], ["--image"], _config_in),
    Case("slurm-time-newline", [*SLURM, "--time", "24:00:00\n"], ["--time"], _config_in),
    Case("slurm-set-newline", [*SLURM, "--set", "run.name=a\ntouch PWNED #"], ["--set"], _config_in),
    Case(
        "slurm-run-dir-newline",
        [*SLURM, "--set", "run.dir={ws}/run\ntouch PWNED #"],
        ["run.dir"],
        _config_in,
    ),
    Case(
        "slurm-output-foreign",
        [*SLURM, "-o", "{ws}/notes.md"],
        ["--output", "--force"],
        both(_config_in, write("notes.md", "mine")),
    ),
    Case(
        "slurm-output-is-config",
        [*SLURM, "-o", "{ws}/c.toml", "--force"],
        ["--output", "--config"],
        _config_in,
    ),
]
_plan_hf = Case(  # a config.json-only Hugging Face folder plans: users plan before downloading weights
    "plan-hf-config-only",
    ["plan", "--model", "{ws}/hf", "--gpus", "8", "--gpu", "h100-80g", "--top", "1"],
    [],
    lambda ws, fx: (ws / "hf").mkdir() or shutil.copy(fx["hf"] / "config.json", ws / "hf"),
    code=0,
)
LAUNCH_ROWS.append(_plan_hf)

ROWS: list[Case] = _schema_rows() + CONFIG_ROWS + CLI_ROWS + DATA_ROWS + CKPT_ROWS + HF_ROWS + LAUNCH_ROWS


# ---------------------------------------------------------------------------------- LoRA checkpoints
def _lora_run(ws: Path, fx: dict) -> None:
    """A LoRA checkpoint of tiny-dense on the Hugging Face base {ws}/base, and another model in {ws}/other."""
    from lora_checkpoints import make_lora_run
    from seektrain.models import build_model, get_preset
    from seektrain.models.deepseek.hf_io import save_pretrained

    make_lora_run(ws / "lrun", "tiny-dense", ws / "base")
    save_pretrained(build_model(get_preset("tiny-dense"), seed=3), ws / "other")


LORA_RESUME = [
    "train",
    "--set",
    "run.dir={ws}/lrun",
    "--set",
    "data.path={data}",
    "--set",
    "lora.rank=4",
    "--set",
    "lora.alpha=8",
    "--set",
    "lora.dropout=0.1",
]
LORA_ROWS = [
    Case(
        "lora-resume-other-base",
        [*LORA_RESUME, "--set", "lora.enabled=true", "--set", "model.hf_path={ws}/other"],
        ["trained on the Hugging Face folder {ws}/base", "this base is the Hugging Face folder {ws}/other"],
        _lora_run,
    ),
    Case(
        "lora-resume-other-rank",
        [
            *LORA_RESUME,
            "--set",
            "lora.enabled=true",
            "--set",
            "model.hf_path={ws}/base",
            "--set",
            "lora.rank=8",
        ],
        ["lora.rank=4", "lora.rank=8"],
        _lora_run,
    ),
    Case(
        "lora-resume-without-lora",
        [*LORA_RESUME, "--set", "model.hf_path={ws}/base"],
        ["holds LoRA adapters", "lora.enabled=true"],
        _lora_run,
    ),
    _ckpt_row(
        "lora-on-a-full-checkpoint",
        lambda ws, fx: None,
        ["full training checkpoint", "lora.enabled=true"],
        [*TRAIN_RESUME, "--set", "lora.enabled=true"],
    ),
    Case(
        "to-peft-full-checkpoint",
        ["convert", "--from-checkpoint", "{run}", "--to-peft", "{ws}/o"],
        ["--to-peft", "not a LoRA checkpoint"],
    ),
    Case(
        "merge-lora-full-checkpoint",
        ["convert", "--from-checkpoint", "{run}", "--merge-lora", "--to-hf", "{ws}/o"],
        ["--merge-lora", "holds no adapters"],
    ),
    Case(
        "lora-checkpoint-to-hf-unmerged",
        ["convert", "--from-checkpoint", "{ws}/lrun", "--to-hf", "{ws}/o"],
        ["holds LoRA adapters", "--merge-lora", "--to-peft"],
        _lora_run,
    ),
    Case(
        "to-peft-over-other-files",
        ["convert", "--from-checkpoint", "{ws}/lrun", "--to-peft", "{ws}/base"],
        ["--to-peft", "config.json"],
        _lora_run,
    ),
]

ROWS: list[Case] = _schema_rows() + CONFIG_ROWS + CLI_ROWS + DATA_ROWS + CKPT_ROWS + HF_ROWS + LORA_ROWS
