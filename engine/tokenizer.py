"""Text <-> token ids, and incremental detokenization of a growing output.

``Tokenizer.for_model(source)`` builds it from what the model ships: a folder's ``tokenizer.json`` (with
the ``tokenizers`` library), or a GGUF file's ``tokenizer.ggml.*`` metadata
(``engine/model/gguf_tokenizer.py``), plus the model's chat template when it has one.  A folder without
``tokenizer.json`` is refused -- guessing a tokenizer gives wrong text without an error -- except for our
random-weight test models (their ``config.json`` says so), which get a byte-level tokenizer (token ``b``
is byte ``b`` for ``b < 256``; bos/eos are special tokens; every other id decodes to nothing).  The same
builder writes ``pdkv make-model``'s tokenizer (``engine/model/make_model.py``).

Detokenization streams through ``tokenizers.decoders.DecodeStream``: it emits text only once the bytes
of a character are complete, so a delta never ends in half a UTF-8 sequence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from engine.chat_template import ChatTemplate
    from engine.model.loader import ModelSource
    from engine.sampling_params import SamplingParams

NUM_BYTES = 256
BOS_TEXT = "<bos>"
EOS_TEXT = "<eos>"


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what ByteLevel BPE vocabularies use)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(NUM_BYTES):
        if b not in printable:
            printable.append(b)
            chars.append(NUM_BYTES + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def build_byte_level_tokenizer(
    *,
    vocab_size: int,
    merges: Sequence[tuple[str, str]] = (),
    bos_token_id: int | None,
    eos_token_id: int | None,
) -> HFTokenizer:
    """A byte-level BPE tokenizer whose ids cover ``[0, vocab_size)`` exactly.

    Layout: ids 0..255 are the bytes in byte order, then one token per merge (in merge order), and every
    id left over is a special token: ``<bos>``/``<eos>`` at their ids, ``<|reserved_i|>`` elsewhere.  BOS,
    when it is a special token, is prepended on encode.
    """
    b2u = byte_to_unicode()
    vocab = {b2u[b]: b for b in range(NUM_BYTES)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    if len(vocab) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is too small for 256 bytes and {len(merges)} merges")
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = []
    for i in range(len(vocab), vocab_size):
        name = BOS_TEXT if i == bos_token_id else EOS_TEXT if i == eos_token_id else f"<|reserved_{i}|>"
        specials.append(AddedToken(name, special=True, normalized=False))
    tok.add_special_tokens(specials)
    if bos_token_id is not None and bos_token_id >= len(vocab):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TEXT} $A", pair=f"{BOS_TEXT} $A $B", special_tokens=[(BOS_TEXT, bos_token_id)]
        )
    return tok


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special ids the engine needs."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        source: str,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.source = source
        self.chat_template = chat_template

    @classmethod
    def for_model(cls, model: ModelSource) -> Tokenizer:
        """The tokenizer (and chat template) ``model`` ships; see the module docstring for the rules."""
        from engine.model.gguf import GGUFModel

        config = model.config
        eos = config.eos_token_ids[0] if config.eos_token_ids else None
        if isinstance(model, GGUFModel):
            from engine.model.gguf_tokenizer import build_gguf_tokenizer

            tok = build_gguf_tokenizer(model.tokenizer, source=str(model.path))
            source = f"{model.path} (tokenizer.ggml)"
        else:
            path = model.path / "tokenizer.json"
            if path.is_file():
                tok = _read_tokenizer_json(path)
                source = str(path)
            elif model.is_random:
                tok = _fallback(model.path, config.vocab_size, config.bos_token_id, eos)
                source = "byte-level tokenizer of a random test model"
            else:
                raise FileNotFoundError(
                    f"model folder {str(model.path)!r} has no tokenizer.json; copy the model's tokenizer.json"
                    " into it (pdkv does not guess a tokenizer)"
                )
        template = _chat_template(tok, model, eos)
        return cls(
            tok, bos_token_id=config.bos_token_id, eos_token_id=eos, source=source, chat_template=template
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token stands for, at most: the longest token string of the
        vocabulary (a byte-level token spells each of its bytes as one character).  A text of N
        characters has at least N / max_token_chars tokens."""
        return max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1) or 1

    def to_json(self) -> str:
        """The tokenizer as tokenizers' JSON (what a grammar engine builds its token table from)."""
        return str(self._tok.to_str())

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """``messages`` rendered with the model's chat template (and ``tools``, OpenAI-shaped, for a
        template that describes them) and tokenized (the template writes every special token itself, so
        none is added).  ``ChatTemplateError`` names what is wrong."""
        from engine.chat_template import ChatTemplateError

        if self.chat_template is None:
            raise ChatTemplateError(f"the model ({self.source}) has no chat template; send text or token ids")
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        return self.encode(text, add_special_tokens=False)

    @property
    def end_of_turn_token_ids(self) -> tuple[int, ...]:
        """Tokens that end a chat reply (the template's end-of-turn tokens and EOS)."""
        ids = self.chat_template.end_of_turn_token_ids if self.chat_template is not None else ()
        eos = () if self.eos_token_id is None else (self.eos_token_id,)
        return tuple(dict.fromkeys((*ids, *eos)))

    def chat_sampling(self, params: SamplingParams) -> SamplingParams:
        """``params`` for a chat reply: it also stops at the template's end-of-turn tokens -- the chat's
        end of sequence, so ``ignore_eos`` ignores them too (vLLM's rule: its stop ids from the generation
        config apply only without it); ``stop_token_ids`` the request sends stop it either way."""
        import dataclasses

        if params.ignore_eos:
            return params
        stops = tuple(dict.fromkeys((*params.stop_token_ids, *self.end_of_turn_token_ids)))
        return dataclasses.replace(params, stop_token_ids=stops)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def stream(self, *, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._tok, skip_special_tokens=skip_special_tokens)


