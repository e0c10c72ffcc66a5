"""Recipe loading: every bad recipe gives its exact one-line message, located by YAML line or --set."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppo_cli.auto import value_kind
from ppo_cli.errors import EXIT_USAGE, RecipeError
from ppo_cli.recipe import PPOConfig
from ppo_cli.recipe_loading import (
    RecipeValidationError,
    apply_overrides,
    dump_resolved,
    load_recipe,
    load_yaml_with_lines,
)

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = ROOT / "tests" / "fixtures" / "recipes" / "minimal.yaml"
PPO_KEYS = ", ".join(PPOConfig.model_fields)

# The line numbers asserted below are the lines of this text.
BASE = """\
name: demo
policy:
  path: tiny/policy
  lora:
    r: 4
reward:
  components:
    - type: function
      function: rewards.py:length_reward
data:
  prompts: prompts.txt
ppo:
  rollout_batch_size: 8
  mini_batch_size: 4
  micro_batch_size: 2
train:
  total_updates: 2
"""


def write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def variant(tmp_path: Path, old: str, new: str) -> Path:
    assert old in BASE, old
    return write(tmp_path, BASE.replace(old, new, 1))


def error(path: Path, overrides: list[str] | tuple[str, ...] = ()) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    assert "\n" not in info.value.message
    assert info.value.exit_code == EXIT_USAGE
    return info.value


# --- valid recipes ----------------------------------------------------------------------------


def test_load_recipe_base_is_valid(tmp_path):
    recipe = load_recipe(write(tmp_path, BASE))
    assert recipe.name == "demo"
    assert recipe.num_mini_batches == 2
    assert recipe.ppo.grad_accum_steps == 2
    assert value_kind(recipe) == "head"  # auto, no reward model to start a critic from
    assert recipe.run_dir == Path("runs") / "demo"


def test_load_recipe_minimal_fixture_is_valid():
    assert load_recipe(MINIMAL).name == "minimal"


def test_every_shipped_recipe_validates():
    # recipes/accelerate/ holds accelerate launcher configs, not recipes.
    files = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if "accelerate" not in p.parts)
    assert files, "no recipes/**/*.yaml found"
    for path in files:
        load_recipe(path)  # raises RecipeError naming the file and line


def test_dump_resolved_round_trips(tmp_path):
    text = BASE.replace(
        "    r: 4\n", "    r: 4\n    target_modules: [q_proj, v_proj]\n"
    ) + "optim:\n  lr: 3.0e-6\n  max_grad_norm: null\n"
    recipe = load_recipe(
        write(tmp_path, text),
        [
            "ppo.adaptive_kl={target: 6.0}",
            "reward.components.1={type: classifier, path: clf, labels: {positive: 10, negative: -1}}",
            "generation.stop_token=<|end|>",
        ],
    )
    dumped = dump_resolved(recipe)
    again = load_recipe(write(tmp_path, dumped, "resolved.yaml"))
    assert again == recipe
    assert dump_resolved(again) == dumped
    assert "kl_coef: 0.05" in dumped  # defaults are written out


def test_dump_resolved_round_trips_the_minimal_fixture(tmp_path):
    recipe = load_recipe(MINIMAL)
    assert load_recipe(write(tmp_path, dump_resolved(recipe))) == recipe


# --- schema errors, located by line -----------------------------------------------------------


def test_unknown_key_names_line_and_suggests_the_right_key(tmp_path):
    path = variant(tmp_path, "  micro_batch_size: 2\n", "  micro_batch_size: 2\n  kl_coeff: 0.1\n")
    err = error(path)
    assert err.message == f"{path}:16: ppo.kl_coeff: unknown key 'kl_coeff' in ppo"
    assert err.hint == f"did you mean 'kl_coef'? allowed keys: {PPO_KEYS}"


def test_unknown_top_level_key(tmp_path):
    path = variant(tmp_path, "name: demo\n", "name: demo\npolcy: {}\n")
    err = error(path)
    assert err.message == f"{path}:2: polcy: unknown key 'polcy'"
    assert err.hint.startswith("did you mean 'policy'? allowed keys: name, seed, output_dir, policy,")


def test_wrong_type_says_expected_type(tmp_path):
    path = variant(tmp_path, "    r: 4\n", "    r: four\n")
    err = error(path)
    assert err.message == f"{path}:5: policy.lora.r: expected an integer, got 'four'"
    assert err.hint == "`policy.lora.r` takes an integer: LoRA rank."


def test_section_that_is_not_a_mapping(tmp_path):
    path = variant(tmp_path, "train:\n  total_updates: 2\n", "train: 2\n")
    err = error(path)
    assert err.message == f"{path}:16: train: expected a mapping (key: value lines), got 2"


def test_bad_literal_lists_allowed_values(tmp_path):
    path = variant(tmp_path, "  path: tiny/policy\n", "  path: tiny/policy\n  dtype: fp16\n")
    err = error(path)
    assert err.message == f"{path}:4: policy.dtype: invalid value 'fp16'"
    assert err.hint == "allowed values: 'float32', 'bfloat16', 'float16' or 'auto'"


def test_near_miss_literal_suggests_the_value(tmp_path):
    path = variant(tmp_path, "  path: tiny/policy\n", "  path: tiny/policy\n  dtype: bfloat\n")
    assert error(path).hint == "did you mean 'bfloat16'? allowed values: 'float32', 'bfloat16', 'float16' or 'auto'"
    path = variant(tmp_path, "    - type: function\n", "    - type: Model\n")
    assert error(path).hint == "did you mean 'model'? allowed values: 'model', 'classifier', 'function', 'http', 'judge'"


def test_bad_reward_type_lists_allowed_types(tmp_path):
    path = variant(tmp_path, "    - type: function\n", "    - type: python\n")
    err = error(path)
    assert err.message == f"{path}:8: reward.components.0.type: invalid value 'python'"
    assert err.hint == "allowed values: 'model', 'classifier', 'function', 'http', 'judge'"


def test_reward_component_without_type(tmp_path):
    path = variant(tmp_path, "    - type: function\n      function:", "    - function:")
    err = error(path)
    assert err.message == f"{path}:8: reward.components.0.type: missing required key"
    assert err.hint == "add `type:` to this item; allowed values: 'model', 'classifier', 'function', 'http', 'judge'"


def test_error_inside_a_reward_component_has_no_union_tag_in_its_path(tmp_path):
    path = variant(tmp_path, "function: rewards.py:length_reward", "function: rewards.py")
    err = error(path)
    assert err.message == f"{path}:9: reward.components.0.function: invalid value 'rewards.py'"
    assert err.hint.startswith("'package.module:name' or 'path/to/file.py:name'")


def test_missing_required_key_points_at_its_parent(tmp_path):
    path = variant(tmp_path, "  total_updates: 2\n", "  save_every: 5\n")
    err = error(path)
    assert err.message == f"{path}:16: train.total_updates: missing required key"
    assert err.hint == "add `total_updates:` under `train:` — PPO updates (rollout + optimisation rounds)."


def test_missing_required_section(tmp_path):
    path = variant(tmp_path, "data:\n  prompts: prompts.txt\n", "")
    err = error(path)
    assert err.message == f"{path}:1: data: missing required key"
    assert err.hint == "add `data:` at the top level — Where the prompts come from."


def test_number_out_of_range_gives_the_allowed_range(tmp_path):
    path = variant(tmp_path, "ppo:\n", "ppo:\n  gamma: 1.5\n")
    err = error(path)
    assert err.message == f"{path}:13: ppo.gamma: must be <= 1.0, got 1.5"
    assert err.hint == "allowed: 0.0 <= gamma <= 1.0; Discount factor (TRL: gamma)."


def test_batch_sizes_that_do_not_divide(tmp_path):
    path = variant(tmp_path, "  mini_batch_size: 4\n", "  mini_batch_size: 3\n")
    err = error(path)
    assert err.message == f"{path}:14: ppo.mini_batch_size: rollout_batch_size (8) must be a multiple of mini_batch_size (3)"
    path = variant(tmp_path, "  micro_batch_size: 2\n", "  micro_batch_size: 3\n")
    err = error(path)
    assert err.message == f"{path}:15: ppo.micro_batch_size: mini_batch_size (4) must be a multiple of micro_batch_size (3)"
    assert "divides" in err.hint


def test_quantized_policy_without_lora(tmp_path):
    path = variant(tmp_path, "  lora:\n    r: 4\n", "  quantization: 4bit\n")
    err = error(path)
    assert err.message == f"{path}:4: policy.quantization: a 4bit policy cannot be trained without LoRA"
    assert err.hint == "add a `lora:` block under `policy:` (QLoRA) or set `policy.quantization: none`"


def test_value_adapter_without_lora(tmp_path):
    path = variant(tmp_path, "  lora:\n    r: 4\n", "  dtype: float32\n")
    err = error(path, ["value.kind=adapter"])
    assert err.message == "--set value.kind: 'adapter' needs a LoRA policy"


def test_value_train_backbone_not_with_an_adapter_critic(tmp_path):
    err = error(write(tmp_path, BASE), ["value.kind=adapter", "value.train_backbone=true"])
    assert err.message.endswith(
        "--set value.train_backbone: not used with value kind 'adapter' (the value adapter is what trains)"
    )
    assert err.hint == "remove `value.train_backbone`, or set `value.kind: head` or `value.kind: model`"
    assert load_recipe(write(tmp_path, BASE), ["value.kind=head", "value.train_backbone=true"]).value.train_backbone
    assert load_recipe(write(tmp_path, BASE), ["value.kind=model", "value.train_backbone=false"]).value.train_backbone is False


def test_value_init_from_reward_needs_a_reward_model(tmp_path):
    err = error(write(tmp_path, BASE), ["value.init_from=reward"])
    assert err.message.startswith("--set value.init_from: 'reward' needs a reward component of type 'model' or 'classifier' to start from")


def test_auto_value_kind_is_a_separate_model_when_initialised_from_the_reward_model(tmp_path):
    recipe = load_recipe(
        write(tmp_path, BASE), ["value.init_from=reward", "reward.components.1={type: model, path: rm}"]
    )
    assert value_kind(recipe) == "model"


def test_several_errors_first_in_file_order_and_counted(tmp_path):
    text = BASE.replace("    r: 4\n", "    r: four\n").replace("  mini_batch_size: 4\n", "  mini_batch_size: x\n")
    path = write(tmp_path, text + "extra: 1\n")
    err = error(path)
    assert err.message == (
        f"{path}:5: policy.lora.r: expected an integer, got 'four' "
        f"(and 2 more errors; run `ppo validate {path} --all-errors` for all)"
    )
    assert isinstance(err, RecipeValidationError)
    assert [str(p) for p in err.problems] == [
        f"{path}:5: policy.lora.r: expected an integer, got 'four'",
        f"{path}:14: ppo.mini_batch_size: expected an integer, got 'x'",
        f"{path}:18: extra: unknown key 'extra'",
    ]


# --- reading the file ---------------------------------------------------------------------------


def test_yaml_syntax_error_names_its_line(tmp_path):
    path = variant(tmp_path, "  micro_batch_size: 2\n", "   micro_batch_size: 2\n")
    err = error(path)
    assert err.message == f"{path}:15: YAML syntax error: mapping values are not allowed here"
    assert "indentation" in err.hint


def test_unclosed_flow_list_names_where_it_opened(tmp_path):
    path = variant(tmp_path, "  prompts: prompts.txt\n", "  prompts: [a, b\n")
    err = error(path)
    assert err.message == f"{path}:12: YAML syntax error: expected ',' or ']', but got ':'"
    assert err.hint.startswith("while parsing a flow sequence at line 11;")


def test_duplicate_key(tmp_path):
    path = variant(tmp_path, "  rollout_batch_size: 8\n", "  rollout_batch_size: 8\n  rollout_batch_size: 16\n")
    err = error(path)
    assert err.message == f"{path}:14: ppo.rollout_batch_size: duplicate key (first at line 13)"


def test_missing_file_suggests_a_sibling(tmp_path):
    write(tmp_path, BASE, "demo.yaml")
    err = error(tmp_path / "dmeo.yaml")
    assert err.message == f"{tmp_path / 'dmeo.yaml'}: no such recipe file"
    assert err.hint == f"did you mean {tmp_path / 'demo.yaml'}?"


def test_directory_instead_of_file(tmp_path):
    write(tmp_path, BASE, "demo.yaml")
    err = error(tmp_path)
    assert err.message == f"{tmp_path}: is a directory, not a recipe file"
    assert err.hint == "recipes in it: demo.yaml"


def test_non_utf8_file(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(b"name: demo\npolicy:\n  path: caf\xe9\n")
    assert error(path).message == f"{path}:3: not UTF-8 text (byte 0xe9)"


def test_empty_file(tmp_path):
    path = write(tmp_path, "# nothing yet\n")
    assert error(path).message == f"{path}: the recipe is empty"


def test_top_level_must_be_a_mapping(tmp_path):
    path = write(tmp_path, "# a list\n- name: demo\n")
    assert error(path).message == f"{path}:2: the recipe must be a mapping of keys (name:, policy:, ...), not a list"


def test_load_yaml_with_lines_records_keys_and_list_items():
    data, lines = load_yaml_with_lines(BASE)
    assert data["ppo"]["mini_batch_size"] == 4
    assert lines[()] == 1
    assert lines[("ppo", "mini_batch_size")] == 14
    assert lines[("reward", "components", "0")] == 8
    assert lines[("reward", "components", "0", "function")] == 9


# --- --set overrides ------------------------------------------------------------------------------


def test_set_values_are_typed_by_the_schema(tmp_path):
    recipe = load_recipe(write(tmp_path, BASE), ["ppo.kl_coef=0.1", "train.total_updates=5", "optim.lr=1e-5"])
    assert recipe.ppo.kl_coef == 0.1 and type(recipe.ppo.kl_coef) is float
    assert recipe.train.total_updates == 5 and type(recipe.train.total_updates) is int
    assert recipe.optim.lr == 1e-5


def test_set_null_removes_a_section(tmp_path):
    recipe = load_recipe(write(tmp_path, BASE), ["policy.lora=null"])
    assert recipe.policy.lora is None
    assert value_kind(recipe) == "head"


def test_set_a_string_field_keeps_the_text(tmp_path):
    assert load_recipe(write(tmp_path, BASE), ["name=2024"]).name == "2024"


def test_set_into_a_list_item_by_index(tmp_path):
    recipe = load_recipe(write(tmp_path, BASE), ["reward.components.0.weight=2"])
    assert recipe.reward.components[0].weight == 2.0


def test_set_appends_at_the_next_index(tmp_path):
    recipe = load_recipe(
        write(tmp_path, BASE), ["reward.components.1.type=function", "reward.components.1.function=x.py:f"]
    )
    assert [c.function for c in recipe.reward.components] == ["rewards.py:length_reward", "x.py:f"]


def test_set_a_whole_list_as_yaml_flow(tmp_path):
    recipe = load_recipe(write(tmp_path, BASE), ['reward.components=[{type: function, function: "x.py:f"}]'])
    assert recipe.reward.components[0].function == "x.py:f"


def test_set_creates_a_missing_section(tmp_path):
    recipe = load_recipe(write(tmp_path, BASE), ["ppo.adaptive_kl.target=6"])
    assert recipe.ppo.adaptive_kl.target == 6.0


def test_set_does_not_change_the_input_data():
    data = {"ppo": {"kl_coef": 0.1}}
    new, paths = apply_overrides(data, ["ppo.kl_coef=0.2"])
    assert data == {"ppo": {"kl_coef": 0.1}} and new == {"ppo": {"kl_coef": 0.2}}
    assert paths == {("ppo", "kl_coef")}


def test_set_unknown_key_lists_allowed_keys_and_suggests(tmp_path):
    err = error(write(tmp_path, BASE), ["ppo.kl_coeff=0.1"])
    assert err.message == f"--set ppo.kl_coeff=0.1: unknown key 'kl_coeff' in ppo; allowed: {PPO_KEYS}"
    assert err.hint == "did you mean 'kl_coef'?"


def test_set_unknown_key_in_a_reward_component_uses_its_type(tmp_path):
    err = error(write(tmp_path, BASE), ["reward.components.0.functon=x.py:f"])
    assert err.message == (
        "--set reward.components.0.functon=x.py:f: unknown key 'functon' in reward.components.0; "
        "allowed: type, function, weight"
    )
    assert err.hint == "did you mean 'function'?"


def test_set_without_equals_sign(tmp_path):
    err = error(write(tmp_path, BASE), ["ppo.kl_coef"])
    assert err.message == "--set ppo.kl_coef: expected key.path=value"
    assert err.hint == "for example --set ppo.kl_coef=0.1 or --set policy.lora=null"


def test_set_with_an_empty_key_part(tmp_path):
    err = error(write(tmp_path, BASE), ["ppo..kl_coef=1"])
    assert err.message == "--set ppo..kl_coef=1: empty key in 'ppo..kl_coef'"


def test_set_index_out_of_range(tmp_path):
    err = error(write(tmp_path, BASE), ["reward.components.3.weight=2"])
    assert err.message == "--set reward.components.3.weight=2: index 3 is out of range: reward.components has 1 item"
    assert err.hint == "use reward.components.1 to append an item"


def test_set_non_numeric_index(tmp_path):
    err = error(write(tmp_path, BASE), ["reward.components.first.weight=2"])
    assert err.message == (
        "--set reward.components.first.weight=2: reward.components is a list; index it with a number, "
        "e.g. reward.components.0"
    )


def test_set_below_a_single_value(tmp_path):
    err = error(write(tmp_path, BASE), ["ppo.kl_coef.value=2"])
    assert err.message == "--set ppo.kl_coef.value=2: ppo.kl_coef is a single value, not a section"


def test_set_value_that_does_not_validate_is_located_on_the_command_line(tmp_path):
    path = write(tmp_path, BASE)
    err = error(path, ["ppo.kl_coef=abc"])
    assert err.message == "--set ppo.kl_coef: expected a number, got 'abc'"
    assert err.hint.startswith("`ppo.kl_coef` takes a number")


def test_set_invalid_yaml_value(tmp_path):
    err = error(write(tmp_path, BASE), ["reward.components=[{type: function"])
    assert err.message.startswith("--set reward.components=[{type: function: the value is not valid YAML:")


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_every_kl_estimator_of_the_algorithm_can_be_chosen(estimator):
    from ppo_cli.algo.kl import KL_ESTIMATORS

    assert estimator in KL_ESTIMATORS
    recipe = load_recipe(MINIMAL, [f"ppo.kl_estimator={estimator}"])
    assert recipe.ppo.kl_estimator == estimator


def test_rollout_is_clip_and_sleep_mode_need_the_vllm_backend(tmp_path):
    err = error(write(tmp_path, BASE), ["ppo.rollout_is_clip=2.0"])
    assert err.message.endswith("--set ppo.rollout_is_clip: corrects for a separate sampler and has no effect with "
                                "generation.backend 'hf' (the policy samples itself)")
    assert err.hint == "set `generation.backend: vllm` or remove `ppo.rollout_is_clip`"
    err = error(write(tmp_path, BASE), ["generation.vllm_sleep_mode=true"])
    assert err.message.endswith("--set generation.vllm_sleep_mode: only used with generation.backend 'vllm'")
    recipe = load_recipe(write(tmp_path, BASE), ["generation.backend=vllm", "ppo.rollout_is_clip=2.0"])
    assert (recipe.generation.backend, recipe.ppo.rollout_is_clip) == ("vllm", 2.0)
    assert load_recipe(write(tmp_path, BASE)).generation.backend == "hf"  # the default: transformers generate
    assert "generation.backend" in error(write(tmp_path, BASE), ["generation.backend=sglang"]).message


def test_bad_mixed_precision_lists_allowed_values(tmp_path):
    path = variant(tmp_path, "  total_updates: 2\n", "  total_updates: 2\n  mixed_precision: fp8\n")
    err = error(path)
    assert err.message == f"{path}:18: train.mixed_precision: invalid value 'fp8'"
    assert err.hint == "allowed values: 'auto', 'no', 'bf16' or 'fp16'"


def test_mixed_precision_on_half_precision_weights_is_refused_with_the_choice(tmp_path):
    path = variant(tmp_path, "  total_updates: 2\n", "  total_updates: 2\n  mixed_precision: bf16\n")
    path.write_text(path.read_text().replace("  path: tiny/policy\n", "  path: tiny/policy\n  dtype: bfloat16\n"))
    err = error(path)
    assert err.message == (f"{path}:19: train.mixed_precision: 'bf16' autocasts float32 weights, but policy.dtype is "
                           "'bfloat16' (pure half precision already)")
    assert err.hint == ("set `train.mixed_precision: no` to train in pure half precision, or `policy.dtype: float32` "
                        "for mixed precision")


@pytest.mark.parametrize("setting", ["auto", "no"])
def test_pure_bf16_weights_validate_with_mixed_precision_auto_or_no(tmp_path, setting):
    path = variant(tmp_path, "  total_updates: 2\n", f"  total_updates: 2\n  mixed_precision: {setting}\n")
    path.write_text(path.read_text().replace("  path: tiny/policy\n", "  path: tiny/policy\n  dtype: bfloat16\n"))
    recipe = load_recipe(path)
    assert (recipe.policy.dtype, recipe.train.mixed_precision) == ("bfloat16", setting)


ENV_KEYS = ("type, tools, class, kwargs, url, headers, timeout_s, retries, retry_backoff_s, max_turns, "
            "max_episode_tokens, max_observation_tokens, max_concurrency, overlap, tool_call_format, on_failure")


def test_set_environment_class_reaches_the_field_written_class(tmp_path):
    # the field is class_ (a Python keyword), written `class` in a recipe: --set takes the recipe's key
    path = write(tmp_path, BASE + "environment: {type: python, class: a.py:Game}\n")
    recipe = load_recipe(path, ["environment.class=b.py:Other"])
    assert recipe.environment.class_ == "b.py:Other"


def test_set_environment_class_underscore_suggests_class(tmp_path):
    path = write(tmp_path, BASE + "environment: {type: python, class: a.py:Game}\n")
    err = error(path, ["environment.class_=b.py:Other"])
    assert err.message == f"--set environment.class_=b.py:Other: unknown key 'class_' in environment; allowed: {ENV_KEYS}"
    assert err.hint == "did you mean 'class'?"


def test_environment_class_underscore_in_the_file_suggests_class(tmp_path):
    path = write(tmp_path, BASE + "environment: {type: python, class: a.py:Game, class_: b.py:B}\n")
    err = error(path)
    assert err.message.endswith("environment.class_: unknown key 'class_' in environment")
    assert err.hint == f"did you mean 'class'? allowed keys: {ENV_KEYS}"


def test_several_errors_from_set_name_the_validate_line_with_the_same_overrides(tmp_path):
    # the errors are in the overrides: `ppo validate RECIPE --all-errors` alone would list none of them
    path = write(tmp_path, BASE)
    err = error(path, ["ppo.kl_coef=x", "name=my run", "ppo.cliprange=y"])
    assert err.message == (
        "--set name: invalid value 'my run' (and 2 more errors; run "
        f"`ppo validate {path} --set ppo.kl_coef=x --set 'name=my run' --set ppo.cliprange=y --all-errors` for all)"
    )


def test_an_episode_budget_below_one_turn_is_refused_on_its_key(tmp_path):
    path = write(tmp_path, BASE + "environment: {type: tools, tools: ['recipes/tools/calculator.py:calculate']}\n")
    recipe = load_recipe(path, ["environment.max_episode_tokens=32", "generation.max_new_tokens=32"])  # one turn fits
    assert recipe.environment.max_episode_tokens == 32
    err = error(path, ["environment.max_episode_tokens=16", "generation.max_new_tokens=40"])
    assert err.message == ("--set environment.max_episode_tokens: 16 is below generation.max_new_tokens (40): the episode's "
                           "budget would cut its first turn short, and max_new_tokens would never apply")
    assert err.hint == ("raise `environment.max_episode_tokens` to at least 40 (it counts every turn and every environment "
                        "message), or lower `generation.max_new_tokens`")


@pytest.mark.parametrize("text, message, hint", [
    ("ppo:\n  beta: 0.04\n", "ppo.beta: unknown key 'beta' in ppo", "TRL's beta is ppo.kl_coef here"),
    ("ppo:\n  min_p: 0.1\n", "ppo.min_p: unknown key 'min_p' in ppo", "TRL's min_p is generation.min_p here"),
    ("ppo:\n  num_iterations: 1\n", "ppo.num_iterations: unknown key 'num_iterations' in ppo", "TRL's num_iterations is ppo.ppo_epochs here"),
    ("ppo:\n  num_generations: 4\n", "ppo.num_generations: unknown key 'num_generations' in ppo",
     "num_generations is a key of generation: write generation.num_generations"),
    ("scale_rewards: none\n", "scale_rewards: unknown key 'scale_rewards'", "scale_rewards is a key of ppo: write ppo.scale_rewards"),
    ("train:\n  seed: 42\n", "train.seed: unknown key 'seed' in train", "seed is a top-level key: write it without a section"),
    ("ppo:\n  advantage: gspo\n", "ppo.advantage: invalid value 'gspo'",
     "for gspo write advantage: grpo with ratio_level: sequence and loss_aggregation: seq_mean_token_mean (GSPO)"),
    ("ppo:\n  loss_aggregation: bnpo\n", "ppo.loss_aggregation: invalid value 'bnpo'", "TRL's loss_type bnpo is loss_aggregation: token_mean"),
    ("ppo:\n  scale_rewards: false\n", "ppo.scale_rewards: invalid value false", "TRL's scale_rewards false is scale_rewards: none"),
    ("ppo:\n  gradient_accumulation_steps: 4\n", "ppo.gradient_accumulation_steps: unknown key 'gradient_accumulation_steps' in ppo",
     "TRL's gradient_accumulation_steps is ppo.mini_batch_size / ppo.micro_batch_size (set mini_batch_size to "
     "micro_batch_size x gradient_accumulation_steps) here"),
])
def test_a_trl_name_or_a_key_in_the_wrong_section_is_pointed_to_its_recipe_key(tmp_path, text, message, hint):
    """Written as a TRL GRPOConfig user writes it: the hint names the recipe key, before the allowed keys."""
    section = text.partition("\n")[0] + "\n"
    recipe = BASE.replace(section, text) if section in BASE else BASE + text  # the keys join the recipe's section
    err = error(write(tmp_path, recipe))
    assert err.message.endswith(message), err.message
    assert err.hint.startswith(hint + ";"), err.hint


@pytest.mark.parametrize("text, message, hint", [
    ("data:\n  train_batch_size: 64\n", "data.train_batch_size: unknown key 'train_batch_size' in data",
     "verl's data.train_batch_size is ppo.rollout_batch_size (prompts per update and process; verl's counts all GPUs) here"),
    ("actor_rollout_ref:\n  rollout:\n    n: 8\n", "actor_rollout_ref: unknown key 'actor_rollout_ref'",
     "verl's actor_rollout_ref.rollout.n is generation.num_generations here"),
    ("algorithm:\n  kl_ctrl:\n    type: fixed\n    kl_coef: 0.001\n", "algorithm: unknown key 'algorithm'",
     "verl's algorithm.kl_ctrl.kl_coef is ppo.kl_coef here"),  # the deepest name written under it
    ("ppo:\n  n_samples_per_prompt: 4\n", "ppo.n_samples_per_prompt: unknown key 'n_samples_per_prompt' in ppo",
     "OpenRLHF's n_samples_per_prompt is generation.num_generations here"),
    ("ppo:\n  beta: 0.04\n", "ppo.beta: unknown key 'beta' in ppo", "TRL's beta is ppo.kl_coef here"),  # TRL's still
    ("ppo:\n  advantage: group_norm\n", "ppo.advantage: invalid value 'group_norm'", "for group_norm write advantage: grpo"),
    ("ppo:\n  advantage: reinforce_plus_plus_baseline\n", "ppo.advantage: invalid value 'reinforce_plus_plus_baseline'",
     "for reinforce_plus_plus_baseline write advantage: reinforce_pp with generation.num_generations >= 2 (the group "
     "mean is subtracted first)"),
])
def test_a_verl_or_openrlhf_name_is_pointed_to_its_recipe_key(tmp_path, text, message, hint):
    section = text.partition("\n")[0] + "\n"
    recipe = BASE.replace(section, text) if section in BASE else BASE + text
    err = error(write(tmp_path, recipe))
    assert err.message.endswith(message), err.message
    assert err.hint.startswith(hint + ";"), err.hint


@pytest.mark.parametrize("override, hint", [
    ("data.train_batch_size=64",
     "verl's data.train_batch_size is ppo.rollout_batch_size (prompts per update and process; verl's counts all GPUs) here"),
    # verl's and OpenRLHF's train_batch_size are not the same thing: both, not "did you mean 'mini_batch_size'?"
    ("ppo.train_batch_size=8",
     "verl's data.train_batch_size is ppo.rollout_batch_size (prompts per update and process; verl's counts all GPUs) here; "
     "OpenRLHF's train_batch_size is ppo.mini_batch_size (completions per optimizer step and process; OpenRLHF's counts "
     "all GPUs) here"),
    ("actor_rollout_ref.rollout.n=8", "verl's actor_rollout_ref.rollout.n is generation.num_generations here"),
    ("ppo.n=8", "verl's actor_rollout_ref.rollout.n is generation.num_generations here"),
    ("algorithm.kl_ctrl.kl_coef=0.001", "verl's algorithm.kl_ctrl.kl_coef is ppo.kl_coef here"),
    ("algorithm.kl_ctrl.type=fixed", "verl's algorithm.kl_ctrl is ppo.kl_coef (type fixed) and ppo.adaptive_kl (type adaptive) here"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=16",
     "verl's actor_rollout_ref.actor.ppo_mini_batch_size is ppo.mini_batch_size (completions per optimizer step and "
     "process; verl's counts prompts: times rollout.n, over the processes) here"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
     "verl's actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu is ppo.micro_batch_size (completions per forward) here"),
    ("data.max_response_length=512", "verl's data.max_response_length is generation.max_new_tokens here"),
    ("data.max_prompt_length=512",  # verl's path, not TRL's flat max_prompt_length
     "verl's data.max_prompt_length is data.max_prompt_tokens (a longer prompt loses its first tokens, not its row) here"),
    ("algorithm.adv_estimator=grpo", "verl's algorithm.adv_estimator is ppo.advantage (gae, grpo, rloo or reinforce_pp) here"),
    ("trainer.total_training_steps=100", "verl's trainer.total_training_steps is train.total_updates here"),
    ("trainer.total_epochs=3", "verl's trainer.total_epochs is train.total_updates (updates, not passes over the prompts) here"),
    ("actor_rollout_ref.rollout.temperature=0.7", "verl's actor_rollout_ref.rollout.temperature is generation.temperature here"),
    ("ppo.temperature=0.7", "temperature is a key of generation: write generation.temperature"),  # ours, misplaced
    ("ppo.micro_train_batch_size=2", "OpenRLHF's micro_train_batch_size is ppo.micro_batch_size (completions per forward) here"),
    ("ppo.init_kl_coef=0.01", "OpenRLHF's init_kl_coef is ppo.kl_coef here"),
    ("data.input_key=question", "OpenRLHF's input_key is data.field here"),
    ("data.apply_chat_template=true", "OpenRLHF's apply_chat_template is data.chat_template here"),
    ("data.prompt_max_len=256", "OpenRLHF's prompt_max_len is data.max_prompt_tokens here"),
    ("generation.generate_max_len=256", "OpenRLHF's generate_max_len is generation.max_new_tokens here"),
    ("optim.actor_learning_rate=1e-6", "OpenRLHF's actor_learning_rate is optim.lr here"),
])
def test_set_of_a_verl_or_openrlhf_name_points_to_its_recipe_key(tmp_path, override, hint):
    err = error(write(tmp_path, BASE), [override])
    assert err.message.startswith(f"--set {override}: unknown key"), err.message
    assert err.hint == hint


def test_set_of_a_trl_name_points_to_its_recipe_key(tmp_path):
    err = error(write(tmp_path, BASE), ["optim.learning_rate=1e-6"])
    assert err.hint == "TRL's learning_rate is optim.lr here"
    err = error(write(tmp_path, BASE), ["ppo.scale_rewards=true"])  # a --set gives it as text
    assert err.hint.startswith("TRL's scale_rewards true is scale_rewards: group;")
    err = error(write(tmp_path, BASE), ["ppo.kl_coeff=0.1"])  # a typo is still a typo
    assert err.hint == "did you mean 'kl_coef'?"


def test_an_error_on_a_key_set_below_it_on_the_command_line_names_the_set(tmp_path):
    """--set environment.kwargs.tries=3 makes environment.kwargs, which the file does not have: the error is the --set's."""
    path = write(tmp_path, BASE + "environment:\n  type: tools\n  tools: ['recipes/tools/calculator.py:calculate']\n")
    err = error(path, ["environment.kwargs.tries=3"])
    assert err.message == "--set environment.kwargs: only used with type 'python', but the type is 'tools'"
    on_file = write(tmp_path, BASE + "environment:\n  type: tools\n  tools: ['recipes/tools/calculator.py:calculate']\n"
                    "  kwargs: {tries: 2}\n", name="with_kwargs.yaml")
    err = error(on_file, ["environment.kwargs.tries=3"])  # the file has the key: its line
    line = on_file.read_text().splitlines().index("  kwargs: {tries: 2}") + 1
    assert err.message == f"{on_file}:{line}: environment.kwargs: only used with type 'python', but the type is 'tools'"
