"""`ppo train` end to end on the tiny models, through the real CLI: learning, files, recipes."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from ppo_cli.cli import app
from ppo_cli.recipe import MonitorConfig
from ppo_cli.recipe_loading import load_recipe
from tests.conftest import ROOT, tiny_overrides

pytestmark = pytest.mark.slow
runner = CliRunner()


def _train(recipe: str, models: Path, out: Path, *extra_args: str, **sets):
    args = ["train", str(ROOT / "recipes" / recipe)]
    for item in tiny_overrides(models, out, **sets):
        args += ["--set", item]
    result = runner.invoke(app, args + list(extra_args))
    assert result.exit_code == 0, result.output
    return result


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _shipped_components(recipe_path: Path, models: Path) -> list[dict]:
    """A recipe's reward components as shipped, with the reward model read from the tiny models and
    the repository's reward functions found from any working directory."""
    components = []
    for component in yaml.safe_load(recipe_path.read_text())["reward"]["components"]:
        component = dict(component)
        if component["type"] in ("model", "classifier"):
            component["path"] = str(models / "reward")
        elif component["function"].startswith("recipes/"):
            component["function"] = str(ROOT / component["function"])
        components.append(component)
    return components


@pytest.fixture(scope="module")
def demo_run(tiny_models, tmp_path_factory):
    """The demo recipe as shipped (only paths redirected), trained once for the tests below."""
    out = tmp_path_factory.mktemp("runs")
    _train("tiny_sentiment.yaml", tiny_models, out, "--merge",
           **{"reward.components": json.dumps(_shipped_components(ROOT / "recipes/tiny_sentiment.yaml", tiny_models)),
              "data.prompts": ROOT / "recipes/prompts/reviews.txt",
              "data.eval_prompts": ROOT / "recipes/prompts/reviews_eval.txt"})
    return out / "tiny-sentiment"


