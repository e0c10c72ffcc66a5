"""What the policy talks to between its turns: the Environment contract and its three types.

    reset(row, seed) -> observation      the messages after the prompt, before turn 1 (None: none)
    step(message)    -> {"observation", "reward", "done"}   message: {"role": "assistant", "content", "tool_calls"?}
    close()                              optional

An observation is a string (one ``user`` message; type tools: ``tool``), a list of messages or None.
Here every environment is driven through the same async interface (``reset``, ``step``, ``close``
coroutines): a user's sync methods run in a thread with a deadline, async ones are awaited with one
(calls.call_bounded). Types:

- ``tools``: built in. Each step runs the assistant message's tool calls (tool_calls.py), all at once,
  and answers with one ``tool`` message per call; a message without a call ends the episode (done).
  A tool's failure is its answer (counted), not the episode's.
- ``python``: the recipe's ``class`` built with ``kwargs``, one instance per episode.
- ``http``: ``POST url/reset {"episode_id", "row", "seed"} -> {"observation"}``, ``POST url/step
  {"episode_id", "message"} -> {"observation", "reward", "done"}``, ``POST url/close {"episode_id"}``,
  sent as http rewards are (engine/rewards/remote.py: per-attempt deadline, retries, ${VAR} headers).

A step that raises, times out or answers something else than the contract fails the episode: the
caller gets ``StepFailure`` (one line) and decides (on_failure).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import uuid
from dataclasses import dataclass
from typing import Any

from ppo_cli.engine.rewards.remote import Policy, RemoteFailure, Secrets, new_client, probe, quote, request_json
from ppo_cli.engine.envs.calls import call_bounded
from ppo_cli.engine.envs.tool_calls import parse_tool_calls
from ppo_cli.engine.envs.tools import Tool, call_tool, load_tools
from ppo_cli.engine.user_code import import_named
from ppo_cli.errors import EnvironmentSetupError
from ppo_cli.recipe import EnvironmentConfig

Message = dict[str, Any]


class StepFailure(Exception):
    """An environment's reset, step or close failed; the message says which and why, in one line."""


@dataclass(frozen=True)
class StepResult:
    observation: list[Message]  # the environment's messages (empty: none)
    reward: float | None  # this step's reward (summed over the episode); None: none
    done: bool
    tool_calls: int = 0  # type tools: the calls this step ran, malformed ones included
    tool_errors: int = 0  # of which answered with an error (unknown tool, wrong arguments, raised, timed out, malformed)


def as_messages(observation: Any, role: str, where: str) -> list[Message]:
    """An observation as messages: a string is one ``role`` message, None none, a list is checked."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": role, "content": observation}]
    if isinstance(observation, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                             and isinstance(m.get("content"), str) for m in observation):
        return [dict(m) for m in observation]
    raise StepFailure(f"{where} gave an observation that is not a string, a list of {{role, content}} messages or None")


STEP_KEYS = ("observation", "reward", "done", "info")  # info: anything, not read (yours to log or debug)


def parse_step(answer: Any, role: str, where: str) -> StepResult:
    """A step's answer ({"observation", "reward", "done"}; observation and reward may be left out) checked
    against the contract. ``done`` is required and other keys are refused: a gym-style answer
    (terminated, truncated) would otherwise run every episode to max_turns without a word."""
    if not isinstance(answer, dict):
        raise StepFailure(f"{where} returned {type(answer).__name__}, not a dict with observation, reward, done")
    unknown = [key for key in answer if key not in STEP_KEYS]
    if unknown:
        gym = "; for gym's terminated and truncated, return done = terminated or truncated" if {
            "terminated", "truncated"} & set(unknown) else ""
        raise StepFailure(f"{where} returned {', '.join(map(repr, unknown))}, not one of observation, reward, done "
                          f"(and info, not read){gym}")
    if "done" not in answer:
        raise StepFailure(f"{where} returned no 'done': say whether the episode has ended, true or false")
    reward = answer.get("reward")
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise StepFailure(f"{where} returned reward {reward!r}, not a finite number or None")
        reward = float(reward)
    done = answer.get("done", False)
    if not isinstance(done, bool):
        raise StepFailure(f"{where} returned done {done!r}, not true or false")
    return StepResult(as_messages(answer.get("observation"), role, where), reward, done)


RESET_KEYS = ("observation", "info")  # info: anything, not read


def parse_reset_answer(answer: Any, where: str) -> list[Message]:
    """An http environment's reset answer ({"observation": ...}) checked against the contract: other keys
    are refused, as step's are (a reward there would be dropped without a word: rewards come with steps)."""
    if not isinstance(answer, dict):
        raise StepFailure(f"{where} answered {type(answer).__name__}, not an object")
    unknown = [key for key in answer if key not in RESET_KEYS]
    if unknown:
        raise StepFailure(f"{where} answered {', '.join(map(repr, unknown))}, not observation (and info, not read)"
                          + ("; a reward comes with a step, not with reset" if "reward" in unknown else ""))
    return as_messages(answer.get("observation"), "user", where)


