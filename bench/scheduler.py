"""Scheduler + block pool cost per step, and what the cache-aware queue policy buys (no model).

    python -m bench.scheduler [--quick] [--json PATH]

Figures:
- ``step_us_256_running``: wall time of ``schedule()`` + ``update_from_output()`` per step while 256
  requests run (decodes, with a stream of arrivals sharing prefixes being prefilled in chunks).
- ``lpm_hit_gain``: on one arrival stream under memory pressure (the pool holds a fraction of the
  prefixes in play), the local prefix-hit rate of ``lpm`` divided by that of ``fcfs``.
"""

from __future__ import annotations

import random
import time

from bench.common import Report, parser
from engine.hashing import HashNamespace
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ModelRunnerOutput, Scheduler
from engine.scheduler.config import CacheConfig, SchedulerConfig

BLOCK_SIZE = 16
NS = HashNamespace("bench-scheduler", BLOCK_SIZE)


def make_stream(
    n: int, *, groups: int, prefix_len: int, tail: tuple[int, int], max_tokens: tuple[int, int], seed: int
) -> list[Request]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32000) for _ in range(prefix_len)] for _ in range(groups)]
    out = []
    for i in range(n):
        prompt = prefixes[rng.randrange(groups)] + [rng.randrange(32000) for _ in range(rng.randint(*tail))]
        out.append(
            Request(
                f"r{i}",
                prompt,
                SamplingParams(max_tokens=rng.randint(*max_tokens), ignore_eos=True),
                namespace=NS,
                arrival_time=float(i),
            )
        )
    return out


def step(s: Scheduler, token: int) -> None:
    so = s.schedule()
    s.update_from_output(so, ModelRunnerOutput({sr.request_id: token for sr in so.scheduled if sr.sample}))


def steady_state_step_us(quick: bool) -> tuple[float, int]:
    """Mean step time with 256 running requests, arrivals topping the running set back up."""
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=256 * 48),
    )
    stream = make_stream(
        1000 if quick else 4000, groups=16, prefix_len=256, tail=(32, 256), max_tokens=(64, 256), seed=1
    )
    arrivals = iter(stream)
    # Fill up: 256 running requests before measuring.
    for _ in range(300):
        s.add_request(next(arrivals))
    while len(s.running) < 256:
        step(s, 11)
    measured, total = 0, 0.0
    target = 100 if quick else 500
    while measured < target:
        while len(s.waiting) < 16:  # a steady stream of arrivals
            s.add_request(next(arrivals))
        t0 = time.perf_counter()
        step(s, 11)
        dt = time.perf_counter() - t0
        if len(s.running) >= 256:
            measured += 1
            total += dt
    return total / measured * 1e6, measured


def hit_rate(policy: str, quick: bool) -> float:
    """Local prefix-hit rate over one bursty arrival stream under memory pressure."""
    groups = 24
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=8, policy=policy, max_passed_over=64),
        # Room for ~10 of the 24 prefixes (32 blocks each) plus the running requests' own blocks.
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=640),
    )
    stream = make_stream(
        400 if quick else 1600, groups=groups, prefix_len=512, tail=(16, 64), max_tokens=(4, 16), seed=2
    )
    arrivals = iter(stream)
    pending = True
    while pending or s.has_unfinished_requests():
        # Bursts of arrivals: the waiting queue holds many groups at once, as under load.
        if pending and len(s.waiting) < 64:
            for _ in range(64):
                req = next(arrivals, None)
                if req is None:
                    pending = False
                    break
                s.add_request(req)
        step(s, 13)
    st = s.stats()
    return st.counter("prefix_cache_hits") / st.counter("prefix_cache_queries")


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    r = Report("bench.scheduler: 256 running requests, shared-prefix arrivals, block size 16")
    us, n = steady_state_step_us(args.quick)
    r.figure("step_us_256_running", us)
    r.figure("steps_measured", n)
    fcfs = hit_rate("fcfs", args.quick)
    lpm = hit_rate("lpm", args.quick)
    r.figure("hit_rate_fcfs", fcfs)
    r.figure("hit_rate_lpm", lpm)
    r.ratio("lpm_hit_gain", lpm / fcfs if fcfs else float("inf"))
    r.emit(args.json)


if __name__ == "__main__":
    main()
