"""Every supported architecture trains on the distribution it samples from.

For each family in tests/fixtures/architectures.py (tiny random weights, realistic logit scale, the
family's own tokenizer kind), through the project's own loading (load_engine with LoRA):

- the rollout's log-probs are those of the model's own forward (``model(ids).logits``) over each row's
  real tokens alone, and those of the logits ``generate`` sampled from; so are the reference's (adapter
  disabled) and those kept from generation (ppo.rollout_logprobs: generation). A forward that
  post-processes its logits (Gemma 2's softcapping, Granite's logits_scaling, Cohere's logit_scale)
  must not be bypassed;
- the first PPO mini-batch has ratio 1, with the adapter critic and with a value head, and the policy
  adapter's weights move;
- final/ loads with ``PeftModel.from_pretrained`` and gives the trained policy's logits;
- the chunked log-probs and entropies (engine/logprobs.py: LM head, the family's own step after it,
  a chunk of positions at a time) equal those of the model's own ``forward().logits``, and so do their
  gradients, with every weight trained (the LM head included).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ppo_cli.checkpoint import save_final
from ppo_cli.engine.chat import tokenize_prompts
from ppo_cli.engine.models import load_tokenizer
from ppo_cli.engine.engine import Engine, load_engine
from ppo_cli.recipe import Recipe
from ppo_cli.recipe_loading import validate_recipe
from ppo_cli.train_setup import init_state
from ppo_cli.trainer import train_step
from tests.conftest import ROOT
from tests.fixtures.architectures import FAMILIES, SENTENCEPIECE_VOCAB

# Different lengths in every tokenizer, so the batch is left-padded.
PROMPTS = ["The movie was", "I think the book was really", "Overall", "This phone is fast and the screen is"]
TEMPERATURE = 0.7
# float32 rounding at realistic logits (logits / temperature up to ~40): measured, the engine's padded
# batch and a row alone are each up to 2e-5 nats from a float64 forward. A skipped softcap costs
# tenths of a nat, a skipped logit scale or a position off by one, nats.
FORWARD_PARITY = 5e-5
KV_CACHED = 1e-4  # generate's incremental forwards against one full forward
RATIO = 1e-5  # rollout and update run the same batched forward

SENTENCEPIECE_FAMILIES = [name for name, family in FAMILIES.items() if family.tokenizer == "sentencepiece"]
BYTE_LEVEL_FAMILIES = [name for name, family in FAMILIES.items() if family.tokenizer == "byte_level"]


def make_recipe(model_dir: Path, output_dir: Path, value_kind: str = "auto", rollout_logprobs: str = "forward") -> Recipe:
    return validate_recipe({
        "name": "arch",
        "seed": 0,
        "output_dir": str(output_dir),
        "policy": {"path": str(model_dir), "dtype": "float32",
                   "lora": {"r": 8, "alpha": 16, "target_modules": "all-linear"}},
        "value": {"kind": value_kind},
        "reward": {"components": [{"type": "function", "function": "ppo_cli.examples.rewards:positive_words"}]},
        "data": {"prompts": str(ROOT / "recipes" / "prompts" / "reviews.txt"), "max_prompt_tokens": 32},
        "generation": {"max_new_tokens": 8, "temperature": TEMPERATURE},
        "ppo": {"rollout_batch_size": 4, "mini_batch_size": 2, "micro_batch_size": 1, "ppo_epochs": 1,
                "rollout_logprobs": rollout_logprobs},
        "optim": {"lr": 5e-3},
        # Tiny matrices: one thread. Two threads on 2 cores shared with other processes spend ~35x
        # the CPU time spinning in the thread pool. float32: the tolerances above are float32 rounding,
        # and on a CPU where the probe finds bf16 faster, auto would autocast.
        "train": {"total_updates": 1, "device": "cpu", "num_threads": 1, "mixed_precision": "no"},
    })


def make_engine(architecture_models: Path, family: str, output_dir: Path, value_kind: str = "auto",
                rollout_logprobs: str = "forward") -> Engine:
    engine = load_engine(make_recipe(architecture_models / family, output_dir, value_kind, rollout_logprobs))
    torch.manual_seed(0)
    return engine


@pytest.fixture(scope="module", autouse=True)
def restore_num_threads():
    """load_engine sets the process-wide thread count from the recipe; leave it as it was found."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def sampled(architecture_models, family, tmp_path_factory):
    """(engine, rollout, raw logits (B, steps, V) that generate() sampled the rollout from)."""
    engine = make_engine(architecture_models, family, tmp_path_factory.mktemp(family))
    policy = engine.actor_critic.policy
    captured = []

    def generate_keeping_logits(*args, **kwargs):
        out = original(*args, **kwargs, output_logits=True, return_dict_in_generate=True)
        captured.append(torch.stack(out.logits, dim=1))
        return out.sequences

    original = policy.generate
    policy.generate = generate_keeping_logits
    try:
        rollout = engine.collect_rollout(PROMPTS)
    finally:
        del policy.generate
    return engine, rollout, captured[0]


