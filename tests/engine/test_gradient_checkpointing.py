"""train.gradient_checkpointing: the auto rule (plan_checkpointing.py), the recipe key, and the update
it runs: the same weights and losses as without it, with the layers run again in the backward."""

from __future__ import annotations

import pytest

from ppo_cli.plan_checkpointing import CheckpointingChoice, choose_gradient_checkpointing
from ppo_cli.plan_units import Line
from ppo_cli.recipe_loading import RecipeValidationError, load_recipe
from tests.conftest import ROOT, tiny_overrides


def plan_lines(activations: float, weights: float = 0.5, retained: float = 0.0, rollout: float = 0.1) -> list[Line]:
    """A plan's lines with checkpointing off: 0.45 GB of process, the weights, the update's activations
    (and the freed heap they leave), a 0.1 GB logits chunk, a rollout."""
    lines = [Line("policy", "weights", weights, ""), Line("runtime", "process", 0.45, "", "runtime"),
             Line("policy", "activations (update)", activations, "", "update"),
             Line("policy", "logits (update)", 0.1, "", "update"),
             Line("rollout", "KV cache", rollout, "", "rollout")]
    if retained:
        lines.append(Line("runtime", "freed memory kept (update)", retained, "", "update"))
    return lines


def test_auto_is_off_when_the_activations_are_below_another_term():
    choice = choose_gradient_checkpointing("auto", plan_lines(activations=0.3), budget_gb=16.0, budget_source="GPU")
    # 0.45 + 0.5 static + max(0.3 + 0.1 update, 0.1 rollout) = 1.35 GB
    assert choice == CheckpointingChoice("auto", False, "the update's activations, 0.30 GB, are below policy weights "
                                                        "0.50 GB; 1.35 GB fits 16.0 GB (GPU)")


def test_the_heap_fsdps_gathers_leave_is_not_counted_among_the_activations():
    # plan_memory.fsdp_heap_kept: what checkpointing cannot shrink is a term of its own, here the largest
    lines = plan_lines(activations=0.3) + [Line("runtime", "freed heap of the gathers (update)", 0.6, "", "update")]
    choice = choose_gradient_checkpointing("auto", lines, budget_gb=None)
    assert choice.value is False
    assert choice.reason.startswith("the update's activations, 0.30 GB, are below runtime freed heap of the gathers")


def test_auto_is_on_when_the_activations_with_their_freed_heap_are_the_largest_term():
    # 0.3 GB of activations keep 0.66 GB of freed heap resident (2.2 x): 0.96 GB, above the 0.5 GB weights
    choice = choose_gradient_checkpointing("auto", plan_lines(activations=0.3, retained=0.66), budget_gb=None)
    assert choice.value is True
    assert choice.reason == "without it the update's activations would be 0.96 GB, its largest term; next: policy weights 0.50 GB"
    assert choice.describe() == f"gradient checkpointing auto -> on ({choice.reason})"


def test_auto_is_on_when_the_peak_does_not_fit_the_device():
    # the weights are the largest term, but 0.45 + 20 + 0.3 + 0.1 = 20.85 GB does not fit 16
    choice = choose_gradient_checkpointing("auto", plan_lines(activations=0.3, weights=20.0), budget_gb=16.0,
                                           budget_source="GPU")
    assert choice.value is True
    assert choice.reason == "the plan's peak without it, 20.85 GB, does not fit 16.0 GB (GPU)"


@pytest.mark.parametrize("setting", [True, False])
def test_an_explicit_setting_is_kept_whatever_the_plan_says(setting):
    choice = choose_gradient_checkpointing(setting, plan_lines(activations=9.0), budget_gb=1.0)
    assert choice == CheckpointingChoice(setting, setting, "")
    assert choice.describe() == f"gradient checkpointing {'on' if setting else 'off'}"


def tiny_recipe(tmp_path, **sets):
    return load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml", tiny_overrides(tmp_path, tmp_path, **sets))


def test_recipe_takes_auto_true_false_and_defaults_to_auto(tmp_path):
    assert tiny_recipe(tmp_path).train.gradient_checkpointing == "auto"
    assert tiny_recipe(tmp_path, **{"train.gradient_checkpointing": "true"}).train.gradient_checkpointing is True
    assert tiny_recipe(tmp_path, **{"train.gradient_checkpointing": "false"}).train.gradient_checkpointing is False


def test_recipe_rejects_another_value_in_one_line(tmp_path):
    with pytest.raises(RecipeValidationError) as err:
        tiny_recipe(tmp_path, **{"train.gradient_checkpointing": "2"})
    assert str(err.value).splitlines()[0] == (
        "--set train.gradient_checkpointing: gradient_checkpointing must be auto, true or false, not 2")


def test_the_old_policy_key_says_where_it_moved(tmp_path):
    text = (ROOT / "recipes" / "tiny_sentiment.yaml").read_text().replace(
        "policy:\n", "policy:\n  gradient_checkpointing: true\n", 1)
    path = tmp_path / "old.yaml"
    path.write_text(text)
    with pytest.raises(RecipeValidationError) as err:
        load_recipe(path, tiny_overrides(tmp_path, tmp_path))
    assert "policy.gradient_checkpointing is now train.gradient_checkpointing (auto, true or false)" in str(err.value)


# --- the update, with and without it --------------------------------------------------------------

