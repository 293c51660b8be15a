"""The ``offload`` connector over each tier: hits across engines and processes, and every fault a store has.

A second engine with a fresh local cache takes its prompt's prefix from the store at scheduling time
(counters show external tokens, computed prompt tokens are only the tail) and its greedy output equals
the first engine's and transformers'.  Faults never change the output; they cost hits and time, bounded.
"""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from connectors.registry import KVConnectorConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.kvstore.kvtest import RedisProcess, StoreServerProcess
from tests.tiny_models import hf_greedy, random_prompts, tiny_model_dir

MODEL = "llama"
BS = 4
PROMPTS = random_prompts([37, 29], seed=11)  # 9 and 7 whole blocks; the tails are computed
PARAMS = SamplingParams(max_tokens=6)
ROOT = Path(__file__).resolve().parents[2]


def offload(spec: str, **options: object) -> KVConnectorConfig:
    return KVConnectorConfig("offload", {"kv_store": spec, **options})


def make_llm(spec: str, **options: object) -> LLM:
    return LLM(tiny_model_dir(MODEL), block_size=BS, num_blocks=64, kv_connector=offload(spec, **options))


def expected() -> list[list[int]]:
    return [r.token_ids for r in hf_greedy(MODEL, PROMPTS, PARAMS.max_tokens)]


def run(llm: LLM) -> list:  # type: ignore[type-arg]
    outs = llm.generate(PROMPTS, PARAMS)
    assert llm.engine.drain(10.0), "saves did not finish"
    llm.engine.scheduler.check_integrity()
    return outs


def assert_from_store(outs: list) -> None:  # type: ignore[type-arg]
    for out, prompt in zip(outs, PROMPTS, strict=True):
        whole = (len(prompt) - 1) // BS * BS
        assert out.num_external_tokens == whole, (out.num_external_tokens, whole)
        assert out.num_cached_tokens == 0
        assert out.num_computed_prompt_tokens == len(prompt) - whole


def test_cpu_tier_serves_a_second_engine_in_the_same_process() -> None:
    spec = "cpu:64MiB"
    first = make_llm(spec)
    assert [o.token_ids for o in run(first)] == expected()
    second = make_llm(spec)  # fresh local cache, same in-process store
    outs = run(second)
    assert [o.token_ids for o in outs] == expected()
    assert_from_store(outs)
    first.engine.shutdown()
    second.engine.shutdown()


_WRITER = """
import sys
from connectors.registry import KVConnectorConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
import json
model, spec, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = LLM(model, block_size=4, num_blocks=64, kv_connector=KVConnectorConfig("offload", {"kv_store": spec}))
outs = llm.generate(prompts, SamplingParams(max_tokens=6))
assert llm.engine.drain(20.0)
llm.engine.shutdown()
print(json.dumps([o.token_ids for o in outs]))
"""


def run_writer_process(spec: str) -> list[list[int]]:
    """A first engine in its own process fills the store, then exits (the store outlives it)."""
    import json

    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(_WRITER),
            str(tiny_model_dir(MODEL)),
            spec,
            json.dumps(PROMPTS),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("tier", ["disk", "redis", "remote"])
