"""Turn each sampling row's logits into one token: greedy, or temperature / top-k / top-p / min-p.

Filters apply in this order on ``logits / temperature``: top-k, then top-p over what top-k kept (both on
one descending sort), then min-p on the resulting probabilities.  The draw is an exponential race,
``argmax(p_i / E_i)`` with ``E_i ~ Exp(1)``, which picks token ``i`` with probability ``p_i``.

Reproducibility: a request with a ``seed`` draws its noise from a generator seeded with
``mix(seed, output_index)``, so its n-th token depends only on its own logits, its seed and n -- never on
which other requests share the batch, nor on whether it was preempted and recomputed, nor on which node
sampled it (a decode node continuing a prefill counts the first token as output 0).  The noise is made
on the CPU so a seed means the same thing on every device.  Unseeded requests share the engine's
generator.

Logit processors run first, on a copy, for the rows whose parameters turn one on (``logit_bias``,
``min_tokens``, the penalties; ``SamplingParams.processes_logits``), in this order: the bias is added,
the stop tokens are masked while fewer than ``min_tokens`` are out, then transformers' repetition penalty
(over the prompt and the output: a positive logit divided by it, a negative one multiplied) and OpenAI's
presence and frequency penalties (over the output: ``- presence * [count > 0] - frequency * count``).
"The output" is every output token, also those another engine sampled before this one took over (a
decode node continuing a prefill), so a request's penalties do not depend on where it runs.

Logprobs are ``log_softmax`` of the raw (unprocessed, untempered, unfiltered) logits at the chosen token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.request import TokenHistory
from engine.sampling_params import SamplingParams, TopLogprobs
from engine.structured import Matcher

_MASK64 = (1 << 64) - 1


def _argmax_only(row: SamplingRow) -> bool:
    """Whether the row's token is the raw logits' argmax and nothing else is read from them: greedy, no
    logit processor, no constraint, no logprobs."""
    p = row.params
    return p.greedy and not p.processes_logits and row.matcher is None and not p.logprobs


def mix_seed(seed: int, index: int) -> int:
    """A well-spread 63-bit seed from (request seed, output index): splitmix64 over both."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """One request to sample for: its parameters, which output token (0-based) this is, and -- when a
    logit processor is on -- its tokens."""

    params: SamplingParams
    output_index: int
    history: TokenHistory | None = None
    matcher: Matcher | None = None  # a structured output's constraint: only the tokens it allows


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # None where the request did not ask for logprobs
    top_logprobs: list[TopLogprobs | None]  # None where it did not ask for alternatives


def alternatives(logits: torch.Tensor, table: torch.Tensor, counts: Sequence[int]) -> list[TopLogprobs]:
    """Each row's ``counts[r]`` most likely tokens and their log-probabilities (``table``), ordered by the
    logits as greedy reads them: highest first, and among equal logits the lowest token id first --
    argmax's rule, so under greedy sampling the first alternative is the token chosen.  A row's answer is
    its own: ``topk``'s order among ties (bfloat16 logits tie often) followed the batch's largest count.
    One ``topk`` for the batch; a row whose first count + 1 values hold a tie takes the exact path."""
    out: list[TopLogprobs] = [() for _ in counts]
    k = min(max(counts, default=0) + 1, logits.shape[-1])
    if k <= 1:
        return out
    values, ids = logits.topk(k, dim=-1)
    picked = table.gather(1, ids)
    rows = zip(values.tolist(), ids.tolist(), picked.tolist(), strict=True)
    for r, (vals, row_ids, lps) in enumerate(rows):
        n = counts[r]
        if not n:
            continue
        if all(vals[i] != vals[i + 1] for i in range(min(n, k - 1))):  # no tie within or at the cut
            out[r] = tuple(zip(row_ids[:n], lps[:n], strict=True))
            continue
        threshold = vals[n - 1]
        candidates = (logits[r] >= threshold).nonzero()[:, 0]  # ascending ids: every tie at the cut
        order = torch.sort(logits[r][candidates], descending=True, stable=True).indices[:n]
        chosen = candidates[order]
        out[r] = tuple(zip(chosen.tolist(), table[r][chosen].tolist(), strict=True))
    return out


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._generator = torch.Generator().manual_seed(seed)
        # The native greedy kernel (engine/native.py ArgmaxKernel), set by the runner on the CPU: the same
        # indices as max(dim).indices over float32 logits, at a tenth of its time on a large vocabulary.
        self.argmax: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """``logits`` [R, V], one row per entry of ``rows``: float32, or the model's 16-bit dtype as the LM
        head gives it -- read as it is by the native greedy argmax where every row only wants that
        (the same index as over its float32 copy), widened to float32 first otherwise."""
        assert logits.shape[0] == len(rows), "one logits row per sampling row"
        if logits.dtype != torch.float32 and not (
            self.argmax is not None and logits.dtype == torch.bfloat16 and all(_argmax_only(r) for r in rows)
        ):
            logits = logits.float()
        raw = logits
        if any(r.params.processes_logits for r in rows):
            logits = process_logits(logits.clone(), rows)
        if any(r.matcher is not None for r in rows):
            logits = constrain(logits if logits is not raw else logits.clone(), rows)
        # max(dim).indices is argmax (first index of the maximum, NaN wins) at 2.5x its speed on the CPU
        chosen = self.argmax(logits) if self.argmax is not None else logits.max(dim=-1).indices
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            chosen[idx] = self._sample(logits[idx], [rows[i] for i in sampled])
        logits = raw
        want_lp = [i for i, r in enumerate(rows) if r.params.logprobs]
        logprobs: list[float | None] = [None] * len(rows)
        top: list[TopLogprobs | None] = [None] * len(rows)
        if want_lp:
            idx = torch.tensor(want_lp, device=logits.device)
            selected = logits[idx]
            table = selected.log_softmax(dim=-1)  # [n, V]
            lp = table.gather(1, chosen[idx, None])[:, 0]  # [n]
            for i, value in zip(want_lp, lp.tolist(), strict=True):
                logprobs[i] = value
            counts = [rows[i].params.top_logprobs for i in want_lp]
            if any(counts):
                for i, alts in zip(want_lp, alternatives(selected, table, counts), strict=True):
                    if rows[i].params.top_logprobs:
                        top[i] = alts
        return SamplerOutput(chosen.tolist(), logprobs, top)

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Sample one token per row of ``logits`` [n, V]; returns [n] int64."""
        device = logits.device
        vocab = logits.shape[1]
        params = [r.params for r in rows]
        temperature = torch.tensor([p.temperature for p in params], device=device)
        x = logits / temperature[:, None]  # [n, V]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            x = self._top_k_top_p(x, params)
        probs = x.softmax(dim=-1)  # [n, V]
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device)
            floor = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [n, 1]
            probs = probs.masked_fill(probs < floor, 0.0)
        noise = torch.stack([self._exponential(r, vocab) for r in rows]).to(device)  # [n, V]
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _top_k_top_p(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        device = x.device
        vocab = x.shape[1]
        sorted_x, order = x.sort(dim=-1, descending=True)  # [n, V] each
        ranks = torch.arange(vocab, device=device)[None, :]  # [1, V]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
        drop = ranks >= top_k[:, None]  # [n, V], in sorted order
        sorted_probs = sorted_x.masked_fill(drop, float("-inf")).softmax(dim=-1)
        top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=device)
        # Drop a token once the tokens ranked above it already hold top_p of the mass (the first stays).
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) > top_p[:, None]
        drop_unsorted = torch.empty_like(drop).scatter_(1, order, drop)  # back to vocabulary order
        return x.masked_fill(drop_unsorted, float("-inf"))

    def _exponential(self, row: SamplingRow, vocab: int) -> torch.Tensor:
        seed = row.params.seed
        if seed is None:
            generator = self._generator
        else:
            generator = torch.Generator().manual_seed(mix_seed(seed, row.output_index))
        noise = torch.empty(vocab).exponential_(generator=generator)  # [V] float32 on the CPU
        # A draw of exactly 0 would turn a zero-probability token into 0/0 = NaN, which argmax picks.
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Apply each row's logit processors to ``logits`` [R, V] in place (see the module docstring)."""
    vocab = logits.shape[1]
    device = logits.device
    for i, row in enumerate(rows):
        p = row.params
        if not p.processes_logits:
            continue
        history = row.history
        assert history is not None, "a request whose logits are processed carries its tokens"
        x = logits[i]
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias if t < vocab], dtype=torch.long, device=device)
            bias = torch.tensor([b for t, b in p.logit_bias if t < vocab], dtype=x.dtype, device=device)
            x.index_add_(0, ids, bias)
        if p.min_tokens and row.output_index < p.min_tokens:  # never with a constraint (SamplingParams)
            stops = [t for t in history.stop_token_ids if t < vocab]
            if stops:
                x[torch.tensor(stops, dtype=torch.long, device=device)] = float("-inf")
        outputs = history.outputs() if p.presence_penalty or p.frequency_penalty else []
        if p.repetition_penalty != 1.0:
            seen = set(history.prompt_token_ids)
            seen.update(history.output_token_ids)
            ids = torch.tensor(sorted(t for t in seen if t < vocab), dtype=torch.long, device=device)
            selected = x[ids]
            x[ids] = torch.where(
                selected < 0, selected * p.repetition_penalty, selected / p.repetition_penalty
            )
        if outputs:
            counts = torch.bincount(torch.tensor(outputs, dtype=torch.long, device=device), minlength=vocab)
            counts = counts[:vocab].to(x.dtype)
            x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)
    return logits


def constrain(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Drop, in place, every token a row's constraint does not allow (``engine/structured.py``)."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        if row.matcher is None:
            continue
        allowed = row.matcher.allowed().to(logits.device)
        if not bool(allowed.any()):  # a matcher in error allows nothing: left unmasked, the scheduler ends it
            continue
        keep = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        n = min(vocab, allowed.shape[0])
        keep[:n] = allowed[:n]
        logits[i].masked_fill_(~keep, float("-inf"))
    return logits
