"""Rewards: the recipe's components, each scored by its type's scorer (engine/rewards/registry.py), their
weights, penalties.

A reward is a weighted sum of components, minus penalties (missing stop token, over-length).
Every component's per-episode value is kept so `ppo score` and the metrics can show them. A
component may fail to score a completion (a server that timed out, a judge answer with no number):
its value is then None, and so is that completion's total. A function's None is TRL's "does not
apply": the total sums the components that scored it, and is None only when none did. Components with an
``ascore`` coroutine (http, judge, async functions) are awaited together in a thread of their own
while the others (reward models) score here; a rollout sends the remote ones' (http, judge) requests
while it is still sampling (``stream``, engine/rewards/stream.py).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ppo_cli.algo.shaping import soft_overlong_penalty
from ppo_cli.engine.data import PromptColumns
from ppo_cli.engine.rewards.remote import RemoteScorer
from ppo_cli.engine.rewards.stream import RewardStream
from ppo_cli.engine.rewards.registry import REWARD_TYPES
from ppo_cli.recipe import RewardConfig

if TYPE_CHECKING:
    import torch

# The overlong penalty's component name (metrics: reward/overlong, metric_names.REWARD_OVERLONG).
OVERLONG = "overlong"


def _component_name(component, index: int, taken: set[str]) -> str:
    base = REWARD_TYPES[component.type].display_name(component)
    name = base if base not in taken else f"{base}#{index}"
    taken.add(name)
    return name


@dataclass
class ScoreResult:
    scores: list  # (B,) the total reward of each episode; None where a component failed to score it
    components: dict[str, list]  # name -> (B,) values before weighting (None: failed); penalties as negative numbers
    failures: dict[str, str] = field(default_factory=dict)  # component name -> its latest failure, said in one line

    @property
    def scored(self) -> list[bool]:
        """(B,) True where every component scored the episode."""
        return [score is not None for score in self.scores]


def combine_components(scorers: list, values: list[list], count: int) -> tuple[list, dict[str, list], dict[str, str]]:
    """(B,) totals, name -> (B,) values, name -> failure line: the components' weighted sum per episode
    (``count``: B).

    A function's None (or NaN) is TRL's "this reward does not apply here": the episode's total is the
    weighted sum of the components that did score it (TRL's nansum over reward functions). An episode
    no function scored, or one a server, judge or model failed to score, has no total (None) and the
    component's failure line is kept: it leaves the update, counted, never scored 0."""
    totals: list = [0.0] * count
    scored_by = [False] * count
    components: dict[str, list] = {}
    for (name, weight, scorer), component in zip(scorers, values):
        components[name] = component
        skips_none = getattr(scorer, "skips_none", False)
        for i, v in enumerate(component):
            if v is not None and totals[i] is not None:
                totals[i] += weight * v
            scored_by[i] = scored_by[i] or v is not None
            if v is None and not skips_none:
                totals[i] = None
    totals = [t if any_score else None for t, any_score in zip(totals, scored_by)]
    failures = {name: getattr(scorer, "failure", None) or f"{name} gave no reward"
                for (name, _, scorer), component in zip(scorers, values)
                if any(v is None and t is None for v, t in zip(component, totals))}
    return totals, components, failures


class RewardStack:
    """The recipe's reward: components summed with their weights, then the penalties."""

    def __init__(self, config: RewardConfig, device: torch.device, system_prompt: str | None = None,
                 columns: PromptColumns | Callable[[], PromptColumns] | None = None,
                 max_new_tokens: int | None = None, mixed_precision: str = "no"):
        """``system_prompt``: the recipe's data.system_prompt, part of the conversation a
        ``text: conversation`` component reads. ``columns``: the prompts' other dataset columns, or
        what reads them (called the first time a component asks). ``max_new_tokens``:
        generation.max_new_tokens, where the overlong penalty (reward.overlong_buffer) is full.
        ``mixed_precision``: the run's, for the components whose models compute under it (ModelScorer)."""
        if config.overlong_buffer > 0 and max_new_tokens is None:
            raise ValueError("reward.overlong_buffer needs generation.max_new_tokens")
        self.config = config
        self.max_new_tokens = max_new_tokens
        self._columns = columns
        taken: set[str] = set()
        self.scorers = []
        for index, component in enumerate(config.components):
            scorer = REWARD_TYPES[component.type].Scorer(component, device, system_prompt)
            if hasattr(scorer, "mixed_precision"):
                scorer.mixed_precision = mixed_precision
            self.scorers.append((_component_name(component, index, taken), component.weight, scorer))

    @property
    def failable(self) -> list[str]:
        """The components that may leave an episode without a reward (None), by name."""
        return [name for name, _, scorer in self.scorers if hasattr(scorer, "failure")]

    def take_part_without_rows(self) -> None:
        """A process that has no rows to score while the others score theirs: a reward model sharded
        across processes (distributed.InStepScorer) still needs its forwards."""
        for _, _, scorer in self.scorers:
            if hasattr(scorer, "take_part_without_rows"):
                scorer.take_part_without_rows()

    def check_columns(self, names: set[str], source: str, fields: set[str] | None = None) -> None:
        """One line naming a reward function that needs a column the rows of ``source`` lack; ``fields``: the
        rows' fields to name in it (the prompt column too), default ``names``."""
        for _, _, scorer in self.scorers:
            if hasattr(scorer, "check_columns"):
                scorer.check_columns(names, f"the rows of {source}", fields)

    def columns_for(self, prompts: list) -> dict[str, list]:
        if callable(self._columns):
            self._columns = self._columns()
        return self._columns.columns_for(prompts) if self._columns is not None else {}

    def _prepare(self, prompts: list, columns: dict[str, list] | None) -> dict[str, list]:
        """The prompts' columns (looked up when a component reads them), every failure of a batch before forgotten."""
        if columns is None and any(getattr(s, "reads_columns", False) for _, _, s in self.scorers):
            columns = self.columns_for(prompts)
        for _, _, scorer in self.scorers:
            if hasattr(scorer, "failure"):
                scorer.failure = None
        return columns or {}

    def stream(self, prompts: list, decode: Callable[[list[int]], str]) -> RewardStream | None:
        """The remote components' requests for ``prompts``, sent as their rows finish sampling
        (generate's ``on_finished``: RewardStream.finished); None when the reward has no remote component."""
        remote = {i: s for i, (_, _, s) in enumerate(self.scorers) if isinstance(s, RemoteScorer)}
        if not remote:
            return None
        return RewardStream(remote, prompts, self._prepare(prompts, None), decode)

    def start(self, prompts: list, responses: list[str], columns: dict[str, list] | None = None,
              stream: RewardStream | None = None) -> "PendingScores":
        """Send the asynchronous components' requests now, in a worker thread; ``score(...,
        pending=)`` collects them. The rollout calls this before its log-prob and value forwards,
        so a server's or judge's latency overlaps them. ``stream``: the remote components' requests
        already sent during sampling (``stream``); the rest of them go out now."""
        columns = stream.columns if stream is not None else self._prepare(prompts, columns)
        streamed = stream.indices if stream is not None else []
        if stream is not None:
            stream.ended(responses)
        waiting = [i for i, (_, _, s) in enumerate(self.scorers) if hasattr(s, "ascore") and i not in streamed]

        async def together():
            return await asyncio.gather(*(self.scorers[i][2].ascore(prompts, responses, columns) for i in waiting),
                                        return_exceptions=True)

        pool = ThreadPoolExecutor(max_workers=1) if waiting else None
        future = pool.submit(asyncio.run, together()) if waiting else None
        return PendingScores(columns, waiting + streamed, pool, future, stream, responses)

    def score(self, prompts: list, responses: list[str], finished: list[bool], response_lengths: list[int],
              known: dict[int, list] | None = None, columns: dict[str, list] | None = None,
              pending: "PendingScores | None" = None, action_lengths: list[int] | None = None) -> ScoreResult:
        """``known``: component index -> (B,) values already computed (engine/rewards/shared.py), None
        for the rows that component still scores. ``columns``: the prompts' other columns, when the
        caller has them (else looked up by prompt). ``pending``: what start() sent for these rows.
        ``action_lengths``: (B,) the policy's sampled tokens of each episode (an environment's tokens
        inside it excluded), what the overlong penalty counts; default ``response_lengths``."""
        pending = pending if pending is not None else self.start(prompts, responses, columns)
        values = self._component_values(prompts, responses, known or {}, pending)
        totals, components, failures = combine_components(self.scorers, values, len(responses))
        if self.config.missing_eos_penalty is not None:
            penalty = [0.0 if done else -self.config.missing_eos_penalty for done in finished]
            components["missing_eos_penalty"] = penalty
            totals = [None if t is None else t + p for t, p in zip(totals, penalty)]
        if self.config.max_response_tokens is not None:
            limit, amount = self.config.max_response_tokens, self.config.overlength_penalty
            penalty = [-amount if n > limit else 0.0 for n in response_lengths]
            components["overlength_penalty"] = penalty
            totals = [None if t is None else t + p for t, p in zip(totals, penalty)]
        if self.config.overlong_buffer > 0:
            lengths = response_lengths if action_lengths is None else action_lengths
            penalty = [soft_overlong_penalty(n, self.max_new_tokens, self.config.overlong_buffer,
                                             self.config.overlong_penalty) for n in lengths]
            components[OVERLONG] = penalty
            totals = [None if t is None else t + p for t, p in zip(totals, penalty)]
        return ScoreResult(totals, components, failures)

    def _component_values(self, prompts: list, responses: list[str], known: dict[int, list],
                          pending: "PendingScores") -> list[list]:
        """Each component's (B,) values: the synchronous ones computed here, while the asynchronous
        ones (started by start()) finish in their thread."""
        values: list = [None] * len(self.scorers)
        for index, (_, _, scorer) in enumerate(self.scorers):
            if index not in pending.waiting:
                reads = getattr(scorer, "reads_columns", False)
                call = (lambda p, r, s=scorer: s(p, r, pending.columns)) if reads else scorer
                values[index] = _fill_in(call, prompts, responses, known.get(index))
        for index, result in zip(pending.waiting, pending.results()):
            if isinstance(result, BaseException):
                raise result
            values[index] = result
        return values


@dataclass
class PendingScores:
    """The asynchronous components' requests for one batch, sent by RewardStack.start."""

    columns: dict[str, list]
    waiting: list[int]  # the components' indices: those awaited in ``future``, then the ``stream``'s
    pool: ThreadPoolExecutor | None
    future: object | None
    stream: RewardStream | None = None
    responses: list[str] | None = None  # the batch's texts, as the stream's requests must have them

    def results(self) -> list:
        """Each waiting component's values, or the exception it raised (bounded: every request has a timeout)."""
        try:
            values = self.future.result() if self.future is not None else []
            return values + (self.stream.results(self.responses) if self.stream is not None else [])
        finally:
            self.close()

    def close(self) -> None:
        """Let go of what is still in flight (the caller failed before collecting)."""
        if self.pool is not None:
            self.pool.shutdown(wait=False)
        if self.stream is not None:
            self.stream.close()


def _fill_in(scorer, prompts: list, responses: list[str], known: list | None) -> list:
    """The scorer's values, calling it only for the rows ``known`` leaves as None."""
    if known is None:
        return scorer(prompts, responses)
    missing = [i for i, value in enumerate(known) if value is None]
    values = list(known)
    if missing:
        for i, value in zip(missing, scorer([prompts[i] for i in missing], [responses[i] for i in missing])):
            values[i] = value
    return values