def _read_tokenizer_json(path: Path) -> HFTokenizer:
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as exc:  # the library raises a bare Exception on malformed files
        raise ValueError(f"{path}: not a valid tokenizers file ({exc})") from exc


def _fallback(folder: Path, vocab_size: int, bos: int | None, eos: int | None) -> HFTokenizer:
    if vocab_size < NUM_BYTES:
        raise ValueError(
            f"model folder {str(folder)!r} has no tokenizer.json and its vocab_size {vocab_size} is too "
            "small for the byte-level tokenizer (needs >= 256); pass token ids or add a tokenizer.json"
        )
    return build_byte_level_tokenizer(vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos)


def _chat_template(tok: HFTokenizer, model: ModelSource, eos: int | None) -> ChatTemplate | None:
    source = model.chat_template
    if source is None:
        return None
    from engine.chat_template import ChatTemplate

    def text(token_id: int | None) -> str:
        return "" if token_id is None else (tok.id_to_token(token_id) or "")

    special = {
        "bos_token": text(model.config.bos_token_id),
        "eos_token": text(eos),
    }
    vocab = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    return ChatTemplate.build(source, special_tokens=special, vocab=vocab, origin=str(model.path))


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, one token at a time."""

    def __init__(self, tokenizer: HFTokenizer, *, skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._token_ids: list[int] = []
        self._num_chars = 0

    def push(self, token_id: int) -> str:
        """The text ``token_id`` completes; '' while a character's bytes are still incomplete."""
        self._token_ids.append(token_id)
        text = self._stream.step(self._tok, token_id) or ""
        self._num_chars += len(text)
        return text

    def flush(self) -> str:
        """At the end of the output: whatever is still held back (incomplete bytes decode to U+FFFD)."""
        full = self._tok.decode(self._token_ids, skip_special_tokens=self._skip_special_tokens)
        return full[self._num_chars :] if len(full) > self._num_chars else ""
