"""SGLang's standard agent hints reach kvtier's backend: ``GenerateReqInput.kv_hints`` (the Python API and HTTP
``/generate``; SGLang 0.5.23, ``srt/managers/kv_hints.py``: ``KvHintsEnvelope``, vLLM's field names) applied to the
store of the request's prefix by kvtier.connectors.kv_hints (Prefetch, Pin, Retain, Demote, Share).

Why a plugin: SGLang carries the envelope GenerateReqInput -> TokenizedGenerateReqInput -> ``Req.kv_hints`` and
reads it nowhere; a HiCache backend's calls carry page keys and ``HiCacheStorageExtraInfo(prefix_keys)`` only (no
request id, no hints), and nothing hands a backend the request. SGLang's declared way in for code that must see a
scheduler-side object is its plugin framework (``sglang/srt/plugins``: entry-point group ``sglang.srt.plugins``,
loaded by every scheduler process before its Scheduler is built; ``HookRegistry`` wraps a named function).
kvtier declares one plugin (pyproject.toml: ``kvtier_hints = "kvtier.connectors.sglang.hints:register"``) with two
AFTER hooks: on ``Req.__init__`` (``TARGET``): when the scheduler makes a request (``_create_generation_req``) that
carries kv_hints, the request goes to this process's kvtier backend(s); on ``Req.update_finish_state``
(``FINISH_TARGET``, each decode step): when such a request finishes, its completion (the stop reason) goes to the
store's policy, which learns from completions when agents come back and only then ranks agents (and so a
Demote or a Retain) in the default policy. A backend whose store runs a Prefetcher (``HintSink.prefetcher``:
prefetch between turns, kvtier/connectors/prefetching.py) hears of every request, hinted or not: the Prefetcher
learns which agents are idle from these arrivals and completions (through the store's watcher), as a vLLM
worker's does from its scheduler's notes. The cost, on the scheduler thread, is one hash per prompt page per
request (what SGLang's HiCache hashes anyway) and one ``Req.finished()`` per request per decode step. A backend
registers itself here (``attach``), so nothing of SGLang's is reached into to find it. The request's keys are
SGLang's page keys of its prompt (kvtier.keys.hashers.SglangPageHasher over ``origin_input_ids``, seeded by
``extra_key`` / ``cache_salt``), folded into the backend's namespace: the keys it stores.

What it reads of SGLang: the Req constructor's parameters named in ``REQUIRED``, each kept as the attribute of that
name; ``REQUIRED_METHODS`` (``Req.update_finish_state``, ``Req.finished``) and ``Req.finished_reason.to_json()``.
``check_sglang`` finds a version that lacks one: ``register`` logs one line and every action of a request's hints
is answered ``ignored``, naming what is missing (counted like any outcome); a version whose Req has no
``kv_hints`` at all has no hints to answer (the one line says so; no hook). A backend started without the plugin
(``SGLANG_PLUGINS`` leaves it out, or kvtier installed without its entry points) logs one line: hints are not seen.

At arrival (the scheduler thread): the request's arrival goes to the store's policy (so a Demote / Retain finds its
agent: the session is ``Req.session_id``, else inferred from the chains), then its actions are applied and their
outcomes counted and logged. A Pin covers the pages the store holds by then; a first turn holds none (``deferred``).
A Pin whose prefix was not all stored is remembered (``HintSink``) and applied again as SGLang's backup thread
stores the request's pages (``on_saved``): the first lease of a deferred Pin is counted once more (accepted /
clipped), the later pages of that request join its lease silently. Bounded: ``MAX_PENDING`` requests and
``MAX_PENDING_KEYS`` keys waiting (the oldest forgotten, logged), each for at most ``MAX_PIN_S``.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.connectors.kv_hints import MAX_PIN_S, Applied, HintOutcomes, apply_kv_hints
from kvtier.keys.hashers import SglangPageHasher
from kvtier.policies import Arrival, Completion
from kvtier.prefetch import Prefetcher
from kvtier.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

TARGET = "sglang.srt.managers.schedule_batch.Req.__init__"
FINISH_TARGET = "sglang.srt.managers.schedule_batch.Req.update_finish_state"
REQUIRED = ("rid", "origin_input_ids", "kv_hints", "extra_key", "cache_salt", "session_id")
# What the completion hook reads: Req.update_finish_state (each decode step), then Req.finished() and
# Req.finished_reason.to_json() ({"type": "stop" | "length" | "abort", "matched": ...}).
REQUIRED_METHODS = ("update_finish_state", "finished")
MAX_INFLIGHT = 1 << 14  # hinted requests whose completion is awaited (the oldest forgotten)
MAX_PENDING = 1024  # requests whose Pin waits for their pages to be stored
MAX_PENDING_KEYS = 1 << 20  # their keys, all together

_lock = threading.Lock()
_sinks: list[HintSink] = []
_loaded = False  # register() ran in this process (SGLang loaded the plugin)
_problem: str | None = None  # what this SGLang lacks (check_sglang), once the plugin is loaded
_every_request = False  # some attached sink has a Prefetcher: the hooks report requests without kv_hints too
_rate_log = RateLimitedLog(log, 1.0)


def check_sglang() -> list[str]:
    """What of ``REQUIRED`` (constructor parameters) and ``REQUIRED_METHODS`` this SGLang's Req lacks (all of
    them when Req does not import)."""
    try:
        from sglang.srt.managers.schedule_batch import Req
    except ImportError:
        return list(REQUIRED) + [f"Req.{m}" for m in REQUIRED_METHODS]
    params = inspect.signature(Req.__init__).parameters
    methods = [f"Req.{m}" for m in REQUIRED_METHODS if not callable(inspect.getattr_static(Req, m, None))]
    return [name for name in REQUIRED if name not in params] + methods


def register() -> None:
    """SGLang's plugin entry point (group ``sglang.srt.plugins``): hook ``TARGET`` and ``FINISH_TARGET``. This
    SGLang without kv_hints: no hook; lacking something else kvtier reads: one log line, and ``TARGET``'s hook
    answers every action ``ignored``."""
    global _loaded, _problem
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    missing = check_sglang()
    _problem = (f"SGLang {_sglang_version()}'s Req lacks {', '.join(missing)} (kvtier reads {', '.join(REQUIRED)}, "
                f"{', '.join(REQUIRED_METHODS)})" if missing else None)
    _loaded = True
    if "kv_hints" in missing:
        log.warning("kvtier: %s: requests carry no agent hints for kvtier to apply", _problem)
        return
    if _problem is not None:
        log.warning("kvtier: %s: every agent hint (kv_hints) will be answered 'ignored'", _problem)
    HookRegistry.register(TARGET, on_request_made, HookType.AFTER)
    if _problem is None:
        HookRegistry.register(FINISH_TARGET, on_request_stepped, HookType.AFTER)


def attach(sink: HintSink) -> None:
    """A backend's hints: the requests this process's scheduler makes with kv_hints (all of them, if ``sink`` has a
    Prefetcher) go to ``sink`` from now on."""
    global _every_request
    with _lock:
        _sinks.append(sink)
        _every_request = any(s.prefetcher is not None for s in _sinks)
        loaded = _loaded
    if not loaded:
        log.warning("kvtier: SGLang did not load kvtier's plugin (entry point kvtier_hints, group sglang.srt.plugins; "
                    "is SGLANG_PLUGINS set without it?): requests' kv_hints are not seen, none is applied")


def detach(sink: HintSink) -> None:
    global _every_request
    with _lock:
        if sink in _sinks:
            _sinks.remove(sink)
        _every_request = any(s.prefetcher is not None for s in _sinks)


@dataclass(frozen=True)
class RequestHints:
    """What the hook takes from one SGLang request: its id, hint envelope, prompt token ids, cache namespace
    (``extra_key``, ``cache_salt``) and session."""

    rid: str
    envelope: Any
    token_ids: Sequence[int]
    extra_key: str | None = None
    cache_salt: str | None = None
    session: str | None = None


def on_request_made(_result: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """The hook, after ``Req.__init__`` on the scheduler thread: a request with kv_hints goes to every attached sink,
    one without to the sinks with a Prefetcher. Never raises into SGLang (a failure is logged, rate-limited: the
    request runs as without hints)."""
    envelope = getattr(req, "kv_hints", None)
    if envelope is None and not _every_request:
        return
    with _lock:
        sinks = [s for s in _sinks if envelope is not None or s.prefetcher is not None]
    if not sinks:
        return
    rid = str(getattr(req, "rid", "?"))
    try:
        if _problem is not None:  # this SGLang lacks what kvtier reads of a request: hints refused, no arrival
            for sink in sinks if envelope is not None else ():
                sink.refuse(rid, envelope, _problem)
            return
        request = RequestHints(rid, envelope, req.origin_input_ids, req.extra_key, req.cache_salt, req.session_id)
        for sink in sinks:
            sink.on_request(request)
    except Exception:
        _rate_log("hook", logging.ERROR, "kvtier: applying the kv_hints of request %s failed; it runs without them",
                  rid, exc_info=True)


def on_request_stepped(_result: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """The hook after ``Req.update_finish_state`` (every decode step of every request): a request reported at its
    arrival that has just finished is a completion for the policies that learn its agent (a Demote / Retain ranks
    agents once the default policy predicts returns, which it learns from completions) and for a Prefetcher (its
    agent is idle now). Cheap for the rest: one attribute read (with a Prefetcher: and ``Req.finished()``); a sink
    counts a request's completion once (``HintSink.on_finished``)."""
    if (getattr(req, "kv_hints", None) is None and not _every_request) or not req.finished():
        return
    with _lock:
        sinks = list(_sinks)
    try:
        stop = stop_reason(req.finished_reason.to_json())
        for sink in sinks:
            sink.on_finished(str(req.rid), stop)
    except Exception:
        _rate_log("finish", logging.ERROR, "kvtier: reporting the completion of request %s failed",
                  getattr(req, "rid", "?"), exc_info=True)