@pytest.fixture(scope="module")
def trained(architecture_models, family, tmp_path_factory):
    """(engine, metrics of one update, the policy adapter's weights before it), default critic."""
    engine = make_engine(architecture_models, family, tmp_path_factory.mktemp(family))
    before = policy_adapter_weights(engine)
    metrics, _ = train_step(init_state(engine, PROMPTS))
    return engine, metrics, before


# --- ground truth ----------------------------------------------------------------------------------


@torch.no_grad()
def forward_logprobs(model, generation, temperature: float) -> torch.Tensor:
    """(B, T): each row's real tokens alone (no padding) through ``model(ids).logits``, log-softmax at
    the temperature, at the sampled response tokens; 0 outside the response mask."""
    out = torch.zeros(generation.response_ids.shape)
    for row in range(generation.response_ids.shape[0]):
        prompt = generation.prompt_ids[row][generation.prompt_mask[row]]
        response = generation.response_ids[row][generation.response_mask[row]]
        logits = model(input_ids=torch.cat([prompt, response])[None]).logits[0].float()
        predicting = logits[len(prompt) - 1 : len(prompt) - 1 + len(response)]
        out[row, : len(response)] = torch.log_softmax(predicting / temperature, -1).gather(-1, response[:, None])[:, 0]
    return out


def sampled_logprobs(generate_logits: torch.Tensor, generation, temperature: float) -> torch.Tensor:
    """(B, T) log-probs of the response tokens under the logits generate() sampled them from."""
    T = generation.response_ids.shape[1]
    logprobs = torch.log_softmax(generate_logits[:, :T].float() / temperature, -1)
    return logprobs.gather(-1, generation.response_ids[..., None])[..., 0].masked_fill(~generation.response_mask, 0.0)


def max_error(actual: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor) -> float:
    return (actual - expected)[mask].abs().max().item()


def assert_logprobs_close(actual, expected, mask, atol: float, what: str) -> None:
    error = max_error(actual, expected, mask)
    assert error <= atol, f"{what}: max |error| {error:.3g} nats over {int(mask.sum())} response tokens (tolerance {atol:g})"


def policy_adapter_weights(engine: Engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.actor_critic.policy.named_parameters() if ".policy." in n and "lora_" in n}


# --- a. log-prob parity ----------------------------------------------------------------------------


def test_rollout_batch_is_left_padded(sampled):
    _, rollout, _ = sampled
    lengths = rollout.generation.prompt_mask.sum(dim=1)
    assert lengths.min() < lengths.max()
    assert rollout.generation.response_mask.sum() > len(PROMPTS)


def test_rollout_logprobs_equal_the_models_own_forward(sampled):
    engine, rollout, _ = sampled
    generation = rollout.generation
    expected = forward_logprobs(engine.actor_critic.policy, generation, TEMPERATURE)
    assert_logprobs_close(rollout.logprobs, expected, generation.response_mask, FORWARD_PARITY, "policy log-probs vs model(ids).logits")


