"""Two "hosts" on one machine: Linux network namespaces joined by a veth pair, reachable only by IP.

Host A is 10.77.0.1, host B 10.77.0.2 by default (a /24 of their own, no DNS, no route anywhere else);
another module passes its own name and subnet. Names carry the test process id, so parallel test runs do
not collide; ``two_hosts()`` removes both namespaces (and
with them the veth pair) whatever happens inside it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from dataclasses import dataclass

SUBNET = "10.77.0"


@dataclass(frozen=True)
class Host:
    netns: str
    ifname: str
    addr: str

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def netns_refusal() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip``, refused by the kernel), or None."""
    probe = f"seektrain-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except FileNotFoundError:
        return "the `ip` command (iproute2) is not installed"
    except subprocess.CalledProcessError as err:
        return f"`ip netns add` was refused: {err.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


@contextlib.contextmanager
def two_hosts(name: str = "st", subnet: str = SUBNET):
    """Yield (host A, host B); both namespaces are deleted on the way out. ``name`` (at most 4
    characters: interface names have 15) and ``subnet`` keep test modules' pairs apart."""
    tag = f"{os.getpid() % 100000}"
    a = Host(f"{name}-a-{tag}", f"{name}a{tag}", f"{subnet}.1")
    b = Host(f"{name}-b-{tag}", f"{name}b{tag}", f"{subnet}.2")
    made: list[str] = []
    try:
        for host in (a, b):
            _ip("netns", "add", host.netns)
            made.append(host.netns)
        _ip("link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname)
        for host in (a, b):
            _ip("link", "set", host.ifname, "netns", host.netns)
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
            _ip("-n", host.netns, "link", "set", host.ifname, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for name in made:  # deleting a namespace deletes the veth end inside it, and so the pair
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", a.ifname], capture_output=True, timeout=30)  # if never moved
