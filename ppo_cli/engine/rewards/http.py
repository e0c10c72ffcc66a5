"""reward type http: completions POSTed in batches to a reward server.

    POST url  {"prompts": [...], "responses": [...], "columns": {"answer": [...], ...}}
         ->   {"rewards": [number | null, ...]}      one per response, null where it cannot score

A request that fails for good (engine/rewards/remote.py: timeouts, 5xx after the retries) or answers wrongly
(not JSON, no "rewards" list, the wrong length) leaves every completion of its batch without a reward
(None); so does a null or a non-finite number. With on_failure: error the first such failure stops the run.
"""

from __future__ import annotations

import math

from urllib.parse import urlsplit

from ppo_cli.engine.rewards.remote import (RemoteFailure, RemoteScorer, Secrets, check_credentials_transport, gather_bounded,
                                   open_client, probe, quote, request_json)
from ppo_cli.recipe import SECRET_HEADER, HttpReward


def check(component: HttpReward, contact_servers: bool = True, import_functions: bool = False) -> None:
    """Every ${VAR} its headers name is set, and (``contact_servers``) the server answers an empty batch."""
    secrets = Secrets()
    headers = {name: secrets.resolve(value, f"reward server {component.url} header '{name}'")
               for name, value in component.headers.items()}
    if contact_servers:
        probe("POST", component.url, component, secrets, headers, {"prompts": [], "responses": [], "columns": {}})


def display_name(component: HttpReward) -> str:
    return f"http:{urlsplit(component.url).netloc}"


class HttpScorer(RemoteScorer):
    reads_columns = True

    def __init__(self, component: HttpReward, device=None, system_prompt: str | None = None):
        super().__init__(component)

    @property
    def where(self) -> str:
        return self.component.url

    @property
    def batch_size(self) -> int:
        return self.component.batch_size

    async def ascore(self, prompts: list, responses: list[str], columns: dict[str, list],
                     limit=None, client=None) -> list[float | None]:
        """``limit`` and ``client``: a semaphore and an httpx client shared by several calls
        (engine/rewards/stream.py), else max_concurrency and a client of this call's own."""
        c = self.component
        headers = {name: self.secrets.resolve(value, f"reward server {c.url} header '{name}'")
                   for name, value in c.headers.items()}
        if any(SECRET_HEADER.search(name) for name in headers):
            check_credentials_transport(c.url, c)
        starts = range(0, len(responses), c.batch_size)

        def job(start: int):
            end = start + c.batch_size
            body = {"prompts": prompts[start:end], "responses": responses[start:end],
                    "columns": {name: values[start:end] for name, values in columns.items()}}
            return lambda: self._post(client, headers, body, len(body["responses"]))

        async with open_client(client) as client:
            results = await gather_bounded([job(s) for s in starts], self.policy.max_concurrency if limit is None else limit)
        return self._values(results, [len(responses[start:start + c.batch_size]) for start in starts])

    async def _post(self, client, headers: dict, body: dict, size: int) -> list[float | None]:
        answer = await request_json(client, "POST", self.component.url, self.policy, self.secrets,
                                    headers=headers, body=body)
        rewards = answer.get("rewards") if isinstance(answer, dict) else None
        if not isinstance(rewards, list):
            raise RemoteFailure(f"{self.component.url} answered without a \"rewards\" list: {quote(str(answer), self.secrets)}")
        if len(rewards) != size:
            raise RemoteFailure(f"{self.component.url} answered {len(rewards)} rewards for {size} responses")
        values = [_number(r) for r in rewards]
        if any(v is None for v in values):
            bad = next(r for r, v in zip(rewards, values) if v is None)
            self._failed(f"{self.component.url} answered {quote(json_text(bad), self.secrets)} for a response")
        return values


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def json_text(value) -> str:
    import json

    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


Scorer = HttpScorer
