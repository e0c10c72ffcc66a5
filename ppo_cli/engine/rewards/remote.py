"""Requests to reward servers and judges: bounded in time, retried with backoff, secrets kept out of text.

Every request has a hard deadline (``timeout_s`` per attempt, enforced around the whole exchange, not
only between bytes), and at most ``retries`` more attempts, so a reward never blocks a run forever.
Retried: timeouts, connection errors, HTTP 429 and 5xx. Not retried: other 4xx and answers that are
not what was asked for (the same request would get the same answer). ``${VAR}`` in a header is read
from the environment when the request is built, and every resolved value is replaced by ``***`` in
any text that leaves this module.

Imports httpx and the standard library only (no torch): `ppo validate` uses it to check servers answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from ppo_cli.errors import RewardServerError, RewardServerUnreachable, UsageError

if TYPE_CHECKING:
    from ppo_cli.recipe import HttpReward, JudgeReward

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
MAX_BACKOFF_S = 30.0
QUOTED_ANSWER = 120  # characters of a server's answer quoted in a failure message
PROBE_TIMEOUT_S = 10.0  # the most one "does it answer" request waits, whatever the component's timeout_s
# Answers that mean the server is there but will not score: wrong path, no credentials, broken.
REFUSING = {401: "unauthorized: check the credentials", 403: "forbidden: check the credentials",
            404: "not found: check the path", 405: "does not take POST: check the path"}


class RemoteFailure(Exception):
    """One request (or its answer) failed for good; the message names the URL and what it answered."""


@dataclass
class Secrets:
    """The resolved values of ${VAR}s and API keys, to be blanked out of every message."""

    values: set[str] = field(default_factory=set)

    def resolve(self, text: str, where: str) -> str:
        """``text`` with each ${VAR} replaced by its environment value (remembered as a secret)."""

        def value(match: re.Match) -> str:
            name = match.group(1)
            found = os.environ.get(name)
            if not found:
                raise RewardServerUnreachable(f"{where} needs the environment variable {name}, which is not set",
                                              hint=f"export {name}=... before running")
            self.values.add(found)
            return found

        return _VAR.sub(value, text)

    def key(self, name: str, where: str) -> str:
        return self.resolve("${" + name + "}", where)

    def redact(self, text: str) -> str:
        for secret in sorted(self.values, key=len, reverse=True):
            text = text.replace(secret, "***")
        return text


@dataclass(frozen=True)
class Policy:
    """How one component's requests are sent (its recipe fields)."""

    timeout_s: float
    retries: int
    retry_backoff_s: float
    max_concurrency: int

    @classmethod
    def of(cls, component: "HttpReward | JudgeReward") -> "Policy":
        return cls(component.timeout_s, component.retries, component.retry_backoff_s, component.max_concurrency)

    def backoff(self, attempt: int) -> float:
        """Seconds before retry ``attempt`` (1-based): base * 2^(attempt-1), jittered by +-50%, capped."""
        return min(MAX_BACKOFF_S, self.retry_backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.5)


def check_credentials_transport(url: str, component: "HttpReward | JudgeReward") -> None:
    """Credentials never go over plain http to another machine unless the recipe allows it (the schema
    refuses such a recipe; checked again here, where the header is sent)."""
    from urllib.parse import urlsplit

    from ppo_cli.recipe import is_loopback_host

    parts = urlsplit(url)
    if parts.scheme == "http" and not is_loopback_host(parts.hostname) and not component.allow_insecure_http:
        raise RewardServerUnreachable(f"would send credentials over plain http to {parts.hostname}",
                                      hint="use https, or set allow_insecure_http: true if the network is trusted")


def quote(text: str, secrets: Secrets) -> str:
    text = secrets.redact(" ".join(text.split()))
    return repr(text if len(text) <= QUOTED_ANSWER else text[:QUOTED_ANSWER] + "...")


