"""Per-request sampling parameters, validated when constructed."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from engine.structured import StructuredOutput

# Below this temperature a request is greedy: logits / 1e-300 overflow to inf, and inf / inf is NaN.
GREEDY_TEMPERATURE = 1e-5
# Stop conditions are checked on every output token: a request may not make that check unboundedly slow
# for everyone in its batch (200k stop strings more than doubled the shared step time).
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
# The most alternatives a request may ask for at each position (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
# One position's most likely tokens and their log-probabilities, most likely first.
TopLogprobs = tuple[tuple[int, float], ...]
# logit_bias entries per request, and the bound of each bias (OpenAI's).
MAX_LOGIT_BIAS = 300
MAX_BIAS = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each output token and when to stop.

    ``temperature`` below ``GREEDY_TEMPERATURE`` (1e-5, 0 included) is greedy; it must be finite, as must
    ``top_p`` and ``min_p``.  ``seed`` makes a sampled request reproducible regardless of what else runs
    in the batch.  ``stop`` strings are matched on the detokenized output and cut from the text.

    Logit processors (``engine/sampler.py``; off at their defaults): ``logit_bias`` (token id -> bias,
    stored as sorted pairs), ``min_tokens`` (stop tokens masked until that many are out), and the
    penalties -- ``repetition_penalty`` over the prompt and the output (transformers'), ``presence_penalty``
    and ``frequency_penalty`` over the output (OpenAI's).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    top_logprobs: int = 0
    # The output's constraint (a JSON schema, a regex, a choice, a grammar; engine/structured.py).
    structured: StructuredOutput | None = None
    # The prompt's own logprobs (vLLM's name): each prompt token's log-probability given the tokens before
    # it, with this many most likely alternatives per position (0: the token's only); None is off.  The
    # prompt is then computed whole (no prefix-cache or connector hit: a hit has no logits).  With it,
    # max_tokens may be 0: the prompt is scored and nothing is generated.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, Mapping) else bias
        object.__setattr__(self, "logit_bias", tuple(sorted((k, float(v)) for k, v in pairs)))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int)
            or isinstance(self.prompt_logprobs, bool)
            or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], "
                f"got {self.prompt_logprobs!r}"
            )
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens must be a positive integer (0 only when scoring the prompt), got 0")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 <= self.top_p <= 1.0:  # 0 (OpenAI's range starts there): the most likely token only
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 is off), got {self.repetition_penalty!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias holds {len(self.logit_bias)} entries; the limit is {MAX_LOGIT_BIAS}"
            )
        for token, value in self.logit_bias:
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {token!r}")
            if not math.isfinite(value) or not -MAX_BIAS <= value <= MAX_BIAS:
                raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {value!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}"
            )
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
        if self.structured is not None and self.min_tokens:
            # A completed constraint allows only the end: min_tokens could not be kept, so it is refused
            raise ValueError(
                "min_tokens is not served with a structured output or a forced tool call: the "
                "constraint ends the output once it is complete"
            )
        if self.top_logprobs and not self.logprobs:
            object.__setattr__(self, "logprobs", True)  # the alternatives come with the chosen token's
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids holds {len(self.stop_token_ids)} ids; the limit is {MAX_STOP_TOKEN_IDS}"
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop holds {len(self.stop)} strings; the limit is {MAX_STOP_STRINGS}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must hold non-negative integers, got {t!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"a stop string of {len(s)} characters; the limit is {MAX_STOP_STRING_CHARS}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def processes_logits(self) -> bool:
        """Whether a logit processor is on (the sampler then needs the request's tokens)."""
        return bool(
            self.logit_bias
            or self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )
