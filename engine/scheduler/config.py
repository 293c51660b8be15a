"""Frozen engine configuration, validated at construction with errors that say how to fix the input."""

from __future__ import annotations

from dataclasses import dataclass

QUEUE_POLICIES = ("fcfs", "priority", "lpm")
LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: ``num_blocks`` blocks of ``block_size`` tokens each."""

    block_size: int = 16
    num_blocks: int = 512
    enable_prefix_caching: bool = True
    enable_kv_events: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if not isinstance(self.num_blocks, int) or self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {self.num_blocks!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits and the waiting-queue policy.

    ``max_num_batched_tokens`` is the token budget of one step (prefill chunks + one per decode);
    ``long_prefill_token_threshold`` caps one request's prefill chunk (0 = only the budget caps it).
    ``lpm`` serves first the waiting requests with the longest cached prefix; a request passed over
    ``max_passed_over`` times is served next regardless, so nothing starves.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    max_passed_over: int = 32
    # A connector load that fails: recompute from the first bad block, or fail the request with an error.
    kv_load_failure_policy: str = "recompute"
    # A hold (a finished request's blocks kept for the connector's transfer) ends after this long: the
    # engine asks the connector to stop the transfer, and frees the blocks once it confirms ...
    kv_hold_timeout_s: float = 120.0
    # ... or after this long, should it never confirm (a connector bug, logged as an error).
    kv_stop_timeout_s: float = 30.0
    # The most distinct LoRA adapters one step runs (the engine's adapter slots): a request whose adapter
    # would be one too many waits; it never runs on the base model.
    max_loras: int = 0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0 disables it)")
        if self.policy not in QUEUE_POLICIES:
            raise ValueError(f"policy {self.policy!r} is unknown; choose one of {', '.join(QUEUE_POLICIES)}")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy {self.kv_load_failure_policy!r} is unknown; "
                f"choose one of {', '.join(LOAD_FAILURE_POLICIES)}"
            )
        for name in ("kv_hold_timeout_s", "kv_stop_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0 (0: no adapters), got {self.max_loras}")
        if self.max_passed_over < 0:
            raise ValueError(f"max_passed_over must be >= 0, got {self.max_passed_over}")
