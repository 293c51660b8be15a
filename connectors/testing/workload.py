"""What the kit runs: a tiny random model's spec, the generation parameters, and fixed prompts whose
lengths cover a partial last block and an exact multiple of the block size."""

from __future__ import annotations

import random
from collections.abc import Sequence

from engine.model.make_model import TinyLlamaSpec
from engine.sampling_params import SamplingParams

# Wide weights (init_std 0.2) spread the logits, so greedy decoding has no near-ties and outputs compare
# exactly whether a prefix was loaded or computed: over the kit's prompts and 12 generated tokens, the
# top-2 logit gap never falls below 0.017 (float32 rounding moves logits by ~1e-6).
KIT_MODEL_SPEC = TinyLlamaSpec(
    layers=2,
    hidden=64,
    heads=4,
    kv_heads=2,
    vocab=300,
    intermediate_size=128,
    max_position_embeddings=256,
    init_std=0.2,
    seed=0,
)
BLOCK_SIZE = 4
MAX_TOKENS = 6
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompts(lengths: Sequence[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i, n in enumerate(lengths):
        # A distinct first token per prompt: no two prompts share a block, so no local prefix hits.
        out.append([seed % 50 + i] + [rng.randrange(256) for _ in range(n - 1)])
    return out


# 18 and 23: a partial last block; 16: an exact multiple of the block size (the last token is the last
# token of a full block); 11 and 9 short ones.
PROMPTS = _prompts((18, 16, 11, 23, 9), seed=1)
EXACT_MULTIPLE = 1  # index of the 16-token prompt
LONG_PROMPT = _prompts((40,), seed=101)[0]  # never saved by anyone: always computed
# What an engine serves after the kit's prompts, so that their freed blocks are reused (the freed-block
# check); its own prompt, so that a backend shared by every check never holds LONG_PROMPT.
FILLER_PROMPT = _prompts((40,), seed=202)[0]
# The first two blocks of each prompt that has them, then a tail of its own: a fork loads the shared
# blocks and computes the rest (the case where blocks computed over a failed load could be saved).
FORKS = [
    p[: 2 * BLOCK_SIZE] + tail
    for p, tail in zip(
        [p for p in PROMPTS if len(p) > 2 * BLOCK_SIZE], _prompts((13, 13, 13, 13), seed=7), strict=False
    )
]
