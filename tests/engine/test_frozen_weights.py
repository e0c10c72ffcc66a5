"""A LoRA policy's frozen Linear weights stored in bf16 under bf16 autocast (engine/frozen_weights.py):
bit-identical sampling, log-probs and gradients, half the frozen weights' bytes."""

import pytest
import torch

from ppo_cli.engine.actor_critic import policy_forward, reference_logprobs
from ppo_cli.recipe_loading import load_recipe
from tests.conftest import ROOT, tiny_overrides

pytestmark = pytest.mark.slow
PROMPTS = ["I think the book was", "The movie was", "Overall, the product is", "This phone is"]


def _computed(engine) -> dict[str, torch.Tensor]:
    """Sampled tokens, policy log-probs, reference log-probs and the LoRA gradients of one loss."""
    ac = engine.actor_critic
    torch.manual_seed(3)
    generation = engine.generate(PROMPTS)
    seq, attn, resp = generation.sequences, generation.attention_mask, generation.response_ids
    ac.policy.zero_grad(set_to_none=True)
    with engine.autocast():
        logprobs, _, _ = policy_forward(ac, seq, attn, resp, 1.0)
        with torch.no_grad():
            ref = reference_logprobs(ac, seq, attn, resp, 1.0)
    (logprobs * generation.response_mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in ac.policy.named_parameters() if p.requires_grad}
    return {"tokens": generation.response_ids, "logprobs": logprobs.detach(), "ref": ref, **grads}


def test_frozen_linears_in_bf16_compute_exactly_what_bf16_autocast_computes_with_float32_weights(tiny_models, tmp_path):
    from ppo_cli.engine.engine import load_engine

    recipe = load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml",
                         tiny_overrides(tiny_models, tmp_path, **{"train.mixed_precision": "bf16"}))
    engine = load_engine(recipe)
    policy = engine.actor_critic.policy
    before = _computed(engine)
    q_proj = policy.base_model.model.model.layers[0].self_attn.q_proj
    stored = engine.store_frozen_weights_in_compute_dtype()
    after = _computed(engine)

    base = [m.base_layer for m in policy.modules() if hasattr(m, "base_layer") and type(m.base_layer) is torch.nn.Linear]
    assert stored == len(base) > 0  # every layer LoRA wraps; the LM head is the embedding's, left float32
    trained = {n: p.dtype for n, p in policy.named_parameters() if "lora_" in n}
    assert trained and set(trained.values()) == {torch.float32}
    assert q_proj.base_layer.weight.dtype == torch.bfloat16 and q_proj.lora_A["policy"].weight.dtype == torch.float32
    assert policy.get_input_embeddings().weight.dtype == torch.float32  # the lookup is not autocast
    assert after.keys() == before.keys() and len(before) > 3
    for name, value in before.items():
        assert torch.equal(after[name], value), name


def test_frozen_linears_stay_float32_without_mixed_precision(tiny_models, tmp_path):
    from ppo_cli.engine.engine import load_engine

    recipe = load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml", tiny_overrides(tiny_models, tmp_path, float32=True))
    engine = load_engine(recipe)
    assert engine.store_frozen_weights_in_compute_dtype() == 0
    assert {p.dtype for p in engine.actor_critic.policy.parameters()} == {torch.float32}


CONVERT = r"""
import json, sys, torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
import ppo_cli.engine.frozen_weights as frozen_weights

def high_water_kb():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))

if sys.argv[2] == "keep":  # as before: every float32 page stays resident until the last tensor is replaced
    frozen_weights.drop_checkpoint_pages = lambda tensor, mappings: None
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
scale = 2.0 if sys.argv[2] == "written" else 1.0
if sys.argv[2] == "written":  # a weight changed in place: its mapping's pages are the only copy of the change
    model.model.layers[1].self_attn.q_proj.weight.data.mul_(scale)
model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
mapped = len(frozen_weights.unwritten_checkpoint_mappings())
before = high_water_kb()
frozen_weights.store_frozen_linears_in(model, torch.bfloat16)
grown = high_water_kb() - before
expected = load_file(sys.argv[1] + "/model.safetensors")
q_proj = model.base_model.model.model.layers[1].self_attn.q_proj.base_layer.weight
norm = model.base_model.model.model.layers[1].input_layernorm.weight
same = (torch.equal(q_proj, (scale * expected["model.layers.1.self_attn.q_proj.weight"]).to(torch.bfloat16))
        and torch.equal(norm, expected["model.layers.1.input_layernorm.weight"]))
print(json.dumps({"mapped": mapped, "grown_mb": grown / 1024, "same": same}))
"""


def test_the_float32_pages_leave_as_each_weight_is_converted_not_at_the_end(tmp_path):
    """Converting a memory-mapped float32 checkpoint's Linears to bf16 used to hold the whole float32 model
    and its bf16 copy at once (each source page stayed resident until the last tensor was replaced); each
    source's pages are now dropped when it is replaced, so the high-water mark grows by about the bf16 copy."""
    import json
    import subprocess
    import sys

    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=1000, hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "model")
    linear_mb = 4 * (4 * 512 * 512 + 3 * 512 * 2048) * 4 / 2**20  # the float32 Linears: 64 MiB

    def convert(mode: str) -> dict:
        done = subprocess.run([sys.executable, "-c", CONVERT, str(tmp_path / "model"), mode], capture_output=True,
                              text=True, cwd=ROOT, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    dropped, kept, written = convert("drop"), convert("keep"), convert("written")
    assert dropped["mapped"] == 1 and dropped["same"] and kept["same"]
    assert written["mapped"] == 0 and written["same"]  # nothing dropped where a page was written
    assert kept["grown_mb"] > 1.3 * linear_mb  # float32 and bf16 at once: 1.5x
    assert dropped["grown_mb"] < 0.75 * linear_mb  # the bf16 copy (0.5x) and one tensor in flight
