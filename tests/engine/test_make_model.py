"""make-model: deterministic files, a folder transformers and pdkv agree on, the default-model cache."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.loader import inspect_model
from engine.model.make_model import TinyLlamaSpec, ensure_random_model, make_model
from engine.tokenizer import Tokenizer
from pdkv.cli import main
from tests.tiny_models import TINY_PDKV_SPEC

SPEC = TinyLlamaSpec(**TINY_PDKV_SPEC)


def file_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    a = make_model(tmp_path / "a", SPEC)
    b = make_model(tmp_path / "b", SPEC)
    c = make_model(tmp_path / "c", TinyLlamaSpec(**{**TINY_PDKV_SPEC, "seed": 1}))
    assert sorted(file_bytes(a)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert file_bytes(a) == file_bytes(b)
    assert file_bytes(a)["model.safetensors"] != file_bytes(c)["model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary folders left behind"


def test_tokenizer_covers_bytes_and_specials(tmp_path: Path) -> None:
    folder = make_model(tmp_path / "m", SPEC)
    tok = Tokenizer.for_model(inspect_model(folder))
    assert tok.vocab_size == SPEC.vocab
    text = "The quick brown fox, naïve café ☕ \x00\x7f"
    ids = tok.encode(text)
    assert ids[0] == SPEC.bos_token_id
    assert len(ids) < len(text.encode()) + 1  # merges shorten ordinary English
    assert tok.decode(ids) == text
    assert tok.decode(list(range(256))).encode("utf-8", "surrogateescape")  # every byte id decodes
    assert tok.decode([SPEC.eos_token_id]) == ""


def test_transformers_and_pdkv_agree_on_a_made_model(tmp_path: Path) -> None:
    import transformers

    spec = TinyLlamaSpec(**{**TINY_PDKV_SPEC, "init_std": 0.2})
    folder = make_model(tmp_path / "m", spec)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(folder, dtype="float32", device="cpu", block_size=8, num_blocks=64)
    prompt = llm.tokenizer.encode("Hello, world! Once upon a time")
    with torch.inference_mode():
        ref = hf.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    [out] = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    assert out.token_ids == ref


def test_out_dir_must_be_new_or_empty(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    make_model(tmp_path / "empty", SPEC)  # an empty folder is replaced
    with pytest.raises(ValueError, match=r"OUT_DIR .* already exists"):
        make_model(tmp_path / "empty", SPEC)


def test_spec_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="vocab must be at least 258"):
        TinyLlamaSpec(vocab=100)
    with pytest.raises(ValueError, match=r"heads \(8\) must be a multiple of kv_heads \(3\)"):
        TinyLlamaSpec(kv_heads=3)


def _ensure_in_child(cache: str, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    import os

    os.environ["PDKV_CACHE_DIR"] = cache
    queue.put(str(ensure_random_model(SPEC)))


def test_random_model_written_once_even_when_processes_race(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ensure_in_child, args=(str(tmp_path), queue)) for _ in range(2)]
    for p in procs:
        p.start()
    paths = {queue.get(timeout=120) for _ in procs}
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    assert len(paths) == 1
    folder = Path(paths.pop())
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert [p.name for p in folder.parent.iterdir()] == [folder.name], "temporary folders left behind"
    monkeypatch.setenv("PDKV_CACHE_DIR", str(tmp_path))
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert ensure_random_model(SPEC) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rewritten


def test_cli_make_model_and_generate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli-model"
    assert (
        main(
            [
                "make-model",
                str(out),
                "--layers",
                "2",
                "--hidden",
                "64",
                "--heads",
                "4",
                "--kv-heads",
                "2",
                "--vocab",
                "300",
                "--seed",
                "3",
            ]
        )
        == 0
    )
    assert (out / "config.json").is_file()
    assert main(["make-model", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    rc = main(
        ["generate", "--model", str(out), "Hello", "--max-tokens", "5", "--ignore-eos", "--block-size", "4"]
    )
    assert rc == 0
    captured = capsys.readouterr()
    assert "prompt_tokens=" in captured.err and "output_tokens=5" in captured.err
    assert "ttft_ms=" in captured.err and "tokens_per_s=" in captured.err


def test_cli_generate_reports_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(tmp_path / "missing"), "Hello"]) == 2
    assert "does not exist" in capsys.readouterr().err
