"""``pdkv profile``: a node's costs measured on the real engine and model, on this machine.

- **Steps**: the engine (the node's own ``EngineConfig``) runs a grid of prompts -- new tokens after
  cached ones -- and of decode batches at several contexts; every step is timed whole (``step()``:
  scheduling, forward, outputs) with what it computed (``LLMEngine.step_observer``), and ``StepCost``
  is fitted to all of them (least squares on relative error, every coefficient kept >= 0).  The grid
  runs ``repeat`` times after a warm-up; the spread is the step times' median relative deviation
  between repeats.
- **Loads**: per store tier, an engine with the ``offload`` connector on that tier computes prompts
  (saved), forgets its local cache, and runs them again: the connector's load time
  (``kv_load_seconds.offload``) over the tokens it loaded, at several lengths.
- **p2p**: the p2p connector's ``BlockPuller`` pulling the engine's own block layout from a
  ``BlockServer`` over loopback, at several sizes.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.snapshot import snapshot
from planner.profile import EngineShape, LinearCost, Profile, StepCost

Progress = Callable[[str], None]


@dataclass(frozen=True)
class StepSample:
    chunks: tuple[tuple[int, int], ...]  # prompt chunks: (tokens, context before them)
    rows: int  # decode rows
    context: int  # their contexts summed
    seconds: float

    def features(self) -> list[float]:
        attention = sum(n * (ctx + (n + 1) / 2) for n, ctx in self.chunks)
        tokens = sum(n for n, _ in self.chunks)
        return [
            0.0 if self.chunks else 1.0,
            1.0 if self.chunks else 0.0,
            tokens,
            attention,
            self.rows,
            self.context,
        ]


def sample_of(step: SchedulerOutput, seconds: float) -> StepSample | None:
    """What one step computed (None for a step that computed nothing)."""
    chunks, rows, context = [], 0, 0
    for sr in step.scheduled:
        n = sr.num_tokens
        if n == 1:
            rows += 1
            context += sr.start_position + 1
        elif n > 1:
            chunks.append((n, sr.start_position))
    if not chunks and not rows:
        return None
    return StepSample(tuple(chunks), rows, context, seconds)


def fit_steps(samples: Sequence[StepSample]) -> StepCost:
    """``StepCost`` by least squares on relative error; a coefficient that comes out negative is held at
    zero and the rest fitted again."""
    x = np.array([s.features() for s in samples], dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    w = 1.0 / y
    active = [j for j in range(x.shape[1]) if x[:, j].any()]
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    error = np.abs(x @ coef - y) / y
    d_base, p_base, p_token, p_attention, d_row, d_context = (float(c) for c in coef)
    return StepCost(
        d_base,
        p_base,
        p_token,
        p_attention,
        d_row,
        d_context,
        samples=len(samples),
        error_p50=float(np.percentile(error, 50)),
        error_p90=float(np.percentile(error, 90)),
    )


def fit_linear(points: Sequence[tuple[float, float]]) -> LinearCost:
    """``base + amount x per`` through (amount, seconds) points, both >= 0."""
    a = np.array([p[0] for p in points], dtype=np.float64)
    t = np.array([p[1] for p in points], dtype=np.float64)
    per, base = np.polyfit(a, t, 1) if len(set(a.tolist())) > 1 else (float(t.mean() / a.mean()), 0.0)
    if base < 0:
        per, base = float((a * t).sum() / (a * a).sum()), 0.0
    per = max(0.0, float(per))
    fitted = base + a * per
    spread = float(np.max(np.abs(fitted - t) / t)) if len(t) else 0.0
    return LinearCost(float(base), per, len(points), spread)


class _Runner:
    """Drives one engine through prompts, collecting its steps."""

    def __init__(self, engine: LLMEngine, vocab: int, low: int = 20) -> None:
        self.engine = engine
        self.rng = random.Random(0)
        self.vocab, self.low = vocab, low
        self.samples: list[StepSample] = []
        self.recording = True
        self._ids = 0

        def observe(step: SchedulerOutput, seconds: float) -> None:
            sample = sample_of(step, seconds)
            if sample is not None and self.recording:
                self.samples.append(sample)

        engine.step_observer = observe

    def tokens(self, n: int) -> list[int]:
        return [self.low + self.rng.randrange(self.vocab - self.low) for _ in range(n)]

    def run(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> None:
        for prompt in prompts:
            self._ids += 1
            self.engine.add_request(
                f"profile-{self._ids}", list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            )
        while self.engine.has_unfinished_requests():
            # A step costs the node all of ``step()`` -- scheduling, the forward, the outputs -- not only
            # the runner's part the observer is told: the sample gets the whole time.
            before = len(self.samples)
            started = time.perf_counter()
            self.engine.step()
            elapsed = time.perf_counter() - started
            if len(self.samples) == before + 1:
                self.samples[-1] = dataclasses.replace(self.samples[-1], seconds=elapsed)
        self.engine.drain()

    def prefill(self, new: int, cached: int) -> None:
        """A prompt of ``new`` tokens after ``cached`` ones its local cache holds."""
        prefix = self.tokens(cached)
        if cached:
            self.recording, was = False, self.recording
            self.run([prefix], 1)
            self.recording = was
        self.run([prefix + self.tokens(new)], 1)

    def decode(self, batch: int, context: int, steps: int) -> None:
        """``batch`` requests decoding ``steps`` tokens at about ``context`` tokens each; their prompts share
        all but their last block (cheap to prefill; the decode rows still attend to all of it)."""
        bs = self.engine.kv_spec.block_size
        shared = self.tokens(max(0, context - bs))
        self.recording, was = False, self.recording
        self.run([shared], 1)
        self.recording = was
        self.run([shared + self.tokens(bs) for _ in range(batch)], steps + 1)


def _grid(quick: bool, limit: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    if quick:
        prefill = [(16, 0), (128, 0), (512, 0), (128, 256)]
        decode = [(1, 64), (4, 64), (8, 256)]
    else:
        prefill = [(n, c) for n in (16, 64, 256, 1024, 2048) for c in (0, 512, 2048)]
        prefill += [(4096, 0)]
        decode = [(b, c) for b in (1, 2, 4, 8, 16, 32, 64) for c in (128, 1024, 3072)]
    keep = [(n, c) for n, c in prefill if n + c < limit]
    return keep, [(b, c) for b, c in decode if c + 64 < limit]


def measure_steps(
    engine: LLMEngine, *, quick: bool, repeat: int, progress: Progress
) -> tuple[StepCost, float]:
    """The fitted step cost, and the spread between repeats of the grid."""
    runner = _Runner(engine, engine.model.config.vocab_size)
    prefill, decode = _grid(quick, engine.max_model_len)
    steps = 8 if quick else 24
    runner.recording = False
    runner.prefill(64, 0)  # warm-up: first calls pay one-time costs
    runner.decode(2, 64, 4)
    rounds: list[list[StepSample]] = []
    for r in range(repeat):
        progress(f"steps: round {r + 1} of {repeat}")
        runner.samples = []
        runner.recording = True
        for new, cached in prefill:
            runner.prefill(new, cached)
        for batch, context in decode:
            runner.decode(batch, context, steps)
        rounds.append(runner.samples)
    samples = [s for round_ in rounds for s in round_]
    cost = fit_steps(samples)
    spread = 0.0
    if len(rounds) > 1:
        n = min(len(r) for r in rounds)
        deviations = []
        for i in range(n):
            times = [r[i].seconds for r in rounds]
            mid = statistics.median(times)
            deviations.append(max(abs(t - mid) for t in times) / mid)
        spread = statistics.median(deviations)
    return cost, spread


def measure_loads(
    config: EngineConfig, tier_specs: dict[str, str], *, quick: bool, progress: Progress
) -> dict[str, LinearCost]:
    """Per tier: the offload connector's load seconds against the tokens it loaded."""
    from connectors.registry import KVConnectorConfig

    out: dict[str, LinearCost] = {}
    lengths = (64, 512) if quick else (64, 256, 1024, 2048)
    for kind, spec in tier_specs.items():
        progress(f"loads: {kind} ({spec})")
        connector = KVConnectorConfig(name="offload", options={"kv_store": spec})
        engine = LLMEngine(dataclasses.replace(config, kv_connector=connector))
        try:
            runner = _Runner(engine, engine.model.config.vocab_size)
            runner.recording = False
            points = []
            for i, n in enumerate((64, *lengths)):  # the first one warms up
                prompt = runner.tokens(n + 1)
                runner.run([prompt], 1)  # computed and saved
                assert engine.reset_prefix_cache()
                before = snapshot(engine)
                runner.run([prompt], 1)  # loaded
                after = snapshot(engine)
                key, hist = "prompt_tokens.external_kv_transfer", "kv_load_seconds.offload"
                loaded = after.stats.counters.get(key, 0.0) - before.stats.counters.get(key, 0.0)
                old = before.histograms[hist].total if hist in before.histograms else 0.0
                if i and loaded:
                    points.append((loaded, after.histograms[hist].total - old))
            if not points:
                raise RuntimeError(f"the {kind} tier ({spec}) loaded nothing back: is it too small?")
            out[kind] = fit_linear(points)
        finally:
            engine.shutdown()
    return out


