"""The connector conformance kit: the KVConnector contract (``connectors/base.py``) as runnable checks.

A plugin author runs it with one line in a pytest module::

    from connectors.testing import conformance_suite
    TestMyConnector = conformance_suite(lambda shared: KVConnectorConfig("my-store", {"root": str(shared)}))

``factory(shared)`` returns the config of the connector pointed at a backend rooted at ``shared`` (an empty
directory per check; two engines built from the same ``shared`` share the backend).  Two hooks are
required -- ``unreachable_factory(shared)`` (a backend that cannot be reached) and ``corrupt(shared)``
(damage every stored block) -- and a check whose hook is missing fails, saying what to add; see
``ConformanceTarget``.  The checks drive real engines on a tiny random
model; each can also be called directly (``CHECKS``) and raises ``ConformanceError`` naming the contract
item it found broken.
"""

from connectors.testing.checks import (
    check_a_hit_ends_at_the_first_missing_block,
    check_blocks_are_keyed_by_the_namespace,
    check_freed_blocks_are_not_read,
    check_load_errors_are_reported,
    check_loads_reproduce_saved_kv,
    check_lookups_are_idempotent,
    check_none_is_followed_by_an_answer,
    check_whole_block_hits,
)
from connectors.testing.harness import kit_model_dir
from connectors.testing.items import ConformanceError
from connectors.testing.lifecycle import (
    check_hold_ends_with_finished_sending,
    check_no_leak_after_abort,
    check_no_leak_after_preemption,
    check_nothing_is_kept_for_finished_requests,
    check_request_finished_exactly_once,
    check_stopped_holds_are_confirmed,
    check_unreachable_backend,
)
from connectors.testing.runner import run_check
from connectors.testing.suite import CHECKS, conformance_suite
from connectors.testing.target import ConfigFactory, ConformanceTarget

__all__ = [
    "CHECKS",
    "ConfigFactory",
    "ConformanceError",
    "ConformanceTarget",
    "check_a_hit_ends_at_the_first_missing_block",
    "check_blocks_are_keyed_by_the_namespace",
    "check_freed_blocks_are_not_read",
    "check_hold_ends_with_finished_sending",
    "check_load_errors_are_reported",
    "check_loads_reproduce_saved_kv",
    "check_lookups_are_idempotent",
    "check_no_leak_after_abort",
    "check_no_leak_after_preemption",
    "check_none_is_followed_by_an_answer",
    "check_nothing_is_kept_for_finished_requests",
    "check_request_finished_exactly_once",
    "check_stopped_holds_are_confirmed",
    "check_unreachable_backend",
    "check_whole_block_hits",
    "conformance_suite",
    "kit_model_dir",
    "run_check",
]
