"""Out of memory in a step ends the run with one line naming the cheapest fix for the job
(seektrain/train/out_of_memory.py): the rule order, the errors recognised, and a real run."""

from __future__ import annotations

import torch

from fault_injection import hooks_env
from run_cli import train
from seektrain.config.loader import load_config
from seektrain.models.deepseek.presets import get_preset
from seektrain.plan.run_plan import RunPlan
from seektrain.train.out_of_memory import cheapest_fix, is_out_of_memory


def _fix(*overrides: str, world: int = 1, device: str = "cpu") -> str:
    return str(
        cheapest_fix(
            RunPlan.resolve(load_config(None, list(overrides)), get_preset("tiny-v3"), world, device)
        )
    )


def test_rules_in_order_of_cost():
    full = "train.activation_checkpoint=full"
    assert _fix().startswith("--set train.activation_checkpoint=full ")
    assert _fix(full, "train.micro_batch_size=8").startswith("--set train.micro_batch_size=4 ")
    assert _fix(full, "train.micro_batch_size=3", "train.global_batch_size=6").startswith(
        "--set train.micro_batch_size=1 "
    )
    ddp = _fix(
        full,
        "train.micro_batch_size=1",
        "parallel.data_parallel=ddp",
        "parallel.dp_shard=1",
        "parallel.dp_replicate=2",
        world=2,
    )
    assert ddp.startswith(
        "--set parallel.data_parallel=fsdp --set parallel.dp_replicate=1 --set parallel.dp_shard=2 "
    )
    hsdp = _fix(full, "train.micro_batch_size=1", "parallel.dp_shard=2", "parallel.dp_replicate=2", world=4)
    assert hsdp.startswith("--set parallel.dp_replicate=1 --set parallel.dp_shard=4 ")
    sharded = (full, "train.micro_batch_size=1")
    assert _fix(*sharded, "parallel.reshard_after_forward=false", world=2).startswith(
        "--set parallel.reshard_after_forward=true "
    )
    assert _fix(*sharded, world=2, device="cuda").startswith("--set parallel.cpu_offload=true ")
    assert "more GPUs (e.g. 4 " in _fix(*sharded, "parallel.cpu_offload=true", world=2, device="cuda")
    assert "more memory" in _fix(*sharded, world=2)  # offloading to the host does not help a CPU run


def test_recognised_errors():
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: "
            "can't allocate memory: you tried to allocate 68719476736 bytes."
        )
    )
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_run_ends_with_the_fix_not_a_traceback(tmp_path):
    proc = train(tmp_path, "train.steps=3", env=hooks_env({"SEEKTRAIN_TEST_OOM": "2"}), check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("seektrain: error: rank 0 ran out of memory during step 2: CUDA out of memory")
    assert last.endswith(
        "Cheapest fix for this job: --set train.activation_checkpoint=full (recompute activations "
        "in backward: about a third more compute, far fewer stored activations)"
    )
    assert "Traceback" not in proc.stderr
