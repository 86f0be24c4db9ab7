"""The typed run configuration: one dataclass per component, nested in ``JobConfig``.

Every key here is public interface (TOML files and ``--set section.key=value`` use these names). Each
field carries one line of help in its metadata, which ``seektrain config keys`` and
``docs/configuration.md`` list, so the schema is the one place a key is described. Each field also declares the
values it accepts (``min=``, ``max=``, ``above=``, ``below=``, ``choices=``, ``also=``, ``nonempty=``, see
``config/bounds.py``), which the loader checks and ``config keys`` lists. Checks that relate several keys
live in ``seektrain.config.loader.validate``; checks against the launched world size are
in ``seektrain.parallel.layout``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from seektrain.config.bounds import Bounds


def _key(default: Any, help: str, **bounds: Any) -> Any:
    """A config field with its one line of help and the values it accepts (``Bounds``: min, max, above,
    below, choices, also, nonempty); floats must always be finite. List defaults get a fresh list per
    config."""
    if "choices" in bounds:
        bounds["choices"] = tuple(bounds["choices"])
    if "also" in bounds:
        bounds["also"] = tuple(bounds["also"])
    meta = {"help": help, "bounds": Bounds(**bounds)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class RopeScalingSection:
    """``[model.rope_scaling]``: YaRN overrides on top of the preset's or the Hugging Face config's own
    rope scaling, for extending a checkpoint's context. -1 keeps the model's value, so an empty table
    changes nothing; checks that relate them to the model's values are made where the model is chosen
    (``models/deepseek/rope_overrides.py``)."""

    factor: float = _key(
        -1.0,
        "YaRN context factor: max_position_embeddings = factor x original_max_position_embeddings; "
        "1 = none; -1 = the model's",
        min=1,
        also=(-1,),
    )
    original_max_position_embeddings: int = _key(
        -1,
        "context length the model was pre-trained at; -1 = the model's (its max_position_embeddings "
        "when it has no YaRN)",
        min=1,
        also=(-1,),
    )
    beta_fast: float = _key(
        -1.0,
        "YaRN: frequencies turning more than this often over the original length are kept; -1 = the model's",
        above=0,
        also=(-1,),
    )
    beta_slow: float = _key(
        -1.0,
        "YaRN: frequencies turning less than this often are divided by factor (< beta_fast); -1 = the model's",
        above=0,
        also=(-1,),
    )
    mscale: float = _key(
        -1.0, "YaRN magnitude of cos/sin, 0.1 x mscale x ln(factor) + 1; -1 = the model's", min=0, also=(-1,)
    )
    mscale_all_dim: float = _key(
        -1.0,
        "YaRN: divides the cos/sin magnitude and scales the softmax (DeepSeek-V2/V3); 0 = off; -1 = the model's",
        min=0,
        also=(-1,),
    )


@dataclass
class ModelSection:
    preset: str = _key(
        "tiny-v3", "preset name (`seektrain models` lists them); ignored when hf_path is set", nonempty=True
    )
    hf_path: str = _key(
        "", "start from a Hugging Face model folder or hub id (org/name) instead of random init"
    )
    rope_scaling: RopeScalingSection = field(default_factory=RopeScalingSection)


@dataclass
class TrainSection:
    steps: int = _key(300, "total optimizer steps of the run (a resumed run continues up to this)", min=1)
    global_batch_size: int = _key(16, "sequences per optimizer step, over all data-parallel ranks", min=1)
    micro_batch_size: int = _key(8, "sequences per forward/backward on one rank", min=1)
    seq_len: int = _key(256, "tokens per training sequence", min=1)
    seed: int = _key(1234, "seed of model init and data order", min=0)
    grad_clip: float = _key(
        1.0, "max global grad norm; 0 disables clipping (the norm is still logged)", min=0
    )
    activation_checkpoint: str = _key(
        "none",
        "recompute activations in backward: none | full | every:K layers | "
        "selective (keep matmul and attention outputs)",
        nonempty=True,
    )
    mtp_loss_weight: float = _key(
        0.3, "weight of the multi-token-prediction loss (models with MTP layers)", min=0
    )
    aux_loss_alpha: float = _key(0.0, "sequence-wise expert balance loss weight (0 = off)", min=0)
    bias_update_speed: float = _key(
        0.01, "V3 aux-loss-free balancing bias step (DeepSeek-V3: 0.001); 0 = off", min=0
    )
    deterministic: bool = _key(False, "torch.use_deterministic_algorithms: bit-exact reruns and resumes")
    compile: bool = _key(
        False,
        "torch.compile each decoder block (regional; off by default: on CPU it costs minutes for a few percent)",
    )
    eval_interval: int = _key(
        100, "compute the validation loss every N steps on the prepared val split (0 = off)", min=0
    )
    eval_steps: int = _key(4, "micro-batches per validation-loss evaluation", min=1)
    on_bad_loss: str = _key(
        "skip",
        "NaN/Inf or spiking loss: skip (drop the update) | stop (exit with one line)",
        choices=("skip", "stop"),
    )
    spike_factor: float = _key(
        0.0, "a loss above factor x the running mean of recent losses is bad; 0 = off", above=1, also=(0,)
    )


@dataclass
class OptimSection:
    lr: float = _key(3e-3, "peak AdamW learning rate", above=0)
    min_lr_ratio: float = _key(0.1, "cosine decay ends at lr x min_lr_ratio", min=0, max=1)
    warmup_steps: int = _key(30, "linear warmup steps before the cosine decay", min=0)
    weight_decay: float = _key(0.1, "AdamW decoupled weight decay", min=0)
    beta1: float = _key(0.9, "AdamW beta1", min=0, below=1)
    beta2: float = _key(0.95, "AdamW beta2", min=0, below=1)
    eps: float = _key(1e-8, "AdamW epsilon", above=0)


@dataclass
class PrecisionSection:
    dtype: str = _key(
        "auto",
        "compute dtype: auto (bf16 where the device has native bf16, else fp32) | fp32 | bf16 | "
        "fp16 (master weights stay fp32)",
        choices=("auto", "fp32", "bf16", "fp16"),
    )
    reduce_dtype: str = _key(
        "fp32",
        "dtype of FSDP's gradient reduce-scatter: fp32 | bf16 (halves its bytes)",
        choices=("fp32", "bf16"),
    )
    loss_scale_init: float = _key(2.0**16, "fp16: initial dynamic loss scale", above=0)
    loss_scale_growth_interval: int = _key(
        200, "fp16: double the loss scale after this many good steps", min=1
    )
    fp8: str = _key(
        "none",
        "FP8 matmuls via torchao on H100-class GPUs: none | rowwise | blockwise "
        "(DeepSeek-V3's 128x128 / 1x128 scaling)",
        choices=("none", "rowwise", "blockwise"),
    )


@dataclass
class ParallelSection:
    dp_replicate: int = _key(1, "data-parallel replicas (HSDP when > 1 with FSDP)", min=1)
    dp_shard: int = _key(
        -1,
        "FSDP shard degree; -1 takes what the world size leaves after the other degrees",
        min=1,
        also=(-1,),
    )
    tp: int = _key(1, "tensor-parallel degree (keep it within a node)", min=1)
    pp: int = _key(1, "pipeline-parallel stages", min=1)
    cp: int = _key(
        1,
        "context-parallel degree: each sequence split over cp ranks in load-balanced chunks (long context)",
        min=1,
    )
    ep: int = _key(
        1, "expert-parallel ranks: a divisor of dp_shard, or with tp > 1 tp x a divisor of dp_shard", min=1
    )
    data_parallel: str = _key("fsdp", "fsdp | ddp (ddp requires dp_shard == 1)", choices=("fsdp", "ddp"))
    reshard_after_forward: bool = _key(True, "FSDP: false keeps params gathered after forward (ZeRO-2-like)")
    cpu_offload: bool = _key(
        False, "FSDP CPU offload: params, grads, optimizer state in host memory (needs fsdp; also 1 rank)"
    )
    pp_schedule: str = _key(
        "1f1b",
        "pipeline schedule: gpipe | 1f1b | interleaved-1f1b | zbv",
        choices=("gpipe", "1f1b", "interleaved-1f1b", "zbv"),
    )
    pp_microbatches: int = _key(
        0, "pipeline micro-batches per step; 0 = one per micro batch of the accumulation", min=0
    )
    pp_stages_per_rank: int = _key(
        2, "stages each rank runs under interleaved-1f1b (zbv always uses 2)", min=1
    )
    pp_split: list[int] = _key([], "decoder layers per pipeline stage; empty = balanced automatically", min=1)
    auto: bool = _key(
        False,
        "replace the degrees and micro_batch_size by the planner's best layout for the world "
        "size and device (seektrain plan)",
    )


@dataclass
class DistSection:
    backend: str = _key(
        "auto",
        "process-group backend: auto (nccl on GPUs, gloo on CPU) | nccl | gloo",
        choices=("auto", "nccl", "gloo"),
    )
    init_timeout_s: float = _key(
        300.0,
        "end a multi-node launch when a node has not joined (or the endpoint is unreachable) within this",
        above=0,
    )
    collective_timeout_s: float = _key(
        600.0, "a collective waiting longer fails with a message naming the rank", above=0
    )
    socket_ifname: str = _key(
        "",
        "network interface gloo/NCCL bind to; empty = the one the route to the rendezvous endpoint leaves by",
    )
    env: list[str] = _key(
        [], "extra NAME=VALUE environment for every worker, e.g. NCCL_DEBUG=WARN, NCCL_IB_HCA=mlx5"
    )


@dataclass
class DataSection:
    path: str = _key("builtin", "a folder made by `seektrain data prepare`, or builtin", nonempty=True)
    tokenizer: str = _key(
        "byte", "built-in corpus tokenizer: byte, a tokenizer.json path or a hub id (org/name)", nonempty=True
    )
    prefetch: int = _key(
        2,
        "training batches read ahead in a background thread (pinned on GPUs); 0 = read in the step",
        min=0,
        max=64,
    )
    packing: bool = _key(
        False, "pack whole documents into each train.seq_len row (attention and RoPE restart per document)"
    )
    document_mask: bool = _key(
        False, "plain windows, but attention and RoPE restart at each stored document start"
    )


@dataclass
class CheckpointSection:
    interval: int = _key(100, "save every N steps (0 = only at the end)", min=0)
    keep: int = _key(2, "newest checkpoints kept on disk", min=1)
    async_save: bool = _key(False, "save in the background while training goes on")
    on_write_error: str = _key(
        "stop",
        "a checkpoint that cannot be written (full disk...): stop the run | continue and retry at the next interval",
        choices=("stop", "continue"),
    )
    preempt_grace_s: float = _key(
        25.0, "after SIGTERM, save within this or exit without (torchrun kills at 30 s)", above=0
    )
    resume: str = _key(
        "auto",
        "auto (newest valid checkpoint of run.dir, else fresh) | never | a step | a path",
        nonempty=True,
    )


@dataclass
class RunSection:
    dir: str = _key("runs/default", "the run folder: config, metrics, logs, checkpoints", nonempty=True)
    name: str = _key("", "run name in metrics and trackers (default: the folder name)")
    log_interval: int = _key(10, "log a line every N steps (metrics.jsonl gets every step)", min=1)
    progress_bar: bool = _key(True, "show a progress bar on rank 0")


@dataclass
class MetricsSection:
    prometheus_port: int = _key(0, "serve /metrics for Prometheus on this port (0 = off)", min=0, max=65535)
    prometheus_host: str = _key("127.0.0.1", "address the Prometheus endpoint listens on", nonempty=True)
    all_ranks: bool = _key(
        False, "every rank serves /metrics at prometheus_port + local_rank (per-GPU numbers)"
    )
    tensorboard: bool = _key(True, "write TensorBoard event files under run.dir/tensorboard")
    trackers: list[str] = _key(
        [],
        "experiment trackers fed by rank 0: wandb, mlflow (each needs its package)",
        choices=("wandb", "mlflow"),
    )
    tracker_project: str = _key(
        "seektrain", "W&B project / MLflow experiment the run is logged to", nonempty=True
    )
    mlflow_tracking_uri: str = _key("", "MLflow tracking URI; empty = sqlite:///<run.dir>/mlflow.db")
    gpu_stats_interval: int = _key(
        10, "sample GPU utilisation, memory, power and temperature (NVML) every N steps", min=1
    )


@dataclass
class ProfileSection:
    steps: list[int] = _key([], "write a torch.profiler Chrome trace for these steps", min=1)


@dataclass
class LoraSection:
    enabled: bool = _key(
        False, "train low-rank adapters on a frozen base (compute dtype, no gradients or optimizer state)"
    )
    rank: int = _key(16, "adapter rank r", min=1)
    alpha: float = _key(32.0, "adapter scale alpha (the update is alpha / r * B @ A)", above=0)
    dropout: float = _key(0.0, "dropout on the adapter's input", min=0, below=1)
    target_modules: list[str] = _key(
        ["attention", "mlp", "shared_experts", "experts"],
        "adapted modules: attention | mlp | shared_experts | experts (routed) | a pattern like '*.o_proj'",
        nonempty=True,
    )


@dataclass
class CpuSection:
    keep_freed_memory: bool = _key(
        True, "glibc keeps freed memory during a step, returns free pages after it (CPU)"
    )


@dataclass
class JobConfig:
    model: ModelSection = field(default_factory=ModelSection)
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimSection = field(default_factory=OptimSection)
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    dist: DistSection = field(default_factory=DistSection)
    data: DataSection = field(default_factory=DataSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    run: RunSection = field(default_factory=RunSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    profile: ProfileSection = field(default_factory=ProfileSection)
    lora: LoraSection = field(default_factory=LoraSection)
    cpu: CpuSection = field(default_factory=CpuSection)
