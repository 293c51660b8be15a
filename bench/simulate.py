"""The cluster simulator against real runs on this machine, then at the scale it is for.

    python -m bench.simulate [--quick] [--json PATH] [--plot PNG] [--profile PATH] [--save-profile PATH]
                             [--no-validation] [--trace PATH]

1. **Profile** (``pdkv profile``'s code, planner/measure.py): the node the validation runs -- the
   embedded SmolLM2 as a bf16 folder (``--quick``: the 4-layer bench model), one thread, blocks of
   ``--tokens-per-block`` -- or ``--profile PATH``.
2. **Validation**: one trace window through real processes (``bench.replay``'s cluster: router and two
   colocated nodes of one thread each, so the nodes do not share cores) and through the simulator with
   the same window, topology and policy, for round-robin and kv-aware.  Ratios
   ``sim_ttft_p50_error`` and ``sim_ttft_p90_error`` (|simulated - measured| / measured, the worse of
   the two policies; goal <= 0.25) and ``sim_hit_rate_error_points`` (the largest difference in prompt
   hit rate, points; goal <= 3).
3. **At scale**: the whole conversation trace (lengths at 32 tokens a 512-token block, the validated
   scale) on 16 and 64 nodes, colocated and P/D, each policy, with and without the store (cpu + disk
   tiers), at the trace's own rate; and at 16 colocated nodes the highest rate meeting the SLO (TTFT p90
   and ITL p90 within ``--slo-ttft-p90`` / ``--slo-itl-p90``) per policy:
   ``kv_aware_goodput_gain_16`` (kv-aware's over round-robin's), ``goodput_gain_bound_16`` (the bound
   the trace's reuse sets: the highest rate the same 16 nodes meet the SLO at when every reusable prompt
   block is a free hit wherever the request runs -- an infinite cache shared by all, the better of the
   two balancing policies -- over round-robin's; no routing reuses more), their quotient
   ``kv_aware_goodput_gain_16_fraction_of_bound`` (goal >= 0.8), the same two against least-loaded
   (``..._vs_least_loaded``: what reuse alone buys over a balancing baseline) and
   ``store_goodput_gain_16`` (round-robin with the store over without).
4. ``--plot PNG``: TTFT p90 against request rate per policy at 16 colocated nodes (matplotlib).

``--quick`` runs the pipeline small (the tiny model's quick profile, 2000 trace lines at scale, 16 nodes,
no real runs: starting the clusters alone takes longer than a minute): a check, not a measurement.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Report, parser
from bench.replay import MODELS, figures, prepare_model, run_mode
from engine.engine_config import EngineConfig
from planner.measure import measure_profile
from planner.plan import Targets, at_rate, max_rate
from planner.profile import Profile, ProfileError
from planner.sim import ClusterSpec, SimResult, simulate
from planner.trace import DEFAULT_TRACE, Arrival, Scale, TraceError, arrivals, ceiling, read_trace
from planner.workload import as_arrivals, scale_trace

POLICY_MODES = {"round-robin": "rr", "kv-aware": "kv"}
STORE = (("cpu", 32 << 30), ("disk", 256 << 30))
# A node's KV cache at scale: 64k tokens (1.4 GiB of SmolLM2's bf16 KV), whatever the validation's node had.
NODE_KV_TOKENS = 65536


@dataclasses.dataclass(frozen=True)
class Validation:
    requests: int
    sample: float
    time_scale: float
    max_input: int
    max_output: int
    node_blocks: int
    tokens_per_block: int = 32


FULL = Validation(requests=120, sample=0.04, time_scale=0.3, max_input=1024, max_output=8, node_blocks=640)
QUICK = Validation(requests=40, sample=0.04, time_scale=0.15, max_input=512, max_output=8, node_blocks=160)


def node_profile(model: Path, v: Validation, quick: bool) -> Profile:
    """The validation's node, timed: one thread, its block size and cache."""
    config = EngineConfig(
        model=str(model), device="cpu", block_size=v.tokens_per_block, num_blocks=v.node_blocks
    )
    with tempfile.TemporaryDirectory(prefix="pdkv-bench-sim-") as tmp:
        tiers = {"cpu": "cpu:1GiB", "disk": f"disk:{tmp}:1GiB"}
        profile = measure_profile(config, threads=1, quick=quick, repeat=1 if quick else 3, tiers=tiers)
    what = "the 4-layer bench model" if quick else "SmolLM2-135M-Instruct (embedded GGUF as a bf16 folder)"
    return dataclasses.replace(profile, model={**profile.model, "path": what})


