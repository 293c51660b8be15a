"""Store configuration (string and TOML), block key runs, and the circuit breaker."""

from __future__ import annotations

import pytest
from kvtest import NAMESPACE, chain

from kvstore.breaker import BreakerConfig, BreakerState, CircuitBreaker
from kvstore.config import (
    CpuTierConfig,
    DiskTierConfig,
    RedisTierConfig,
    RemoteTierConfig,
    StoreConfig,
    parse_size,
)
from wire.keys import ANCHOR_SPAN, KeyRun

# ---- the config string ------------------------------------------------------------------------------------


def test_the_documented_example_parses() -> None:
    config = StoreConfig.parse("cpu:4GiB,disk:/var/cache/pdkv:64GiB,redis://host:6379/0")
    cpu, disk, redis = config.tiers
    assert cpu == CpuTierConfig(capacity_bytes=4 << 30)
    assert disk == DiskTierConfig(path="/var/cache/pdkv", capacity_bytes=64 << 30)
    assert isinstance(redis, RedisTierConfig) and redis.url == "redis://host:6379/0" and not redis.cluster


def test_options_and_synonyms() -> None:
    config = StoreConfig.parse(
        "cpu:512MiB?verify=true&pin=false, disk:/a:b:1GB?fsync=always,"
        " valkey://h:7000/0?ttl_s=60&timeout_ms=20&cluster=true&prefix=kv,remote:ipc:///tmp/s?timeout_ms=5"
    )
    cpu, disk, redis, remote = config.tiers
    assert cpu == CpuTierConfig(512 << 20, verify_payload=True, pin_memory=False)
    assert disk == DiskTierConfig("/a:b", 10**9, fsync="always")  # a colon in the path is fine
    assert isinstance(redis, RedisTierConfig)
    assert (redis.url, redis.ttl_s, redis.timeout_s, redis.cluster, redis.prefix) == (
        "redis://h:7000/0",
        60.0,
        0.02,
        True,
        "kv",
    )
    assert remote == RemoteTierConfig("ipc:///tmp/s", timeout_s=0.005)


def test_repeated_kinds_get_distinct_names() -> None:
    config = StoreConfig.parse("disk:/a:1GB,disk:/b:1GB,disk:/c:1GB?name=cold")
    assert [t.name for t in config.tiers] == ["disk", "disk-2", "cold"]


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("", "empty"),
        ("cpu:4GX", "'4GX'"),
        ("cpu:-1", "'-1'"),
        ("cpu:4GiB,,disk:/x:1GB", "tier 2"),
        ("disk:/x", "disk:PATH:SIZE"),
        ("disk:/x:lots", "'lots'"),
        ("disk:/x:1GB?fsync=sometimes", "'sometimes'"),
        ("redis://:6379/0", "host"),
        ("redis://h:port/0", "'h:port'"),
        ("redis://h:6379/0?ttl_s=-5", "'-5'"),
        ("redis://h:6379/0?colour=red", "colour"),
        ("redis://h:6379/abc", "database after the port must be a number"),  # was accepted
        ("redis://h:6379/3?cluster=true", "database 0 only"),
        ("remote:localhost", "'localhost'"),
        ("gpu:1GiB", "'gpu'"),
        ("cpu:1GiB?speed=fast", "speed"),
        ("cpu:1GiB?verify=maybe", "'maybe'"),
        ("cpu:1GiB?name=a,disk:/x:1GB?name=a", "unique"),
    ],
)
def test_every_bad_value_is_named(spec: str, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("?", r"\?")):
        StoreConfig.parse(spec)


def test_the_error_says_which_tier() -> None:
    with pytest.raises(ValueError, match=r"tier 3 'disk:/y:1GQ'"):
        StoreConfig.parse("cpu:1GiB,disk:/x:1GB,disk:/y:1GQ")


def test_sizes() -> None:
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("1.5KiB") == 1536
    assert parse_size("64GB") == 64 * 10**9
    assert parse_size("1000") == 1000
    assert parse_size(123) == 123


def test_toml_table() -> None:
    config = StoreConfig.from_toml(
        """
        [kv_store]
        write_policy = "back"
        write_queue_depth = 8
        lookup_timeout_ms = 20
        breaker_cooldown_ms = 250
        [[kv_store.tiers]]
        kind = "cpu"
        capacity = "1GiB"
        [[kv_store.tiers]]
        kind = "redis"
        url = "redis://h:6379/0"
        ttl_s = 30
        cluster = true
        """
    )
    assert config.write_policy == "back" and config.write_queue_depth == 8
    assert config.lookup_timeout_s == 0.02 and config.breaker.cooldown_s == 0.25
    cpu, redis = config.tiers
    assert cpu == CpuTierConfig(1 << 30)
    assert isinstance(redis, RedisTierConfig) and redis.ttl_s == 30 and redis.cluster