def test_rollout_logprobs_equal_the_models_own_forward_on_the_same_padded_batch(sampled):
    """The left-padded batch itself through ``model(...).logits`` (all positions, no logits_to_keep,
    positions from the mask as generate computes them): the same arithmetic, so float32 agrees to 1e-5."""
    from ppo_cli.engine.logprobs import position_ids_from_mask

    engine, rollout, _ = sampled
    generation = rollout.generation
    T = generation.response_ids.shape[1]
    with torch.no_grad():
        logits = engine.actor_critic.policy(
            input_ids=generation.sequences, attention_mask=generation.attention_mask.long(),
            position_ids=position_ids_from_mask(generation.attention_mask),
        ).logits[:, -T - 1 : -1].float()
    expected = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, generation.response_ids[..., None])[..., 0]
    assert_logprobs_close(rollout.logprobs, expected, generation.response_mask, 1e-5,
                          "policy log-probs vs model(padded batch).logits")


def test_reference_logprobs_equal_the_base_models_own_forward(sampled):
    engine, rollout, _ = sampled
    generation = rollout.generation
    with engine.actor_critic.reference_context():
        expected = forward_logprobs(engine.actor_critic.policy, generation, TEMPERATURE)
    assert_logprobs_close(rollout.ref_logprobs, expected, generation.response_mask, FORWARD_PARITY,
                          "reference log-probs vs model(ids).logits with the adapter disabled")


def test_rollout_logprobs_equal_the_distribution_generate_sampled_from(sampled):
    _, rollout, generate_logits = sampled
    generation = rollout.generation
    expected = sampled_logprobs(generate_logits, generation, TEMPERATURE)
    assert_logprobs_close(rollout.logprobs, expected, generation.response_mask, KV_CACHED,
                          "policy log-probs vs generate(output_logits=True)")


def test_logprobs_kept_from_generation_equal_the_models_own_forward(architecture_models, family, tmp_path):
    """ppo.rollout_logprobs: generation takes the old log-probs from the sampling passes themselves."""
    engine = make_engine(architecture_models, family, tmp_path, rollout_logprobs="generation")
    assert engine.reuses_generation_forward()
    rollout = engine.collect_rollout(PROMPTS)
    generation = rollout.generation
    expected = forward_logprobs(engine.actor_critic.policy, generation, TEMPERATURE)
    assert_logprobs_close(rollout.logprobs, expected, generation.response_mask, KV_CACHED,
                          "log-probs kept from generation vs model(ids).logits")


# --- b. first mini-batch ratio ---------------------------------------------------------------------


def assert_first_update_is_sound(metrics: dict, before: dict, engine: Engine) -> None:
    assert abs(metrics["val/ratio_first_minibatch"] - 1.0) <= RATIO, metrics["val/ratio_first_minibatch"]
    assert metrics["skipped"] == 0, metrics.get("skip_reason")
    assert math.isfinite(metrics["loss/policy_avg"]) and math.isfinite(metrics["loss/value_avg"])
    after = policy_adapter_weights(engine)
    assert before and any(not torch.equal(before[n], after[n]) for n in before), "the policy adapter did not train"


def test_first_update_with_the_default_critic_has_ratio_one(trained):
    engine, metrics, before = trained
    assert engine.actor_critic.value_kind == "head"  # auto, with no reward model to start a critic from
    assert_first_update_is_sound(metrics, before, engine)


def test_first_update_with_the_adapter_critic_has_ratio_one(architecture_models, family, tmp_path):
    engine = make_engine(architecture_models, family, tmp_path, value_kind="adapter")
    before = policy_adapter_weights(engine)
    metrics, _ = train_step(init_state(engine, PROMPTS))
    assert_first_update_is_sound(metrics, before, engine)


# --- c. final/ loads with peft -----------------------------------------------------------------------


