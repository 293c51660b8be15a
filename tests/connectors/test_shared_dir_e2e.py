"""``shared-dir`` end to end: engines in separate processes share prompt KV through a directory, and the
known failure modes of shared KV stores stay closed (CONNECTOR_API.md, "Known failure modes")."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from connectors.registry import KVConnectorConfig
from engine.engine_config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.request import Request
from engine.sampling_params import SamplingParams
from tests.tiny_models import hf_greedy, pdkv_tiny_model_dir, random_prompts, tiny_model_dir

BS = 4
NEW_TOKENS = 6
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
REPO = Path(__file__).resolve().parents[2]

# One engine process: generate greedily with shared-dir at DIR, print what each request got where.
ENGINE_PROCESS = """
import json, sys
from connectors.registry import KVConnectorConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams

args = json.loads(sys.argv[1])
llm = LLM(
    args["model"], device="cpu", dtype="float32", block_size=args["block_size"], num_blocks=64,
    kv_connector=KVConnectorConfig("shared-dir", {"path": args["dir"]}),
)
outs = llm.generate(args["prompts"], SamplingParams(max_tokens=args["max_tokens"], ignore_eos=True))
print(json.dumps([
    {"tokens": o.token_ids, "cached": o.num_cached_tokens, "external": o.num_external_tokens,
     "computed": o.num_computed_prompt_tokens}
    for o in outs
]))
"""


def run_engine_process(model: Path, kv_dir: Path, prompts: Sequence[Sequence[int]], hash_seed: str) -> Any:
    args = {
        "model": str(model),
        "dir": str(kv_dir),
        "prompts": prompts,
        "block_size": BS,
        "max_tokens": NEW_TOKENS,
    }
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}  # Python's hash() must play no part in block keys
    done = subprocess.run(
        [sys.executable, "-c", ENGINE_PROCESS, json.dumps(args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def shared_dir(path: Path) -> KVConnectorConfig:
    return KVConnectorConfig("shared-dir", {"path": str(path)})


def llm(model: Path, kv_dir: Path | None = None) -> LLM:
    connector = shared_dir(kv_dir) if kv_dir is not None else None
    return LLM(model, device="cpu", dtype="float32", block_size=BS, num_blocks=64, kv_connector=connector)


def block_files(
    engine: LLMEngine, kv_dir: Path, prompt: Sequence[int], salt: str | None = None
) -> list[Path]:
    """Where shared-dir keeps the prompt's full blocks (the layout in connectors/shared_dir.py)."""
    request = Request("probe", prompt, PARAMS, namespace=engine.namespace, cache_salt=salt)
    spec = engine.kv_spec
    layout = f"{str(spec.dtype).removeprefix('torch.')}-{spec.num_layers}x{spec.num_kv_heads}x{spec.head_dim}"
    root = kv_dir / engine.namespace.namespace_id / layout
    return [root / h.hex()[:2] / f"{h.hex()}.kv" for h in request.block_hashes]


def test_a_second_process_gets_the_prompt_from_the_first_ones_directory(tmp_path: Path) -> None:
    model = tiny_model_dir("llama")
    prompts = random_prompts([18, 27, 9], seed=5)
    first = run_engine_process(model, tmp_path, prompts, hash_seed="1")
    assert [r["external"] for r in first] == [0, 0, 0]
    assert list(tmp_path.rglob("*.kv"))
    second = run_engine_process(model, tmp_path, prompts, hash_seed="2")
    for prompt, a, b in zip(prompts, first, second, strict=True):
        loadable = (len(prompt) - 1) // BS * BS  # whole blocks, never the last token
        assert (b["cached"], b["external"], b["computed"]) == (0, loadable, len(prompt) - loadable)
        assert b["tokens"] == a["tokens"]
    refs = hf_greedy("llama", prompts, NEW_TOKENS)
    for ref, b in zip(refs, second, strict=True):
        assert ref.min_margin > 1e-3, "the reference has a near-tie; pick another seed"
        assert b["tokens"] == ref.token_ids
    assert not math.isnan(refs[0].logprobs[0])


def test_a_block_file_of_another_model_is_never_served(tmp_path: Path) -> None:
    model_a, model_b = pdkv_tiny_model_dir(), pdkv_tiny_model_dir(seed=1)  # same shape, other weights
    prompts = random_prompts([18, 13], seed=6, vocab=256)
    llm(model_a, tmp_path).generate(prompts, PARAMS)
    want = [o.token_ids for o in llm(model_b).generate(prompts, PARAMS)]
    b = llm(model_b, tmp_path)
    outs = b.generate(prompts, PARAMS)
    assert [o.num_external_tokens for o in outs] == [0, 0]  # another namespace: another directory
    assert [o.token_ids for o in outs] == want
    # Plant model A's files where model B looks: the lookup sees files, the load refuses them.
    a_engine, b2 = llm(model_a).engine, llm(model_b, tmp_path)
    for prompt in prompts:
        for src, dst in zip(
            block_files(a_engine, tmp_path, prompt), block_files(b2.engine, tmp_path, prompt), strict=True
        ):
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
    outs = b2.generate(prompts, PARAMS)
    assert [o.token_ids for o in outs] == want
    assert b2.stats().counter("kv_load_failures") == 2


