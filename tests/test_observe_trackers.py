"""Experiment trackers behind the metrics sink, offline: W&B in offline mode (its run file is read back
record by record) and MLflow on a local SQLite store (read back with mlflow's own client)."""

from __future__ import annotations

import json
import struct
from typing import ClassVar

import pytest

from seektrain.config.loader import ConfigError, config_to_dict, load_config
from seektrain.config.schema import JobConfig
from seektrain.observe import trackers as trackers_mod
from seektrain.observe.sink import MetricsSink


def record(step: int) -> dict:
    return {"loss": 10.0 - step, "lr": 0.001 * step, "tokens_per_s": 100.0 * step, "note": "text"}


def log_steps(sink: MetricsSink, steps) -> None:
    for step in steps:
        sink.log(step, record(step))


# ----------------------------------------------------------------------------------------- mlflow
def mlflow_client(run_dir):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")


def test_mlflow_logs_params_once_and_every_step(tmp_path):
    pytest.importorskip("mlflow")
    params = config_to_dict(JobConfig())
    with MetricsSink(
        tmp_path, rank=0, tensorboard=False, trackers=["mlflow"], run_name="first", params=params
    ) as sink:
        log_steps(sink, (1, 2, 3))
    client = mlflow_client(tmp_path)
    run_id = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
    run = client.get_run(run_id)
    assert run.info.run_name == "first" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "seektrain"
    assert run.data.params["train.steps"] == "300" and run.data.params["parallel.pp_split"] == "[]"

    def leaves(table: dict) -> int:  # a sub-table such as [model.rope_scaling] is logged key by key
        return sum(leaves(v) if isinstance(v, dict) else 1 for v in table.values())

    assert len(run.data.params) == leaves(params)
    history = client.get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 9.0), (2, 8.0), (3, 7.0)]
    assert "note" not in run.data.metrics  # text goes to metrics.jsonl only
    assert [m.value for m in client.get_metric_history(run_id, "tokens_per_s")] == [100.0, 200.0, 300.0]


def test_mlflow_resume_continues_the_run_and_a_fresh_start_does_not(tmp_path):
    pytest.importorskip("mlflow")
    with MetricsSink(tmp_path, rank=0, tensorboard=False, trackers=["mlflow"]) as sink:
        log_steps(sink, (1, 2))
    first = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
    with MetricsSink(tmp_path, rank=0, tensorboard=False, trackers=["mlflow"], resume=True) as sink:
        log_steps(sink, (3,))
    assert json.loads((tmp_path / "trackers.json").read_text())["mlflow"] == first
    client = mlflow_client(tmp_path)
    assert [m.step for m in client.get_metric_history(first, "loss")] == [1, 2, 3]
    with MetricsSink(tmp_path, rank=0, tensorboard=False, trackers=["mlflow"], resume=False) as sink:
        log_steps(sink, (1,))
    second = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
    assert second != first and [m.step for m in client.get_metric_history(second, "loss")] == [1]


def test_only_rank_zero_tracks(tmp_path):
    pytest.importorskip("mlflow")
    with MetricsSink(tmp_path, rank=1, enabled=True, tensorboard=False, trackers=["mlflow"]) as sink:
        log_steps(sink, (1,))
    assert (tmp_path / "metrics.rank1.jsonl").is_file()
    assert not (tmp_path / "trackers.json").exists() and not (tmp_path / "mlflow.db").exists()


def test_bad_mlflow_uri_is_one_line(tmp_path):
    pytest.importorskip("mlflow")
    with pytest.raises(ValueError) as err:
        MetricsSink(
            tmp_path, rank=0, tensorboard=False, trackers=["mlflow"], mlflow_tracking_uri="nosuchscheme://x"
        )
    assert "metrics.mlflow_tracking_uri" in str(err.value) and "\n" not in str(err.value)


# ----------------------------------------------------------------------------------------- wandb
def read_wandb_records(path) -> list:
    """The records of a ``.wandb`` run file: a 7-byte header, then LevelDB-log framed protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, chunk, out = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(chunk)
            out.append(rec)
            chunk = b""
    return out


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))


def test_wandb_offline_writes_config_and_metrics_under_the_run_dir(tmp_path, wandb_offline):
    run_dir = tmp_path / "run"
    with MetricsSink(
        run_dir,
        rank=0,
        tensorboard=False,
        trackers=["wandb"],
        run_name="wb",
        tracker_project="proj",
        params={"train": {"steps": 2}},
    ) as sink:
        log_steps(sink, (1, 2))
    run_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]
    (run_file,) = (run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    records = read_wandb_records(run_file)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "proj" and run.display_name == "wb"
    assert {i.key: json.loads(i.value_json) for i in run.config.update}["train"] == {"steps": 2}
    history = [
        {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [(h["_step"], h["loss"], h["lr"]) for h in history] == [(1, 9.0, 0.001), (2, 8.0, 0.002)]
    assert all("note" not in h for h in history)

    with MetricsSink(
        run_dir, rank=0, tensorboard=False, trackers=["wandb"], tracker_project="proj", resume=True
    ) as sink:
        log_steps(sink, (3,))
    assert json.loads((run_dir / "trackers.json").read_text())["wandb"] == run_id  # the same run goes on
    # wandb adds "-1" to a second folder of the same run started within the same second
    assert len(list((run_dir / "wandb").glob(f"offline-run-*-{run_id}*"))) == 2


# ----------------------------------------------------------------------------------------- errors
def test_missing_package_is_one_config_error_naming_pip_install(monkeypatch):
    from seektrain.models.deepseek.presets import get_preset
    from seektrain.plan.run_plan import RunPlan

    def resolve(*overrides):  # the launcher and every worker ask here, before training
        return RunPlan.resolve(load_config(overrides=list(overrides)), get_preset("tiny-v3"), 1, "cpu")

    monkeypatch.setattr(trackers_mod, "_installed", lambda module: module not in ("wandb", "sqlalchemy"))
    with pytest.raises(ConfigError) as err:
        resolve("metrics.trackers=wandb")
    assert "pip install wandb" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="pip install sqlalchemy alembic"):
        resolve("metrics.trackers=mlflow")
    plan = resolve("metrics.trackers=mlflow", "metrics.mlflow_tracking_uri=http://127.0.0.1:5000")
    assert plan.job.metrics.trackers == ["mlflow"]  # a tracking server needs no SQL packages here


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (
            ["metrics.trackers=tensorboardx"],
            r"metrics\.trackers=\[\"tensorboardx\"\]: item 'tensorboardx': use one of wandb, mlflow",
        ),
        (["metrics.trackers=mlflow,mlflow"], "listed twice"),
        (["metrics.tracker_project="], r"metrics\.tracker_project='': must not be empty"),
    ],
)
def test_bad_tracker_keys(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(overrides=overrides)


def test_a_failing_tracker_is_dropped_and_training_goes_on(caplog):
    class Broken:
        name = "broken"

        def log(self, step, metrics):
            raise ConnectionError("server went away\nsecond line")

        def close(self):
            raise AssertionError("not closed by log_to")

    class Good:
        name = "good"
        logged: ClassVar[list] = []

        def log(self, step, metrics):
            self.logged.append(step)

    good = Good()
    alive = trackers_mod.log_to([Broken(), good], 5, {"loss": 1.0})
    assert alive == [good] and good.logged == [5]
    assert "tracker broken failed at step 5" in caplog.text and "second line" not in caplog.text


def test_flat_params():
    assert trackers_mod.flat_params({"a": {"b": 1, "c": [1, 2]}, "d": "x"}) == {
        "a.b": "1",
        "a.c": "[1, 2]",
        "d": "x",
    }
