"""Predicted next use (PNU): keep the agents that come back soonest; evict whole agents, tails before roots.

Agentic traffic is a set of interleaved loops: each turn of an agent re-reads its whole context and appends a
little. A block's next use is its agent's next request, so the policy ranks agents, not blocks, by when each is
predicted back, using only what a server knows online (observations.py; docs/eviction.md "Eviction policies" has
the measurements that chose it):

* learned, no priors (returns.py): service times, and per stop reason the gaps until the agent's next request
  and the share of completions after which it comes back at all;
* an idle agent is predicted back at the median of that mixture given how long it has waited (never, if the
  mixture has no median: too few come back); one in flight after its median residual service time and then
  a gap; a "finished" hint: never; a TTL hint caps the prediction while it runs; priorities rank first
  (lower priority evicted first), then the prediction, then the least recently active (agents.py);
* eviction: agents not expected back (finished, or never predicted back), then blocks of no known agent (LRU
  order), then agents predicted back last first, each one's deepest blocks first (the depth of a key is its
  position in the arrival's chain, so the order of keys in a put never matters);
* admission: when a put does not fit, its new blocks are stored only as far as room can be made without
  evicting an agent predicted back sooner than theirs (the root-most part first), or none;
* a hybrid model's checkpoints (``Arrival.checkpoints``: its recurrent state and window tails at a boundary,
  checkpoints.py) belong to the agents that reached them, at the depth of the block before the boundary, just
  ahead of that block (a prefix without its checkpoint cannot be restored): a checkpoint superseded by its
  agent's newer one is evicted before anything else, a fork junction is handed to the soonest back of its
  other agents rather than evicted with one of them, and when one of a checkpoint's objects goes, the rest go
  first (they are of no use apart);
* until some stop reason is followed by a return at least two times in three (ReturnModel.predictive), the
  order is chain-aware LRU (chain_lru.py, kept beside at all times) and every block is admitted: traffic
  without sessions or completions, and chat traffic where half the requests are never followed up (Mooncake),
  get LRU's hit rates exactly.

Bounded memory: per tracked key one map entry and one heap entry here and an LRU entry in the recency order
(what a tier tracks anyway), per agent a small record (``max_agents``, the least recently active forgotten
first: their blocks join the unknown ones), per recent request its chain length, and per key of a recent
chain that is not stored yet one entry (``max_pending``, oldest dropped first). Work per call is O(batch),
bulk loops in C; the agents are re-scored in full at most once per ``refresh_s`` of the clock, and between
only the agents an observation concerns are moved.

Past ~400 lines on purpose: one policy whose every part (observations, the keys a tier tracks, eviction,
admission, ranking) reads and moves the same maps of keys to agents and the same heap, which a split would
have to share; its separable parts already live apart (agents.py: the agent records and ranking keys;
returns.py: the learned return model; chain_lru.py: the fallback order).
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict, deque
from collections.abc import Container, Sequence
from itertools import compress, count, repeat
from operator import and_, is_, is_not, not_

from kvtier.policies.base import Clock, Policy, take_oldest
from kvtier.policies.chain_lru import ChainLRUPolicy
from kvtier.policies.checkpoints import CheckpointObjects
from kvtier.policies.observations import SUBAGENTS, Arrival, Completion, Hint, Observations
from kvtier.policies.registry import register_policy
from kvtier.policies.agents import INF, UNKNOWN_STOP, Agent, Key, Ranking
from kvtier.policies.returns import ReturnModel


@register_policy("pnu")
class PredictedNextUse(Policy):
    """See the module docstring. ``capacity``: the tier's blocks (bounds the pending keys)."""

    name = "pnu"
    observes = True

    def __init__(self, capacity: int = 0, *, clock: Clock = time.monotonic, max_agents: int = 1 << 14,
                 max_pending: int | None = None, window: int = 1024, refresh_s: float = 1.0,
                 admission: bool = True) -> None:
        super().__init__(capacity, clock=clock)
        if max_agents < 1:
            raise ValueError(f"max_agents must be >= 1, got {max_agents}")
        self.max_agents = max_agents
        self.max_pending = max_pending if max_pending is not None else max(capacity, 1 << 16)
        self.max_requests = max(max_agents, 1 << 12)
        self.refresh_s, self.admission = refresh_s, admission
        self._agents: OrderedDict[str, Agent] = OrderedDict()  # least recently active first
        self._where: dict[bytes, Agent] = {}  # tracked key -> the agent owning it
        # Tracked keys of no known agent, LRU order. None until the first arrival: then every tracked key is one,
        # in the recency order, and keeping a second copy of that order would double a plain store's cost.
        self._orphans_map: OrderedDict[bytes, None] | None = None
        self._pending: OrderedDict[bytes, tuple[Agent, int]] = OrderedDict()  # chain keys not stored yet
        self._requests: OrderedDict[str, tuple[Agent, int, float]] = OrderedDict()  # -> (agent, chain len, t)
        self.model = ReturnModel(window, max_pending=self.max_requests)
        # Recency over blocks, chain by chain: the order while no prediction can be made.
        self._recency = ChainLRUPolicy(capacity, clock=clock, max_pending=self.max_pending,
                                       max_requests=self.max_requests)
        self._predicting = False
        self._uids = count()
        self._ranking = Ranking(self._key, refresh_s)
        self._checkpoints = CheckpointObjects(self.max_pending)
        self._dead: OrderedDict[bytes, None] = OrderedDict()  # tracked objects of superseded checkpoints: first

    # ---- observations ----------------------------------------------------------------------------------

    def observe(self, batch: Observations) -> None:
        for a in batch.arrivals:
            self._arrival(a)
        for c in batch.completions:
            self._completion(c)
        for h in batch.hints:
            self._hint(h)

    def _arrival(self, a: Arrival) -> None:
        if a.session is None:
            return
        now = self.clock() if a.time is None else a.time
        agent = self._agent(a.session, now)
        self._unknown()  # from the first arrival on, the keys of no known agent are kept apart
        if agent.inflight == 0 and agent.outcome is not None:
            self.model.came_back(agent.outcome, now)
            agent.outcome = None
        agent.inflight += 1
        agent.arrived = agent.last = now
        agent.finished = False
        agent.waiting = 0
        if a.checkpoints:
            self._reached(agent, a)
        self._claim(agent, a.keys, 0)
        requests = self._requests
        requests[a.request] = (agent, len(a.keys), now)
        requests.move_to_end(a.request)
        while len(requests) > self.max_requests:
            requests.popitem(last=False)
        self._ranking.touch(agent)

    def _completion(self, c: Completion) -> None:
        known = self._requests.get(c.request)
        if known is None or not known[0].alive:
            return
        agent, chain, arrived = known
        now = self.clock() if c.time is None else c.time
        if agent.inflight:
            agent.inflight -= 1
            self.model.served(now - arrived)
        agent.completed = now  # not "last": recency is when its blocks were last read, at the arrival
        agent.stop = SUBAGENTS if agent.waiting else (c.stop or UNKNOWN_STOP)
        if not agent.inflight:
            agent.outcome = self.model.completed(now, agent.stop)
        if c.keys:
            self._claim(agent, c.keys, chain)
        self._ranking.touch(agent)

    def _hint(self, h: Hint) -> None:
        agent = self._agents.get(h.session) if h.session is not None else None
        if agent is None:
            return
        now = self.clock() if h.time is None else h.time
        if h.finished:
            agent.finished = True
        if h.subagents > 0:
            agent.waiting = h.subagents
            if not agent.inflight:
                agent.stop = SUBAGENTS
                if agent.outcome is not None:
                    agent.outcome.stop = SUBAGENTS
        if h.ttl_s is not None:
            agent.ttl_until = now + h.ttl_s
        if h.priority is not None:
            agent.priority = h.priority
        self._ranking.touch(agent)

    def _agent(self, name: str, now: float) -> Agent:
        agents = self._agents
        agent = agents.get(name)
        if agent is None:
            agent = agents[name] = Agent(name, next(self._uids), now)
            while len(agents) > self.max_agents:
                self._forget(agents.popitem(last=False)[1])
        else:
            agents.move_to_end(name)
        return agent

    def _forget(self, agent: Agent) -> None:
        """An agent dropped from the table: its blocks become blocks of no known agent, the oldest ones."""
        agent.alive = False
        where, orphans = self._where, self._unknown()
        for _, key in agent.heap:
            if where.get(key) is agent:
                del where[key]
                orphans[key] = None
                orphans.move_to_end(key, last=False)
        agent.heap, agent.count = [], 0
        self._ranking.forget(agent)

    def _claim(self, agent: Agent, keys: Sequence[bytes], start: int) -> None:
        """``keys`` (depths start, start+1, ...) belong to ``agent``: tracked ones move to it, the others
        wait in ``pending`` for their insert. Bulk work runs in C loops (map, compress, zip); Python work is
        per key moved from another agent or the unknown ones (shared roots: rare on agentic traffic)."""
        where, orphans, pending = self._where, self._unknown(), self._pending
        n = len(keys)
        owners = list(map(where.get, keys))
        free = list(map(is_, owners, repeat(None)))  # not owned: untracked, or tracked as unknown
        depths = range(start, start + n)
        loose = list(compress(depths, free))
        if loose:
            adopt = list(compress(loose, map(orphans.__contains__, [keys[d - start] for d in loose])))
            if adopt:
                adopted = set(adopt)
                loose = [d for d in loose if d not in adopted]
                for d in adopt:
                    del orphans[keys[d - start]]
                    self._own(agent, keys[d - start], d)
            pending.update(zip([keys[d - start] for d in loose], zip(repeat(agent), loose)))
        moved = list(compress(depths, map(and_, map(not_, free), map(is_not, owners, repeat(agent)))))
        for d in moved:
            owner = owners[d - start]
            owner.count -= 1  # its heap entry goes stale
            self._shrunk(owner)
            self._own(agent, keys[d - start], d)
        while len(pending) > self.max_pending:
            pending.popitem(last=False)

    def _reached(self, agent: Agent, a: Arrival) -> None:
        """The arrival's checkpoints: each one's objects go to the agent just ahead of the block before its
        boundary; another agent that owns that block saw the prefix too (a fork junction). The agent's
        checkpoints its newest supersedes become dead weight, evicted first."""
        where, pending = self._where, self._pending
        alive = _Alive(self._agents)
        for d, objects in a.checkpoints:
            if not objects or not 0 < d <= len(a.keys):
                continue
            block = a.keys[d - 1]
            other = where.get(block) or (pending.get(block) or (None, 0))[0]
            sharers = (other.name,) if other is not None and other is not agent and other.alive else ()
            cid = self._checkpoints.add(agent.name, d, objects, sharers)
            # A junction is as valuable as the soonest back of its agents: its objects are that one's.
            owner = self._heir(cid, agent) if sharers else None
            self._claim_objects(owner or agent, objects, d - 0.5)
        orphans = self._unknown()
        for key in self._checkpoints.superseded(agent.name, alive):
            owner = where.get(key)
            if owner is not None:
                del where[key]
                owner.count -= 1
                self._shrunk(owner)
            elif key not in orphans:
                continue  # not stored (or pending): nothing to evict
            orphans.pop(key, None)
            self._dead[key] = None

    def _claim_objects(self, agent: Agent, keys: Sequence[bytes], depth: float) -> None:
        """A checkpoint's objects belong to ``agent`` at ``depth`` (tracked ones move to it now)."""
        where, orphans, dead, pending = self._where, self._unknown(), self._dead, self._pending
        for key in keys:
            owner = where.get(key)
            if owner is agent:
                continue
            if owner is not None:
                owner.count -= 1
                self._shrunk(owner)
            elif key in orphans:
                del orphans[key]
            elif key in dead:
                del dead[key]
            else:
                pending[key] = (agent, depth)  # type: ignore[assignment]
                continue
            self._own(agent, key, depth)  # type: ignore[arg-type]

    def _own(self, agent: Agent, key: bytes, depth: int) -> None:
        self._where[key] = agent
        heapq.heappush(agent.heap, (-depth, key))
        agent.count += 1
        if agent.count == 1:
            self._ranking.touch(agent)
        elif len(agent.heap) > 2 * agent.count + 64:
            self._compact(agent)

    def _shrunk(self, agent: Agent) -> None:
        """After an agent lost keys: its heap holds at most about twice its keys (stale entries dropped)."""
        if len(agent.heap) > 2 * agent.count + 64:
            self._compact(agent)

    def _compact(self, agent: Agent) -> None:
        where, seen = self._where, set()
        live = []
        for entry in agent.heap:
            key = entry[1]
            if where.get(key) is agent and key not in seen:
                seen.add(key)
                live.append(entry)
        heapq.heapify(live)
        agent.heap = live

    # ---- the keys a tier tracks ------------------------------------------------------------------------

    def insert(self, keys: Sequence[bytes]) -> None:
        if self._orphans_map is None:  # told nothing yet: recency alone
            self._recency.insert_at(keys, ())
            return
        found = list(map(self._pending.pop, keys, repeat(None)))
        if not any(found):  # no chain known: unknown blocks, in C loops
            self._unknown().update(dict.fromkeys(keys))
            self._recency.insert_at(keys, ())
            return
        depths = [-1 if p is None or not p[0].alive else p[1] for p in found]
        self._recency.insert_at(keys, depths)
        where, touch, orphans = self._where, self._ranking.touch, self._unknown()
        push = heapq.heappush
        for key, p, depth in zip(keys, found, depths):
            if depth < 0:
                orphans[key] = None
                continue
            agent = p[0]  # type: ignore[index]
            where[key] = agent
            push(agent.heap, (-depth, key))
            agent.count += 1
            if agent.count == 1:
                touch(agent)

    def access(self, keys: Sequence[bytes]) -> None:
        self._recency.access(keys)
        orphans = self._orphans_map
        if orphans is not None:
            _drain(map(orphans.move_to_end, filter(orphans.__contains__, keys)))

    def remove(self, keys: Sequence[bytes]) -> None:
        self._recency.remove(keys)
        self._forget_keys(keys)

    def _forget_keys(self, keys: Sequence[bytes]) -> None:
        where, orphans = self._where, self._orphans_map
        if orphans is None:
            return
        if not where:
            _drain(map(orphans.pop, keys, repeat(None)))
            if self._dead:
                _drain(map(self._dead.pop, keys, repeat(None)))
            return
        shrunk = set()
        for key in keys:
            agent = where.pop(key, None)
            if agent is not None:
                agent.count -= 1
                shrunk.add(agent)
            else:
                orphans.pop(key, None)
                self._dead.pop(key, None)
        for agent in shrunk:
            self._shrunk(agent)

    def __len__(self) -> int:
        return len(self._recency)  # it tracks every key too

    def victims(self, n: int, protected: Container[bytes]) -> list[bytes]:
        if n <= 0:
            return []
        now = self.clock()
        if not self._predicts(now):
            out = self._recency.victims(n, protected)
            self._forget_keys(out)
            return out
        out = self._victims(n, protected, now)
        self._recency.remove(out)
        if self._checkpoints.rule:
            self._together(out)
        return out

    def _together(self, victims: Sequence[bytes]) -> None:
        """A checkpoint's objects live and die together: those left of a checkpoint that lost one go first."""
        where, orphans, dead, of = self._where, self._unknown(), self._dead, self._checkpoints.of
        for cid in {c for c in map(of, victims) if c is not None}:
            for key in self._checkpoints.objects(cid):
                owner = where.pop(key, None)
                if owner is not None:
                    owner.count -= 1
                    self._shrunk(owner)
                elif key not in orphans:
                    continue
                orphans.pop(key, None)
                dead[key] = None

    def _victims(self, n: int, protected: Container[bytes], now: float) -> list[bytes]:
        """Passes over the ranking until ``n`` are out: a pass that hands a fork junction to its heir (``_take``)
        leaves it for the heir's turn, which may come in the next pass only (the heir was ranked before it held
        keys); each hand-over goes to an agent strictly sooner back, so the passes end."""
        out: list[bytes] = []
        for _ in range(len(self._agents) + 1):
            handed = self._victims_pass(n, protected, now, out)
            if len(out) >= n or not handed:
                break
        return out

    def _victims_pass(self, n: int, protected: Container[bytes], now: float, out: list[bytes]) -> bool:
        """One pass over the ranking; True if it handed a fork junction to its heir."""
        ranking = self._ranking.current(now)
        i = len(ranking) - 1
        keys = self._ranking.keys
        handed = False
        if self._dead:  # this queue and the keys of no agent's: from the front, as LRU (base.take_oldest)
            take_oldest(self._dead, n, protected, out)
        while i >= 0 and len(out) < n and keys[i][1] == INF:  # finished, or not expected back: first
            handed |= self._take(ranking[i], n, protected, out)
            i -= 1
        if len(out) < n and self._orphans_map:
            take_oldest(self._unknown(), n, protected, out)
        while i >= 0 and len(out) < n:
            handed |= self._take(ranking[i], n, protected, out)
            i -= 1
        return handed

    def _take(self, agent: Agent, n: int, protected: Container[bytes], out: list[bytes]) -> bool:
        """The agent's deepest unprotected keys, until ``out`` has ``n``; True if a fork junction's key went to
        its heir instead."""
        if agent.count <= 0 or not agent.alive:
            return False
        handed = False
        heap, where = agent.heap, self._where
        kept = []
        pop = heapq.heappop
        heirs: dict[bytes, Agent | None] = {}
        of = self._checkpoints.of if self._checkpoints.rule else _none
        while heap and len(out) < n:
            entry = pop(heap)
            key = entry[1]
            if where.get(key) is not agent:
                continue  # stale: removed, evicted, or moved to another agent
            if key in protected:
                kept.append(entry)
                continue
            cid = of(key)
            if cid is not None:  # a fork junction is kept while another of its agents is back sooner
                heir = heirs[cid] if cid in heirs else heirs.setdefault(cid, self._heir(cid, agent))
                if heir is not None:
                    agent.count -= 1
                    self._own(heir, key, -entry[0])
                    handed = True
                    continue
            del where[key]
            agent.count -= 1
            out.append(key)
        for entry in kept:
            heapq.heappush(heap, entry)
        return handed

    def _unknown(self) -> OrderedDict[bytes, None]:
        """The keys of no known agent, LRU order (made at the first arrival; the paths that use them run
        after one)."""
        if self._orphans_map is None:
            where = self._where
            self._orphans_map = OrderedDict.fromkeys(k for k in self._recency.keys() if k not in where)
        return self._orphans_map

    def _heir(self, cid: bytes, agent: Agent) -> Agent | None:
        """Of checkpoint ``cid``'s other agents still expected, the one back soonest if before ``agent``
        (strictly: a junction never cycles between agents)."""
        now = self.clock()
        best, best_key = None, self._key(agent, now)
        for name in self._checkpoints.agents(cid):
            other = self._agents.get(name)
            if other is None or other is agent or not other.alive or other.finished:
                continue
            k = self._key(other, now)
            if k[1] < INF and k < best_key:
                best, best_key = other, k
        return best

    # ---- admission -------------------------------------------------------------------------------------

    def admit(self, keys: Sequence[bytes], free: int) -> Sequence[int] | None:
        found = list(map(self._pending.get, keys))
        known = [i for i, p in enumerate(found) if p is not None and p[0].alive]
        if not known:
            return None
        groups: dict[Agent, list[tuple[int, int]]] = {}
        for i in known:
            agent, depth = found[i]  # type: ignore[misc]
            members = groups.get(agent)
            if members is None:
                members = groups[agent] = []
            members.append((depth, i))
        now = self.clock()
        if not (self.admission and self._predicts(now)):  # every key, root-most first
            taken = set(known)
            unknown = [i for i in range(len(keys)) if i not in taken] if len(known) < len(keys) else []
            return [i for _, i in sorted(m for members in groups.values() for m in members)] + unknown
        self._ranking.current(now)
        out: list[int] = []
        for agent, members in sorted(groups.items(), key=lambda g: self._key(g[0], now)):  # soonest back first
            members.sort()  # root-most first
            need = len(out) + len(members) - free
            if need > 0:
                room = len(self._unknown()) + self._ranking.room_above(self._key(agent, now), agent, need)
                members = members[: max(0, free + room - len(out))]
            out += [i for _, i in members]
        # Keys of no known agent are not worth an eviction where blocks of known ones are declined.
        return out

    # ---- prefetch between turns (kvtier/prefetch/) -----------------------------------------------------

    def predicted_back(self, session: str) -> float | None:
        agent = self._agents.get(session)
        if agent is None or not agent.alive or agent.finished:
            return None
        now = self.clock()
        if not self._predicts(now):
            return None
        t = self._predict(agent, now)
        return None if t == INF else t

    def handed_up(self, session: str, keys: Sequence[bytes], depths: Sequence[int]) -> None:
        """The keys wait in ``pending`` as the agent's (the tier dropped them: untracked now), as a chain's keys
        not stored yet do: their write-down is then ranked with the agent's blocks. Without it a full SSD would
        decline them as blocks of no known agent, breaking the agent's prefix there."""
        agent = self._agents.get(session)
        if agent is None or not agent.alive or agent.finished:
            return
        pending = self._pending
        pending.update(zip(keys, zip(repeat(agent), depths)))
        while len(pending) > self.max_pending:
            pending.popitem(last=False)

    def prefetch_room(self, session: str, chain: Sequence[bytes], start: int, need: int, free: int) -> int:
        """Free slots, then the blocks the eviction order takes before this agent's (agents not expected back,
        blocks of no known agent, agents predicted back later): the same order ``victims`` follows, so what the
        prefetch's put evicts is never predicted to be needed sooner. The chain's keys are claimed for the
        agent (at their depths), so the put files them under it, deepest evicted first as usual."""
        need = max(0, need)
        agent = self._agents.get(session)
        if agent is None or not agent.alive or agent.finished or need == 0:
            # An agent this policy cannot rank (an operator's prefetch of keys it never saw, a finished one):
            # free slots only, which evict nothing.
            return min(need, max(0, free))
        now = self.clock()
        if not self._predicts(now):
            return min(need, max(0, free))
        self._claim(agent, chain, start)
        if need <= free:
            return need
        self._ranking.current(now)
        key = self._key(agent, now)
        if key[1] == INF:
            return max(0, free)
        short = need - max(0, free)
        room = len(self._unknown()) + self._ranking.room_above(key, agent, short)
        return max(0, free) + min(short, room)

    # ---- ranking ---------------------------------------------------------------------------------------

    def _predicts(self, now: float) -> bool:
        """Whether agents are seen coming back often enough for a prediction (ReturnModel.predictive);
        the first time, the agents are re-scored."""
        self.model.settle(now)
        predicts = self.model.predictive
        if predicts != self._predicting:
            self._predicting = predicts
            self._ranking.invalidate()
        return predicts

    def _key(self, agent: Agent, now: float) -> Key:
        """The agent's place in the eviction order (the largest goes first): priority, then the predicted
        time it is back, then how long ago it was last active (ties: the least recently active first). Times
        are absolute, so keys computed at different moments (an agent moved since the last full re-score)
        compare right."""
        if agent.finished:
            return (-agent.priority, INF, INF, agent.uid)
        return (-agent.priority, self._predict(agent, now), -agent.last, agent.uid)

    def _predict(self, agent: Agent, now: float) -> float:
        """When the agent is predicted back (INF: never expected; 0 for all in recency mode: the last
        activity decides)."""
        if agent.inflight or agent.completed is None:
            t = self.model.in_flight(now - agent.arrived)
        else:
            t = self.model.idle(agent.stop, now - agent.completed)
        if agent.ttl_until is not None and now < agent.ttl_until:
            t = min(t, agent.ttl_until - now)
        return now + t

    # ---- introspection (tests, stats) -------------------------------------------------------------------

    def agents(self) -> int:
        return len(self._agents)

    def pending(self) -> int:
        return len(self._pending)


class _Alive:
    """The agents still expected, by name: in the table and not finished (CheckpointRule's ``alive``)."""

    __slots__ = ("_agents",)

    def __init__(self, agents: dict[str, Agent]) -> None:
        self._agents = agents

    def __contains__(self, name: object) -> bool:
        agent = self._agents.get(name)  # type: ignore[call-overload]
        return agent is not None and agent.alive and not agent.finished


def _none(key: bytes) -> None:
    return None


def _drain(it: object) -> None:
    """Run an iterator of side effects to its end, in C."""
    deque(it, maxlen=0)  # type: ignore[call-overload]
