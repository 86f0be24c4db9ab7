"""`seektrain doctor`: passes on this (CPU) machine, remarks on risky environment variables, refuses a
run.dir that cannot hold a run, checks shared storage across ranks, and `--comm` prints nccl-tests'
algorithm and bus bandwidth for 2 and 4 gloo ranks (small messages, so it stays fast)."""

from __future__ import annotations

import json
import os

import pytest

from run_cli import seektrain
from seektrain.doctor.storage_checks import shared_storage_check

FAST = ("--write-mib", "4")


def _doctor(tmp_path, *args: str, env: dict | None = None):
    return seektrain(
        "doctor", "--run-dir", str(tmp_path / "run"), *FAST, *args, env=env, check=False, timeout=600
    )


def _checks(proc) -> dict[str, dict]:
    return {c["name"]: c for c in json.loads(proc.stdout)["checks"]}


def test_passes_here(tmp_path):
    proc = _doctor(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no blockers" in proc.stdout
    checks = _checks(_doctor(tmp_path, "--json"))
    assert checks["torch"]["status"] == "ok"
    assert checks["gpus"]["status"] in ("info", "ok")  # no GPU on a CPU machine is a fact, not a blocker
    assert checks["run.dir"]["status"] == "ok" and checks["write speed"]["detail"].endswith("fsynced)")


def test_risky_environment_gets_its_remark(tmp_path):
    env = {"NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "INFO", "TORCH_NCCL_BLOCKING_WAIT": "1"}
    proc = _doctor(tmp_path, "--json", env=env)
    assert proc.returncode == 0  # slower, not broken
    checks = _checks(proc)
    assert checks["env NCCL_IB_DISABLE"]["status"] == "warn"
    assert "inter-node traffic goes over TCP sockets" in checks["env NCCL_IB_DISABLE"]["detail"]
    assert "use WARN in production" in checks["env NCCL_DEBUG"]["detail"]
    assert checks["env TORCH_NCCL_BLOCKING_WAIT"]["status"] == "warn"


def test_broken_environment_is_a_blocker(tmp_path):
    env = {
        "MASTER_ADDR": "localhost",
        "WORLD_SIZE": "16",
        "LOCAL_WORLD_SIZE": "8",
        "NCCL_SOCKET_IFNAME": "nosuchif",
    }
    proc = _doctor(tmp_path, env=env)
    assert proc.returncode == 1
    assert "BLOCKER  env MASTER_ADDR" in proc.stdout and "other nodes cannot reach" in proc.stdout
    assert "NCCL_SOCKET_IFNAME=nosuchif matches no interface" in proc.stdout


def _read_only_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):  # root ignores the mode bits; sysfs refuses new entries even to root
        return "/sys/seektrain-doctor-test/run"
    return str(ro / "run")


def test_read_only_run_dir_is_a_blocker(tmp_path):
    proc = seektrain("doctor", "--run-dir", _read_only_dir(tmp_path), *FAST, check=False)
    assert proc.returncode == 1
    assert "BLOCKER  run.dir" in proc.stdout and "cannot be written" in proc.stdout


def test_full_disk_is_a_blocker(tmp_path):
    proc = _doctor(tmp_path, "--min-free-gib", "1e9")
    assert proc.returncode == 1
    assert "BLOCKER  disk" in proc.stdout and "below --min-free-gib 1e+09" in proc.stdout


def test_unshared_run_dir_is_a_blocker(tmp_path):
    """Rank 1 (simulated: another host) wrote its file somewhere rank 0 cannot see."""

    def gather(obj):
        fake = {"name": "x-rank1-abc", "host": "other-host", "result": ("", [])}
        if isinstance(obj, str) and "-rank0-" in obj:
            return [obj, fake["name"]]
        if isinstance(obj, str):
            return [obj, fake["host"]]
        return [obj, fake["result"]]

    check = shared_storage_check(tmp_path, 0, 2, lambda: None, gather)
    assert check.status == "blocker"
    assert "rank 0 (" in check.detail and "does not see the files of rank(s) 1 (other-host)" in check.detail
    assert not list(tmp_path.iterdir())  # its own probe file is removed


COMM = ("--comm", "--sizes", "4K,64K", "--iters", "2")


def test_comm_prints_bandwidth_table(tmp_path):
    proc = _doctor(tmp_path, *COMM, "--nproc-per-node", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    assert "collective bandwidth on 2 ranks (gloo, cpu)" in out and "algbw (GB/s)  busbw (GB/s)" in out
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert sum(line.startswith(op) for line in out.splitlines()) == 2  # one row per size
    assert "slowest link: rank 0 (" in out
    assert "all 2 ranks on 1 host(s) see each other's files" in out


def test_comm_bus_bandwidth_on_four_ranks(tmp_path):
    proc = _doctor(tmp_path, *COMM, "--nproc-per-node", "4", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    comm = json.loads(proc.stdout)["comm"]
    factor = {"all_reduce": 1.5, "all_gather": 0.75, "reduce_scatter": 0.75, "all_to_all": 0.75}  # n = 4
    assert sorted({row["op"] for row in comm["rows"]}) == sorted(factor)
    for row in comm["rows"]:
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * factor[row["op"]])
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / (row["time_us"] * 1e-6) / 1e9)
    assert [(link["src"], link["dst"]) for link in comm["links"]] == [(0, 1), (1, 2), (2, 3), (3, 0)]


def test_comm_needs_ranks(tmp_path):
    proc = _doctor(tmp_path, "--comm")
    assert proc.returncode == 2 and "--comm measures collectives between ranks" in proc.stderr


def test_model_folder_read_speed(tmp_path):
    """With model.hf_path the doctor measures the raw read rate of its weight files (the figure the
    start-up log's load rate is read against); without one it does not."""
    from seektrain.models import build_model, get_preset
    from seektrain.models.deepseek.hf_io import save_pretrained

    save_pretrained(build_model(get_preset("tiny-dense"), seed=0), tmp_path / "hf", max_shard_bytes=500_000)
    checks = _checks(_doctor(tmp_path, "--json", "--set", f"model.hf_path={tmp_path / 'hf'}"))
    detail = checks["model read speed"]["detail"]
    assert checks["model read speed"]["status"] == "ok" and "GB/s raw read of" in detail, detail
    assert "weight file(s), page cache dropped" in detail
    assert "model read speed" not in _checks(_doctor(tmp_path, "--json"))
