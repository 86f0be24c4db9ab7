"""Where this node stands on the network: the rendezvous endpoint, the address to advertise, the interface.

Why: torchrun decides who hosts the c10d store by comparing the endpoint with the machine's *host name*,
and tells the workers to meet at the host name too. On hosts that reach each other only by IP (no DNS,
or a name that resolves to an unreachable address) nobody hosts the store, or the workers hang. We
decide both from addresses instead: the address this node would use to reach the endpoint (the source
address the kernel picks for a UDP "connection" to it; no packet is sent) is the one to advertise, and
its interface is the one gloo and NCCL should bind to.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from seektrain.errors import UserError


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_endpoint(text: str) -> Endpoint:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6), or a ValueError of one line."""
    host, sep, port = text.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(
            f"--rdzv-endpoint {text!r} is not HOST:PORT; give the first node's address and a free "
            "port, the same on every node, e.g. --rdzv-endpoint 10.0.0.1:29500"
        )
    return Endpoint(host, int(port))


def resolve_host(endpoint: Endpoint) -> str:
    """The endpoint's IP address, or a ValueError of one line when its host name does not resolve."""
    try:
        return socket.getaddrinfo(endpoint.host, endpoint.port, proto=socket.IPPROTO_TCP)[0][4][0]
    except socket.gaierror:
        raise UserError(
            f"--rdzv-endpoint {endpoint}: host {endpoint.host!r} does not resolve on this node; "
            "use the first node's IP address (or a name every node resolves)"
        ) from None


def route_source_address(ip: str, port: int) -> str:
    """The local address packets to ``ip`` leave from (connect() on UDP only asks the routing table)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, port))
        except OSError as err:
            raise UserError(
                f"--rdzv-endpoint {ip}:{port}: no route from this node ({err.strerror}); check the "
                "network, or pass --local-addr with this node's address"
            ) from None
        return s.getsockname()[0]


def interface_addresses() -> dict[str, list[str]]:
    """Interface name -> its addresses: IPv4 by ioctl(SIOCGIFADDR), IPv6 from /proc (no ``ip`` binary needed).
    SIOCGIFADDR gives one IPv4 address per interface (the primary), which is the one routes leave from."""
    found = _ipv4_by_ioctl()
    try:
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            hexaddr, *_, name = line.split()
            addr = str(ipaddress.IPv6Address(bytes.fromhex(hexaddr)))
            found.setdefault(name, []).append(addr)
    except OSError:
        pass
    return found


def _ipv4_by_ioctl() -> dict[str, list[str]]:
    import fcntl
    import struct

    SIOCGIFADDR = 0x8915
    out: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            out.setdefault(name, []).append(socket.inet_ntoa(packed[20:24]))
    return out


def interface_of(addr: str) -> str | None:
    """The name of the interface that holds ``addr``, or None when no local interface does."""
    want = ipaddress.ip_address(addr)
    for name, addrs in interface_addresses().items():
        if any(ipaddress.ip_address(a.split("%")[0]) == want for a in addrs):
            return name
    return None


def _names_loopback(host: str) -> bool:
    """True when the user asked for loopback on purpose (all nodes on one machine): an IP or localhost."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name (e.g. Debian's /etc/hosts maps the own name to 127.0.1.1)


def is_local_address(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_loopback or interface_of(ip) is not None


@dataclass(frozen=True)
class NodeNetwork:
    """What one node of a multi-node launch uses: whether it hosts the store, what it advertises, which
    interface the collectives bind to (``None``: leave the backend's own choice)."""

    endpoint: Endpoint
    endpoint_ip: str
    hosts_store: bool
    local_addr: str
    ifname: str | None


def node_network(endpoint_text: str, local_addr: str = "", ifname: str = "") -> NodeNetwork:
    """Decide everything above from the endpoint; ``local_addr`` / ``ifname`` override the detection."""
    endpoint = parse_endpoint(endpoint_text)
    ip = resolve_host(endpoint)
    if ipaddress.ip_address(ip).is_loopback and not _names_loopback(endpoint.host):
        raise UserError(
            f"--rdzv-endpoint {endpoint}: {endpoint.host!r} resolves to {ip} (loopback) on this node, "
            "which the other nodes cannot reach; give node 0's network IP address instead"
        )
    hosts = is_local_address(ip)
    if local_addr:
        try:
            ipaddress.ip_address(local_addr)
        except ValueError:
            raise UserError(
                f"--local-addr {local_addr!r} is not an IP address; give this node's address "
                "that the other nodes reach"
            ) from None
        if not is_local_address(local_addr):
            raise UserError(
                f"--local-addr {local_addr} is not an address of this node; pick one from "
                "`ip -o addr` that the other nodes reach"
            )
    else:
        local_addr = ip if hosts else route_source_address(ip, endpoint.port)
    if not ifname:
        ifname = interface_of(local_addr) or ""
    return NodeNetwork(endpoint, ip, hosts, local_addr, ifname or None)


def wait_for_endpoint(ip: str, port: int, timeout_s: float) -> bool:
    """True once something accepts TCP connections at ``ip:port`` (the store host is up), False when
    nothing did within ``timeout_s``. Checked here, in Python, so an unreachable endpoint ends in our one
    line rather than in the C++ store client's stack dump."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            with socket.create_connection((ip, port), timeout=min(2.0, left)):
                return True
        except OSError:
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
