"""The pieces of FSDP support that need no processes: frozen models kept out of sharding, gathered
state dicts cut into the checkpoint's parts, the optimizer format, the FSDP version check."""

import pytest
import torch
from torch import nn

from ppo_cli.checkpoint import keyed_by_parameter_name, without_tied_copies
from ppo_cli.engine.weights import part_of
from ppo_cli.distributed import check_fsdp_version, without_frozen_models
from ppo_cli.errors import UsageError


def _tiny_lm(tied: bool = True):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    return Qwen2ForCausalLM(config)


class _Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.policy = _tiny_lm()
        self.value_head = nn.Linear(8, 1)
        self.ref_model = _tiny_lm().requires_grad_(False)


def test_without_frozen_models_detaches_only_frozen_whole_models_and_puts_them_back():
    holder = _Holder()
    before = [name for name, _ in holder.named_children()]
    with without_frozen_models(holder):
        assert [name for name, _ in holder.named_children()] == ["policy", "value_head"]
        assert not any(name.startswith("ref_model.") for name, _ in holder.named_parameters())
    assert [name for name, _ in holder.named_children()] == before


def test_part_of_names_entries_relative_to_the_prefix():
    state = {"policy.a.weight": 1, "policy_other": 2, "value_head.bias": 3}
    assert part_of(state, "policy.") == {"a.weight": 1}
    assert part_of(state, "value_head.") == {"bias": 3}
    assert part_of(None, "policy.") is None
    # Nothing under the prefix (a frozen whole model, never gathered): None, so savers read the modules.
    assert part_of(state, "value_backbone.") is None


def test_without_tied_copies_drops_the_second_name_of_tied_weights_only():
    tied, untied = _tiny_lm(tied=True), _tiny_lm(tied=False)
    gathered = {name: t.clone() for name, t in untied.state_dict().items()}  # gathered copies share nothing
    assert "lm_head.weight" in gathered
    assert sorted(without_tied_copies(tied, gathered)) == sorted(set(gathered) - {"lm_head.weight"})
    assert sorted(without_tied_copies(untied, gathered)) == sorted(gathered)


def test_keyed_by_parameter_name_tells_fsdp_gathered_optimizer_state_from_torch_state_dict():
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([param])
    param.grad = torch.ones(2)
    optimizer.step()
    assert not keyed_by_parameter_name(optimizer.state_dict())
    named = {"state": {"actor_critic.value_head.weight": optimizer.state_dict()["state"][0]},
             "param_groups": [{"params": ["actor_critic.value_head.weight"], "lr": 1e-3}]}
    assert keyed_by_parameter_name(named)


def test_fsdp1_is_refused_with_the_setting_to_change():
    check_fsdp_version(2)
    with pytest.raises(UsageError) as err:
        check_fsdp_version(1)
    assert err.value.message == "the accelerate config asks for FSDP version 1; ppo_cli supports FSDP2 only"
    assert err.value.hint == "set fsdp_config.fsdp_version: 2 (see recipes/accelerate/fsdp.yaml)"
