"""MultiTurnSampler: the Sampler the engine calls, running episodes of several turns over a batch.

Per turn: the inner sampler samples every running episode's next turn from its whole sequence so far
(left-padded; at most the largest remaining budget, each episode's turn then cut to its own), every
episode that sampled is stepped in its environment, ``max_concurrency`` at once on one event loop kept
for the whole batch in a thread of its own (so an environment's connections and state live across its
turns), and the environment's delta (episode.py) is appended. With ``environment.overlap`` the batch
runs as two waves, its first and second half: while one wave's environments step, the other wave
samples, in a fixed order (wave 1 samples, wave 2 samples, wave 1's steps are waited for, wave 1
samples, ...), so what is sampled never depends on how long a step took. Sampling and every use of the
tokenizer stay in the calling thread; only the environments' calls run on the loop (overlap.py).

The result is a ``Sampled`` whose Generation's response is every token after the prompt:
``response_mask`` on all of them (attended), ``action_mask`` on the policy's sampled tokens only
(trained), holes where the environment spoke; ``finished`` per episode (its last turn ended with the
stop token). Beside it, ``episodes``: one EpisodeRecord per row.

An episode whose reset gave messages starts from a longer prompt: those messages are rendered into its
prompt (nothing is sampled yet, so nothing sampled is re-tokenized); ``generation.prompt_ids`` is then
not the ``prompt_ids`` passed in, and the caller reads it from the result. An episode whose reset
failed still samples its first turn (every row has a response) and ends failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ppo_cli.engine.rewards.remote import gather_bounded
from ppo_cli.engine.envs.environments import EnvironmentFactory, StepFailure, StepResult
from ppo_cli.engine.envs.overlap import StepRunner, WaveRun, steps_overlap_sampling, waves
from ppo_cli.engine.envs.episode import (
    Episode,
    TemplateRewrites,
    assistant_message,
    check_template_round_trip,
    cut_observation,
    encode,
    no_chat_template_error,
    observation_ids,
    render,
    sample_conversations,
)
from ppo_cli.engine.chat import as_messages
from ppo_cli.engine.envs.tool_calls import describe_tools, parse_tool_calls, resolve_tool_call_format, template_renders_tools
from ppo_cli.engine.envs.tools import tool_schemas
from ppo_cli.errors import EnvironmentFailed
from ppo_cli.recipe import EnvironmentConfig
from ppo_cli.types import Generation

Message = dict[str, Any]


@dataclass(frozen=True)
class EpisodeStart:
    """What an episode starts from besides its prompt ids: the prompt's row (its columns), the reset seed
    (the same for every episode of one prompt's group: group_reset_seeds) and the prompt's messages."""

    row: dict
    seed: int
    prompt_messages: list[Message]


@dataclass(frozen=True)
class EpisodeRecord:
    messages: list[Message]  # the transcript after the prompt: reset's messages, assistant turns, the environment's
    turns: int
    tool_calls: int
    tool_errors: int
    observation_tokens: int  # the environment's tokens the policy read (reset's in the prompt included)
    step_reward: float | None  # sum of the steps' rewards; None: no step gave one
    ended_by: str  # done | max_turns | max_episode_tokens | max_new_tokens | failed
    failed: bool
    failure: str | None  # one line, when failed
    last_response: str  # the last assistant message's text: what reward.components score


@dataclass(frozen=True)
class MultiTurnSampled:
    """engine/sampler.py's Sampled (its four fields, same meaning) plus the episodes' records."""

    generation: Generation
    logprobs: torch.Tensor | None  # (B, T) sampled tokens' log-probs, 0 outside action_mask
    hidden: torch.Tensor | None  # (B, T, H) the turns' hidden states at the policy's tokens, 0 elsewhere
    policy_logprobs: bool
    episodes: list[EpisodeRecord]


def group_reset_seeds(seed: int, num_prompts: int, num_generations: int) -> list[int]:
    """One reset seed per episode, the same within a prompt's group of ``num_generations``: (P * G,)."""
    return [seed + p for p in range(num_prompts) for _ in range(num_generations)]


def left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids and bool mask, each row right-aligned."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(row)
            mask[i, width - len(row):] = True
    return ids.to(device), mask.to(device)


class MultiTurnSampler:
    """The Sampler protocol over whole episodes. It reads the prompts themselves (``reads_prompts``): an
    episode starts from the prompt's messages and row, and its prompt ids are the chat template's rendering
    with the tools; the engine passes ``prompts`` and this sampler makes the ids and the reset seeds."""

    reads_prompts = True
    streams = False  # the rewards score an episode's last message, once the episode has ended

    def __init__(self, inner, factory: EnvironmentFactory, tokenizer, environment: EnvironmentConfig,
                 stop_token_id: int, pad_token_id: int, columns_for=None, system_prompt: str | None = None,
                 max_prompt_tokens: int | None = None, max_turn_tokens: int | None = None):
        """``columns_for(prompts) -> {column: [value per prompt]}``: the rows' other columns, which reset
        reads as ``row`` (engine/data.PromptColumns); ``system_prompt`` / ``max_prompt_tokens``: data.*."""
        self.inner = inner
        self.columns_for = columns_for
        self.system_prompt = system_prompt
        self.max_prompt_tokens = max_prompt_tokens
        self.max_turn_tokens = max_turn_tokens  # generation.max_new_tokens: one turn's tokens at most
        self.factory = factory
        self.tokenizer = tokenizer
        self.environment = environment
        self.stop_token_id = stop_token_id
        self.pad_token_id = pad_token_id
        self.stop_text = tokenizer.decode([stop_token_id], skip_special_tokens=False)
        self.tools = tool_schemas(factory.tools) or None  # what the template shows (type tools)
        # Refused here, before any episode runs: no template, a tool format not read, a template that rewrites history.
        if not getattr(tokenizer, "chat_template", None):
            raise no_chat_template_error(getattr(tokenizer, "name_or_path", "") or "the policy")
        self.tool_call_format = (resolve_tool_call_format(tokenizer, environment.tool_call_format)
                                 if environment.type == "tools" else environment.tool_call_format)
        check_template_round_trip(tokenizer, sample_conversations(factory.observation_role), stop_token_id, self.tools)
        # Type tools with a template that does not show tools (SmolLM2's ChatML): offered in the system prompt.
        self.tools_in_system = (describe_tools(self.tools) if self.tools and not template_renders_tools(tokenizer)
                                else None)

    @property
    def copies_weights(self) -> bool:
        return self.inner.copies_weights

    def close(self) -> None:
        self.inner.close()

    # --- prompts ------------------------------------------------------------------------------------

    def prompt_messages(self, prompt) -> list[Message]:
        """The conversation an episode starts from: the prompt (a string is one user turn), data.system_prompt
        first unless the prompt has a system turn, and the tools described there when the template does not
        show them."""
        messages = as_messages(prompt, self.system_prompt)
        if self.tools_in_system is None:
            return messages
        if messages[0]["role"] == "system":
            return [{**messages[0], "content": messages[0]["content"] + "\n\n" + self.tools_in_system}, *messages[1:]]
        return [{"role": "system", "content": self.tools_in_system}, *messages]

    def starts_for(self, prompts: list) -> list[EpisodeStart]:
        """One EpisodeStart per prompt: its row's columns, its messages, and a reset seed drawn from torch's
        random state (seeded and checkpointed: a resumed run draws the same), the same for consecutive
        repeats of one prompt (a prompt's group of num_generations)."""
        columns = self.columns_for(prompts) if self.columns_for is not None else {}
        starts, seed = [], None
        for i, prompt in enumerate(prompts):
            if i == 0 or prompt != prompts[i - 1]:
                seed = int(torch.randint(0, 2**31 - 1, (1,)))
            row = {name: values[i] for name, values in columns.items()}
            starts.append(EpisodeStart(row, seed, self.prompt_messages(prompt)))
        return starts

    def encode_prompts(self, starts: list[EpisodeStart], device) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, P) left-padded ids and mask: each start's messages through the chat template, with the tools."""
        rows = [encode(self.tokenizer, render(self.tokenizer, s.prompt_messages, self.tools, True)) for s in starts]
        longest = max(len(r) for r in rows)
        if self.max_prompt_tokens is not None and longest > self.max_prompt_tokens:
            from ppo_cli.errors import DataError

            raise DataError(f"an episode's prompt (its chat template and the tools included) takes {longest} tokens, "
                            f"more than data.max_prompt_tokens ({self.max_prompt_tokens})",
                            hint=f"raise data.max_prompt_tokens to at least {longest}, or shorten the prompts")
        return left_pad(rows, self.pad_token_id, device)

    # --- episodes -----------------------------------------------------------------------------------

    def sample(self, policy, prompt_ids: torch.Tensor | None, prompt_mask: torch.Tensor | None, *,
               prompts: list | None = None, starts: list[EpisodeStart] | None = None,
               with_logprobs: bool = False, keep_hidden: bool = False, on_finished=None,
               max_new_tokens: int | None = None, device=None) -> MultiTurnSampled:
        """Either ``prompts`` (as read: strings or message lists; the ids, rows and seeds are made here,
        ``prompt_ids`` / ``prompt_mask`` ignored) or ``starts``: one per row of ``prompt_ids`` (B, P).
        ``max_new_tokens``, if given, lowers the episode budget (max_episode_tokens). ``on_finished(rows,
        [ids])`` is told of each episode as it ends, with its last turn's ids. Raises EnvironmentFailed
        with on_failure: error."""
        if starts is None:
            starts = self.starts_for(prompts)
            prompt_ids, prompt_mask = self.encode_prompts(starts, device if device is not None else
                                                          (prompt_ids.device if prompt_ids is not None else "cpu"))
        assert len(starts) == prompt_ids.shape[0]
        budget = min(self.environment.max_episode_tokens, max_new_tokens or self.environment.max_episode_tokens)
        episodes = [Episode(row_ids[row_mask].tolist(), list(start.prompt_messages), budget)
                    for row_ids, row_mask, start in zip(prompt_ids, prompt_mask, starts)]
        # The environments live on an event loop in a thread of its own, for the whole batch (their connections
        # and state last across turns); this thread samples (torch) and does all the tokenizer's work.
        steps = StepRunner()
        environments: list = [None] * len(episodes)
        overlap = steps_overlap_sampling(self.environment, self.factory.environment_class)
        runs = [WaveRun(rows) for rows in waves(len(episodes), overlap)]
        try:
            steps.run(self._reset(episodes, starts, environments))
            policy_logprobs = True
            while any(run.rows for run in runs):
                for run in runs:
                    if run.stepping is not None:  # its steps ran while the other wave sampled
                        self._finish_turn(episodes, run, steps.wait(run.stepping), on_finished)
                    rows = [i for i in run.rows if episodes[i].ended_by is None]
                    if not rows or run.turns == self.environment.max_turns:
                        run.rows = []
                        continue
                    policy_logprobs = self._sample_turn(policy, episodes, rows, run, prompt_ids.device, with_logprobs,
                                                        keep_hidden)
                    run.stepping = steps.submit(self._steps(environments, run.stepped))
        finally:
            steps.stop(self._close(environments))
        return self._assemble(episodes, prompt_ids.device, with_logprobs, keep_hidden, policy_logprobs)

    # --- one turn ---------------------------------------------------------------------------------

    def _turn_budget(self, remaining: int) -> int:
        return remaining if self.max_turn_tokens is None else min(remaining, self.max_turn_tokens)

    def _add_turn(self, episode: Episode, sampled, k: int) -> list[int]:
        """Row ``k`` of the inner sampler's turn into ``episode``, cut to its remaining budget."""
        generation = sampled.generation
        keep = generation.response_mask[k]
        room = episode.remaining
        ids = generation.response_ids[k][keep].tolist()[: self._turn_budget(room)]
        stopped = bool(ids) and ids[-1] == self.stop_token_id
        logprobs = sampled.logprobs[k][keep][: len(ids)].tolist() if sampled.logprobs is not None else None
        hidden = sampled.hidden[k][keep][: len(ids)] if sampled.hidden is not None else None
        episode.add_turn(ids, stopped, logprobs, hidden)
        text = self.tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
        calls = [c.as_message_call() for c in parse_tool_calls(text) if c.error is None]
        episode.messages.append({**assistant_message(text), **({"tool_calls": calls} if calls else {})})
        if not stopped:  # the message is cut: by the episode's budget, or by the turn's
            episode.end("max_episode_tokens" if len(ids) >= room else "max_new_tokens")
        return ids

    async def _reset(self, episodes: list[Episode], starts: list[EpisodeStart], environments: list) -> None:
        async def reset(i: int) -> None:
            episode = episodes[i]
            try:
                environments[i] = self.factory()
                observation = await environments[i].reset(starts[i].row, starts[i].seed)
            except StepFailure as err:
                self._failed(episode, str(err))
                return
            if observation:
                observation = cut_observation(self.tokenizer, observation, self.environment.max_observation_tokens)
                grown = encode(self.tokenizer, render(self.tokenizer, episode.prompt_messages + observation, self.tools, True))
                episode.observation_tokens += max(0, len(grown) - len(episode.prompt_ids))
                episode.prompt_ids = grown
                episode.messages += observation

        await self._bounded([lambda i=i: reset(i) for i in range(len(episodes))])

    def _sample_turn(self, policy, episodes: list[Episode], rows: list[int], run: "WaveRun", device,
                     with_logprobs: bool, keep_hidden: bool) -> bool:
        """One turn of ``rows`` (a wave's running episodes) sampled and added; ``run`` then holds the rows and
        which of them step (an episode whose reset failed ends here: it sampled so that its row has a turn)."""
        sequences, mask = left_pad([episodes[i].sequence for i in rows], self.pad_token_id, device)
        sampled = self.inner.sample(policy, sequences, mask, with_logprobs=with_logprobs, keep_hidden=keep_hidden,
                                    max_new_tokens=self._turn_budget(max(episodes[i].remaining for i in rows)))
        for k, i in enumerate(rows):
            reset_failure = episodes[i].failure  # read first: a turn cut short ends the episode, clearing it
            run.last[i] = self._add_turn(episodes[i], sampled, k)
            if reset_failure is not None:
                episodes[i].end("failed", reset_failure)
        run.turns += 1
        run.sampled = rows
        run.stepped = {i: dict(episodes[i].messages[-1]) for i in rows if episodes[i].ended_by is None}
        return sampled.policy_logprobs

    async def _steps(self, environments: list, messages: dict[int, Message]) -> dict:
        """Each episode's step on its last assistant message, ``max_concurrency`` at once: {row: StepResult
        or the StepFailure}. Only the environments are called here (in the loop's thread); what comes back
        is applied in the sampling thread (_finish_turn)."""
        rows = list(messages)
        results = await gather_bounded([lambda i=i: environments[i].step(messages[i]) for i in rows],
                                       self.environment.max_concurrency)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, StepFailure):  # a bug: not swallowed
                raise result
        return dict(zip(rows, results))

    def _finish_turn(self, episodes: list[Episode], run: "WaveRun", results: dict, on_finished) -> None:
        """A wave's step results applied in row order, then ``on_finished`` told of its episodes that ended."""
        final = run.turns == self.environment.max_turns
        for i, result in results.items():
            self._apply_step(episodes[i], result, final)
        ended = [i for i in run.sampled if episodes[i].ended_by is not None]
        if on_finished is not None and ended:
            on_finished(ended, [run.last[i] for i in ended])
        run.stepping = None

    def _apply_step(self, episode: Episode, result: "StepResult | StepFailure", final: bool) -> None:
        if isinstance(result, StepFailure):
            self._failed(episode, str(result))
            episode.end("failed", str(result))
            return
        episode.tool_calls += result.tool_calls
        episode.tool_errors += result.tool_errors
        episode.add_reward(result.reward)
        observation = cut_observation(self.tokenizer, result.observation, self.environment.max_observation_tokens)
        history = [*episode.prompt_messages, *(assistant_message(m["content"]) if m["role"] == "assistant" else m
                                               for m in episode.messages)]
        episode.messages += observation
        if result.done:
            episode.end("done")
            return
        if final:
            episode.end("max_turns")
            return
        try:
            ids = observation_ids(self.tokenizer, history, observation, self.stop_text, self.tools)
        except TemplateRewrites as err:
            self._failed(episode, f"the chat template rewrote earlier turns: {err}")
            episode.end("failed", episode.failure)
            return
        if len(ids) >= episode.remaining:  # no room for one more sampled token
            episode.end("max_episode_tokens")
            return
        episode.add_observation(ids)

    def _failed(self, episode: Episode, why: str) -> None:
        episode.failure = why
        if self.environment.on_failure == "error":
            raise EnvironmentFailed(f"environment failed: {why}",
                                    hint="with environment.on_failure: skip such episodes leave the update instead")

    async def _bounded(self, jobs: list) -> None:
        for result in await gather_bounded(jobs, self.environment.max_concurrency):
            if isinstance(result, BaseException):  # EnvironmentFailed (on_failure: error) or a bug: not swallowed
                raise result

    async def _close(self, environments: list) -> None:
        async def close(env) -> None:
            try:
                await env.close()
            except StepFailure:
                pass  # the episode is over; a failed goodbye changes nothing in it

        await gather_bounded([lambda e=e: close(e) for e in environments if e is not None], self.environment.max_concurrency)
        await self.factory.aclose()

    # --- the batch ----------------------------------------------------------------------------------

    def _assemble(self, episodes: list[Episode], device, with_logprobs: bool, keep_hidden: bool,
                  policy_logprobs: bool) -> MultiTurnSampled:
        B, T = len(episodes), max(1, max(len(e.token_ids) for e in episodes))
        prompt_ids, prompt_mask = left_pad([e.prompt_ids for e in episodes], self.pad_token_id, device)
        response_ids = torch.full((B, T), self.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((B, T), dtype=torch.bool)
        action_mask = torch.zeros((B, T), dtype=torch.bool)
        logprobs = torch.zeros((B, T)) if with_logprobs else None
        hidden = None
        for b, e in enumerate(episodes):
            n = len(e.token_ids)
            response_ids[b, :n] = torch.tensor(e.token_ids, dtype=torch.long)
            response_mask[b, :n] = True
            action_mask[b, :n] = torch.tensor(e.action, dtype=torch.bool)
            if logprobs is not None:
                logprobs[b, :n] = torch.tensor(e.logprobs)
            for start, states in e.hidden if keep_hidden else ():
                if hidden is None:
                    hidden = torch.zeros((B, T, states.shape[-1]), dtype=states.dtype, device=states.device)
                hidden[b, start:start + states.shape[0]] = states
        finished = torch.tensor([e.finished for e in episodes], dtype=torch.bool)
        generation = Generation(prompt_ids, prompt_mask, response_ids.to(device), response_mask.to(device),
                                finished.to(device), action_mask.to(device))
        records = [EpisodeRecord(e.messages, e.turns, e.tool_calls, e.tool_errors, e.observation_tokens, e.step_reward,
                                 e.ended_by, e.ended_by == "failed", e.failure, _last_response(e.messages))
                   for e in episodes]
        return MultiTurnSampled(generation, logprobs.to(device) if logprobs is not None else None, hidden,
                                policy_logprobs, records)


def _last_response(messages: list[Message]) -> str:
    return next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")

