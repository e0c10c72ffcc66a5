"""`ppo plan`: the estimate's parts against numbers worked out by hand for a small Qwen2 config."""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest
import yaml
from typer.testing import CliRunner

from ppo_cli.cli import app
from ppo_cli.errors import EXIT_DOES_NOT_FIT
from ppo_cli.plan_memory import (
    CPU_HEAP_RETENTION,
    CPU_HEAP_RETENTION_CHECKPOINTED,
    CPU_HEAP_RETENTION_MAPPED,
    GB,
    QUANT_BYTES,
    RUNTIME_GB,
    Settings,
    activation_floats_per_token_layer,
    describe_model,
    estimate,
    suggestions,
)
from ppo_cli.recipe import LoraConfig
from tests.conftest import ROOT, tiny_overrides

# vocab 100, hidden 16, intermediate 32, 2 layers, 4 heads of 4, 2 KV heads (k/v width 8), tied embeddings.
CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 100, "hidden_size": 16,
    "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "tie_word_embeddings": True, "max_position_embeddings": 64,
}
# By hand: embeddings 100*16 = 1600; per layer q 16*16+16, k 16*8+8, v 16*8+8, o 16*16, gate/up/down 3*16*32,
# two norms 2*16 -> 272+136+136+256+1536+32 = 2368; final norm 16; lm_head tied (0).
TOTAL = 1600 + 2 * 2368 + 16
LINEAR = 2 * (256 + 128 + 128 + 256 + 3 * 512)  # weights of the linear layers, biases excluded
LORA_ALL_R4 = 2 * 4 * ((16 + 16) + (16 + 8) + (16 + 8) + (16 + 16) + 3 * (16 + 32))  # r * (in + out) per layer


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return tmp_path


def settings(**changes) -> Settings:
    base = dict(
        device="cpu", dtype="float32", quantization="none", lora=LoraConfig(r=4, alpha=8), gradient_checkpointing=False,
        reference="adapter", reference_dtype="float32", reference_quantization="none", value_kind="head",
        value_dtype="float32", value_lora=None, rewards=(("float32", "none", 32),), micro_batch=2, mini_batch=4,
        rollout_batch=4, prompt_tokens=6, response_tokens=4,
    )
    base.update(changes)
    return Settings(**base)


def parts(est) -> dict[tuple[str, str], float]:
    return {(line.role, line.part): line.gb * GB for line in est.lines}


def test_meta_device_parameter_counts_match_hand_counts(model_dir):
    shape = describe_model(str(model_dir), "causal_lm")
    assert shape.total_params == TOTAL == 6352
    assert shape.linear_params == LINEAR == 4608
    assert (shape.hidden, shape.intermediate, shape.layers, shape.heads, shape.kv_heads, shape.head_dim, shape.vocab) == (
        16, 32, 2, 4, 2, 4, 100)
    assert shape.lora_params(LoraConfig(r=4)) == LORA_ALL_R4 == 2048
    assert shape.lora_params(LoraConfig(r=4, target_modules=["q_proj", "v_proj"])) == 2 * 4 * ((16 + 16) + (16 + 8))
    assert shape.lora_params(None) == 0
    classifier = describe_model(str(model_dir), "classifier")  # no LM head, a 1-output score head instead
    assert classifier.total_params == TOTAL + 16 * classifier_labels(model_dir)


