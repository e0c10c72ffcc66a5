"""One forward per distinct prompt (engine/shared_prompts.py): the packed layout by hand, the cost model's
choice by hand, and on every architecture of the matrix the same hidden states, log-probs and gradients
as the plain batch."""

from __future__ import annotations

import pytest
import torch

from ppo_cli.engine import shared_prompts
from ppo_cli.engine.logprobs import response_hidden, response_logprobs
from ppo_cli.engine.shared_prompts import (completions_per_row, pack, prompt_groups, rank_in_group, shared_layout,
                                          shared_prefill)
from tests.fixtures.architectures import FAMILIES

# float32, the plain batch against the packed one: other matmul shapes, the same sums. Measured on the
# matrix, hidden states and log-probs agree to 4e-7 of their largest magnitude.
# Each weight's gradient (relative Frobenius norm) differs by up to 5.4e-6 (GPT-NeoX), which is float32's
# own noise here: against a float64 forward the plain batch's gradients are up to 5.7e-6 off (OPT), the
# packed batch's 5.9e-6.
HIDDEN_PARITY = 1e-6
GRADIENT_PARITY = 1e-5


def test_rank_in_group_counts_each_groups_rows_in_order():
    assert rank_in_group(torch.tensor([2, 0, 2, 1, 0, 2])).tolist() == [0, 0, 1, 0, 1, 2]


def test_rows_with_the_same_prompt_ids_and_padding_share_a_group():
    ids = torch.tensor([[0, 5, 6, 9], [0, 5, 6, 8], [5, 5, 6, 9], [0, 5, 6, 7]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]])
    groups = prompt_groups(ids, mask, prompt_len=3)
    assert groups[0] == groups[1] == groups[3] != groups[2]  # row 2's prompt has one more real token


def test_packed_layout_by_hand():
    # Rows 0 and 2 share the prompt [pad, 5, 6]; row 1's is [7, 8, 9]. P = 3, T = 2; row 2's response
    # has one real token.
    ids = torch.tensor([[0, 5, 6, 11, 12], [7, 8, 9, 13, 14], [0, 5, 6, 15, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]])
    packed = pack(ids, mask, response_len=2, groups=prompt_groups(ids, mask, 3), per_row=2)
    first, second = packed.rows.tolist()[0], packed.rows.tolist()[1]
    assert packed.rows.tolist()[2] == first != second
    assert packed.input_ids[first].tolist() == [0, 5, 6, 11, 12, 15, 0]
    assert packed.input_ids[second].tolist() == [7, 8, 9, 13, 14, 0, 0]
    # the positions each token had in its own row: row 2's response starts at 2, like row 0's
    assert packed.position_ids[first].tolist() == [0, 0, 1, 2, 3, 2, 2]
    assert packed.position_ids[second].tolist() == [0, 1, 2, 3, 4, 0, 0]
    expected_first = torch.tensor([
        # keys: pad 5  6  11 12 15 pad
        [1, 0, 0, 0, 0, 0, 0],  # the padding attends itself only
        [0, 1, 0, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0, 0],
        [0, 1, 1, 1, 0, 0, 0],  # response 1: the prompt's real tokens and its own
        [0, 1, 1, 1, 1, 0, 0],
        [0, 1, 1, 0, 0, 1, 0],  # response 2 does not see response 1
        [0, 1, 1, 0, 0, 1, 1],  # its padding: read by no real token
    ], dtype=torch.bool)
    assert torch.equal(packed.attention_mask[first, 0], expected_first)
    # token t is predicted at the column before it; the first by the prompt's last column
    assert packed.predicting.tolist() == [[2, 3], [2, 3], [2, 5]]


def test_completions_per_row_by_hand():
    # Two prompts of 4 completions, P = 40, T = 48. Linear work only: k = 1: 8 rows x 88 = 704;
    # k = 2: 4 x 136 = 544; k = 3: 4 x 184 = 736 (a group of 4 needs two rows); k = 4: 2 x 232 = 464.
    assert completions_per_row([4, 4], 40, 48, token_cost=1.0, pair_cost=0.0) == 4
    # Attention only: k = 1: 8 x 88^2 = 61,952; k = 2: 4 x 136^2 = 73,984: the plain batch.
    assert completions_per_row([4, 4], 40, 48, token_cost=0.0, pair_cost=1.0) == 1
    # Long responses (T = 1000, P = 100, SmolLM2's ratio of 2.9e-4 pair to token): k = 1 costs
    # 16 x (1100 + 1100^2 x 2.9e-4) = 23,215, k = 2: 8 x (2100 + 2100^2 x 2.9e-4) = 27,031.
    assert completions_per_row([16], 100, 1000, token_cost=1.0, pair_cost=2.9e-4) == 1


