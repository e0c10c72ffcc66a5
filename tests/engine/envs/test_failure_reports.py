"""What the commands say when episodes' environments fail: `ppo train`'s stopping line, and the note of
`ppo rollout` and `ppo eval` naming the first failure (a rate alone does not say what to fix)."""

from __future__ import annotations

from types import SimpleNamespace

from ppo_cli import report
from ppo_cli.errors import RESUME
from ppo_cli.evaluation import summarize_rows
from ppo_cli.train_checks import no_reward_error

FAILURE = "environment envs.py:Game.step returned str, not a dict with observation, reward, done"


def episode(failed: bool, failure: str | None = None):
    return SimpleNamespace(failed=failed, failure=failure)


def test_every_environment_failing_names_the_environment_not_the_reward():
    err = no_reward_error(3, ["", FAILURE], [episode(True, FAILURE), episode(True, FAILURE)])
    assert err.message == f"update 3: every episode's environment failed: {FAILURE}"
    assert err.hint == (f"fix the environment (ppo rollout writes each episode's env_failure), then continue with "
                        f"{RESUME} (the checkpoints written so far are intact)")


def test_in_the_first_update_nothing_was_kept_so_the_hint_says_to_start_again():
    err = no_reward_error(1, [FAILURE], [episode(True, FAILURE)])
    assert err.hint == ("fix the environment (ppo rollout writes each episode's env_failure), then run the same "
                        "ppo train again (the run stopped in its first update, so nothing was kept)")
    err = no_reward_error(1, ["reward server http://x: cannot connect"])
    assert err.message == "update 1: no completion got a reward: reward server http://x: cannot connect"
    assert err.hint == ("once the reward answers, run the same ppo train again (the run stopped in its first update, "
                        "so nothing was kept)")
    assert RESUME not in err.hint  # the run directory it would name is gone


def test_a_reward_failure_later_in_the_run_keeps_its_resume_hint():
    err = no_reward_error(4, ["judge: HTTP 500"], [episode(True, FAILURE), episode(False)])  # not every episode failed
    assert err.message == "update 4: no completion got a reward: judge: HTTP 500"
    assert err.hint == f"the checkpoints written so far are intact; once the reward answers again, continue with {RESUME}"


def row(failed: bool, failure: str | None = None) -> dict:
    return {"reward": None if failed else 1.0, "reward_components": {}, "finished": True, "response": "a b",
            "response_tokens": 2, "turns": 1, "tool_calls": 0, "env_failed": failed, "env_failure": failure,
            "ended_by": "failed" if failed else "done"}


def test_eval_summary_counts_failed_environments_and_keeps_the_first_failure():
    summary = summarize_rows([row(False), row(True, FAILURE), row(True, "other")])
    assert summary["env_failed"] == 2 and summary["env_failure"] == FAILURE
    assert summarize_rows([row(False)])["env_failure"] is None


def printed(call) -> list[str]:
    with report.console.capture() as capture:
        call()
    return capture.get().splitlines()


def test_rollout_notes_failed_environments_with_the_first_failure():
    lines = printed(lambda: report.print_rollout("out.jsonl", 4, 2, "base", 3, FAILURE))
    assert lines == ["wrote 4 rows (2 prompts) from base to out.jsonl",
                     f"note: the environment failed in 3 of 4 episodes (env_failed: no reward); the first: {FAILURE}"]
    assert printed(lambda: report.print_rollout("out.jsonl", 4, 2, "base")) == ["wrote 4 rows (2 prompts) from base to out.jsonl"]


def test_eval_with_every_environment_failing_says_so_and_shows_no_nan():
    summary = {"description": "base", "num_prompts": 2, "num_samples": 1, "prompts": "p.jsonl", "seed": 0, "recipe": "r",
               **summarize_rows([row(True, FAILURE), row(True, FAILURE)])}
    lines = printed(lambda: report.print_eval(summary))
    assert f"note: the environment failed in 2 of 2 episodes (env_failed: no reward); the first: {FAILURE}" in lines
    table = "\n".join(lines)
    assert "nan" not in table
    assert any("mean reward" in line and "n/a" in line for line in lines)
    assert any("std reward" in line and "n/a" in line for line in lines)


def test_compare_with_every_environment_failing_says_so_for_each_side_and_shows_no_nan():
    side = {"num_prompts": 2, "num_samples": 1, "prompts": "p.jsonl", "seed": 0, "recipe": "r",
            **summarize_rows([row(True, FAILURE), row(True, FAILURE)])}
    a, b = {**side, "model": "base", "description": "base"}, {**side, "model": "aligned", "description": "aligned"}
    nan = float("nan")
    difference = {"ci95": (nan, nan), "mean_reward_diff": nan, "win_rate_b": nan, "pairs": 0,
                  "bootstrap": {"resamples": 2000}}
    with report.console.capture() as capture:
        report.print_compare(a, b, difference, [])
    lines = capture.get().splitlines()
    note = f"note: the environment failed in 2 of 2 episodes (env_failed: no reward); the first: {FAILURE}"
    assert f"A: {note}" in lines and f"B: {note}" in lines
    assert "nan" not in capture.get()
    assert any("win rate of B" in line and "n/a" in line for line in lines)
    assert any("environment failed" in line and "100%" in line for line in lines)


def test_eval_shows_the_steps_rewards_beside_the_components():
    rows = [{**row(False), "reward": 1.5, "reward_components": {"half": 0.5}, "step_reward": 1.0},
            {**row(False), "reward": 0.5, "reward_components": {"half": 0.5}, "step_reward": None},
            {**row(True, FAILURE), "reward_components": {"half": 0.5}, "step_reward": None}]
    summary = {"description": "base", "num_prompts": 3, "num_samples": 1, "prompts": "p.jsonl", "seed": 0, "recipe": "r",
               **summarize_rows(rows)}
    assert summary["step_reward"] == 0.5  # over the episodes whose environment did not fail
    lines = printed(lambda: report.print_eval(summary))
    assert any("  half " in line and "+0.500" in line for line in lines)
    assert any("  environment steps " in line and "+0.500" in line for line in lines)


def test_eval_and_compare_show_the_share_of_tool_calls_answered_with_an_error():
    """A high tool-call rate means little when the calls fail: the share is a row of its own."""
    calls = [{**row(False), "tool_calls": 2, "tool_errors": 2}, {**row(False), "tool_calls": 2, "tool_errors": 1},
             {**row(False), "tool_calls": 0, "tool_errors": 0}]
    summary = summarize_rows(calls)
    assert summary["tool_error_rate"] == 3 / 4 and summary["tool_call_rate"] == 2 / 3
    assert summarize_rows([row(False)])["tool_error_rate"] is None  # no call: nothing to rate
    shown = {"description": "base", "num_prompts": 3, "num_samples": 1, "prompts": "p.jsonl", "seed": 0, "recipe": "r", **summary}
    assert any("calls answered with an error" in line and "75%" in line for line in printed(lambda: report.print_eval(shown)))
    a = {**shown, "model": "base"}
    b = {**shown, "model": "aligned", "description": "aligned", **summarize_rows([row(False)])}
    difference = {"ci95": (0.0, 0.0), "mean_reward_diff": 0.0, "win_rate_b": 0.5, "pairs": 3, "bootstrap": {"resamples": 2000}}
    lines = printed(lambda: report.print_compare(a, b, difference, []))
    assert any("calls with an error" in line and "75%" in line and "n/a" in line for line in lines)
