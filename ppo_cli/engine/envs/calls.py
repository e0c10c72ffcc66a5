"""Calling the user's code: importing a named function or class, and calling it with a deadline.

``import_named('path/to/file.py:name')`` imports the file only when a recipe names it (as function
rewards are). ``call_bounded(fn, *args, timeout_s=...)`` awaits an ``async def`` with asyncio.wait_for
and runs a plain ``def`` in a daemon thread of its own: a call past its deadline is abandoned (a thread
cannot be killed; it runs on until it returns) and never holds up the event loop's shutdown, as the
default executor's threads would (asyncio.run waits for them).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from ppo_cli.errors import EnvironmentSetupError


def import_named(spec: str, what: str) -> Any:
    """The object ``spec`` ('package.module:name' or 'path/to/file.py:name') names; ``what`` says what it
    is in the error line ("tool", "environment class")."""
    target, _, name = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise EnvironmentSetupError(f"{what} file not found: {target}", hint="paths are relative to the current directory")
            module_name = f"ppo_env_{abs(hash(str(path.resolve())))}"
            module = sys.modules.get(module_name)
            if module is None:
                module_spec = importlib.util.spec_from_file_location(module_name, path)
                module = importlib.util.module_from_spec(module_spec)
                module_spec.loader.exec_module(module)
                sys.modules[module_name] = module
        else:
            module = importlib.import_module(target)
    except EnvironmentSetupError:
        raise
    except Exception as err:  # the user's module raised while importing
        raise EnvironmentSetupError(f"cannot import {what} module '{target}': {type(err).__name__}: {err}") from err
    found = getattr(module, name, None)
    if found is None:
        raise EnvironmentSetupError(f"'{target}' has no {what} '{name}'", hint=f"define {name} in {target}")
    return found


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
