"""``conformance_suite``: the kit as a pytest test class, one test method per contract check.

    # test_my_connector.py
    from connectors.registry import KVConnectorConfig
    from connectors.testing import conformance_suite

    TestMyConnector = conformance_suite(lambda shared: KVConnectorConfig("my-store", {"root": str(shared)}))

Each test gets pytest's ``tmp_path`` as the backend's root.  Every check runs for every target: one
whose hook the target lacks fails, saying what to add (a skipped check would let the defect it looks
for through).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from connectors.testing import checks, lifecycle
from connectors.testing.runner import run_check
from connectors.testing.target import ConfigFactory, ConformanceTarget

Check = Callable[[ConformanceTarget, Path], None]

# Test method name -> check, in the order a plugin author meets them.
CHECKS: dict[str, Check] = {
    "test_lookups_are_idempotent_and_side_effect_free": checks.check_lookups_are_idempotent,
    "test_hits_are_whole_blocks_and_never_the_last_token": checks.check_whole_block_hits,
    "test_none_is_followed_by_an_answer": checks.check_none_is_followed_by_an_answer,
    "test_loads_reproduce_saved_kv_bit_for_bit": checks.check_loads_reproduce_saved_kv,
    "test_blocks_are_keyed_by_the_whole_namespace": checks.check_blocks_are_keyed_by_the_namespace,
    "test_a_hit_ends_at_the_first_missing_block": checks.check_a_hit_ends_at_the_first_missing_block,
    "test_freed_blocks_are_not_read": checks.check_freed_blocks_are_not_read,
    "test_load_errors_are_reported_not_raised": checks.check_load_errors_are_reported,
    "test_request_finished_exactly_once": lifecycle.check_request_finished_exactly_once,
    "test_no_block_leaked_after_abort": lifecycle.check_no_leak_after_abort,
    "test_no_block_leaked_after_preemption": lifecycle.check_no_leak_after_preemption,
    "test_hold_ends_with_finished_sending": lifecycle.check_hold_ends_with_finished_sending,
    "test_stopped_holds_are_confirmed": lifecycle.check_stopped_holds_are_confirmed,
    "test_nothing_is_kept_for_finished_requests": lifecycle.check_nothing_is_kept_for_finished_requests,
    "test_unreachable_backend_bounded_time_zero_hits": lifecycle.check_unreachable_backend,
}


def conformance_suite(target: ConformanceTarget | ConfigFactory, /, **hooks: Any) -> type:
    """A pytest test class running every check against ``target``.

    ``target`` is a ``ConformanceTarget``, or just its factory (``shared -> KVConnectorConfig``) with the
    other ``ConformanceTarget`` fields as keywords (``unreachable_factory=``, ``corrupt=``, ...).  Assign
    the result to a module-level name starting with ``Test``.
    """
    if isinstance(target, ConformanceTarget):
        if hooks:
            raise TypeError("give hooks either in the ConformanceTarget or as keywords, not both")
    else:
        target = ConformanceTarget(target, **hooks)
    attrs: dict[str, Any] = {"__test__": True, "target": target, "__doc__": "KV connector conformance kit."}
    for name, check in CHECKS.items():
        attrs[name] = _test_method(name, check)
    return type("ConnectorConformance", (), attrs)


def _test_method(name: str, check: Check) -> Callable[[Any, Path], None]:
    def test(self: Any, tmp_path: Path) -> None:
        run_check(check, self.target, tmp_path)

    test.__name__ = test.__qualname__ = name
    test.__doc__ = check.__doc__
    return test
