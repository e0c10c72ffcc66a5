"""A model given as a .gguf file: the checks before loading, what it resolves to, its model card.
Fake files only (the GGUF magic bytes, nothing more): no model loads here."""

from __future__ import annotations

import importlib.util

import pytest
from typer.testing import CliRunner

from ppo_cli.cli import app
from ppo_cli.errors import ModelReferenceError
from ppo_cli.model_card import front_matter, render_model_card
from ppo_cli.model_refs import check_model_reference, gguf_location, is_gguf, resolve_model_reference
from tests.conftest import ROOT

RECIPE = ROOT / "recipes" / "smollm2_concise.yaml"


@pytest.fixture
def fake_gguf(tmp_path):
    path = tmp_path / "model.Q4_1.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00")
    return path


def test_gguf_paths_and_their_from_pretrained_location():
    assert is_gguf("models/x/SmolLM2.Q4_1.GGUF") and not is_gguf("models/x") and not is_gguf("org/gguf-model")
    assert gguf_location("models/x/SmolLM2.Q4_1.gguf") == ("models/x", "SmolLM2.Q4_1.gguf")


def test_a_gguf_file_is_checked_before_loading(tmp_path, fake_gguf, monkeypatch):
    check_model_reference(str(fake_gguf))  # a GGUF file, and the gguf package is installed (dev extra)
    missing, not_gguf = tmp_path / "nope.gguf", tmp_path / "text.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(ModelReferenceError) as err:
        check_model_reference(str(missing))
    assert str(err.value) == f"GGUF file not found: {missing}"
    with pytest.raises(ModelReferenceError) as err:
        check_model_reference(str(not_gguf))
    assert str(err.value) == f"{not_gguf} is not a GGUF file (it does not start with the GGUF magic bytes)"
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    with pytest.raises(ModelReferenceError) as err:
        check_model_reference(str(fake_gguf))
    assert (str(err.value), err.value.hint) == (
        f"reading the GGUF file {fake_gguf} needs the gguf package, which is not installed", "pip install gguf")


def test_a_gguf_file_is_a_model_reference(fake_gguf):
    resolved = resolve_model_reference(str(fake_gguf))
    assert (resolved.kind, resolved.base_path, resolved.tokenizer_path) == ("model", str(fake_gguf), str(fake_gguf))


def test_validate_names_a_bad_gguf_policy_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    missing = tmp_path / "SmolLM2.gguf"
    result = CliRunner().invoke(app, ["validate", str(RECIPE), "--set", f"policy.path={missing}"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.startswith(("error:", "hint:"))]
    assert lines == [f"error: policy.path: GGUF file not found: {missing}", "hint: check the path (relative to the current directory)"]
    assert "Traceback" not in result.output


def test_the_model_card_of_a_run_from_a_gguf_names_the_file_and_loads_it_with_gguf_file():
    info = {"policy_path": "models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "lora": True, "step": 16}
    card = render_model_card(info, "name: x\n")
    assert "starting from `models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (a GGUF file, dequantized at load)" in card
    assert ("model = AutoModelForCausalLM.from_pretrained('models/smollm2', gguf_file='SmolLM2-135M-Instruct.Q4_1.gguf')"
            in card)
    assert "base_model" not in front_matter(info["policy_path"], True)  # a file names no hub repository


def test_a_gguf_files_config_and_tokenizer_are_read_once_per_process_each_caller_getting_its_own_copy(
        fake_gguf, monkeypatch):
    import os

    import transformers
    from transformers import LlamaConfig

    from ppo_cli import gguf_cache
    from ppo_cli.engine.precision import model_widths
    from ppo_cli.plan_memory import describe_model

    reads = []

    def from_pretrained(location, gguf_file=None, **kwargs):
        reads.append((location, gguf_file))
        return LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           vocab_size=128, quantization_config={"quant_method": "gguf"})

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    gguf_cache._read_config.cache_clear()
    first = gguf_cache.gguf_config(str(fake_gguf))
    first.hidden_size = 1
    assert gguf_cache.gguf_config(str(fake_gguf)).hidden_size == 64  # a copy each, not the cached one
    assert model_widths(str(fake_gguf)) == (64, 96)
    shape = describe_model(str(fake_gguf), "causal_lm")
    assert (shape.hidden, shape.layers, shape.vocab) == (64, 2, 128)
    assert not hasattr(first, "quantization_config")  # the model loads dequantized
    assert reads == [(str(fake_gguf.parent), fake_gguf.name)]
    os.utime(fake_gguf, ns=(1, 1))  # the file changed since: read again
    gguf_cache.gguf_config(str(fake_gguf))
    assert len(reads) == 2
    gguf_cache._read_config.cache_clear()


def test_a_gguf_files_tokenizer_is_read_once_and_each_load_gets_its_own(fake_gguf, monkeypatch):
    import transformers

    from ppo_cli import gguf_cache
    from ppo_cli.engine.models import load_tokenizer
    from tests.fixtures.tiny_models import train_tokenizer

    reads = []

    def from_pretrained(location, gguf_file=None, **kwargs):
        reads.append((location, gguf_file))
        return train_tokenizer(["a review of a film", "a good film, a bad film"])

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    gguf_cache._read_tokenizer.cache_clear()
    first, second = load_tokenizer(str(fake_gguf)), load_tokenizer(str(fake_gguf))
    assert reads == [(str(fake_gguf.parent), fake_gguf.name)]
    assert first is not second and first.padding_side == second.padding_side == "left"
    first.add_special_tokens({"additional_special_tokens": ["<only-in-first>"]})
    assert len(second) == len(first) - 1
    gguf_cache._read_tokenizer.cache_clear()
