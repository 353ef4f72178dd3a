"""One background thread that runs calls in the order they were submitted.

``concurrent.futures.ThreadPoolExecutor`` refuses new work once the interpreter starts shutting down
("cannot schedule new futures after interpreter shutdown"), and a save that finishes while the
process exits (``async_save``'s promise) schedules its hashing then. This worker keeps accepting
work until it is closed; its owner always waits for what it submitted.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["SerialWorker"]

T = TypeVar("T")
_Item = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class SerialWorker:
    """``submit(fn, *args)`` returns a ``Future``; calls run one at a time, in submission order.

    Example:
        >>> with SerialWorker("certckpt-hash") as w:
        ...     done = w.submit(sum, [1, 2])
        >>> done.result()
        3
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        # a daemon: its owner waits for every result, so nothing it runs is ever cut off by exit
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as e:
                future.set_exception(e)
            else:
                future.set_result(result)
            del item, future, fn, args  # drop references (a tensor's bytes) before waiting again

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        self._queue.put((future, fn, args))
        return future

    def close(self) -> None:
        """Run what was submitted, then stop the thread."""
        self._queue.put(None)
        self._thread.join()

    def __enter__(self) -> SerialWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
