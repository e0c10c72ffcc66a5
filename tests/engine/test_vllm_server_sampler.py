"""generation.backend: vllm_server against a fake OpenAI-compatible server on loopback
(tests/fixtures/fake_vllm_server.py): what crosses the wire, the adapter's load/unload sequence, what
comes back as a Generation, and each failure's one line. (Against a real `vllm serve`:
tests/integration/test_vllm_server.py, in the vLLM venv.)"""

from __future__ import annotations

import json
import socket
import types
from pathlib import Path

import pytest
import torch

from ppo_cli.engine import vllm_server_sampler as server_sampler
from ppo_cli.errors import SamplerServerError, UsageError
from ppo_cli.model_refs import ResolvedModel
from ppo_cli.recipe import GenerationConfig
from ppo_cli.recipe_loading import load_recipe
from tests.conftest import ROOT
from tests.fixtures.fake_vllm_server import FakeVllmServer

STOP, PAD = 2, 0


def _recipe(url: str, tmp_path: Path, **sets):
    overrides = ["generation.backend=vllm_server", f"generation.server_url={url}", f"output_dir={tmp_path / 'runs'}",
                 "generation.max_new_tokens=4", "generation.server_timeout_s=1", "generation.server_retries=1"]
    return load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml", overrides + [f"{k}={v}" for k, v in sets.items()])


@pytest.fixture
def server():
    with FakeVllmServer() as fake:
        yield fake


@pytest.fixture
def saved_adapters(monkeypatch):
    """save_adapter without a model: writes the adapter_config.json the server checks for, records the calls."""
    calls = []

    def save_adapter(policy, adapter, target):
        target.mkdir()
        (target / "adapter_config.json").write_text(json.dumps({"r": 4}))
        calls.append((adapter, target))

    monkeypatch.setattr("ppo_cli.engine.models.save_adapter", save_adapter)
    # The adapter's weights: a stand-in policy's own tensor, or (no policy) new values at every call (not
    # drawn from torch's RNG, which seeds the requests).
    calls_so_far = iter(range(10**6))
    monkeypatch.setattr("ppo_cli.engine.models.adapter_tensors", lambda policy, adapter: [
        ("lora_A", policy.weight if policy is not None else torch.tensor([float(next(calls_so_far))]))])
    return calls


# Two groups of two rows: prompt [7, 8] (left-padded by one) and prompt [9, 10, 11].
PROMPT_IDS = torch.tensor([[PAD, 7, 8], [PAD, 7, 8], [9, 10, 11], [9, 10, 11]])
PROMPT_MASK = torch.tensor([[False, True, True]] * 2 + [[True, True, True]] * 2)


def test_completion_body_is_the_in_process_sampling_as_request_fields():
    gen = GenerationConfig(max_new_tokens=24, temperature=0.7, top_k=50, top_p=0.9, num_generations=4)
    body = server_sampler.completion_body("ppo-1", [3, 4], gen, stop_token_id=STOP, seed=99, n=4)
    assert body == {"model": "ppo-1", "prompt": [3, 4], "n": 4, "temperature": 0.7, "top_k": 50, "top_p": 0.9,
                    "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                    "max_tokens": 24, "stop_token_ids": [STOP], "seed": 99, "logprobs": 0,
                    "return_token_ids": True, "ignore_eos": True}


def test_base_url_drops_the_v1_the_openai_clients_add():
    assert server_sampler.base_url("http://h:8000/v1/") == "http://h:8000"
    assert server_sampler.base_url("http://h:8000") == "http://h:8000"


def test_two_rollouts_load_a_fresh_adapter_unload_the_previous_and_send_groups_as_n(server, saved_adapters, tmp_path):
    recipe = _recipe(server.url, tmp_path, **{"generation.num_generations": 2})
    sampler = server_sampler.VllmServerSampler(recipe, STOP, PAD)
    torch.manual_seed(0)
    seeds = torch.randint(0, 2**31 - 1, (2,)).tolist()  # what the sampler draws: one seed per group
    torch.manual_seed(0)
    sampled = sampler.sample(None, PROMPT_IDS, PROMPT_MASK)
    first = sampler.adapter[0]
    first_dir = saved_adapters[0][1]
    assert saved_adapters[0][0] == "policy" and first_dir.parent == recipe.run_dir / "server_adapters"
    assert server.paths() == ["/v1/models", "/v1/load_lora_adapter", "/v1/completions", "/v1/completions"]
    assert server.requests[1][2] == {"lora_name": first, "lora_path": str(first_dir.resolve())}
    bodies = sorted((b for _, p, b in server.requests if p == "/v1/completions"), key=lambda b: len(b["prompt"]))
    assert [(b["prompt"], b["n"], b["model"], b["seed"]) for b in bodies] == [([7, 8], 2, first, seeds[0]),
                                                                               ([9, 10, 11], 2, first, seeds[1])]
    # Completion i of seed s: tokens 5 + (s + i + k) % 20; an even s + i stops after 3 (the last is STOP),
    # an odd one runs to the 4-token budget; token k's log-prob is -(k + 1) / 10.
    for row, (group, child) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        s = seeds[group] + child
        ids = [5 + (s + k) % 20 for k in range(3 if s % 2 == 0 else 4)]
        if s % 2 == 0:
            ids[-1] = STOP
        n = len(ids)
        assert sampled.generation.response_ids[row, :n].tolist() == ids
        assert sampled.generation.action_mask[row].tolist() == [k < n for k in range(sampled.generation.action_mask.shape[1])]
        assert sampled.logprobs[row, :n].tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4][:n])
        assert bool(sampled.generation.finished[row]) == (s % 2 == 0)
    assert sampled.policy_logprobs is False and sampled.hidden is None

    sampler.sample(None, PROMPT_IDS, PROMPT_MASK)
    second = sampler.adapter[0]
    assert second != first
    assert server.paths()[4:7] == ["/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/completions"]
    assert server.requests[5][2] == {"lora_name": first}
    assert not first_dir.exists() and list(server.adapters) == [second]
    sampler.close()
    assert server.adapters == {} and not (recipe.run_dir / "server_adapters").exists()


