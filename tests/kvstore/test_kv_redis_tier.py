"""The redis tier against real redis-servers started here: one round trip per lookup, exact reads, damaged
values, a server that dies or hangs mid-run, TTL, and a Redis Cluster."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from kvtest import BLOCK, LAYOUT, NAMESPACE, OTHER_NAMESPACE, Blocks, RedisProcess, free_port, wait_until

from kvstore.breaker import BreakerConfig
from kvstore.config import RedisTierConfig
from kvstore.deadline import Deadline
from kvstore.results import MissReason
from kvstore.tiers.base import TierPolicy
from kvstore.tiers.redis import RedisTier
from wire.codec import BlockCodec
from wire.keys import ANCHOR_SPAN

pytestmark = pytest.mark.redis

POLICY = TierPolicy(
    lookup_timeout_s=0.3, get_timeout_s=0.5, put_timeout_s=0.5, breaker=BreakerConfig(cooldown_s=0.5)
)


def tier_for(url: str, **options: object) -> RedisTier:
    config = RedisTierConfig(url, timeout_s=0.25, connect_timeout_s=0.25, **options)  # type: ignore[arg-type]
    return RedisTier(config, policy=POLICY)


def commandstats(client: redis.Redis) -> dict[str, int]:
    return {name: stats["calls"] for name, stats in client.info("commandstats").items()}


class RoundTrips:
    """Counts the packed sends (one per round trip) redis-py connections make."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = redis.connection.AbstractConnection.send_packed_command

        def counting(conn, command, check_health=True):  # type: ignore[no-untyped-def]
            self.count += 1
            return original(conn, command, check_health)

        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)


@pytest.fixture
def tier(redis_server: RedisProcess) -> Iterator[RedisTier]:
    t = tier_for(redis_server.url)
    yield t
    t.close()


def test_lookup_is_one_round_trip(
    tier: RedisTier,
    redis_server: RedisProcess,
    make_blocks: Callable[..., Blocks],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    b = make_blocks(300)
    client = redis_server.client()
    tier.put(b.run(0, 200), b.units(0, 200))
    assert tier.contains_prefix(b.run()) == 200  # loads the script
    trips = RoundTrips(monkeypatch)
    for run, expected in ((b.run(), 200), (b.run(0, 150), 150), (b.run(100), 100), (b.run(200), 0)):
        before = commandstats(client)
        trips.count = 0
        assert tier.contains_prefix(run) == expected
        assert trips.count == 1
        delta = {k: v - before.get(k, 0) for k, v in commandstats(client).items()}
        assert delta.get("cmdstat_evalsha") == 1
        assert not {"cmdstat_get", "cmdstat_mget", "cmdstat_scan", "cmdstat_keys"} & {
            k for k, v in delta.items() if v
        }


def test_the_prefix_stops_at_the_first_missing_key(
    tier: RedisTier, make_blocks: Callable[..., Blocks]
) -> None:
    b = make_blocks(100)
    tier.put(b.run(), b.units())
    for gap in (0, 1, 37, 64, 99):
        tier.delete(b.run(gap, gap + 1))
        assert tier.contains_prefix(b.run()) == gap
        tier.put(b.run(gap, gap + 1), b.units(gap, gap + 1))
    assert tier.contains_prefix(b.run()) == 100


def test_a_flushed_script_is_reloaded(
    tier: RedisTier, redis_server: RedisProcess, make_blocks: Callable[..., Blocks]
) -> None:
    b = make_blocks(3)
    tier.put(b.run(), b.units())
    assert tier.contains_prefix(b.run()) == 3
    redis_server.client().script_flush()
    assert tier.contains_prefix(b.run()) == 3


def test_get_into_reproduces_the_bytes(tier: RedisTier, make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(40)  # more than one pipelined batch
    assert tier.put(b.run(0, 35), b.units(0, 35)).stored == 35
    result = tier.get_into(b.run(), b.out_views, LAYOUT)
    assert (result.loaded, result.reason) == (35, MissReason.ABSENT)
    assert b.loaded(35)
    read = tier.read(b.run(30))
    assert [bytes(u.payload) for u in read.units] == [bytes(v) for v in b.views[30:35]]


def test_keys_share_a_hash_tag_per_anchor_group(tier: RedisTier, make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(2 * ANCHOR_SPAN + 5)
    keys = tier.keys(b.run(ANCHOR_SPAN - 2))
    tags = [key[key.index(b"{") : key.index(b"}") + 1] for key in keys]
    assert len(set(tags[:2])) == 1 and len(set(tags[2 : 2 + ANCHOR_SPAN])) == 1 and tags[1] != tags[2]
    assert keys[0].startswith(b"pdkv:" + NAMESPACE[:8].hex().encode() + b":{")


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"garbage", MissReason.TRUNCATED),
        (b"x" * (96 + BLOCK), MissReason.CORRUPT),
        ("other_model", MissReason.WRONG_NAMESPACE),
        ("flip", MissReason.CORRUPT),
        ("short", MissReason.TRUNCATED),
    ],
)
def test_a_damaged_value_is_a_miss(
    tier: RedisTier,
    redis_server: RedisProcess,
    make_blocks: Callable[..., Blocks],
    value: object,
    reason: MissReason,
) -> None:
    b = make_blocks(4)
    tier.put(b.run(), b.units())
    key = tier.keys(b.run())[2]
    client = redis_server.client()
    good = client.get(key)
    if value == "other_model":
        value = BlockCodec(OTHER_NAMESPACE, LAYOUT).encode(b.hashes[2], b.views[2])
    elif value == "flip":
        value = good[:500] + bytes([good[500] ^ 1]) + good[501:]
    elif value == "short":
        value = good[:-1]
    client.set(key, value)
    result = tier.get_into(b.run(), b.out_views, LAYOUT)
    assert (result.loaded, result.reason) == (2, reason)
    assert b.loaded(2)
    # the connection stayed in step: the next call is served normally -- the bad block was dropped with
    # the run's blocks after it, so the put of the recomputed run stores them all
    assert tier.put(b.run(2), b.units(2)).stored == 2
    assert tier.get_into(b.run(), b.out_views, LAYOUT).loaded == 4


