"""GGUF files for tests, written from a ``pdkv make-model`` folder the way llama.cpp's converter writes
them (``convert_hf_to_gguf.py``): tensor names, the q/k row permutation, ``llama.*`` metadata, the
byte-level tokenizer as ``tokenizer.ggml.*`` (``smollm`` pre-tokenizer: single digits), a ChatML template.

transformers reads these files with its own GGUF code (its own dequantizers and un-permutation), so
"pdkv on the file == transformers on the file" checks our reader against an independent one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

# The tensor types pdkv reads that the ``gguf`` package can also write (it quantizes no K-quant: their
# tests write blocks of their own, tests/kquants.py).
WRITTEN_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: per head, rotate-half rows -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    folder: Path,
    out: Path,
    *,
    qtype: str = "F32",
    arch: str = "llama",
    tokenizer: bool = True,
    chat_template: str | None = CHATML,
    edit: Callable[[Any], None] | None = None,
    raw: Mapping[str, tuple[str, np.ndarray]] | None = None,
) -> Path:
    """``folder`` (make-model output) as a GGUF file; matrices in ``qtype``, norms in F32.

    ``edit(writer)`` may add or override metadata before the file is written (bad-input tests).
    ``raw`` (Hugging Face name -> (GGUF type, [rows, bytes] uint8 blocks in Hugging Face row order)) writes
    those matrices as the blocks given, whatever ``qtype`` -- types the ``gguf`` package cannot quantize
    (the K-quants: tests/kquants.py) -- or, type "F32", as the float32 [rows, cols] given."""
    import gguf
    from gguf import GGMLQuantizationType, quants

    cfg = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("pdkv test model")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    if tokenizer:
        _add_tokenizer(w, folder, cfg)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    if edit is not None:
        edit(w)
    q = GGMLQuantizationType[qtype]
    for hf_name, t in tensors.items():
        name = _gguf_name(hf_name)
        blocks = None if raw is None else raw.get(hf_name)
        # the given rows (of blocks: permuted as the weights' rows are), or the folder's tensor
        a = blocks[1] if blocks is not None else t.to(torch.float32).numpy()
        if name.endswith("attn_q.weight"):
            a = permute(a, heads)
        elif name.endswith("attn_k.weight"):
            a = permute(a, kv_heads)
        if blocks is not None and blocks[0] == "F32":  # a float32 matrix amid quantized ones
            w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
        elif blocks is not None:
            w.add_tensor(name, np.ascontiguousarray(a), raw_dtype=GGMLQuantizationType[blocks[0]])
        elif a.ndim == 1 or q == GGMLQuantizationType.F32:
            w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
        elif q == GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, quants.quantize(a, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_NAMES[rest]}"


def _add_tokenizer(w: Any, folder: Path, cfg: dict[str, Any]) -> None:
    """make-model's tokenizer.json as tokenizer.ggml.*: its special tokens become control tokens, and
    <bos> / <eos> are renamed to ChatML's <|im_start|> / <|im_end|> (as in SmolLM2: bos 1, eos 2)."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    specials = {t["content"]: t["id"] for t in tok["added_tokens"]}
    renamed = {cfg["bos_token_id"]: "<|im_start|>", cfg["eos_token_id"]: "<|im_end|>"}
    tokens = [""] * cfg["vocab_size"]
    types = [1] * cfg["vocab_size"]  # 1: normal
    for s, i in vocab.items():
        tokens[i] = s
    for s, i in specials.items():
        tokens[i] = renamed.get(i, s)
        types[i] = 3  # control
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(False)
