"""Held-out evaluation, one piece of code for `ppo rollout`, `ppo eval`, `ppo compare` and the before
/ after numbers of `ppo train`: sample rows (``sample_rows``), score them with the recipe's reward
(``score_rows``), summarise them (``summarize_rows``).

Same model, prompts, seed and settings -> the same responses: prompts repeated ``num_samples`` times,
split into batches of ``batch_size``, torch seeded once with ``seed`` before the first batch (the
caller's random state is left as it was). The batch size is part of what is sampled: it sets the
padding and how many random numbers each sampling step draws, so batches of 4 and of 12 give different
responses from the same seed. Every path therefore defaults to one rule (``recipe_sampling``: batches of
ppo.rollout_batch_size), and `ppo compare`'s base row is what `ppo train` measured before training.
Scoring all rows in one RewardStack.score call makes rollout -> score give the numbers eval gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ppo_cli.metric_names import (
    HELD_OUT_EOS_RATE, HELD_OUT_KL, HELD_OUT_RESPONSE_LENGTH, HELD_OUT_REWARD_FAILED, HELD_OUT_SCORE,
)
from ppo_cli.model_refs import ResolvedModel
from ppo_cli.recipe import Recipe

Progress = Callable[[int], None]  # called with the number of rows just finished


@dataclass(frozen=True)
class SamplingSettings:
    seed: int
    num_samples: int = 1  # responses per prompt
    batch_size: int = 16  # prompts per generate() call


def recipe_sampling(recipe: Recipe, seed: int, num_samples: int = 1, batch_size: int | None = None) -> SamplingSettings:
    """Sampling settings for ``recipe``: ``batch_size`` rows per generate() call, by default the recipe's
    ppo.rollout_batch_size; `ppo train`'s held-out evaluation and `ppo rollout / eval / compare` all
    take it from here, so the same seed and prompts give them the same responses."""
    return SamplingSettings(seed, num_samples, batch_size or recipe.ppo.rollout_batch_size)


def generation_settings(recipe: Recipe) -> dict:
    """The sampling settings a row records, so a rollout file says how it was made."""
    gen = recipe.generation
    return {"backend": gen.backend, "max_new_tokens": gen.max_new_tokens, "temperature": gen.temperature, "top_k": gen.top_k,
            "top_p": gen.top_p, "min_p": gen.min_p, "stop_token": gen.stop_token, "chat_template": recipe.data.chat_template,
            "system_prompt": recipe.data.system_prompt, "max_prompt_tokens": recipe.data.max_prompt_tokens}


def model_path(model: ResolvedModel) -> str:
    """The directory a row names as its model: the adapter's, else the weights'."""
    return str(model.adapter_dir) if model.adapter_dir is not None else model.weights_path


def sample_rows(engine, model: ResolvedModel | None, prompts: list[str], settings: SamplingSettings, *,
                with_kl: bool = False, with_tokens: bool = False, progress: Progress | None = None) -> list[dict]:
    """Sample ``settings.num_samples`` responses per prompt; one row dict per (prompt, sample), naming
    ``model`` when given (a rollouts file says which model wrote it).

    With ``with_kl`` each row also gets ``kl``: sum over its response tokens of the k1 estimate
    log pi(y_t) - log pi_ref(y_t), from the same log-prob code as training. With ``with_tokens`` each row
    also gets exactly what training would see (``token_fields``): ``token_ids``, ``loss_mask`` and ``logprobs``.
    """
    import torch

    episodes = [(i, s, p) for i, p in enumerate(prompts) for s in range(settings.num_samples)]
    common = {"seed": settings.seed, "generation": generation_settings(engine.recipe)}
    if model is not None:
        common = {"model": model.reference, "model_path": model_path(model), **common}
    rows: list[dict] = []
    with torch.random.fork_rng(devices=[]):  # training goes on with the random state it had
        torch.manual_seed(settings.seed)
        for start in range(0, len(episodes), settings.batch_size):
            batch = episodes[start : start + settings.batch_size]
            sampled = engine.sample([p for _, _, p in batch])
            generation, records = sampled.generation, getattr(sampled, "episodes", None)
            responses = (engine.decode_responses(generation) if records is None
                         else [e.last_response for e in records])
            logprobs = ref_logprobs = None
            if with_kl or with_tokens:  # the training forward's log-probs, on the policy's tokens only
                logprobs, ref_logprobs, _, _ = engine.evaluate_logprobs_and_values(generation, engine.recipe.ppo.micro_batch_size)
            kl = sequence_kl(logprobs, ref_logprobs, generation).tolist() if with_kl else None
            prompt_tokens = generation.prompt_mask.sum(dim=1).tolist()
            response_tokens = generation.response_lengths.tolist()
            for j, (index, sample, prompt) in enumerate(batch):
                row = {"prompt": prompt, "response": responses[j], "finished": bool(generation.finished[j]),
                       "prompt_tokens": int(prompt_tokens[j]), "response_tokens": int(response_tokens[j]),
                       "prompt_index": index, "sample": sample, **common}
                if kl is not None:
                    row["kl"] = float(kl[j])
                if records is not None:
                    row.update(episode_fields(records[j]))
                if with_tokens:
                    row.update(token_fields(generation, logprobs, j))
                rows.append(row)
            if progress is not None:
                progress(len(batch))
    return rows


def episode_fields(episode) -> dict:
    """What a row records of an episode of several turns (envs.multi_turn.EpisodeRecord): its transcript
    after the prompt, turns, tool calls and errors, how it ended, its steps' reward and whether its
    environment failed (then it has no reward)."""
    return {"messages": episode.messages, "turns": episode.turns, "tool_calls": episode.tool_calls,
            "tool_errors": episode.tool_errors, "ended_by": episode.ended_by, "step_reward": episode.step_reward,
            "env_failed": episode.failed, "env_failure": episode.failure}


def token_fields(generation, logprobs, row: int) -> dict:
    """One row's whole sequence as training sees it: ``token_ids`` (the prompt's and every token after it:
    the policy's and the environment's, no padding), ``loss_mask`` (one 0/1 per id: 1 where the policy
    sampled the token and it is trained) and ``logprobs`` (one per id: the policy's log-prob of the token
    at the sampling temperature where loss_mask is 1, else 0)."""
    prompt = generation.prompt_ids[row][generation.prompt_mask[row]].tolist()
    real = generation.response_mask[row]
    response = generation.response_ids[row][real].tolist()
    action = generation.action_mask[row][real]
    trained = [int(a) for a in action.tolist()]
    values = logprobs[row][real].masked_fill(~action, 0.0).tolist()
    return {"token_ids": prompt + response, "loss_mask": [0] * len(prompt) + trained,
            "logprobs": [0.0] * len(prompt) + [float(v) for v in values]}


def sequence_kl(logprobs, ref_logprobs, generation):
    """(B,) KL to the reference per response: sum_t k1_t over the policy's tokens (action mask), from the
    rollout forward's log-probs and reference log-probs (B, T)."""
    from ppo_cli.algo.kl import kl_penalty

    kl = kl_penalty(logprobs, ref_logprobs, "k1").masked_fill(~generation.action_mask, 0.0)  # (B, T)
    return kl.sum(dim=1)


