"""The conformance kit can fail: each deliberately broken connector (tests/kit_connectors.py) is
flagged by the check for the contract item it breaks, with a message naming that item."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from connectors.registry import KVConnectorConfig
from connectors.testing import (
    CHECKS,
    ConformanceError,
    ConformanceTarget,
    check_a_hit_ends_at_the_first_missing_block,
    check_blocks_are_keyed_by_the_namespace,
    check_freed_blocks_are_not_read,
    check_hold_ends_with_finished_sending,
    check_load_errors_are_reported,
    check_loads_reproduce_saved_kv,
    check_lookups_are_idempotent,
    check_none_is_followed_by_an_answer,
    check_nothing_is_kept_for_finished_requests,
    check_request_finished_exactly_once,
    check_stopped_holds_are_confirmed,
    check_unreachable_backend,
    check_whole_block_hits,
    conformance_suite,
    run_check,
)
from connectors.testing import items as kit
from connectors.testing.items import ASYNC_LOADS
from tests.connectors.test_conformance_builtins import corrupt_block_files, evict_block_file, unreachable


def broken(name: str, **hooks: Any) -> ConformanceTarget:
    def factory(shared: Path) -> KVConnectorConfig:
        return KVConnectorConfig(f"tests.kit_connectors:{name}", {"path": str(shared / "kv")})

    return ConformanceTarget(factory, **hooks)


def same_backend(name: str) -> Any:
    return lambda shared: KVConnectorConfig(f"tests.kit_connectors:{name}", {"path": str(shared / "kv")})


CASES = [
    (
        "LastTokenConnector",
        {},
        check_whole_block_hits,
        kit.WHOLE_BLOCKS,
        "last token",
    ),
    ("ShrinkingLookupConnector", {}, check_lookups_are_idempotent, kit.LOOKUP, "must give the same answer"),
    (
        "ClaimingLookupConnector",
        {},
        check_lookups_are_idempotent,
        kit.LOOKUP,
        "consumed what the backend holds",
    ),
    (
        "NeverAnswersConnector",
        {"lookup_deadline_s": 0.2},
        check_none_is_followed_by_an_answer,
        kit.NONE_ANSWER,
        "answered None",
    ),
    (
        "PerturbingLoadConnector",
        {},
        check_loads_reproduce_saved_kv,
        kit.LOADS,
        "bytes loaded differ from the block engine A computed",
    ),
    (
        "RaisingLoadConnector",
        {"corrupt": corrupt_block_files},
        check_load_errors_are_reported,
        kit.WORKER_RAISES,
        "a worker call raised",
    ),
    (  # a full disk raised out of wait_for_save: named as the raise it is, whichever check meets it
        "RaisingSaveConnector",
        {},
        check_lookups_are_idempotent,
        kit.WORKER_RAISES,
        "OSError",
    ),
    (
        "TrustingLoadConnector",
        {"corrupt": corrupt_block_files},
        check_load_errors_are_reported,
        kit.LOAD_ERRORS,
        "reported no load error",
    ),
    (
        "NeverSendsConnector",
        {"send_deadline_s": 0.2},
        check_hold_ends_with_finished_sending,
        kit.HOLD_ENDS,
        "finished_sending",
    ),
    (
        "NeverSendsConnector",
        {"send_deadline_s": 0.2},
        check_stopped_holds_are_confirmed,
        kit.STOP_CONFIRMED,
        "stop_request_ids",
    ),
    (
        "SlowConnectConnector",
        {"unreachable_factory": same_backend("SlowConnectConnector"), "unreachable_deadline_s": 0.3},
        check_unreachable_backend,
        kit.UNREACHABLE,
        "did not finish within 0.3s",
    ),
    (  # an outside author gave the connector's own factory as the unreachable one: an empty store passed
        "AsyncSharedDirConnector",
        {"unreachable_factory": same_backend("AsyncSharedDirConnector")},
        check_unreachable_backend,
        kit.UNREACHABLE,
        "that backend is reachable",
    ),
    # The classes an outside author's defects showed the kit missed:
    (
        "TokenKeyedConnector",
        {},
        check_blocks_are_keyed_by_the_namespace,
        kit.NAMESPACE,
        "another tenant's cache salt",
    ),
    (
        "SaveAfterFreeConnector",
        {},
        check_freed_blocks_are_not_read,
        kit.FREED,
        "after request_finished returned hold=False",
    ),
    (
        "FlushAtShutdownConnector",
        {},
        check_freed_blocks_are_not_read,
        kit.FREED,
        "after request_finished returned hold=False",
    ),
    # The three classes issue #31 found slipping through, each caught without the author's help:
    (
        "HoleBlindConnector",  # no evict hook: the kit makes the hole itself
        {},
        check_a_hit_ends_at_the_first_missing_block,
        kit.HOLES,
        "block 1 of 5 was never saved",
    ),
    (
        "HoleBlindConnector",  # and with one, it also evicts a block
        {"evict": evict_block_file},
        check_a_hit_ends_at_the_first_missing_block,
        kit.HOLES,
        "block 1 of",
    ),
    (
        "BackgroundSaveConnector",
        {},
        check_freed_blocks_are_not_read,
        kit.FREED,
        "after request_finished returned hold=False",
    ),
    (
        "DtypelessKeyConnector",
        {},
        check_blocks_are_keyed_by_the_namespace,
        kit.NAMESPACE,
        "engine D: the connector offered",
    ),
    (  # an outside author's plugin: the base model's KV offered under an adapter
        "AdapterBlindKeyConnector",
        {},
        check_blocks_are_keyed_by_the_namespace,
        kit.NAMESPACE,
        "engine E: the connector offered",
    ),
    (
        "BlockingLookupConnector",
        {"call_deadline_s": 0.5},
        check_lookups_are_idempotent,
        kit.BOUNDED_CALLS,
        "get_num_new_matched_tokens has not returned",
    ),
    (
        "LeakyStateConnector",
        {},
        check_nothing_is_kept_for_finished_requests,
        kit.RELEASED,
        "self._requests",
    ),
    (
        "IgnoresLocalHitConnector",
        {},
        check_loads_reproduce_saved_kv,
        kit.LOADS,
        "the connector's blocks start at the local hit",
    ),
    (  # wrong bytes that are not the freed blocks' poison: named as wrong bytes, not as a late save
        "PerturbingLoadConnector",
        {},
        check_freed_blocks_are_not_read,
        kit.FREED,
        "stored or loaded the wrong bytes",
    ),
    (
        "SilentLoadConnector",
        {"load_deadline_s": 0.5},
        check_loads_reproduce_saved_kv,
        ASYNC_LOADS,
        "finished_recving",
    ),
    # An outside plugin author's broken connectors, which the engine now survives (the node goes on):
    # the kit still fails each, naming the rule it breaks, not the check it happened to run.
    ("RaisingFinishConnector", {}, check_lookups_are_idempotent, kit.SCHEDULER_RAISES, "request_finished"),
    ("RaisingMetaConnector", {}, check_lookups_are_idempotent, kit.SCHEDULER_RAISES, "build_connector_meta"),
    ("ForeignLoadErrorsConnector", {}, check_loads_reproduce_saved_kv, kit.REPORTS, "was not loading"),
    ("ForeignFinishedConnector", {}, check_lookups_are_idempotent, kit.REPORTS, "'not-a-request'"),
    # A later plugin author's: raises the engine survives since, stats that raise, loads reported twice.
    (
        "RaisingAllocConnector",
        {},
        check_lookups_are_idempotent,
        kit.SCHEDULER_RAISES,
        "update_state_after_alloc",
    ),
    (
        "RaisingOutputConnector",
        {},
        check_lookups_are_idempotent,
        kit.SCHEDULER_RAISES,
        "update_connector_output",
    ),
    ("RaisingStatsConnector", {}, check_lookups_are_idempotent, kit.STATS, "worker half's get_stats raised"),
    (
        "TwiceLoadedConnector",
        {},
        check_request_finished_exactly_once,
        kit.FINISHED_ONCE,
        "finished_recving listed",
    ),
]


@pytest.mark.parametrize(
    ("name", "hooks", "check", "item", "fragment"),
    CASES,
    ids=[case[0] + ("-" + "-".join(case[1]) if case[1] else "") for case in CASES],
)
def test_the_kit_flags_each_broken_connector(
    tmp_path: Path, name: str, hooks: dict[str, Any], check: Any, item: str, fragment: str
) -> None:
    started = time.monotonic()
    with pytest.raises(ConformanceError) as info:
        run_check(check, broken(name, **hooks), tmp_path)  # the suite's way: under the watchdog
    assert time.monotonic() - started < 60, "a broken connector must fail fast, never hang the run"
    assert info.value.item == item
    assert str(info.value).startswith(f"[{item}] ")
    assert fragment in str(info.value), str(info.value)


TestAsyncSharedDir = conformance_suite(
    same_backend("AsyncSharedDirConnector"),
    corrupt=corrupt_block_files,
    unreachable_factory=lambda shared: KVConnectorConfig(
        "tests.kit_connectors:AsyncSharedDirConnector", {"path": str(unreachable(shared))}
    ),
)
"""The kit passes a connector that takes every slow path the contract allows (None answers, async
loads, delayed frees): what it demands is the contract, not one implementation's shortcuts."""


