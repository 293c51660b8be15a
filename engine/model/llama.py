"""The Llama-family decoder (Llama, Mistral, Qwen2) over the paged KV cache.

One implementation covers the three: they differ only in config (q/k/v biases for Qwen2, sliding windows
for Mistral, RoPE scaling for Llama 3), which ``ModelConfig`` already resolved.  The forward takes the
step's tokens as one flat ragged batch ``[T]`` (see ``engine/attention.py`` for the row order); every
matmul runs on all T rows at once and only attention looks at request boundaries.

q/k/v and gate/up projections are fused into one matmul each; ``load_weights`` splits the Hugging Face
tensors into the fused parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, GatherWorkspace, paged_attention, write_kv
from engine.model.config import ModelConfig
from engine.model.rope import RotaryEmbedding, apply_rotary
from engine.native import NativeKernels, RMSNormKernel, RopeKernel, SiluMulKernel
from engine.native_attention import KV_CANONICAL, KV_PAIRED, DecodeKernel, PrefillKernel
from engine.runner_hooks import KVHooks


@dataclass(slots=True)
class ForwardContext:
    """Per-step state every layer reads: the cache, where this step's tokens go, and the hooks."""

    kv_cache: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    attn: AttentionMetadata
    hooks: KVHooks
    workspace: GatherWorkspace
    decode_kernel: DecodeKernel | None = None  # native decode attention (engine/native.py), if built
    rope_kernel: RopeKernel | None = None  # native RoPE + K/V write, if built
    prefill_kernel: PrefillKernel | None = None  # native prefill attention, if built and it serves the dtype
    deterministic: bool = False  # every attention row through prefill_kernel (engine/attention.py)