def _tiny_llama(**config):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    settings = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(LlamaConfig(**{**settings, **config})).eval()


def _grouped_batch(vocab: int, prompts: int = 3, completions: int = 4, prompt_len: int = 7, response_len: int = 6):
    """(B, L) sequences and mask: each prompt (left-padded, of different lengths) ``completions`` times,
    responses right-padded to different lengths."""
    gen = torch.Generator().manual_seed(0)
    rows, masks = [], []
    for p in range(prompts):
        real = prompt_len - p
        prompt = torch.randint(5, vocab, (real,), generator=gen)
        for c in range(completions):
            response = torch.randint(5, vocab, (response_len,), generator=gen)
            length = response_len - c % 3
            rows.append(torch.cat([torch.zeros(prompt_len - real, dtype=torch.long), prompt, response]))
            masks.append(torch.cat([torch.zeros(prompt_len - real), torch.ones(real + length),
                                    torch.zeros(response_len - length)]).bool())
    return torch.stack(rows), torch.stack(masks), response_len


def test_distinct_prompts_and_unknown_classes_run_the_plain_batch():
    model = _tiny_llama()
    ids, mask, T = _grouped_batch(64)
    assert shared_layout(model, ids, mask, T) is not None
    assert shared_layout(model, ids[::4], mask[::4], T) is None  # one completion per prompt
    remote = type("RemoteLlama", (type(model),), {})
    model.__class__ = remote
    assert shared_layout(model, ids, mask, T) is None


def test_a_sliding_window_shorter_than_the_rows_runs_the_plain_batch():
    from transformers import MistralConfig, MistralForCausalLM

    ids, mask, T = _grouped_batch(64)
    config = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2)
    assert shared_layout(MistralForCausalLM(MistralConfig(**config, sliding_window=ids.shape[1])), ids, mask, T) is not None
    assert shared_layout(MistralForCausalLM(MistralConfig(**config, sliding_window=ids.shape[1] - 1)), ids, mask, T) is None


def _hidden_and_gradients(model, ids, mask, T, share: bool, monkeypatch):
    monkeypatch.setattr(shared_prompts, "ENABLED", share)
    assert (shared_layout(model, ids, mask, T) is not None) == share
    model.zero_grad()
    hidden = response_hidden(model, ids, mask, T)
    real = mask[:, -T:]
    weights = torch.linspace(-1.0, 1.0, hidden.numel()).view_as(hidden)
    (hidden * weights * real[..., None]).sum().backward()
    return hidden.detach()[real], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_as_plain(model, ids, mask, T, monkeypatch):
    expected, expected_grads = _hidden_and_gradients(model, ids, mask, T, False, monkeypatch)
    hidden, grads = _hidden_and_gradients(model, ids, mask, T, True, monkeypatch)
    assert ((hidden - expected).abs().max() / expected.abs().max()).item() <= HIDDEN_PARITY
    assert set(grads) == set(expected_grads)
    errors = [((grads[n] - g).norm() / g.norm()).item() for n, g in expected_grads.items()
              if g.norm() > 0 and not n.endswith("k_proj.bias")]  # softmax ignores a key bias: noise in both
    assert max(errors) <= GRADIENT_PARITY


