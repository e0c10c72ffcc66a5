"""`ppo train` with generation.backend: vllm_server against the fake server on loopback
(tests/fixtures/fake_vllm_server.py; a real `vllm serve`: tests/integration/test_vllm_server.py): a server
that starts failing mid-run stops the run with one line and leaves its checkpoints, and --resume goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, tiny_overrides
from tests.fixtures.fake_vllm_server import FakeVllmServer

pytestmark = pytest.mark.slow
COMPLETIONS = "/v1/completions"


def _train(models: Path, out: Path, url: str, *extra: str) -> subprocess.CompletedProcess:
    sets = {"data.prompts": ROOT / "recipes/prompts/reviews.txt",
            "generation.backend": "vllm_server", "generation.server_url": url, "generation.server_retries": 0,
            "generation.max_new_tokens": 6, "ppo.rollout_batch_size": 4, "ppo.mini_batch_size": 4,
            "ppo.micro_batch_size": 4, "train.total_updates": 3, "train.save_every": 1}
    cmd = [sys.executable, "-m", "ppo_cli", "train", str(ROOT / "recipes" / "tiny_sentiment.yaml")]
    for item in tiny_overrides(models, out, **sets):
        cmd += ["--set", item]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd + list(extra), env=env, capture_output=True, text=True, timeout=600)


def test_a_failing_server_stops_the_run_in_one_line_and_resume_goes_on(tiny_models, tmp_path):
    run = tmp_path / "tiny-sentiment"
    with FakeVllmServer() as server:
        # the 16 held-out prompts' evaluation, then two updates of 4 one-completion requests, then HTTP 500
        server.fail_after[COMPLETIONS] = (16 + 8, 500)
        failed = _train(tiny_models, tmp_path, server.url)
        assert failed.returncode == 1, failed.stderr
        errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
        assert errors == [f"error: vLLM server failed while sampling: {server.url}/v1/completions: HTTP 500 "
                          "'{\"error\": {\"message\": \"engine is dead\", \"code\": 500}}'"], failed.stderr
        assert "Traceback" not in failed.stderr
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
        assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
        assert not (run / "server_adapters").exists()  # its adapter directories are gone with the run's end
        assert len(server.adapters) == 0  # and the last adapter unloaded

        del server.fail_after[COMPLETIONS]
        resumed = _train(tiny_models, tmp_path, server.url, "--resume", "latest")
        assert resumed.returncode == 0, resumed.stderr
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # The fake's log-probs (-0.1, -0.2, ...) are not the policy's: the difference is measured, not assumed.
    assert all(m["rollout/logprob_diff_max"] > 0.0 for m in metrics)
    loads = [body["lora_name"] for _, path, body in server.requests if path == "/v1/load_lora_adapter"]
    # A fresh name each time the weights changed, the resumed run's differing too: the evaluation before and
    # update 1 (the same weights: one load), updates 2 and 3 (then the server fails); resumed, update 3 and
    # the evaluation after. The evaluation's 4 batches share one load.
    assert len(loads) == len(set(loads)) == 3 + 2
