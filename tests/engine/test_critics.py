"""What each value.kind says about itself without a model loaded."""

from types import SimpleNamespace

from torch import nn

from ppo_cli.engine.critics import CRITICS


def test_forward_parameters_count_the_network_each_kind_runs_for_its_values():
    backbone = nn.Linear(10, 3)  # 10 * 3 + 3 = 33 parameters
    separate = SimpleNamespace(value_backbone=backbone)
    none = SimpleNamespace(value_backbone=None)
    assert CRITICS["model"]().forward_parameters(separate, policy=1000) == 33
    assert CRITICS["adapter"]().forward_parameters(none, policy=1000) == 1000  # the policy's base, value adapter on
    assert CRITICS["head"]().forward_parameters(none, policy=1000) == 0  # the values come with the policy's forward
    assert CRITICS["none"]().forward_parameters(none, policy=1000) == 0
