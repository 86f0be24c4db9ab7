"""Experiment trackers (Weights & Biases, MLflow) fed by the metrics sink, optional and on rank 0 only.

Neither package is a dependency: ``check_installed`` lets ``RunPlan.resolve`` refuse a tracker that is
not installed with one line before any worker starts, and the packages are imported only when a
tracker is opened. A tracker gets the run config once as parameters and then every step's numeric
metrics under the names of ``metrics.jsonl``.

The tracker runs of a run folder are recorded in ``run_dir/trackers.json``; a trainer that resumed
from a checkpoint passes ``resume=True`` and the same W&B run / MLflow run goes on instead of a new one
starting at every restart. A tracker that fails in the middle of a run is reported once on the log and
switched off: losing a dashboard must not stop a training job.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import socket
import time
from pathlib import Path
from typing import Any, Protocol

from seektrain.config.loader import ConfigError
from seektrain.config.schema import MetricsSection
from seektrain.errors import UserError

log = logging.getLogger(__name__)

TRACKERS = ("wandb", "mlflow")
IDS_FILE = "trackers.json"


class Tracker(Protocol):
    name: str

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def missing_packages(trackers: list[str] | tuple[str, ...], mlflow_tracking_uri: str = "") -> list[str]:
    """``pip install`` names of what the requested trackers need and this environment lacks."""
    missing = []
    if "wandb" in trackers and not _installed("wandb"):
        missing.append("wandb")
    if "mlflow" in trackers:
        if not _installed("mlflow"):
            missing.append("mlflow")
        elif _uses_sqlite(mlflow_tracking_uri) and not (_installed("sqlalchemy") and _installed("alembic")):
            missing += ["sqlalchemy", "alembic"]  # mlflow-skinny lacks the SQL store the default URI uses
    return missing


def check_installed(metrics: MetricsSection) -> None:
    """A ConfigError of one line when a tracker in ``metrics.trackers`` lacks its package; asked by
    ``RunPlan.resolve``, in the launcher before any worker starts and in every worker."""
    missing = missing_packages(metrics.trackers, metrics.mlflow_tracking_uri)
    if missing:
        raise ConfigError(
            f"metrics.trackers={metrics.trackers} needs packages that are not installed; "
            f"pip install {' '.join(missing)} (or drop the tracker)"
        )


def _uses_sqlite(uri: str) -> bool:
    return not uri or uri.startswith("sqlite:")


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"train": {"steps": 2}}`` -> ``{"train.steps": "2"}``: the form MLflow params take."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_params(value, name + "."))
        else:
            out[name] = json.dumps(value) if isinstance(value, list) else str(value)
    return out


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class _RunIds:
    """The ids of this run folder's tracker runs, kept in ``trackers.json`` to continue them on resume."""

    def __init__(self, run_dir: Path, resume: bool) -> None:
        self.path = run_dir / IDS_FILE
        self.ids: dict[str, str] = {}
        if resume and self.path.is_file():
            try:
                self.ids = json.loads(self.path.read_text())
            except (OSError, ValueError):
                log.warning("%s is unreadable; trackers start new runs", self.path)

    def get(self, tracker: str) -> str | None:
        return self.ids.get(tracker)

    def record(self, tracker: str, run_id: str) -> None:
        self.ids[tracker] = run_id
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.ids, indent=1) + "\n")


class WandbTracker:
    """A W&B run whose files live under ``run_dir/wandb`` (``WANDB_MODE=offline`` keeps them there)."""

    name = "wandb"

    def __init__(self, run_dir: Path, project: str, run_name: str, params: dict, ids: _RunIds) -> None:
        import wandb

        try:  # id=None starts a new run; a recorded id continues that run
            self.run = wandb.init(
                project=project,
                name=run_name,
                dir=str(run_dir),
                config=params,
                id=ids.get("wandb"),
                resume="allow",
                reinit="create_new",
            )
        except Exception as err:  # wandb raises its own types (no API key, no network)
            raise UserError(
                f"metrics.trackers: wandb could not start a run ({_first_line(err)}); run "
                "`wandb login`, or set WANDB_MODE=offline and `wandb sync` later"
            ) from None
        ids.record("wandb", self.run.id)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


