"""Calling the user's code (imported by engine/user_code.py) with a deadline.

``call_bounded(fn, *args, timeout_s=...)`` awaits an ``async def`` with asyncio.wait_for
and runs a plain ``def`` in a daemon thread of its own: a call past its deadline is abandoned (a thread
cannot be killed; it runs on until it returns) and never holds up the event loop's shutdown, as the
default executor's threads would (asyncio.run waits for them).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any, Callable


async def call_bounded(fn: Callable, *args, timeout_s: float, **kwargs) -> Any:
    """``fn(*args, **kwargs)``'s result within ``timeout_s`` seconds; asyncio.TimeoutError past it, and
    whatever ``fn`` raised otherwise. A sync ``fn`` returning an awaitable has it awaited too."""
    if inspect.iscoroutinefunction(fn):
        return await asyncio.wait_for(fn(*args, **kwargs), timeout_s)
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error) -> None:
        if not future.done():  # cancelled by the timeout: nobody waits any more
            future.set_exception(error) if error is not None else future.set_result(result)

    def work() -> None:
        try:
            outcome = (fn(*args, **kwargs), None)
        except BaseException as err:  # handed to the awaiting side, which decides
            outcome = (None, err)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop closed while this call overran its deadline
            pass

    threading.Thread(target=work, daemon=True, name=f"ppo-env-{getattr(fn, '__name__', 'call')}").start()
    result = await asyncio.wait_for(future, timeout_s)
    if inspect.isawaitable(result):
        result = await asyncio.wait_for(result, timeout_s)
    return result