def test_redis_stopped_mid_run_is_a_bounded_miss_then_recovers(
    tier: RedisTier, redis_server: RedisProcess, make_blocks: Callable[..., Blocks]
) -> None:
    b = make_blocks(4)
    tier.put(b.run(), b.units())
    assert tier.contains_prefix(b.run()) == 4
    redis_server.stop()
    start = time.monotonic()
    assert tier.contains_prefix(b.run(), Deadline.after(0.3)) == 0
    assert tier.get_into(b.run(), b.out_views, LAYOUT, Deadline.after(0.3)).loaded == 0
    assert time.monotonic() - start < 1.5  # two calls of 0.3 s each, plus slack for a busy host
    stats = tier.stats()
    assert stats.breakers["read"] == "open"
    assert stats.missed(MissReason.ERROR) == 1 and stats.missed(MissReason.UNAVAILABLE) == 1
    redis_server.start()  # empty again: no persistence
    wait_until(lambda: tier.put(b.run(), b.units()).stored == 4, 5.0, "the write breaker to close")
    wait_until(lambda: tier.contains_prefix(b.run()) == 4, 5.0, "the read breaker to close")
    assert tier.stats().breakers == {"read": "closed", "write": "closed"}
    assert tier.get_into(b.run(), b.out_views, LAYOUT).loaded == 4 and b.loaded(4)


def test_a_hung_redis_times_out_within_the_deadline(
    tier: RedisTier, redis_server: RedisProcess, make_blocks: Callable[..., Blocks]
) -> None:
    b = make_blocks(4)
    tier.put(b.run(), b.units())
    redis_server.pause()
    try:
        start = time.monotonic()
        assert tier.contains_prefix(b.run(), Deadline.after(0.2)) == 0
        assert time.monotonic() - start < 1.0
        assert tier.stats().missed(MissReason.TIMEOUT) == 1
        start = time.monotonic()
        assert tier.contains_prefix(b.run(), Deadline.after(0.2)) == 0  # skipped: the breaker is open
        assert time.monotonic() - start < 0.3  # no wait at all: the breaker is open
    finally:
        redis_server.resume()
    wait_until(lambda: tier.contains_prefix(b.run()) == 4, 5.0, "recovery after the pause")


def test_ttl(redis_server: RedisProcess, make_blocks: Callable[..., Blocks]) -> None:
    b = make_blocks(2)
    tier = tier_for(redis_server.url, ttl_s=0.3)
    try:
        tier.put(b.run(), b.units())
        client = redis_server.client()
        ttls = [client.pttl(k) for k in tier.keys(b.run())]
        assert all(0 < t <= 300 for t in ttls), ttls
        wait_until(lambda: tier.contains_prefix(b.run()) == 0, 5.0, "the keys to expire")
    finally:
        tier.close()
    no_ttl = tier_for(redis_server.url, prefix="other")
    try:
        no_ttl.put(b.run(), b.units())
        assert redis_server.client().pttl(no_ttl.keys(b.run())[0]) == -1
    finally:
        no_ttl.close()