PROBE_TIMEOUT_S = 5.0


def _probe_server(uri: str) -> None:
    """An http(s) tracking URI must accept a connection within seconds: MLflow's client retries a dead
    server with backoff for minutes (317 s measured) before it says anything."""
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as err:
        raise UserError(
            f"metrics.mlflow_tracking_uri={uri!r}: nothing answers at {parts.hostname}:{port} "
            f"({err.strerror or err}); start the tracking server, fix the URI, or leave it empty for a "
            "local store"
        ) from None


class MlflowTracker:
    """An MLflow run in experiment ``project``; the default store is ``run_dir/mlflow.db`` (SQLite)."""

    name = "mlflow"

    def __init__(
        self, run_dir: Path, project: str, run_name: str, params: dict, ids: _RunIds, tracking_uri: str
    ) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.uri = tracking_uri or f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
        _probe_server(self.uri)
        try:
            self.client = MlflowClient(tracking_uri=self.uri)
            self.run_id = self._continue(ids.get("mlflow"))
            if self.run_id is None:
                experiment = self.client.get_experiment_by_name(project)
                experiment_id = (
                    experiment.experiment_id
                    if experiment is not None
                    else self.client.create_experiment(project)
                )
                self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
                items = [Param(k, v) for k, v in flat_params(params).items()]
                for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
                    self.client.log_batch(self.run_id, params=items[i : i + 100])
        except Exception as err:  # MlflowException, SQL and HTTP errors
            raise UserError(
                f"metrics.mlflow_tracking_uri={self.uri!r}: MLflow could not start a run "
                f"({_first_line(err)}); fix the URI or leave it empty for a local store"
            ) from None
        ids.record("mlflow", self.run_id)

    def _continue(self, run_id: str | None) -> str | None:
        if run_id is None:
            return None
        try:
            self.client.get_run(run_id)
        except Exception:  # not in this store (a new URI): start a new run
            return None
        self.client.update_run(run_id, status="RUNNING")
        return run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def open_trackers(
    names: list[str] | tuple[str, ...],
    run_dir: Path,
    project: str,
    run_name: str,
    params: dict | None,
    mlflow_tracking_uri: str = "",
    resume: bool = False,
) -> list[Tracker]:
    """Open the requested trackers (a ValueError with one line when one cannot start)."""
    missing = missing_packages(names, mlflow_tracking_uri)
    if missing:
        raise UserError(
            f"metrics.trackers={list(names)} needs packages that are not installed; "
            f"pip install {' '.join(missing)} (or drop the tracker)"
        )
    ids = _RunIds(run_dir, resume)
    opened: list[Tracker] = []
    try:
        for name in names:
            if name == "wandb":
                opened.append(WandbTracker(run_dir, project, run_name, params or {}, ids))
            elif name == "mlflow":
                opened.append(
                    MlflowTracker(run_dir, project, run_name, params or {}, ids, mlflow_tracking_uri)
                )
            else:
                raise UserError(f"metrics.trackers: unknown tracker {name!r}; use {' or '.join(TRACKERS)}")
    except BaseException:
        close_all(opened)
        raise
    return opened


def log_to(trackers: list[Tracker], step: int, metrics: dict[str, float]) -> list[Tracker]:
    """Log to each tracker; returns the ones still working (a failing one is reported and dropped)."""
    alive = []
    for tracker in trackers:
        try:
            tracker.log(step, metrics)
        except Exception as err:
            log.warning(
                "tracker %s failed at step %d and is switched off: %s", tracker.name, step, _first_line(err)
            )
            continue
        alive.append(tracker)
    return alive


def close_all(trackers: list[Tracker]) -> None:
    """Finish every tracker run; one that fails to finish is reported, the others still close."""
    for tracker in trackers:
        try:
            tracker.close()
        except Exception as err:
            log.warning("tracker %s failed to finish its run: %s", tracker.name, _first_line(err))