CASES = {
    "lora + value adapter": ("tiny_sentiment.yaml", {}),
    "lora + value head": ("tiny_sentiment.yaml", {"value.kind": "head"}),
    "qlora (4-bit base)": ("tiny_qlora.yaml", {}),
    "full fine-tune + value model": ("tiny_sentiment.yaml", {"policy.lora": "null", "value.kind": "model"}),
}
PROMPTS = ["The movie was", "This phone is", "I think the book was", "Overall"]


def one_update(tiny_models, tmp_path, recipe_name: str, sets: dict, checkpointing: bool):
    """(trained parameters by name, the update's loss metrics, decoder-layer forwards in the update)."""
    import torch

    from ppo_cli.engine.engine import load_engine
    from ppo_cli.train_setup import init_state
    from ppo_cli.trainer import train_step

    small = {"ppo.rollout_batch_size": 4, "ppo.mini_batch_size": 4, "ppo.micro_batch_size": 2, "ppo.ppo_epochs": 1,
             "generation.max_new_tokens": 8, "train.gradient_checkpointing": str(checkpointing).lower()}
    recipe = load_recipe(ROOT / "recipes" / recipe_name,
                         tiny_overrides(tiny_models, tmp_path, float32=True, **{**small, **sets}))
    torch.manual_seed(0)
    engine = load_engine(recipe, torch.device("cpu"), "no", gradient_checkpointing=checkpointing)
    policy = engine.actor_critic.policy
    flagged = [m for m in policy.modules() if getattr(m, "gradient_checkpointing", False) is True]
    assert bool(flagged) is checkpointing
    calls = []
    layer = next(m for m in policy.modules() if type(m).__name__.endswith("DecoderLayer"))
    # The recompute runs the layer's modules' forward again, without their hooks (measured, torch 2.13):
    # count the calls of one module's forward itself.
    mlp_forward = layer.mlp.forward
    layer.mlp.forward = lambda *args, **kwargs: (calls.append(torch.is_grad_enabled()), mlp_forward(*args, **kwargs))[1]
    torch.manual_seed(1)
    metrics, _ = train_step(init_state(engine, PROMPTS))
    trained = {n: p.detach().clone() for n, p in engine.actor_critic.named_parameters() if p.requires_grad}
    losses = {k: v for k, v in metrics.items() if k.startswith("loss/")}
    return trained, losses, calls


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_one_update_is_the_same_with_and_without_checkpointing(tiny_models, tmp_path, case):
    import torch

    recipe_name, sets = CASES[case]
    plain, plain_losses, plain_calls = one_update(tiny_models, tmp_path / "off", recipe_name, sets, False)
    ckpt, ckpt_losses, ckpt_calls = one_update(tiny_models, tmp_path / "on", recipe_name, sets, True)
    # Checkpointed, each grad-enabled forward of a layer runs once more in the backward (the recompute):
    # the value adapter's forward too, under its own adapter (ActorCritic.recompute_under_the_forwards_adapter).
    assert ckpt_calls.count(True) == 2 * plain_calls.count(True) > 0
    assert plain_losses and plain_losses.keys() == ckpt_losses.keys()
    for key in plain_losses:
        assert ckpt_losses[key] == pytest.approx(plain_losses[key], abs=1e-6), key
    assert plain.keys() == ckpt.keys()
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=0, atol=1e-6, msg=name)


# --- the glibc heap tuning's rule (engine/malloc.py tuning_fits) -----------------------------------


def test_heap_tuning_stays_on_while_the_planned_peak_and_its_extra_leave_a_fifth_free():
    from ppo_cli.engine.malloc import tuning_fits

    # 8 GB planned x 1.1 = 8.8 GB <= 0.8 x 11 = 8.8 GB available: on; at 10.9 GB available it is not
    assert tuning_fits(8.0, 11.0) == (True, "heap tuning on (planned 8.00 GB + 10% <= 80% of 11.0 GB available)")
    assert tuning_fits(8.0, 10.9) == (False, "heap tuning off (planned 8.00 GB + 10% > 80% of 10.9 GB available)")
    assert tuning_fits(None, 64.0)[0] is False and tuning_fits(1.0, None)[0] is False


@pytest.mark.slow
@pytest.mark.parametrize(("checkpointing", "mapped"), [("true", True), ("false", False)])
def test_a_checkpointed_run_maps_its_large_blocks_where_they_get_huge_pages(tiny_models, tmp_path, monkeypatch,
                                                                            checkpointing, mapped):
    """`ppo train`'s first line says which heap it runs with: mapped (engine/malloc.heap_mapped; no
    memory to agree to, so no rule) where the update is checkpointed, else the tuning's rule."""
    from ppo_cli import plan_memory
    from ppo_cli.commands.plan import planned_choices

    monkeypatch.setattr(plan_memory, "large_blocks_on_huge_pages", lambda: True)
    recipe = load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml",
                         tiny_overrides(tiny_models, tmp_path, **{"train.gradient_checkpointing": checkpointing}))
    choices = planned_choices(recipe, "cpu", "no")
    assert choices.heap_tuning is True
    if mapped:
        assert choices.heap_reason == "heap: blocks of 2 MiB or more mapped on huge pages, freed at once"
    else:
        assert choices.heap_reason.startswith("heap tuning on (planned ")
