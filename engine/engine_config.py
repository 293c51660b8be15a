"""``EngineConfig``: every option of one engine, frozen and validated when constructed.

The KV cache is sized either by ``num_blocks`` or by a byte budget (``kv_cache_bytes``), from which the
number of blocks follows once the model's per-block size is known (``num_blocks_for``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.connector.spec import KVConnectorSpec
from engine.hashing import SUPPORTED_ALGOS
from engine.scheduler.config import QUEUE_POLICIES, CacheConfig, SchedulerConfig

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

DTYPES = ("auto", "float32", "bfloat16", "float16")
# How a GGUF file's quantized matrices run (engine/model/quantized.py): as the file ships them, or
# dequantized at load to bfloat16 / float32.
WEIGHT_FORMATS = ("auto", "quantized", "bf16", "float32")
WEIGHTS_HELP = (
    "how a GGUF file's quantized matrices (Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K) run: quantized "
    "(packed as the file ships them, native AVX512-VNNI or AVX2 kernels: 1.0x the file's memory for "
    "Q8_0/Q4_0/Q4_1, 1.3-1.8x for the others; the built-in model decodes at 2x llama.cpp's batch-1 "
    "rate with AVX-512, 1.7x with AVX2 alone), bf16 or float32 (dequantized at load; that "
    "dtype); auto: quantized where the CPU, the file and the build allow it, unless --dtype float32 "
    "asks for the reference path (docs/quantized.md)"
)
_WEIGHT_DTYPES = {"bf16": "bfloat16", "float32": "float32"}
DEFAULT_KV_CACHE_BYTES = 512 * 1024**2
# What deterministic mode (engine/determinism.py) costs, measured by ``python -m bench.engine_real``
# (docs/BENCHMARKS.md); --help prints it.
DETERMINISTIC_COST = (
    "On by default where served: on SmolLM2-135M (AMD EPYC, AVX512-BF16, 2 cores) it costs under 1% of "
    "decode tokens/s at batch 8, nothing at batch 32 (2-4% faster on) and nothing of a 1000-token prefill; "
    "on an Intel Xeon with AMX, or with AVX-512 and no AVX512-BF16 (the dot products in FMAs), nothing "
    "measurable (bench.engine_real, 2026-12-05; the budget for on by default is 5%); with AVX2 alone (an "
    "AMD EPYC Zen 3 VM whose runs scatter by 10-30%) decode within the noise, a 1000-token prefill "
    "0.84-1.09 of off's speed in six runs (2026-12-06)"
)
DETERMINISTIC_SWITCH = ("auto", "on", "off")  # --deterministic's values


def deterministic_from_switch(value: str) -> bool | None:
    """``EngineConfig.deterministic`` for a ``--deterministic`` value: on True, off False, auto None."""
    if value not in DETERMINISTIC_SWITCH:
        raise ValueError(f"--deterministic must be one of {', '.join(DETERMINISTIC_SWITCH)}, got {value!r}")
    return {"on": True, "off": False}.get(value)


@dataclass(frozen=True)
class EngineConfig:
    """Options of one engine.  ``model=None`` means the embedded default model (written on first use).

    ``dtype="auto"``: on CUDA the checkpoint's 16-bit dtype, else bfloat16.  On the CPU, a checkpoint
    stored in float32 runs in float32 (its weights are not rounded); any other runs in bfloat16 where the
    CPU has AVX512_BF16 or AMX, or AVX-512 with pdkv's native bfloat16 kernels built
    (``engine/cpu_features.py``), else in float32.
    ``device="auto"``: CUDA when present, else the CPU.
    ``weights``: how a GGUF file's quantized matrices run (``engine/model/quantized.py``; the types:
    ``quant_blocks.KERNEL_TYPES``):
    ``quantized`` as the file ships them (native kernels, AVX512-VNNI or AVX2), ``bf16`` / ``float32``
    dequantized at load (and that dtype); ``auto`` is quantized where it can be served unless the dtype
    is explicitly float32 (the reference path).
    ``max_model_len``: the longest request (prompt + output); defaults to the model's
    ``max_position_embeddings``, cut to what the KV cache holds (with a warning), and may exceed neither.
    """

    model: str | Path | None = None
    dtype: str = "auto"
    weights: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # Record the prefix cache's stored/removed blocks for a publisher (``take_kv_events``).
    enable_kv_events: bool = False
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    hash_algo: str = "sha256"
    seed: int = 0
    # Builds the KV connector's halves (the registry's ``KVConnectorConfig``: a name or "pkg.module:Class"
    # and its options); None runs the no-op connector.
    kv_connector: KVConnectorSpec | None = None
    kv_load_failure_policy: str = "recompute"
    kv_hold_timeout_s: float = 120.0
    kv_stop_timeout_s: float = 30.0
    # Names this engine to its peers (p2p transfer parameters, store events).
    engine_id: str = "engine-0"
    # Batch-invariant forward passes (engine/determinism.py): True requires them (an error where they
    # cannot be served), None (the default: what they cost, DETERMINISTIC_COST, is within the budget for
    # on by default) has them wherever they can be served, False turns them off.
    deterministic: bool | None = None
    # LoRA adapters (engine/lora/): served from the start as (name, PEFT folder) pairs; ``enable_lora``
    # serves adapters without any at the start (loaded at run time).  Either makes the engine keep
    # ``max_loras`` adapter slots (the most distinct adapters one step runs), at most ``max_cpu_loras``
    # adapters in memory (None: max(max_loras, len(loras), 8)), of rank up to ``max_lora_rank``.
    loras: tuple[tuple[str, str], ...] = ()
    enable_lora: bool = False
    max_loras: int = 4
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(
                f"weights {self.weights!r} is not supported; choose one of {', '.join(WEIGHT_FORMATS)}"
            )
        wanted = _WEIGHT_DTYPES.get(self.weights)
        if wanted is not None and self.dtype not in ("auto", wanted):
            raise ValueError(f"weights {self.weights!r} computes in {wanted}, but dtype is {self.dtype!r}")
        if not isinstance(self.device, str) or not (
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")
        ):
            raise ValueError(f"device {self.device!r} is not supported; use auto, cpu, cuda or cuda:N")
        _positive_int("block_size", self.block_size)
        if self.num_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("set num_blocks or kv_cache_bytes, not both")
        if self.num_blocks is not None:
            _positive_int("num_blocks", self.num_blocks)
        if self.kv_cache_bytes is not None:
            _positive_int("kv_cache_bytes", self.kv_cache_bytes)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if self.policy not in QUEUE_POLICIES:
            raise ValueError(f"policy {self.policy!r} is unknown; choose one of {', '.join(QUEUE_POLICIES)}")
        if self.hash_algo not in SUPPORTED_ALGOS:
            raise ValueError(
                f"hash_algo {self.hash_algo!r} is not supported; choose one of {', '.join(SUPPORTED_ALGOS)}"
            )
        if self.kv_connector is not None and not isinstance(self.kv_connector, KVConnectorSpec):
            raise ValueError(
                "kv_connector must be a KVConnectorConfig(name=..., options={...}) from connectors.registry"
            )
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ValueError("engine_id must be a non-empty string")
        if self.deterministic not in (None, True, False):
            raise ValueError(f"deterministic must be True, False or None, got {self.deterministic!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        _positive_int("max_loras", self.max_loras)
        _positive_int("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})"
            )
        names = [n for n, _ in self.loras]
        if len(set(names)) != len(names):
            raise ValueError(f"loras: an adapter name is given twice ({names})")
        _ = self.scheduler_config  # validates the scheduling limits now, not at first use

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            policy=self.policy,
            kv_load_failure_policy=self.kv_load_failure_policy,
            kv_hold_timeout_s=self.kv_hold_timeout_s,
            kv_stop_timeout_s=self.kv_stop_timeout_s,
            max_loras=self.lora_slots,
        )

    @property
    def lora_slots(self) -> int:
        """Adapter slots: ``max_loras`` when LoRA is on (adapters given or ``enable_lora``), else 0."""
        return self.max_loras if self.enable_lora or self.loras else 0

    @property
    def cpu_loras(self) -> int:
        if self.max_cpu_loras is not None:
            return self.max_cpu_loras
        return max(self.max_loras, len(self.loras), 8)

    def cache_config(self, num_blocks: int) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            enable_kv_events=self.enable_kv_events,
        )

    def num_blocks_for(self, bytes_per_block: int) -> int:
        """``num_blocks`` if set, else as many blocks as the byte budget holds."""
        if self.num_blocks is not None:
            return self.num_blocks
        budget = self.kv_cache_bytes if self.kv_cache_bytes is not None else DEFAULT_KV_CACHE_BYTES
        blocks = budget // bytes_per_block
        if blocks < 1:
            raise ValueError(
                f"kv_cache_bytes {budget} holds no block of {bytes_per_block} bytes; raise kv_cache_bytes"
            )
        return blocks

    def context_length(self, max_positions: int, num_blocks: int, block_size: int) -> tuple[int, str]:
        """The longest request (prompt and output): ``max_model_len``, at most the model's positions and
        what the KV cache holds -- a request's blocks are all in the cache while it runs, and one longer
        was admitted and failed mid-stream.  An explicit ``max_model_len`` past either is refused; the
        model's own context is cut to the cache, with a warning.  With what set it, for errors."""
        capacity = num_blocks * block_size
        if self.max_model_len is None and max_positions > capacity:
            logger.warning(
                "the model's context (%d tokens) is more than the KV cache holds (%d blocks, %d tokens): "
                "requests of at most %d tokens are served; raise num_blocks (or kv_cache_bytes) for more",
                max_positions,
                num_blocks,
                capacity,
                capacity,
            )
            return capacity, f"what the KV cache holds: num_blocks {num_blocks} of {block_size} tokens"
        if self.max_model_len is None:
            return max_positions, "the model's context, max_position_embeddings"
        if self.max_model_len > max_positions:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{max_positions}"
            )
        if self.max_model_len > capacity:
            raise ValueError(
                f"max_model_len {self.max_model_len} is more than the KV cache holds ({num_blocks} blocks of "
                f"{block_size} tokens: {capacity}); a request that long could never finish -- raise "
                "num_blocks (or kv_cache_bytes) or lower max_model_len"
            )
        return self.max_model_len, "as configured"

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} was requested but CUDA is not available")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
        import torch

        from engine.cpu_features import fast_bf16_flags

        if self.dtype != "auto":
            return getattr(torch, self.dtype)  # type: ignore[no-any-return]
        if self.weights in _WEIGHT_DTYPES:
            return getattr(torch, _WEIGHT_DTYPES[self.weights])  # type: ignore[no-any-return]
        if device.type == "cpu":
            if checkpoint_dtype == "float32" or not fast_bf16_flags() or _bf16_kernels_missing():
                return torch.float32
            return torch.bfloat16
        if checkpoint_dtype in ("float16", "bfloat16"):
            return getattr(torch, checkpoint_dtype)  # type: ignore[no-any-return]
        return torch.bfloat16

    def dtype_reason(self, device: torch.device) -> str:
        """Why ``torch_dtype`` chose ``dtype``: one phrase for the log."""
        from engine.cpu_features import auto_cpu_dtype_note

        if self.dtype != "auto":
            return f"--dtype {self.dtype}"
        if self.weights in _WEIGHT_DTYPES:
            return f"--weights {self.weights}"
        if device.type != "cpu":
            return "auto on CUDA"
        if _bf16_kernels_missing():
            from engine.cpu_features import fast_bf16_flags, kernel_flags_label

            flags = kernel_flags_label(fast_bf16_flags())
            return f"auto = float32 on this CPU ({flags}, but the native bfloat16 kernels were not built)"
        return auto_cpu_dtype_note()


def _bf16_kernels_missing() -> bool:
    """Whether bfloat16 is fast here only on the native kernels (AVX-512 without AVX512-BF16 or AMX, or
    AVX2: torch's paths emulate it) and the library was built without them (the prefill attention stands
    for them: csrc/simd.h's PDKV_BF16)."""
    from engine.cpu_features import fast_bf16_flags, kernel_flags

    needs = kernel_flags()
    if not needs or fast_bf16_flags() != needs:
        return False
    from engine.native import native_kernels

    kernels = native_kernels()
    return kernels is None or kernels.prefill is None


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
