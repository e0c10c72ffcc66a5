import pytest
import torch

from ppo_cli.engine.logprobs import position_ids_from_mask, selective_log_softmax


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-5)])
def test_selective_log_softmax_matches_log_softmax_gather(dtype, atol):
    # Half-precision logits are upcast to float32 inside, so bfloat16 inputs are as exact as float32.
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 7, 50, generator=gen) * 3).to(dtype)
    index = torch.randint(0, 50, (5, 7), generator=gen)
    naive = torch.log_softmax(logits.double(), dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    fast = selective_log_softmax(logits, index, chunk_rows=2)
    assert fast.shape == (5, 7)
    torch.testing.assert_close(fast.double(), naive, atol=atol, rtol=0)


def test_selective_log_softmax_gradient_matches_naive():
    logits = torch.randn(3, 4, 11, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, 11, (3, 4))
    selective_log_softmax(logits, index).sum().backward()
    fast_grad = logits.grad.clone()
    logits.grad = None
    torch.log_softmax(logits, -1).gather(-1, index.unsqueeze(-1)).sum().backward()
    torch.testing.assert_close(fast_grad, logits.grad, atol=1e-12, rtol=0)


def test_position_ids_count_real_tokens_after_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]], dtype=torch.bool)
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 1, 2, 2]]


# --- the model's own logits, for architectures that change them after the LM head -----------------

VOCAB, EOS, PAD = 96, 1, 0


def _tiny_causal_lm(family: str):
    """A 2-layer random model whose raw LM-head outputs are in the tens, as trained models' are, so that
    Gemma 2's soft-capping at 30 and Granite's logit scaling change the distribution."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=2)
    configs = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
                   dict(final_logit_softcapping=30.0, tie_word_embeddings=False)),
        "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM, dict(logits_scaling=8.0)),
    }
    config_class, model_class, extra = configs[family]
    torch.manual_seed(0)
    model = model_class(config_class(**common, **extra)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40.0)
    return model


def _left_padded_batch():
    """Two prompts of different lengths (the short one left-padded) followed by 5 response tokens."""
    gen = torch.Generator().manual_seed(1)
    sequences = torch.randint(3, VOCAB, (2, 9), generator=gen)
    attention_mask = torch.ones(2, 9, dtype=torch.bool)
    attention_mask[1, :3] = False
    sequences[1, :3] = PAD
    return sequences, attention_mask


def _unpadded_truth(model, sequences, attention_mask, response_len: int, temperature: float) -> torch.Tensor:
    """log_softmax(model(row).logits / temperature) at each response token, every row alone, no padding."""
    rows = []
    for seq, real in zip(sequences, attention_mask):
        ids = seq[real].unsqueeze(0)
        logits = model(input_ids=ids).logits[0, -response_len - 1 : -1].float() / temperature
        rows.append(logits.log_softmax(-1).gather(-1, ids[0, -response_len:].unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma2", "granite"])
def test_causal_lm_forward_gives_the_models_own_logits_on_left_padded_rows(family):
    from ppo_cli.engine.logprobs import causal_lm_forward

    model = _tiny_causal_lm(family)
    sequences, attention_mask = _left_padded_batch()
    with torch.no_grad():
        logits, hidden = causal_lm_forward(model, sequences, attention_mask, 5, 0.7, keep_hidden=True)
        truth = _unpadded_truth(model, sequences, attention_mask, 5, 0.7)
        lm_head_only = model.get_output_embeddings()(hidden).float() / 0.7
    ours = selective_log_softmax(logits, sequences[:, -5:])
    torch.testing.assert_close(ours, truth, atol=1e-5, rtol=0)
    assert hidden.shape == (2, 5, 32)
    naive = selective_log_softmax(lm_head_only, sequences[:, -5:])
    # The LM head alone is the model's distribution only where the forward adds nothing after it.
    assert ((naive - truth).abs().max() < 1e-5) == (family == "llama")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma2", "granite"])
def test_generation_logprobs_are_those_of_the_distribution_sampled(family):
    from ppo_cli.engine.generate import generate_with_logprobs
    from ppo_cli.engine.logprobs import causal_lm_forward
    from ppo_cli.recipe import GenerationConfig

    model = _tiny_causal_lm(family)
    prompts, prompt_mask = _left_padded_batch()
    gen = GenerationConfig(max_new_tokens=6, temperature=0.7)
    torch.manual_seed(3)
    generation, logprobs, hidden = generate_with_logprobs(model, prompts, prompt_mask, gen, EOS, PAD, keep_hidden=True)
    T = generation.response_ids.shape[1]
    with torch.no_grad():
        logits, full_hidden = causal_lm_forward(model, generation.sequences, generation.attention_mask, T, 0.7,
                                                keep_hidden=True)
    mask = generation.response_mask
    expected = selective_log_softmax(logits, generation.response_ids)
    torch.testing.assert_close(logprobs[mask], expected[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(hidden[mask], full_hidden[mask], atol=1e-5, rtol=0)
    assert logprobs.shape == (2, T) and hidden.shape == (2, T, 32)


@pytest.mark.slow
def test_no_dropout_survives_in_train_mode_not_even_as_a_float_rate():
    """OPT applies dropout through float attributes (config.dropout 0.1), not nn.Dropout modules; the
    policy trains in train mode, so two forwards must still agree exactly."""
    import transformers

    from ppo_cli.engine.models import disable_dropout

    config = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                    num_attention_heads=4, word_embed_proj_dim=32, dropout=0.1,
                                    attention_dropout=0.1, layerdrop=0.5, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(config).train()
    ids = torch.randint(3, VOCAB, (2, 7))
    assert not torch.equal(model(ids).logits, model(ids).logits)  # random as loaded
    disable_dropout(model)
    torch.testing.assert_close(model(ids).logits, model(ids).logits, atol=0, rtol=0)