def test_the_adapter_crosses_over_again_only_when_its_weights_changed(server, saved_adapters, tmp_path):
    # An evaluation's batches, dynamic sampling's rounds and an episode's turns sample the same weights.
    policy = types.SimpleNamespace(weight=torch.zeros(3))
    sampler = server_sampler.VllmServerSampler(_recipe(server.url, tmp_path), STOP, PAD)
    sampler.sample(policy, PROMPT_IDS, PROMPT_MASK)
    first = sampler.adapter[0]
    sampler.sample(policy, PROMPT_IDS, PROMPT_MASK)
    assert sampler.adapter[0] == first and len(saved_adapters) == 1
    with torch.no_grad():
        policy.weight[1] = 1e-7  # one element, as an optimizer step moves it
    sampler.sample(policy, PROMPT_IDS, PROMPT_MASK)
    assert sampler.adapter[0] != first and len(saved_adapters) == 2
    assert server.paths().count("/v1/load_lora_adapter") == 2 and server.paths().count("/v1/completions") == 3 * 4
    sampler.close()


def test_rows_that_are_not_whole_groups_go_one_request_each(server, saved_adapters, tmp_path):
    sampler = server_sampler.VllmServerSampler(_recipe(server.url, tmp_path), STOP, PAD)
    sampler.sample(None, PROMPT_IDS[1:], PROMPT_MASK[1:])
    bodies = [b for _, p, b in server.requests if p == "/v1/completions"]
    assert sorted(b["prompt"] for b in bodies) == [[7, 8], [9, 10, 11], [9, 10, 11]]
    assert {b["n"] for b in bodies} == {1}
    assert len({b["seed"] for b in bodies}) == 3


def test_inference_loads_the_saved_adapter_once_and_the_base_needs_none(server, tmp_path):
    adapter = tmp_path / "final"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    recipe = _recipe(server.url, tmp_path)
    model = ResolvedModel("aligned", "aligned", recipe.policy.path, adapter_dir=adapter)
    sampler = server_sampler.VllmServerSampler(recipe, STOP, PAD, model=model)
    sampler.sample(None, PROMPT_IDS, PROMPT_MASK)
    sampler.sample(None, PROMPT_IDS, PROMPT_MASK)
    assert server.paths().count("/v1/load_lora_adapter") == 1
    assert server.requests[1][2]["lora_path"] == str(adapter.resolve())
    sampler.close()
    assert server.adapters == {} and adapter.is_dir()  # the run's own adapter is never deleted

    base = server_sampler.VllmServerSampler(recipe, STOP, PAD, model=ResolvedModel("base", "base", recipe.policy.path))
    base.sample(None, PROMPT_IDS, PROMPT_MASK)
    assert server.requests[-1][2]["model"] == "base"
    base.close()
    assert server.paths().count("/v1/unload_lora_adapter") == 1


# --- each failure: one line ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_that_is_not_there_is_one_line_before_anything_loads(tmp_path):
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(SamplerServerError) as info:
        server_sampler.check_server(_recipe(url, tmp_path))
    assert str(info.value).startswith(f"vLLM server {url} does not answer: {url}/v1/models: cannot connect (")
    assert "\n" not in str(info.value) and "vllm serve" in info.value.hint


def test_more_than_one_process_and_non_adapter_models_are_refused(server, tmp_path):
    recipe = _recipe(server.url, tmp_path)
    with pytest.raises(UsageError, match="^generation.backend 'vllm_server' is supported with one training process only$"):
        server_sampler.check_server(recipe, world_size=2)
    merged = ResolvedModel("runs/x/final", "model", recipe.policy.path, full_model_dir=tmp_path)
    with pytest.raises(UsageError, match="cannot sample runs/x/final: the server holds the base model and takes LoRA adapters only"):
        server_sampler.check_server(recipe, models=[merged])
    server_sampler.check_server(recipe)  # answers: nothing raised
    assert server.paths() == ["/v1/models"]