def measure_p2p(engine: LLMEngine, *, quick: bool, progress: Progress) -> LinearCost:
    """Pulls of the engine's block layout over loopback by the p2p connector's own server and puller."""
    import torch

    from connectors.p2p_client import BlockPuller, PullJob
    from connectors.p2p_server import BlockServer
    from connectors.p2p_transfer import BlockViews, TransferStats

    progress("p2p pulls")
    spec = engine.kv_spec
    # a pull's fixed cost (ms) dwarfs 64 blocks of a small model's bytes: the quick sizes span 4 to 256, and
    # the line goes through each size's median (a noisy host's one slow pull tilted a fit of every sample
    # below zero, a per-byte cost of 0)
    sizes = (4, 256) if quick else (4, 32, 128, 512)
    blocks = max(sizes)
    shape = (blocks, *spec.shape[1:])
    src = torch.empty(shape, dtype=spec.dtype).uniform_()
    dst = torch.zeros(shape, dtype=spec.dtype)
    namespace = bytes(16)
    server = BlockServer(BlockViews(src), "tcp://127.0.0.1:0", stats=TransferStats(), namespace=namespace)
    puller = BlockPuller(BlockViews(dst), stats=TransferStats(), namespace=namespace, threads=1)
    hashes = tuple(i.to_bytes(32, "little") for i in range(blocks))
    times: dict[int, list[float]] = {n: [] for n in sizes}
    try:
        for i, n in enumerate((sizes[0], *sizes) * 3):
            rid = f"profile-{i}"
            server.add_lease(rid, range(n), hashes[:n], 60.0)
            while not server.is_sealed(rid):
                time.sleep(0.0005)
            start = time.perf_counter()
            result = puller.submit(PullJob(rid, server.endpoint, rid, 0, tuple(range(n)), hashes[:n])).wait(
                60
            )
            elapsed = time.perf_counter() - start
            if result is None or not result.ok:
                raise RuntimeError(f"a p2p pull of {n} blocks failed: {result}")
            puller.take_finished()
            if i:  # the first pull warms up
                times[n].append(elapsed)
    finally:
        puller.close()
        server.close()
    block = BlockViews(src).block_nbytes
    return fit_linear([(n * block, statistics.median(t)) for n, t in times.items()])


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_profile(
    config: EngineConfig,
    *,
    threads: int | None,
    quick: bool = False,
    repeat: int = 3,
    tiers: dict[str, str] | None = None,
    progress: Progress = lambda _: None,
) -> Profile:
    """Everything ``pdkv profile`` writes: ``config`` is the node's engine configuration."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    config = dataclasses.replace(config, kv_connector=None, enable_kv_events=False)
    started = time.time()
    engine = LLMEngine(config)
    try:
        progress(
            f"model loaded: {engine.model.config.num_layers} layers, KV {engine.kv_spec.num_blocks} blocks"
        )
        step, spread = measure_steps(engine, quick=quick, repeat=max(1, repeat), progress=progress)
        p2p = measure_p2p(engine, quick=quick, progress=progress)
        spec = engine.kv_spec
        shape = EngineShape(
            block_size=spec.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            num_blocks=spec.num_blocks,
            kv_bytes_per_token=spec.bytes_per_block // spec.block_size,
            # The model's context (or the one asked for), not this node's cache's cut of it: a plan may
            # size nodes with more KV than the profiled one.
            max_model_len=config.max_model_len or engine.model.config.max_position_embeddings,
        )
        model = {
            "path": str(config.model or "embedded"),
            "fingerprint": engine.namespace.model_fingerprint,
            "dtype": str(spec.dtype).removeprefix("torch."),
            "weights": "quantized" if engine.model.quantized else "dense",
            "deterministic": engine.determinism.on,
        }
    finally:
        engine.shutdown()
    with tempfile.TemporaryDirectory(prefix="pdkv-profile-") as tmp:
        specs = tiers if tiers is not None else {"cpu": "cpu:1GiB", "disk": f"disk:{tmp}:1GiB"}
        loads = measure_loads(config, specs, quick=quick, progress=progress)
    machine = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    repeat_info = {"runs": repeat, "step_spread": spread, "seconds": round(time.time() - started, 1)}
    return Profile(machine, model, shape, step, loads, p2p, repeat_info)