def test_lora_targets_match_as_peft_matches_them(model_dir):
    """A module's name or its end after a dot, any module (lm_head, the embeddings); all-linear's list leaves
    lm_head out, as peft does."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = describe_model(str(model_dir), "causal_lm")
    assert shape.linear_names == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    found = ["q_proj", "self_attn.o_proj", "lm_head", "embed_tokens", "model.layers.1.mlp.up_proj"]
    assert shape.unmatched_targets([*found, "proj", "foo_proj", "attn.q_proj"]) == ["proj", "foo_proj", "attn.q_proj"]
    config = AutoConfig.from_pretrained(model_dir)
    for target in found:  # peft finds each alone
        get_peft_model(AutoModelForCausalLM.from_config(config), PeftLoraConfig(r=2, target_modules=[target]))
    for target in ("proj", "attn.q_proj"):  # and none of these
        with pytest.raises(ValueError, match="not found in the base model"):
            get_peft_model(AutoModelForCausalLM.from_config(config), PeftLoraConfig(r=2, target_modules=[target]))


def classifier_labels(model_dir) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir).num_labels


def test_weights_quantized_and_not(model_dir):
    shape = describe_model(str(model_dir), "causal_lm")
    assert shape.weight_bytes("float32") == TOTAL * 4
    assert shape.weight_bytes("bfloat16") == TOTAL * 2
    assert shape.weight_bytes("float32", "4bit") == pytest.approx(LINEAR * QUANT_BYTES["4bit"] + (TOTAL - LINEAR) * 4)
    assert shape.weight_bytes("bfloat16", "8bit") == LINEAR * 1 + (TOTAL - LINEAR) * 2


def test_lora_estimate_parts(model_dir):
    shape = describe_model(str(model_dir), "causal_lm")
    reward = describe_model(str(model_dir), "classifier")
    est = estimate(settings(), shape, None, [reward])
    p = parts(est)
    assert p["policy", "weights"] == pytest.approx(TOTAL * 4)
    assert p["policy", "LoRA adapter"] == pytest.approx(2048 * 4)
    assert p["policy", "gradients"] == pytest.approx(2048 * 4)
    assert p["policy", "AdamW states"] == pytest.approx(2 * 2048 * 4)
    assert p["reference", "weights"] == 0  # the adapter disabled
    assert p["value", "head"] == pytest.approx(17 * 4)
    # micro-batch 2 x (6 + 4) tokens x 2 layers x (8H + 4I + 7r + L/2) x 4 B, frozen base
    per = 8 * 16 + 4 * 32 + 7 * 4 + 10 / 2
    assert activation_floats_per_token_layer(shape, trains_weights=False, lora_r=4, seq_len=10) == per
    assert p["policy", "activations (update)"] == pytest.approx(2 * 10 * 2 * per * 4)
    assert p["policy", "logits (update)"] == pytest.approx(4 * 2 * 4 * 100 * 4)  # 4 copies of B x T x V, float32
    # KV cache: 2 (k, v) x 2 layers x 2 KV heads x head dim 4 x rollout batch 4 x 10 tokens x 4 B
    assert p["rollout", "KV cache"] == pytest.approx(2 * 2 * 2 * 4 * 4 * 10 * 4)
    static = sum(v for (role, part), v in p.items() if "update" not in part and role != "rollout")
    assert est.total_gb * GB == pytest.approx(static + max(est.update_gb, est.rollout_gb) * GB)


def test_lora_on_a_half_precision_base_keeps_float32_input_copies(model_dir):
    """peft casts each adapted layer's bf16 input to its float32 adapter and keeps the copy for the backward
    (the 1.5B recipe on an H200: 0.578 GB of them at the update's peak, planned 0.578)."""
    shape = describe_model(str(model_dir), "causal_lm")
    half = parts(estimate(settings(dtype="bfloat16", device="cuda"), shape, None, []))
    # micro-batch 2 x 10 tokens x per layer (q, k, v, o, gate, up: in 16 each; down: in 32) x 2 layers x 4 B
    assert half["policy", "LoRA input casts (update)"] == pytest.approx(2 * 10 * 2 * (6 * 16 + 32) * 4)
    q_v = parts(estimate(settings(dtype="bfloat16", device="cuda", lora=LoraConfig(r=4, target_modules=["q_proj", "v_proj"])),
                         shape, None, []))
    assert q_v["policy", "LoRA input casts (update)"] == pytest.approx(2 * 10 * 2 * (16 + 16) * 4)
    checkpointed = parts(estimate(settings(dtype="bfloat16", device="cuda", gradient_checkpointing=True), shape, None, []))
    assert checkpointed["policy", "LoRA input casts (update)"] == pytest.approx(2 * 10 * (6 * 16 + 32) * 4)  # one layer
    for no_casts in (settings(device="cuda"),  # float32 base: the input is float32 already
                     settings(dtype="bfloat16", device="cuda", lora=None),  # no adapters
                     settings(dtype="bfloat16", device="cuda", mixed_precision="bf16")):  # autocast: not measured on a GPU
        assert ("policy", "LoRA input casts (update)") not in parts(estimate(no_casts, shape, None, []))


def test_an_entropy_bonus_keeps_more_logits_copies(model_dir):
    """With ppo.entropy_coef > 0 the entropy's softmax and its gradients join the log-softmax's: 7 float32
    copies of the response logits at the backward's peak, measured on an H200 (4 without)."""
    shape = describe_model(str(model_dir), "causal_lm")
    bonus = parts(estimate(settings(entropy_bonus=True), shape, None, []))
    assert bonus["policy", "logits (update)"] == pytest.approx(7 * 2 * 4 * 100 * 4)


def test_logits_are_counted_for_one_chunk_of_positions_at_a_real_vocabulary(tmp_path):
    """engine/logprobs.py computes log-probs 2**23 logits at a time: at SmolLM2's 49,152 tokens a chunk
    is 170 positions, so a 16 x 48 micro-batch holds 170 positions' logits, not 768."""
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "vocab_size": 49152}))
    shape = describe_model(str(tmp_path), "causal_lm")
    assert shape.logits_chunk == 2**23 // 49152 == 170
    big = settings(micro_batch=16, response_tokens=48)
    p = parts(estimate(big, shape, None, []))
    assert p["policy", "logits (update)"] == pytest.approx(4 * 170 * 49152 * 4)  # 4 copies of one chunk
    bonus = parts(estimate(settings(micro_batch=16, response_tokens=48, entropy_bonus=True), shape, None, []))
    assert bonus["policy", "logits (update)"] == pytest.approx(7 * 170 * 49152 * 4)
    # the rollout's no-grad forward: one layer's temporaries + 2 copies of one chunk's logits
    layer = 16 * (6 + 48) * (3 * 32 + 4 * 16) * 4
    assert p["rollout", "no-grad forward working set"] == pytest.approx(layer + 2 * 170 * 49152 * 4)
    small = parts(estimate(settings(micro_batch=2, response_tokens=4), shape, None, []))
    assert small["policy", "logits (update)"] == pytest.approx(4 * 2 * 4 * 49152 * 4)  # 8 positions: one chunk, whole


def test_a_class_whose_log_probs_take_its_own_logits_is_counted_whole(tmp_path):
    """Starcoder2 is not in engine/logprobs.py's HEAD_STEPS: its log-probs come from forward().logits, all
    the micro-batch's positions at once."""
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "architectures": ["Starcoder2ForCausalLM"],
                                                      "model_type": "starcoder2", "vocab_size": 49152}))
    shape = describe_model(str(tmp_path), "causal_lm")
    assert shape.logits_chunk is None
    p = parts(estimate(settings(micro_batch=16, response_tokens=48), shape, None, []))
    assert p["policy", "logits (update)"] == pytest.approx(4 * 16 * 48 * 49152 * 4)


def test_cpu_adds_the_heap_retention_of_the_update_only_on_cpu(model_dir):
    shape = describe_model(str(model_dir), "causal_lm")
    reward = describe_model(str(model_dir), "classifier")
    for lora, key in ((LoraConfig(r=4, alpha=8), "frozen_base"), (None, "trained")):
        cpu = parts(estimate(settings(lora=lora), shape, None, [reward]))
        activations = cpu["policy", "activations (update)"]  # not the logits
        assert cpu["runtime", "freed memory kept (update)"] == pytest.approx(CPU_HEAP_RETENTION[key] * activations)
        cuda = parts(estimate(settings(lora=lora, device="cuda"), shape, None, [reward]))
        assert ("runtime", "freed memory kept (update)") not in cuda


def test_full_finetune_parts(model_dir):
    shape = describe_model(str(model_dir), "causal_lm")
    value = describe_model(str(model_dir), "backbone")
    est = estimate(settings(lora=None, reference="copy", value_kind="model", dtype="bfloat16",
                            reference_dtype="bfloat16", value_dtype="bfloat16", rewards=()), shape, value, [])
    p = parts(est)
    assert p["policy", "gradients"] == pytest.approx(TOTAL * 2)
    assert p["policy", "AdamW states"] == pytest.approx(2 * TOTAL * 2)  # states in the parameters' dtype
    assert p["reference", "weights"] == pytest.approx(TOTAL * 2)
    assert value.total_params == TOTAL - 0  # backbone only: the tied LM head adds no parameters
    assert p["value", "weights"] == pytest.approx(value.total_params * 2)
    assert p["value", "gradients + AdamW states"] == pytest.approx(3 * (value.total_params + 17) * 2)
    per = 10 * 16 + 4 * 32 + 10 / 2  # the weights train: norms' inputs kept too
    assert p["policy", "activations (update)"] == pytest.approx(2 * 10 * 2 * per * 2)
    assert p["value", "activations (update)"] == pytest.approx(2 * 10 * 2 * per * 2)


