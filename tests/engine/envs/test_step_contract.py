"""parse_step: a step's answer against the environment contract, one line for each way it can be wrong."""

from __future__ import annotations

import pytest

from ppo_cli.engine.envs.environments import StepFailure, parse_step

WHERE = "environment envs.py:Game.step"


def test_a_full_answer_and_one_with_only_done_are_read():
    full = parse_step({"observation": "Higher.", "reward": 1, "done": False, "info": {"guess": 3}}, "user", WHERE)
    assert (full.observation, full.reward, full.done) == ([{"role": "user", "content": "Higher."}], 1.0, False)
    bare = parse_step({"done": True}, "user", WHERE)
    assert (bare.observation, bare.reward, bare.done) == ([], None, True)


@pytest.mark.parametrize(
    "answer, message",
    [
        ({"observation": "Higher.", "reward": 0.0},
         "returned no 'done': say whether the episode has ended, true or false"),
        ({"observation": "x", "reward": 1.0, "terminated": True, "truncated": False, "info": {}},
         "returned 'terminated', 'truncated', not one of observation, reward, done (and info, not read); "
         "for gym's terminated and truncated, return done = terminated or truncated"),
        ({"obs": "x", "done": True}, "returned 'obs', not one of observation, reward, done (and info, not read)"),
        ({"done": 1}, "returned done 1, not true or false"),
        ({"reward": "1", "done": True}, "returned reward '1', not a finite number or None"),
        (("x", 1.0, True), "returned tuple, not a dict with observation, reward, done"),
    ],
)
def test_an_answer_outside_the_contract_is_one_line(answer, message):
    with pytest.raises(StepFailure) as info:
        parse_step(answer, "user", WHERE)
    assert str(info.value) == f"{WHERE} {message}"
