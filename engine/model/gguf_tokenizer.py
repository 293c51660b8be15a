"""A ``tokenizers.Tokenizer`` from a GGUF file's ``tokenizer.ggml.*`` metadata (byte-level BPE).

llama.cpp stores the vocabulary (tokens in GPT-2's byte alphabet), the merges, a type per token and the
name of the pre-tokenizer (``tokenizer.ggml.pre``) -- the regexes that split text before BPE runs.  We
rebuild the same pipeline llama.cpp runs (``llama-vocab.cpp``), with the ``tokenizers`` library:

    pre        split before BPE (llama.cpp's regex_exprs)
    default    GPT-2's regex                          (ByteLevel with its built-in regex)
    gpt2       GPT-2's regex
    smollm     single digits, then GPT-2's regex      (Digits(individual) + ByteLevel)
    llama-bpe  Llama 3's regex                        (Split + ByteLevel without its regex)
    qwen2      Qwen2's regex (single digits)          (Split + ByteLevel without its regex)

Token types: 3 (control, e.g. ``<|im_start|>``) become special added tokens, matched whole and left out of
decoded text with ``skip_special_tokens``; 4 (user-defined) become plain added tokens, matched whole.
A pre-tokenizer not in the table is refused: splitting text differently from the model's training gives
other token ids, and so other output, without any error.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from engine.model.gguf import GGUFError, GGUFTokenizerSpec

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama-bpe", "llama3", "qwen2")
CONTROL, USER_DEFINED = 3, 4


def build_gguf_tokenizer(spec: GGUFTokenizerSpec, *, source: str) -> HFTokenizer:
    """The tokenizer ``spec`` describes; ``source`` names the file in errors."""
    if spec.model != "gpt2":
        raise GGUFError(f"{source}: tokenizer.ggml.model {spec.model!r} is not supported")
    vocab = {token: i for i, token in enumerate(spec.tokens)}
    merges = []
    for i, merge in enumerate(spec.merges):
        a, sep, b = merge.partition(" ")
        if not sep or not a or not b:
            raise GGUFError(f"{source}: tokenizer.ggml.merges[{i}] {merge!r} is not 'left right'")
        merges.append((a, b))
    # llama.cpp (and Llama 3's own tokenizer.json) look a whole pre-token up in the vocabulary before
    # merging for the Llama 3 pre-tokenizer: a word the vocabulary holds is one token even when the
    # merges would not build it.
    ignore_merges = spec.pre in ("llama-bpe", "llama3")
    tok = HFTokenizer(
        models.BPE(
            vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges
        )
    )
    tok.pre_tokenizer = _pre_tokenizer(spec.pre, source)
    tok.decoder = decoders.ByteLevel()
    types = spec.token_types or (0,) * len(spec.tokens)
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(spec.tokens, types, strict=True)
            if kind == CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(spec.tokens, types, strict=True)
            if kind == USER_DEFINED
        ]
    )
    tok.post_processor = _post_processor(spec)
    return tok


def _pre_tokenizer(pre: str, source: str) -> pre_tokenizers.PreTokenizer:
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bytes_only = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("default", "gpt2"):
        return gpt2
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre in ("llama-bpe", "llama3"):
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"), bytes_only]
        )
    if pre == "qwen2":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"), bytes_only]
        )
    raise GGUFError(
        f"{source}: tokenizer.ggml.pre {pre!r} is not supported; pdkv knows {', '.join(PRE_TOKENIZERS)}"
    )


def _post_processor(spec: GGUFTokenizerSpec) -> processors.PostProcessor:
    """Adds BOS / EOS around an encoded text when the file says llama.cpp does."""
    single, specials = "$A", []
    if spec.add_bos_token and spec.bos_token_id is not None:
        bos = spec.tokens[spec.bos_token_id]
        single, specials = f"{bos} {single}", [(bos, spec.bos_token_id)]
    if spec.add_eos_token and spec.eos_token_id is not None:
        eos = spec.tokens[spec.eos_token_id]
        single = f"{single} {eos}"
        specials.append((eos, spec.eos_token_id))
    if not specials:
        return processors.ByteLevel(trim_offsets=False)
    return processors.TemplateProcessing(single=single, pair=f"{single} $B", special_tokens=specials)
