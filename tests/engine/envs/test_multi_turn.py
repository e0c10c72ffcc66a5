"""MultiTurnSampler over scripted turns: the exact token sequence, both masks, how episodes end, counts."""

from __future__ import annotations

import random
import time

import pytest
import torch

from ppo_cli.engine.envs.environments import EnvironmentFactory
from ppo_cli.engine.envs.metrics import episode_metrics
from ppo_cli.engine.envs.multi_turn import EpisodeStart, MultiTurnSampler, group_reset_seeds, left_pad
from ppo_cli.errors import EnvironmentFailed
from ppo_cli.recipe import EnvironmentConfig
from tests.engine.envs.conftest import ScriptedSampler

CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "12 * 7"}}</tool_call>'
WRONG = '<tool_call>{"name": "calculate", "arguments": {"expr": "12 * 7"}}</tool_call>'
MALFORMED = '<tool_call>{"name": "calculate", "arguments": </tool_call>'
TOOLS = {"type": "tools", "tools": ["recipes/tools/calculator.py:calculate"]}


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop(tokenizer):
    return tokenizer.convert_tokens_to_ids("<|im_end|>")


def run(tokenizer, settings: dict, turns: list[list[str]], prompts: list[str], seeds=None, **kwargs):
    environment = EnvironmentConfig.model_validate(settings)
    inner = ScriptedSampler(tokenizer, turns)
    sampler = MultiTurnSampler(inner, EnvironmentFactory(environment), tokenizer, environment, stop(tokenizer),
                               tokenizer.pad_token_id)
    messages = [[{"role": "user", "content": p}] for p in prompts]
    rows = [ids(tokenizer, tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)) for m in messages]
    prompt_ids, prompt_mask = left_pad(rows, tokenizer.pad_token_id, "cpu")
    seeds = seeds or [0] * len(prompts)
    starts = [EpisodeStart({"prompt": p}, s, m) for p, s, m in zip(prompts, seeds, messages)]
    return sampler.sample(None, prompt_ids, prompt_mask, starts=starts, **kwargs), inner, rows


def response(result, b):
    g = result.generation
    n = int(g.response_mask[b].sum())
    assert not g.response_mask[b, n:].any()
    return g.response_ids[b, :n].tolist(), g.action_mask[b, :n].tolist()


