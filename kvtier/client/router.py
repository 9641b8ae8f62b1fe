"""Router: rank candidate workers for a prompt by what the master estimates each would cost.

    ns = vllm_namespace("meta-llama/Llama-3.1-8B", layout_fingerprint)  # what KVTierConnector stores under
    router = Router(MasterClient("tcp://master:7300"), ns, hasher=VllmBlockHasher(16), prefill_tokens_per_s=20_000)
    best = router.rank(token_ids, ["w1", "w2", "w3"])[0]      # Plan: worker, total_s, load/recompute split
    routed = router.route(token_ids, ["w1", "w2"], session="agent-7")  # the best plan, and its prefix prefetched
    router.prefetch(token_ids, "w2")                          # PrefetchResult: accepted/clipped/ignored/rejected

Keys are computed the way the engine computed them (an engine hasher from kvtier.keys.hashers, folded into the
namespace exactly as the connectors fold engine hashes), or by kvtier's own chained hash when no hasher is
given; a caller holding keys already passes them instead of token ids.

``prefetch`` asks the worker that will serve a prompt to bring its prefix up into DRAM before the request arrives
(from its SSD, or a pool its store reads: master/prefetch.py); ``route`` ranks and, when the best plan loads a
prefix, asks its worker for that prefix at once (a sticky router that picked the worker already calls
``prefetch``). The master answers at once; the worker collects the order at its next heartbeat.

Thread-safety and blocking follow the client: ``rank`` blocks on a MasterClient, ``rank_async`` awaits an
AsyncMasterClient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.client.api import Plan, PrefetchResult
from kvtier.client.master import AsyncMasterClient, MasterClient
from kvtier.keys.hashers import BlockHasher
from kvtier.keys import KEY_BYTES, Namespace


@dataclass
class Routed:
    """``route``'s answer: the plans cheapest first (``best`` is the first), and the prefetch asked of the best
    plan's worker (None: not asked: ``prefetch`` off, or the plan loads nothing)."""

    plans: list[Plan]
    prefetch: PrefetchResult | None

    @property
    def best(self) -> Plan:
        return self.plans[0]


