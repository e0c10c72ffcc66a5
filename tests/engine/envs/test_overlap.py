"""environment.overlap: two waves, one's steps running while the other samples. Scripted per episode, so
the same episode gets the same turns whatever batch it is sampled in: with overlap it must come out exactly
as without (tokens, masks, log-probs, records), and the waves must really overlap (a handshake, no timing)."""

from __future__ import annotations

import sys

import pytest
import torch

from ppo_cli.engine.envs.environments import EnvironmentFactory
from ppo_cli.engine.envs.metrics import episode_metrics
from ppo_cli.engine.envs.multi_turn import EpisodeStart, MultiTurnSampler, group_reset_seeds, left_pad
from ppo_cli.engine.envs.overlap import steps_overlap_sampling, waves
from ppo_cli.errors import EnvironmentFailed
from ppo_cli.recipe import EnvironmentConfig
from tests.engine.envs.conftest import ScriptedSampler
from tests.engine.envs.test_multi_turn import CALL, MALFORMED, TOOLS, WRONG, ids, stop


class EpisodeScriptedSampler(ScriptedSampler):
    """Answers each row with its episode's next scripted text, the episode found by its prompt (``p<b>``),
    whatever rows a call holds; records the episodes of each call. ``before_call(episodes)`` runs first."""

    def __init__(self, tokenizer, scripts: list[list[str]], before_call=None):
        super().__init__(tokenizer, [])
        self.scripts = [list(s) for s in scripts]
        self.episode_calls: list[list[int]] = []
        self.before_call = before_call

    def episode_of(self, sequence: list[int]) -> int:
        text = self.tokenizer.decode(sequence, skip_special_tokens=False)
        found = [b for b in range(len(self.scripts)) if f"<|im_start|>user\np{b}<|im_end|>" in text]
        assert len(found) == 1, text
        return found[0]

    def sample(self, policy, prompt_ids, prompt_mask, **kwargs):
        episodes = [self.episode_of(row[m].tolist()) for row, m in zip(prompt_ids, prompt_mask)]
        self.episode_calls.append(episodes)
        if self.before_call is not None:
            self.before_call(episodes)
        self.turns = [[self.scripts[b].pop(0) for b in episodes]]
        return super().sample(policy, prompt_ids, prompt_mask, **kwargs)


def run(tokenizer, settings: dict, scripts: list[list[str]], seeds=None, before_call=None, **kwargs):
    environment = EnvironmentConfig.model_validate(settings)
    inner = EpisodeScriptedSampler(tokenizer, scripts, before_call)
    sampler = MultiTurnSampler(inner, EnvironmentFactory(environment), tokenizer, environment, stop(tokenizer),
                               tokenizer.pad_token_id)
    prompts = [f"p{b}" for b in range(len(scripts))]
    messages = [[{"role": "user", "content": p}] for p in prompts]
    rows = [ids(tokenizer, tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)) for m in messages]
    prompt_ids, prompt_mask = left_pad(rows, tokenizer.pad_token_id, "cpu")
    seeds = seeds or [0] * len(prompts)
    starts = [EpisodeStart({"prompt": p}, s, m) for p, s, m in zip(prompts, seeds, messages)]
    return sampler.sample(None, prompt_ids, prompt_mask, starts=starts, **kwargs), inner


def test_waves_are_the_first_half_rounded_up_and_the_rest():
    assert waves(5, overlap=True) == [[0, 1, 2], [3, 4]]
    assert waves(4, overlap=True) == [[0, 1], [2, 3]]
    assert waves(1, overlap=True) == [[0]]  # nothing to overlap with: one wave, as without
    assert waves(5, overlap=False) == [[0, 1, 2, 3, 4]]


class DeclaresSlowSteps:
    slow_steps = True


class DeclaresNothing:
    pass


PYTHON = {"type": "python", "class": "recipes/envs/guess.py:GuessNumber"}
HTTP = {"type": "http", "url": "http://127.0.0.1:8080"}


@pytest.mark.parametrize("settings, environment_class, expected", [
    (PYTHON, DeclaresSlowSteps, True),  # auto: on only where the class declares its steps slow
    (PYTHON, DeclaresNothing, False),
    (HTTP, None, False),
    (TOOLS, None, False),
    ({**PYTHON, "overlap": False}, DeclaresSlowSteps, False),  # true and false decide
    ({**TOOLS, "overlap": True}, None, True),
    ({**HTTP, "overlap": True}, None, True),
])
def test_overlap_auto_is_on_only_for_a_class_declaring_slow_steps(settings, environment_class, expected):
    assert steps_overlap_sampling(EnvironmentConfig.model_validate(settings), environment_class) is expected


def test_overlap_reads_true_false_and_auto_from_the_recipe():
    assert [EnvironmentConfig.model_validate({**TOOLS, **extra}).overlap for extra in
            ({}, {"overlap": "auto"}, {"overlap": True}, {"overlap": False})] == ["auto", "auto", True, False]
    with pytest.raises(ValueError, match="overlap"):
        EnvironmentConfig.model_validate({**TOOLS, "overlap": "sometimes"})


# Five tool episodes of 1 to 3 turns: a valid call, wrong arguments, malformed calls, none.
SCRIPTS = [
    [CALL, "The answer is 84."],
    [WRONG, "It is 84."],
    [MALFORMED, MALFORMED, MALFORMED],
    ["It is 84."],
    [CALL, CALL, "84" + ScriptedSampler.NO_STOP],
]


def test_with_overlap_every_episode_comes_out_exactly_as_without(chatml):
    results, calls, told = {}, {}, {}
    for overlap in (False, True):
        told[overlap] = {}

        def finished(rows, last, seen=told[overlap]):
            for row, row_ids in zip(rows, last):
                assert row not in seen  # each episode is told once, as it ends
                seen[row] = row_ids

        results[overlap], inner = run(chatml, {**TOOLS, "max_turns": 3, "overlap": overlap}, SCRIPTS,
                                      with_logprobs=True, keep_hidden=True, on_finished=finished)
        calls[overlap] = inner.episode_calls
        assert all(script == [] for script in inner.scripts)  # every scripted turn was sampled
    # Without: one batch per turn of every running episode (as before overlap existed). With: the halves
    # [0, 1, 2] and [3, 4] take turns; episode 3 ended after its first turn.
    assert calls[False] == [[0, 1, 2, 3, 4], [0, 1, 2, 4], [2, 4]]
    assert calls[True] == [[0, 1, 2], [3, 4], [0, 1, 2], [4], [2], [4]]
    off, on = results[False], results[True]
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "finished", "action_mask"):
        assert torch.equal(getattr(off.generation, name), getattr(on.generation, name)), name
    assert torch.equal(off.logprobs, on.logprobs) and torch.equal(off.hidden, on.hidden)
    assert off.episodes == on.episodes
    assert told[False] == told[True] and sorted(told[True]) == [0, 1, 2, 3, 4]
    # The records are the ones the scripts call for (valid throughout: action within response, both set).
    assert [r.ended_by for r in on.episodes] == ["done", "done", "max_turns", "done", "max_new_tokens"]
    assert [(r.turns, r.tool_calls, r.tool_errors) for r in on.episodes] == [(2, 1, 0), (2, 1, 1), (3, 3, 3),
                                                                             (1, 0, 0), (3, 2, 0)]
    g = on.generation
    assert (g.action_mask <= g.response_mask).all()
    assert g.finished.tolist() == [True, True, True, True, False]
    assert response_tokens(on, 3) == ids(chatml, "It is 84.") + [stop(chatml)]


def response_tokens(result, b: int) -> list[int]:
    g = result.generation
    return g.response_ids[b][g.response_mask[b]].tolist()