def score_rows(reward, rows: list[dict], failures: list[str] | None = None) -> list[dict]:
    """Copies of ``rows`` with ``reward`` (the total) and ``reward_components`` (name -> value,
    penalties as negative numbers) from one RewardStack.score call over all rows.

    A row a component failed to score has null there and as its reward. With ``failures`` (a list)
    the failure lines are appended to it and the caller decides; without, a call where no row got a
    reward raises RewardServerError naming what the server or judge answered."""

    if not rows:
        return []
    prompts = [r["prompt"] for r in rows]
    columns = None
    if "messages" in rows[0]:  # episodes of several turns: the reward functions may read the transcripts
        reads = any(getattr(scorer, "reads_columns", False) for _, _, scorer in reward.scorers)
        columns = {**(reward.columns_for(prompts) if reads else {}), "messages": [r.get("messages") for r in rows]}
    result = reward.score(
        prompts,
        [r["response"] for r in rows],
        [bool(r.get("finished", True)) for r in rows],
        [int(r.get("response_tokens", 0)) for r in rows],
        columns=columns,
    )
    if failures is not None:
        failures.extend(str(f) for f in result.failures.values() if f)
    elif not any(result.scored):
        raise no_row_scored(next(iter(result.failures.values())))
    return [
        {**row, "reward": _episode_total(row, _number(total)),
         "reward_components": {name: _number(values[i]) for name, values in result.components.items()}}
        for i, (row, total) in enumerate(zip(rows, result.scores))
    ]