def test_the_value_adapters_forward_is_checkpointed_as_the_policys(model_dir):
    """value.kind adapter: with checkpointing its forward keeps the layers' inputs and one layer's
    activations (the recompute runs under the value adapter: ActorCritic.recompute_under_the_forwards_adapter)."""
    shape = describe_model(str(model_dir), "causal_lm")
    on = parts(estimate(settings(value_kind="adapter", gradient_checkpointing=True, rewards=()), shape, None, []))
    off = parts(estimate(settings(value_kind="adapter", rewards=()), shape, None, []))
    per_layer = off["value", "activations (update)"] / (2 * 10 * 2 * 4)  # micro-batch 2 x 10 tokens, 2 layers, 4 B
    assert on["value", "activations (update)"] == pytest.approx(2 * 10 * (2 * 16 + per_layer) * 4)
    assert on["value", "activations (update)"] == pytest.approx(on["policy", "activations (update)"])


def test_8bit_adamw_keeps_one_byte_per_moment(model_dir):
    shape = describe_model(str(model_dir), "causal_lm")
    value = describe_model(str(model_dir), "backbone")
    est = estimate(settings(lora=None, reference="copy", value_kind="model", rewards=(), optimizer="adamw_8bit"),
                   shape, value, [])
    p = parts(est)
    assert p["policy", "gradients"] == pytest.approx(TOTAL * 4)  # gradients stay in the weights' dtype
    assert p["policy", "AdamW states"] == pytest.approx(2 * TOTAL * 1)
    assert p["value", "gradients + AdamW states"] == pytest.approx((value.total_params + 17) * (4 + 2 * 1))


def test_frozen_value_model_costs_its_weights_and_a_trained_head_only(model_dir):
    shape = describe_model(str(model_dir), "causal_lm")
    value = describe_model(str(model_dir), "backbone")
    est = estimate(settings(value_kind="model", value_dtype="bfloat16", value_frozen=True, rewards=()), shape, value, [])
    p = parts(est)
    assert p["value", "weights"] == pytest.approx(value.total_params * 2)
    assert p["value", "gradients + AdamW states"] == pytest.approx(3 * 17 * 4)  # hidden 16 + bias, float32
    assert ("value", "activations (update)") not in p  # a frozen forward keeps nothing for the backward


def test_no_critic_counts_nothing_for_the_value(model_dir):
    shape = describe_model(str(model_dir), "causal_lm")
    with_head = estimate(settings(), shape, None, [])
    est = estimate(settings(value_kind="none"), shape, None, [])
    assert [line for line in est.lines if line.role == "value"] == []
    assert with_head.total_gb * GB - est.total_gb * GB == pytest.approx(17 * 4 + 3 * 17 * 4)  # the head, its grads + AdamW
    s = settings(value_kind="none", lora=None, reference="copy")
    fixes = suggestions(s, {"policy": shape, "value": None, "rewards": []}, budget_gb=0.0)
    assert fixes[0].overrides == ["policy.lora={r: 16}"]  # no critic to offer a head for
    assert not any("value.kind=head" in f.overrides for f in fixes)


@pytest.mark.slow
def test_frozen_value_model_on_the_reward_model_costs_no_second_copy(tiny_models, tmp_path):
    from ppo_cli.plan_memory import settings_from_recipe
    from ppo_cli.recipe_loading import load_recipe

    sets = {"value.kind": "model", "value.init_from": "reward", "value.train_backbone": "false"}
    recipe = load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml", tiny_overrides(tiny_models, tmp_path, **sets))
    s = settings_from_recipe(recipe, "cpu", prompt_len=8)
    assert s.value_frozen and s.value_shared
    shape = describe_model(str(tiny_models / "policy"), "causal_lm")
    value = describe_model(str(tiny_models / "reward"), "backbone")
    assert parts(estimate(s, shape, value, [value]))["value", "weights"] == 0.0
    sets["reward.components.0.dtype"] = "bfloat16"  # another dtype: a copy of its own
    recipe = load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml", tiny_overrides(tiny_models, tmp_path, **sets))
    assert not settings_from_recipe(recipe, "cpu", prompt_len=8).value_shared


def test_gradient_checkpointing_keeps_layer_inputs_only(model_dir):
    shape = describe_model(str(model_dir), "causal_lm")
    est = estimate(settings(gradient_checkpointing=True), shape, None, [])
    per = 2 * 16 + (8 * 16 + 4 * 32 + 7 * 4 + 5)  # 2 layer inputs + one layer being recomputed
    assert parts(est)["policy", "activations (update)"] == pytest.approx(2 * 10 * per * 4)


def test_checkpointed_update_on_cpu_keeps_heap_in_what_the_layers_compute_and_free(model_dir):
    shape = describe_model(str(model_dir), "causal_lm")
    cpu = parts(estimate(settings(gradient_checkpointing=True), shape, None, []))
    # 2 rows x 10 tokens x 2 layers x (8 x 16 + 4 x 32 + 7 x 4 LoRA + 10 / 2 mask) x 4 B = 46,240 B computed and
    # freed by the layers' forwards and recomputes; 0.8 of it stays resident, not 0.8 of the layer inputs kept
    assert CPU_HEAP_RETENTION_CHECKPOINTED == 0.8
    assert cpu["runtime", "freed memory kept (update)"] == pytest.approx(0.8 * 46_240)
    # the same activations kept whole (no checkpointing): the heap term stays 2.2 x them
    whole = parts(estimate(settings(), shape, None, []))
    assert whole["policy", "activations (update)"] == pytest.approx(46_240)
    assert whole["runtime", "freed memory kept (update)"] == pytest.approx(2.2 * 46_240)
    cuda = parts(estimate(settings(gradient_checkpointing=True, device="cuda"), shape, None, []))
    assert ("runtime", "freed memory kept (update)") not in cuda


