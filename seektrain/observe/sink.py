"""One ``log(step, metrics)`` call feeds every consumer: a JSONL file, TensorBoard, Prometheus and the
experiment trackers.

* ``run_dir/metrics.jsonl``: one JSON object per call, flushed at once, so a crashed run keeps its
  history and ``tail -f`` works. The summary and the tests read it back.
* ``run_dir/tensorboard/``: every numeric value as a scalar, grouped by ``names.tb_tag``.
* Prometheus: a gauge per key (``names.metric_name``; per-layer keys ``KEY/layerN`` share one gauge
  with a ``layer`` label) in a registry private to this sink, served over
  HTTP so a Prometheus server can scrape a live run and alert on it. A private registry keeps two
  sinks in one process (tests, notebooks) from colliding in prometheus_client's global registry.
* Experiment trackers (``trackers``: ``wandb``, ``mlflow``; ``seektrain.observe.trackers``), on rank 0
  only: ``params`` (the run config) once, then every numeric value under its ``metrics.jsonl`` name.

Files are written by rank 0 only (or the ranks passed ``enabled=True``: their files get a ``.rank<N>``
suffix). The HTTP endpoint runs on rank 0, or on every rank at ``port + local_rank`` when
``all_ranks_serve`` is set, for per-GPU numbers (memory, utilisation) from every process.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from prometheus_client import CollectorRegistry, Gauge, Info, start_http_server

from seektrain.errors import UserError
from seektrain.observe.names import LAYER_KEYS, RUN_INFO, STANDARD_KEYS, metric_name, split_layer_key, tb_tag
from seektrain.observe.trackers import Tracker, close_all, log_to, open_trackers

Number = float | int


def _to_float(value: Any) -> float | None:
    """Python numbers, numpy scalars and one-element tensors become floats; anything else None."""
    if isinstance(value, (int, float)):
        return float(value)
    item = getattr(value, "item", None)
    if callable(item):
        try:
            out = item()
        except (ValueError, RuntimeError):  # more than one element
            return None
        return float(out) if isinstance(out, (int, float)) else None
    return None


def _json_default(value: Any) -> Any:
    number = _to_float(value)
    return number if number is not None else str(value)


class MetricsSink:
    def __init__(
        self,
        run_dir: Path | str,
        rank: int = 0,
        enabled: bool | None = None,
        prometheus_port: int = 0,
        prometheus_host: str = "127.0.0.1",
        all_ranks_serve: bool = False,
        local_rank: int = 0,
        tensorboard: bool = True,
        trackers: list[str] | tuple[str, ...] = (),
        tracker_project: str = "seektrain",
        run_name: str = "",
        mlflow_tracking_uri: str = "",
        params: dict | None = None,
        resume: bool = False,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.enabled = (rank == 0) if enabled is None else enabled
        self._lock = threading.Lock()  # log() may be called from a data thread and the main loop
        self._jsonl: TextIO | None = None
        self._tb: Any = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.registry: CollectorRegistry | None = None
        self._gauges: dict[str, Gauge] = {}
        self._info: Info | None = None
        self._info_labels: dict[str, str] = {}
        self._trackers: list[Tracker] = []
        self.port = 0

        # Serve first: a bad port then fails before any file is opened.
        if prometheus_port != 0 and (rank == 0 or all_ranks_serve):
            self._serve(prometheus_port + (local_rank if all_ranks_serve else 0), prometheus_host)
            self.set_run_info(run=self.run_dir.name, rank=str(rank))
        if self.enabled or (rank == 0 and trackers):
            try:
                if self.enabled:
                    self._open_files(rank, tensorboard)
                if rank == 0 and trackers:
                    self._trackers = open_trackers(
                        trackers,
                        self.run_dir,
                        tracker_project,
                        run_name or self.run_dir.name,
                        params,
                        mlflow_tracking_uri,
                        resume,
                    )
            except BaseException:
                self.close()
                raise

    def _open_files(self, rank: int, tensorboard: bool) -> None:
        suffix = "" if rank == 0 else f".rank{rank}"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.run_dir / f"metrics{suffix}.jsonl", "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb_dir = self.run_dir / "tensorboard" / (f"rank{rank}" if rank else "")
            self._tb = SummaryWriter(log_dir=str(tb_dir), flush_secs=10)

    # ------------------------------------------------------------------------------ prometheus
    def _serve(self, port: int, host: str) -> None:
        fix = (
            "set metrics.prometheus_port to a free port in 1024-65535 (with metrics.all_ranks each "
            "rank uses port + local_rank), or to 0 to turn the endpoint off"
        )
        if not 0 < port < 65536:
            raise UserError(f"metrics.prometheus_port: port {port} is out of range; {fix}")
        self.registry = CollectorRegistry(auto_describe=True)
        self._gauge("step")
        try:
            started = start_http_server(port, addr=host, registry=self.registry)
        except (OSError, OverflowError) as err:  # EADDRINUSE, EACCES, bad address
            self.registry = None
            raise UserError(
                f"metrics.prometheus_port: cannot serve on {host}:{port} "
                f"({err.strerror if isinstance(err, OSError) and err.strerror else err}); "
                f"{fix}"
            ) from None
        # prometheus_client >= 0.17 returns (server, thread); older versions return None.
        if isinstance(started, tuple):
            self._server, self._thread = started
        self.port = port

    def _gauge(self, key: str) -> Gauge | None:
        """The gauge of ``key``; a per-layer key (``names.LAYER_KEYS``) is its gauge's ``layer`` child."""
        if self.registry is None:
            return None
        per_layer = split_layer_key(key)
        base = per_layer[0] if per_layer else key
        name = metric_name(base)
        gauge = self._gauges.get(name)
        if gauge is None:
            doc = LAYER_KEYS.get(base) or STANDARD_KEYS.get(key, f"Logged metric {key!r}.")
            gauge = Gauge(name, doc, ["layer"] if per_layer else (), registry=self.registry)
            self._gauges[name] = gauge
        return gauge.labels(layer=per_layer[1]) if per_layer else gauge

    def set_run_info(self, **labels: Any) -> None:
        """Labels of ``seektrain_run_info`` (e.g. run, model, world_size): merged with earlier ones."""
        if self.registry is None:
            return
        with self._lock:
            if self._info is None:
                self._info = Info(RUN_INFO, "Static facts of this training run.", registry=self.registry)
            self._info_labels.update({k: str(v) for k, v in labels.items()})
            self._info.info(self._info_labels)

    # ------------------------------------------------------------------------------ logging
    def log(self, step: int, metrics: dict[str, Number], wall_time: float | None = None) -> None:
        """Record one set of metrics at ``step``. Non-numeric values go to the JSONL file only.
        ``wall_time``: when the step happened (``time.time()``), if it is logged later; default now."""
        wall_time = time.time() if wall_time is None else wall_time
        with self._lock:
            if self._jsonl is not None:
                record = {"step": step, "time": wall_time, **metrics}
                record["step"] = step
                self._jsonl.write(json.dumps(record, default=_json_default) + "\n")
                self._jsonl.flush()
            numeric = {k: f for k, v in metrics.items() if k != "step" and (f := _to_float(v)) is not None}
            if self._tb is not None:
                for key, value in numeric.items():
                    self._tb.add_scalar(tb_tag(key), value, step, walltime=wall_time)
            if self.registry is not None:
                self._gauge("step").set(step)
                for key, value in numeric.items():
                    self._gauge(key).set(value)
            if self._trackers:
                self._trackers = log_to(self._trackers, step, numeric)

    def flush(self) -> None:
        with self._lock:
            if self._jsonl is not None:
                self._jsonl.flush()
            if self._tb is not None:
                self._tb.flush()

    def close(self) -> None:
        """Stop the HTTP server and close the files; safe to call twice."""
        with self._lock:
            if self._server is not None:
                self._server.shutdown()
                self._server.server_close()
                if self._thread is not None:
                    self._thread.join(timeout=5)
                self._server = self._thread = None
            if self._tb is not None:
                self._tb.close()
                self._tb = None
            if self._jsonl is not None:
                self._jsonl.close()
                self._jsonl = None
            trackers, self._trackers = self._trackers, []
            close_all(trackers)

    def __enter__(self) -> MetricsSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
