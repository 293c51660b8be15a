"""Multi-LoRA on the embedded model: decode and prefill with adapters mixed in the batch, against the
base model at the same batch, in the same run.

    python -m bench.lora [--quick] [--json PATH] [--batch 32] [--tokens 48] [--rank 16]

Adapters of rank ``--rank`` on all seven modules (q/k/v/o/gate/up/down), random weights written as PEFT
folders.  Two engines in one process: the base model with LoRA off (the baseline), and one with LoRA on
(8 slots, 8 adapters).  Each round decodes every case at the same time as a baseline batch, one step of
each engine in turn, on fresh prompts: the round's ratio is the median over its step pairs of the base
step's time over the case step's; prefill runs the case right next to a baseline run (which goes first
alternates).  A ratio is the median over the rounds, a figure the median rate.

    lora_base_only_fraction   LoRA on, no adapter in the batch / base      (target >= 0.98)
    lora_1_fraction           every request under one adapter / base       (target >= 0.9)
    lora_4_fraction           4 adapters mixed in the batch / base         (target >= 0.8)
    lora_8_fraction           8 adapters mixed in the batch / base         (target >= 0.75)
    lora_prefill_4_fraction   prefill tokens/s, 4 adapters mixed / base    (target >= 0.85)

Decode tokens/s: the batch size over the median time of a decode step (every request past its first
token).  (Until 2026-12-04 decode cases too ran right after or before a whole baseline run: its pairs
scattered by 5-15% on a shared VM.)
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import Report, parser

_ids = itertools.count()
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, config: Any, rank: int, seed: int) -> Path:
    """A PEFT-format adapter of ``rank`` on every module of every layer, small random weights."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}
    shapes |= {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    tensors = {}
    for layer in range(config.num_layers):
        for m in MODULES:
            out, inp = shapes[m]
            parent = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{parent}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES)}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return folder


def paired_decode(
    base: Any, case: Any, batch: int, prompts: Any, params: Any, adapters: list[str | None], first: int
) -> tuple[float, float, float]:
    """The base engine and the case's decode a batch each at the same time, one step of each in turn
    (``first`` says which steps first; it swaps every step): (base tokens/s, case tokens/s, the median
    over the step pairs of base step time / case step time).  Pairing single steps (~50 ms apart) cancels
    the drifts of a shared VM, which move whole runs by 5-10%; a rate is the batch over the median step
    (a step that a neighbour's load slowed does not move a median).  Timed once every request of both
    batches has its first token."""
    engines = (base.engine, case.engine)
    mixes: tuple[list[str | None], list[str | None]] = ([None] * batch, adapters)
    for engine, mix in zip(engines, mixes, strict=True):
        ids = [f"d{next(_ids)}" for _ in range(batch)]
        for rid, prompt, adapter in zip(ids, prompts(batch, 64), mix, strict=True):
            engine.add_request(rid, prompt, params, adapter=adapter)
        started: set[str] = set()
        while len(started) < batch:
            started |= {o.request_id for o in engine.step() if o.new_token_ids}
    times: tuple[list[float], list[float]] = ([], [])
    step = first
    while all(e.has_unfinished_requests() for e in engines):
        for which in (step % 2, 1 - step % 2):
            t0 = time.perf_counter()
            engines[which].step()
            times[which].append(time.perf_counter() - t0)
        step += 1
    for engine in engines:  # the last steps (a request or two finishing) are not timed
        while engine.has_unfinished_requests():
            engine.step()
    ratio = statistics.median(b / c for b, c in zip(times[0], times[1], strict=True))
    return batch / statistics.median(times[0]), batch / statistics.median(times[1]), ratio


def prefill_rate(llm: Any, prompts: list[list[int]], params: Any, adapters: list[str | None]) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params, adapters=adapters)
    return sum(len(p) for p in prompts) / (time.perf_counter() - start)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if args.quick:
        args.tokens, args.rounds = 16, 2

    from engine import LLM, SamplingParams

    base = LLM(None, num_blocks=4096, max_num_seqs=64)
    config = base.engine.model.config
    tmp = Path(tempfile.mkdtemp(prefix="pdkv-bench-lora-"))
    names: list[str | None] = [f"a{i}" for i in range(8)]
    loras = tuple((f"a{i}", str(write_adapter(tmp / f"a{i}", config, args.rank, i))) for i in range(8))
    lora = LLM(None, num_blocks=4096, max_num_seqs=64, loras=loras, max_loras=8, max_lora_rank=args.rank)
    vocab, batch = config.vocab_size, args.batch
    rng = random.Random(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]

    decode = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    mixes: dict[str, list[str | None]] = {
        "base_only": [None] * batch,
        "1": [names[0]] * batch,
        "4": [names[i % 4] for i in range(batch)],
        "8": [names[i % 8] for i in range(batch)],
    }
    rates: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}

    def record(key: str, base_rate: float, case_rate: float, ratio: float) -> None:
        rates.setdefault(key, []).append(case_rate)
        rates.setdefault(f"base_for_{key}", []).append(base_rate)
        ratios.setdefault(key, []).append(ratio)

    def pair(key: str, first: int, baseline: Any, case: Any) -> None:
        """One case and its baseline back to back (in turns which goes first): their ratio cancels the
        machine's slow drifts, which on a shared VM move a rate by 5-10% from minute to minute."""
        got: dict[str, float] = {}
        for name, run in (("base", baseline), (key, case))[:: 1 if first % 2 == 0 else -1]:
            got[name] = run()
        record(key, got["base"], got[key], got[key] / got["base"])

    for r in range(args.rounds):
        for key, mix in mixes.items():
            record(key, *paired_decode(base, lora, batch, prompts, decode, mix, r))
        # Prefill: 4 prompts of 512 tokens, one step of 2048 tokens, under 4 adapters against the base.
        pair(
            "prefill_4",
            r,
            lambda: prefill_rate(base, prompts(4, 512), one, [None] * 4),
            lambda: prefill_rate(lora, prompts(4, 512), one, names[:4]),
        )

    print("per-round ratios:", {k: [round(x, 3) for x in v] for k, v in ratios.items()})
    report = Report("bench.lora")
    print(f"cpu: {_cpu()}, torch threads {torch.get_num_threads()}, dtype {lora.engine.kv_spec.dtype}")
    med = {k: statistics.median(v) for k, v in rates.items()}
    report.figure("base_decode_tok_s", statistics.median([med[f"base_for_{k}"] for k in mixes]))
    for key in mixes:
        report.figure(f"lora_{key}_decode_tok_s", med[key])
    report.figure("base_prefill_tok_s", med["base_for_prefill_4"])
    report.figure("lora_prefill_4_tok_s", med["prefill_4"])
    targets = {"base_only": ">= 0.98", "1": ">= 0.9", "4": ">= 0.8", "8": ">= 0.75", "prefill_4": ">= 0.85"}
    for key, target in targets.items():
        report.ratio(f"lora_{key}_fraction", statistics.median(ratios[key]), target)
    report.emit(args.json)


if __name__ == "__main__":
    main()