@pytest.mark.parametrize(
    ("toml", "named"),
    [
        ('[kv_store]\nwrite_policy = "sideways"\n[[kv_store.tiers]]\nkind = "cpu"\ncapacity = 1', "sideways"),
        ("[kv_store]\ncolour = 1\n[[kv_store.tiers]]\nkind = 'cpu'\ncapacity = 1", "colour"),
        ("[kv_store]\ntiers = []", "non-empty"),
        ("[[kv_store.tiers]]\nkind = 'tape'", "'tape'"),
        ("[[kv_store.tiers]]\nkind = 'disk'\npath = '/x'\ncapacity = 'big'", r"tiers\[1\].*'big'"),
        ("[[kv_store.tiers]]\nkind = 'cpu'\ncapacity = '1GiB'\nspeed = 3", "speed"),
    ],
)
def test_toml_errors_are_named(toml: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        StoreConfig.from_toml(toml)


def test_load_reads_a_toml_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "store.toml"
    path.write_text("[[kv_store.tiers]]\nkind = 'cpu'\ncapacity = '2MiB'\n")
    assert StoreConfig.load(f"@{path}").tiers == (CpuTierConfig(2 << 20),)


# ---- key runs --------------------------------------------------------------------------------------------


def test_runs_carry_the_anchor_of_each_group() -> None:
    hashes = chain(3 * ANCHOR_SPAN)
    run = KeyRun.of_chain(NAMESPACE, hashes, ANCHOR_SPAN - 2, 2 * ANCHOR_SPAN + 3)
    assert run.anchors == (hashes[0], hashes[ANCHOR_SPAN], hashes[2 * ANCHOR_SPAN])
    assert run.anchor(0) == hashes[0] and run.anchor(2) == hashes[ANCHOR_SPAN]
    tail = run.slice(3)
    assert tail.start == ANCHOR_SPAN + 1 and tail.anchors == (hashes[ANCHOR_SPAN], hashes[2 * ANCHOR_SPAN])
    assert list(tail.hashes) == hashes[ANCHOR_SPAN + 1 : 2 * ANCHOR_SPAN + 3]
    assert len(run.slice(5, 5)) == 0


def test_a_run_from_the_wire_is_checked() -> None:
    hashes = chain(4)
    assert KeyRun.from_wire(NAMESPACE, hashes, 2, [chain(1)[0]]).start == 2
    with pytest.raises(ValueError, match="anchors"):
        KeyRun.from_wire(NAMESPACE, hashes, 0, [])
    with pytest.raises(ValueError, match="16 or 32"):
        KeyRun.from_wire(NAMESPACE, [b"short"], 0, [hashes[0]])
    with pytest.raises(ValueError, match="namespace"):
        KeyRun.from_wire(b"ns", hashes, 0, [hashes[0]])
    with pytest.raises(ValueError, match="outside"):
        KeyRun.of_chain(NAMESPACE, hashes, 3, 9)


# ---- the breaker -----------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_backs_off_and_closes() -> None:
    clock = Clock()
    breaker = CircuitBreaker(
        BreakerConfig(failures_to_open=2, cooldown_s=1.0, max_cooldown_s=3.0), clock=clock
    )
    assert breaker.allow()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED  # one failure is not enough
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN and not breaker.allow()
    clock.now += 1.0
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # only one probe at a time
    breaker.record_failure()  # the probe failed: the cooldown doubles
    clock.now += 1.5
    assert not breaker.allow()
    clock.now += 0.5
    assert breaker.allow()
    breaker.record_failure()
    clock.now += 3.0  # capped at max_cooldown_s
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.allow() and breaker.times_opened == 3


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"failures_to_open": 0}, "failures_to_open"),
        ({"cooldown_s": 0}, "cooldown_s"),
        ({"max_cooldown_s": 0.5}, "max"),
    ],
)
def test_breaker_config_is_validated(kwargs: dict[str, float], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        BreakerConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "spec",
    [
        "disk:/tmp/pdkv-a:1GB,disk:/tmp/pdkv-a:1GB?name=cold",
        "disk:/tmp/pdkv-a:1GB,disk:/tmp/pdkv-a/../pdkv-a/:1GB?name=cold",
    ],
)
def test_two_disk_tiers_in_one_folder_are_refused_by_name(spec: str) -> None:
    """Each would index, evict and delete the other's files."""
    with pytest.raises(ValueError, match="disk tiers 'disk' and 'cold' share the folder"):
        StoreConfig.parse(spec)
    StoreConfig.parse("disk:/tmp/pdkv-a:1GB,disk:/tmp/pdkv-ab:1GB?name=cold")  # a sibling is its own
    StoreConfig.parse("disk:/tmp/pdkv-a:1GB,disk:/tmp/pdkv-a/cold:1GB?name=cold")  # so is a subfolder
