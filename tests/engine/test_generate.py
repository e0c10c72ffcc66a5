import pytest
import torch

from ppo_cli.engine.generate import trim_padding, truncate_after_stop
from ppo_cli.types import Generation

EOS, PAD = 0, 1


@pytest.mark.parametrize(
    "raw, ids, mask, finished",
    [
        # stop token in the middle: kept, everything after it padded
        ([5, 6, 0, 7], [5, 6, 0, 1], [1, 1, 1, 0], True),
        # no stop token: all sampled tokens count
        ([5, 6, 7, 8], [5, 6, 7, 8], [1, 1, 1, 1], False),
        # stop token first: a one-token response
        ([0, 6, 7, 8], [0, 1, 1, 1], [1, 0, 0, 0], True),
        # only the first of two stop tokens ends the response
        ([5, 0, 0, 9], [5, 0, 1, 1], [1, 1, 0, 0], True),
        # stop token last
        ([5, 6, 7, 0], [5, 6, 7, 0], [1, 1, 1, 1], True),
    ],
)
def test_truncate_after_stop_keeps_up_to_first_stop_token(raw, ids, mask, finished):
    out_ids, out_mask, out_finished = truncate_after_stop(torch.tensor([raw]), EOS, PAD)
    assert out_ids.tolist() == [ids]
    assert out_mask.tolist() == [[bool(m) for m in mask]]
    assert out_finished.tolist() == [finished]


def test_truncate_after_stop_is_row_wise():
    raw = torch.tensor([[5, 0, 7], [5, 6, 7]])
    ids, mask, finished = truncate_after_stop(raw, EOS, PAD)
    assert ids.tolist() == [[5, 0, 1], [5, 6, 7]]
    assert mask.sum(dim=1).tolist() == [2, 3]
    assert finished.tolist() == [True, False]


def test_trim_padding_drops_columns_after_longest_response():
    gen = Generation(
        prompt_ids=torch.tensor([[1, 2], [3, 4]]),
        prompt_mask=torch.ones(2, 2, dtype=torch.bool),
        response_ids=torch.tensor([[5, 0, 1, 1], [5, 6, 0, 1]]),
        response_mask=torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool),
        finished=torch.tensor([True, True]),
        action_mask=torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]], dtype=torch.bool),
    )
    trimmed = trim_padding(gen)
    assert trimmed.response_ids.tolist() == [[5, 0, 1], [5, 6, 0]]
    assert trimmed.response_mask.shape == (2, 3)
    assert trimmed.action_mask.tolist() == [[True, True, False], [True, False, True]]
    assert trimmed.sequences.shape == (2, 5)


def _ranks_of_sampled_tokens(model, generation) -> torch.Tensor:
    """Rank of every sampled response token under the model's logits at its position (0 = argmax)."""
    from ppo_cli.engine.logprobs import position_ids_from_mask

    T = generation.response_ids.shape[1]
    with torch.no_grad():
        logits = model(input_ids=generation.sequences, attention_mask=generation.attention_mask.long(),
                       position_ids=position_ids_from_mask(generation.attention_mask)).logits[:, -T - 1 : -1]
    chosen = logits.gather(-1, generation.response_ids.unsqueeze(-1))
    ranks = (logits > chosen).sum(dim=-1)
    return ranks[generation.response_mask]


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [0, 5])
def test_sampling_ignores_the_models_own_generation_defaults(tiny_models, top_k):
    """PPO's log-probs are the full softmax's: with top_k 0 the samples must come from it, whatever the
    checkpoint's generation_config.json says (transformers would otherwise apply its own top_k of 50)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppo_cli.engine.generate import generate
    from ppo_cli.recipe import GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_models / "policy")
    tokenizer = AutoTokenizer.from_pretrained(tiny_models / "policy", padding_side="left")
    model.generation_config.top_k, model.generation_config.repetition_penalty = 1, 2.0  # a hub model's defaults
    batch = tokenizer(["The movie was"] * 64, return_tensors="pt")
    torch.manual_seed(0)
    # Temperature 3 flattens the tiny model's peaked distribution: a few % of the mass lies outside the top 50.
    gen = GenerationConfig(max_new_tokens=16, temperature=3.0, top_k=top_k)
    generation = generate(model, batch.input_ids, batch.attention_mask.bool(), gen, tokenizer.eos_token_id,
                          tokenizer.pad_token_id)
    ranks = _ranks_of_sampled_tokens(model, generation)
    if top_k == 0:
        assert ranks.max() >= 50, "no token outside the top 50 in 64 x 16 samples from the full softmax"
    else:
        assert ranks.max() < top_k and ranks.min() == 0
    assert model.generation_config.top_k == 1  # the model's own config is left as it was


def _tied_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def test_the_head_cast_once_computes_the_same_logits_and_gives_the_head_back():
    from ppo_cli.engine.generate import head_cast_once

    model = _tied_llama()
    head = model.get_output_embeddings()
    assert head.weight is model.get_input_embeddings().weight
    ids = torch.randint(0, 300, (3, 7))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        per_call = model(input_ids=ids).logits
        with head_cast_once(model):
            assert "forward" in vars(head)  # the copy is in use
            once = model(input_ids=ids).logits
    assert "forward" not in vars(head)
    assert once.dtype == per_call.dtype == torch.bfloat16
    assert torch.equal(once, per_call)


@pytest.mark.parametrize("case", ["no autocast", "trained head"])
def test_the_head_cast_once_leaves_alone_a_head_it_would_not_speed_up(case):
    from ppo_cli.engine.generate import head_cast_once

    model = _tied_llama()
    head = model.get_output_embeddings()
    if case == "trained head":
        head.weight.requires_grad_(True)  # autocast caches its cast already
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case != "no autocast"), head_cast_once(model):
        assert "forward" not in vars(head)