def test_a_checkpointed_update_whose_large_blocks_are_mapped_keeps_less_heap(model_dir):
    """engine/malloc.heap_mapped: where large blocks get huge pages a checkpointed update maps them and
    each goes back to the kernel when freed; without checkpointing the heap is kept as before, and so it
    is where the hidden-state blocks are below the 2 MiB mapped (they stay in the heap and split it)."""
    shape = describe_model(str(model_dir), "causal_lm")
    # 64 x 512 tokens x 16 hidden x 4 B = 2 MiB: the hidden-state blocks are mapped
    big = dict(gradient_checkpointing=True, micro_batch=64, prompt_tokens=6, response_tokens=506)
    mapped = parts(estimate(settings(**big, cpu_heap_mapped=True), shape, None, []))
    kept = parts(estimate(settings(**big), shape, None, []))
    computed = kept["runtime", "freed memory kept (update)"] / 0.8
    small = parts(estimate(settings(gradient_checkpointing=True, cpu_heap_mapped=True), shape, None, []))
    assert small["runtime", "freed memory kept (update)"] == pytest.approx(0.8 * 46_240)  # 2 x 10 x 16 x 4 B blocks
    # 0.2 (CPU_HEAP_RETENTION_MAPPED) instead of 0.8 of what the checkpointed layers compute and free
    assert CPU_HEAP_RETENTION_MAPPED == 0.2
    assert mapped["runtime", "freed memory kept (update)"] == pytest.approx(0.2 * computed)
    freed = ("runtime", "freed memory kept (update)")
    assert {k: v for k, v in kept.items() if k != freed} == {k: v for k, v in mapped.items() if k != freed}
    whole = parts(estimate(settings(cpu_heap_mapped=True), shape, None, []))
    assert whole["runtime", "freed memory kept (update)"] == pytest.approx(2.2 * 46_240)
    # FSDP maps its gathered blocks its own way and trims the heap's top: the factor's line as measured on
    # one process, and up to what was measured under FSDP (FSDP_CPU_HEAP_KEPT_PER_LAYER_HIDDEN) a line of
    # its own, which checkpointing does not shrink (plan_checkpointing leaves it out of the activations)
    gathers = ("runtime", "freed heap of the gathers (update)")
    fsdp = parts(estimate(settings(gradient_checkpointing=True, cpu_heap_mapped=True, processes=2, sharding="fsdp"),
                          shape, None, []))
    assert fsdp[freed] == pytest.approx(0.8 * 46_240)
    assert fsdp[freed] + fsdp[gathers] == pytest.approx(2 * 16 * 24_000)  # layers x hidden x 24 KB
    one_process = parts(estimate(settings(gradient_checkpointing=True, cpu_heap_mapped=True, processes=1,
                                          sharding="fsdp"), shape, None, []))
    assert gathers not in one_process  # nothing gathered
    huge = dict(gradient_checkpointing=True, micro_batch=4096, prompt_tokens=6, response_tokens=4000)
    fsdp_huge = parts(estimate(settings(**huge, processes=2, sharding="fsdp"), shape, None, []))
    assert fsdp_huge[freed] > 2 * 16 * 24_000 and gathers not in fsdp_huge
    assert gathers not in parts(estimate(settings(device="cuda", processes=2, sharding="fsdp"), shape, None, []))


def test_suggestions_for_a_full_finetune_that_does_not_fit(model_dir):
    shape = describe_model(str(model_dir), "causal_lm")
    s = settings(lora=None, reference="copy", value_kind="model", micro_batch=4)
    shapes = {"policy": shape, "value": describe_model(str(model_dir), "backbone"), "rewards": [shape]}
    total = estimate(s, shape, shapes["value"], [shape]).total_gb
    budget = RUNTIME_GB["cpu"] + 0.5 * (total - RUNTIME_GB["cpu"])  # half of what the models need
    fixes = suggestions(s, shapes, budget_gb=budget)
    by_change = {f.change.split(" (")[0]: f for f in fixes}
    assert by_change["train a LoRA adapter"].overrides == ["policy.lora={r: 16}", "value.kind=head"]
    assert by_change["train a LoRA adapter"].total_gb < total
    assert by_change["8-bit AdamW"].overrides == ["optim.name=adamw_8bit"]
    assert by_change["8-bit AdamW"].total_gb < total
    assert [f.overrides for f in fixes if f.change.startswith("micro-batch")] == [
        ["ppo.micro_batch_size=2"], ["ppo.micro_batch_size=1"]]  # divisors of the mini-batch (4) only
    combined = fixes[-1]
    assert combined.change == "all of the above" and combined.fits
    assert "reference.quantization=4bit" not in combined.overrides  # no copy left once LoRA is on
    assert all(f.total_gb < total for f in fixes)


@pytest.mark.slow
def test_plan_command_on_the_tiny_recipe(tiny_models, tmp_path):
    args = ["plan", str(ROOT / "recipes" / "tiny_sentiment.yaml"), "--gpu-memory", "0.1"]
    for item in tiny_overrides(tiny_models, tmp_path, **{"policy.lora": "null", "value.kind": "model"}):
        args += ["--set", item]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == EXIT_DOES_NOT_FIT, result.output
    assert "does NOT fit" in result.output and "policy.lora" in result.output
    # The suggested command, on one line whatever the width, keeps the user's overrides and validates.
    apply = [line for line in result.output.splitlines() if line.startswith('to apply "')]
    assert len(apply) == 1, result.output
    argv = shlex.split(apply[0].split(": ", 1)[1])
    assert argv[:3] == ["ppo", "train", args[1]] and argv[3:3 + len(args) - 4] == args[4:]
    resolved = CliRunner().invoke(app, ["validate", *argv[2:]])
    assert resolved.exit_code == 0, resolved.output
    assert "policy.lora" in apply[0] and yaml.safe_load(resolved.stdout)["policy"]["lora"]["r"] == 16
    assert not any(tmp_path.iterdir())  # nothing loaded, nothing written


# --- several processes: --num-processes N --sharding ----------------------------------------------


def full_finetune(**changes) -> Settings:
    return settings(lora=None, reference="copy", rewards=(("float32", "none", 32),), **changes)