HANDSHAKE = '''
import threading

class Handshake:
    slow_steps = True  # overlap: auto turns on
    stepping = threading.Event()  # a step of wave 1 has begun
    sampled = threading.Event()   # wave 2 was sampled meanwhile
    def reset(self, row, seed):
        return None
    def step(self, message):
        Handshake.stepping.set()
        overlapped = Handshake.sampled.wait(20)
        return {"observation": None, "reward": 1.0 if overlapped else 0.0, "done": True}
'''


def test_one_waves_steps_run_while_the_other_wave_samples(chatml, tmp_path):
    """overlap: auto, on since the class declares slow_steps. Episode 0's step (wave 1) waits until wave 2 has
    been sampled, and wave 2 is sampled only once that step has begun: without overlap the step would wait in
    vain and give reward 0 (nothing is timed)."""
    (tmp_path / "handshake.py").write_text(HANDSHAKE)
    path = f"{tmp_path}/handshake.py"
    module: dict = {}

    def before_call(episodes):
        handshake = module.setdefault("Handshake", next(
            m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == path).Handshake)
        if episodes == [1]:  # wave 2's first turn
            assert handshake.stepping.wait(20)
            handshake.sampled.set()

    result, inner = run(chatml, {"type": "python", "class": f"{path}:Handshake", "timeout_s": 30},
                        [["5"], ["6"]], before_call=before_call)
    assert inner.episode_calls == [[0], [1]]
    assert [(r.ended_by, r.step_reward) for r in result.episodes] == [("done", 1.0), ("done", 1.0)]


def test_with_overlap_a_crashing_step_fails_its_episode_and_is_counted(chatml, envs_file):
    result, _ = run(chatml, {"type": "python", "class": f"{envs_file}:Crashes", "overlap": True}, [["5"], ["6"], ["7"]])
    assert [r.ended_by for r in result.episodes] == ["failed"] * 3
    assert {r.failure for r in result.episodes} == {
        f"environment {envs_file}:Crashes.step raised RuntimeError: the game server fell over"}
    assert episode_metrics(result.episodes)["env/failed_rate"] == 1.0


def test_with_overlap_a_step_past_its_timeout_fails_its_episode(chatml, envs_file):
    result, _ = run(chatml, {"type": "python", "class": f"{envs_file}:Sleeps", "timeout_s": 0.2, "overlap": True},
                    [["5"], ["6"]])
    assert [r.failure for r in result.episodes] == [f"environment {envs_file}:Sleeps.step did not return within 0.2 s"] * 2


def test_with_overlap_on_failure_error_stops_in_one_line_and_closes_every_environment(chatml, envs_file):
    settings = {"type": "python", "class": f"{envs_file}:CrashesOnP3", "on_failure": "error", "overlap": True}
    with pytest.raises(EnvironmentFailed) as info:
        run(chatml, settings, [["1", "1"], ["2", "2"], ["3", "3"], ["4", "4"]])
    assert info.value.message == f"environment failed: environment {envs_file}:CrashesOnP3.step raised RuntimeError: p3's board is gone"
    module = next(m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == envs_file)
    assert sorted(module.CrashesOnP3.closed) == ["p0", "p1", "p2", "p3"]


def test_with_overlap_episodes_keep_their_reset_seeds_and_groups(chatml, envs_file):
    seeds = group_reset_seeds(5, num_prompts=3, num_generations=2)  # [5, 5, 6, 6, 7, 7]
    scripts = [["a", "b"]] * 6
    result, inner = run(chatml, {"type": "python", "class": f"{envs_file}:Seeded", "max_turns": 2, "overlap": True},
                        scripts, seeds=seeds)
    assert inner.episode_calls == [[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4, 5]]
    assert [r.messages[0]["content"] for r in result.episodes] == [f"row p{b}, seed {s}" for b, s in enumerate(seeds)]
    assert [(r.ended_by, r.turns, r.step_reward) for r in result.episodes] == [("max_turns", 2, 1.0)] * 6
