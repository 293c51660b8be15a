"""Decode steps one native call per layer (``engine/csrc/decode_layer.c``) where every linear is packed
for the native kernels (GGUF's quantized blocks or dense bfloat16, ``engine/model/quantized.py``).

A batch-1 decode step of the built-in model reads its 96 MB of quantized weights in about 4 ms; calling
the ~10 kernels of each of 30 layers from Python (wrappers, tensors, ctypes) cost as much again.
``FusedDecode`` hands each layer to ``pdkv_decode_layer``, which calls the same kernels in the same order
with the same roundings -- the per-op path's bits (a test compares the two) -- and the connector's layer
hooks still run between layers.

It serves a decode-only step (any number of rows), or in deterministic mode every step (all rows'
attention is the native prefill kernel's then, in both paths), in bfloat16 or float32 (quantized weights
under ``--dtype float32``) with every native kernel the per-op path would use, where every layer's
four linears are ``QuantLinear`` of at most ``MAX_PARTS`` parts (runs of one format: a Q4_K_M file's v
in Q6_K beside q and k in Q4_K) without bias (no Qwen2 biases) -- under LoRA wrappers on
the native LoRA kernel, whose deltas the call adds where the step has adapters (csrc/lora.c, as
LoRALinear.forward does), or on the torch path (no AVX-512 or AVX2), whose steps without adapter rows it
serves (the wrappers add nothing then); any other step takes the per-op path.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import torch

from engine.model.quantized import QuantLinear
from engine.native_attention import KV_CANONICAL, KV_PAIRED

if TYPE_CHECKING:
    from engine.model.llama import ForwardContext, LlamaForCausalLM
    from engine.native import DecodeLayerKernel

_P = ctypes.c_void_p
_I = ctypes.c_int64


class _LoRAModule(ctypes.Structure):
    _fields_ = [("a", _P), ("b", _P), ("part_start", _P), ("parts", _I), ("rank", _I), ("num_slots", _I)]


MAX_PARTS = 3  # decode_layer.c's PDKV_MAX_PARTS


class _Linear(ctypes.Structure):
    _fields_ = [("parts", _I), ("w", _P * MAX_PARTS), ("fmt", _I * MAX_PARTS), ("rows", _I * MAX_PARTS)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("norm1", _P), ("norm2", _P), ("qkv", _Linear), ("o", _Linear), ("gu", _Linear), ("d", _Linear),
        ("layer", _I), ("window", _I), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("lora", ctypes.POINTER(_LoRAModule)),
    ]  # fmt: skip


class _Shape(ctypes.Structure):
    _fields_ = [
        (n, _I)
        for n in (
            "hidden", "heads", "kv_heads", "head_dim", "inter", "num_layers", "block_size", "bf16", "kv_order"
        )
    ]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [
        ("rows", _I), ("table_width", _I), ("num_blocks", _I), ("cos", _P), ("sin", _P), ("kv_cache", _P),
        ("slot_blocks", _P), ("slot_offsets", _P), ("block_table", _P), ("positions", _P), ("counts", _P),
        ("chunks", _I), ("scratch", _P), ("lora_rows", _P), ("lora_on", _P),
    ]  # fmt: skip


class FusedDecode:
    """The layers of ``model`` as ``pdkv_decode_layer`` structs, built once (the weights never move)."""

    def __init__(self, model: LlamaForCausalLM, kernel: DecodeLayerKernel, dtype: torch.dtype) -> None:
        c = model.config
        self.layer_fn = kernel.layer_fn
        self.scratch_fn = kernel.scratch_fn
        self.shape = _Shape(
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.intermediate_size,
            c.num_layers,
            0,
            dtype == torch.bfloat16,
            KV_CANONICAL,
        )  # block_size and kv_order: the cache's, per step
        self.layers = []
        self.wrappers: list[Any] = []  # the LoRA wrappers, 4 per layer in the C order, None where none
        self._lora_structs = []  # kept alive: the layer structs point into them
        # LoRA wrappers on the torch path: the call serves only the steps without adapter rows (theirs add
        # nothing then), a step with adapters takes the per-op path.
        self.lora_native = True
        for i, layer in enumerate(_layers(model)):
            attn, mlp = _parts(layer)
            mods = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
            self.wrappers += [m if _is_wrapper(m) else None for m in mods]
            native = all(_lora_wrapper(m) is not None for m in mods)
            self.lora_native &= native or not any(_is_wrapper(m) for m in mods)
            lora = (_LoRAModule * 4)(*map(_lora_module, mods)) if native else None
            if lora is not None:
                self._lora_structs.append(lora)
            linears = [_linear(_base(m)) for m in mods]
            self.layers.append(
                _Layer(
                    layer.input_layernorm.weight.data_ptr(),
                    layer.post_attention_layernorm.weight.data_ptr(),
                    *linears,
                    i,
                    attn.window or 0,
                    layer.input_layernorm.eps,
                    attn.scale,
                    lora,
                )
            )
        self.scratch = torch.empty(0, dtype=torch.uint8)
        self.layer_refs = [ctypes.byref(layer) for layer in self.layers]  # each keeps its struct alive
        self.shape_ref = ctypes.byref(self.shape)
        self.bufs = torch.empty(4, 0, c.hidden_size, dtype=dtype)  # grown to the step's rows

    @staticmethod
    def packed(model: LlamaForCausalLM) -> bool:
        """Whether every layer's four linears run packed (``QuantLinear``, under a LoRA wrapper or not)."""
        return all(
            isinstance(_base(m), QuantLinear)
            for layer in _layers(model)
            for attn, mlp in (_parts(layer),)
            for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        )

    @staticmethod
    def serves(model: LlamaForCausalLM, dtype: torch.dtype) -> bool:
        """Whether every layer has what the fused call computes (see the module's docstring)."""
        if dtype not in (torch.bfloat16, torch.float32):
            return False
        for layer in _layers(model):
            attn, mlp = _parts(layer)
            if layer.input_layernorm.kernel is None or mlp.kernel is None:
                return False
            if layer.input_layernorm.eps != layer.post_attention_layernorm.eps:
                return False
            mods = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            native = [_lora_wrapper(m) is not None for m in mods]
            if any(native) and not all(native):
                return False  # the native LoRA kernel on some of the linears only
            for m in mods:
                base = _base(m)
                if not isinstance(base, QuantLinear) or len(base.parts) > MAX_PARTS or base.bias is not None:
                    return False
        return True

    @staticmethod
    def step_fits(ctx: ForwardContext) -> bool:
        """Whether the fused call computes this step as the per-op path would: a decode-only step with
        the native decode attention, or in deterministic mode any step (every row's attention is the
        native prefill kernel's in both); RoPE native."""
        a = ctx.attn
        if ctx.rope_kernel is None:
            return False
        if ctx.deterministic:
            return ctx.prefill_kernel is not None
        return not a.prefills and bool(a.decodes) and ctx.decode_kernel is not None

    def __call__(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor | None:
        """The layers over the step's embeddings ``h`` [T, hidden] -> hidden states (before the final
        norm); None for a step this does not serve (``step_fits``)."""
        if not self.step_fits(ctx):
            return None
        t = h.shape[0]
        # every row as a chunk (a decode row: a chunk of one at its position), the tables padded to the
        # widest: the prefill kernel's arguments, and for a decode-only step the decode kernel's too
        table, starts, counts = ctx.attn.as_chunks()
        chunks, counts_ptr = (starts.shape[0], counts.data_ptr()) if ctx.deterministic else (0, 0)
        need = int(self.scratch_fn(ctypes.byref(self.shape), t))
        if self.scratch.numel() < need:
            self.scratch = torch.empty(need, dtype=torch.uint8)
        kv = ctx.kv_cache
        self.shape.block_size = kv.shape[3]
        self.shape.kv_order = KV_PAIRED if ctx.deterministic else KV_CANONICAL
        assert kv.is_contiguous() and table.is_contiguous() and starts.is_contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        lora_rows = lora_on = None
        state = next((w.state for w in self.wrappers if w is not None), None)
        if state is not None and state.used:  # this step's adapters: each module's delta where it has one
            if not self.lora_native:
                return None  # the torch path's deltas: the per-op path computes this step
            assert state.rows is not None and state.rows.is_contiguous()
            lora_rows = state.rows
            on = [w is not None and bool(state.used & w.slot_bits) for w in self.wrappers]
            lora_on = torch.tensor(on, dtype=torch.int64)
        rows_ptr = None if lora_rows is None else lora_rows.data_ptr()
        on_ptr = None if lora_on is None else lora_on.data_ptr()
        step = _Step(
            t, table.shape[1], kv.shape[0], cos.data_ptr(), sin.data_ptr(), kv.data_ptr(),
            ctx.attn.slot_blocks.data_ptr(), ctx.attn.slot_offsets.data_ptr(), table.data_ptr(),
            starts.data_ptr(), counts_ptr, chunks, self.scratch.data_ptr(), rows_ptr, on_ptr,
        )  # fmt: skip
        shape, step_ref, fn = self.shape_ref, ctypes.byref(step), self.layer_fn
        hooks, attn = ctx.hooks, ctx.attn
        # two (h, delta) pairs in turns, kept across steps: a layer reads one and writes the other
        h = h.contiguous()
        assert h.dtype == self.bufs.dtype, "the step's dtype is the one the layers were built for"
        if self.bufs.shape[1] < t:
            self.bufs = torch.empty(4, t, h.shape[1], dtype=h.dtype)
        bufs = self.bufs[:, :t]
        ptrs = [b.data_ptr() for b in bufs]
        h_in, d_in = h.data_ptr(), None
        for i, layer in enumerate(self.layer_refs):
            hooks.wait_for_layer_load(i)
            h_out, d_out = ptrs[2 * (i % 2)], ptrs[2 * (i % 2) + 1]
            failed = fn(layer, shape, step_ref, h_in, d_in, h_out, d_out)
            if failed:
                raise RuntimeError(f"pdkv_decode_layer failed in layer {i} ({failed})")
            hooks.save_kv_layer(i, kv, attn)
            h_in, d_in = h_out, d_out
        if not self.layers:
            return h
        last = 2 * ((len(self.layers) - 1) % 2)
        return bufs[last] + bufs[last + 1]  # a new tensor: the buffers are the next step's


def _layers(model: LlamaForCausalLM) -> list[Any]:
    return list(model.layers)


def _parts(layer: Any) -> tuple[Any, Any]:
    """A decoder layer's attention and MLP modules."""
    return layer.self_attn, layer.mlp


def _is_wrapper(m: Any) -> bool:
    """A LoRA wrapper (engine/lora/layers.LoRALinear: ``base``, ``a2``/``b2``, ``state``; not imported
    here, which would circle back to the model)."""
    return hasattr(m, "base") and hasattr(m, "state")


def _lora_wrapper(m: Any) -> Any:
    """``m`` where it is a LoRA wrapper on the native LoRA kernel, else None (a wrapper on the torch path
    too: the fused call cannot reproduce that one)."""
    return m if _is_wrapper(m) and m.on_native_kernel else None


def _lora_module(m: Any) -> _LoRAModule:
    a, b = m.a2, m.b2
    return _LoRAModule(a.data_ptr(), b.data_ptr(), m.part_start.data_ptr(), len(m.parts), m.rank, a.shape[0])


def _base(m: Any) -> Any:
    return m.base if _is_wrapper(m) else m


def _linear(m: Any) -> _Linear:
    """A ``QuantLinear``'s parts as decode_layer.c's struct (its packed tensors live as long as the model)."""
    assert isinstance(m, QuantLinear) and 1 <= len(m.parts) <= MAX_PARTS
    ws = [w for _, w in m.parts]
    pad = MAX_PARTS - len(ws)
    return _Linear(
        len(ws),
        (_P * MAX_PARTS)(*(w.packed.data_ptr() for w in ws), *[None] * pad),
        (_I * MAX_PARTS)(*(w.fmt for w in ws), *[0] * pad),
        (_I * MAX_PARTS)(*(w.rows for w in ws), *[0] * pad),
    )
