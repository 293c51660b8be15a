"""``pdkv make-model`` and ``pdkv generate``: write a random model, generate text with the local engine.

``generate`` runs an in-process engine on ``--model`` (a local Hugging Face folder) or, without it, on the
embedded default model (written on first use).  With ``--server HOST:PORT`` it sends the request to a
router instead (``pdkv up``) and streams the tokens as they arrive.  Either way the completion goes to
stdout and one line of stats to stderr.  Torch and the engine are imported inside the command
functions, so ``pdkv --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def register(subparsers: Any) -> None:
    mk = subparsers.add_parser(
        "make-model",
        help="write a small random-weight Llama (Hugging Face format) into OUT_DIR",
        description="Write config.json, model.safetensors and a byte-level tokenizer.json; the same "
        "options and seed always give the same files.",
    )
    mk.add_argument("out_dir", metavar="OUT_DIR", help="folder to create (must not exist, or be empty)")
    mk.add_argument("--layers", type=int, default=4)
    mk.add_argument("--hidden", type=int, default=256)
    mk.add_argument("--heads", type=int, default=8)
    mk.add_argument("--kv-heads", type=int, default=4)
    mk.add_argument("--vocab", type=int, default=512, help="at least 258: 256 byte tokens + bos + eos")
    mk.add_argument("--intermediate-size", type=int, default=0, help="MLP width (0: 8/3 of hidden)")
    mk.add_argument("--max-position-embeddings", type=int, default=4096)
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    mk.set_defaults(func=_make_model)

    gen = subparsers.add_parser(
        "generate",
        help="generate a completion for PROMPT with the local engine",
        description="Generate text.  Without --model, uses the embedded default model (random weights, "
        "written on first use under $PDKV_CACHE_DIR or ~/.cache/pdkv).",
    )
    gen.add_argument("prompt", metavar="PROMPT")
    gen.add_argument("--model", metavar="DIR", help="a local Hugging Face model folder")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None, help="per-request sampling seed (reproducible)")
    gen.add_argument("--stop", action="append", default=[], metavar="STRING", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    remote = gen.add_argument_group("remote (a router started by pdkv up or pdkv serve-router)")
    remote.add_argument(
        "--server",
        metavar="HOST:PORT",
        help="send the request to this router over gRPC instead of running locally",
    )
    remote.add_argument("--cache-salt", default=None, help="isolate prefix-cache entries (tenant)")
    remote.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    engine = gen.add_argument_group("engine (local generation)")
    engine.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    engine.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--num-blocks", type=int, default=None)
    gen.set_defaults(func=_generate)


def _make_model(args: argparse.Namespace) -> int:
    from engine.model.make_model import TinyLlamaSpec, make_model

    spec = TinyLlamaSpec(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_position_embeddings,
        seed=args.seed,
        dtype=args.dtype,
    )
    out = make_model(args.out_dir, spec)
    print(out)
    return 0


def _sampling_params(args: argparse.Namespace) -> Any:
    from engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )


def _generate(args: argparse.Namespace) -> int:
    if args.server:
        return _generate_remote(args)
    return _generate_local(args)


def _generate_remote(args: argparse.Namespace) -> int:
    """Stream the completion from a router, printing text as it arrives."""
    import grpc

    from serving.client import GenerationClient, generate_request

    request = generate_request(args.prompt, _sampling_params(args), cache_salt=args.cache_salt)

    def show(delta: Any) -> None:
        sys.stdout.write(delta.text)
        sys.stdout.flush()

    with GenerationClient(args.server) as client:
        try:
            out = client.generate(request, timeout=args.timeout, on_delta=show)
        except grpc.RpcError as exc:
            sys.stdout.write("\n")
            code = exc.code().name if isinstance(exc, grpc.Call) else "UNKNOWN"
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            print(f"pdkv generate: {args.server}: {code}: {details}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    u = out.usage
    ttft_ms = (out.time_to_first_token_s or float("nan")) * 1e3
    cached = (
        f"local={u.cached.local_prefix},store={u.cached.store},remote={u.cached.remote_prefill}" if u else "-"
    )
    print(
        f"[pdkv] request_id={out.request_id} prompt_tokens={u.prompt_tokens if u else '?'} "
        f"cached_tokens={cached} output_tokens={len(out.token_ids)} ttft_ms={ttft_ms:.1f} "
        f"finish_reason={out.finish_reason}",
        file=sys.stderr,
    )
    return 0


def _generate_local(args: argparse.Namespace) -> int:
    from engine.engine_config import EngineConfig
    from engine.llm_engine import LLMEngine

    params = _sampling_params(args)
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
        )
    )
    start = time.perf_counter()
    request = engine.add_request("cli-0", args.prompt, params)
    first_token_at: float | None = None
    num_tokens = 0
    finish_reason: str | None = None
    error: str | None = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and first_token_at is None:
                first_token_at = time.perf_counter()
            num_tokens += len(out.new_token_ids)
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            if out.finished:
                finish_reason, error = out.finish_reason, out.error
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    ttft_ms = (first_token_at - start) * 1e3 if first_token_at is not None else float("nan")
    rate = num_tokens / elapsed if elapsed > 0 else float("nan")
    print(
        f"[pdkv] prompt_tokens={request.num_prompt_tokens} cached_tokens={max(0, request.num_cached_tokens)} "
        f"output_tokens={num_tokens} ttft_ms={ttft_ms:.1f} tokens_per_s={rate:.1f} "
        f"finish_reason={finish_reason}",
        file=sys.stderr,
    )
    if error:
        print(f"pdkv generate: error: {error}", file=sys.stderr)
        return 1
    return 0
