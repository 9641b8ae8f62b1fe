"""The service-time model of the replay: how long a request holds the modeled server.

One GPU server with two first-come-first-served resources: the host-to-GPU link, which loads the blocks hit
below HBM at each tier's bandwidth, and the prefill engine, which computes the missed tokens at a fixed rate
once the loads are done. Decode then runs at a per-request rate without slowing other requests (continuous
batching). A lane's next request waits for its previous one to finish, so better hit rates shorten service
times and the load on the server evolves with the cache, as it would on a real server.

Defaults, for Llama-3.1-8B on one H200:
* prefill 10,000 tokens/s: at agentic context lengths (~100K tokens) a new token costs ~16 GFLOP of weights
  plus ~25 GFLOP of attention; at ~400 TFLOP/s effective (half of bf16 peak) that is ~10K tokens/s;
* decode 50 tokens/s per request;
* load bandwidth per tier into HBM: DRAM 50 GB/s (PCIe 5.0 x16), remote pool 25 GB/s (a 200 Gb/s NIC),
  SSD 6 GB/s (one NVMe drive).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0
DEFAULT_DECODE_TOKENS_PER_S = 50.0
DEFAULT_TIER_BYTES_PER_S: dict[str, float] = {"dram": 50e9, "pool": 25e9, "ssd": 6e9}


@dataclass(frozen=True)
class ServiceModel:
    """Rates of the modeled server. Immutable; shared by every run of a sweep."""

    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    decode_tokens_per_s: float = DEFAULT_DECODE_TOKENS_PER_S
    tier_bytes_per_s: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_TIER_BYTES_PER_S))

    def __post_init__(self) -> None:
        for name, v in (("prefill rate", self.prefill_tokens_per_s), ("decode rate", self.decode_tokens_per_s)):
            if not v > 0:
                raise ValueError(f"{name} must be > 0 tokens/s, got {v}")
        for tier, v in self.tier_bytes_per_s.items():
            if not v > 0:
                raise ValueError(f"bandwidth of tier {tier!r} must be > 0 B/s, got {v}")

    def bandwidth(self, tier: str) -> float:
        try:
            return self.tier_bytes_per_s[tier]
        except KeyError:
            raise ValueError(f"no load bandwidth for tier {tier!r}; give one with --bandwidth "
                             f"{tier}=<bytes/s>") from None


class Server:
    """Virtual-time state of the modeled server. Used by one replayer; not thread-safe."""

    __slots__ = ("model", "link_free", "gpu_free", "prefill_busy_s")

    def __init__(self, model: ServiceModel) -> None:
        self.model = model
        self.link_free = 0.0  # when the host-to-GPU link finishes the loads queued so far
        self.gpu_free = 0.0  # when the prefill engine finishes the prefills queued so far
        self.prefill_busy_s = 0.0  # total prefill time: over the replay's span, how saturated the server was

    def load(self, now: float, seconds: float) -> float:
        """Queue a load of ``seconds`` on the link at ``now``; return when it is done."""
        if seconds <= 0:
            return now
        self.link_free = max(self.link_free, now) + seconds
        return self.link_free

    def prefill(self, now: float, tokens: int) -> float:
        """Queue a prefill of ``tokens`` at ``now`` (its loads done); return when its first token is out."""
        seconds = tokens / self.model.prefill_tokens_per_s
        self.prefill_busy_s += seconds
        self.gpu_free = max(self.gpu_free, now) + seconds
        return self.gpu_free

    def decode_seconds(self, tokens: int) -> float:
        return tokens / self.model.decode_tokens_per_s