def test_scripted_tool_episodes_give_the_exact_tokens_masks_and_endings(chatml):
    S = stop(chatml)
    turns = [[CALL, WRONG, MALFORMED, "It is 84."], ["The answer is 84.", "It is 84.", MALFORMED], [MALFORMED]]
    told = []
    result, inner, prompts = run(chatml, {**TOOLS, "max_turns": 3}, turns, ["What is 12 times 7?"] * 4,
                                 with_logprobs=True, keep_hidden=True, on_finished=lambda rows, ids: told.append((rows, ids)))

    def tool_delta(content):
        return ids(chatml, f"\n<|im_start|>tool\n{content}<|im_end|>\n<|im_start|>assistant\n")

    wrong = "error: wrong arguments for tool 'calculate': missing a required argument: 'expression'"
    malformed = "error: malformed tool call: not JSON (Expecting value at character 35)"
    expected = [
        [(ids(chatml, CALL) + [S], True), (tool_delta("84"), False), (ids(chatml, "The answer is 84.") + [S], True)],
        [(ids(chatml, WRONG) + [S], True), (tool_delta(wrong), False), (ids(chatml, "It is 84.") + [S], True)],
        [(ids(chatml, MALFORMED) + [S], True), (tool_delta(malformed), False),
         (ids(chatml, MALFORMED) + [S], True), (tool_delta(malformed), False), (ids(chatml, MALFORMED) + [S], True)],
        [(ids(chatml, "It is 84.") + [S], True)],
    ]
    for b, parts in enumerate(expected):
        tokens, action = response(result, b)
        assert tokens == [t for part, _ in parts for t in part]
        assert action == [trained for part, trained in parts for _ in part]  # holes exactly at the tool's tokens
    g = result.generation
    assert g.response_mask.shape == g.action_mask.shape == result.logprobs.shape
    assert (g.action_mask <= g.response_mask).all()
    # Log-probs and hidden states sit at the policy's tokens, 0 at the environment's.
    assert torch.equal(result.logprobs, torch.where(g.action_mask, -g.response_ids.float() / 1000, 0.0))
    assert torch.equal(result.hidden[..., 0], torch.where(g.action_mask, g.response_ids.float(), 0.0))
    assert torch.equal(g.prompt_ids, left_pad(prompts, chatml.pad_token_id, "cpu")[0])
    assert g.finished.tolist() == [True, True, True, True]

    records = result.episodes
    assert [r.ended_by for r in records] == ["done", "done", "max_turns", "done"]
    assert [(r.turns, r.tool_calls, r.tool_errors) for r in records] == [(2, 1, 0), (2, 1, 1), (3, 3, 3), (1, 0, 0)]
    assert [r.observation_tokens for r in records] == [len(tool_delta("84")), len(tool_delta(wrong)),
                                                       2 * len(tool_delta(malformed)), 0]
    assert records[0].messages == [
        {"role": "assistant", "content": CALL,
         "tool_calls": [{"type": "function", "function": {"name": "calculate", "arguments": {"expression": "12 * 7"}}}]},
        {"role": "tool", "name": "calculate", "content": "84"},
        {"role": "assistant", "content": "The answer is 84."},
    ]
    assert records[2].messages[-1] == {"role": "tool", "content": malformed}  # answered after the last turn: not in the tokens
    assert [r.last_response for r in records] == ["The answer is 84.", "It is 84.", MALFORMED, "It is 84."]
    # Each turn samples the running episodes' whole sequences, at most the largest remaining budget.
    assert [len(rows) for rows, _ in inner.calls] == [4, 3, 1]
    assert inner.calls[1][0][0] == prompts[0] + ids(chatml, CALL) + [S] + tool_delta("84")
    assert inner.calls[0][1] == 256
    assert inner.calls[2][1] == 256 - len(response(result, 2)[0]) + len(ids(chatml, MALFORMED)) + 1
    # Each episode is told as it ends, with its last turn's ids (what the rewards score).
    assert told == [([3], [ids(chatml, "It is 84.") + [S]]),
                    ([0, 1], [ids(chatml, "The answer is 84.") + [S], ids(chatml, "It is 84.") + [S]]),
                    ([2], [ids(chatml, MALFORMED) + [S]])]
    metrics = episode_metrics(records)
    assert metrics["env/turns"] == 2.0 and metrics["env/tool_calls"] == 5 / 4 and metrics["env/tool_errors"] == 1.0
    assert metrics["env/ended_by/done"] == 0.75 and metrics["env/ended_by/max_turns"] == 0.25
    assert metrics["env/failed_rate"] == 0.0


def test_a_turn_cut_by_the_episode_budget_ends_the_episode_unfinished(chatml):
    delta = ids(chatml, "\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>assistant\n")
    first = len(ids(chatml, CALL)) + 1
    budget = first + len(delta) + 3
    result, inner, _ = run(chatml, {**TOOLS, "max_episode_tokens": budget}, [[CALL], ["The answer is 84."]], ["q"])
    tokens, action = response(result, 0)
    assert len(tokens) == budget  # the second turn keeps 3 tokens
    assert tokens[-3:] == ids(chatml, "The answer is 84.")[:3]
    assert inner.calls[1][1] == 3
    assert result.episodes[0].ended_by == "max_episode_tokens"
    assert result.generation.finished.tolist() == [False]