def _episode_total(row: dict, total: float | None) -> float | None:
    """An episode's reward, as training counts it: the components' total plus its steps' rewards; none
    when its environment failed. A row of one turn: the total."""
    if row.get("env_failed") or total is None:
        return None if row.get("env_failed") else total
    return total + (row.get("step_reward") or 0.0)


def _number(value) -> float | None:
    return None if value is None else float(value)


def scored_mean(values: list) -> float:
    """The mean of the values that are not None (the rows a reward failed to score are left out)."""
    from ppo_cli.stats import mean

    return mean([v for v in values if v is not None])


def summarize_rows(rows: list[dict]) -> dict:
    """Metrics of scored rows (each with reward, reward_components, finished, response, response_tokens, kl)."""
    from ppo_cli.stats import distinct_n, mean, summarize

    rewards = [r["reward"] for r in rows if r["reward"] is not None]  # rows a reward failed to score: counted apart
    names = list(rows[0]["reward_components"]) if rows else []
    return {
        "reward": summarize(rewards),
        "reward_failed": len(rows) - len(rewards),
        "reward_components": {n: scored_mean([r["reward_components"][n] for r in rows]) for n in names},
        "eos_rate": mean([1.0 if r["finished"] else 0.0 for r in rows]),
        "response_length": mean([float(r["response_tokens"]) for r in rows]),
        "kl": mean([r["kl"] for r in rows]) if rows and "kl" in rows[0] else None,
        "distinct_1": distinct_n([r["response"] for r in rows], 1),
        "distinct_2": distinct_n([r["response"] for r in rows], 2),
        **(_episode_summary(rows) if rows and "turns" in rows[0] else {}),
    }


def no_row_scored(failure) -> Exception:
    from ppo_cli.errors import RewardServerError

    return RewardServerError(f"no row got a reward: {failure}", hint="check that the reward server or judge answers, then run again")


def no_held_out_reward(rows: list[dict], failures: list[str], before: bool) -> Exception:
    """Why no held-out row got a reward: every episode's environment failed (the fix is there), or the
    reward did; and what to do then, before the first update (nothing kept) or after the last one."""
    from ppo_cli.errors import RESUME, RewardServerError

    then = ("run the same ppo train again (the run stopped before its first update, so nothing was kept)" if before
            else f"continue with {RESUME} (the checkpoints written so far are intact)")
    failed, first_env_failure = env_failures(rows)
    if failed == len(rows):
        return RewardServerError(
            f"no held-out episode got a reward: every episode's environment failed: {first_env_failure or 'no failure line'}",
            hint=f"fix the environment (ppo rollout writes each episode's env_failure), then {then}")
    return RewardServerError(f"no held-out prompt got a reward: {failures[0] if failures else 'every reward failed'}",
                             hint=f"check the reward (a server or judge that does not answer, functions that return None), then {then}")


def env_failures(rows: list[dict]) -> tuple[int, str | None]:
    """How many episodes' environments failed, and the first one's failure (None: none said why)."""
    failed = [r for r in rows if r.get("env_failed")]
    return len(failed), next((r["env_failure"] for r in failed if r.get("env_failure")), None)


def mean_step_reward(rows: list[dict]) -> float:
    """The episodes' own step rewards (the part of their reward no component gives), over those whose
    environment ran."""
    return scored_mean([r.get("step_reward") or 0.0 for r in rows if not r.get("env_failed")])


