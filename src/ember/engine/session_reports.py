"""What the session table reports (``GET /v1/sessions``, metrics): read-only views, engine thread.

Kept apart from ``sessions.py``, which changes the table; this only reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ember.config import SessionConfig
from ember.engine.kv_cache import KVCacheManager
from ember.engine.session_restore import SessionData
from ember.engine.tier_policy import Tier, TierPolicy


class SessionReports:
    """Views of a session table: ``SessionManager`` provides the attributes below."""

    policy: TierPolicy
    data: dict[str, SessionData]
    kv: KVCacheManager
    clock: Callable[[], float]

    @property
    def config(self) -> SessionConfig:
        return self.policy.config

    def info(self, key: str) -> dict[str, Any] | None:
        """What ``GET /v1/sessions/{id}`` shows of a session."""
        record, data = self.policy.records.get(key), self.data.get(key)
        if record is None or data is None:
            return None
        ttl = self.config.hot_ttl_s if record.tier == Tier.HOT else self.config.warm_ttl_s
        now = self.clock()
        size = len(data.hot_blocks) * self.kv.bytes_per_block if record.tier == Tier.HOT else record.ram_bytes or record.disk_bytes
        return {
            "id": key,
            "tier": "warm" if record.tier == Tier.DISK else record.tier.value,
            "location": {Tier.HOT: "pool", Tier.WARM: "ram", Tier.DISK: "disk"}[record.tier],
            "tokens": len(data.token_ids),
            "cached_tokens": len(data.block_hashes) * self.kv.block_size,
            "bytes": size,
            "last_used_s_ago": round(now - record.last_used, 3),
            "on_disk": record.has_current_file,  # a copy of exactly this state is on disk
            "expires_in_s": round(record.last_used + ttl - now, 3),
        }

    def list_sessions(self, prefix: str = "") -> list[dict[str, Any]]:
        """Most recently used first."""
        return [info for key in reversed(self.policy.records) if key.startswith(prefix) and (info := self.info(key)) is not None]

    def tier_bytes(self) -> dict[str, int]:
        hot = sum(len(d.hot_blocks) for d in self.data.values()) * self.kv.bytes_per_block
        return {Tier.HOT.value: hot, Tier.WARM.value: self.policy.ram_bytes, Tier.DISK.value: self.policy.disk_bytes}