def test_final_adapter_loads_with_peft_and_gives_the_trained_logits(trained, architecture_models, family, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    engine, _, _ = trained
    final_dir = tmp_path / "final"
    save_final(engine.actor_critic, engine.tokenizer, final_dir, {"step": 1})
    base = AutoModelForCausalLM.from_pretrained(architecture_models / family, dtype=torch.float32)
    ids = engine.tokenizer(PROMPTS[-1], return_tensors="pt").input_ids
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        loaded_logits = PeftModel.from_pretrained(base, final_dir).eval()(input_ids=ids).logits
        trained_logits = engine.actor_critic.policy(input_ids=ids).logits
    assert (trained_logits - base_logits).abs().max() > 1e-3, "the update left the logits unchanged"
    torch.testing.assert_close(loaded_logits, trained_logits, atol=1e-5, rtol=0)  # the same forward, same rows


# --- tokenizers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SENTENCEPIECE_FAMILIES)
def test_sentencepiece_tokenizer_is_whole_adds_bos_and_has_no_pad(architecture_models, name):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(architecture_models / name)
    assert len(tokenizer) == SENTENCEPIECE_VOCAB
    assert tokenizer.pad_token is None
    ids = tokenizer("The movie was great").input_ids
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "The movie was great"


@pytest.mark.parametrize("name", BYTE_LEVEL_FAMILIES)
def test_byte_level_tokenizer_has_eos_and_no_bos(architecture_models, name):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(architecture_models / name)
    ids = tokenizer("The movie was great").input_ids
    assert tokenizer.bos_token_id is None or tokenizer.bos_token_id not in ids
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id not in ids
    assert tokenizer.decode(ids) == "The movie was great"


def test_chat_templated_prompt_has_exactly_one_bos(architecture_models):
    """A chat template that writes the BOS itself, tokenised as the engine does: one BOS, not two."""
    from ppo_cli.recipe import DataConfig

    tokenizer = load_tokenizer(str(architecture_models / "mistral"))
    assert tokenizer.chat_template.startswith("{{ bos_token }}")
    data = DataConfig(prompts="unused.txt", chat_template=True, max_prompt_tokens=64)
    prompt_ids, prompt_mask = tokenize_prompts(PROMPTS, tokenizer, data, device="cpu")
    for ids, mask in zip(prompt_ids, prompt_mask):
        real = ids[mask].tolist()
        assert real[0] == tokenizer.bos_token_id
        assert real.count(tokenizer.bos_token_id) == 1, real[:4]


# --- d. chunked log-probs: the model's own logits, without holding them --------------------------------

# Which path each family's log-probs take (engine/logprobs.py's logprob_path): "chunked" reproduces the
# step after the LM head; "model logits" takes forward().logits whole. Every family here is chunked.
LOGPROB_PATHS = {name: "chunked" for name in FAMILIES}
# float32: one chunk covering every position runs the very ops of the model's forward (bitwise equal
# log-probs and entropies, gradients too); smaller chunks change only the LM head matmul's blocking
# and the order gradients are summed in. Measured with 4 positions per chunk: log-probs and entropies
# at most 2.2e-7 of the largest |log-prob|; a weight's gradient at most 2.0e-6 off (Granite's k_proj,
# Llama's final norm 1.6e-6), float32 summation order, not a distribution.
CHUNK_PARITY = 1e-6  # relative to the largest |log-prob| (the scale of the logsumexp)
GRADIENT_PARITY = {"one chunk": 1e-6, "several chunks": 5e-6}  # ||error|| / ||gradient||, each weight


def relative_error(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor) -> float:
    """max |actual - expected| / max |scale|."""
    return ((actual - expected).abs().max() / scale.abs().max()).item()


def gradient_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| (Frobenius): a weight's gradient as one vector."""
    return (torch.linalg.vector_norm(actual - expected) / torch.linalg.vector_norm(expected)).item()


def zero_in_exact_arithmetic(name: str) -> bool:
    """A key projection's bias: softmax ignores a constant added to every key, so its gradient is
    rounding noise in both paths (OPT's: 1e-9 against weights' 1e1), and their ratio means nothing."""
    return name.endswith("k_proj.bias")


def test_each_family_takes_the_logprob_path_listed(architecture_models, family):
    from transformers import AutoModelForCausalLM

    from ppo_cli.engine.logprobs import logprob_path

    model = AutoModelForCausalLM.from_pretrained(architecture_models / family, dtype=torch.float32)
    assert logprob_path(model) == LOGPROB_PATHS[family]


def test_a_model_class_whose_forward_was_not_read_takes_its_own_logits(architecture_models):
    from transformers import LlamaForCausalLM

    from ppo_cli.engine.logprobs import logprob_path

    class RemoteCodeLlama(LlamaForCausalLM):  # a name HEAD_STEPS does not know: its forward could do anything
        pass

    same_name = type("LlamaForCausalLM", (LlamaForCausalLM,), {})  # remote code reusing a known name
    for cls in (RemoteCodeLlama, same_name):
        assert logprob_path(cls.from_pretrained(architecture_models / "llama", dtype=torch.float32)) == "model logits"


def _logprobs_entropies_and_gradients(model, compute):
    """(log-probs (B, T), entropies (B, T), {name: gradient}) of a weighted sum of both, every weight trained."""
    model.zero_grad()
    logprobs, entropies = compute()
    weights = torch.linspace(-1.0, 1.0, logprobs.numel()).view_as(logprobs)
    ((logprobs * weights).sum() + 0.1 * entropies.sum()).backward()
    return logprobs.detach(), entropies.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("positions_per_chunk", [1000, 4])
def test_chunked_logprobs_and_gradients_equal_the_models_own_logits(architecture_models, family, positions_per_chunk):
    from transformers import AutoModelForCausalLM

    from ppo_cli.algo.losses import entropy_from_logits
    from ppo_cli.engine.logprobs import causal_lm_forward, response_logprobs, selective_log_softmax

    model = AutoModelForCausalLM.from_pretrained(architecture_models / family, dtype=torch.float32).eval()
    model.requires_grad_(True)
    vocab = model.get_output_embeddings().weight.shape[0]
    sequences = torch.randint(5, vocab, (3, 14), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones(3, 14, dtype=torch.bool)
    attention_mask[1, :4] = attention_mask[2, :2] = False  # left padding
    response_ids = sequences[:, -6:]

    def own_logits():  # the path before chunking: the model's forward().logits, whole
        logits, _ = causal_lm_forward(model, sequences, attention_mask, 6, TEMPERATURE)
        return selective_log_softmax(logits, response_ids), entropy_from_logits(logits)

    def chunked():
        logprobs, entropies, _ = response_logprobs(model, sequences, attention_mask, response_ids, TEMPERATURE, "grad",
                                                   logits_per_chunk=positions_per_chunk * vocab)
        return logprobs, entropies

    expected_lp, expected_ent, expected_grads = _logprobs_entropies_and_gradients(model, own_logits)
    lp, ent, grads = _logprobs_entropies_and_gradients(model, chunked)
    assert set(grads) == set(expected_grads) and any("lm_head" in n or "embed" in n or "wte" in n for n in grads)
    if positions_per_chunk >= 18:  # one chunk: the forward's own ops, bitwise
        assert torch.equal(lp, expected_lp) and torch.equal(ent, expected_ent)
    assert relative_error(lp, expected_lp, expected_lp) <= CHUNK_PARITY
    assert relative_error(ent, expected_ent, expected_lp) <= CHUNK_PARITY
    worst = max((gradient_error(grads[n], expected_grads[n]), n) for n in grads if not zero_in_exact_arithmetic(n))
    tolerance = GRADIENT_PARITY["one chunk" if positions_per_chunk >= 18 else "several chunks"]
    assert worst[0] <= tolerance, f"gradient of {worst[1]}: relative error {worst[0]:.3g}"