def test_an_observation_that_leaves_no_room_ends_the_episode_before_it(chatml):
    first = len(ids(chatml, CALL)) + 1
    delta = ids(chatml, "\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>assistant\n")
    result, _, _ = run(chatml, {**TOOLS, "max_episode_tokens": first + len(delta)}, [[CALL]], ["q"])
    assert response(result, 0)[0] == ids(chatml, CALL) + [stop(chatml)]
    assert result.episodes[0].ended_by == "max_episode_tokens"
    assert result.episodes[0].messages[-1] == {"role": "tool", "name": "calculate", "content": "84"}
    assert result.generation.finished.tolist() == [True]


def test_a_long_observation_is_cut_in_the_middle(chatml, tmp_path):
    (tmp_path / "echo.py").write_text('def echo(text: str) -> str:\n    """Echo.\n\n    Args:\n        text: What.\n    """\n'
                                      '    return text\n')
    long = "Higher. Lower. " * 20
    call = '<tool_call>{"name": "echo", "arguments": {"text": "' + long + '"}}</tool_call>'
    result, _, _ = run(chatml, {"type": "tools", "tools": [f"{tmp_path}/echo.py:echo"], "max_observation_tokens": 4},
                       [[call], ["ok"]], ["q"])
    said = result.episodes[0].messages[1]["content"]
    full = ids(chatml, long)
    assert said == chatml.decode(full[:2]) + f"\n[... {len(full) - 4} tokens cut ...]\n" + chatml.decode(full[-2:])


GUESS = {"type": "python", "class": "recipes/envs/guess.py:GuessNumber", "kwargs": {"low": 1, "high": 10}}


def test_python_environment_reset_grows_the_prompt_and_a_group_shares_its_number(chatml):
    seed = 7
    number = random.Random(seed).randint(1, 10)
    low = "1" if number != 1 else "2"
    seeds = group_reset_seeds(seed, num_prompts=1, num_generations=2)
    assert seeds == [7, 7]
    result, inner, prompts = run(chatml, GUESS, [[low, str(number)], [str(number)]], ["Guess my number."] * 2, seeds=seeds)
    intro = "I am thinking of a number from 1 to 10. Answer with one number."
    grown = ids(chatml, chatml.apply_chat_template([{"role": "user", "content": "Guess my number."},
                                                    {"role": "user", "content": intro}], tokenize=False,
                                                   add_generation_prompt=True))
    assert inner.calls[0][0] == [grown, grown]
    assert result.generation.prompt_ids[0][result.generation.prompt_mask[0]].tolist() == grown
    first, second = result.episodes
    assert (first.ended_by, first.turns, first.step_reward) == ("done", 2, 1.0)
    assert (second.ended_by, second.turns, second.step_reward) == ("done", 1, 1.0)
    hint = "Higher." if int(low) < number else "Lower."
    assert [m["content"] for m in first.messages] == [intro, low, hint, str(number), "Correct!"]
    assert first.observation_tokens == len(grown) - len(prompts[0]) + len(
        ids(chatml, f"\n<|im_start|>user\n{hint}<|im_end|>\n<|im_start|>assistant\n"))


def test_a_crashing_step_fails_its_episode_and_is_counted(chatml, envs_file):
    result, _, _ = run(chatml, {"type": "python", "class": f"{envs_file}:Crashes"}, [["5", "6"]], ["a", "b"])
    assert [r.ended_by for r in result.episodes] == ["failed", "failed"]
    assert result.episodes[0].failure == f"environment {envs_file}:Crashes.step raised RuntimeError: the game server fell over"
    assert episode_metrics(result.episodes)["env/failed_rate"] == 1.0


@pytest.mark.parametrize("turn", ["5", "5 6 7" + ScriptedSampler.NO_STOP])  # the turn ends, or is cut short
def test_a_failed_reset_still_samples_one_turn_and_fails(chatml, envs_file, turn):
    result, inner, _ = run(chatml, {"type": "python", "class": f"{envs_file}:CrashesAtReset"}, [[turn]], ["a"])
    sampled = ids(chatml, turn.removesuffix(ScriptedSampler.NO_STOP))
    assert len(inner.calls) == 1 and response(result, 0)[0] == sampled + ([] if turn.endswith(ScriptedSampler.NO_STOP) else [stop(chatml)])
    assert result.episodes[0].failure == f"environment {envs_file}:CrashesAtReset.reset raised KeyError: 'board'"
    assert result.episodes[0].ended_by == "failed"