def test_zero2_splits_gradients_and_adamw_states_of_what_trains_only(model_dir):
    shape = describe_model(str(model_dir), "causal_lm")
    reward = describe_model(str(model_dir), "classifier")
    one = parts(estimate(full_finetune(), shape, None, [reward]))
    ddp = parts(estimate(full_finetune(processes=4), shape, None, [reward]))
    assert ddp == one  # DDP: every process holds everything
    z2 = parts(estimate(full_finetune(processes=4, sharding="zero2"), shape, None, [reward]))
    assert z2["policy", "gradients"] == pytest.approx(TOTAL * 4 / 4)
    assert z2["policy", "AdamW states"] == pytest.approx(2 * TOTAL * 4 / 4)
    assert z2["value", "gradients + AdamW states"] == pytest.approx(17 * (4 + 2 * 4) / 4)  # the value head
    assert z2["policy", "weights"] == z2["reference", "weights"] == pytest.approx(TOTAL * 4)  # whole
    assert z2["reward", f"weights ({model_dir.name})"] == pytest.approx(reward.total_params * 4)
    assert ("rollout", "policy gathered for generation") not in z2


@pytest.mark.parametrize("sharding", ["zero3", "fsdp"])
def test_zero3_and_fsdp_also_split_the_policy_and_gather_it_to_generate(model_dir, sharding):
    shape = describe_model(str(model_dir), "causal_lm")
    reward = describe_model(str(model_dir), "classifier")
    est = estimate(full_finetune(processes=4, sharding=sharding), shape, None, [reward])
    p = parts(est)
    assert p["policy", "weights"] == pytest.approx(TOTAL * 4 / 4)
    assert p["policy", "gradients"] == pytest.approx(TOTAL * 4 / 4)
    assert p["value", "head"] == pytest.approx(17 * 4 / 4)
    assert p["reference", "weights"] == pytest.approx(TOTAL * 4)  # frozen copy: whole on every process
    # Sampling needs the whole policy: DeepSpeed gathers the other 3 processes' quarters beside its own;
    # FSDP2 gathers all four quarters into buffers of its own, the process's shard staying beside them.
    gathered = TOTAL * 4 if sharding == "fsdp" else TOTAL * 4 * 3 / 4
    assert p["rollout", "policy gathered for generation"] == pytest.approx(gathered)
    assert p["policy", "one layer gathered (update)"] == pytest.approx(TOTAL * 4 / 2)  # 2 layers
    # FSDP2 on CPU also holds the next layer it prefetches and the buffer it all-gathers into (measured)
    in_flight = p.get(("policy", "next layer and all-gather buffer (update)"))
    assert in_flight == (pytest.approx(2 * TOTAL * 4 / 2) if sharding == "fsdp" else None)
    # 6352 x 4 B x (1/4 weights + 1/4 gradients + 2/4 AdamW) + head (17 x 4 + 17 x 12) / 4 + reference + reward
    # (FSDP shards the frozen reward model too: a quarter of it; DeepSpeed leaves it whole)
    static = sum(v for (role, part), v in p.items() if "update" not in part and role != "rollout")
    reward_share = 1 / 4 if sharding == "fsdp" else 1
    assert static == pytest.approx(TOTAL * 4 * (1 + 1 + 2) / 4 + 17 * 16 / 4 + TOTAL * 4
                                   + reward.total_params * 4 * reward_share + RUNTIME_GB["cpu"] * GB)
    assert (("rollout", "reward model gathered for scoring") in p) == (sharding == "fsdp")


def test_fsdp_scoring_gathers_the_reward_models_root_and_one_block(model_dir):
    shape = describe_model(str(model_dir), "causal_lm")
    reward = describe_model(str(model_dir), "classifier")
    p = parts(estimate(full_finetune(processes=4, sharding="fsdp", fsdp_per_block=True), shape, None, [reward]))
    # what no block holds, the other 3 quarters, and one of the 2 blocks whole, x 4 B (float32)
    outside, linear = reward.total_params - reward.linear_params, reward.linear_params
    assert p["rollout", "reward model gathered for scoring"] == pytest.approx(outside * 4 * 3 / 4 + linear * 4 / 2)
    # a 4-bit reward model stays whole and gathers nothing
    quantized = dataclasses.replace(full_finetune(processes=4, sharding="fsdp"), rewards=(("float32", "4bit", 8),))
    q = parts(estimate(quantized, shape, None, [reward]))
    assert ("rollout", "reward model gathered for scoring") not in q
    assert q["reward", next(part for role, part in q if role == "reward")] == pytest.approx(
        reward.weight_bytes("float32", "4bit"))


def test_fsdp_per_block_rollout_gathers_what_no_block_holds_and_one_block(model_dir):
    shape = describe_model(str(model_dir), "causal_lm")
    reward = describe_model(str(model_dir), "classifier")
    p = parts(estimate(full_finetune(processes=4, sharding="fsdp", fsdp_per_block=True), shape, None, [reward]))
    # Outside the blocks: (6352 - 4608 linear weights) x 4 B, the other 3 quarters; one block: 4608 / 2 layers x 4 B.
    assert p["rollout", "policy gathered for generation"] == pytest.approx((TOTAL - LINEAR) * 4 * 3 / 4 + LINEAR * 4 / 2)
    # ZeRO-3 (DeepSpeed's gather for generation) has no per-block rollout.
    z3 = parts(estimate(full_finetune(processes=4, sharding="zero3", fsdp_per_block=True), shape, None, [reward]))
    assert z3["rollout", "policy gathered for generation"] == pytest.approx(TOTAL * 4 * 3 / 4)


def test_fsdp_under_bf16_counts_every_gather_at_2_bytes_and_the_shards_at_their_own(model_dir):
    shape = describe_model(str(model_dir), "causal_lm")
    reward = describe_model(str(model_dir), "classifier")
    f32 = parts(estimate(full_finetune(processes=4, sharding="fsdp", fsdp_per_block=True), shape, None, [reward]))
    bf16 = parts(estimate(full_finetune(processes=4, sharding="fsdp", fsdp_per_block=True, mixed_precision="bf16"),
                          shape, None, [reward]))
    outside, linear = TOTAL - LINEAR, LINEAR
    # float32 gathers: the other 3 quarters of what no block holds + one of 2 blocks, x 4 B; bf16: x 2 B
    assert f32["rollout", "policy gathered for generation"] == pytest.approx(outside * 4 * 3 / 4 + linear * 4 / 2)
    assert bf16["rollout", "policy gathered for generation"] == pytest.approx(outside * 2 * 3 / 4 + linear * 2 / 2)
    routside, rlinear = reward.total_params - reward.linear_params, reward.linear_params
    assert bf16["rollout", "reward model gathered for scoring"] == pytest.approx(routside * 2 * 3 / 4 + rlinear * 2 / 2)
    assert bf16["policy", "one layer gathered (update)"] == pytest.approx(TOTAL * 2 / 2)  # 6352 x 2 B / 2 layers
    # the shards stay float32: a quarter of 6352 x 4 B, as without mixed precision
    assert bf16["policy", "weights"] == f32["policy", "weights"] == pytest.approx(TOTAL * 4 / 4)
    assert bf16["policy", "gradients"] == pytest.approx(TOTAL * 4 / 4)
    # the gathered weights arrive in bf16: autocast makes no copies of them (one process does: 4608 x 2 B)
    one = parts(estimate(full_finetune(mixed_precision="bf16"), shape, None, [reward]))
    assert one["policy", "autocast weight copies (update)"] == pytest.approx(LINEAR * 2)
    assert ("policy", "autocast weight copies (update)") not in bf16
    # the whole policy gathered at once (train.fsdp_rollout: gathered): 6352 x 2 B beside the float32 shard
    whole = parts(estimate(full_finetune(processes=4, sharding="fsdp", mixed_precision="bf16"), shape, None, [reward]))
    assert whole["rollout", "policy gathered for generation"] == pytest.approx(TOTAL * 2)


