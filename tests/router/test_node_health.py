"""The router's health rounds (``NodeHandle.check``): a live node that answers one check late stays up, a
frozen one (every check late) and a dead one (its connection refused) go down."""

from __future__ import annotations

import pytest

from engine.hashing import HashNamespace
from router import nodes
from router.nodes import LATE_CHECKS_DOWN, NodeHandle

LATE = "UNREACHABLE: DEADLINE_EXCEEDED Deadline Exceeded"
REFUSED = "UNREACHABLE: UNAVAILABLE failed to connect to all addresses"


@pytest.fixture
def answers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The health answers the next checks get, in order (the Stats call after a SERVING one fails: no
    node listens -- the handle keeps its figures and stays up)."""
    queue: list[str] = []
    monkeypatch.setattr(nodes, "check", lambda *a, **k: queue.pop(0))
    return queue


def _node() -> NodeHandle:
    """A node that was up, its model known (a Stats read before: router/candidates.py)."""
    node = NodeHandle("127.0.0.1:1", "pdkv.v1.DecodeNode")
    node.namespace = HashNamespace("test-model", 16)
    node.mark_up()
    return node


def test_one_late_answer_keeps_a_node_up_and_an_answer_in_time_forgets_it(answers: list[str]) -> None:
    node = _node()
    answers += [LATE, "SERVING", LATE, "SERVING"]
    for _ in range(4):
        node.check(0.05)
        assert node.healthy
    assert node.late_checks == 0 and node.unreachable_since is None


def test_late_answers_in_a_row_mark_a_frozen_node_down(answers: list[str]) -> None:
    node = _node()
    answers += [LATE] * LATE_CHECKS_DOWN
    for _ in range(LATE_CHECKS_DOWN - 1):
        node.check(0.05)
        assert node.healthy
    since = node.unreachable_since
    assert since is not None  # the reroute clock runs from the first late check
    node.check(0.05)
    assert not node.healthy and node.last_error == LATE and node.unreachable_since == since


def test_a_refused_connection_marks_a_node_down_at_once(answers: list[str]) -> None:
    node = _node()
    answers.append(REFUSED)
    node.check(0.05)
    assert not node.healthy and node.last_error == REFUSED


def test_a_node_down_stays_down_on_a_late_answer(answers: list[str]) -> None:
    node = _node()
    answers += [REFUSED, LATE]
    node.check(0.05)
    node.check(0.05)
    assert not node.healthy and node.last_error == LATE


def test_a_draining_node_is_down_at_its_first_not_serving(answers: list[str]) -> None:
    node = _node()
    answers.append("NOT_SERVING")
    node.check(0.05)
    assert not node.healthy and node.stopping


def test_a_node_that_leaves_dns_keeps_its_open_calls_until_they_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """An outside probe's find: a pod leaving its headless Service in a rolling update (no longer resolved
    the moment it is told to stop) had its channel closed at once, cutting the streams it was draining;
    they resumed on another node where a planned stop must resume none.  Now it gets no new call, its
    channel closes once its calls end, and it is back should it resolve again."""
    resolved = {"10.0.0.1", "10.0.0.2"}
    monkeypatch.setattr(
        nodes.socket,
        "getaddrinfo",
        lambda host, port, **kw: [(0, 0, 0, "", (ip, port)) for ip in sorted(resolved)],
    )
    pool = nodes.NodePool("decode", ["decode:7000"], "pdkv.v1.DecodeNode", dns_discovery=True)
    closed: list[str] = []
    for node in pool.nodes():
        monkeypatch.setattr(node, "close", lambda a=node.address: closed.append(a))
        node.namespace = HashNamespace("test-model", 16)
        node.mark_up()
    leaving = next(n for n in pool.nodes() if n.address == "10.0.0.1:7000")
    try:
        with leaving.busy():  # a stream it serves
            resolved.discard("10.0.0.1")
            pool.refresh()
            assert [n.address for n in pool.healthy()] == ["10.0.0.2:7000"]  # nothing new goes there
            pool.refresh()
            assert closed == []  # its stream goes on
        pool.refresh()
        assert closed == ["10.0.0.1:7000"]  # ended: the channel closes
        # One that leaves and comes back before its calls end is the same node again.
        other = pool.nodes()[0]
        with other.busy():
            resolved.clear()
            resolved.add("10.0.0.1")
            pool.refresh()
            resolved.add("10.0.0.2")
            pool.refresh()
        assert other in pool.nodes() and closed == ["10.0.0.1:7000"]
        # A call that never ends is cut after LEAVING_GRACE_S.
        with other.busy():
            resolved.discard("10.0.0.2")
            pool.refresh()
            monkeypatch.setattr(nodes.time, "monotonic", lambda: 10**9)
            pool.refresh()
            assert closed == ["10.0.0.1:7000", "10.0.0.2:7000"]
    finally:
        pool.close()


def test_a_leaving_node_is_still_checked_and_a_frozen_one_s_calls_go_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A review's find: a node moved out of the pool was no longer checked, so a pod that left its
    Service because it froze (not ready) kept its streams waiting up to LEAVING_GRACE_S, where
    reroute_unreachable cut them after --reroute-after-s before."""
    resolved = {"10.0.0.1", "10.0.0.2"}
    monkeypatch.setattr(
        nodes.socket,
        "getaddrinfo",
        lambda host, port, **kw: [(0, 0, 0, "", (ip, port)) for ip in sorted(resolved)],
    )
    answers = {"10.0.0.1:7000": LATE, "10.0.0.2:7000": "SERVING"}
    monkeypatch.setattr(nodes, "check", lambda address, **kw: answers[address])
    pool = nodes.NodePool("decode", ["decode:7000"], "pdkv.v1.DecodeNode", dns_discovery=True)
    for node in pool.nodes():
        node.namespace = HashNamespace("test-model", 16)
        monkeypatch.setattr(node, "_refresh_stats", lambda timeout: None)
        node.mark_up()
    frozen = next(n for n in pool.nodes() if n.address == "10.0.0.1:7000")
    cut: list[str] = []
    monitor = nodes.HealthMonitor([pool], interval=1.0, timeout=0.05, reroute_after_s=0.0)
    try:
        with frozen.busy(lambda: cut.append("stream")):
            resolved.discard("10.0.0.1")  # it left its Service (not ready)
            for _ in range(LATE_CHECKS_DOWN + 1):
                monitor.check_all()
            assert frozen in pool.leaving() and not frozen.healthy  # checked all the same
            assert cut and set(cut) == {"stream"}  # cut (each round until it ends), as in the pool
        # A resolver's hiccup keeps what the name stood for: nothing leaves.
        monkeypatch.setattr(
            nodes.socket, "getaddrinfo", lambda *a, **kw: (_ for _ in ()).throw(OSError("EAI_AGAIN"))
        )
        pool.refresh()
        assert [n.address for n in pool.nodes()] == ["10.0.0.2:7000"]
    finally:
        pool.close()
