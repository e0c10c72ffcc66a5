"""Refactors change no number: the demo recipe (PPO with a critic) and a GRPO recipe train a few
updates in each precision the suite covers, and their metrics and final weights equal a record taken
before the refactor (tests/fixtures/behaviour_record.json).

Bit for bit against the record of this machine (same CPU model and flags, thread count, torch /
transformers / peft): the file holds one record per machine. With another thread count on the same CPU,
matmuls sum in another order: there the metrics and the weights' per-tensor sums must agree to 1e-3. Another machine's kernels differ in their
last bits and two updates amplify that far past any tolerance that would still catch a change (an AVX2
record against an AVX-512 EPYC: 229 numbers off by more than 1e-3, a few by 5%; policy weights' sums
crossing zero), so a machine without a record skips, saying how to make one.

Record this machine's numbers at a commit whose numbers are trusted (the last one CI passed), or
re-record when a change is meant to move them (and say so in the commit):
    PPO_RECORD_BEHAVIOUR=1 scripts/test.sh tests/integration/test_behaviour_unchanged.py
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppo_cli.cli import app
from tests.conftest import ROOT

pytestmark = pytest.mark.slow
runner = CliRunner()
RECORD = ROOT / "tests" / "fixtures" / "behaviour_record.json"
# Wall time, throughput and memory vary run to run; every other metric is a function of the seed.
UNRECORDED_PREFIXES = ("time/", "perf/", "memory/", "tokens_per_s")

CASES = {
    "ppo-critic": ("tiny_sentiment.yaml", {
        "ppo.rollout_batch_size": 8, "ppo.mini_batch_size": 4, "ppo.micro_batch_size": 4,
    }),
    "grpo": ("tiny_grpo.yaml", {
        # 4 prompts x 4 completions in one mini-batch: the old log-probs are left to the update's first epoch
        "ppo.rollout_batch_size": 4, "ppo.mini_batch_size": 16, "ppo.micro_batch_size": 8,
    }),
}
PRECISIONS = ("no", "bf16")


def machine_fingerprint() -> dict:
    import peft
    import torch
    import transformers

    model, flags = "", set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    simd = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "sse4")))
    # The thread count too: a matmul split over another number of threads sums in another order.
    return {"cpu": model or platform.processor(), "simd": simd, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}


def _train(models: Path, out: Path, recipe: str, precision: str, extra: dict) -> tuple[list[dict], dict]:
    name = f"{Path(recipe).stem}-{precision}"
    sets = {
        "name": name,
        "output_dir": str(out),
        "policy.path": str(models / "policy"),
        "train.total_updates": 2,
        "train.mixed_precision": precision,
        "generation.max_new_tokens": 12,
        **extra,
    }
    classifier = ("{type: classifier, path: '%s', labels: {negative: -1.0, neutral: 0.1, positive: 10.0}, "
                  "scale_by_confidence: true" % (models / "reward"))
    if "grpo" in recipe:  # the recipe's own two components, the classifier pointed at the tiny one
        sets["reward.components"] = (f"[{classifier}, text: response}}, {{type: function, function: "
                                     f"'{ROOT / 'recipes/rewards/min_length.py'}:too_short'}}]")
    else:
        sets["reward.components"] = f"[{classifier}}}]"
    args = ["train", str(ROOT / "recipes" / recipe)]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    run = out / name
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    recorded = [{k: v for k, v in row.items() if not k.startswith(UNRECORDED_PREFIXES)} for row in metrics]
    return recorded, _weights(run / "final")


def _weights(final: Path) -> dict:
    """Every safetensors file under final/: its SHA-256, and each tensor's sum and sum of squares."""
    from safetensors.torch import load_file

    out = {}
    for path in sorted(final.rglob("*.safetensors")):
        tensors = load_file(path)
        out[str(path.relative_to(final))] = {
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "sums": {k: [float(t.double().sum()), float(t.double().square().sum())] for k, t in sorted(tensors.items())},
        }
    return out


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("behaviour")
    return {f"{case}-{precision}": _train(tiny_models, out, recipe, precision, extra)
            for case, (recipe, extra) in CASES.items() for precision in PRECISIONS}


def _same_cpu(recorded: dict, fingerprint: dict) -> bool:
    return {k: v for k, v in recorded.items() if k != "threads"} == {k: v for k, v in fingerprint.items() if k != "threads"}


def _near(name: str, got: float, want: float) -> bool:
    """Within 1e-3 of the record (the same CPU with another thread count). An explained variance
    (1 - var(residual) / var(return)) is compared as its variance ratio: near 0 it is a difference of two
    near-equal numbers, moved by far more than 1e-3 of itself when the ratio moves by 1e-3."""
    if name.endswith("explained_variance"):
        got, want = 1.0 - got, 1.0 - want
    return got == pytest.approx(want, rel=1e-3, abs=1e-5, nan_ok=True)


def test_training_numbers_equal_the_record(runs):
    fingerprint = machine_fingerprint()
    records = json.loads(RECORD.read_text())["records"] if RECORD.exists() else []
    if os.environ.get("PPO_RECORD_BEHAVIOUR"):
        records = [r for r in records if r["machine"] != fingerprint] + [{"machine": fingerprint, "runs": {
            key: {"metrics": metrics, "weights": weights} for key, (metrics, weights) in runs.items()}}]
        RECORD.write_text(json.dumps({"records": records}, indent=1) + "\n")
    record = next((r for r in records if r["machine"] == fingerprint), None)
    exact = record is not None
    if record is None:  # this CPU and these libraries with another thread count: sums in another order
        record = next((r for r in records if _same_cpu(r["machine"], fingerprint)), None)
    if record is None:
        pytest.skip(f"no record of this machine's numbers ({fingerprint}): check out the last commit CI passed and "
                    "run PPO_RECORD_BEHAVIOUR=1 scripts/test.sh tests/integration/test_behaviour_unchanged.py")
    assert sorted(runs) == sorted(record["runs"])
    differ = []  # every number off the record, not only the first
    for key, (metrics, weights) in runs.items():
        expected = record["runs"][key]
        assert len(metrics) == len(expected["metrics"]), key
        for step, (row, want) in enumerate(zip(metrics, expected["metrics"]), start=1):
            assert sorted(row) == sorted(want), (key, step, sorted(set(row) ^ set(want)))
            for name, value in want.items():
                got = row[name]
                if exact or not isinstance(value, float):
                    same = got == value or (isinstance(value, float) and math.isnan(value) and math.isnan(got))
                else:
                    same = _near(name, got, value)
                if not same:
                    differ.append(f"{key} update {step} {name}: {got!r} != recorded {value!r}")
        assert sorted(weights) == sorted(expected["weights"]), key
        for file, want in expected["weights"].items():
            if exact and weights[file]["sha256"] != want["sha256"]:
                differ.append(f"{key} {file}: weights differ from the record")
            elif not exact:
                differ += [f"{key} {tensor}: sums {weights[file]['sums'][tensor]} != recorded {sums}"
                           for tensor, sums in want["sums"].items()
                           if weights[file]["sums"][tensor] != pytest.approx(sums, rel=1e-3, abs=1e-6)]
    assert not differ, f"{len(differ)} numbers differ from the record:\n" + "\n".join(differ[:40])