def test_eager_attention_reads_the_additive_mask(monkeypatch):
    model = _tiny_llama(attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    ids, mask, T = _grouped_batch(64)
    _assert_same_as_plain(model, ids, mask, T, monkeypatch)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_architecture_gives_the_plain_batchs_hidden_states_and_gradients(architecture_models, family, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(architecture_models / family, dtype=torch.float32).eval()
    model.requires_grad_(True)
    assert type(model).__name__ in shared_prompts.SHARING_CLASSES
    ids, mask, T = _grouped_batch(model.get_output_embeddings().weight.shape[0])
    _assert_same_as_plain(model, ids, mask, T, monkeypatch)

    monkeypatch.setattr(shared_prompts, "ENABLED", False)
    plain = response_logprobs(model, ids, mask, ids[:, -T:], 0.7)[0]
    monkeypatch.setattr(shared_prompts, "ENABLED", True)
    shared = response_logprobs(model, ids, mask, ids[:, -T:], 0.7)[0]
    real = mask[:, -T:]
    assert ((shared - plain)[real].abs().max() / plain[real].abs().max()).item() <= HIDDEN_PARITY


@pytest.mark.slow
def test_a_grpo_update_has_the_plain_batchs_gradient_and_reference(tiny_models, tmp_path, monkeypatch):
    """The whole path: rollout (reference log-probs) and one optimizer step on groups of 4, shared and plain."""
    from ppo_cli.engine.actor_critic import reference_logprobs
    from ppo_cli.engine.engine import load_engine
    from ppo_cli.recipe_loading import load_recipe
    from ppo_cli.train_setup import init_state
    from ppo_cli.trainer import compute_advantages, optimise
    from tests.conftest import ROOT, tiny_overrides

    prompts = ["I think the book was", "The movie was"]
    sets = {"generation.num_generations": 4, "ppo.rollout_batch_size": 2, "ppo.mini_batch_size": 8,
            "ppo.micro_batch_size": 8, "ppo.ppo_epochs": 1, "generation.max_new_tokens": 8, "ppo.kl_coef": 0.04}
    recipe = load_recipe(ROOT / "recipes" / "tiny_grpo.yaml", tiny_overrides(tiny_models, tmp_path, float32=True, **sets))
    torch.manual_seed(0)
    engine = load_engine(recipe)
    monkeypatch.setattr(shared_prompts, "ENABLED", False)
    rollout = engine.collect_rollout([p for p in prompts for _ in range(4)])
    gen = rollout.generation
    T = gen.response_ids.shape[1]
    monkeypatch.setattr(shared_prompts, "ENABLED", True)
    assert shared_layout(engine.actor_critic.policy, gen.sequences, gen.attention_mask, T) is not None
    with torch.no_grad():
        ref = reference_logprobs(engine.actor_critic, gen.sequences, gen.attention_mask, gen.response_ids, engine.temperature)
    mask = gen.action_mask
    torch.testing.assert_close(ref[mask], rollout.ref_logprobs[mask], atol=1e-5, rtol=0)

    def step_gradients(share: bool) -> dict[str, torch.Tensor]:
        monkeypatch.setattr(shared_prompts, "ENABLED", share)
        state = init_state(engine, prompts)
        grads = {}
        state.optimizer.step = lambda *a, **k: grads.update(
            {n: p.grad.clone() for n, p in engine.actor_critic.policy.named_parameters() if p.grad is not None})
        adv = compute_advantages(rollout, state.kl_controller.value, recipe.ppo, group_size=4)
        torch.manual_seed(1)
        optimise(state, rollout, adv)
        return grads

    plain, shared = step_gradients(False), step_gradients(True)
    assert plain and plain.keys() == shared.keys()
    moved = [name for name in plain if plain[name].norm() > 0]  # lora_A's is 0 while lora_B is
    assert moved and all(shared[name].norm() == 0 for name in plain.keys() - moved)
    for name in moved:
        assert ((shared[name] - plain[name]).norm() / plain[name].norm()).item() <= GRADIENT_PARITY, name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_with_each_prompt_prefilled_once_samples_the_same_tokens(architecture_models, family):
    from transformers import AutoModelForCausalLM

    from ppo_cli.engine.generate import generate
    from ppo_cli.recipe import GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(architecture_models / family, dtype=torch.float32).eval()
    # 12 rows of 3 prompts of 16 columns: 9 x 15 prompt tokens saved, at least 8 a row (PREFILL_TOKENS_PER_STEP)
    ids, mask, T = _grouped_batch(model.get_output_embeddings().weight.shape[0], prompt_len=16)
    prompt_ids, prompt_mask = ids[:, :-T], mask[:, :-T]
    cache = shared_prefill(model, prompt_ids, prompt_mask)
    assert cache is not None and cache.get_seq_length() == prompt_ids.shape[1] - 1
    gen = GenerationConfig(max_new_tokens=8, temperature=0.7)
    samples = {}
    for share in (True, False):
        torch.manual_seed(0)
        samples[share] = generate(model, prompt_ids, prompt_mask, gen, stop_token_id=-1, pad_token_id=0, share_prompts=share)
    assert torch.equal(samples[True].response_ids, samples[False].response_ids)
    assert shared_prefill(model, prompt_ids[::4], prompt_mask[::4]) is None  # no prompt repeats
    # prompts of 7 columns: 9 x 6 tokens saved, under 8 a row: not worth the prefill's own forward call
    short_ids, short_mask, T = _grouped_batch(model.get_output_embeddings().weight.shape[0], prompt_len=7)
    assert shared_prefill(model, short_ids[:, :-T], short_mask[:, :-T]) is None


def test_a_sharded_or_partitioned_policy_prefills_each_row_itself():
    model = _tiny_llama()
    ids, mask, T = _grouped_batch(64, prompt_len=16)
    assert shared_prefill(model, ids[:, :-T], mask[:, :-T]) is not None
    model.model.norm.weight.data = torch.empty(0)  # as ZeRO-3 leaves a partitioned parameter
    assert shared_prefill(model, ids[:, :-T], mask[:, :-T]) is None
