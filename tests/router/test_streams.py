"""The idle limit on streams (router/streams.py) and its HTTP side (router/http_scope.IdleCutoff)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from router.http_scope import IdleCutoff
from router.streams import StreamWatch


def test_a_send_pending_past_the_idle_limit_cancels_the_call() -> None:
    watch = StreamWatch(0.2)
    try:
        stalled, moving = threading.Event(), threading.Event()
        a = watch.watch(stalled.set)
        b = watch.watch(moving.set)
        a.sending()  # never sent
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # b keeps sending within the limit
            b.sending()
            time.sleep(0.02)
            b.sent()
        assert stalled.wait(2.0) and not moving.is_set()
        assert watch.cut == 1
        b.close()
        a.close()
    finally:
        watch.close()


def test_time_waiting_for_the_nodes_does_not_count() -> None:
    watch = StreamWatch(0.1)
    try:
        cancelled = threading.Event()
        w = watch.watch(cancelled.set)
        time.sleep(0.5)  # no send pending: the router waits on a node, not on the client
        assert not cancelled.is_set() and watch.cut == 0
        w.close()
    finally:
        watch.close()


def test_http_a_response_the_client_does_not_take_is_cut() -> None:
    watch = StreamWatch(0.2)
    sent: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(3):
            await send({"type": "http.response.body", "body": b"x", "more_body": True})

    async def stalling_send(message: Any) -> None:
        if message["type"] == "http.response.body":
            await asyncio.sleep(3600)  # the transport's buffer is full and stays so
        sent.append(message)

    try:
        started = time.monotonic()
        asyncio.run(IdleCutoff(app, watch)({"type": "http"}, None, stalling_send))
        assert time.monotonic() - started < 2.0
        assert [m["type"] for m in sent] == ["http.response.start"] and watch.cut == 1
    finally:
        watch.close()