class Router:
    """Cost-ranked worker choice. ``block_tokens`` defaults to the hasher's block size."""

    def __init__(self, client: MasterClient | AsyncMasterClient, namespace: Namespace, *,
                 hasher: BlockHasher | None = None, block_tokens: int | None = None,
                 prefill_tokens_per_s: float = 10_000.0) -> None:
        if block_tokens is None:
            if hasher is None:
                raise ValueError("give block_tokens (or a hasher, whose block size it then is)")
            block_tokens = hasher.block_size
        if hasher is not None and hasher.block_size != block_tokens:
            raise ValueError(f"hasher block size {hasher.block_size} != block_tokens {block_tokens}")
        if not prefill_tokens_per_s > 0:
            raise ValueError(f"prefill_tokens_per_s must be > 0, got {prefill_tokens_per_s}")
        self.client = client
        self.namespace = namespace
        self.hasher = hasher
        self.block_tokens = block_tokens
        self.prefill_tokens_per_s = prefill_tokens_per_s

    def keys_for(self, token_ids: Sequence[int] | np.ndarray) -> list[bytes]:
        """The keys the engine stored for the full blocks of ``token_ids``."""
        if self.hasher is None:
            return self.namespace.chain(token_ids, self.block_tokens)
        return self.namespace.keys(self.hasher.hashes(token_ids))

    def _request(self, prompt: Sequence[int] | Sequence[bytes] | np.ndarray) -> tuple[list[bytes], int]:
        """(keys, prompt tokens) for token ids or for keys."""
        if len(prompt) and isinstance(prompt[0], (bytes, bytearray)):
            keys = [bytes(k) for k in prompt]  # type: ignore[arg-type]
            if any(len(k) != KEY_BYTES for k in keys):
                raise ValueError(f"keys must be {KEY_BYTES} bytes each")
            return keys, len(keys) * self.block_tokens
        return self.keys_for(prompt), len(prompt)  # type: ignore[arg-type]

    @staticmethod
    def _ranked(plans: list[Plan]) -> list[Plan]:
        # Cheapest first; among equals, the one holding more locally (it spends no network).
        return sorted(plans, key=lambda p: (p.total_s, -sum(p.local_tokens.values())))

    def rank(self, prompt: Sequence[int] | Sequence[bytes] | np.ndarray, workers: Sequence[str],
             checkpoints: Sequence[tuple[int, Sequence[bytes]]] | None = None) -> list[Plan]:
        """Plans for ``workers``, cheapest first. ``prompt``: token ids, or the prompt's block keys (a hybrid
        model's: its full-history blocks). ``checkpoints``: a hybrid model's restore points, (blocks, the keys of
        the state and window blocks restoring there needs), as the connector stored them (api.cost)."""
        if not isinstance(self.client, MasterClient):
            raise TypeError("rank() needs a MasterClient; use rank_async() with an AsyncMasterClient")
        return self._plans(*self._request(prompt), workers, checkpoints)

    def _plans(self, keys: list[bytes], tokens: int, workers: Sequence[str],
               checkpoints: Sequence[tuple[int, Sequence[bytes]]] | None) -> list[Plan]:
        assert isinstance(self.client, MasterClient)
        res = self.client.cost(keys, workers, self.block_tokens, self.prefill_tokens_per_s, prompt_tokens=tokens,
                               checkpoints=checkpoints)
        return self._ranked(res.plans)

    def prefetch(self, prompt: Sequence[int] | Sequence[bytes] | np.ndarray, worker: str, *,
                 session: str | None = None, ttl_s: float = 30.0) -> PrefetchResult:
        """Ask ``worker`` to bring the prompt's prefix up into its DRAM (token ids or keys, as ``rank``);
        ``session`` names the agent (its job replaces the agent's earlier one). ``ttl_s``: how long the order
        waits for the worker to collect it."""
        if not isinstance(self.client, MasterClient):
            raise TypeError("prefetch() needs a MasterClient; use prefetch_async() with an AsyncMasterClient")
        keys, _ = self._request(prompt)
        return self.client.prefetch(worker, keys, session, ttl_s)

    async def prefetch_async(self, prompt: Sequence[int] | Sequence[bytes] | np.ndarray, worker: str, *,
                             session: str | None = None, ttl_s: float = 30.0) -> PrefetchResult:
        if not isinstance(self.client, AsyncMasterClient):
            raise TypeError("prefetch_async() needs an AsyncMasterClient; use prefetch() with a MasterClient")
        keys, _ = self._request(prompt)
        return await self.client.prefetch(worker, keys, session, ttl_s)

    def route(self, prompt: Sequence[int] | Sequence[bytes] | np.ndarray, workers: Sequence[str], *,
              session: str | None = None, prefetch: bool = True, ttl_s: float = 30.0,
              checkpoints: Sequence[tuple[int, Sequence[bytes]]] | None = None) -> Routed:
        """``rank``, then (``prefetch``) ask the best plan's worker for the prefix that plan loads: the blocks it
        would read from below its DRAM or from another node are brought up while the request is on its way."""
        if not isinstance(self.client, MasterClient):
            raise TypeError("route() needs a MasterClient")
        keys, tokens = self._request(prompt)
        plans = self._plans(keys, tokens, workers, checkpoints)
        load = min(len(keys), plans[0].load_tokens // self.block_tokens) if plans else 0
        if not prefetch or load == 0:
            return Routed(plans, None)
        return Routed(plans, self.client.prefetch(plans[0].worker, keys[:load], session, ttl_s))

    async def rank_async(self, prompt: Sequence[int] | Sequence[bytes] | np.ndarray, workers: Sequence[str],
                         checkpoints: Sequence[tuple[int, Sequence[bytes]]] | None = None) -> list[Plan]:
        if not isinstance(self.client, AsyncMasterClient):
            raise TypeError("rank_async() needs an AsyncMasterClient; use rank() with a MasterClient")
        keys, tokens = self._request(prompt)
        res = await self.client.cost(keys, workers, self.block_tokens, self.prefill_tokens_per_s,
                                     prompt_tokens=tokens, checkpoints=checkpoints)
        return self._ranked(res.plans)
