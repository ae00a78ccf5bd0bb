"""Small network helpers shared by the head and the replicas."""

from __future__ import annotations

import socket


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def address_host(address: str) -> str:
    """The host of ``[SCHEME://]HOST[:PORT]`` (a Ray address: ``ray://h:10001``, ``h:6379``)."""
    rest = address.split("://", 1)[-1]
    return (rest.rsplit(":", 1)[0] if ":" in rest else rest).strip("[]")


def is_loopback_url(url: str) -> bool:
    """``tcp://HOST:PORT`` on a loopback host."""
    host = url.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    return is_loopback(host)


def listen_tcp(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) TCP socket that a child process could inherit."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def tcp_url(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def split_tcp_url(url: str) -> tuple[str, int]:
    rest = url.removeprefix("tcp://")
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), int(port)


def detect_local_address(master_host: str, master_port: int) -> str:
    """The local IP the kernel would use to reach the master.

    connect() on a UDP socket sends nothing but resolves the route, so getsockname()
    returns the source address of that route: the address the master can reach us on.
    """
    family = socket.AF_INET6 if ":" in master_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((master_host, master_port))
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def connectable_url(url: str, fallback_host: str) -> str:
    """Replace a wildcard bind host (0.0.0.0, *, ::) with a host peers can dial."""
    host, port = split_tcp_url(url)
    if host in ("0.0.0.0", "*", "::", ""):
        return tcp_url(fallback_host, port)
    return url


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct free ports (all held open while choosing, so none repeats)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()