def validate(
    model: Path, model_name: str, profile: Profile, v: Validation, trace: Path, report: Report
) -> dict[str, float]:
    """Real runs and simulations of one window; the errors between them."""
    choice = MODELS[model_name]
    scale = Scale(v.tokens_per_block, v.time_scale, v.max_output, v.max_input)
    rows = read_trace(trace, 0, v.requests, v.sample)
    requests = scale_trace(rows, scale, choice.vocab, choice.low_id)
    work = as_arrivals(requests, v.tokens_per_block)
    report.figure("validation_requests", len(requests))
    report.figure("validation_span_s", requests[-1].arrival_s)
    report.figure("validation_ceiling", ceiling(work, v.tokens_per_block))
    errors: dict[str, float] = {}
    for policy, mode in POLICY_MODES.items():
        real = figures(
            mode,
            run_mode(mode, model, requests, 1.5, v.node_blocks, choice.store, 2, v.tokens_per_block, 1),
            1e9,
            1e9,
        )
        spec = ClusterSpec(
            policy=policy,
            colocated=2,
            block_tokens=v.tokens_per_block,
            node_kv_tokens=v.node_blocks * v.tokens_per_block,
        )
        sim = simulate(profile, spec, work).figures()
        for q in (50, 90):
            measured, simulated = real[f"{mode}_ttft_p{q}_ms"], sim[f"ttft_p{q}_ms"]
            report.figure(f"validation_{mode}_ttft_p{q}_ms_real", measured)
            report.figure(f"validation_{mode}_ttft_p{q}_ms_sim", simulated)
            errors[f"ttft_p{q}_{mode}"] = abs(simulated - measured) / measured
        for what in ("local", "store"):
            measured, simulated = real[f"{mode}_hit_{what}"], sim[f"hit_{what}"]
            report.figure(f"validation_{mode}_hit_{what}_real", measured)
            report.figure(f"validation_{mode}_hit_{what}_sim", simulated)
            errors[f"hit_{what}_{mode}"] = abs(simulated - measured) * 100
        report.figure(f"validation_{mode}_errors", real[f"{mode}_errors"])
        report.figure(f"validation_{mode}_itl_p50_ms_real", real[f"{mode}_itl_p50_ms"])
        report.figure(f"validation_{mode}_itl_p50_ms_sim", sim["itl_p50_ms"])
    return errors


