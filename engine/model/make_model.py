"""Write a small random-weight Llama in Hugging Face format (``pdkv make-model``; the tests' models).

``make_model(out_dir, TinyLlamaSpec(...))`` writes ``config.json``, ``model.safetensors`` and a byte-level
BPE ``tokenizer.json`` (256 byte tokens, merges learnt from a short built-in text, ``<bos>``/``<eos>``).
The same spec and seed always give the same bytes.  Only torch, safetensors and tokenizers are used, so
the folder can be written on a fresh machine with nothing downloaded.

``ensure_random_model(spec)`` returns the folder of ``spec``, writing it on first use under
``$PDKV_CACHE_DIR`` (else ``~/.cache/pdkv``).  Every folder is written into a temporary sibling and renamed
into place, so a reader never sees half a model and two processes racing both end with a valid folder.
Its ``config.json`` says it is random (``pdkv_random_model``).  The embedded default model is a real one:
``engine/model/embedded.py``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import pre_tokenizers

from engine.model.embedded import cache_dir
from engine.tokenizer import NUM_BYTES, build_byte_level_tokenizer

FORMAT_VERSION = 1
DTYPES = ("float32", "bfloat16", "float16")

# The text the default tokenizer's merges are learnt from: common English, so prompts tokenize shorter.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A large language model reads the prompt and writes the next
token, one at a time, and the server keeps the keys and values of every token it has seen so that the next
step does not compute them again. When two requests share a prefix, the cache serves the second one from the
blocks the first one computed. The prefill node computes the prompt and the decode node generates the rest.
There is a time for everything: the time to first token, the tokens per second, and the time it takes to
move a block from one machine to another. In the beginning the model knows nothing; with the right weights
it would tell a story about the sea, the mountains, the city and the people who live there. This is the
first sentence of a longer text, and this is the second one. What is the answer? It is what it is.
Hello, world! Once upon a time, there was a little house in the middle of the forest, and in the house
lived an old man with his cat. They would sit by the window and watch the rain and the snow and the sun.
"""


@dataclass(frozen=True)
class TinyLlamaSpec:
    """The shape of a random Llama.  ``intermediate_size`` 0 means 8/3 of hidden, rounded up to 64."""

    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 4
    vocab: int = 512
    intermediate_size: int = 0
    max_position_embeddings: int = 4096
    seed: int = 0
    dtype: str = "float32"
    init_std: float = 0.02
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.vocab < NUM_BYTES + 2:
            raise ValueError(
                f"vocab must be at least {NUM_BYTES + 2} (256 byte tokens + bos + eos), got {self.vocab}"
            )
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if (self.hidden // self.heads) % 2:
            raise ValueError(f"hidden / heads = {self.hidden // self.heads} must be even (rotary embeddings)")
        if self.intermediate_size < 0:
            raise ValueError(f"intermediate_size must be >= 0 (0 derives it), got {self.intermediate_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")

    @property
    def ffn_size(self) -> int:
        if self.intermediate_size:
            return self.intermediate_size
        return -(-(self.hidden * 8 // 3) // 64) * 64

    # Layout of the vocabulary: bytes 0..255, then merges, then <bos> and <eos> as the last two ids.
    @property
    def bos_token_id(self) -> int:
        return self.vocab - 2

    @property
    def eos_token_id(self) -> int:
        return self.vocab - 1

    def hf_config(self) -> dict[str, object]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn_size,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.hidden // self.heads,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-5,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": self.dtype,
            "pdkv_random_model": {"format_version": FORMAT_VERSION, "seed": self.seed},
        }


def random_weights(spec: TinyLlamaSpec) -> dict[str, torch.Tensor]:
    """HF-named tensors drawn from one generator in a fixed order: N(0, init_std), norms at 1."""
    gen = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    head_dim = spec.hidden // spec.heads

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * spec.init_std).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    tensors = {"model.embed_tokens.weight": normal(spec.vocab, spec.hidden)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = ones(spec.hidden)
        tensors[p + "self_attn.q_proj.weight"] = normal(spec.heads * head_dim, spec.hidden)
        tensors[p + "self_attn.k_proj.weight"] = normal(spec.kv_heads * head_dim, spec.hidden)
        tensors[p + "self_attn.v_proj.weight"] = normal(spec.kv_heads * head_dim, spec.hidden)
        tensors[p + "self_attn.o_proj.weight"] = normal(spec.hidden, spec.heads * head_dim)
        tensors[p + "post_attention_layernorm.weight"] = ones(spec.hidden)
        tensors[p + "mlp.gate_proj.weight"] = normal(spec.ffn_size, spec.hidden)
        tensors[p + "mlp.up_proj.weight"] = normal(spec.ffn_size, spec.hidden)
        tensors[p + "mlp.down_proj.weight"] = normal(spec.hidden, spec.ffn_size)
    tensors["model.norm.weight"] = ones(spec.hidden)
    tensors["lm_head.weight"] = normal(spec.vocab, spec.hidden)
    return tensors


def learn_merges(text: str, num_merges: int) -> list[tuple[str, str]]:
    """Byte-level BPE merges of ``text``: the most frequent adjacent pair first, ties by the pair itself.

    A few dozen lines of Python rather than the library's trainer, so the result is the same everywhere.
    """
    splitter = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words: Counter[tuple[str, ...]] = Counter(tuple(w) for w, _ in splitter.pre_tokenize_str(text))
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for a, b in itertools.pairwise(word):
                pairs[(a, b)] += count
        if not pairs:
            break
        best_count = max(pairs.values())
        if best_count < 2:
            break
        best = min(p for p, c in pairs.items() if c == best_count)
        merges.append(best)
        words = Counter({_merge_word(w, best): c for w, c in words.items()})
    return merges


def _merge_word(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def make_model(out_dir: str | Path, spec: TinyLlamaSpec | None = None, *, exist_ok: bool = False) -> Path:
    """Write the model folder ``out_dir`` atomically.  An existing empty folder is replaced.

    With ``exist_ok``, a folder that already holds a model (another process won a race) is kept as is.
    """
    spec = spec or TinyLlamaSpec()
    out = Path(out_dir).expanduser()
    if out.exists() and not _is_empty_dir(out):
        if exist_ok and (out / "config.json").is_file():
            return out
        raise ValueError(f"OUT_DIR {str(out)!r} already exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_model(tmp, spec)
        # mkdtemp makes a private (0700) folder; a model folder is ordinary readable data.
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
        try:
            os.rename(tmp, out)  # replaces an empty directory; fails if another writer got there first
        except OSError:
            if exist_ok and (out / "config.json").is_file():
                return out
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_model(folder: Path, spec: TinyLlamaSpec) -> None:
    (folder / "config.json").write_text(json.dumps(spec.hf_config(), indent=2, sort_keys=True) + "\n")
    save_file(random_weights(spec), str(folder / "model.safetensors"), metadata={"format": "pt"})
    merges = learn_merges(_CORPUS, spec.vocab - NUM_BYTES - 2)
    tok = build_byte_level_tokenizer(
        vocab_size=spec.vocab,
        merges=merges,
        bos_token_id=spec.bos_token_id,
        eos_token_id=spec.eos_token_id,
    )
    tok.save(str(folder / "tokenizer.json"))


def ensure_random_model(spec: TinyLlamaSpec | None = None) -> Path:
    """The folder of the random model ``spec``, written on first use (safe against concurrent writers)."""
    spec = spec or TinyLlamaSpec()
    key = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:12]
    return make_model(cache_dir() / "models" / f"tiny-llama-v{FORMAT_VERSION}-{key}", spec, exist_ok=True)


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())