# ---- Redis Cluster -------------------------------------------------------------------------------------


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[list[RedisProcess]]:
    nodes = []
    try:
        for i in range(3):
            node = RedisProcess(
                free_port(),
                (
                    "--cluster-enabled",
                    "yes",
                    "--cluster-port",  # the bus port, else port + 10000, which may not exist
                    str(free_port()),
                    "--cluster-config-file",
                    str(tmp_path / f"nodes-{i}.conf"),
                    "--dir",
                    str(tmp_path),
                ),
            )
            node.start()
            nodes.append(node)
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )

        def ready() -> bool:
            return all(b"cluster_state:ok" in n.client().execute_command("CLUSTER", "INFO") for n in nodes)

        wait_until(ready, 20.0, "the cluster to form")
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def test_a_cluster_lookup_is_one_round_trip_per_node(
    redis_cluster: list[RedisProcess], make_blocks: Callable[..., Blocks], monkeypatch: pytest.MonkeyPatch
) -> None:
    b = make_blocks(6 * ANCHOR_SPAN)  # six slot groups, spread over the nodes
    tier = tier_for(redis_cluster[0].url.replace("/0", ""), cluster=True)
    try:
        assert tier.put(b.run(0, 5 * ANCHOR_SPAN), b.units(0, 5 * ANCHOR_SPAN)).stored == 5 * ANCHOR_SPAN
        assert tier.contains_prefix(b.run()) == 5 * ANCHOR_SPAN  # loads the script where needed
        tags = {k[k.index(b"{") : k.index(b"}") + 1] for k in tier.keys(b.run())}
        nodes = {tier._cluster_client().get_node_from_key(b"x" + t).name for t in tags}
        assert len(nodes) >= 2, "the groups should spread over several nodes"
        trips = RoundTrips(monkeypatch)
        assert tier.contains_prefix(b.run()) == 5 * ANCHOR_SPAN
        assert trips.count == len(nodes)
        tier.delete(b.run(2 * ANCHOR_SPAN + 7, 2 * ANCHOR_SPAN + 8))
        assert tier.contains_prefix(b.run()) == 2 * ANCHOR_SPAN + 7
        result = tier.get_into(b.run(), b.out_views, LAYOUT)
        assert result.loaded == 2 * ANCHOR_SPAN + 7 and b.loaded(result.loaded)
    finally:
        tier.close()


class AuthRedis(RedisProcess):
    """A redis-server that wants a password (its PING needs AUTH first)."""

    PASSWORD = "a-redis-password-not-in-any-url"

    def ping(self) -> bool:
        try:
            return bool(redis.Redis(port=self.port, password=self.PASSWORD, socket_timeout=0.5).ping())
        except redis.RedisError:
            return False


def test_credentials_come_from_the_environment_or_a_file_never_the_url(
    make_blocks: Callable[..., Blocks], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = AuthRedis(free_port(), extra=("--requirepass", AuthRedis.PASSWORD))
    server.start()
    try:
        blocks = make_blocks(3)
        monkeypatch.setenv("PDKV_TEST_REDIS_PASSWORD", AuthRedis.PASSWORD)
        secret = tmp_path / "redis-password"
        secret.write_text(AuthRedis.PASSWORD + "\n")
        for option in ({"password_env": "PDKV_TEST_REDIS_PASSWORD"}, {"password_file": str(secret)}):
            t = tier_for(server.url, **option)
            try:
                assert t.put(blocks.run(), blocks.units()).stored == 3
                assert t.contains_prefix(blocks.run()) == 3
                assert AuthRedis.PASSWORD not in str(t._backend_stats())
            finally:
                t.close()
        anonymous = tier_for(server.url)  # without the password: refused, as a miss, not a crash
        try:
            assert anonymous.contains_prefix(blocks.run()) == 0
        finally:
            anonymous.close()
        with pytest.raises(ValueError, match="PDKV_TEST_REDIS_UNSET is not set"):
            tier_for(server.url, password_env="PDKV_TEST_REDIS_UNSET")
    finally:
        server.stop()


def test_redis_credentials_and_tls_options_parse_from_the_spec_and_toml(tmp_path: Path) -> None:
    from kvstore.config import StoreConfig

    config = StoreConfig.load("redis://h:6379/0?username=pdkv&password_env=REDIS_PW").tiers[0]
    assert isinstance(config, RedisTierConfig)
    assert (config.username, config.password_env) == ("pdkv", "REDIS_PW")
    toml = tmp_path / "store.toml"
    toml.write_text(
        '[kv_store]\n[[kv_store.tiers]]\nkind = "redis"\nurl = "rediss://h:6380/0"\n'
        'password_file = "/run/secrets/redis"\nssl_ca_certs = "/run/secrets/ca.pem"\n'
    )
    tls = StoreConfig.load(f"@{toml}").tiers[0]
    assert isinstance(tls, RedisTierConfig)
    assert (tls.password_file, tls.ssl_ca_certs) == ("/run/secrets/redis", "/run/secrets/ca.pem")
    with pytest.raises(ValueError, match="need a rediss:// url"):
        RedisTierConfig("redis://h:6379/0", ssl_ca_certs="/ca.pem")
    # A file that is not there is refused when the tier opens (every connection would fail, counted).
    with pytest.raises(ValueError, match=r"ssl_ca_certs /nonexistent/ca.pem: not a readable file"):
        tier_for("rediss://127.0.0.1:1/0", ssl_ca_certs="/nonexistent/ca.pem")