def test_fsdp_lora_under_bf16_gathers_base_and_adapters_at_2_bytes(model_dir):
    shape = describe_model(str(model_dir), "causal_lm")
    p = parts(estimate(settings(processes=2, sharding="fsdp", mixed_precision="bf16"), shape, None, []))
    # base 6352 + adapters 2048 (r=4 on every linear layer), gathered whole in bf16
    assert p["rollout", "policy gathered for generation"] == pytest.approx((TOTAL + LORA_ALL_R4) * 2)
    assert p["policy", "LoRA adapter"] == pytest.approx(LORA_ALL_R4 * 4 / 2)  # float32 master weights, halved


def test_a_quantized_policy_base_stays_whole_under_zero3(model_dir):
    shape = describe_model(str(model_dir), "causal_lm")
    lora = LoraConfig(r=4, alpha=8)
    p = parts(estimate(settings(lora=lora, quantization="4bit", processes=2, sharding="zero3"), shape, None, []))
    assert p["policy", "weights"] == pytest.approx(shape.weight_bytes("float32", "4bit", 4.0))
    assert p["policy", "LoRA adapter"] == pytest.approx(2048 * 4 / 2)
    assert p["rollout", "policy gathered for generation"] == pytest.approx(2048 * 4 / 2)  # only the adapter's other half


@pytest.mark.parametrize("flags, message", [
    (["--sharding", "zero2"], "error: --sharding zero2 splits memory across processes, and there is one"),
    (["--num-processes", "0"], "error: --num-processes must be at least 1, got 0"),
    (["--num-processes", "2", "--sharding", "zero4"], "error: unknown --sharding 'zero4'"),
])
def test_bad_plan_flags_are_one_line(flags, message):
    result = CliRunner().invoke(app, ["plan", str(ROOT / "recipes" / "tiny_sentiment.yaml"), *flags])
    assert result.exit_code == 2
    assert result.stderr.splitlines()[0] == message


@pytest.mark.slow
def test_plan_command_per_process(tiny_models, tmp_path):
    args = ["plan", str(ROOT / "recipes" / "tiny_sentiment.yaml"), "--num-processes", "4", "--sharding", "zero3"]
    for item in tiny_overrides(tiny_models, tmp_path, **{"policy.lora": "null", "value.kind": "head"}):
        args += ["--set", item]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "memory plan (per process of 4, zero3, cpu" in result.output
    assert "policy gathered for generation" in result.output


def test_mixed_precision_halves_float32_activations_and_frozen_linears_and_adds_autocast_copies_when_weights_train(model_dir):
    shape = describe_model(str(model_dir), "causal_lm")
    for lora in (LoraConfig(r=4, alpha=8), None):
        fp32 = parts(estimate(settings(lora=lora), shape, None, []))
        bf16 = parts(estimate(settings(lora=lora, mixed_precision="bf16"), shape, None, []))
        assert bf16["policy", "activations (update)"] == pytest.approx(fp32["policy", "activations (update)"] / 2)
        assert bf16["policy", "logits (update)"] == fp32["policy", "logits (update)"]  # upcast to float32
        # float32 after RoPE in transformers' cache; held in bf16 in the reserved one (a Llama here)
        assert shape.shares_prompts and bf16["rollout", "KV cache"] == pytest.approx(fp32["rollout", "KV cache"] / 2)
        if lora is None:
            assert bf16["policy", "weights"] == fp32["policy", "weights"]  # float32 master weights
        else:  # the frozen base's linear layers stored in bf16, the rest float32
            assert bf16["policy", "weights"] == pytest.approx(fp32["policy", "weights"] - LINEAR * 2)
    assert bf16["policy", "autocast weight copies (update)"] == pytest.approx(LINEAR * 2)  # full fine-tune (lora None)
    unlisted = dataclasses.replace(shape, shares_prompts=False)  # a class that keeps transformers' cache
    assert (parts(estimate(settings(mixed_precision="bf16"), unlisted, None, []))["rollout", "KV cache"]
            == parts(estimate(settings(), unlisted, None, []))["rollout", "KV cache"])
    lora_bf16 = parts(estimate(settings(mixed_precision="bf16"), shape, None, []))
    assert ("policy", "autocast weight copies (update)") not in lora_bf16  # frozen base: cast per use, not cached


@pytest.mark.parametrize("setting, dtype, expected", [
    ("auto", "float32", "bf16"), ("auto", "bfloat16", "no"), ("no", "float32", "no"), ("fp16", "float32", "fp16"),
])
def test_plan_for_a_gpu_elsewhere_assumes_bf16_support(monkeypatch, setting, dtype, expected):
    from types import SimpleNamespace

    import torch

    from ppo_cli.commands.plan import planned_precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    recipe = SimpleNamespace(train=SimpleNamespace(mixed_precision=setting))
    assert planned_precision(recipe, "cuda", getattr(torch, dtype)).value == expected


# Qwen2.5-0.5B's layer sizes with the tiny tokenizer's vocabulary, as benchmarks/bench_sharding.py --shape 0.5b builds it.
BENCH_05B = {**CONFIG, "vocab_size": 1089, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 512}


# SmolLM2-135M-Instruct's config (scripts/fetch_smollm2.py writes it beside the weights).
SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
           "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "tie_word_embeddings": True, "max_position_embeddings": 8192}


