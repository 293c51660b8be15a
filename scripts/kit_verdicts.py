"""Run the connector conformance kit N times over the built-in connectors, the example plugin and the
broken variants issue #31 names, and print each target's verdicts: a kit whose verdict depends on timing
is not a kit.

    .venv/bin/python scripts/kit_verdicts.py --runs 10 [--json PATH]

A correct target must pass every check in every run; a broken variant must fail in every run, with its
rule among the failures, each run within 60 s.  (The offload connector's Redis and remote tiers need
servers: this script starts a redis-server of its own on a free port, and a store server per check in
this process, as the test suite does.)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connectors.registry import KVConnectorConfig
from connectors.testing import CHECKS, ConformanceError, ConformanceTarget, run_check
from connectors.testing import items as kit


def _targets() -> dict[str, tuple[ConformanceTarget, str | None]]:
    """name -> (target, the rule it must break; None: it must pass)."""
    from tests.connectors import test_conformance_offload as off
    from tests.connectors.test_conformance_builtins import corrupt_block_files, multi, shared_dir, unreachable
    from tests.connectors.test_conformance_offload import (
        corrupt_cpu_tier,
        corrupt_disk_tier,
        cpu_spec,
        offload,
    )
    from tests.connectors.test_example_plugin import damage

    def sd(shared: Path) -> KVConnectorConfig:
        return KVConnectorConfig("shared-dir", {"path": str(shared / "kv")})

    def sd_dead(shared: Path) -> KVConnectorConfig:
        return KVConnectorConfig("shared-dir", {"path": str(unreachable(shared))})

    def variant(name: str) -> Callable[[Path], KVConnectorConfig]:
        return lambda shared: KVConnectorConfig(f"tests.kit_connectors:{name}", {"path": str(shared / "kv")})

    def example(shared: Path) -> KVConnectorConfig:
        return KVConnectorConfig("example-memory", {"store": str(shared)})

    def null(shared: Path) -> KVConnectorConfig:
        return KVConnectorConfig("null")

    def p2p(shared: Path) -> KVConnectorConfig:
        return KVConnectorConfig("p2p")

    def cpu(shared: Path) -> KVConnectorConfig:
        return offload(cpu_spec(shared))

    def disk(shared: Path) -> KVConnectorConfig:
        return offload(f"disk:{shared / 'kv'}:64MiB")

    def disk_dead(shared: Path) -> KVConnectorConfig:
        return offload(f"disk:{unreachable(shared)}:64MiB")

    def two_dirs(shared: Path) -> KVConnectorConfig:
        return multi(shared_dir(shared / "a"), shared_dir(shared / "b"))

    def two_dead(shared: Path) -> KVConnectorConfig:
        return multi(shared_dir(unreachable(shared, "a")), shared_dir(unreachable(shared, "b")))

    def redis(shared: Path) -> KVConnectorConfig:
        return offload(off.redis_spec(shared))

    def redis_dead(shared: Path) -> KVConnectorConfig:
        return offload(off.redis_spec(shared, off.nowhere()))

    def remote(shared: Path) -> KVConnectorConfig:
        return offload(f"remote:{off.store_server(shared)}?timeout_ms=500")

    def remote_dead(shared: Path) -> KVConnectorConfig:
        return offload(f"remote:tcp://{off.nowhere()}?timeout_ms=300")

    def corrupt_remote(shared: Path) -> None:
        corrupt_disk_tier(shared, "srv")

    hooks = {"corrupt": corrupt_block_files, "unreachable_factory": sd_dead}
    return {
        "shared-dir": (ConformanceTarget(sd, **hooks), None),
        "multi(shared-dir, shared-dir)": (
            ConformanceTarget(two_dirs, corrupt=corrupt_block_files, unreachable_factory=two_dead),
            None,
        ),
        "null": (ConformanceTarget(null, provides_hits=False, unreachable_factory=null), None),
        "p2p": (ConformanceTarget(p2p, provides_hits=False, unreachable_factory=p2p), None),
        "offload cpu": (ConformanceTarget(cpu, corrupt=corrupt_cpu_tier, unreachable_factory=cpu), None),
        "offload disk": (
            ConformanceTarget(disk, corrupt=corrupt_disk_tier, unreachable_factory=disk_dead),
            None,
        ),
        "offload redis": (
            ConformanceTarget(redis, corrupt=off.corrupt_redis_values, unreachable_factory=redis_dead),
            None,
        ),
        "offload remote (store server)": (
            ConformanceTarget(remote, corrupt=corrupt_remote, unreachable_factory=remote_dead),
            None,
        ),
        "example-memory (plugin)": (
            ConformanceTarget(example, corrupt=damage, unreachable_factory=example),
            None,
        ),
        "HoleBlindConnector (no evict)": (
            ConformanceTarget(variant("HoleBlindConnector"), **hooks),
            kit.HOLES,
        ),
        "BackgroundSaveConnector (50 ms, no hold)": (
            ConformanceTarget(variant("BackgroundSaveConnector"), **hooks),
            kit.FREED,
        ),
        "DtypelessKeyConnector": (
            ConformanceTarget(variant("DtypelessKeyConnector"), **hooks),
            kit.NAMESPACE,
        ),
    }


def run_kit(target: ConformanceTarget) -> tuple[set[str], float]:
    """Every check once; the contract items that failed, and the seconds the kit took."""
    failed: set[str] = set()
    started = time.monotonic()
    for check in CHECKS.values():
        # ignore_cleanup_errors: a broken connector may still write there from a thread of its own
        with tempfile.TemporaryDirectory(prefix="pdkv-kit-verdicts-", ignore_cleanup_errors=True) as shared:
            try:
                run_check(check, target, Path(shared))
            except ConformanceError as exc:
                failed.add(exc.item)
            except Exception as exc:  # a kit bug or a hook's: counted, never a crash of the whole run
                failed.add(f"raised {type(exc).__name__}: {exc}"[:200])
    return failed, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--only", default="", help="run only the targets whose name contains this")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the connectors' warnings about the kit's damage are expected
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    report: dict[str, dict[str, object]] = {}
    from tests.connectors import test_conformance_offload as off
    from tests.kvstore.kvtest import RedisProcess, free_port

    redis = RedisProcess(free_port())
    redis.start()
    off.SERVERS["redis"] = f"127.0.0.1:{redis.port}"
    try:
        ok = _run(args, report)
    finally:
        for server, stop, thread in off.STORE_SERVERS.values():
            stop.set()
            thread.join()
            server.close()
            server.store.close()
        redis.stop()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


def _run(args: argparse.Namespace, report: dict[str, dict[str, object]]) -> bool:
    ok = True
    for name, (target, rule) in _targets().items():
        if args.only not in name:
            continue
        good, slowest, seen = 0, 0.0, []
        for _ in range(args.runs):
            failed, seconds = run_kit(target)
            slowest = max(slowest, seconds)
            seen.append(sorted(failed))
            good += (not failed) if rule is None else (rule in failed and seconds < 60)
        verdict = f"{good}/{args.runs} " + ("passed" if rule is None else f"failed [{rule}]")
        print(f"{name:44s} {verdict:60s} slowest run {slowest:5.1f}s", flush=True)
        report[name] = {"expected": rule or "pass", "as_expected": good, "runs": args.runs, "failures": seen}
        ok = ok and good == args.runs
    return ok


if __name__ == "__main__":
    raise SystemExit(main())
