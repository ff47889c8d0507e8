"""The model port: a session's one way to call its model stream."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from ..plugins import ModelStream


class ModelPort:
    """Runs one stream's blocking calls on the executor, in call order, one at a time; each call
    tells the stream whether the next one follows at once (``ModelStream.follows``)."""

    def __init__(self, executor: Executor, stream: ModelStream) -> None:
        self._executor = executor
        self._stream = stream
        self._lock = asyncio.Lock()

    async def call(
        self, fn: Callable[..., Any], *args: Any, guard: Callable[[], bool] | None = None, follows: bool = False
    ) -> Any:
        async with self._lock:
            if guard is not None and not guard():
                return None
            return await asyncio.get_running_loop().run_in_executor(self._executor, self._run, follows, fn, args)

    def _run(self, follows: bool, fn: Callable[..., Any], args: tuple) -> Any:
        self._stream.follows = follows
        return fn(*args)
