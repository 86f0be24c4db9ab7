"""The parallel layout: degrees of every dimension, validated against the world size, and the one
DeviceMesh every parallel function takes its views from.

World mesh dimensions, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``, ``tp``. Data-parallel
ranks (the ones that see different data) are ``dp_replicate × dp_shard``; expert parallelism borrows
its ranks from inside ``dp_shard`` and, with tensor parallelism, every ``tp`` rank too (``ep_layout_error``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from seektrain.config.loader import ConfigError
from seektrain.config.schema import ParallelSection


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    data_parallel: str = "fsdp"

    @classmethod
    def from_config(cls, p: ParallelSection, world_size: int) -> "ParallelLayout":
        others = p.dp_replicate * p.tp * p.pp
        dp_shard = p.dp_shard
        if dp_shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"world size {world_size} is not divisible by parallel.dp_replicate × tp × pp = {others}; "
                    "change the degrees or the number of processes")
            dp_shard = world_size // others
        layout = cls(world_size, p.dp_replicate, dp_shard, p.tp, p.pp, p.ep, p.data_parallel)
        layout.validate()
        return layout

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def validate(self) -> None:
        product = self.pp * self.dp_replicate * self.dp_shard * self.tp
        if product != self.world_size:
            raise ConfigError(
                f"parallel.pp × dp_replicate × dp_shard × tp = {self.pp}×{self.dp_replicate}×{self.dp_shard}"
                f"×{self.tp} = {product} but the world size is {self.world_size}; set parallel.dp_shard=-1 or "
                "fix the degrees")
        error = ep_layout_error(self.ep, self.dp_shard, self.tp)
        if error:
            raise ConfigError(error)
        if self.ep > 1 and self.data_parallel == "ddp" and self.dp > 1:
            raise ConfigError(f"parallel.ep={self.ep} needs parallel.data_parallel=fsdp: DDP cannot hold expert shards")
        if self.data_parallel == "ddp" and self.dp_shard > 1:
            raise ConfigError("parallel.data_parallel=ddp replicates the model: set parallel.dp_shard=1 and "
                              "parallel.dp_replicate to the data-parallel size, or use data_parallel=fsdp")

    def describe(self) -> str:
        return (f"world={self.world_size} pp={self.pp} dp_replicate={self.dp_replicate} "
                f"dp_shard={self.dp_shard} tp={self.tp} ep={self.ep} ({self.data_parallel})")

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The world mesh with flattened views ``dp`` (all data-parallel ranks) and ``dp_fsdp``."""
        names = ("pp", "dp_replicate", "dp_shard", "tp")
        shape = (self.pp, self.dp_replicate, self.dp_shard, self.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        return mesh


def ep_layout_error(ep: int, dp_shard: int, tp: int) -> str | None:
    """Why ``ep`` expert-parallel ranks do not fit the layout (one line), or None.

    Without tensor parallelism the ep ranks are data-parallel shard ranks, so ``ep`` must divide
    ``dp_shard``. With it, an ep group takes whole tensor-parallel groups (each tp rank dispatches its
    own share of the tokens, torchtitan's "ETP=1"): ``ep = tp × k`` with ``k`` dividing ``dp_shard``.
    """
    if ep < 1:
        return f"parallel.ep={ep} must be >= 1"
    if ep == 1:
        return None
    if tp == 1:
        if dp_shard % ep:
            return (f"parallel.ep={ep} must divide parallel.dp_shard={dp_shard}: experts are spread over the "
                    "data-parallel shard ranks")
        return None
    if ep % tp:
        return (f"parallel.ep={ep} must be a multiple of parallel.tp={tp}: expert parallelism borrows every "
                f"tensor-parallel rank; set parallel.ep to tp × a divisor of parallel.dp_shard={dp_shard}")
    if dp_shard % (ep // tp):
        return (f"parallel.ep={ep} must divide parallel.dp_shard × tp = {dp_shard}×{tp} = {dp_shard * tp}: "
                f"set parallel.ep to tp × a divisor of parallel.dp_shard")
    return None


def resolve_layout(cfg, world_size: int) -> tuple[ParallelLayout, int]:
    """The layout for ``world_size`` processes and the gradient-accumulation steps it implies; every
    size that does not divide is refused here, before any worker starts."""
    layout = ParallelLayout.from_config(cfg.parallel, world_size)
    t = cfg.train
    per_step = t.micro_batch_size * layout.dp
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size × "
            f"data-parallel size = {t.micro_batch_size}×{layout.dp} = {per_step}; adjust one of them")
    return layout, t.global_batch_size // per_step
