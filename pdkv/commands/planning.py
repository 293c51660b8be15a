"""``pdkv profile`` and ``pdkv plan``: capacity planning (docs/planning.md).

    pdkv profile --out node.json [engine options as a node takes them] [--threads N] [--quick]
    pdkv plan --trace FILE --profile node.json --slo-ttft-p90 S --slo-itl-p90 S [--policy P] [--store TIERS]

``profile`` times the engine a node with the same options would run (planner/measure.py); ``plan``
simulates the workload on clusters of that node (planner/sim) and prints the smallest one that meets
the targets beside the next smaller (planner/plan.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from planner.profile import Profile

# A cluster whose queued prompts would take its nodes this many times the TTFT target is overloaded:
# its run stops there.
GIVE_UP_FACTOR = 5.0


def register(subparsers: Any) -> None:
    from node.config import add_engine_arguments
    from router.policy import POLICIES

    profile = subparsers.add_parser(
        "profile",
        help="measure a node's costs on this machine (for pdkv plan)",
        description="Time the engine a node with these options runs: steps by prompt and batch, store "
        "loads by tier, p2p pulls; write them as a JSON profile.",
    )
    profile.add_argument("--out", type=Path, default=Path("profile.json"), help="where to write it")
    profile.add_argument("--threads", type=int, default=None, help="compute threads (a node's --threads)")
    profile.add_argument("--quick", action="store_true", help="a small grid (a minute; for tests)")
    profile.add_argument("--repeat", type=int, default=3, help="rounds of the step grid (spread kept)")
    profile.add_argument(
        "--tier",
        action="append",
        default=None,
        metavar="KIND=SPEC",
        help="a store tier to time loads from, as --kv-store gives it, e.g. cpu=cpu:1GiB or "
        "disk=disk:/var/cache/pdkv:8GiB (repeatable; default: cpu, and disk in a temporary folder)",
    )
    add_engine_arguments(profile)
    profile.set_defaults(func=_profile)

    plan = subparsers.add_parser(
        "plan",
        help="the smallest cluster meeting latency targets on a trace, by simulation",
        description="Simulate the workload on clusters of the profiled node (the router's own policy "
        "code routes) and print the smallest that meets the targets beside the next smaller.  Exits 0 "
        "when every shape asked has one, 1 when one has none (the figures are printed all the same), 2 on "
        "bad input.",
    )
    plan.add_argument("--trace", type=Path, default=None, help="a Mooncake-format trace (JSON lines)")
    plan.add_argument("--workload", choices=("trace", "qa"), default="trace")
    plan.add_argument("--profile", type=Path, required=True, help="pdkv profile's JSON")
    plan.add_argument("--slo-ttft-p90", type=float, required=True, metavar="S", help="TTFT p90 target (s)")
    plan.add_argument("--slo-itl-p90", type=float, required=True, metavar="S", help="ITL p90 target (s)")
    plan.add_argument("--policy", choices=POLICIES, default="kv-aware")
    plan.add_argument("--store", default="", metavar="TIERS", help="the store, as --kv-store (cpu, disk)")
    plan.add_argument("--shape", choices=("colocated", "pd", "both"), default="both")
    plan.add_argument("--max-nodes", type=int, default=256)
    plan.add_argument("--start", type=int, default=0, help="first trace line (0-based)")
    plan.add_argument("--requests", type=int, default=None, help="requests from --start (default: all)")
    plan.add_argument("--sample", type=float, default=1.0, help="this fraction of the conversations")
    plan.add_argument("--rate", type=float, default=1.0, help="the trace this many times as fast")
    plan.add_argument("--tokens-per-block", type=int, default=512, help="tokens a trace block stands for")
    plan.add_argument("--max-input", type=int, default=None, help="input cap (default: the model's length)")
    plan.add_argument(
        "--max-output", type=int, default=None, help="output cap (--workload qa: each answer; default 16)"
    )
    plan.add_argument("--qa-users", type=int, default=32, help="--workload qa: users")
    plan.add_argument("--qa-rounds", type=int, default=12, help="--workload qa: rounds a user")
    plan.add_argument("--qa-gap-ms", type=float, default=250.0, help="--workload qa: ms between requests")
    plan.add_argument("--seed", type=int, default=7, help="--workload qa: its questions and order")
    plan.add_argument("--node-kv-tokens", type=int, default=None, help="KV tokens a node (default: profile)")
    plan.add_argument("--json", type=Path, default=None, help="also write the figures here")
    plan.set_defaults(func=_plan)


def _profile(args: argparse.Namespace) -> int:
    from kvstore.config import StoreConfig
    from node.config import engine_config_from_args
    from planner.measure import measure_profile

    tiers = None
    if args.tier:
        tiers = {}
        for item in args.tier:
            kind, sep, spec = item.partition("=")
            if not sep or not kind or not spec:
                raise SystemExit(f"pdkv profile: --tier {item!r}: give KIND=SPEC, e.g. cpu=cpu:1GiB")
            try:  # before the step grid runs (minutes), not after it
                StoreConfig.parse(spec)
            except ValueError as exc:
                raise SystemExit(f"pdkv profile: --tier {item!r}: {exc}") from None
            tiers[kind] = spec
    if args.repeat < 1:
        raise SystemExit("pdkv profile: --repeat must be at least 1")
    try:
        check_output_file(args.out, "--out")
    except ValueError as exc:
        raise SystemExit(f"pdkv profile: {exc}") from None
    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"pdkv profile: --threads must be at least 1, got {args.threads}")
    config = engine_config_from_args(args)
    profile = measure_profile(
        config,
        threads=args.threads,
        quick=args.quick,
        repeat=args.repeat,
        tiers=tiers,
        progress=lambda line: print(f"pdkv profile: {line}", file=sys.stderr, flush=True),
    )
    profile.save(args.out)
    step = profile.step
    print(
        f"pdkv profile: wrote {args.out} ({profile.machine['cpu']}, {profile.machine['threads']} threads; "
        f"decode step {step.decode_seconds(1, 512) * 1e3:.1f} ms at batch 1, prefill "
        f"{step.prefill_token_s * 1e3:.3f} ms a token; fit error p90 {step.error_p90:.1%})"
    )
    return 0


def _plan(args: argparse.Namespace) -> int:
    from planner.plan import Targets
    from planner.profile import Profile, ProfileError
    from planner.trace import TraceError

    try:
        _check_plan_options(args)
        profile = Profile.load(args.profile)
        targets = Targets(args.slo_ttft_p90, args.slo_itl_p90)
        arrivals, ceil, what = _workload(args, profile)
        store = _store(args.store, profile)
    except (ProfileError, TraceError, ValueError) as exc:
        print(f"pdkv plan: {exc}", file=sys.stderr)
        return 2
    from planner.plan import smallest
    from planner.sim import ClusterSpec

    base = ClusterSpec(
        policy=args.policy,
        colocated=1,
        store=store,
        block_tokens=args.tokens_per_block,
        node_kv_tokens=args.node_kv_tokens,
        give_up_s=GIVE_UP_FACTOR * targets.ttft_p90_s,
    )
    measured = profile_source(args.profile, profile)
    print(f"pdkv plan: {what}; {len(arrivals)} requests, infinite-cache ceiling {ceil:.1%}")
    print(f"  measured: {measured}")
    print(f"  targets: TTFT p90 <= {targets.ttft_p90_s:g} s, ITL p90 <= {targets.itl_p90_s:g} s")
    report: dict[str, Any] = {
        "workload": what,
        "ceiling": ceil,
        "profile": {"file": str(args.profile), "machine": profile.machine, "model": profile.model},
        "shapes": {},
    }
    unmet = 0
    kinds = ("colocated", "pd") if args.shape == "both" else (args.shape,)
    for kind in kinds:
        found, smaller = smallest(
            profile,
            arrivals,
            targets,
            base,
            kind,
            max_nodes=args.max_nodes,
            progress=lambda line: print(f"  ... {line}", file=sys.stderr, flush=True),
        )
        entry: dict[str, Any] = {}
        if found is None:
            unmet += 1
            print(f"  {kind}: no cluster of up to {args.max_nodes} nodes meets the targets")
            if smaller is not None and smaller.result.refused:  # not a capacity answer: say why
                print(
                    f"  {kind}: {smaller.result.refused} of {len(arrivals)} requests need more KV than a "
                    "node holds (prompt and output over its KV tokens): no number of nodes serves them"
                )
        else:
            print(f"  {kind}: {found.spec.describe()} meets the targets")
            entry["chosen"] = {"cluster": found.spec.describe(), **found.result.figures()}
        if smaller is not None:
            entry["smaller"] = {"cluster": smaller.spec.describe(), **smaller.result.figures()}
        _table([o for o in (found, smaller) if o is not None], targets, ceil)
        report["shapes"][kind] = entry
    if args.json is not None:
        try:  # a figure of no request is NaN, which JSON has not: null
            text = json.dumps(_finite(report), indent=2, allow_nan=False)
            args.json.write_text(text + "\n", encoding="utf-8")
        except OSError as exc:
            why = exc.strerror or exc
            print(f"pdkv plan: --json {args.json}: cannot be written ({why})", file=sys.stderr)
            return 2
    return 1 if unmet else 0  # a script tells "no cluster meets the targets" from a plan


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _check_plan_options(args: argparse.Namespace) -> None:
    """Every number an option takes, checked before anything runs: 0 is never "the default", and a rate
    of 0 or NaN is no workload (it divided by zero, or planned nonsense)."""
    if not (math.isfinite(args.rate) and args.rate > 0):
        raise ValueError(f"--rate must be a positive number, got {args.rate}")
    for name in ("max_input", "max_output", "node_kv_tokens", "requests"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.start < 0:
        raise ValueError(f"--start must be a line number >= 0, got {args.start}")
    if not 0 < args.sample <= 1:
        raise ValueError(f"--sample must be a fraction in (0, 1], got {args.sample}")
    least = 2 if args.shape in ("pd", "both") else 1  # a prefill and a decode node
    if args.max_nodes < least:
        raise ValueError(
            f"--max-nodes must be at least {least} for --shape {args.shape}, got {args.max_nodes}"
        )
    if args.workload == "qa":
        if args.trace is not None:
            raise ValueError("--trace is read with --workload trace only (qa makes its own requests)")
        if args.qa_users < 1 or args.qa_rounds < 1:
            got = f"{args.qa_users}, {args.qa_rounds}"
            raise ValueError(f"--qa-users and --qa-rounds must be at least 1, got {got}")
        if not (math.isfinite(args.qa_gap_ms) and args.qa_gap_ms >= 0):
            raise ValueError(f"--qa-gap-ms must be a number >= 0, got {args.qa_gap_ms}")
    if args.json is not None:
        check_output_file(args.json, "--json")


def check_output_file(path: Path, option: str) -> None:
    """A file a command writes at its end, checked before it runs (minutes): not a folder, and in one."""
    if path.is_dir():
        raise ValueError(f"{option} {path} is a folder: give a file")
    if not path.absolute().parent.is_dir():
        raise ValueError(f"{option} {path}: its folder {path.absolute().parent} does not exist")


def _workload(args: argparse.Namespace, profile: Any) -> tuple[list[Any], float, str]:
    from planner.plan import at_rate
    from planner.trace import Scale, arrivals, ceiling, read_trace
    from planner.workload import as_arrivals, qa_workload

    cap = args.max_input if args.max_input is not None else profile.engine.max_model_len
    outputs = args.max_output if args.max_output is not None else (16 if args.workload == "qa" else 1 << 30)
    if min(cap, outputs, args.tokens_per_block) < 1:
        raise ValueError("--max-input, --max-output and --tokens-per-block must be at least 1")
    scale = Scale(args.tokens_per_block, 1.0, outputs, cap)
    if args.workload == "qa":
        gap = args.qa_gap_ms / 1e3
        reqs = qa_workload(args.qa_users, args.qa_rounds, scale, 50000, gap, seed=args.seed)
        out = as_arrivals(reqs, args.tokens_per_block)
        what = f"multi-round QA, {args.qa_users} users x {args.qa_rounds} rounds, seed {args.seed}"
    else:
        if args.trace is None:
            raise ValueError("--trace FILE is required (or --workload qa)")
        rows = read_trace(args.trace, args.start, args.requests, args.sample)
        if not rows:
            raise ValueError(f"no requests in {args.trace} from line {args.start} on")
        out = arrivals(rows, scale)
        what = f"{args.trace.name} lines {args.start}..{rows[-1]['line'] - 1}, {scale.describe()}"
    if args.rate != 1.0:
        out = at_rate(out, args.rate)
        what += f", x{args.rate:g} the rate"
    return out, ceiling(out, args.tokens_per_block), what


def _store(spec: str, profile: Any) -> tuple[tuple[str, int], ...]:
    if not spec:
        return ()
    from kvstore.config import StoreConfig

    tiers = []
    for tier in StoreConfig.parse(spec).tiers:
        size = getattr(tier, "capacity_bytes", None)
        if tier.kind not in profile.loads or size is None:
            have = ", ".join(sorted(profile.loads)) or "none"
            raise ValueError(
                f"--store: tier {tier.kind!r} has no load cost in the profile (it has {have}); "
                f"time it with pdkv profile --tier {tier.kind}=SPEC"
            )
        tiers.append((tier.kind, int(size)))
    return tuple(tiers)


def _table(outcomes: list[Any], targets: Any, ceil: float) -> None:
    if not outcomes:
        return
    rows = [
        ("TTFT p50 / p90 / p99 (s)", "ttft", 1e-3),
        ("ITL p50 / p90 / p99 (ms)", "itl", 1.0),
        ("e2e p50 / p90 / p99 (s)", "e2e", 1e-3),
    ]
    figures = [
        (
            o.spec.describe() + (" (overloaded: cut short)" if o.result.overloaded else ""),
            o.result.figures(),
            o.result,
        )
        for o in outcomes
    ]
    width = max(len(name) for name, _, _ in figures) + 2
    print("    " + " " * 34 + "".join(name.ljust(width) for name, _, _ in figures))
    for label, key, unit in rows:
        cells = [
            " / ".join(f"{f[f'{key}_p{q}_ms'] * unit:.3g}" for q in (50, 90, 99)).ljust(width)
            for _, f, _ in figures
        ]
        print(f"    {label:<34}" + "".join(cells))
    hits = [f"{f['hit_local']:.1%} local, {f['hit_store']:.1%} store".ljust(width) for _, f, _ in figures]
    print(f"    {f'prompt tokens hit (ceiling {ceil:.1%})':<34}" + "".join(hits))
    good = [
        f"{r.goodput(targets.ttft_p90_s, targets.itl_p90_s):.3g} req/s".ljust(width) for _, _, r in figures
    ]
    print(f"    {'goodput':<34}" + "".join(good))


def profile_source(path: object, profile: Profile) -> str:
    """Where the plan's figures come from, in one line: the profile file, its model and its machine (a
    figure without its machine is not a figure: docs/planning.md)."""
    m, model = profile.machine, profile.model
    machine = f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('threads', '?')} thread(s)"
    machine += f", torch {m.get('torch', '?')}"
    return f"{path}: {model.get('path', '?')} ({model.get('dtype', '?')}) on {machine}"