# (embeddings, cos, sin, context) -> hidden states, or None for a step it does not serve
FusedDecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor | None]


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back (as HF does, for bit-faithful parity).

    ``kernel`` (set by ``LlamaForCausalLM.use_native`` where it serves the model's dtype) computes the
    same in one native call."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps
        self.kernel: RMSNormKernel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_forward(self, h: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and this norm: ``h + delta`` (``h`` when ``delta`` is None) and its norm."""
        if delta is None:
            return h, self(h)
        if self.kernel is not None:
            return self.kernel.add(h, delta, self.weight, self.eps)
        h = h + delta
        return h, self(h)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.window = config.sliding_windows[layer]
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) * D]
        # Every row's K/V goes in before any row reads: a request may prefix-hit blocks another request
        # of this same step is computing.  And not before this layer's loads landed.
        if ctx.rope_kernel is not None:
            ctx.hooks.wait_for_layer_load(self.layer)
            qk, v = ctx.rope_kernel(
                qkv,
                cos,
                sin,
                ctx.kv_cache,
                self.layer,
                ctx.attn.slot_blocks,
                ctx.attn.slot_offsets,
                self.num_heads,
                KV_PAIRED if ctx.deterministic else KV_CANONICAL,
            )  # [T, H + Hkv, D] rotated; [T, Hkv, D]; K and V already in their slots
        else:
            # Queries and keys rotate in one call: [T, (H + Hkv) * D] -> [T, H + Hkv, D].
            qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim), cos, sin)
            v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
            ctx.hooks.wait_for_layer_load(self.layer)
            write_kv(ctx.kv_cache, self.layer, qk[:, self.num_heads :], v, ctx.attn, paired=ctx.deterministic)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, Hkv, D]
        out = paged_attention(
            q,
            k,
            v,
            ctx.kv_cache,
            self.layer,
            ctx.attn,
            scale=self.scale,
            window=self.window,
            workspace=ctx.workspace,
            kernel=ctx.decode_kernel,
            prefill_kernel=ctx.prefill_kernel,
            deterministic=ctx.deterministic,
        )  # [T, H, D]
        ctx.hooks.save_kv_layer(self.layer, ctx.kv_cache, ctx.attn)
        return self.o_proj(out.reshape(t, self.q_size))  # [T, H * D] -> [T, hidden]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.kernel: SiluMulKernel | None = None  # set by LlamaForCausalLM.use_native

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 I]
        if self.kernel is not None:
            return self.down_proj(self.kernel(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        h: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream arrives as ``h + delta`` (the previous layer's MLP output not yet added, so
        the add and the norm after it are one call) and leaves the same way: returns (h, mlp output)."""
        h, x = self.input_layernorm.add_forward(h, delta)
        h, x = self.post_attention_layernorm.add_forward(h, self.self_attn(x, cos, sin, ctx))
        return h, self.mlp(x)


# Hugging Face parameter name suffix -> (our fused parameter, shard index within it).
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head; parameters are named like HF's minus ``model.``."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = config
        # Build on the meta device and then allocate uninitialized storage: every parameter is
        # overwritten by load_weights, so running nn.Linear's random init would only waste time.
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.to(dtype)  # still on meta: free
        self.to_empty(device=device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, device)
        # Set by the runner where every linear runs packed (engine/model/fused_decode.py): decode steps
        # one native call per layer; it returns None for a step it does not serve.
        self.fused_decode: FusedDecodeFn | None = None

    def use_native(self, kernels: NativeKernels | None, dtype: torch.dtype, packed: bool = False) -> None:
        """Compute every RMSNorm and SwiGLU activation with ``kernels`` (engine/native.py) where they
        serve ``dtype``, the model's (``packed``: every linear runs packed, which the float32 SiLU kernel
        needs); the torch ops otherwise (and with None)."""
        norm = kernels.rms_norm if kernels is not None and RMSNormKernel.supports(dtype) else None
        silu = kernels.silu_mul if kernels is not None and SiluMulKernel.supports(dtype, packed) else None
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.kernel = norm
            elif isinstance(m, MLP):
                m.kernel = silu

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``input_ids``, ``positions`` [T] -> hidden states [T, hidden] (before the final norm)."""
        h = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, h.dtype)  # [T, 1, D/2] each
        if self.fused_decode is not None:
            out = self.fused_decode(h, cos, sin, ctx)  # one native call per layer, where it serves
            if out is not None:
                return out
        delta: torch.Tensor | None = None
        for layer in self.layers:
            h, delta = layer(h, delta, cos, sin, ctx)
        return h if delta is None else h + delta

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [R, hidden] -> logits [R, vocab] as the LM head gives them (the model's dtype)."""
        return self.lm_head(self.norm(hidden))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states of the rows that sample [R, hidden] -> float32 logits [R, vocab]."""
        return self.logits(hidden).float()

    # -- weights ------------------------------------------------------------------------------------------

    def expected_weight_names(self) -> set[str]:
        """The Hugging Face tensor names a complete checkpoint provides for this config."""
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.config.tie_word_embeddings:
            names.add("lm_head.weight")
        c = self.config
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                names.add(f"{p}self_attn.{proj}.weight")
            if c.qkv_bias:
                names |= {f"{p}self_attn.{proj}.bias" for proj in ("q_proj", "k_proj", "v_proj")}
            if c.o_bias:
                names.add(f"{p}self_attn.o_proj.bias")
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names.add(f"{p}mlp.{proj}.weight")
                if c.mlp_bias:
                    names.add(f"{p}mlp.{proj}.bias")
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[set[str], set[str]]:
        """Copy HF tensors into their (possibly fused) parameters; returns (names loaded, names unknown)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        unknown: set[str] = set()
        for hf_name, tensor in weights:
            if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
                loaded.add(hf_name)  # a duplicate some tied checkpoints ship; the embedding is the source
                continue
            dest = self._destination(params, hf_name)
            if dest is None:
                unknown.add(hf_name)
                continue
            _copy_checked(dest, tensor, hf_name)
            loaded.add(hf_name)
        return loaded, unknown

    def _destination(self, params: dict[str, nn.Parameter], hf_name: str) -> torch.Tensor | None:
        """The tensor (a slice of a fused parameter, maybe) that HF tensor ``hf_name`` fills."""
        name = hf_name.removeprefix("model.")
        for hf_part, (ours, shard) in _FUSED.items():
            if f".{hf_part}." in f".{name}":
                target = params.get(name.replace(hf_part, ours))
                if target is None:
                    return None
                sizes = self._shard_sizes(ours)
                return target.data.narrow(0, sum(sizes[:shard]), sizes[shard])
        target = params.get(name)
        return None if target is None else target.data

    def _shard_sizes(self, fused: str) -> list[int]:
        c = self.config
        if fused == "self_attn.qkv_proj":
            kv = c.num_kv_heads * c.head_dim
            return [c.num_heads * c.head_dim, kv, kv]
        return [c.intermediate_size, c.intermediate_size]


def _copy_checked(dest: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dest.shape) != tuple(src.shape):
        raise ValueError(
            f"weight {name!r} has shape {tuple(src.shape)} but the model's config implies {tuple(dest.shape)}"
        )
    dest.copy_(src)
