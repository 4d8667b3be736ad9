"""A small pool of named daemon threads for background cache work.

Like ``concurrent.futures.thread`` but with no futures: tasks report through
their own callbacks, and a failure is logged and handed to ``on_error``, never
raised into the submitting thread.
"""

from __future__ import annotations

import _thread
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Handoff", "Workers", "join_started", "start_soon"]

logger = logging.getLogger(__name__)
_STOP = object()


def start_soon(threads: Sequence[threading.Thread]) -> threading.Event:
    """Start ``threads`` from a short-lived helper thread and return at once; the event is
    set once each has started (or failed to: logged). ``Thread.start`` waits until the new
    thread is scheduled (0.2-0.5 ms on a busy 2-core machine): on a first hit's path, that
    wait was the largest single cost. Thread-safe."""
    up = threading.Event()

    def starter() -> None:
        try:
            for t in threads:
                t.start()
        except RuntimeError as e:  # no more threads, or the interpreter is shutting down
            logger.warning("asyncclcache: could not start a background thread (%s); its work is not done", e)
        finally:
            up.set()

    try:
        _thread.start_new_thread(starter, ())
    except RuntimeError:
        starter()  # no helper either: started (or not) here
    return up


def join_started(threads: Sequence[threading.Thread], up: threading.Event, timeout: float | None) -> None:
    """Join ``threads`` (started by :func:`start_soon` with ``up``), up to ``timeout`` seconds
    in all; never the calling thread, never one that did not start."""
    deadline = None if timeout is None else time.monotonic() + timeout

    def left() -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    up.wait(left())
    for t in threads:
        if t is not threading.current_thread() and t.ident is not None:
            t.join(left())


class Handoff:
    """``fn()``, run once: by a worker thread that gets to it first, or by the thread that
    asks for its :meth:`result` first (never waiting behind a queue of other work). Thread-safe."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        self._claimed = False
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def run(self) -> None:
        """Run ``fn`` here unless another thread has; its error is kept for :meth:`result`."""
        with self._lock:
            if self._claimed:
                return
            self._claimed = True
        try:
            self._value = self._fn()
        except BaseException as e:  # noqa: BLE001 - the caller of result() gets it
            self._error = e
        finally:
            self._done.set()

    def result(self) -> Any:
        """``fn``'s value (raises its error): run here if no thread has started it, else
        waited for (a task already running: never one still queued)."""
        self.run()
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


class Workers:
    """``n`` daemon threads named ``<name>-<i>`` running submitted callables. Thread-safe."""

    def __init__(
        self,
        n: int,
        name: str,
        on_error: Callable[[BaseException], None],
        on_cpu: Callable[[float], None] | None = None,
    ) -> None:
        """``on_cpu`` receives the CPU seconds each task took (the cache counts its own cost)."""
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._on_error = on_error
        self._on_cpu = on_cpu
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)
        ]
        self._up: threading.Event | None = None  # set once the threads have started
        self._lock = threading.Lock()
        self._stopped = False

    def submit(self, fn: Callable[..., object], *args: Any) -> None:
        """Queue ``fn(*args)``; threads start on first use, without the caller waiting for
        them (:func:`start_soon`). No-op after :meth:`stop`."""
        with self._lock:
            if self._stopped:
                return
            if self._up is None:
                self._up = start_soon(self._threads)
        self._queue.put(functools.partial(fn, *args) if args else fn)

    def handoff(self, fn: Callable[[], Any]) -> Handoff:
        """``fn`` queued as a :class:`Handoff`: a worker runs it meanwhile, or the caller
        at ``result()``. For short work that the caller needs done soon, whatever the queue holds."""
        task = Handoff(fn)
        self.submit(task.run)
        return task

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is _STOP:
                return
            t0 = time.thread_time()
            try:
                fn()  # type: ignore[operator]
            except BaseException as e:
                logger.exception("background task failed")
                try:
                    self._on_error(e)
                except Exception:
                    logger.exception("error handler failed")
            if self._on_cpu is not None:
                self._on_cpu(time.thread_time() - t0)

    def stop(self, timeout: float | None = None) -> None:
        """Stop taking work; queued tasks still run. Joins up to ``timeout`` seconds."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            up = self._up
        if up is None:
            return
        for _ in self._threads:
            self._queue.put(_STOP)
        join_started(self._threads, up, timeout)