def test_an_answer_outside_the_contract_fails_the_episode(chatml, envs_file):
    result, _, _ = run(chatml, {"type": "python", "class": f"{envs_file}:BadAnswer"}, [["5"]], ["a"])
    assert result.episodes[0].failure == (f"environment {envs_file}:BadAnswer.step gave an observation that is not a string, "
                                          "a list of {role, content} messages or None")


def test_a_step_past_its_timeout_fails_fast(chatml, envs_file):
    started = time.monotonic()
    result, _, _ = run(chatml, {"type": "python", "class": f"{envs_file}:Sleeps", "timeout_s": 0.2}, [["5"]], ["a"])
    assert result.episodes[0].failure == f"environment {envs_file}:Sleeps.step did not return within 0.2 s"
    assert time.monotonic() - started < 3.0


def test_on_failure_error_stops_with_one_line(chatml, envs_file):
    with pytest.raises(EnvironmentFailed) as info:
        run(chatml, {"type": "python", "class": f"{envs_file}:Crashes", "on_failure": "error"}, [["5"]], ["a"])
    assert info.value.message == f"environment failed: environment {envs_file}:Crashes.step raised RuntimeError: the game server fell over"
    assert info.value.hint == "with environment.on_failure: skip such episodes leave the update instead"


def test_async_environment_methods_are_awaited_and_closed(chatml, envs_file):
    import sys

    settings = {"type": "python", "class": f"{envs_file}:Async", "kwargs": {"answer": "Higher."}, "max_turns": 2}
    result, _, _ = run(chatml, settings, [["5", "6"], ["7", "8"]], ["a", "b"], seeds=[3, 4])
    assert [r.messages[0]["content"] for r in result.episodes] == ["row a, seed 3", "row b, seed 4"]
    assert [(r.ended_by, r.step_reward, r.turns) for r in result.episodes] == [("max_turns", 1.0, 2)] * 2
    module = next(m for m in sys.modules.values() if getattr(m, "__file__", None) == envs_file)
    assert len(module.Async.closed) == 2


def test_steps_of_different_episodes_run_at_most_max_concurrency_at_once(chatml, tmp_path):
    (tmp_path / "counted.py").write_text(
        "import asyncio\n"
        "class Counted:\n"
        "    running = 0\n"
        "    most = 0\n"
        "    def reset(self, row, seed):\n"
        "        return None\n"
        "    async def step(self, message):\n"
        "        Counted.running += 1\n"
        "        Counted.most = max(Counted.most, Counted.running)\n"
        "        await asyncio.sleep(0.05)\n"
        "        Counted.running -= 1\n"
        "        return {\"done\": True}\n")
    result, _, _ = run(chatml, {"type": "python", "class": f"{tmp_path}/counted.py:Counted", "max_concurrency": 2},
                       [["1", "2", "3", "4", "5"]], list("abcde"))
    import sys

    module = next(m for m in sys.modules.values() if getattr(m, "__file__", None) == f"{tmp_path}/counted.py")
    assert module.Counted.most == 2
    assert [r.ended_by for r in result.episodes] == ["done"] * 5


def test_an_environment_class_without_reset_and_step_is_refused(tmp_path):
    from ppo_cli.errors import EnvironmentSetupError

    (tmp_path / "half.py").write_text("class Half:\n    def step(self, message):\n        return {}\n")
    with pytest.raises(EnvironmentSetupError, match="is not a class with reset and step$"):
        EnvironmentFactory(EnvironmentConfig.model_validate({"type": "python", "class": f"{tmp_path}/half.py:Half"}))
