"""Structured outputs: the output constrained to a JSON schema, any JSON object, a regex, one of a list of
strings, or a Lark grammar -- with llguidance (``docs/structured_outputs_engine.md`` says why it, not
xgrammar).

A request names its constraint in ``SamplingParams.structured`` (a ``StructuredOutput``: plain data,
carried by the proto to every node).  Each engine (and the router, to refuse a bad one before any node
call) holds a ``GrammarCompiler``: it compiles a constraint once into a template matcher, cached by the
constraint, and hands every request a copy.  The request's matcher gives, before each token is sampled,
the mask of the tokens the constraint allows (``allowed``: the sampler drops the others, so with greedy
sampling the output is the unconstrained one wherever its token is allowed), and consumes each token
sampled.  A request that continues another engine's (a decode node after a prefill, a resumed stream)
has its matcher advance over the output tokens it was handed first, so the constraint holds across the
split.  Once the constraint is complete it allows only EOS, so the request stops there ("stop"), even
with ``ignore_eos``.

Compiling happens off the step loop: the engine's driver compiles on the caller's thread before the
request reaches the engine thread, which then finds it cached.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[Kind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20
MAX_CHOICES = 1024
CACHE_SIZE = 256
# JSON as OpenAI's strict mode writes it: one space after ":" and ",", no other whitespace (a schema's
# "x-guidance" options may say otherwise).
JSON_STYLE: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A constraint that does not compile; the message starts with ``structured`` and says why."""


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint.  ``spec``: the JSON schema's text (json_schema), the regex, the choices as a JSON
    list of strings (choice), the Lark grammar (grammar); empty for json_object."""

    kind: Kind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(
                f"structured.{self.kind} must be a string of at most {MAX_SPEC_CHARS} characters"
            )
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"structured.{self.kind} is empty")
        if self.kind == "choice":
            try:
                choices = json.loads(self.spec)
            except json.JSONDecodeError:
                choices = None
            if not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES:
                raise ValueError(f"structured.choice must be a JSON list of 1 to {MAX_CHOICES} strings")
            if not all(isinstance(c, str) and c for c in choices):
                raise ValueError("structured.choice must list non-empty strings")

    @classmethod
    def choice(cls, choices: Sequence[str]) -> StructuredOutput:
        if not choices or len(choices) > MAX_CHOICES or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"structured.choice must list 1 to {MAX_CHOICES} non-empty strings")
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutput:
        # Key order kept: properties are written in the schema's order (as OpenAI's strict mode writes
        # them) -- a schema that puts "reasoning" before "answer" means it.
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    def grammar(self) -> str:
        """The constraint as llguidance's grammar text (not yet checked: compiling checks it)."""
        from llguidance import LLMatcher

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as exc:
                raise GrammarError(f"structured.json_schema is not JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise GrammarError("structured.json_schema must be a JSON object")
            try:
                return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)  # type: ignore[arg-type]
            except ValueError as exc:
                raise GrammarError(f"structured.json_schema: {exc}") from None
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            choices = json.loads(self.spec)
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        return LLMatcher.grammar_from_lark(self.spec)


class Matcher:
    """One request's position in its constraint."""

    def __init__(self, inner: Any, vocab_size: int) -> None:
        self._inner = inner
        self._vocab = vocab_size

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens the constraint allows next (EOS only, once it is complete)."""
        import numpy as np
        import torch

        bits = np.frombuffer(self._inner.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self._vocab]
        return torch.from_numpy(mask.astype(np.bool_))

    def consume(self, token_ids: Sequence[int]) -> bool:
        """Advance over tokens sampled (here or by another engine); False if the constraint refused one."""
        return bool(self._inner.consume_tokens(list(token_ids))) if token_ids else True

    def step(self, token: int, eos_token_id: int | None) -> str | None:
        """After ``token`` was sampled: "stop" when the constraint is complete (the token is the EOS the
        mask allowed, even with ``ignore_eos``), an error message when the token broke it, else None."""
        if self.done:
            return "stop"
        if not self.consume((token,)) or self.error:
            return f"structured output: token {token} broke the constraint ({self.error[:200]})"
        if self.done and token == eos_token_id:
            return "stop"
        return None

    @property
    def done(self) -> bool:
        """The constraint is complete and allows nothing more."""
        return bool(self._inner.is_stopped()) and not self._inner.is_error()

    @property
    def error(self) -> str:
        return str(self._inner.get_error()) if self._inner.is_error() else ""


class GrammarCompiler:
    """Compiles constraints for one tokenizer, caching each (thread-safe: the driver compiles on callers'
    threads, the engine thread makes matchers)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._source = (tokenizer_json, vocab_size, list(eos_token_ids))
        self.vocab_size = vocab_size
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:  # built on first use (about 0.3 s for a 49k vocabulary)
            from llguidance import LLTokenizer

            text, vocab, eos = self._source
            self._tokenizer = LLTokenizer(text, n_vocab=vocab, eos_token=eos or None)
        return self._tokenizer

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for -- a token that is part of a UTF-8 character is that part, not
        U+FFFD -- and a special token's text: OpenAI's logprobs ``bytes``.  From the same llguidance table
        of the vocabulary the grammars use (byte-level and byte-fallback vocabularies alike)."""
        with self._lock:
            tokenizer = self._llg_tokenizer()
        return bytes(tokenizer.decode_bytes([token_id]))

    def compile(self, spec: StructuredOutput) -> Any:
        """The template matcher of ``spec`` (cached); ``GrammarError`` naming what does not compile."""
        with self._lock:
            template = self._cache.get(spec)
            if template is not None:
                self._cache.move_to_end(spec)
                return template
            tokenizer = self._llg_tokenizer()
        from llguidance import LLMatcher

        template = LLMatcher(tokenizer, spec.grammar(), log_level=0)
        if template.is_error():
            raise GrammarError(f"structured.{spec.kind} does not compile: {template.get_error()[:500]}")
        with self._lock:
            self._cache[spec] = template
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return template

    def matcher(self, spec: StructuredOutput, prior_output_token_ids: Sequence[int] = ()) -> Matcher:
        """A fresh matcher for one request, advanced over the output tokens another engine sampled."""
        matcher = Matcher(self.compile(spec).deep_copy(), self.vocab_size)
        if not matcher.consume(prior_output_token_ids):
            raise GrammarError(
                f"structured.{spec.kind}: the output handed over does not follow it ({matcher.error[:200]})"
            )
        return matcher
