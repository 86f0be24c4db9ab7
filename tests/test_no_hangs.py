"""No wait without an end: a rendezvous port another program holds and an MLflow server that is not there
each end within seconds with one line (left to their libraries' defaults they wait 120 s and 317 s).
The absurd GPU count (``plan --gpus 1000000000``) and ``--rdzv-timeout nan|inf|-3`` are rows of
tests/test_bad_input.py. The bounds are generous for a loaded 2-core machine and far below those waits.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from seektrain.cli.main import main
from seektrain.errors import UserError
from seektrain.launch.store_probe import port_taken

BOUND_S = 30


@pytest.fixture
def foreign_listener():
    """A program that accepts connections on a loopback port and never says a word (a stale process)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    for conn in held:  # the abandoned store probe sees the connection close and ends
        conn.close()
    server.close()


def test_rendezvous_port_held_by_another_program_ends_in_seconds(foreign_listener, tmp_path, capsys):
    port = foreign_listener
    assert port_taken("127.0.0.1", port)  # what the node that hosts the store checks first
    saved = dict(os.environ)
    start = time.monotonic()
    try:
        code = main(
            [
                "train",
                "--nnodes",
                "2",
                "--node-rank",
                "0",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-timeout",
                "5",
                "--set",
                f"run.dir={tmp_path / 'run'}",
            ]
        )
    finally:
        os.environ.clear()
        os.environ.update(saved)  # the launcher exports its choices to the workers it would start
    elapsed = time.monotonic() - start
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert code == 1 and elapsed < BOUND_S, (code, elapsed)
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0] and "--rdzv-endpoint" in errors[0], errors


def test_port_taken_only_while_something_listens():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        assert port_taken("127.0.0.1", port)
    assert not port_taken("127.0.0.1", port)


def test_unreachable_mlflow_server_ends_in_seconds(tmp_path):
    from seektrain.observe.trackers import open_trackers

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    with pytest.raises(UserError) as err:
        open_trackers(["mlflow"], tmp_path, "proj", "run", {}, uri)
    assert time.monotonic() - start < BOUND_S
    assert (
        "\n" not in str(err.value)
        and "metrics.mlflow_tracking_uri" in str(err.value)
        and uri in str(err.value)
    )
