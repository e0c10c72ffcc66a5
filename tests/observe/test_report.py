"""What `ppo train`, `ppo eval` and `ppo compare` print beside their tables."""

from __future__ import annotations

from ppo_cli import report


def eval_summary(kl: float | None) -> dict:
    return {
        "description": "base model", "reward": {"mean": 1.0, "median": 1.0, "std": 0.5, "min": 0.0, "max": 2.0},
        "reward_components": {}, "eos_rate": 0.5, "response_length": 10.0, "kl": kl, "distinct_1": 0.5,
        "distinct_2": 0.6, "num_prompts": 4, "num_samples": 1, "prompts": "prompts.txt", "seed": 0, "recipe": "r",
    }


def printed(summary: dict, **kwargs) -> list[str]:
    with report.console.capture() as capture:
        report.print_eval(summary, **kwargs)
    return capture.get().splitlines()


def test_negative_kl_is_explained_and_a_positive_one_is_not():
    assert report.KL_BELOW_ZERO in printed(eval_summary(-0.02))
    assert report.KL_BELOW_ZERO not in printed(eval_summary(0.02))
    assert report.KL_BELOW_ZERO not in printed(eval_summary(None))


def test_eval_says_when_it_replaced_an_existing_summary():
    assert printed(eval_summary(0.1), out="eval-base.json", replaced=True)[-1] == "wrote eval-base.json (replacing the previous file)"
    assert printed(eval_summary(0.1), out="eval-base.json")[-1] == "wrote eval-base.json"


def test_train_screen_draws_what_a_run_shows_as_plain_lines_off_a_terminal(monkeypatch):
    monkeypatch.setattr(report.console, "_force_terminal", False)  # a log file, as under a job scheduler
    screen = report.TrainScreen()
    warning = {"rule": "eos_stuck", "step": 2, "since": 2, "message": "no response ended", "cause": "c", "fix": "f",
               "value": 0.0}
    with report.console.capture() as capture:
        screen("loading", {"name": "demo", "precision": "float32"})
        screen("start", {"total": 3, "step": 1, "log_every": 2})
        for step in (2, 3):
            screen("update", {"step": step, "objective/scores": 0.5, "eos_rate": 0.25})
        screen("warning", warning)
        screen("end", {})
        screen("resumed", {"checkpoint": "runs/demo/checkpoints/step-000001", "step": 1})
    assert capture.get().splitlines() == [
        "loading models for demo (float32) ...",
        "update 2/3  score +0.50  eos 25%",  # log_every 2: update 3 is drawn on a terminal only
        "warning update 2: no response ended  [eos_stuck]",
        "  likely cause: c",
        "  fix: f",
        "resumed from runs/demo/checkpoints/step-000001 at update 1",
    ]
    assert screen.progress is None  # "end" closed the bar


def train_summary(**extra) -> dict:
    return {"updates": 3, "episodes": 24, "seconds": 12.0, "peak_memory_gb": 5.81, "run_dir": "runs/x", "final_dir": "runs/x/final",
            "before": None, "after": None, **extra}


def test_train_summary_names_the_phase_that_set_the_peak_where_it_was_measured():
    def printed_words(summary):  # the panel wraps its lines at the console's width
        with report.console.capture() as capture:
            report.print_train_summary(summary)
        return " ".join(word for word in capture.get().split() if word not in "│╭╮╰╯─")

    by_phase = {"loading": 3.29, "evaluation before": 3.71, "rollout": 3.89, "update": 5.81, "saving": 3.5}
    assert "peak memory 5.81 GB (in the update)" in printed_words(train_summary(peak_memory_gb_by_phase=by_phase))
    words = printed_words(train_summary())  # on a CPU: not measured by phase
    assert "peak memory 5.81 GB" in words and "(in the" not in words


def test_a_run_shorter_than_the_health_window_does_not_claim_a_clean_bill_of_health():
    def printed(summary):
        with report.console.capture() as capture:
            report.print_train_summary(summary)
        return " ".join(word for word in capture.get().split() if word not in "│╭╮╰╯─")

    assert ("no health warnings, but most rules wait for 10 updates (monitor.window) and this run had 3: only the "
            "ratio and failed-reward checks ran") in printed(train_summary(health_window=10))
    words = printed(train_summary(updates=12, health_window=10))
    assert "no health warnings" in words and "but most rules" not in words
    assert "no health checks (monitor.enabled: false)" in printed(train_summary(health_window=None))


def test_a_held_out_kl_below_zero_is_explained_under_the_before_after_table():
    from ppo_cli.metric_names import HELD_OUT_KL, HELD_OUT_SCORE

    with report.console.capture() as capture:
        report.print_train_summary(train_summary(before={HELD_OUT_SCORE: 0.1, HELD_OUT_KL: 0.0},
                                                 after={HELD_OUT_SCORE: 0.4, HELD_OUT_KL: -0.118}, health_window=10))
    words = " ".join(word for word in capture.get().split() if word not in "│╭╮╰╯─")
    assert "KL to reference 0.000 -0.118 -0.118" in words
    assert "the held-out KL to reference is below zero: it is estimated from the sampled tokens" in words


def test_the_progress_line_leaves_out_a_metric_the_run_does_not_measure():
    """kl_coef 0 skips the reference forward: objective/kl is NaN in metrics.jsonl, and 'kl nan' on the line said nothing."""
    from ppo_cli.report import metrics_line

    measured = {"objective/scores": 0.5, "eos_rate": 0.25, "objective/kl": 1.5, "response_length": 12.0}
    assert metrics_line(measured) == "score +0.50  eos 25%  kl 1.50  len 12.0"
    assert metrics_line({**measured, "objective/kl": float("nan")}) == "score +0.50  eos 25%  len 12.0"