@pytest.mark.parametrize("config, sharding, batch, tokens, measured_gb", [
    (BENCH_05B, "none", (2, 4), (7, 16), 4.52),
    (BENCH_05B, "fsdp", (2, 4), (7, 16), 3.33),
    (BENCH_05B, "fsdp", (4, 8), (7, 32), 2.89),
    ({**BENCH_05B, "num_hidden_layers": 6}, "fsdp", (2, 4), (7, 16), 1.43),
    (SMOLLM2, "fsdp", (2, 4), (43, 16), 1.37),
], ids=["0.5b-ddp", "0.5b-fsdp", "0.5b-fsdp-4x39", "0.5b-6-layers-fsdp", "smollm2-fsdp"])
def test_plan_follows_the_measured_peak_of_two_processes(tmp_path, config, sharding, batch, tokens, measured_gb):
    """`PPO_BENCH_CACHE=... python benchmarks/bench_sharding.py --shape 0.5b --modes lora [--set ...]`, 2 CPU
    processes over gloo, LoRA r=16 all-linear, value adapter, float32, the larger process's peak RSS
    (2026-11-28 20:04-20:30, AMD EPYC without AVX-512, 2 cores, the value adapter's forward checkpointed;
    docs/distributed.md, "FSDP2 with LoRA: the plan against the peak"). The 0.5B widths with a reward model
    of the same shape (sharded under FSDP): micro-batch 2 x (7 + 16) tokens, rollout 4: DDP 4.52 GB, FSDP
    3.33; micro-batch 4 x (7 + 32), rollout 8: FSDP 2.89; 6 of their layers, 2 x (7 + 16): FSDP 1.43.
    SmolLM2 (its real weights) with a Python reward, 2 x (43 + 16), rollout 4: FSDP 1.37.
    Gradient checkpointing as `auto` chose: off under DDP, on under FSDP (there the update's activations
    are its largest term). The plan stays within 25%."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = describe_model(str(tmp_path), "causal_lm")
    rewards = [] if config is SMOLLM2 else [describe_model(str(tmp_path), "classifier")]
    (micro, rollout), (prompt, response) = batch, tokens
    s = settings(lora=LoraConfig(r=16, alpha=32), value_kind="adapter", micro_batch=micro, mini_batch=micro,
                 rollout_batch=rollout, prompt_tokens=prompt, response_tokens=response, processes=2,
                 sharding=sharding, fsdp_per_block=sharding == "fsdp", gradient_checkpointing=sharding == "fsdp",
                 rewards=(("float32", "none", 64),) * len(rewards))
    planned = estimate(s, shape, None, rewards).total_gb
    assert 0.75 <= planned / measured_gb <= 1.25, planned


def test_an_environment_plans_max_episode_tokens_after_the_prompt(tmp_path):
    """Episodes of several turns: every token after the prompt (the policy's turns and the environment's
    messages) counts, up to environment.max_episode_tokens, not one turn's max_new_tokens."""
    from ppo_cli.plan_memory import response_budget, settings_from_recipe
    from ppo_cli.recipe_loading import load_recipe

    env = "{type: tools, tools: ['recipes/tools/calculator.py:calculate'], max_episode_tokens: 200}"
    one_turn = load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml", ["generation.max_new_tokens=24"])
    episodes = load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml", ["generation.max_new_tokens=24", f"environment={env}"])
    assert (response_budget(one_turn), response_budget(episodes)) == (24, 200)
    assert settings_from_recipe(episodes, "cpu", prompt_len=8).response_tokens == 200
    tokens = load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml",
                         ["ppo.micro_batch_tokens=832", f"environment={env}", "ppo.mini_batch_size=8",
                          "ppo.micro_batch_size=8"])
    assert settings_from_recipe(tokens, "cpu", prompt_len=8).micro_batch == 4  # 832 // (8 + 200)


def test_plan_notes_the_filter_rounds(tmp_path):
    from ppo_cli.commands.plan import filter_rounds_note
    from ppo_cli.recipe_loading import load_recipe

    path = ROOT / "recipes" / "tiny_grpo.yaml"
    assert filter_rounds_note(load_recipe(path, tiny_overrides(tmp_path, tmp_path))) == ""
    recipe = load_recipe(path, tiny_overrides(tmp_path, tmp_path, **{"ppo.filter_groups": "true", "ppo.max_filter_rounds": 2}))
    assert filter_rounds_note(recipe) == (
        "ppo.filter_groups: 1 to 3 rollouts per update (at most 3 x 64 episodes sampled and scored, 3 x the "
        "rollout's time); memory as one rollout: a round is let go once its kept groups are copied, and at most "
        "rollout_batch_size groups are kept")


def test_a_reward_model_forward_is_counted_in_the_runs_autocast_dtype(model_dir):
    shape = describe_model(str(model_dir), "causal_lm")
    reward = describe_model(str(model_dir), "classifier")
    # 64 rows: the reward's forward, min(32, 64) x 10 tokens x (3 x 32 + 4 x 16) values, is the largest
    big = dict(rollout_batch=64, rewards=(("float32", "none", 32),))
    full = parts(estimate(settings(**big), shape, None, [reward]))["rollout", "no-grad forward working set"]
    half = parts(estimate(settings(**big, mixed_precision="bf16"), shape, None, [reward]))["rollout", "no-grad forward working set"]
    assert full == pytest.approx(32 * 10 * (3 * 32 + 4 * 16) * 4)
    assert half == pytest.approx(32 * 10 * (3 * 32 + 4 * 16) * 2)  # bf16 autocast: 2 B a value


def test_a_tied_head_is_counted_once_more_in_bf16_while_sampling_under_autocast(model_dir):
    """engine/generate.py head_cast_once: a frozen float32 head tied to the embedding is cast to bf16 once
    for each generate() call, a copy of vocab x hidden x 2 B held while sampling."""
    import dataclasses

    shape = describe_model(str(model_dir), "causal_lm")
    assert shape.tied_head  # CONFIG ties them
    cast = ("rollout", "LM head cast for sampling")
    assert parts(estimate(settings(mixed_precision="bf16"), shape, None, []))[cast] == pytest.approx(100 * 16 * 2)
    assert cast not in parts(estimate(settings(), shape, None, []))  # no autocast: the head is used as it is
    assert cast not in parts(estimate(settings(mixed_precision="bf16", lora=None), shape, None, []))  # trained head
    assert cast not in parts(estimate(settings(mixed_precision="bf16", dtype="bfloat16"), shape, None, []))
    assert cast not in parts(estimate(settings(mixed_precision="bf16", sharding="fsdp", processes=2, fsdp_per_block=True),
                                      shape, None, []))  # sharded while sampling: each block's own forward gathers it
    # the recipe's fsdp_rollout per_block without FSDP: the policy is whole while sampling
    assert cast in parts(estimate(settings(mixed_precision="bf16", fsdp_per_block=True), shape, None, []))
    untied = dataclasses.replace(shape, tied_head=False)  # its own head: stored in bf16 with the frozen Linears
    assert cast not in parts(estimate(settings(mixed_precision="bf16"), untied, None, []))


