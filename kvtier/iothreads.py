"""I/O threads that a store's close can still use while the interpreter exits.

concurrent.futures stops every thread pool when the main thread ends, before atexit handlers and weakref
finalizers run, and refuses new work from then on ("cannot schedule new futures after interpreter shutdown").
A store closed then (an atexit handler; a finalizer, as vLLM's in-process engine shuts down from one; a thread
that outlives the main one) must still write DRAM's blocks down (TieredStore.close), so ``run_each`` does the
calls it is handed then on the caller's thread, one after another: slower, never lost. Used by the SSD tier's
reads and writes, the pool tier's per-pool fan-out and the stream transport's parallel sockets.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class IoThreads:
    """A ThreadPoolExecutor of ``threads`` threads named ``name``-N, for ``what`` (a tier, a connection: said in
    the log).
    After ``close`` (the tier's own) a refusal stays an error."""

    def __init__(self, threads: int, name: str, what: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        self._what = what
        self._closed = False
        self._inline_said = False

    def run_each(self, fn: Callable[..., T], calls: Sequence[tuple[Any, ...]]) -> list[Future[T]]:
        """``fn(*args)`` for each ``args`` of ``calls`` on the threads (on the caller's while the interpreter
        exits); their futures, in order."""
        futures: list[Future[T]] = []
        for i, args in enumerate(calls):
            try:
                futures.append(self._pool.submit(fn, *args))
            except RuntimeError:
                if self._closed:
                    raise
                self._say_inline()
                return futures + [_run_here(fn, a) for a in calls[i:]]
        return futures

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Work that may be dropped at exit (the pool's observations): on the threads only; RuntimeError when
        they are stopped."""
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        """Wait for the calls handed over, then stop the threads."""
        self._closed = True
        self._pool.shutdown(wait=True)

    def _say_inline(self) -> None:
        if not self._inline_said:
            self._inline_said = True
            log.info("%s: the interpreter is exiting (its thread pools are stopped); this close's I/O runs on the "
                     "closing thread", self._what)


def _run_here(fn: Callable[..., T], args: tuple[Any, ...]) -> Future[T]:
    done: Future[T] = Future()
    try:
        done.set_result(fn(*args))
    except Exception as e:  # as a pool's future: the caller's .result() raises it
        done.set_exception(e)
    return done