class ToolsEnvironment:
    """type tools: runs the assistant's tool calls and answers each with a ``tool`` message."""

    def __init__(self, tools: dict[str, Tool], timeout_s: float):
        self.tools = tools
        self.timeout_s = timeout_s

    async def reset(self, row: dict, seed: int) -> list[Message]:
        return []

    async def step(self, message: Message) -> StepResult:
        calls = parse_tool_calls(message["content"])
        if not calls:
            return StepResult([], None, True)

        async def answer(call):
            if call.error is not None:
                return f"error: {call.error}", True
            said = await call_tool(self.tools, call.name, call.arguments, self.timeout_s)
            return said.content, said.error

        answers = await asyncio.gather(*(answer(call) for call in calls))
        observation = [{"role": "tool", **({"name": call.name} if call.name else {}), "content": content}
                       for call, (content, _) in zip(calls, answers)]
        return StepResult(observation, None, False, len(calls), sum(error for _, error in answers))

    async def close(self) -> None:
        pass


class PythonEnvironment:
    """type python: one instance of the user's class per episode; sync or async methods, each bounded."""

    def __init__(self, instance: Any, spec: str, timeout_s: float):
        self.instance = instance
        self.spec = spec
        self.timeout_s = timeout_s

    async def _call(self, method: str, *args) -> Any:
        where = f"environment {self.spec}.{method}"
        try:
            return await call_bounded(getattr(self.instance, method), *args, timeout_s=self.timeout_s)
        except asyncio.TimeoutError:
            raise StepFailure(f"{where} did not return within {self.timeout_s:g} s") from None
        except StepFailure:
            raise
        except Exception as err:
            raise StepFailure(f"{where} raised {type(err).__name__}: {' '.join(str(err).split())[:200]}") from err

    async def reset(self, row: dict, seed: int) -> list[Message]:
        return as_messages(await self._call("reset", dict(row), seed), "user", f"environment {self.spec}.reset")

    async def step(self, message: Message) -> StepResult:
        return parse_step(await self._call("step", dict(message)), "user", f"environment {self.spec}.step")

    async def close(self) -> None:
        if callable(getattr(self.instance, "close", None)):
            await self._call("close")


class HttpEnvironment:
    """type http: one episode on a server, named by a fresh ``episode_id``."""

    def __init__(self, url: str, headers: dict[str, str], policy: Policy, secrets: Secrets, client_of):
        self.url = url.rstrip("/")
        self.headers = headers
        self.policy = policy
        self.secrets = secrets
        self.client_of = client_of  # () -> the httpx.AsyncClient the episodes of one sampling share
        self.episode_id = uuid.uuid4().hex

    async def _post(self, endpoint: str, body: dict) -> Any:
        headers = {name: self.secrets.resolve(value, f"environment header '{name}'") for name, value in self.headers.items()}
        try:
            return await request_json(self.client_of(), "POST", f"{self.url}/{endpoint}", self.policy, self.secrets,
                                      headers=headers, body={"episode_id": self.episode_id, **body})
        except RemoteFailure as err:
            raise StepFailure(f"environment server {err}") from None

    async def reset(self, row: dict, seed: int) -> list[Message]:
        return parse_reset_answer(await self._post("reset", {"row": row, "seed": seed}), f"environment server {self.url}/reset")

    async def step(self, message: Message) -> StepResult:
        return parse_step(await self._post("step", {"message": message}), "user", f"environment server {self.url}/step")

    async def close(self) -> None:
        await self._post("close", {})