@pytest.fixture(scope="module")
def demo_aligned_eval(demo_run, tmp_path_factory):
    """`ppo eval aligned` of the demo run with 4 responses per held-out prompt (64 in all): the run's
    own after-number samples each of the 16 prompts once, and one tail draw (a -11 for a review cut
    off) moves that mean by half a point or more. Six trained policies (3 seeds x 2 samplers, AMD EPYC,
    session 45) scored 8.10-9.97 on 16 responses and 8.25-9.43 on 64, EOS rate 86-98%."""
    out = tmp_path_factory.mktemp("demo-eval") / "eval.json"
    result = runner.invoke(app, ["eval", "aligned", "--run", str(demo_run), "--num-samples", "4", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_tiny_recipe_ends_healthy_with_positive_sentences(demo_run, demo_aligned_eval):
    summary = json.loads((demo_run / "summary.json").read_text())
    before, after = summary["before"], summary["after"]
    # Held-out prompts, same seed before and after: the reward and the EOS rate rise ...
    assert after["score"] >= before["score"] + 5.0, summary
    assert after["eos_rate"] > before["eos_rate"], summary
    # ... to near their ceilings (10 and 100%), measured on 4 responses per prompt ...
    assert demo_aligned_eval["num_samples"] == 4 and demo_aligned_eval["num_prompts"] == 16
    assert demo_aligned_eval["reward"]["mean"] >= 8.0, demo_aligned_eval
    assert demo_aligned_eval["eos_rate"] >= 0.85 > before["eos_rate"], demo_aligned_eval
    # ... with sentences, not the 2-5 token answers ("excellent.") the classifier alone pays as much for,
    assert demo_aligned_eval["response_length"] >= 8.0, demo_aligned_eval
    # ... near the reference (nats summed over the response; the mean of the last updates, as one
    # rollout of 32 episodes swings by a nat or two) ...
    metrics = _read_jsonl(demo_run / "metrics.jsonl")
    last = [m["objective/kl"] for m in metrics[-5:]]
    assert sum(last) / len(last) <= 5.0, last
    # ... and without any health warning on the way, from the monitor at its default thresholds.
    assert load_recipe(demo_run / "recipe.yaml").monitor == MonitorConfig()
    assert summary["warnings"] == [], [w["message"] for w in summary["warnings"]]


def test_run_directory_holds_metrics_samples_recipe_and_final(demo_run):
    metrics = _read_jsonl(demo_run / "metrics.jsonl")
    recipe = load_recipe(demo_run / "recipe.yaml")
    assert [m["step"] for m in metrics] == list(range(1, recipe.train.total_updates + 1))
    for name in ("objective/kl", "objective/scores", "objective/rlhf_reward", "objective/non_score_reward",
                 "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg", "val/ratio",
                 "eos_rate", "response_length", "tokens_per_s", "reward/missing_eos_penalty"):
        assert all(name in m for m in metrics), name
    samples = _read_jsonl(demo_run / "samples.jsonl")
    assert {s["step"] for s in samples} >= {1, 10, 20}
    assert set(samples[0]) == {"step", "prompt", "response", "score", "finished"}
    final = demo_run / "final"
    for name in ("adapter_config.json", "adapter_model.safetensors", "critic/value_head.safetensors",
                 "critic/value_adapter/adapter_config.json", "tokenizer.json", "manifest.json", "merged/config.json",
                 "README.md"):
        assert (final / name).exists(), name
    assert "KL to the reference" in (final / "README.md").read_text()  # the demo sets eval_prompts


def test_final_adapter_loads_with_peft_and_merged_model_matches_it(demo_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    info = json.loads((demo_run / "final" / "ppo_cli.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(info["policy_path"])
    adapted = PeftModel.from_pretrained(base, str(demo_run / "final")).eval()
    merged = AutoModelForCausalLM.from_pretrained(demo_run / "final" / "merged").eval()
    ids = torch.tensor([[5, 17, 42, 9, 33]])
    with torch.no_grad():
        base_logits = AutoModelForCausalLM.from_pretrained(info["policy_path"])(ids).logits
        adapted_logits, merged_logits = adapted(ids).logits, merged(ids).logits
    torch.testing.assert_close(merged_logits, adapted_logits, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(adapted_logits, base_logits, atol=1e-3)  # training changed the policy


def test_python_function_reward_from_a_file_trains(tiny_models, tmp_path):
    _train("tiny_function_reward.yaml", tiny_models, tmp_path, **{
        "reward.components": "[{type: function, function: '%s'}]" % (ROOT / "recipes/rewards/short_positive.py:reward"),
        "data.prompts": ROOT / "recipes/prompts/reviews.txt",
        "data.eval_prompts": ROOT / "recipes/prompts/reviews_eval.txt",
    })
    summary = json.loads((tmp_path / "tiny-function-reward" / "summary.json").read_text())
    assert summary["after"]["score"] >= summary["before"]["score"] + 5.0, summary
    assert summary["after"]["eos_rate"] >= 0.8, summary


def _structure_overrides(recipe_path: Path, models: Path) -> dict:
    """Keep a recipe's structure (LoRA, quantization, critic, penalties) but run it tiny and short. A
    recipe whose prompts are one of the repository's datasets (recipes/data/, rows with the columns its
    reward reads) keeps them, and its held-out rows for the evaluation before and after."""
    data = yaml.safe_load(recipe_path.read_text())["data"]
    own_dataset = data["prompts"].startswith("recipes/data/")
    return {
        "reward.components": json.dumps(_shipped_components(recipe_path, models)),
        "data.prompts": ROOT / (data["prompts"] if own_dataset else "recipes/prompts/reviews.txt"),
        "data.eval_prompts": ROOT / (data["eval_prompts"] if own_dataset else "recipes/prompts/reviews_eval.txt"),
        "train.total_updates": 2, "train.save_every": 1, "train.log_every": 1,
        "ppo.rollout_batch_size": 4, "ppo.mini_batch_size": 2, "ppo.micro_batch_size": 2,
        "generation.max_new_tokens": 8, "optim.warmup_steps": 0,
    }


ALL_RECIPES = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if "accelerate" not in p.parts)
# Episodes of several turns need a chat model with a template the environment's replies render in, which
# the tiny review policy is not: each such recipe is trained as shipped by a test of its own.
TRAINED_ELSEWHERE = {"tiny_tools": "tests/integration/test_tiny_tools_learns.py",
                     "smollm2_follow_up": "tests/integration/test_smollm2_follow_up.py"}
RECIPES = [p for p in ALL_RECIPES if "environment" not in (yaml.safe_load(p.read_text()) or {})]


def test_every_recipe_with_an_environment_is_trained_by_a_test_of_its_own():
    with_environment = {p.stem for p in ALL_RECIPES} - {p.stem for p in RECIPES}
    assert with_environment == set(TRAINED_ELSEWHERE)
    assert all((ROOT / test).exists() for test in TRAINED_ELSEWHERE.values())


def test_recipes_exist():
    assert len(RECIPES) >= 4


@pytest.mark.parametrize("recipe_path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_structure_trains_on_the_tiny_models(recipe_path, tiny_models, tmp_path):
    sets = _structure_overrides(recipe_path, tiny_models)
    _train(str(recipe_path.relative_to(ROOT / "recipes")), tiny_models, tmp_path, **sets)
    name = yaml.safe_load(recipe_path.read_text())["name"]
    run = tmp_path / name
    assert len(_read_jsonl(run / "metrics.jsonl")) == 2
    assert (run / "checkpoints" / "step-000001" / "manifest.json").exists()
    assert (run / "final" / "manifest.json").exists()
    evaluation = json.loads((run / "eval.json").read_text())
    assert len(evaluation["before"]["samples"]) == len(evaluation["after"]["samples"]) > 0
