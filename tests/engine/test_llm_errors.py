"""Bad input is refused with an error naming the field; the engine keeps serving everyone else."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from tests.tiny_models import tiny_model_dir

GOOD = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_model_dir("llama"), device="cpu", block_size=4, num_blocks=64))


def run(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        steps += 1
        assert steps < 1000, "engine made no progress"
    engine.scheduler.check_integrity()
    return outs


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([1] * 257, None, "max_model_len"),  # max_position_embeddings is 256 (the cache holds 256 too)
        ([], None, "prompt is empty"),
        ("", None, "prompt is empty"),
        ([5, 320], None, "prompt token id 320 at index 1 is outside the vocabulary"),
        ([5, -1], None, "prompt token id -1"),
        ([5, 6], "not params", "sampling_params"),
    ],
)
def test_bad_request_is_refused_and_others_complete(
    engine: LLMEngine, prompt: object, params: object, field: str
) -> None:
    engine.add_request("good", GOOD, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", prompt, params)  # type: ignore[arg-type]
    outs = run(engine)
    assert set(outs) == {"good"}
    assert outs["good"][-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outs["good"]) == 4


def test_request_larger_than_the_cache() -> None:
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), device="cpu", block_size=4, num_blocks=8))
    with pytest.raises(ValueError, match="num_blocks 8"):
        engine.add_request("big", [1] * 40)


def test_a_cache_smaller_than_the_context_caps_requests_instead_of_failing_them_mid_stream(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An outside probe: a node with 12 blocks of 16 tokens and the model's context of 256 admitted a
    191-token prompt with max_tokens 4, sent 2 tokens and failed it ("needs more KV blocks than the cache
    has ... retry the request"; the same every time).  The context is cut to what the cache holds, with a
    warning: such a request ends "length" at the cache's size; a longer max_model_len asked for is
    refused at start; a prompt of max_model_len tokens (no room for an output token) is refused."""
    with caplog.at_level("WARNING", logger="engine.engine_config"):
        engine = LLMEngine(
            EngineConfig(model=tiny_model_dir("llama"), device="cpu", block_size=4, num_blocks=8)
        )
    assert engine.max_model_len == 32 and "requests of at most 32 tokens" in caplog.text
    engine.add_request("fits", [1] * 20, SamplingParams(max_tokens=100, ignore_eos=True))
    outs = run(engine)["fits"]
    assert outs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs) == 12
    with pytest.raises(ValueError, match=r"max_model_len 32 \(what the KV cache holds: num_blocks 8"):
        engine.add_request("full", [1] * 32)
    with pytest.raises(ValueError, match="max_model_len 64 is more than the KV cache holds"):
        LLMEngine(
            EngineConfig(
                model=tiny_model_dir("llama"), device="cpu", block_size=4, num_blocks=8, max_model_len=64
            )
        )


def test_a_prompt_of_max_model_len_tokens_is_refused(engine: LLMEngine) -> None:
    """The engine took a prompt of exactly max_model_len tokens and returned one more (65 of 64); the
    router refuses it: the context holds the prompt and at least one output token."""
    with pytest.raises(ValueError, match=r"max_model_len 256 .*leaves no room for an output token"):
        engine.add_request("at-context", [1] * 256)
    engine.add_request("one-less", [1] * 255, SamplingParams(max_tokens=5))
    outs = run(engine)["one-less"]
    assert sum(len(o.new_token_ids) for o in outs) == 1 and outs[-1].finish_reason == "length"


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_non_positive_max_tokens(max_tokens: int) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=max_tokens)


def test_duplicate_request_id(engine: LLMEngine) -> None:
    engine.add_request("dup", GOOD)
    with pytest.raises(ValueError, match="request_id 'dup' is already in use"):
        engine.add_request("dup", GOOD)
    assert run(engine)["dup"][-1].finished