def test_weights_packed_for_sampling_are_counted_where_generate_packs_them(model_dir):
    """engine/packed_linear.py: under bf16 autocast on a CPU whose oneDNN computes bf16, generate() holds each
    adapted layer's weight (joined to its B) and the head laid out a second time, for responses of at least
    MIN_STEPS tokens;
    the head's bf16 copy is then the packed one (no cast line besides)."""
    import torch

    from ppo_cli.engine.packed_linear import MIN_STEPS

    shape = describe_model(str(model_dir), "causal_lm")
    packs = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    weights, head = ("rollout", "bf16 weights packed for sampling"), ("rollout", "LM head packed for sampling")
    long = dict(mixed_precision="bf16", response_tokens=MIN_STEPS)
    got = parts(estimate(settings(**long), shape, None, []))
    if not packs:
        assert weights not in got and head not in got
        return
    # all-linear: every backbone Linear joined to its B, (in + r) x out: 4,608 + 4 x 2 layers x 128 outputs
    assert got[weights] == pytest.approx((LINEAR + 4 * 2 * (16 + 8 + 8 + 16 + 32 + 32 + 16)) * 2)
    assert got[head] == pytest.approx(100 * 16 * 2)
    assert ("rollout", "LM head cast for sampling") not in got
    # train.fsdp_rollout per_block (the recipe's default) counts only under FSDP: one process samples whole
    assert parts(estimate(settings(**long, fsdp_per_block=True), shape, None, []))[weights] == got[weights]
    only_q = parts(estimate(settings(**long, lora=LoraConfig(r=4, alpha=8, target_modules=["q_proj"])), shape, None, []))
    assert only_q[weights] == pytest.approx(2 * (16 + 4) * 16 * 2)  # 2 layers' q_proj, (16 + r 4) x 16
    for change in (dict(response_tokens=MIN_STEPS - 1), dict(mixed_precision="no"), dict(device="cuda"),
                   dict(lora=None), dict(quantization="4bit"), dict(pack_weights=False),
                   dict(sharding="fsdp", processes=2, fsdp_per_block=True)):
        got = parts(estimate(settings(**{**long, **change}), shape, None, []))
        assert weights not in got and head not in got, change


def test_the_recipe_can_keep_the_packed_copies_memory_and_the_plan_offers_it(model_dir):
    """generation.pack_weights false (or a vLLM backend, which never calls generate()) plans no packed
    copies; where they are planned, an over-budget plan offers generation.pack_weights=false."""
    from ppo_cli.engine.packed_linear import MIN_STEPS
    from ppo_cli.plan_memory import sampling_packs, settings_from_recipe
    from ppo_cli.recipe_loading import load_recipe

    recipe = ROOT / "recipes" / "tiny_sentiment.yaml"
    assert settings_from_recipe(load_recipe(recipe, []), "cpu", prompt_len=8).pack_weights
    assert not settings_from_recipe(load_recipe(recipe, ["generation.pack_weights=false"]), "cpu", prompt_len=8).pack_weights
    assert not settings_from_recipe(load_recipe(recipe, ["generation.backend=vllm"]), "cpu", prompt_len=8).pack_weights
    shape = describe_model(str(model_dir), "causal_lm")
    s = settings(mixed_precision="bf16", response_tokens=MIN_STEPS)
    offered = [f.overrides for f in suggestions(s, {"policy": shape, "value": None, "rewards": []}, budget_gb=0.0)]
    assert (["generation.pack_weights=false"] in offered) == sampling_packs(s)


def test_a_groups_prompt_is_counted_once_where_the_policy_shares_it(model_dir):
    """engine/shared_prompts.py packs a prompt's completions behind it: the update's activations are those
    of the packed rows. Two prompts of 6 tokens x 4 completions of 4 in one micro-batch of 8; the cost
    model (hidden 16, intermediate 32: 2,560 multiply-adds a token, 32 a query-key pair) picks 4 to a row:
    2 rows x 22 tokens cost 2 x (22 x 2,560 + 22^2 x 32) = 143,616 against the plain 8 x (10 x 2,560 +
    10^2 x 32) = 230,400 (2 to a row: 168,448; 3: 225,792)."""
    shape = describe_model(str(model_dir), "causal_lm")
    assert shape.shares_prompts
    grouped = dict(micro_batch=8, mini_batch=8, rollout_batch=8, group=4)
    shared = parts(estimate(settings(**grouped), shape, None, []))
    # 2 rows x 22 tokens x 2 layers x (8 x 16 + 4 x 32 + 7 x 4 LoRA + 22 / 2 mask) x 4 B
    assert shared["policy", "activations (update)"] == pytest.approx(2 * 22 * 2 * 295 * 4)
    # a mini-batch smaller than the rollout may split a group anywhere: the plain 8 x 10 tokens
    split = parts(estimate(settings(**{**grouped, "mini_batch": 4, "micro_batch": 4}), shape, None, []))
    assert split["policy", "activations (update)"] == pytest.approx(4 * 10 * 2 * 289 * 4)
    plain = parts(estimate(settings(**{**grouped, "group": 1}), shape, None, []))
    assert plain["policy", "activations (update)"] == pytest.approx(8 * 10 * 2 * 289 * 4)


@pytest.mark.parametrize("attention, shares", [("auto", True), ("sdpa", True), ("eager", True),
                                               ("flash_attention_2", False)])
def test_the_plan_shares_prompts_only_under_the_attention_the_recipe_names(model_dir, attention, shares):
    """A recipe's policy.attn_implementation, not the config's default: flash_attention_2 takes no 4D mask,
    so its run packs nothing and its update holds the plain rows."""
    assert describe_model(str(model_dir), "causal_lm", attn_implementation=attention).shares_prompts is shares
