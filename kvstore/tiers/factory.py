"""A tier from its config, importing the backend (redis, zmq) only when that tier is configured.

Here rather than in ``kvstore/config.py``: the tiers import their config classes, so a factory in the
config module made an import circle.
"""

from __future__ import annotations

from typing import Any

from kvstore.config import CpuTierConfig, DiskTierConfig, RedisTierConfig, RemoteTierConfig, TierConfig
from kvstore.tiers.base import Tier, TierPolicy


def build_tier(config: TierConfig, policy: TierPolicy | None = None, **kwargs: Any) -> Tier:
    """Construct the tier a config describes, importing its backend only now."""
    if isinstance(config, CpuTierConfig):
        from kvstore.tiers.cpu import CpuTier

        return CpuTier(config, policy=policy, **kwargs)
    if isinstance(config, DiskTierConfig):
        from kvstore.tiers.disk import DiskTier

        return DiskTier(config, policy=policy, **kwargs)
    if isinstance(config, RedisTierConfig):
        from kvstore.tiers.redis import RedisTier

        return RedisTier(config, policy=policy, **kwargs)
    if isinstance(config, RemoteTierConfig):
        from kvstore.tiers.remote import RemoteTier

        return RemoteTier(config, policy=policy, **kwargs)
    raise TypeError(f"not a tier config: {config!r}")