def check_server(environment: EnvironmentConfig, row: dict) -> None:
    """type http, before any model loads (`ppo validate`, train's preflight): one episode reset on
    ``row`` (the first prompt's columns) and closed, so a server that is down, refuses, or answers reset
    outside the contract is one line now, not a failed first update. Its ${VAR} headers are resolved."""
    secrets = Secrets()
    headers = {name: secrets.resolve(value, f"environment server {environment.url} header '{name}'")
               for name, value in environment.headers.items()}
    url = environment.url.rstrip("/")
    episode_id = f"ppo-check-{uuid.uuid4().hex}"
    answer = probe("POST", f"{url}/reset", environment, secrets, headers, {"episode_id": episode_id, "row": row, "seed": 0},
                   what="environment server", error=EnvironmentSetupError)
    try:
        parse_reset_answer(answer.json(), f"environment server {url}/reset")
    except ValueError:
        raise EnvironmentSetupError(f"environment server {url}/reset did not answer JSON: {quote(answer.text, secrets)}",
                                    hint="answer reset with {\"observation\": ...}") from None
    except StepFailure as err:
        raise EnvironmentSetupError(str(err), hint="answer reset with {\"observation\": a string, a list of "
                                    "{role, content} messages, or null}") from None
    probe("POST", f"{url}/close", environment, secrets, headers, {"episode_id": episode_id},
          what="environment server", error=EnvironmentSetupError)


def check_python_environment(environment: EnvironmentConfig, row: dict) -> None:
    """type python, before any model loads (train's preflight, which imports the class anyway): one
    instance built with environment.kwargs, reset on ``row`` (the first prompt's columns, seed 0) and
    closed, as check_server does on a server, so that wrong kwargs, a reset that raises or answers outside
    the contract is one line now, not a failed first update after the models load."""
    factory = EnvironmentFactory(environment)

    async def one_episode() -> None:
        instance = factory()
        try:
            await instance.reset(dict(row), 0)
        finally:
            try:
                await instance.close()
            except StepFailure:
                pass  # a failed goodbye: what the episodes themselves also forgive

    try:
        asyncio.run(one_episode())
    except StepFailure as err:
        raise EnvironmentSetupError(str(err), hint="fix the environment class (ppo_cli reset one episode on the first "
                                    "prompt's row, seed 0, before loading the models)") from None


class EnvironmentFactory:
    """The recipe's environment section -> a new environment per episode. Built once, before sampling:
    tools and classes are imported here, so a missing one is one line before any episode runs."""

    def __init__(self, environment: EnvironmentConfig):
        self.config = environment
        self.tools: dict[str, Tool] = load_tools(environment.tools) if environment.type == "tools" else {}
        self.observation_role = "tool" if environment.type == "tools" else "user"
        self.environment_class = None
        if environment.type == "python":
            define = f"define class {environment.class_.rpartition(':')[2]} with reset(self, row, seed) and step(self, message)"
            self.environment_class = import_named(environment.class_, "environment class", EnvironmentSetupError,
                                                  define=define)
            if not inspect.isclass(self.environment_class) or not all(
                    callable(getattr(self.environment_class, method, None)) for method in ("reset", "step")):
                raise EnvironmentSetupError(f"environment class '{environment.class_}' is not a class with reset and step",
                                            hint="def reset(self, row, seed) and def step(self, message)")
        self.policy = Policy(environment.timeout_s, environment.retries, environment.retry_backoff_s,
                             environment.max_concurrency)
        self.secrets = Secrets()
        self._client = None

    def _client_of(self):
        if self._client is None:  # made inside the running event loop that will use it
            self._client = new_client()
        return self._client

    def __call__(self):
        """A fresh environment for one episode; the user's __init__ raising is a StepFailure."""
        config = self.config
        if config.type == "tools":
            return ToolsEnvironment(self.tools, config.timeout_s)
        if config.type == "http":
            return HttpEnvironment(config.url, config.headers, self.policy, self.secrets, self._client_of)
        try:
            return PythonEnvironment(self.environment_class(**config.kwargs), config.class_, config.timeout_s)
        except Exception as err:
            raise StepFailure(f"environment {config.class_}(**kwargs) raised {type(err).__name__}: {err}") from err

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
