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


def test_no_critic_answers_for_itself_trains_nothing_and_values_zero():
    import torch

    critic = CRITICS["none"]()
    ac = SimpleNamespace(value_head=None, value_backbone=None)
    assert not critic.trains and not critic.reads_policy_hidden and not critic.features_fixed(ac)
    assert critic.value_parameters(ac) == []  # no optimizer group, nothing for the value loss
    assert critic.default_lr(ac, 1e-3) == 1e-3
    sequences = torch.ones((2, 7), dtype=torch.long)  # 2 rows of prompt and response
    values = critic.values(ac, sequences, torch.ones_like(sequences, dtype=torch.bool), response_len=3)
    assert values.dtype == torch.float32 and values.tolist() == [[0.0] * 3] * 2  # no baseline


def test_a_critic_with_a_head_trains_the_head_then_its_own_parameters():
    head, backbone = nn.Linear(4, 1), nn.Linear(4, 4)
    ac = SimpleNamespace(value_head=head, value_backbone=backbone)
    assert CRITICS["head"]().trains
    assert CRITICS["head"]().value_parameters(ac) == list(head.parameters())
    assert CRITICS["model"]().value_parameters(ac) == [*head.parameters(), *backbone.parameters()]
