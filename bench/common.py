"""Shared plumbing for benchmarks: flags, timing, and the ``{"figures", "ratios"}`` JSON report.

Every benchmark measures its baseline in the same run and prints the ratio; none is a test assertion.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a small size that runs in under a minute")
    p.add_argument("--json", type=Path, metavar="PATH", help='write {"figures": {...}, "ratios": {...}}')
    return p


def timings(fn: Callable[[], Any], *, repeat: int, warmup: int = 1) -> list[float]:
    """Wall times of ``repeat`` calls of ``fn`` (seconds), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def best_of(fn: Callable[[], Any], *, repeat: int, warmup: int = 1) -> float:
    """Minimum wall time of ``fn`` over ``repeat`` runs: the least noisy estimate on 2 cores."""
    return min(timings(fn, repeat=repeat, warmup=warmup))


def best_of_interleaved(
    fns: dict[str, Callable[[], Any]], *, repeat: int, warmup: int = 1
) -> dict[str, float]:
    """Minimum wall time of each function, the functions run in turns: a load spike from elsewhere on
    the machine hits every contender alike instead of skewing their ratio."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def medians_in_turns(
    rounds: int,
    first: Callable[[], list[float]],
    second: Callable[[], list[float]],
    *,
    pause_s: float = 0.0,
) -> tuple[float, float]:
    """The medians of the times ``first()`` and ``second()`` return, each called ``rounds`` times in
    turns (which goes first alternating, ``pause_s`` before each call), so that a shared VM's speed, which
    moves by up to 2x within minutes, weighs on both alike."""
    times: tuple[list[float], list[float]] = ([], [])
    sides = (first, second)
    for r in range(rounds):
        for side in (0, 1) if r % 2 else (1, 0):
            if pause_s:
                time.sleep(pause_s)
            times[side].extend(sides[side]())
    return statistics.median(times[0]), statistics.median(times[1])


def random_prompts(
    n: int, lengths: tuple[int, int], vocab: int, seed: int, *, low: int = 0
) -> list[list[int]]:
    """``n`` prompts of random ids in ``[low, vocab)`` with lengths drawn from ``lengths`` (inclusive)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(low, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


@dataclass
class Report:
    name: str
    figures: dict[str, float] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)
    targets: dict[str, str] = field(default_factory=dict)

    def figure(self, key: str, value: float) -> None:
        self.figures[key] = round(float(value), 6)

    def ratio(self, key: str, value: float, target: str | None = None) -> None:
        self.ratios[key] = round(float(value), 4)
        if target:
            self.targets[key] = target

    def emit(self, json_path: Path | None) -> None:
        print(f"== {self.name} ({platform.node()}, {time.strftime('%Y-%m-%d %H:%M')})")
        for k, v in self.figures.items():
            print(f"  {k:<40} {v:>14.4f}")
        for k, v in self.ratios.items():
            target = f"   (target {self.targets[k]})" if k in self.targets else ""
            print(f"  {k:<40} {v:>14.3f}{target}")
        if json_path is not None:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(
                json.dumps({"figures": self.figures, "ratios": self.ratios}, indent=2) + "\n"
            )


def run_transformers(model: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """transformers' batched greedy ``generate`` (left padding, a mask): seconds and output tokens."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    elapsed = time.perf_counter() - start
    return elapsed, out[:, width:].tolist()
