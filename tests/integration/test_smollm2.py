"""A real pretrained model end to end: SmolLM2-135M-Instruct (scripts/fetch_smollm2.py, the `smollm2`
fixture), as a plain transformers directory and as the GGUF file it came from."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "smollm2_concise.yaml"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF = f"gguf/{GGUF_NAME}"


@pytest.fixture(scope="module")
def model_and_tokenizer(smollm2):
    from ppo_cli.engine.models import load_causal_lm, load_tokenizer

    model = load_causal_lm(str(smollm2), None, dtype=torch.float32, device=torch.device("cpu")).eval()
    return model, load_tokenizer(str(smollm2))


def _recipe(**sets):
    from ppo_cli.recipe_loading import load_recipe

    return load_recipe(RECIPE, [f"{k}={v}" for k, v in sets.items()])


def test_the_gguf_file_loads_as_the_same_model_and_tokenizer_as_the_fetched_directory(smollm2, model_and_tokenizer):
    from ppo_cli.engine.models import load_causal_lm, load_tokenizer
    from ppo_cli.plan_memory import describe_model

    model, tokenizer = model_and_tokenizer
    gguf_path = str(smollm2 / GGUF)
    from_gguf = load_causal_lm(gguf_path, None, dtype=torch.float32, device=torch.device("cpu")).eval()
    assert type(from_gguf).__name__ == "LlamaForCausalLM" and not hasattr(from_gguf.config, "quantization_config")
    ids = torch.tensor([tokenizer("The capital of France is").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(from_gguf(ids).logits, model(ids).logits, atol=0, rtol=0)
    gguf_tokenizer = load_tokenizer(gguf_path)
    assert gguf_tokenizer.get_vocab() == tokenizer.get_vocab()
    assert gguf_tokenizer.chat_template == tokenizer.chat_template
    assert (gguf_tokenizer.eos_token, gguf_tokenizer.pad_token, gguf_tokenizer.padding_side) == ("<|im_end|>", "<|im_end|>", "left")
    # ppo plan counts the dequantized model: the same parameters as the directory's config says.
    shape, dir_shape = describe_model(gguf_path, "causal_lm"), describe_model(str(smollm2), "causal_lm")
    assert shape.total_params == dir_shape.total_params == 134_515_008
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.vocab) == (30, 576, 9, 3, 64, 49152)


def test_the_chat_template_is_applied_once_with_no_token_in_front(model_and_tokenizer):
    from ppo_cli.engine.chat import encode_prompt, render_template

    _, tokenizer = model_and_tokenizer
    data = _recipe().data
    prompt = [{"role": "user", "content": "Why is the sky blue?"}]
    ids = encode_prompt(prompt, tokenizer, data)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == im_start  # ChatML has no BOS: nothing is added in front of the template
    assert ids.count(im_start) == 3  # SmolLM's default system turn, the user turn, the assistant header
    text = tokenizer.decode(ids)
    assert text == render_template(tokenizer, prompt, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n")


def test_training_logprobs_are_the_models_own_log_softmax_on_left_padded_chat_rows(model_and_tokenizer):
    from ppo_cli.engine.chat import encode_prompt
    from ppo_cli.engine.logprobs import causal_lm_forward, selective_log_softmax

    model, tokenizer = model_and_tokenizer
    data, temperature = _recipe().data, 0.7
    prompts = [encode_prompt([{"role": "user", "content": q}], tokenizer, data)
               for q in ("Hi!", "How do airplanes stay in the air? Answer briefly.")]
    response = tokenizer("Wings push air down, so the air pushes them up.").input_ids + [tokenizer.eos_token_id]
    width = max(map(len, prompts))
    rows = [[tokenizer.pad_token_id] * (width - len(p)) + p + response for p in prompts]
    sequences = torch.tensor(rows)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * (len(p) + len(response)) for p in prompts]).bool()
    T = len(response)
    with torch.no_grad():
        logits, _ = causal_lm_forward(model, sequences, attention_mask, T, temperature)
        ours = selective_log_softmax(logits, sequences[:, -T:])
        truth = torch.stack([
            (model(input_ids=torch.tensor([p + response])).logits[0, -T - 1:-1] / temperature)
            .log_softmax(-1).gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1)
            for p in prompts])
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, truth, atol=1e-4, rtol=0)


# The recipe's first 5 updates, as they are (its batch, length, reward, learning rate and seed), on the
# same 16 of its questions every update: over its 64 each update's batch was other questions, and their
# spread was the test's margin (on 2 CPU cores the mean reward went -0.85, -0.63, -0.71, -0.44, -0.77 by
# its batches: risen, then a harder batch last). A learning rate high enough to rise in 3 updates (2e-3)
# drove the KL to 10 nats and the reward down instead.
SHORT_RUN = {"train.total_updates": 5, "train.sample_every": 0}
SHORT_RUN_QUESTIONS = 16  # the recipe's rollout_batch_size: one batch


@pytest.fixture(scope="module")
def short_run(smollm2, tmp_path_factory):
    """A few updates from the GGUF file itself, in a process of its own (its peak memory is the run's
    alone), and `ppo plan` of the same recipe."""
    out = tmp_path_factory.mktemp("smollm2-runs")
    questions = out / "questions.jsonl"
    lines = ROOT.joinpath(_recipe().data.prompts).read_text().splitlines(keepends=True)
    questions.write_text("".join(lines[:SHORT_RUN_QUESTIONS]))
    sets = dict(SHORT_RUN, **{"policy.path": str(smollm2 / GGUF), "output_dir": str(out), "name": "short",
                              "data.prompts": str(questions)})
    args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    train = subprocess.run([sys.executable, "-m", "ppo_cli", "train", str(RECIPE), *args], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=1800)
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    # The plan of the run as it ran: `auto` made concrete by the run's own probe, which the plan's
    # probe, timed apart on a busy machine, may decide the other way.
    resolved = json.loads((out / "short" / "summary.json").read_text())["mixed_precision"]
    args += ["--set", f"train.mixed_precision={resolved}"]
    plan = subprocess.run([sys.executable, "-m", "ppo_cli", "plan", str(RECIPE), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr[-3000:]
    return out / "short", plan.stdout


def test_a_short_run_from_the_gguf_file_raises_the_reward(short_run):
    """Judged on the held-out questions, which the run samples before and after training from the same
    seed: the same random numbers draw both, so without learning the two are the same samples (a run at
    lr 1e-12: -0.795 and -0.795, EOS 17% and 17%) and the change is the policy's. Measured at one thread,
    as CI runs it: -0.795 -> -0.303 (EOS 17% -> 50%) with the inverse-CDF draw, -0.925 -> -0.453 with
    the Gumbel-max draw before it. The training batches' own means are 16 fresh samples each, about 0.08
    apart between updates without learning (the lr 1e-12 run: -0.90, -0.90, -1.04, -1.01, -0.86), so
    they are only asked to rise (-0.90, -0.93, -0.77, -0.81, -0.75 and -0.92, -0.97, -0.93, -0.78, -0.39:
    0.14 and 0.36 from the first two to the last two, where a 0.15 margin failed the first)."""
    run, _ = short_run
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scores = [m["objective/scores"] for m in metrics if "objective/scores" in m]
    assert len(scores) == SHORT_RUN["train.total_updates"]
    assert sum(scores[-2:]) > sum(scores[:2]), scores
    summary = json.loads((run / "summary.json").read_text())
    before, after = summary["before"], summary["after"]
    assert after["score"] > before["score"] + 0.2, (before, after)
    assert after["eos_rate"] > before["eos_rate"], (before, after)


def test_final_loads_with_peft_on_the_gguf_base_and_generates(smollm2, short_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    final = short_run[0] / "final"
    card = (final / "README.md").read_text()
    assert f"`{smollm2 / GGUF}` (a GGUF file, dequantized at load)" in card
    assert f"AutoModelForCausalLM.from_pretrained({str(smollm2 / 'gguf')!r}, gguf_file={GGUF_NAME!r})" in card
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == str(smollm2 / GGUF)
    base = AutoModelForCausalLM.from_pretrained(str(smollm2 / "gguf"), gguf_file=GGUF_NAME, dtype=torch.float32,
                                                quantization_config=GgufConfig(dequantize=True))
    model = PeftModel.from_pretrained(base, str(final)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(final))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is a haiku?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    new = out[0, ids["input_ids"].shape[1]:]
    assert len(new) > 0 and tokenizer.decode(new, skip_special_tokens=True).strip()


# Not strict about the heap: the measured peak moves with it. With gradient checkpointing (`auto` turns it
# on at this shape) the plan counts the heap the checkpointed layers' freed activations leave resident:
# where the kernel grants huge pages on request, the large blocks are mapped (engine/malloc.heap_mapped)
# and it is 0.2x them (CPU_HEAP_RETENTION_MAPPED: 1.62 GB planned, 1.68 measured for 2 updates), else
# 0.8x (CPU_HEAP_RETENTION_CHECKPOINTED: 2.49 planned against 3.09 in CI, 2026-11-28).
def test_plan_is_within_a_quarter_of_the_measured_peak(short_run):
    """Measured on an idle AMD EPYC (2 cores), before checkpointing was `auto`: bf16 3.43 GB against a plan
    of 3.64, fp32 5.37 against 6.19. With it on, fp32: 3.09 (CI) and 2.92 (2 updates, one thread) against
    2.49."""
    run, plan_output = short_run
    planned = float(re.search(r"peak = .* = ([\d.]+) GB", plan_output).group(1))
    measured = json.loads((run / "summary.json").read_text())["peak_memory_gb"]
    assert abs(planned - measured) / measured < 0.25, (planned, measured)
