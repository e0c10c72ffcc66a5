"""kl_coef 0 without adaptive_kl: the KL weighs nothing and never will, so no reference forward runs
(ppo.uses_reference False, as TRL's beta 0); objective/kl is NaN (not measured), never a 0 that the
kl_zero health rule would read as a reference equal to the policy."""

import math

import pytest
import torch

from ppo_cli.recipe_loading import load_recipe
from ppo_cli.train_setup import init_state
from ppo_cli.trainer import train_step
from tests.conftest import ROOT, tiny_overrides

PROMPTS = ["I think the book was", "The movie was"]
SMALL = {"generation.num_generations": 2, "ppo.rollout_batch_size": 2, "ppo.mini_batch_size": 4,
         "ppo.micro_batch_size": 2, "generation.max_new_tokens": 6, "ppo.max_kl": "null"}


def _recipe(name: str, tmp_path, models=ROOT, **sets):
    return load_recipe(ROOT / "recipes" / name, tiny_overrides(models, tmp_path, **{**SMALL, **sets}))


@pytest.mark.parametrize("sets, uses", [
    ({"ppo.kl_coef": 0.0}, False),
    ({"ppo.kl_coef": 0.0, "ppo.adaptive_kl": "{target: 6.0}"}, True),  # the coefficient may rise from 0
    ({"ppo.kl_coef": 0.01}, True),
])
@pytest.mark.parametrize("name", ["tiny_grpo.yaml", "tiny_sentiment.yaml"])
def test_only_kl_coef_0_without_adaptive_kl_leaves_the_reference_out(name, sets, uses, tmp_path):
    assert _recipe(name, tmp_path, **sets).ppo.uses_reference is uses


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny_grpo.yaml", "tiny_sentiment.yaml"])  # the KL in the loss; in the reward
def test_kl_coef_0_runs_no_reference_forward_and_reports_the_kl_as_not_measured(name, tiny_models, tmp_path, monkeypatch):
    from ppo_cli.engine import engine as engine_module

    calls, original = [], engine_module.reference_logprobs
    monkeypatch.setattr(engine_module, "reference_logprobs", lambda *a, **k: calls.append(1) or original(*a, **k))
    for kl_coef, runs in ((0.0, False), (0.1, True)):
        calls.clear()
        torch.manual_seed(0)
        recipe = _recipe(name, tmp_path / str(kl_coef), tiny_models, **{"ppo.kl_coef": kl_coef})
        metrics, rollout = train_step(init_state(engine_module.load_engine(recipe), PROMPTS * 2))
        assert bool(calls) is runs, (kl_coef, calls)
        assert metrics["skipped"] == 0 and math.isfinite(metrics["loss/policy_avg"])
        if runs:
            assert math.isfinite(metrics["objective/kl"])
            assert ("loss/kl_avg" in metrics) == (name == "tiny_grpo.yaml")
            continue
        assert math.isnan(metrics["objective/kl"])  # not measured, not 0
        assert metrics["objective/non_score_reward"] == 0.0
        assert not rollout.ref_logprobs.any()  # zeros, which nothing read
        assert "loss/kl_avg" not in metrics  # GRPO's KL term is not computed either
