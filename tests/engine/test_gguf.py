"""GGUF loading on small files written like llama.cpp writes them (tests/gguf_models.py): every supported
tensor type against transformers' own GGUF reader, the tokenizer, the chat template, the fingerprint,
convert-gguf, and every kind of bad file refused with one clear error before any weight is read."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.chat_template import ChatTemplateError
from engine.hashing import HashNamespace
from engine.llm import LLM
from engine.model.gguf import K_QUANTS, SUPPORTED_TENSOR_TYPES, GGUFError, inspect_gguf
from engine.model.loader import inspect_model
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from pdkv.cli import main
from tests.gguf_models import WRITTEN_TYPES, write_gguf
from tests.kquants import f32_matrices, kquant_tensors
from tests.tiny_models import pdkv_tiny_model_dir

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [100, 200, 300, 50, 60], [42] * 17]
GREEDY = SamplingParams(max_tokens=8)
TRICKY = [
    "Hello, world!",
    "12345 and 3.14159 and 2026-12-01",
    "  two spaces\t\ttabs\n\nnewlines   \n",
    "naïve café — 你好 🙂 ü",
    "<|im_start|>user\nhi<|im_end|>",
    "don't won't I'm we'll",
    "",
]


def _llm(path: Path, dtype: str = "float32", weights: str = "auto") -> LLM:
    return LLM(path, dtype=dtype, weights=weights, device="cpu", block_size=4, num_blocks=64)


DENSE = {"float32": "float32", "bfloat16": "bf16"}  # --weights dequantizing at load, by dtype


def _hf_greedy(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            out.append(gen[0, len(p) :].tolist())
    return out


@pytest.mark.parametrize("qtype", WRITTEN_TYPES)
def test_every_supported_tensor_type_matches_transformers_on_the_same_file(
    qtype: str, files: dict[str, Path]
) -> None:
    ours = [o.token_ids for o in _llm(files[qtype]).generate(PROMPTS, GREEDY)]
    assert ours == _hf_greedy(files[qtype], PROMPTS, GREEDY.max_tokens)


def test_every_type_read_is_tested() -> None:
    assert set(WRITTEN_TYPES) | set(K_QUANTS) == set(SUPPORTED_TENSOR_TYPES)


def _kquant_folder() -> Path:
    """K-quant rows are super-blocks of 256: a model whose every matrix is that wide."""
    return pdkv_tiny_model_dir(init_std=0.2, hidden=256, heads=4, kv_heads=2, intermediate_size=512)


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_k_quant_matrices_read_as_ggml_dequantizes_them_and_match_transformers(
    qtype: str, tmp_path: Path
) -> None:
    """Every matrix (the embedding too) in ``qtype``: the loader's weights equal, bit for bit, a
    dequantizer written from ggml's C (tests/kquants.py), q/k rows back in Hugging Face order; the engine
    on them (``--weights float32``: Q4_K's packed kernel is test_quantized.py's) then decodes as
    transformers does on the same file."""
    folder = _kquant_folder()
    raw, dense = kquant_tensors(folder, lambda name: qtype, seed=K_QUANTS.index(qtype))
    path = write_gguf(folder, tmp_path / f"{qtype}.gguf", raw=raw)
    weights = dict(inspect_gguf(path).weights(torch.float32))
    assert set(dense) <= set(weights) and len(dense) > 10
    for name, want in dense.items():
        assert torch.equal(weights[name], torch.from_numpy(want)), name
    ours = [o.token_ids for o in _llm(path, weights="float32").generate(PROMPTS, GREEDY)]
    assert ours == _hf_greedy(path, PROMPTS, GREEDY.max_tokens)


def test_a_k_quant_file_runs_exactly_like_its_dequantized_twin(tmp_path: Path) -> None:
    """A Q4_K_M-like mix (Q6_K embedding and down projections, Q4_K the rest) against an F32 file of
    the reference dequantization: the same tokens and log-probabilities, in float32 and in bfloat16, on
    the weights dequantized at load (``--weights float32`` / ``bf16``)."""
    folder = _kquant_folder()

    def pick(name: str) -> str:
        return "Q6_K" if name.endswith(("embed_tokens.weight", "down_proj.weight")) else "Q4_K"

    raw, dense = kquant_tensors(folder, pick, seed=7)
    mixed = write_gguf(folder, tmp_path / "q4_k_m.gguf", raw=raw)
    twin = write_gguf(folder, tmp_path / "twin.gguf", raw=f32_matrices(dense))
    params = SamplingParams(max_tokens=8, logprobs=2)
    for dtype in ("float32", "bfloat16"):
        a, b = (_llm(p, dtype, DENSE[dtype]).generate(PROMPTS, params) for p in (mixed, twin))
        assert [(o.token_ids, o.logprobs) for o in a] == [(o.token_ids, o.logprobs) for o in b], dtype


def test_an_f32_file_runs_exactly_like_the_folder_it_came_from(folder: Path, files: dict[str, Path]) -> None:
    """The q/k permutation is undone exactly: same weights, same tokens, token for token."""
    from_folder = [o.token_ids for o in _llm(folder).generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in _llm(files["F32"]).generate(PROMPTS, GREEDY)] == from_folder
    ours, theirs = inspect_gguf(files["F32"]).config, inspect_model(folder).config
    # Everything but the norm epsilon, which GGUF stores as float32 (1e-5 -> 9.99999975e-06).
    assert dataclasses.replace(ours, rms_norm_eps=theirs.rms_norm_eps) == theirs


def test_the_tokenizer_equals_transformers_on_tricky_strings(files: dict[str, Path]) -> None:
    import transformers

    path = files["F32"]
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = Tokenizer.for_model(inspect_model(path))
    for text in TRICKY:
        assert ours.encode(text) == ref(text, add_special_tokens=True).input_ids, text
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False), text
    assert ours.encode("777") == ours.encode("7") * 3  # the smollm pre-tokenizer splits single digits


def test_the_chat_template_renders_and_stops_at_its_end_of_turn_token(files: dict[str, Path]) -> None:
    tok = Tokenizer.for_model(inspect_model(files["F32"]))
    assert tok.chat_template is not None
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    im_start, im_end = tok.encode("<|im_start|>"), tok.encode("<|im_end|>")
    assert ids[:1] == im_start and im_end[0] in ids
    assert ids[-len(tok.encode("<|im_start|>assistant\n")) :] == tok.encode("<|im_start|>assistant\n")
    assert tok.end_of_turn_token_ids == tuple(im_end)
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]\.role"):
        tok.apply_chat_template([{"role": "wizard", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="at least one message"):
        tok.apply_chat_template([])


def test_a_developer_message_is_a_system_message_where_the_template_knows_no_developer_role(
    files: dict[str, Path], folder: Path, tmp_path: Path
) -> None:
    """OpenAI's newer name for the system role (an outside probe: SmolLM2's template rendered its default
    system prompt, then a 'developer' turn the model never saw).  A template that names the role gets it."""
    tok = Tokenizer.for_model(inspect_model(files["F32"]))
    turns = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(turns) == tok.apply_chat_template(system)
    knows = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{# developer #}"
    own = Tokenizer.for_model(inspect_model(write_gguf(folder, tmp_path / "dev.gguf", chat_template=knows)))
    assert "[developer]Be brief." in own.decode(own.apply_chat_template(turns))


def test_a_name_the_template_does_not_show_is_refused_not_dropped(
    files: dict[str, Path], folder: Path, tmp_path: Path
) -> None:
    """An outside probe's find: a message's ``name`` was accepted and had no effect (SmolLM2's template
    never renders it).  A name the template does not show the model is refused, naming that message's
    ``name``; a template that renders names gets them, in whatever case it writes them; one that shows
    only users' names refuses an assistant's."""
    tok = Tokenizer.for_model(inspect_model(files["F32"]))  # ChatML: no names
    named = [{"role": "user", "content": "hi", "name": "Ada"}]
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]\.name.*does not show a user message's name"):
        tok.apply_chat_template(named)
    loop = (
        "{%% for m in messages %%}[{{ m.role }}{%% if %s %%} {{ m.name%s }}{%% endif %%}]"
        "{{ m.content }}{%% endfor %%}"
    )
    shows = loop % ("m.name", " | upper")
    own = Tokenizer.for_model(inspect_model(write_gguf(folder, tmp_path / "names.gguf", chat_template=shows)))
    assert "[user ADA]hi" in own.decode(own.apply_chat_template(named))
    users_only = loop % ("m.role == 'user' and m.name", "")
    path = write_gguf(folder, tmp_path / "users.gguf", chat_template=users_only)
    users = Tokenizer.for_model(inspect_model(path))
    turns = [*named, {"role": "assistant", "content": "hello", "name": "Bot"}]
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]\.name.*assistant"):
        users.apply_chat_template(turns)
    assert "[user Ada]hi" in users.decode(users.apply_chat_template(named))
    # a review's finds: the error names the role the client sent (a developer message renders as a
    # system one here), and no content can pass for a shown name (each call's markers are its own)
    with pytest.raises(ChatTemplateError, match="does not show a developer message's name"):
        tok.apply_chat_template([{"role": "developer", "content": "Be brief.", "name": "Ops"}, *named])
    echo = [{"role": "user", "content": "PdkvName0Marker pdkvname0x" + "0" * 16, "name": "Ada"}]
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]\.name"):
        tok.apply_chat_template(echo)


def test_the_template_runs_sandboxed(files: dict[str, Path], tmp_path: Path, folder: Path) -> None:
    """A template is data from the model file: it cannot reach Python internals."""
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    path = write_gguf(folder, tmp_path / "evil.gguf", chat_template=evil)
    tok = Tokenizer.for_model(inspect_model(path))
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_template_that_fails_at_run_time_is_a_chat_template_error(folder: Path, tmp_path: Path) -> None:
    """Not a bare TypeError (an HTTP 500): a clear error the router answers with 400."""
    path = write_gguf(folder, tmp_path / "broken.gguf", chat_template="{{ 1 + messages[0]['content'] }}")
    tok = Tokenizer.for_model(inspect_model(path))
    with pytest.raises(ChatTemplateError, match="TypeError"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_model_without_a_template_refuses_chat(folder: Path, tmp_path: Path) -> None:
    path = write_gguf(folder, tmp_path / "plain.gguf", chat_template=None)
    tok = Tokenizer.for_model(inspect_model(path))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_the_fingerprint_names_the_file_not_its_path(files: dict[str, Path], tmp_path: Path) -> None:
    copy = tmp_path / "copy.gguf"
    shutil.copy(files["Q8_0"], copy)
    assert inspect_gguf(copy).fingerprint == inspect_gguf(files["Q8_0"]).fingerprint
    prints = {inspect_gguf(p).fingerprint for p in files.values()}
    assert len(prints) == len(files), "two quantizations share a fingerprint"
    a, b = (
        HashNamespace(model_fingerprint=inspect_gguf(files[q]).fingerprint, block_size=4)
        for q in ("Q8_0", "Q4_0")
    )
    ha = Request("a", list(range(8)), SamplingParams(), namespace=a).block_hashes
    hb = Request("b", list(range(8)), SamplingParams(), namespace=b).block_hashes
    assert ha and not set(ha) & set(hb)


def test_an_inspected_file_keeps_no_reader_alive(files: dict[str, Path], tmp_path: Path) -> None:
    """The cache of inspected files holds their tensors, not gguf's reader: its metadata fields are a
    memmap per part (a real vocabulary: ~250,000), which every process would carry -- memory, and objects
    each full collection of the garbage collector walks while the engine waits."""
    import gc

    from gguf import GGUFReader

    copy = tmp_path / "kept.gguf"
    shutil.copy(files["Q8_0"], copy)
    model = inspect_gguf(copy)
    assert len(list(model.weights(torch.float32))) > 0  # the weights still read after it
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, GGUFReader)]


def test_convert_gguf_writes_a_folder_transformers_and_pdkv_load(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import transformers

    out = tmp_path / "converted"
    assert main(["convert-gguf", str(files["Q4_1"]), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    ref = _hf_greedy(files["Q4_1"], PROMPTS, GREEDY.max_tokens)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.inference_mode():
        for p, want in zip(PROMPTS, ref, strict=True):
            ids = torch.tensor([p])
            got = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()  # fmt: skip
            assert got == want
    assert [o.token_ids for o in _llm(out).generate(PROMPTS, GREEDY)] == ref
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.chat_template is not None
    ours = Tokenizer.for_model(inspect_model(files["Q4_1"]))
    for text in TRICKY:
        assert tok(text).input_ids == ours.encode(text)
    assert main(["convert-gguf", str(files["Q4_1"]), str(out)]) == 2  # not empty: refused
    assert "not empty" in capsys.readouterr().err


# -- bad files: one clear error, before any weight is read --------------------------------------------------


@pytest.fixture
def no_weight_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    from gguf import quants

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("a weight was read before the file was refused")

    monkeypatch.setattr(quants, "dequantize", refuse)


def test_a_file_that_is_not_gguf(tmp_path: Path, no_weight_reads: None) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf file at all")
    with pytest.raises(GGUFError, match=r"not a GGUF file \(starts with b'PK\\x03\\x04'"):
        LLM(path, device="cpu")


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.01])
def test_a_truncated_file(keep: float, files: dict[str, Path], tmp_path: Path, no_weight_reads: None) -> None:
    data = files["Q8_0"].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(GGUFError, match="truncated"):
        LLM(path, device="cpu")


def test_an_unsupported_architecture(folder: Path, tmp_path: Path, no_weight_reads: None) -> None:
    path = write_gguf(folder, tmp_path / "gpt2.gguf")
    data = path.read_bytes().replace(b"llama", b"gemma")  # the architecture and its keys' prefix
    path.write_bytes(data)
    with pytest.raises(
        GGUFError, match=r"general.architecture 'gemma' is not supported; pdkv runs llama, qwen2"
    ):
        LLM(path, device="cpu")


def test_an_unsupported_tensor_type(tmp_path: Path, no_weight_reads: None) -> None:
    import gguf
    from gguf import GGMLQuantizationType

    path = tmp_path / "k-quant.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    block_bytes = gguf.GGML_QUANT_SIZES[GGMLQuantizationType.Q3_K][1]
    w.add_tensor(
        "token_embd.weight", np.zeros((4, block_bytes), np.uint8), raw_dtype=GGMLQuantizationType.Q3_K
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        GGUFError, match="type Q3_K, which pdkv does not dequantize; supported: F32, F16, BF16, Q8_0"
    ):
        LLM(path, device="cpu")


def test_missing_tokenizer_metadata(folder: Path, tmp_path: Path, no_weight_reads: None) -> None:
    path = write_gguf(folder, tmp_path / "no-tok.gguf", tokenizer=False)
    with pytest.raises(GGUFError, match=r"no tokenizer metadata \(tokenizer.ggml.model is missing\)"):
        LLM(path, device="cpu")


def test_an_unknown_pre_tokenizer(folder: Path, tmp_path: Path) -> None:
    path = write_gguf(folder, tmp_path / "pre.gguf")
    path.write_bytes(path.read_bytes().replace(b"smollm", b"zzzzzz"))
    with pytest.raises(GGUFError, match=r"tokenizer.ggml.pre 'zzzzzz' is not supported"):
        LLM(path, device="cpu")


def test_a_missing_file() -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM("/nonexistent/model.gguf", device="cpu")


def test_a_folder_without_tokenizer_json_is_refused_unless_it_is_a_random_test_model(
    folder: Path, tmp_path: Path
) -> None:
    real = tmp_path / "real"
    shutil.copytree(folder, real)
    (real / "tokenizer.json").unlink()
    import json

    raw = json.loads((real / "config.json").read_text())
    (real / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k != "pdkv_random_model"}))
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer\.json"):
        LLM(real, device="cpu")
    (real / "config.json").write_text(json.dumps(raw))  # says it is random: a byte-level tokenizer
    assert LLM(real, device="cpu", num_blocks=16).tokenizer.source.startswith("byte-level")


def test_generate_chat_renders_the_template_and_stops_at_the_end_of_turn(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = files["F32"]
    llm = _llm(path)
    tok = llm.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "hello there"}])
    want = llm.generate([ids], tok.chat_sampling(SamplingParams(max_tokens=6)))[0]
    argv = ["generate", "--model", str(path), "--dtype", "float32", "--device", "cpu", "--block-size", "4"]
    assert main([*argv, "--num-blocks", "64", "--max-tokens", "6", "--chat", "hello there"]) == 0
    captured = capsys.readouterr()
    assert captured.out == want.text + "\n"
    assert f"prompt_tokens={len(ids)}" in captured.err
    assert main([*argv, "--num-blocks", "64", "--max-tokens", "6", "hello there"]) == 0  # raw: no template
    raw = llm.generate([tok.encode("hello there")], SamplingParams(max_tokens=6))[0]
    assert capsys.readouterr().out == raw.text + "\n"


def test_the_llama3_pre_tokenizer_takes_whole_words_from_the_vocabulary() -> None:
    """llama.cpp's llama-bpe (like Llama 3's tokenizer.json) ignores merges for a pre-token the
    vocabulary holds whole; gpt2-style pre-tokenizers build every token from merges."""
    from engine.model.gguf import GGUFTokenizerSpec
    from engine.model.gguf_tokenizer import build_gguf_tokenizer

    def spec(pre: str) -> GGUFTokenizerSpec:
        return GGUFTokenizerSpec(
            model="gpt2", pre=pre, tokens=("a", "b", "c", "ab", "abc"), token_types=(1, 1, 1, 1, 1),
            merges=("a b",), bos_token_id=None, eos_token_id=None, unk_token_id=None, pad_token_id=None,
            add_bos_token=False, add_eos_token=False,
        )  # fmt: skip

    assert build_gguf_tokenizer(spec("llama-bpe"), source="t").encode("abc").ids == [4]
    assert build_gguf_tokenizer(spec("gpt2"), source="t").encode("abc").ids == [3, 2]