def tool_error_rate(rows: list[dict]) -> float | None:
    """The share of the rows' tool calls answered with an error (None: no call): a high tool-call rate
    means little if the calls fail."""
    calls = sum(r.get("tool_calls") or 0 for r in rows)
    return sum(r.get("tool_errors") or 0 for r in rows) / calls if calls else None


def _episode_summary(rows: list[dict]) -> dict:
    """Episodes of several turns: mean turns and tool calls, the share that called a tool, the share of
    the calls answered with an error, the shares ended each way and whose environment failed."""
    from ppo_cli.engine.envs.episode import ENDED_BY
    from ppo_cli.stats import mean

    failed, first_failure = env_failures(rows)
    return {"turns": mean([float(r["turns"]) for r in rows]),
            "tool_calls": mean([float(r["tool_calls"]) for r in rows]),
            "tool_call_rate": mean([1.0 if r["tool_calls"] else 0.0 for r in rows]),
            "tool_error_rate": tool_error_rate(rows),
            "env_failed_rate": mean([1.0 if r["env_failed"] else 0.0 for r in rows]),
            "env_failed": failed,
            "step_reward": mean_step_reward(rows),
            "env_failure": first_failure,
            "ended_by": {reason: mean([1.0 if r["ended_by"] == reason else 0.0 for r in rows])
                         for reason in ENDED_BY}}


def share_of(items: list, rank: int, world_size: int) -> list:
    """Process ``rank``'s contiguous share of ``items`` (sizes differ by at most one, possibly empty):
    concatenated in rank order, the shares are ``items``."""
    per, extra = divmod(len(items), world_size)
    start = rank * per + min(rank, extra)
    return items[start:start + per + (1 if rank < extra else 0)]


def held_out(engine, prompts: list[str], seed: int, dist=None, *, before: bool = False) -> dict | None:
    """`ppo train`'s before / after numbers: mean score, EOS rate, length and KL to the reference
    (summed over each response) on the held-out prompts, one response each, sampled with a fixed seed
    and scored by the training engine's reward, as `ppo eval` samples and scores.

    Collective with ``dist``: every process samples its share of the prompts (share_of) in batches of
    ppo.rollout_batch_size with the seed plus its rank, so one process samples exactly what `ppo eval` and
    `ppo compare` sample from the same model with the recipe's seed (their default batch size); the main process
    gets every prompt's result in the prompts' order, the others None. Under FSDP or ZeRO-3 call it
    inside ``dist.full_parameters``: generation then needs no communication. ``before``: the evaluation
    before the first update (a run that stops there keeps nothing, so the fix is to start it again)."""
    rank, world_size = (dist.rank, dist.world_size) if dist is not None else (0, 1)
    share = share_of(prompts, rank, world_size)
    settings = recipe_sampling(engine.recipe, seed + rank)
    failures: list[str] = []  # a share without any reward must not stop one process alone: decided after the gather
    rows = score_rows(engine.reward, sample_rows(engine, None, share, settings, with_kl=True), failures)
    if not share:  # fewer prompts than processes: a sharded reward model still needs this one's forwards
        engine.reward.take_part_without_rows()
    if world_size > 1:
        parts = dist.gather_objects((rows, failures))
        if not dist.is_main:
            return None
        rows = [row for part, _ in parts for row in part]
        failures = [f for _, part in parts for f in part]
    if rows and all(r["reward"] is None for r in rows):
        raise no_held_out_reward(rows, failures, before)
    summary = summarize_rows(rows)
    return {
        HELD_OUT_SCORE: summary["reward"]["mean"], HELD_OUT_REWARD_FAILED: summary["reward_failed"],
        HELD_OUT_EOS_RATE: summary["eos_rate"], HELD_OUT_RESPONSE_LENGTH: summary["response_length"], HELD_OUT_KL: summary["kl"],
        "samples": [{"prompt": r["prompt"], "response": r["response"], "score": r["reward"], "finished": r["finished"]}
                    for r in rows],
    }
