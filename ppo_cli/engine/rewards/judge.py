"""reward type judge: an LLM behind an OpenAI-compatible chat-completions endpoint scores each completion.

The template file's {prompt} and {response} are filled in (other braces are left alone) and sent as
the user message, at temperature 0; the first number in the answer must lie in ``scale`` [low, high]
and is mapped to (x - low) / (high - low) in [0, 1]. An answer with no such number, or a request that
fails for good (engine/rewards/remote.py), leaves the completion without a reward (None).
"""

from __future__ import annotations

import re
from pathlib import Path

from ppo_cli.engine.rewards.remote import (RemoteFailure, RemoteScorer, Secrets, check_credentials_transport, gather_bounded,
                                   open_client, probe, quote, request_json)
from ppo_cli.errors import DataError
from ppo_cli.recipe import JudgeReward

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def check(component: JudgeReward, contact_servers: bool = True, import_functions: bool = False) -> None:
    """The template file has {response}, the API key's variable is set, and (``contact_servers``) the server answers."""
    template = Path(component.prompt)
    if not template.is_file():
        raise DataError(f"judge prompt template not found: {template}", hint="paths are relative to the current directory")
    if "{response}" not in template.read_text(encoding="utf-8", errors="replace"):
        raise DataError(f"judge prompt template {template} has no {{response}}",
                        hint="write {prompt} and {response} where the judge should read them")
    secrets = Secrets()
    headers = {}
    if component.api_key_env:
        headers["Authorization"] = "Bearer " + secrets.key(component.api_key_env, f"judge {component.base_url} (api_key_env)")
    if contact_servers:
        # OpenAI-compatible servers list their models here; one that has no such route still answered.
        probe("GET", component.base_url.rstrip("/") + "/models", component, secrets, headers, None, allow={404, 405})


def display_name(component: JudgeReward) -> str:
    return f"judge:{component.model}"


def prompt_text(prompt) -> str:
    """A conversation as 'role: content' lines; a plain prompt as is."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def fill_template(template: str, prompt, response: str) -> str:
    return template.replace("{prompt}", prompt_text(prompt)).replace("{response}", response)


def parse_score(answer: str, low: float, high: float) -> float | None:
    """The first number of ``answer`` mapped from [low, high] to [0, 1]; None when there is none or it is out of range."""
    match = _NUMBER.search(answer)
    if match is None:
        return None
    value = float(match.group())
    return (value - low) / (high - low) if low <= value <= high else None


class JudgeScorer(RemoteScorer):
    said_as = "judge"
    reads_columns = False

    def __init__(self, component: JudgeReward, device=None, system_prompt: str | None = None):
        super().__init__(component)
        self.template = Path(component.prompt).read_text(encoding="utf-8")
        self.scale = component.scale
        self.request = {"model": component.model, "temperature": 0, "max_tokens": component.max_tokens}  # each body's fixed part
        self.url = component.base_url.rstrip("/") + "/chat/completions"

    @property
    def where(self) -> str:
        return self.url

    async def ascore(self, prompts: list, responses: list[str], columns: dict[str, list],
                     limit=None, client=None) -> list[float | None]:
        """``limit`` and ``client``: a semaphore and an httpx client shared by several calls
        (engine/rewards/stream.py), else max_concurrency and a client of this call's own."""
        c = self.component
        headers = {}
        if c.api_key_env:
            check_credentials_transport(self.url, c)
            headers["Authorization"] = "Bearer " + self.secrets.key(c.api_key_env, f"judge {c.base_url} (api_key_env)")
        async with open_client(client) as client:
            jobs = [(lambda p=p, r=r: self._judge(client, headers, p, r)) for p, r in zip(prompts, responses)]
            results = await gather_bounded(jobs, self.policy.max_concurrency if limit is None else limit)
        return self._values(results, [1] * len(results))

    async def _judge(self, client, headers: dict, prompt, response: str) -> list[float]:
        body = {**self.request, "messages": [{"role": "user", "content": fill_template(self.template, prompt, response)}]}
        answer = await request_json(client, "POST", self.url, self.policy, self.secrets, headers=headers, body=body)
        try:
            text = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise RemoteFailure(f"{self.url} answered without choices[0].message.content: {quote(str(answer), self.secrets)}") from None
        low, high = self.scale
        score = parse_score(str(text), low, high)
        if score is None:
            raise RemoteFailure(f"judge {self.url} answered {quote(str(text), self.secrets)}, which has no number in "
                                f"[{low:g}, {high:g}]")
        return [score]


Scorer = JudgeScorer