def at_scale(
    profile: Profile, work: list[Arrival], targets: Targets, quick: bool, report: Report
) -> dict[str, Any]:
    """The whole trace's figures at the trace's rate, and the goodput searches at 16 nodes."""
    tpb = 32
    sizes = (16,) if quick else (16, 64)
    base = ClusterSpec(
        block_tokens=tpb, colocated=1, node_kv_tokens=NODE_KV_TOKENS, give_up_s=5 * targets.ttft_p90_s
    )
    for nodes in sizes:
        for shape in ("colocated", "pd"):
            for policy in ("round-robin", "least-loaded", "kv-aware"):
                for store in ((), STORE):
                    if shape == "colocated":
                        spec = dataclasses.replace(base, policy=policy, store=store, colocated=nodes)
                    else:
                        half = nodes // 2
                        spec = dataclasses.replace(
                            base, policy=policy, store=store, colocated=0, prefill=half, decode=nodes - half
                        )
                    started = time.perf_counter()
                    f = simulate(profile, spec, work).figures()
                    name = (
                        f"scale_{nodes}_{shape}_{POLICY_MODES.get(policy, 'll')}{'_store' if store else ''}"
                    )
                    for key in (
                        "ttft_p50_ms",
                        "ttft_p90_ms",
                        "itl_p90_ms",
                        "hit_local",
                        "hit_store",
                        "overloaded",
                    ):
                        report.figure(f"{name}_{key}", f[key])
                    report.figure(f"{name}_sim_s", time.perf_counter() - started)
    rates: dict[str, float] = {}
    runs: dict[str, SimResult] = {}
    colocated = dataclasses.replace(base, colocated=16)
    steps = 5 if quick else 9
    for name, spec in (
        ("rr", dataclasses.replace(colocated, policy="round-robin")),
        ("ll", dataclasses.replace(colocated, policy="least-loaded")),
        ("kv", dataclasses.replace(colocated, policy="kv-aware")),
        ("rr_store", dataclasses.replace(colocated, policy="round-robin", store=STORE)),
    ):
        rate, outcome = max_rate(profile, spec, work, targets, low=1 / 16, high=64.0, steps=steps)
        rates[name] = rate
        report.figure(f"goodput_16_{name}_rate_factor", rate)
        if outcome is not None:
            runs[name] = outcome.result
            report.figure(f"goodput_16_{name}_req_s", len(work) / max(outcome.result.span_s, 1e-9))
    return {"rates": rates, "runs": runs, "colocated": colocated}


def ceiling_rate(
    profile: Profile, work: list[Arrival], colocated: ClusterSpec, targets: Targets, steps: int
) -> float:
    """The highest rate meeting the targets on the same nodes when every reusable prompt block is a free
    hit wherever the request runs (an infinite cache shared by all, loaded at no cost): no routing can
    reuse more, so no policy's goodput exceeds it.  The better of the two balancing policies."""
    best = 0.0
    for policy in ("least-loaded", "kv-aware"):
        spec = dataclasses.replace(colocated, policy=policy, oracle=True)
        rate, _ = max_rate(profile, spec, work, targets, low=1 / 16, high=64.0, steps=steps)
        best = max(best, rate)
    return best


