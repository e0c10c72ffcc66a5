"""generation.backend: vllm_server against a real `vllm serve` on CPU (skipped where vllm is not installed:
scripts/vllm_test.sh makes a venv with it and runs these). One server for the module, on the tiny policy
rewritten with 32-dim heads (tests/fixtures/vllm_models.py); the trainer talks to it over loopback HTTP, and
so do `ppo rollout`, `ppo eval` and `ppo compare` on the run it trained.
The wire protocol and each failure's line: tests/engine/test_vllm_server_sampler.py (a fake server)."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppo_cli.cli import app
from tests.conftest import ROOT, tiny_overrides
from tests.fixtures.vllm_server import start_server, stop_server
from tests.integration.test_vllm_train import LOGPROB_TOLERANCE, _vllm_importable, wide_models  # noqa: F401 - a fixture

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(not _vllm_importable(), reason="vllm is not importable (scripts/vllm_test.sh installs it)"),
]
runner = CliRunner()
SERVED_NAME = "tiny-base"
STARTUP_S = 600  # about 90 s on 2 shared cores; CI is slower
GREEDY = "0.0001"


def _served_models(url: str) -> list[str]:
    with urllib.request.urlopen(url + "/v1/models", timeout=5) as answer:
        return [m["id"] for m in json.load(answer)["data"]]


@pytest.fixture(scope="module")
def server(wide_models, tmp_path_factory):
    """`vllm serve` as docs/vllm.md starts it (tests/fixtures/vllm_server.py)."""
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    proc, url = start_server(wide_models / "policy", SERVED_NAME, 64, log)
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                _served_models(url)
                break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(2)
        yield url
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def run(server, wide_models, tmp_path_factory) -> tuple[Path, list[dict]]:
    """Two updates sampled by the server, with the truncated importance-sampling correction on."""
    out = tmp_path_factory.mktemp("runs")
    sets = {"data.prompts": ROOT / "recipes/prompts/reviews.txt",
            "generation.backend": "vllm_server", "generation.server_url": server, "ppo.rollout_is_clip": 2.0,
            "ppo.rollout_batch_size": 8, "ppo.mini_batch_size": 8, "ppo.micro_batch_size": 8,
            "train.total_updates": 2, "train.save_every": 1}
    cli = ["train", str(ROOT / "recipes" / "tiny_sentiment.yaml")]
    for item in tiny_overrides(wide_models, out, float32=True, **sets):  # float32 on both sides
        cli += ["--set", item]
    result = runner.invoke(app, cli)
    assert result.exit_code == 0, result.output
    run_dir = out / "tiny-sentiment"
    return run_dir, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_training_samples_from_the_server_with_this_updates_adapter(run, server):
    run_dir, metrics = run
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        # The server sampled with the adapter of this very update: its log-probs are the trainer's, to
        # float rounding (measured 7e-6 at most); a stale adapter or re-tokenized text shows as 0.01 and more.
        assert m["rollout/logprob_diff_max"] < LOGPROB_TOLERANCE, m
        assert 0.0 <= m["rollout/logprob_diff_mean"] <= m["rollout/logprob_diff_max"]
        assert abs(m["val/ratio_first_minibatch"] - 1.0) < 1e-4, m
    assert (run_dir / "final" / "adapter_config.json").is_file()
    assert _served_models(server) == [SERVED_NAME]  # the last adapter unloaded at the end
    assert not (run_dir / "server_adapters").exists()


def test_rollout_samples_the_aligned_adapter_from_the_server(run, server, tmp_path):
    """`ppo rollout aligned` through the server, at a tiny temperature: each token is the aligned policy's
    argmax under transformers' forward (the adapter was applied), not the base's."""
    import torch

    from ppo_cli.commands.rollout import release
    from ppo_cli.engine.inference import load_inference_engine
    from ppo_cli.engine.vllm_server_sampler import VllmServerSampler
    from ppo_cli.model_refs import resolve_model_reference
    from ppo_cli.recipe_loading import load_recipe

    run_dir, _ = run
    prompts = tmp_path / "eight.txt"
    prompts.write_text("\n".join((ROOT / "recipes/prompts/reviews_eval.txt").read_text().splitlines()[:8]) + "\n")
    out = tmp_path / "rollout.jsonl"
    result = runner.invoke(app, ["rollout", "aligned", "--run", str(run_dir), "--prompts", str(prompts), "--out",
                                 str(out), "--temperature", GREEDY, "--max-new-tokens", "12"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 8 and {r["generation"]["backend"] for r in rows} == {"vllm_server"}
    assert _served_models(server) == [SERVED_NAME]  # the adapter it loaded, unloaded at the end

    recipe = load_recipe(run_dir / "recipe.yaml", [f"generation.temperature={GREEDY}", "generation.max_new_tokens=12"])
    engine = load_inference_engine(recipe, resolve_model_reference("aligned", run_dir))
    assert isinstance(engine.sampler, VllmServerSampler)
    torch.manual_seed(0)
    g = engine.generate(prompts.read_text().splitlines())
    sequences = torch.cat([g.prompt_ids, g.response_ids], dim=1)  # (B, P + T)
    mask = torch.cat([g.prompt_mask, g.response_mask], dim=1)
    P = g.prompt_ids.shape[1]

    def gaps(policy) -> torch.Tensor:
        """How far below ``policy``'s argmax each response token's logit is, over the response mask."""
        with torch.no_grad():
            logits = policy(input_ids=sequences, attention_mask=mask.long(),
                            position_ids=(mask.long().cumsum(1) - 1).clamp(min=0)).logits
        response_logits = logits[:, P - 1 : -1].float()  # (B, T, V)
        chosen = response_logits.gather(-1, g.response_ids.unsqueeze(-1)).squeeze(-1)  # (B, T)
        return (response_logits.max(dim=-1).values - chosen)[g.response_mask]

    policy = engine.actor_critic.policy
    own = gaps(policy)
    with policy.disable_adapter():
        base = gaps(policy)
    release(engine)
    # As with the in-process engine (tests/integration/test_vllm_inference.py): vLLM's CPU kernels pick
    # the aligned policy's argmax to within 0.05; the base would put some of those tokens well below its own.
    assert own.numel() > 0 and own.max().item() < 0.05, own.max().item()
    assert base.max().item() > own.max().item(), (base.max().item(), own.max().item())


def test_eval_and_compare_sample_from_the_server(run, server, tmp_path):
    """`ppo eval aligned` and `ppo compare base aligned` through the server (they load models as `ppo rollout`
    does): the same prompts and seed give eval's rows and compare's aligned side the same responses (one seed
    per request), the base's KL to itself is exactly 0 and the aligned adapter's is not, and both commands
    leave the server with its base model only."""
    run_dir, _ = run
    prompts = tmp_path / "four.txt"
    prompts.write_text("\n".join((ROOT / "recipes/prompts/reviews_eval.txt").read_text().splitlines()[:4]) + "\n")
    common = ["--run", str(run_dir), "--prompts", str(prompts), "--max-new-tokens", "8"]
    result = runner.invoke(app, ["eval", "aligned", *common, "--out", str(tmp_path / "eval.json")])
    assert result.exit_code == 0, result.output
    evaluated = json.loads((tmp_path / "eval.json").read_text())
    assert evaluated["generation"]["backend"] == "vllm_server"
    result = runner.invoke(app, ["compare", "base", "aligned", *common, "--out", str(tmp_path / "compare")])
    assert result.exit_code == 0, result.output
    compared = json.loads((tmp_path / "compare" / "compare.json").read_text())
    assert compared["b"]["generation"]["backend"] == "vllm_server"
    assert compared["b"]["reward"] == evaluated["reward"] and compared["b"]["kl"] == evaluated["kl"]
    assert [p["a_kl"] for p in compared["rows"]] == [0.0] * 4  # the base is its own reference
    assert all(p["b_kl"] != 0.0 for p in compared["rows"])
    assert _served_models(server) == [SERVED_NAME]
