"""The local launcher behind ``pdkv up``: the compose topology as plain processes on this machine
(``cluster``: start, supervise, stop; ``rolling``: planned restarts and ``pdkv up``'s loop; ``topology``:
what to run; ``process``: one child and its ready line).
Only the command line and the benchmarks drive it; no serving package imports it."""

from pdkv.launcher.cluster import Cluster
from pdkv.launcher.process import Process
from pdkv.launcher.rolling import RollingRestarts, run_until_signal
from pdkv.launcher.topology import DEFAULT_STORE, MODES, RestartPolicy, Topology, connector_stack

__all__ = [
    "DEFAULT_STORE",
    "MODES",
    "Cluster",
    "Process",
    "RestartPolicy",
    "RollingRestarts",
    "Topology",
    "connector_stack",
    "run_until_signal",
]