def plot(profile: Profile, work: list[Arrival], colocated: ClusterSpec, center: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    factors = [center * 2 ** (k / 2) for k in range(-4, 5)]
    trace_rate = len(work) / (work[-1].arrival_s - work[0].arrival_s)  # requests/s offered at x1
    for policy in ("round-robin", "least-loaded", "kv-aware"):
        spec = dataclasses.replace(colocated, policy=policy, give_up_s=None)
        points = []
        for f in factors:
            result = simulate(profile, spec, at_rate(work, f))
            points.append((trace_rate * f, result.figures()["ttft_p90_ms"] / 1e3))
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy)
    ax.set_xlabel(f"offered request rate (requests/s; the trace's own is {trace_rate:.2f})")
    ax.set_ylabel("TTFT p90 (s)")
    ax.set_yscale("log")
    ax.set_title(f"conversation trace, 16 colocated nodes ({profile.machine.get('cpu', '?')}, 1 thread each)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0] if __doc__ else "simulate")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--profile", type=Path, default=None, help="use this profile instead of measuring one")
    p.add_argument("--save-profile", type=Path, default=None, help="write the measured profile here")
    p.add_argument(
        "--no-validation", action="store_true", help="skip the real runs (--quick skips them: minutes)"
    )
    p.add_argument("--plot", type=Path, default=None, help="write TTFT p90 against rate here (PNG)")
    p.add_argument("--slo-ttft-p90", type=float, default=None, help="seconds (default: from the profile)")
    p.add_argument("--slo-itl-p90", type=float, default=None, help="seconds (default: from the profile)")
    args: Any = p.parse_args(argv)
    for name in ("slo_ttft_p90", "slo_itl_p90"):
        value = getattr(args, name)
        if value is not None and not (0 < value < math.inf):
            p.error(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value}")
    # Bad input -- the trace (every line it will read), the profile -- said in a line, before any model
    # is made or measured (an outside probe met tracebacks).
    try:
        if not read_trace(args.trace, 0, 2000 if args.quick else None):
            raise TraceError(f"{args.trace}: no request in it")
        given = Profile.load(args.profile) if args.profile is not None else None
    except (TraceError, ProfileError) as exc:
        raise SystemExit(f"bench.simulate: {exc}") from None
    v = QUICK if args.quick else FULL
    model_name = "tiny" if args.quick else "smollm2"
    r = Report(f"bench.simulate: {'quick, ' if args.quick else ''}model {model_name}")
    errors: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="pdkv-bench-sim-") as tmp:
        model = prepare_model(model_name, Path(tmp) / "model")
        if given is not None:
            profile = given
        else:
            profile = node_profile(model, v, args.quick)
            if args.save_profile is not None:
                profile.save(args.save_profile)
        r.figure("profile_decode_step_b1_ms", profile.step.decode_seconds(1, 512) * 1e3)
        r.figure("profile_prefill_ms_per_token", profile.step.prefill_token_s * 1e3)
        r.figure("profile_fit_error_p90", profile.step.error_p90)
        if not args.no_validation and not args.quick:
            errors = validate(model, model_name, profile, v, args.trace, r)
    if errors:
        r.ratio(
            "sim_ttft_p50_error", max(e for k, e in errors.items() if k.startswith("ttft_p50")), "<= 0.25"
        )
        r.ratio(
            "sim_ttft_p90_error", max(e for k, e in errors.items() if k.startswith("ttft_p90")), "<= 0.25"
        )
        r.ratio(
            "sim_hit_rate_error_points", max(e for k, e in errors.items() if k.startswith("hit_")), "<= 3"
        )
    rows = read_trace(args.trace, 0, 2000 if args.quick else None)
    work = arrivals(rows, Scale(32, 1.0, 1 << 30, profile.engine.max_model_len))
    r.figure("scale_requests", len(work))
    r.figure("scale_ceiling", ceiling(work, 32))
    # The SLO, from the profile: TTFT twice what an idle node gives the trace's 90th-percentile prompt;
    # ITL ten times a decode step of 8 rows at 1024 tokens of context (room for prompt chunks beside).
    solo = sorted(profile.step.prefill_seconds(a.input_tokens) for a in work)
    ttft = args.slo_ttft_p90 or 2 * solo[int(0.9 * (len(solo) - 1))]
    itl = args.slo_itl_p90 or 10 * profile.step.decode_seconds(8, 8 * 1024)
    targets = Targets(ttft, itl)
    r.figure("slo_ttft_p90_s", ttft)
    r.figure("slo_itl_p90_s", itl)
    scale = at_scale(profile, work, targets, args.quick, r)
    rates = scale["rates"]
    if rates.get("rr"):
        gain = rates["kv"] / rates["rr"]
        ceiling_16 = ceiling_rate(profile, work, scale["colocated"], targets, 5 if args.quick else 9)
        r.figure("goodput_16_ceiling_rate_factor", ceiling_16)
        limit = ceiling_16 / rates["rr"]
        r.ratio("kv_aware_goodput_gain_16", gain, "> 1")
        r.ratio("goodput_gain_bound_16", limit, "figure")
        r.ratio("kv_aware_goodput_gain_16_fraction_of_bound", gain / limit, ">= 0.8")
        r.ratio("store_goodput_gain_16", rates["rr_store"] / rates["rr"], "figure")
        if rates.get("ll"):  # the same against a balancing baseline: the gain reuse alone buys
            r.ratio("kv_aware_goodput_gain_16_vs_least_loaded", rates["kv"] / rates["ll"], "figure")
            r.ratio("goodput_gain_bound_16_vs_least_loaded", ceiling_16 / rates["ll"], "figure")
        if args.plot is not None:
            plot(profile, work, scale["colocated"], rates["rr"], args.plot)
            print(f"bench.simulate: wrote {args.plot}")
    r.emit(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
