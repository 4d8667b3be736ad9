"""A small pool of named daemon threads for background cache work.

Like ``concurrent.futures.thread`` but with no futures: tasks report through
their own callbacks, and a failure is logged and handed to ``on_error``, never
raised into the submitting thread.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Handoff", "Workers"]

logger = logging.getLogger(__name__)
_STOP = object()


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
        self._started = False
        self._lock = threading.Lock()
        self._stopped = False

    def submit(self, fn: Callable[..., object], *args: Any) -> None:
        """Queue ``fn(*args)``; threads start on first use. No-op after :meth:`stop`."""
        with self._lock:
            if self._stopped:
                return
            if not self._started:
                for t in self._threads:
                    t.start()
                self._started = True
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
            started = self._started
        if not started:
            return
        for _ in self._threads:
            self._queue.put(_STOP)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout)