def generate_salted(
    engine: LLMEngine, rid: str, prompt: Sequence[int], salt: str | None
) -> tuple[list[int], int]:
    engine.add_request(rid, prompt, PARAMS, cache_salt=salt)
    tokens: list[int] = []
    external = -1
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            external = out.num_external_tokens
    return tokens, external


def test_cache_salt_separates_tenants_on_the_shared_directory(tmp_path: Path) -> None:
    model = pdkv_tiny_model_dir()
    prompt = random_prompts([17], seed=7, vocab=256)[0]

    def engine() -> LLMEngine:
        config = EngineConfig(
            model=model, device="cpu", block_size=BS, num_blocks=64, kv_connector=shared_dir(tmp_path)
        )
        return LLMEngine(config)

    want, _ = generate_salted(engine(), "alice-0", prompt, "alice")
    fresh = engine()
    assert generate_salted(fresh, "bob", prompt, "bob") == (want, 0)
    assert generate_salted(fresh, "anonymous", prompt, None) == (want, 0)
    assert generate_salted(engine(), "alice-1", prompt, "alice") == (want, 16)


def test_truncated_or_bit_flipped_block_files_are_load_errors_and_outputs_stay_exact(tmp_path: Path) -> None:
    model = pdkv_tiny_model_dir()
    prompts = random_prompts([18, 22], seed=8, vocab=256)
    want = [o.token_ids for o in llm(model).generate(prompts, PARAMS)]
    saver = llm(model, tmp_path)
    saver.generate(prompts, PARAMS)
    truncated = block_files(saver.engine, tmp_path, prompts[0])[0]
    truncated.write_bytes(truncated.read_bytes()[:100])  # a header and a few payload bytes
    flipped = block_files(saver.engine, tmp_path, prompts[1])[2]
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    loader = llm(model, tmp_path)
    outs = loader.generate(prompts, PARAMS)
    assert [o.token_ids for o in outs] == want
    assert loader.stats().counter("kv_load_failures") == 2
    # The recomputed blocks are served from the local cache afterwards, still exactly.
    assert [o.token_ids for o in loader.generate(prompts, PARAMS)] == want
    loader.engine.scheduler.check_integrity()
    # The bad files were replaced by good ones: a fresh engine loads both prefixes without a failure.
    fresh = llm(model, tmp_path)
    outs = fresh.generate(prompts, PARAMS)
    assert [o.token_ids for o in outs] == want
    assert fresh.stats().counter("kv_load_failures") == 0
    assert [o.num_external_tokens for o in outs] == [(len(p) - 1) // BS * BS for p in prompts]


def test_blocks_computed_over_a_failed_load_are_not_saved(tmp_path: Path) -> None:
    """A prompt sharing two blocks with a saved one loads them; the first is damaged.  The blocks the
    engine computes in that step attended to the bad block: they must not be saved (they are saved
    after the recompute instead), or every later reader would load wrong KV with valid checksums."""
    model = pdkv_tiny_model_dir()
    saved = random_prompts([13], seed=8, vocab=256)[0]  # blocks 0..2 saved
    prompt = saved[: 2 * BS] + random_prompts([12], seed=9, vocab=256)[0]  # shares blocks 0..1
    want = [o.token_ids for o in llm(model).generate([prompt], PARAMS)]
    llm(model, tmp_path).generate([saved], PARAMS)
    damaged = block_files(llm(model).engine, tmp_path, saved)[0]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    loader = llm(model, tmp_path)
    assert [o.token_ids for o in loader.generate([prompt], PARAMS)] == want
    assert loader.stats().counter("kv_load_failures") == 1
    fresh = llm(model, tmp_path)
    outs = fresh.generate([prompt], PARAMS)
    assert [o.token_ids for o in outs] == want
    assert fresh.stats().counter("kv_load_failures") == 0
    assert [o.num_external_tokens for o in outs] == [(len(prompt) - 1) // BS * BS]


def test_two_dtypes_of_one_model_share_a_directory_without_stepping_on_each_other(tmp_path: Path) -> None:
    """Block hashes name the model, not the cache's dtype: the files of a float32 and a bfloat16 engine of
    one model live in separate folders, and each engine hits its own."""
    model = pdkv_tiny_model_dir()
    prompt = random_prompts([18], seed=12, vocab=256)[0]
    full = (len(prompt) - 1) // BS * BS

    def half() -> LLM:
        return LLM(
            model,
            device="cpu",
            dtype="bfloat16",
            block_size=BS,
            num_blocks=64,
            kv_connector=shared_dir(tmp_path),
        )

    llm(model, tmp_path).generate([prompt], PARAMS)
    files = block_files(llm(model).engine, tmp_path, prompt)
    contents = [f.read_bytes() for f in files]
    first_half = half()
    [out] = first_half.generate([prompt], PARAMS)
    assert out.num_external_tokens == 0 and first_half.stats().counter("kv_load_failures") == 0
    assert [f.read_bytes() for f in files] == contents  # the float32 blocks are untouched
    second_half = half()
    [again] = second_half.generate([prompt], PARAMS)
    assert again.num_external_tokens == full and again.token_ids == out.token_ids
    owner = llm(model, tmp_path)
    [mine] = owner.generate([prompt], PARAMS)
    assert mine.num_external_tokens == full and owner.stats().counter("kv_load_failures") == 0