def test_generate_is_all_or_nothing() -> None:
    llm = LLM(tiny_model_dir("llama"), device="cpu", block_size=4, num_blocks=64)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([GOOD, [999]], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    [out] = llm.generate([GOOD], SamplingParams(max_tokens=2))
    assert len(out.token_ids) == 2


def test_the_engine_observes_each_request_s_phases_and_lengths() -> None:
    """vLLM's per-request histograms: prompt and output lengths, prefill (admission to first token) and
    decode (first to last token, only with more than one token).  Counts and totals only: no timing."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), device="cpu", block_size=4, num_blocks=64))
    engine.add_request("long", GOOD, SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request("one", GOOD[:3], SamplingParams(max_tokens=1, ignore_eos=True))
    run(engine)
    h = engine.stats().histograms
    assert h["request_prompt_tokens"].count == 2 and h["request_prompt_tokens"].total == len(GOOD) + 3
    assert h["request_generation_tokens"].total == 5 + 1
    assert h["request_prefill_time_seconds"].count == 2
    assert h["request_decode_time_seconds"].count == 1  # the one-token request has no decode phase


def test_abort_returns_a_final_output(engine: LLMEngine) -> None:
    engine.add_request("a", GOOD, SamplingParams(max_tokens=50))
    engine.add_request("b", GOOD, SamplingParams(max_tokens=3))
    engine.step()
    final = engine.abort_request("a")
    assert final is not None and final.finished and final.finish_reason == "abort"
    assert engine.abort_request("a") is None
    outs = run(engine)
    assert outs["b"][-1].finish_reason == "length"


def test_a_failed_forward_fails_its_requests_and_the_engine_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), device="cpu", block_size=4, num_blocks=64))
    warm, doomed = [7] * 12, [8] * 12
    engine.add_request("warm", warm, SamplingParams(max_tokens=2))
    run(engine)
    real = engine.runner.execute

    def broken(step):  # type: ignore[no-untyped-def]
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(engine.runner, "execute", broken)
    engine.add_request("victim", doomed, SamplingParams(max_tokens=4))
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("victim", "error")]
    assert outs[0].error is not None and "simulated device failure" in outs[0].error
    monkeypatch.setattr(engine.runner, "execute", real)
    engine.add_request("again", doomed, SamplingParams(max_tokens=4))
    engine.add_request("warm-again", warm, SamplingParams(max_tokens=4))
    done = run(engine)
    # The failed step's blocks left the cache; blocks computed by earlier steps are still served.
    assert done["again"][-1].finish_reason == "length" and done["again"][-1].num_cached_tokens == 0
    assert done["warm-again"][-1].num_cached_tokens == 8


# -- model folders ------------------------------------------------------------------------------------


def copy_model(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    return folder


def test_missing_folder() -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM("/nonexistent/pdkv-model", device="cpu")


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        LLM(tmp_path, device="cpu")


def test_unsupported_architecture(tmp_path: Path) -> None:
    folder = copy_model(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"architectures\[0\] 'GPT2LMHeadModel' is not supported"):
        LLM(folder, device="cpu")


def test_unsupported_activation(tmp_path: Path) -> None:
    folder = copy_model(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        LLM(folder, device="cpu")


def test_no_weights(tmp_path: Path) -> None:
    folder = copy_model(tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights"):
        LLM(folder, device="cpu")


def test_missing_tensor(tmp_path: Path) -> None:
    folder = copy_model(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.1\.mlp\.up_proj\.weight"):
        LLM(folder, device="cpu")


def test_wrong_tensor_shape(tmp_path: Path) -> None:
    folder = copy_model(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(  # the file named: a GGUF file has no config.json to blame
        ValueError,
        match=r"model folder .*: weight 'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape \(\d+, \d+\) "
        r"but the model's config implies",
    ):
        LLM(folder, device="cpu")


@pytest.mark.parametrize(
    "damage", ["cut_in_half", "cut_to_50_bytes", "a_folder", "fp8", "int32", "quantized"]
)
def test_a_damaged_or_quantized_weight_file_is_an_error_naming_it(tmp_path: Path, damage: str) -> None:
    """An outside probe: a cut safetensors file, one that is a folder, and an FP8 checkpoint each ended in
    a traceback (SafetensorError, OSError, NotImplementedError) -- now refused before any weight is read."""
    import torch

    folder = copy_model(tmp_path)
    weights = folder / "model.safetensors"
    says = "cannot be read as safetensors"
    if damage.startswith("cut"):
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2] if damage == "cut_in_half" else data[:50])
    elif damage == "a_folder":
        weights.unlink()
        weights.mkdir()
        says = r"no \*\.safetensors weights"
    elif damage in ("fp8", "int32"):
        tensors = load_file(weights)
        dtype = torch.float8_e4m3fn if damage == "fp8" else torch.int32
        tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].to(dtype)
        save_file(tensors, weights)
        says = r"tensor model\.layers\.0\.mlp\.up_proj\.weight is stored as (F8_E4M3|I32)"
    else:  # a merged 16-bit export keeps its 4-bit base's quantization_config: its float tensors decide
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
        (folder / "config.json").write_text(json.dumps(config))
        assert LLM(folder, device="cpu").generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids
        return
    with pytest.raises((ValueError, FileNotFoundError), match=says):
        LLM(folder, device="cpu")


def test_a_special_file_as_the_model_is_named_so(tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="neither a GGUF file nor a model folder"):  # and no hang
        LLM(fifo, device="cpu")


def test_missing_shard(tmp_path: Path) -> None:
    folder = tmp_path / "sharded"
    shutil.copytree(tiny_model_dir("llama_sharded"), folder)
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        LLM(folder, device="cpu")


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"dtype": "float8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"block_size": 0}, "block_size"),
        ({"num_blocks": 4, "kv_cache_bytes": 1024}, "num_blocks or kv_cache_bytes"),
        ({"policy": "random"}, "policy"),
        ({"hash_algo": "md5"}, "hash_algo"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
    ],
)
def test_engine_config_names_the_bad_field(options: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**options)  # type: ignore[arg-type]


def test_max_model_len_above_the_model_context() -> None:
    with pytest.raises(ValueError, match="max_model_len 1000 exceeds"):
        LLMEngine(EngineConfig(model=tiny_model_dir("llama"), device="cpu", max_model_len=1000))
