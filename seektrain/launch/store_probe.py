"""Is the rendezvous port free for our store, or held by one that answers? Asked before torchrun starts.

Why: torchrun's c10d store client connects to whatever listens on the endpoint and then waits for the
store's reply with no deadline, so a port that another program holds (a web server, a stale process)
made a launch sit silent until it was killed, whatever ``--rdzv-timeout`` said. The node that is to
host the store checks that it can bind the port; a node that joins (or any node on loopback, where
every node is local) asks what listens there to answer as a store within the timeout. The probe runs
in a daemon thread because the C++ client cannot be interrupted; an abandoned probe ends when the
other program closes the connection, or with the process.
"""

from __future__ import annotations

import errno
import socket
import threading
from datetime import timedelta

_PROBE_KEY = "seektrain/probe"


def port_taken(ip: str, port: int) -> bool:
    """True when another socket already listens on ``ip:port`` (binding it fails with EADDRINUSE)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed store's TIME_WAIT is fine
        try:
            sock.bind((ip, port))
        except OSError as err:
            return err.errno == errno.EADDRINUSE
    return False


def listening(ip: str, port: int) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=2.0):
            return True
    except OSError:
        return False


def store_answers(ip: str, port: int, timeout_s: float) -> bool:
    """True when what listens at ``ip:port`` answers a c10d TCP store request within ``timeout_s``."""
    from torch.distributed import TCPStore

    answered = threading.Event()

    def probe() -> None:
        try:
            store = TCPStore(ip, port, is_master=False, timeout=timedelta(seconds=max(1.0, timeout_s)))
            store.check([_PROBE_KEY])
            answered.set()
        except Exception:  # anything but an answer: the caller reports the port
            pass

    threading.Thread(target=probe, name="seektrain-store-probe", daemon=True).start()
    return answered.wait(timeout_s)
