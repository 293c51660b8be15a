"""Where a process of ours listens and whether it may: listen addresses, loopback, and the refusal of an
open-wide bind without security (nodes, router, store server, p2p block servers)."""

from __future__ import annotations


def is_loopback(host: str) -> bool:
    """A host only this machine reaches: a loopback address (127.0.0.0/8, ::1) or ``localhost``.  A
    name that merely starts with "127." is not one."""
    import ipaddress

    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_address(text: str, what: str = "address") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); port 0 means "pick a free one"."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{what} {text!r} must look like HOST:PORT, e.g. 127.0.0.1:50061")
    return host.strip("[]"), int(port)


def check_endpoint(text: str, what: str = "endpoint") -> str:
    """A ZeroMQ endpoint a process of ours binds: ``tcp://HOST:PORT`` (PORT 0-65535, or ``*``: any) or
    ``ipc://PATH``; ``text`` itself, else ValueError naming ``what`` (ZeroMQ itself would take
    ``tcp://h:99999`` as port 34463, and a bare ``h:PORT`` raise deep in a bind)."""
    scheme, sep, rest = text.partition("://")
    if sep and scheme == "ipc" and rest:
        return text
    if sep and scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        number = port.isascii() and port.isdigit() and int(port) <= 65535
        if colon and host.strip("[]") and (port == "*" or number):
            return text
    raise ValueError(
        f"{what} {text!r} must be a ZeroMQ endpoint: tcp://HOST:PORT (port 0-65535 or *) or ipc://PATH"
    )


def refuse_open_wide_bind(address: str, what: str, secured: bool, insecure: bool, how: str) -> None:
    """A listener on a non-loopback ``address`` (HOST:PORT, or a ZeroMQ tcp:// endpoint) with its
    security off is refused unless ``insecure``.  ipc:// endpoints are files: never "wide"."""
    if address.startswith("ipc://"):
        return
    host = address.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    if secured or insecure or is_loopback(host):
        return
    raise ValueError(
        f"refusing to serve {what} on {address} without {how}: anyone who reaches that address could use "
        "it. Turn security on (pdkv up --secure writes what it needs), bind a loopback address, or pass "
        "--insecure on a network you trust"
    )
