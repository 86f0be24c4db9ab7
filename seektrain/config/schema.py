"""The typed run configuration: one dataclass per component, nested in ``JobConfig``.

Every key here is public interface (TOML files and ``--set section.key=value`` use these names).
Validation that needs no world size lives in ``validate``; checks against the launched world size are
in ``seektrain.parallel.layout``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelSection:
    preset: str = "tiny-v3"
    hf_path: str = ""  # start from a Hugging Face folder instead of random init (preset ignored)


@dataclass
class TrainSection:
    steps: int = 300  # total optimizer steps of the run (a resumed run continues up to this)
    global_batch_size: int = 16  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 8  # sequences per forward/backward on one rank
    seq_len: int = 256
    seed: int = 1234
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping (the norm is still logged)
    activation_checkpoint: str = "none"  # none | full | every:K
    mtp_loss_weight: float = 0.3
    aux_loss_alpha: float = 0.0  # sequence-wise balance loss weight (0 = off)
    bias_update_speed: float = 0.01  # V3 aux-loss-free balancing step (DeepSeek-V3 used 0.001 over 14.8T tokens; short runs need more); 0 = off
    deterministic: bool = False  # torch.use_deterministic_algorithms
    compile: bool = False
    # failure handling (seektrain.train.faults, docs/checkpoints.md)
    on_bad_loss: str = "skip"  # NaN/Inf or spiking loss: skip (drop the update) | stop (exit, one line)
    spike_factor: float = 0.0  # a loss above factor × running mean of recent losses is bad; 0 = off
    collective_timeout_s: float = 600.0  # a collective waiting longer fails with a message naming the rank
    # CPU runs: glibc keeps freed memory for reuse during a step instead of unmapping it (big tensors
    # stop page-faulting every step) and returns free pages after each step (seektrain/train/cpu_allocator.py)
    cpu_keep_freed_memory: bool = True


@dataclass
class OptimSection:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8


@dataclass
class PrecisionSection:
    dtype: str = "bf16"  # fp32 | bf16 | fp16 (compute dtype; master weights and optimizer stay fp32)
    reduce_dtype: str = "fp32"  # fp32 | bf16: dtype of FSDP's gradient reduce-scatter (bf16 halves its bytes)
    loss_scale_init: float = 2.0**16
    loss_scale_growth_interval: int = 200


@dataclass
class ParallelSection:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever the world size leaves after the other degrees
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert-parallel ranks: a divisor of dp_shard, or with tp > 1 tp × a divisor of dp_shard
    data_parallel: str = "fsdp"  # fsdp | ddp (ddp requires dp_shard == 1)
    reshard_after_forward: bool = True  # False keeps params gathered after forward (ZeRO-2-like)
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 0  # 0: one per micro batch of the accumulation
    pp_stages_per_rank: int = 2  # stages each rank runs under interleaved-1f1b (zbv always uses 2)
    pp_split: list[int] = field(default_factory=list)  # decoder layers per stage; empty = balanced automatically


@dataclass
class DataSection:
    path: str = "builtin"  # a folder made by `seektrain data prepare`, or "builtin"
    tokenizer: str = "byte"  # tokenizer for the built-in corpus: byte or a tokenizer.json path


@dataclass
class CheckpointSection:
    interval: int = 100  # save every N steps (0 = only at the end)
    keep: int = 2
    async_save: bool = False
    preempt_grace_s: float = 25.0  # after SIGTERM, save within this or exit without (torchrun kills at 30 s)


@dataclass
class RunSection:
    dir: str = "runs/default"
    name: str = ""
    log_interval: int = 10  # log a line every N steps (metrics.jsonl gets every step)
    progress_bar: bool = True


@dataclass
class MetricsSection:
    prometheus_port: int = 0  # 0 = no HTTP endpoint
    prometheus_host: str = "127.0.0.1"
    all_ranks: bool = False
    tensorboard: bool = True


@dataclass
class ProfileSection:
    steps: list[int] = field(default_factory=list)  # torch.profiler trace for these steps


@dataclass
class JobConfig:
    model: ModelSection = field(default_factory=ModelSection)
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimSection = field(default_factory=OptimSection)
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    data: DataSection = field(default_factory=DataSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    run: RunSection = field(default_factory=RunSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    profile: ProfileSection = field(default_factory=ProfileSection)
