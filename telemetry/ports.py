"""The default ``/metrics`` port of each kind of pdkv process: one table that the command line's defaults,
``pdkv up``, ``deploy/docker-compose.yml``, ``deploy/kubernetes/`` and the Prometheus scrape configs in
``deploy/prometheus/`` all follow (``tests/deploy`` and ``tests/serving/test_deploy.py`` check it)::

    router      9400        pdkv serve-router
    kvstore     9401        pdkv kvstore serve
    prefill     9410 + i    pdkv serve-prefill
    decode      9430 + i    pdkv serve-decode
    colocated   9450 + i    pdkv serve-colocated

A container or a pod runs one process, so compose and Kubernetes use each kind's base port.  ``pdkv up``
runs several nodes of one kind on one host: node ``i`` of a kind (``prefill-0``, ``prefill-1``, ...) gets
base + i, for up to ``NODES_PER_KIND`` nodes of a kind, so every process of a cluster has its own port and
the same one at every start (a scrape config written once keeps working).
"""

from __future__ import annotations

METRICS_PORTS: dict[str, int] = {
    "router": 9400,
    "kvstore": 9401,
    "prefill": 9410,
    "decode": 9430,
    "colocated": 9450,
}
NODE_KINDS = ("prefill", "decode", "colocated")
# Room for this many nodes of a kind on one host before their ports would run into the next kind's.
NODES_PER_KIND = 20


def metrics_port(kind: str, index: int = 0) -> int:
    """The default metrics port of process ``index`` (from 0) of ``kind`` on one host."""
    if kind not in METRICS_PORTS:
        raise ValueError(f"no metrics port for {kind!r}; kinds: {', '.join(METRICS_PORTS)}")
    most = NODES_PER_KIND if kind in NODE_KINDS else 1
    if not 0 <= index < most:
        raise ValueError(
            f"{kind} process {index} has no default metrics port: one host has room for {most} "
            f"(ports {METRICS_PORTS[kind]}..{METRICS_PORTS[kind] + most - 1})"
        )
    return METRICS_PORTS[kind] + index
