"""An asyncio event loop on a daemon thread, for blocking callers of async code.

Owns :func:`new_event_loop` (uvloop's loop when uvloop is installed, ``rollsafe[gateway]``,
else asyncio's; no policy set) and :class:`LoopThread`: the loop the fleet's data plane runs its
own requests on (the blocking ``RolloutFleet.generate`` submits to it) and the gateway serves
on; the thread never blocks interpreter exit. Imports only the standard library.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from rollsafe.errors import RollsafeError

__all__ = ["LoopClosed", "LoopThread", "new_event_loop"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class LoopClosed(RollsafeError, RuntimeError):
    """Work was submitted to a :class:`LoopThread` that is closed."""


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop when it is installed, else asyncio's default one."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """One event loop running forever on a daemon thread named ``name`` (started lazily)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop, started on first use; :class:`LoopClosed` after :meth:`close`."""
        with self._lock:
            if self._closed:
                raise LoopClosed(f"event loop thread {self.name!r} is closed")
            if self._loop is None:
                loop = new_event_loop()
                ready = threading.Event()

                def run() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                thread = threading.Thread(target=run, name=self.name, daemon=True)
                thread.start()
                ready.wait()
                self._loop, self._thread = loop, thread
            return self._loop

    @property
    def started(self) -> bool:
        return self._loop is not None and not self._closed

    def in_loop(self) -> bool:
        """Whether the caller runs on this loop's thread (blocking there would deadlock)."""
        return self._thread is not None and threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; its future (cancel it to cancel the task)."""
        try:
            loop = self.loop
        except LoopClosed:
            coro.close()
            raise
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block for its result (its exception re-raised). On
        ``timeout`` or an interrupt of the caller the task is cancelled."""
        if self.in_loop():
            coro.close()
            raise RuntimeError(f"LoopThread.run called on its own loop thread {self.name!r}")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise

    def call(self, fn: Callable[[], Awaitable[T]], timeout: float | None = None) -> T:
        """:meth:`run` of ``fn()`` (built on the loop's thread, where it must be)."""

        async def wrapped() -> T:
            return await fn()

        return self.run(wrapped(), timeout)

    def close(
        self, on_loop: Callable[[], Awaitable[None]] | None = None, timeout: float = 5.0
    ) -> None:
        """Run ``on_loop()`` there (closing what lives on the loop), cancel what is left, stop
        the loop and join the thread (at most ``timeout`` s each). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def shutdown() -> None:
            if on_loop is not None:
                try:
                    await asyncio.wait_for(on_loop(), timeout)
                except Exception:
                    log.exception("closing %s: its shutdown step raised", self.name)
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=timeout)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(2 * timeout + 1)
        except Exception:
            log.exception("closing %s: shutdown did not finish", self.name)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        if not thread.is_alive():
            loop.close()
