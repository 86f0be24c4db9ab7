"""Network interfaces, InfiniBand ports and free TCP ports, read from /sys and by binding.

What is a blocker: ``NCCL_SOCKET_IFNAME``/``GLOO_SOCKET_IFNAME`` naming an interface this host does not
have (the process group cannot start), and a port the user asked for that is taken. A down InfiniBand
port is a warning: NCCL falls back to TCP, slower but working.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from seektrain.doctor.check_report import Check
from seektrain.errors import UserError

SYS_NET = Path("/sys/class/net")
SYS_IB = Path("/sys/class/infiniband")
DEFAULT_PORT = 29500  # torchrun's default MASTER_PORT / rendezvous port


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:  # e.g. speed of a down or virtual interface: EINVAL
        return ""


def interfaces() -> dict[str, dict]:
    """Every interface but loopback: state, MTU and speed (Mb/s, where the driver reports one)."""
    if not SYS_NET.is_dir():
        return {}
    found = {}
    for dev in sorted(SYS_NET.iterdir()):
        if dev.name == "lo":
            continue
        found[dev.name] = {
            "state": _read(dev / "operstate"),
            "mtu": _read(dev / "mtu"),
            "speed_mbps": _read(dev / "speed"),
        }
    return found


def interface_checks() -> list[Check]:
    found = interfaces()
    if not found:
        return [Check("warn", "network", "no network interface besides loopback: single-node only")]
    parts = []
    for name, info in found.items():
        speed = info["speed_mbps"]
        speed = f", {int(speed) / 1000:g} Gb/s" if speed.lstrip("-").isdigit() and int(speed) > 0 else ""
        parts.append(f"{name} ({info['state']}, mtu {info['mtu']}{speed})")
    checks = [
        Check(
            "ok" if any(i["state"] == "up" for i in found.values()) else "warn",
            "network",
            ", ".join(parts) + f"; hostname {socket.gethostname()}",
        )
    ]
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        checks += _ifname_check(var, os.environ.get(var, ""), found)
    return checks


def _ifname_check(var: str, value: str, found: dict) -> list[Check]:
    """NCCL's syntax: a comma list of name prefixes; ``^`` excludes, ``=`` means exact names."""
    if not value or value.startswith("^"):
        return []
    exact = value.startswith("=")
    names = [n for n in value.lstrip("=").split(",") if n]
    known = list(found) + ["lo"]
    if any((n in known) if exact else any(k.startswith(n) for k in known) for n in names):
        return []
    return [
        Check(
            "blocker",
            f"env {var}",
            f"{var}={value} matches no interface here ({', '.join(known)}): the "
            "process group cannot start; fix or unset it",
        )
    ]


def infiniband_checks() -> list[Check]:
    if not SYS_IB.is_dir():
        return [
            Check(
                "info",
                "infiniband",
                "no InfiniBand/RoCE devices (/sys/class/infiniband): inter-node "
                "traffic goes over TCP sockets",
            )
        ]
    checks = []
    for dev in sorted(SYS_IB.iterdir()):
        for port in sorted((dev / "ports").iterdir()) if (dev / "ports").is_dir() else []:
            state, rate = _read(port / "state"), _read(port / "rate")
            layer = _read(port / "link_layer")
            active = "ACTIVE" in state
            checks.append(
                Check(
                    "ok" if active else "warn",
                    f"ib {dev.name}/{port.name}",
                    f"{state or 'unknown state'}, {rate or 'unknown rate'}, {layer or 'link layer ?'}"
                    + ("" if active else ": this port is down, NCCL will not use it"),
                )
            )
    return checks or [Check("warn", "infiniband", f"{SYS_IB} exists but lists no ports")]


def parse_ports(text: str) -> list[int]:
    """``29500`` or ``29500-29510`` (inclusive); a ValueError names the mistake."""
    try:
        low, _, high = text.partition("-")
        first, last = int(low), int(high or low)
    except ValueError:
        raise UserError(f"--ports {text!r}: give a port or a range, e.g. 29500 or 29500-29510") from None
    if not 1 <= first <= last <= 65535:  # checked before the range is built: 1-10**12 is no MemoryError
        raise UserError(f"--ports {text!r}: ports are 1-65535, low-high")
    return list(range(first, last + 1))


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def port_checks(ports: list[int] | None) -> list[Check]:
    """Ports given with ``--ports`` must be free (blocker); otherwise torchrun's default 29500 (or
    MASTER_PORT) is checked and a busy one is only a warning (single-node launches pick a free port)."""
    asked = ports is not None
    if not asked:
        master = os.environ.get("MASTER_PORT", "")
        ports = [int(master)] if master.isdigit() else [DEFAULT_PORT]
    busy = [p for p in ports if not port_is_free(p)]
    span = f"{ports[0]}-{ports[-1]}" if len(ports) > 1 else str(ports[0])
    if not busy:
        return [Check("ok", "ports", f"{span} free")]
    return [
        Check(
            "blocker" if asked else "warn",
            "ports",
            f"in use: {', '.join(map(str, busy[:10]))}{' ...' if len(busy) > 10 else ''} of {span}: a "
            "rendezvous or MASTER_PORT there fails with 'address already in use'; pick another port or end "
            "the process holding it (ss -ltnp)",
        )
    ]