def _sampler_failing(server, tmp_path, **fail):
    sampler = server_sampler.VllmServerSampler(_recipe(server.url, tmp_path), STOP, PAD)
    server.fail.update(fail)
    return sampler


def test_an_error_answer_is_retried_then_one_line(server, saved_adapters, tmp_path):
    sampler = _sampler_failing(server, tmp_path, **{"/v1/completions": 500})
    with pytest.raises(SamplerServerError) as info:
        sampler.sample(None, PROMPT_IDS[:1], PROMPT_MASK[:1])
    assert str(info.value) == (f"vLLM server failed while sampling: {server.url}/v1/completions: HTTP 500 "
                               "'{\"error\": {\"message\": \"engine is dead\", \"code\": 500}}' (2 attempts)")
    assert server.paths().count("/v1/completions") == 2  # server_retries 1
    assert "ppo train RECIPE --resume)" in info.value.hint  # the run's own command when printed (errors.RESUME)


def test_a_refused_adapter_is_one_line_with_vllms_reason(server, saved_adapters, tmp_path):
    sampler = _sampler_failing(server, tmp_path, **{"/v1/load_lora_adapter": 400})
    with pytest.raises(SamplerServerError, match=r"^vLLM server failed while loading the adapter .*ppo-\w+-1: "
                       rf"{server.url}/v1/load_lora_adapter answered HTTP 400 .*engine is dead"):
        sampler.sample(None, PROMPT_IDS[:1], PROMPT_MASK[:1])
    assert server.paths().count("/v1/load_lora_adapter") == 1  # a 4xx is not retried
    assert not saved_adapters[0][1].exists()  # the directory it could not load is not left behind


def test_a_server_that_lost_the_adapter_is_one_line(server, saved_adapters, tmp_path):
    sampler = _sampler_failing(server, tmp_path)
    server.forget_adapters_before_completions = True  # restarted between the load and the sampling
    with pytest.raises(SamplerServerError) as info:
        sampler.sample(None, PROMPT_IDS[:1], PROMPT_MASK[:1])
    assert str(info.value) == (f"the vLLM server {server.url} no longer has the policy's adapter {sampler.adapter[0]} "
                               "(restarted, or unloaded by someone else)")


def test_a_server_that_does_not_answer_in_time_is_one_line(server, saved_adapters, tmp_path):
    sampler = _sampler_failing(server, tmp_path, **{"/v1/completions": "slow"})
    server.slow_s = 1.5  # server_timeout_s is 1
    with pytest.raises(SamplerServerError, match=rf"^vLLM server failed while sampling: {server.url}/v1/completions: "
                       r"no answer within 1 s \(2 attempts\)$"):
        sampler.sample(None, PROMPT_IDS[:1], PROMPT_MASK[:1])


def test_a_dropped_connection_is_one_line(server, saved_adapters, tmp_path):
    sampler = _sampler_failing(server, tmp_path, **{"/v1/completions": "drop"})
    with pytest.raises(SamplerServerError, match=rf"^vLLM server failed while sampling: {server.url}/v1/completions: "
                       r"cannot connect \(.*\) \(2 attempts\)$"):
        sampler.sample(None, PROMPT_IDS[:1], PROMPT_MASK[:1])


def test_a_prompt_read_as_other_tokens_is_one_line(server, saved_adapters, tmp_path):
    sampler = _sampler_failing(server, tmp_path)
    server.echo_other_prompt = True
    with pytest.raises(SamplerServerError, match=rf"^vLLM server failed while sampling: {server.url}/v1/completions "
                       r"read the prompt as 3 other token ids than the 2 sent$"):
        sampler.sample(None, PROMPT_IDS[:1], PROMPT_MASK[:1])


def test_close_after_the_server_went_away_does_not_hang_or_raise(server, saved_adapters, tmp_path):
    sampler = _sampler_failing(server, tmp_path)
    sampler.sample(None, PROMPT_IDS[:1], PROMPT_MASK[:1])
    directory = saved_adapters[0][1]
    server.fail["/v1/unload_lora_adapter"] = 503
    sampler.close()
    assert not directory.exists() and not directory.parent.exists()


# --- the recipe -------------------------------------------------------------------------------------


@pytest.mark.parametrize("sets, line", [
    ({"generation.server_url": "null"}, "generation.server_url: generation.backend 'vllm_server' needs the server's address"),
    ({"policy.lora": "null", "value.kind": "head"}, "generation.backend: generation.backend 'vllm_server' samples with the policy's LoRA adapter"),
])
def test_recipe_refuses_vllm_server_without_url_or_lora(sets, line, tmp_path):
    with pytest.raises(Exception) as info:
        _recipe("http://127.0.0.1:1", tmp_path, **sets)
    assert line in str(info.value)


def test_recipe_refuses_server_keys_with_another_backend():
    with pytest.raises(Exception) as info:
        load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml", ["generation.server_url=http://127.0.0.1:8000"])
    assert "generation.server_url: only used with generation.backend 'vllm_server'" in str(info.value)