def test_the_engines_last_resort_free_does_not_hide_a_connector_that_ignores_stops(
    tmp_path: Path,
) -> None:
    """The stop check sets kv_stop_timeout_s far above its own deadline: the engine's last-resort free
    (which would make the books balance) comes too late to hide a worker that never confirms a stop."""
    with pytest.raises(kit.ConformanceError, match="stop_request_ids"):
        check_stopped_holds_are_confirmed(broken("NeverSendsConnector", send_deadline_s=0.5), tmp_path)


def test_the_one_line_suite_reports_exactly_the_broken_item_and_never_skips(tmp_path: Path) -> None:
    """A broken connector with every hook fails its one item; a correct one without the required hooks
    fails the two checks that need them, saying what to add -- no check is ever skipped."""
    module = tmp_path / "test_generated_kit.py"
    module.write_text(
        textwrap.dedent(
            """
            from connectors.registry import KVConnectorConfig
            from connectors.testing import conformance_suite
            from tests.connectors.test_conformance_builtins import corrupt_block_files, unreachable

            def factory(shared):
                return KVConnectorConfig("tests.kit_connectors:LastTokenConnector", {"path": str(shared)})

            def dead(shared):
                return KVConnectorConfig("shared-dir", {"path": str(unreachable(shared))})

            TestLastToken = conformance_suite(factory, corrupt=corrupt_block_files, unreachable_factory=dead)
            def correct(shared):
                return KVConnectorConfig("shared-dir", {"path": str(shared)})

            TestNoHooks = conformance_suite(correct)
            """
        )
    )

    class Collect:
        def __init__(self) -> None:
            self.reports: list[Any] = []

        def pytest_runtest_logreport(self, report: Any) -> None:
            if report.when == "call" or report.outcome != "passed":
                self.reports.append(report)

    collect = Collect()
    code = pytest.main(
        [
            str(module),
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:timeout",
            "--import-mode=importlib",
            f"--basetemp={tmp_path / 'basetemp'}",
        ],
        plugins=[collect],
    )
    assert code == pytest.ExitCode.TESTS_FAILED
    outcomes = {tuple(r.nodeid.rsplit("::", 2)[-2:]): r for r in collect.reports}
    assert {name for _, name in outcomes} == set(CHECKS)
    assert not [key for key, r in outcomes.items() if r.outcome == "skipped"]
    failed = {key: r.longreprtext for key, r in outcomes.items() if r.outcome == "failed"}
    assert set(failed) == {
        ("TestLastToken", "test_hits_are_whole_blocks_and_never_the_last_token"),
        ("TestNoHooks", "test_load_errors_are_reported_not_raised"),
        ("TestNoHooks", "test_unreachable_backend_bounded_time_zero_hits"),
    }
    assert (
        f"[{kit.WHOLE_BLOCKS}]"
        in failed[("TestLastToken", "test_hits_are_whole_blocks_and_never_the_last_token")]
    )
    assert "no corrupt(shared) hook" in failed[("TestNoHooks", "test_load_errors_are_reported_not_raised")]
    assert "Add one" in failed[("TestNoHooks", "test_unreachable_backend_bounded_time_zero_hits")]


def test_conformance_suite_validates_its_target() -> None:
    with pytest.raises(TypeError, match="factory must be callable"):
        conformance_suite("shared-dir")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="send_deadline_s must be a positive"):
        conformance_suite(same_backend("LastTokenConnector"), send_deadline_s=0)
    with pytest.raises(ValueError, match="may not set 'model'"):
        ConformanceTarget(same_backend("LastTokenConnector"), engine_options={"model": "x"})
    with pytest.raises(ValueError, match="num_blocks is 16; the kit's prompts"):
        ConformanceTarget(same_backend("LastTokenConnector"), engine_options={"num_blocks": 16})
    ConformanceTarget(same_backend("LastTokenConnector"), engine_options={"num_blocks": 128})
    suite = conformance_suite(same_backend("LastTokenConnector"))
    assert getattr(suite, "__test__", False)
    assert sorted(n for n in vars(suite) if n.startswith("test_")) == sorted(CHECKS)
