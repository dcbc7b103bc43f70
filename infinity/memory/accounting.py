"""Byte accounting: current/peak bytes per tier, bytes and seconds per link, fetch counts."""
from __future__ import annotations

import threading

__all__ = ["Accounting", "TIERS", "LINKS", "STATS_COUNTERS"]

TIERS = ("device", "host", "nvme")
LINKS = ("nvme_read", "nvme_write", "h2d", "d2h", "allgather", "reduce_scatter")
#: counters engine.stats() reports as 0 before they first count
STATS_COUNTERS = (
    "on_demand_fetches", "prefetched_fetches", "untracked_fetches", "divergent_steps",
    "prefetch_unused", "prefetch_evicted", "reused_fetches", "reused_bytes",
    "device_budget_overflows", "optimizer_groups_overlapped",
    "optimizer_groups_after_decision", "optimizer_groups_not_overlapped_shadow",
    "optimizer_groups_finished_after_step", "optimizer_master_handoffs",
    "optimizer_master_read_bytes_saved", "activation_offload_bytes", "activation_fetch_bytes",
    "allgather_sent_bytes", "allgather_sent_inter_bytes", "grad_comm_sent_bytes",
    "grad_comm_sent_inter_bytes", "frozen_nvme_read_bytes", "frozen_host_read_bytes",
    "grad_buckets_reduced", "grad_bucket_early_reductions")


class Accounting:
    """Thread-safe counters. Everything reported is a plain number."""

    def __init__(self):
        self._lock = threading.Lock()
        self.current = {t: 0 for t in TIERS}
        self.peak = {t: 0 for t in TIERS}
        self.link_bytes = {k: 0 for k in LINKS}
        self.link_seconds = {k: 0.0 for k in LINKS}
        self.counters: dict[str, int] = {}

    def _tier(self, tier: str) -> str:
        if tier not in self.current:
            raise ValueError(f"accounting: unknown tier {tier!r}; expected one of {TIERS}")
        return tier

    def alloc(self, tier: str, nbytes: int) -> None:
        with self._lock:
            t = self._tier(tier)
            self.current[t] += int(nbytes)
            if self.current[t] > self.peak[t]:
                self.peak[t] = self.current[t]

    def free(self, tier: str, nbytes: int) -> None:
        with self._lock:
            t = self._tier(tier)
            self.current[t] -= int(nbytes)

    def link(self, name: str, nbytes: int, seconds: float = 0.0) -> None:
        with self._lock:
            if name not in self.link_bytes:
                raise ValueError(f"accounting: unknown link {name!r}; expected one of {LINKS}")
            self.link_bytes[name] += int(nbytes)
            self.link_seconds[name] += float(seconds)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n

    def reset_peaks(self) -> None:
        with self._lock:
            self.peak = dict(self.current)

    def as_dict(self) -> dict:
        with self._lock:
            d = {}
            for t in TIERS:
                d[f"{t}_bytes"] = self.current[t]
                d[f"{t}_peak_bytes"] = self.peak[t]
            for k in LINKS:
                d[f"{k}_bytes"] = self.link_bytes[k]
                d[f"{k}_seconds"] = self.link_seconds[k]
            d.update(self.counters)
            return d