def test_a_second_process_takes_its_prefix_from_each_tier(
    tier: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if tier == "disk":
        spec = f"disk:{tmp_path / 'kv'}:64MiB"
    elif tier == "redis":
        spec = f"redis://127.0.0.1:{request.getfixturevalue('redis_server').port}/0"
    else:
        spec = f"remote:{request.getfixturevalue('store_server')('cpu:64MiB').endpoint}"
    first = run_writer_process(spec)  # also the restart test for disk: a new process finds the files
    assert first == expected()
    # A lookup unanswered in lookup_timeout_s is a miss by design (0.2 s by default); a new process's first
    # lookups (connecting to the tier) can take longer than that on a loaded machine: give them time.
    second = make_llm(spec, lookup_timeout_s=5.0)
    outs = run(second)
    assert [o.token_ids for o in outs] == first
    assert_from_store(outs)
    stats = second.engine.stats()
    assert stats.counter("prompt_tokens.external_kv_transfer") == sum(
        (len(p) - 1) // BS * BS for p in PROMPTS
    )
    second.engine.shutdown()


def test_redis_stopped_mid_run_costs_hits_not_correctness(redis_server: RedisProcess) -> None:
    spec = f"redis://127.0.0.1:{redis_server.port}/0?timeout_ms=200"
    llm = make_llm(spec)
    assert [o.token_ids for o in run(llm)] == expected()
    redis_server.stop()
    assert llm.engine.reset_prefix_cache()
    t0 = time.monotonic()
    outs = run(llm)
    assert time.monotonic() - t0 < 20.0
    assert [o.token_ids for o in outs] == expected()
    assert all(o.num_external_tokens == 0 for o in outs)
    llm.engine.shutdown()


def test_store_server_killed_costs_hits_not_correctness(
    store_server: Callable[..., StoreServerProcess],
) -> None:
    server = store_server("cpu:64MiB")
    spec = f"remote:{server.endpoint}?timeout_ms=200"
    llm = make_llm(spec)
    assert [o.token_ids for o in run(llm)] == expected()
    server.kill()
    assert llm.engine.reset_prefix_cache()
    t0 = time.monotonic()
    outs = run(llm)
    assert time.monotonic() - t0 < 20.0
    assert [o.token_ids for o in outs] == expected()
    llm.engine.shutdown()


def _damage(files: list[Path], how: str) -> None:
    for f in files:
        data = bytearray(f.read_bytes())
        if how == "truncate":
            f.write_bytes(bytes(data[: len(data) // 2]))
        else:  # flip one bit in the middle of the payload
            data[len(data) // 2] ^= 0x01
            f.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncate", "bitflip"])
def test_damaged_disk_blocks_are_misses_and_the_output_stays_exact(how: str, tmp_path: Path) -> None:
    spec = f"disk:{tmp_path / 'kv'}:64MiB"
    first = run_writer_process(spec)
    files = sorted(p for p in (tmp_path / "kv").rglob("*") if p.is_file() and not p.name.startswith("."))
    assert files, "the writer stored no block files"
    _damage(files[::2], how)
    llm = make_llm(spec)
    outs = run(llm)
    assert [o.token_ids for o in outs] == first == expected()
    stats = llm.engine.stats()
    total_whole = sum((len(p) - 1) // BS * BS for p in PROMPTS)
    # Damaged blocks are either never counted as hits or fail their load and are recomputed -- and then
    # usage says so: what a request reports as loaded is what really loaded (an outside client saw
    # "16 of 16 blocks not loaded; recomputing them" next to usage store=256).
    assert stats.counter("prompt_tokens.external_kv_transfer") < total_whole
    for out in outs:
        assert out.num_external_tokens + out.num_cached_tokens + out.num_computed_prompt_tokens == len(
            out.prompt_token_ids
        )
    assert sum(o.num_external_tokens for o in outs) == stats.counter("prompt_tokens.external_kv_transfer")
    llm.engine.shutdown()


def test_blocks_of_another_model_are_never_served(tmp_path: Path) -> None:
    spec = f"disk:{tmp_path / 'kv'}:64MiB"
    other = LLM(tiny_model_dir("qwen2"), block_size=BS, num_blocks=64, kv_connector=offload(spec))
    other.generate(PROMPTS, PARAMS)
    assert other.engine.drain(10.0)
    other.engine.shutdown()
    llm = make_llm(spec)
    outs = run(llm)
    assert [o.token_ids for o in outs] == expected()
    assert all(o.num_external_tokens == 0 for o in outs)
    llm.engine.shutdown()


def test_redis_value_overwritten_with_garbage_is_a_miss(redis_server: RedisProcess) -> None:
    import redis

    spec = f"redis://127.0.0.1:{redis_server.port}/0"
    first = make_llm(spec)
    run(first)
    first.engine.shutdown()
    client = redis.Redis(port=redis_server.port)
    keys = list(client.scan_iter(count=1000))
    assert keys
    for key in keys[::2]:
        client.set(key, b"garbage" * 10)
    llm = make_llm(spec)
    outs = run(llm)
    assert [o.token_ids for o in outs] == expected()
    llm.engine.shutdown()


def test_a_disk_that_refuses_writes_loses_saves_not_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvstore.tiers.disk as disk

    def full(fd: int, buffers: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk.os, "writev", full)
    llm = make_llm(f"disk:{tmp_path / 'kv'}:64MiB")
    outs = run(llm)
    assert [o.token_ids for o in outs] == expected()
    assert llm.engine.reset_prefix_cache()
    outs = run(llm)  # nothing was stored: everything is computed again, correctly
    assert [o.token_ids for o in outs] == expected()
    assert all(o.num_external_tokens == 0 for o in outs)
    assert not list((tmp_path / "kv").rglob("*.tmp*")), "a failed write left a partial file"
    llm.engine.shutdown()


def test_bad_options_name_the_key() -> None:
    with pytest.raises(ValueError, match="kv_store"):
        make_llm("")
    with pytest.raises(ValueError, match="lookup_timeout_s"):
        make_llm("cpu:1MiB", lookup_timeout_s=-1)
    with pytest.raises(ValueError, match="unknown option 'kvstore'"):
        LLM(
            tiny_model_dir(MODEL),
            block_size=BS,
            num_blocks=64,
            kv_connector=KVConnectorConfig("offload", {"kvstore": "cpu:1MiB"}),
        )


def test_stats_count_loads_saves_and_tier_traffic_for_the_node_metrics() -> None:
    from engine.snapshot import snapshot

    llm = make_llm("cpu:64MiB?name=mem")  # the tier name keys its counters
    run(llm)
    assert llm.engine.reset_prefix_cache()
    run(llm)
    counters = snapshot(llm.engine).connector.counters
    whole_blocks = sum((len(p) - 1) // BS for p in PROMPTS)
    assert counters["offload_blocks_loaded"] == whole_blocks
    assert counters["store_mem_hit_blocks"] == whole_blocks
    assert counters["offload_blocks_saved"] >= whole_blocks
    llm.engine.shutdown()