def probe(method: str, url: str, component, secrets: Secrets, headers: dict, body, allow: set[int] = frozenset(),
          what: str | None = None, error: type[UsageError] = RewardServerUnreachable):
    """One request before any model loads (`ppo validate`, train's preflight): a server that does not
    answer in time, or refuses, is one line naming the URL (``what`` it is: by default the component's
    type, "... reward"). Returns the answer."""
    import httpx

    what = what or f"{component.type} reward"
    timeout = min(component.timeout_s, PROBE_TIMEOUT_S)
    hint = f"start the server (or fix the URL) and run again; checked with one request, {timeout:g} s timeout"
    try:
        response = httpx.request(method, url, headers=headers, json=body, timeout=timeout)
    except httpx.TimeoutException:
        raise error(f"{what} {url} did not answer within {timeout:g} s", hint=hint) from None
    except httpx.HTTPError as err:
        raise error(f"{what} {url} cannot be reached ({secrets.redact(str(err)) or type(err).__name__})",
                    hint=hint) from None
    status = response.status_code
    if (status in REFUSING and status not in allow) or status >= 500:
        reason = REFUSING.get(status, "server error")
        raise error(f"{what} {url} answered HTTP {status} ({reason}) {quote(response.text, secrets)}", hint=hint)
    return response


async def request_json(client, method: str, url: str, policy: Policy, secrets: Secrets, *,
                       headers: dict[str, str] | None = None, body: Any = None, json_answer: bool = True) -> Any:
    """The JSON answer to one request, retried per ``policy``; RemoteFailure when it fails for good.
    ``json_answer`` False: the answer's text (vLLM's adapter endpoints answer plain text)."""
    import httpx

    attempts = policy.retries + 1
    last = ""
    for attempt in range(1, attempts + 1):
        if attempt > 1:
            await asyncio.sleep(policy.backoff(attempt - 1))
        try:
            response = await asyncio.wait_for(client.request(method, url, headers=headers, json=body),
                                              timeout=policy.timeout_s)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            last = f"no answer within {policy.timeout_s:g} s"
            continue
        except httpx.HTTPError as err:
            last = f"cannot connect ({secrets.redact(type(err).__name__ + ': ' + str(err)) or type(err).__name__})"
            continue
        if response.status_code == 429 or response.status_code >= 500:
            last = f"HTTP {response.status_code} {quote(response.text, secrets)}"
            continue
        if response.status_code >= 400:
            raise RemoteFailure(f"{url} answered HTTP {response.status_code} {quote(response.text, secrets)}")
        if not json_answer:
            return response.text
        try:
            return response.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RemoteFailure(f"{url} answered with something that is not JSON: {quote(response.text, secrets)}") from None
    tries = f" ({attempts} attempts)" if attempts > 1 else ""
    raise RemoteFailure(f"{url}: {last}{tries}")


async def gather_bounded(jobs: list[Callable[[], Awaitable]], limit: "int | asyncio.Semaphore") -> list:
    """Run the jobs with at most ``limit`` at once (a semaphore: shared with other calls); results (or
    the exceptions they raised) in order."""
    semaphore = limit if isinstance(limit, asyncio.Semaphore) else asyncio.Semaphore(limit)

    async def one(job):
        async with semaphore:
            return await job()

    return await asyncio.gather(*(one(job) for job in jobs), return_exceptions=True)


def open_client(client=None):
    """``client`` as is (its owner closes it), else a new one for one ``async with``."""
    import contextlib

    return contextlib.nullcontext(client) if client is not None else new_client()


def new_client():
    """An async client with no timeout of its own (request_json bounds every attempt) and no proxies
    from the environment for loopback addresses (httpx honours NO_PROXY)."""
    import httpx

    return httpx.AsyncClient(timeout=None, follow_redirects=False)


class RemoteScorer:
    """What the http and judge scorers share: the component's request policy, the secrets resolved for
    it, the latest failure (for the line that stops a run) and on_failure."""

    said_as = "reward server"  # how a failure that stops the run names the component
    batch_size = 1  # completions per request (http: the recipe's)

    def __init__(self, component: "HttpReward | JudgeReward"):
        self.component = component
        self.policy = Policy.of(component)
        self.secrets = Secrets()
        self.failure: str | None = None

    def _failed(self, message: str) -> None:
        self.failure = self.secrets.redact(message)
        if self.component.on_failure == "error":
            raise RewardServerError(f"{self.said_as} failed: {self.failure}",
                                    hint="with on_failure: skip such completions leave the update instead")

    def _values(self, results: list, sizes: list[int]) -> list[float | None]:
        """gather_bounded's results, one list of values per request, flattened: a failed request's
        completions get None (and the failure is kept); any other exception is raised."""
        values: list[float | None] = []
        for result, size in zip(results, sizes):
            if isinstance(result, RemoteFailure):
                self._failed(str(result))
                result = [None] * size
            elif isinstance(result, BaseException):
                raise result
            values += result
        return values