def stop_reason(finish: Any) -> str | None:
    """SGLang's finish reason (``to_json()``) as a stop reason: ``length``, ``abort``, ``stop``, or ``stop:<it>``
    for a stop on a given token or string (as the vLLM connector names them: a tool call's end token apart)."""
    if not isinstance(finish, dict) or not isinstance(finish.get("type"), str):
        return None
    kind, matched = finish["type"], finish.get("matched")
    return f"{kind}:{matched}" if kind == "stop" and matched is not None else kind


@dataclass
class _Pending:
    """A Pin waiting for its request's pages: ``waiting`` the keys not stored yet."""

    rid: str
    session: str | None
    envelope: Any
    keys: list[bytes]
    waiting: set[bytes]
    until: float
    counted: bool  # a lease of it has been counted (accepted / clipped) already


@dataclass(eq=False)  # one per backend, found by identity
class HintSink:
    """One backend's hints: ``store`` (a TieredStore), ``keys_of`` folds SGLang page keys into the backend's namespace,
    ``page_size`` SGLang's; ``prefetcher`` the store's (a Prefetch is applied through it; with one, every request
    is reported here, hinted or not); ``outcomes`` counts them. Thread-safe: ``on_request`` runs on the scheduler
    thread, ``on_saved`` on SGLang's backup thread."""

    store: Any
    keys_of: Callable[[Sequence[str]], list[bytes]]
    page_size: int
    prefetcher: Prefetcher | None = None
    outcomes: HintOutcomes = field(default_factory=HintOutcomes)
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._waiting_keys: dict[bytes, set[str]] = {}
        self._inflight: OrderedDict[str, None] = OrderedDict()  # hinted requests not finished yet

    def keys(self, request: RequestHints) -> list[bytes]:
        """The store keys of the request's full prompt pages, root first (SGLang's page keys, this namespace)."""
        hasher = SglangPageHasher(self.page_size, extra_key=request.extra_key, cache_salt=request.cache_salt)
        return self.keys_of(hasher.hashes(request.token_ids))

    def on_request(self, request: RequestHints) -> list[Applied]:
        """Tell the policy the request arrived, apply its hints (if any), count them; remember a Pin whose pages are
        not all stored yet. Returns the outcomes."""
        keys = self.keys(request)
        self.store.observe(arrivals=[Arrival(request.rid, keys, session=request.session)])
        with self._lock:
            self._inflight[request.rid] = None
            while len(self._inflight) > MAX_INFLIGHT:
                self._inflight.popitem(last=False)
        if request.envelope is None:  # reported for the Prefetcher alone: the arrival is all there is
            return []
        held = self.store.lookup_prefix(keys).length if keys else 0
        applied = apply_kv_hints(request.envelope, self.store, request.session, keys, request=request.rid,
                                 prefetcher=self.prefetcher)
        self.outcomes.record(f"request {request.rid}", applied)
        pins = [a.outcome for a in applied if a.action == "Pin" and a.outcome in ("accepted", "clipped", "deferred")]
        if pins and held < len(keys):
            self._remember(_Pending(request.rid, request.session, request.envelope, keys, set(keys[held:]),
                                    self.clock() + MAX_PIN_S, counted=pins[-1] != "deferred"))
        return applied

    def on_finished(self, rid: str, stop: str | None) -> None:
        """A hinted request finished (with ``stop``): its completion goes to the store's policy, once."""
        with self._lock:
            if rid not in self._inflight:
                return
            del self._inflight[rid]
        self.store.observe(completions=[Completion(rid, None, stop)])

    def refuse(self, rid: str, envelope: Any, why: str) -> list[Applied]:
        """Answer every action of ``envelope`` ``ignored`` (this SGLang lacks what kvtier reads: ``why``), counted."""
        actions = envelope.get("actions") if isinstance(envelope, dict) else getattr(envelope, "actions", None)
        kinds = [str(a.get("action_type") if isinstance(a, dict) else getattr(a, "action_type", None))[:64]
                 for a in (actions if isinstance(actions, (list, tuple)) else [])] or ["envelope"]
        applied = [Applied(kind, "ignored", why) for kind in kinds]
        self.outcomes.record(f"request {rid}", applied)
        return applied

    def on_saved(self, page_keys: Sequence[str], ok: Sequence[bool]) -> None:
        """SGLang stored these pages (``ok`` per page): lease them under the Pins that wait for them."""
        if not self._pending:
            return
        stored = [k for k, good in zip(self.keys_of(page_keys), ok) if good]
        now = self.clock()
        with self._lock:
            self._expire(now)
            touched: dict[str, _Pending] = {}
            for key in stored:
                for rid in self._waiting_keys.pop(key, ()):
                    entry = self._pending[rid]
                    entry.waiting.discard(key)
                    touched[rid] = entry
            for rid, entry in touched.items():
                if not entry.waiting:
                    del self._pending[rid]
        for entry in touched.values():
            applied = apply_kv_hints(entry.envelope, self.store, entry.session, entry.keys, request=entry.rid,
                                     only="Pin")
            with self._lock:
                first = not entry.counted and any(a.outcome != "deferred" for a in applied)
                entry.counted = entry.counted or first
            if first:
                self.outcomes.record(f"request {entry.rid}", applied)

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def _remember(self, entry: _Pending) -> None:
        with self._lock:
            self._expire(self.clock())
            self._forget(entry.rid)
            self._pending[entry.rid] = entry
            for key in entry.waiting:
                self._waiting_keys.setdefault(key, set()).add(entry.rid)
            while len(self._pending) > MAX_PENDING or len(self._waiting_keys) > MAX_PENDING_KEYS:
                rid = next(iter(self._pending))
                _rate_log("pending", logging.WARNING, "kvtier: forgetting the Pin of request %s before its pages were "
                          "stored (more than %d requests or %d keys wait)", rid, MAX_PENDING, MAX_PENDING_KEYS)
                self._forget(rid)

    def _expire(self, now: float) -> None:
        """Forget Pins that waited MAX_PIN_S (lock held)."""
        while self._pending:
            rid, entry = next(iter(self._pending.items()))
            if entry.until > now:
                break
            self._forget(rid)

    def _forget(self, rid: str) -> None:
        entry = self._pending.pop(rid, None)
        if entry is None:
            return
        for key in entry.waiting:
            rids = self._waiting_keys.get(key)
            if rids is not None:
                rids.discard(rid)
                if not rids:
                    del self._waiting_keys[key]


def _sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        return "(version unknown)"
