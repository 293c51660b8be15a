"""Shared clusters for the serving tests (real processes on loopback, started once per session)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdkv.launcher import Cluster
from tests.serving.helpers import start_cluster


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """Router + 1 prefill + 1 decode on the tiny make-model checkpoint (text prompts), p2p when present."""
    c = start_cluster(num_prefill=1, num_decode=1)
    try:
        yield c
    finally:
        c.stop()
