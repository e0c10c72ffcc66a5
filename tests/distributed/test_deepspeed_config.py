"""DeepSpeed settings ppo_cli fills itself (ppo_cli/distributed.py), without deepspeed installed: the
values accelerate's prepare() reads from the plugin's config. tests/integration/test_deepspeed.py
trains with it (scripts/deepspeed_test.sh)."""

from __future__ import annotations

import types

import pytest

from ppo_cli.distributed import configure_deepspeed, deepspeed_batch_settings, mark_accumulation_boundary


def test_batch_sizes_accumulation_and_clipping_come_from_the_recipe():
    assert deepspeed_batch_settings(micro_batch_size=4, world_size=2, max_grad_norm=0.5) == {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 8,
        "gradient_clipping": 0.5,
    }
    assert deepspeed_batch_settings(1, 3, None)["gradient_clipping"] == 0.0  # DeepSpeed: 0 = never clip


def _accelerator(plugin, num_processes=2):
    state = types.SimpleNamespace(deepspeed_plugin=plugin)
    return types.SimpleNamespace(state=state, num_processes=num_processes, gradient_accumulation_steps=4,
                                 gradient_state=types.SimpleNamespace(_set_sync_gradients=None))


def test_the_plugins_auto_values_are_filled_before_prepare():
    # As accelerate 1.15 reads recipes/accelerate/deepspeed_zero2.yaml: sizes "auto", clipping 1.0.
    plugin = types.SimpleNamespace(deepspeed_config={
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0, "zero_optimization": {"stage": 2},
    })
    accelerator = _accelerator(plugin)
    configure_deepspeed(accelerator, micro_batch_size=8, max_grad_norm=None)
    assert plugin.deepspeed_config == {
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
    }
    assert accelerator.gradient_accumulation_steps == 1


def test_without_deepspeed_nothing_changes():
    accelerator = _accelerator(None)
    configure_deepspeed(accelerator, micro_batch_size=8, max_grad_norm=1.0)
    mark_accumulation_boundary(accelerator, False)  # would call None if it touched the gradient state
    assert accelerator.gradient_accumulation_steps == 4


def test_deepspeed_steps_only_after_a_mini_batchs_last_micro_batch():
    flags = []
    accelerator = _accelerator(types.SimpleNamespace(deepspeed_config={}))
    accelerator.gradient_state._set_sync_gradients = flags.append
    for index in range(3):
        mark_accumulation_boundary(accelerator, index == 2)
    assert flags == [False, False, True]


def test_a_zero3_init_flag_is_refused_in_one_line():
    from ppo_cli.distributed import load_models_whole
    from ppo_cli.errors import UsageError

    with pytest.raises(UsageError) as err:
        load_models_whole(types.SimpleNamespace(zero3_init_flag=True))
    assert str(err.value.message).startswith("zero3_init_flag: true in the accelerate config is not supported")
    assert "zero3_init_flag: false" in err.value.hint


def test_a_checkpoint_resumes_only_under_the_launcher_that_wrote_it(tmp_path):
    """DeepSpeed's optimizer shards (deepspeed/) and a torch optimizer state do not stand in for each other."""
    from ppo_cli.checkpoint import check_same_launcher
    from ppo_cli.errors import CheckpointError

    plain, sharded = tmp_path / "step-000002", tmp_path / "ds" / "step-000002"
    plain.mkdir()
    (sharded / "deepspeed").mkdir(parents=True)
    check_same_launcher(plain, deepspeed=False)
    check_same_launcher(sharded, deepspeed=True)
    with pytest.raises(CheckpointError) as err:
        check_same_launcher(sharded, deepspeed=False)
    assert err.value.message == f"{sharded} was saved under DeepSpeed; this run is not launched with DeepSpeed"
    with pytest.raises(CheckpointError) as err:
        check_same_launcher(plain, deepspeed=True)
    assert err.value.message == f"{plain} was saved without DeepSpeed; this run is launched with DeepSpeed"
