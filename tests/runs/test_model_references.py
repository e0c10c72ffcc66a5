"""Model references (base / aligned / run / checkpoint / local / hub) -> paths, and atomic outputs.

Fake run directories only (a few small files), so nothing here loads a model or imports torch.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from ppo_cli.errors import ModelReferenceError, UsageError
from ppo_cli.model_refs import latest_run, recipe_for_models, resolve_model_reference
from ppo_cli.runs import AtomicJsonlWriter, check_output_path, write_jsonl_atomic


def make_run(root: Path, name: str, *, lora: bool = True, final: bool = True, checkpoint: bool = True) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "recipe.yaml").write_text(f"name: {name}\npolicy:\n  path: models/base-{name}\n")
    targets = ([run / "final"] if final else []) + ([run / "checkpoints" / "step-000002"] if checkpoint else [])
    for directory in targets:
        directory.mkdir(parents=True)
        weights = "adapter_config.json" if lora else "config.json"
        (directory / weights).write_text(json.dumps({"base_model_name_or_path": "somewhere/else"}))
        (directory / "tokenizer_config.json").write_text("{}")
        (directory / "manifest.json").write_text("{}")
    if final:
        (run / "final" / "ppo_cli.json").write_text(json.dumps({"policy_path": f"models/base-{name}", "lora": lora}))
    return run


@pytest.fixture
def runs(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    old, new = make_run(tmp_path / "runs", "old"), make_run(tmp_path / "runs", "new")
    past = time.time() - 100
    for path in (old, old / "recipe.yaml", old / "final"):
        os.utime(path, (past, past))
    return tmp_path / "runs"


def test_base_and_aligned_resolve_against_the_most_recent_run(runs: Path):
    base = resolve_model_reference("base")
    assert (base.kind, base.base_path, base.adapter_dir, base.full_model_dir) == ("base", "models/base-new", None, None)
    assert base.recipe_path.resolve() == (runs / "new" / "recipe.yaml").resolve()
    aligned = resolve_model_reference("aligned")
    assert aligned.kind == "aligned"
    assert aligned.adapter_dir.resolve() == (runs / "new" / "final").resolve()
    assert aligned.base_path == "models/base-new"  # ppo_cli.json wins over adapter_config's base
    assert aligned.tokenizer_path == str(aligned.adapter_dir)


def test_run_option_picks_the_run(runs: Path):
    assert resolve_model_reference("base", runs / "old").base_path == "models/base-old"
    assert latest_run(runs) == runs / "new"


def test_run_directory_means_its_final_model_and_a_checkpoint_keeps_the_run_base(runs: Path):
    by_run = resolve_model_reference(str(runs / "old"))
    assert by_run.adapter_dir.resolve() == (runs / "old" / "final").resolve()
    checkpoint = resolve_model_reference(str(runs / "old" / "checkpoints" / "step-000002"))
    assert (checkpoint.kind, checkpoint.base_path) == ("checkpoint", "models/base-old")
    assert checkpoint.recipe_path.resolve() == (runs / "old" / "recipe.yaml").resolve()


def test_full_fine_tune_final_is_loaded_whole_with_the_run_base_as_reference(tmp_path: Path):
    run = make_run(tmp_path, "full", lora=False)
    resolved = resolve_model_reference(str(run / "final"))
    assert resolved.adapter_dir is None
    assert resolved.full_model_dir == run / "final"
    assert resolved.weights_path == str(run / "final")
    assert resolved.base_path == "models/base-full"


def test_plain_local_model_and_hub_id(tmp_path: Path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    local = resolve_model_reference(str(model))
    assert (local.kind, local.base_path, local.recipe_path) == ("model", str(model), None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    hub = resolve_model_reference("Qwen/Qwen2.5-0.5B")
    assert (hub.kind, hub.base_path) == ("hub", "Qwen/Qwen2.5-0.5B")


@pytest.mark.parametrize(
    "ref, message, hint_start",
    [
        ("alignd", "unknown model reference 'alignd'", "did you mean 'aligned'?"),
        ("not a model!", "unknown model reference 'not a model!'", "a model is 'base' or 'aligned'"),
        ("./missing", "model directory not found: ./missing", "check the path"),
        ("some-hub-model", "unknown model reference 'some-hub-model': not base/aligned, not a directory, "
         "and the hub is offline (HF_HUB_OFFLINE=1)", "a model is"),
    ],
)
def test_unknown_references_get_one_clear_line(tmp_path: Path, monkeypatch, ref, message, hint_start):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelReferenceError) as err:
        resolve_model_reference(ref)
    assert err.value.message == message
    assert err.value.hint.startswith(hint_start)


def test_missing_runs_are_reported(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelReferenceError, match=r"^no run found under runs/$"):
        resolve_model_reference("aligned")
    with pytest.raises(ModelReferenceError, match=r"^run directory not found: nope$"):
        resolve_model_reference("base", "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelReferenceError, match=r"^empty is not a run directory \(no recipe.yaml\)$"):
        resolve_model_reference("base", "empty")
    unfinished = make_run(tmp_path / "runs", "unfinished", final=False)
    with pytest.raises(ModelReferenceError, match=r"has no final/ model$") as err:
        resolve_model_reference("aligned", unfinished)
    assert err.value.hint == f"use a checkpoint instead, e.g. {unfinished / 'checkpoints' / 'step-000002'}"


def test_directory_that_is_not_a_model(tmp_path: Path):
    (tmp_path / "stuff").mkdir()
    with pytest.raises(ModelReferenceError, match="not a model, run or checkpoint directory"):
        resolve_model_reference(str(tmp_path / "stuff"))


def test_recipe_comes_from_the_model_run_then_the_run_option(runs: Path, tmp_path: Path):
    aligned = resolve_model_reference("aligned", runs / "old")
    assert recipe_for_models([aligned]) == aligned.recipe_path
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    local = resolve_model_reference(str(model))
    assert recipe_for_models([local], runs / "old") == runs / "old" / "recipe.yaml"
    with pytest.raises(ModelReferenceError, match=f"^no recipe for {model}: it is not part of a run, and no run found"):
        recipe_for_models([local], output_root=tmp_path / "elsewhere")


def test_atomic_jsonl_writer_leaves_nothing_behind_on_error(tmp_path: Path):
    out = tmp_path / "out.jsonl"
    out.write_text("old contents\n")
    with pytest.raises(RuntimeError):
        with AtomicJsonlWriter(out) as writer:
            writer.write({"a": 1})
            raise RuntimeError("failed half way")
    assert out.read_text() == "old contents\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]
    assert write_jsonl_atomic(out, [{"a": 1}, {"b": "é"}]) == 2
    assert out.read_text(encoding="utf-8") == '{"a": 1}\n{"b": "é"}\n'


def test_check_output_path_rejects_a_directory(tmp_path: Path):
    with pytest.raises(UsageError, match=r"is a directory$"):
        check_output_path(tmp_path)
    assert check_output_path(tmp_path / "new" / "out.jsonl") == tmp_path / "new" / "out.jsonl"


@pytest.mark.parametrize("umask", [0o022, 0o027])  # neither gives mkstemp's 0600 or mkdtemp's 0700
def test_atomic_outputs_get_the_mode_the_umask_gives(tmp_path: Path, umask: int):
    """mkstemp/mkdtemp make private files; outputs must look like any file the user writes."""
    from ppo_cli.checkpoint import atomic_directory
    from ppo_cli.runs import atomic_write_text

    previous = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "summary.json", "{}")
        write_jsonl_atomic(tmp_path / "rows.jsonl", [{"a": 1}])
        with atomic_directory(tmp_path / "final", {"kind": "final"}) as tmp:
            (tmp / "weights.bin").write_bytes(b"x")
            os.chmod(tmp / "weights.bin", 0o600)  # as some libraries write theirs
            (tmp / "sub").mkdir()
    finally:
        os.umask(previous)
    file_mode, dir_mode = 0o666 & ~umask, 0o777 & ~umask
    for name in ("summary.json", "rows.jsonl", "final/weights.bin", "final/manifest.json"):
        assert (tmp_path / name).stat().st_mode & 0o777 == file_mode, name
    for name in ("final", "final/sub"):
        assert (tmp_path / name).stat().st_mode & 0o777 == dir_mode, name


def test_a_hub_id_on_a_machine_without_network_fails_at_once(tmp_path: Path, monkeypatch):
    """Not local, hub not offline, but its host does not resolve: one line before any retry loop,
    unless the model is in the hub cache (transformers then loads it without the network)."""
    import socket

    from ppo_cli.model_refs import check_model_reference

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)

    def no_dns(host, *args, **kwargs):
        assert host == "huggingface.co"
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    with pytest.raises(ModelReferenceError) as err:
        check_model_reference("mymodel")
    assert err.value.message == ("model 'mymodel' is not a local directory, and the hub cannot be reached "
                                 "(huggingface.co does not resolve: Name or service not known)")
    monkeypatch.setattr("huggingface_hub.try_to_load_from_cache", lambda repo, name: f"/cache/{repo}/{name}")
    check_model_reference("mymodel")  # cached: allowed
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    monkeypatch.setattr("huggingface_hub.try_to_load_from_cache", lambda repo, name: None)
    check_model_reference("mymodel")  # a proxy resolves names itself: not judged here


@pytest.mark.parametrize("value", ["1", "true", "ON", "yes"])
def test_offline_hub_refuses_only_what_is_not_cached(value, tmp_path: Path, monkeypatch):
    from ppo_cli.model_refs import check_model_reference

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    monkeypatch.setattr("huggingface_hub.try_to_load_from_cache", lambda repo, name: None)
    with pytest.raises(ModelReferenceError, match=r"the hub is offline"):
        check_model_reference("Qwen/Qwen2.5-0.5B")
    cached = {("Qwen/Qwen2.5-0.5B", "config.json"), ("someone/adapter", "adapter_config.json")}
    monkeypatch.setattr("huggingface_hub.try_to_load_from_cache",
                        lambda repo, name: f"/cache/{repo}/{name}" if (repo, name) in cached else None)
    check_model_reference("Qwen/Qwen2.5-0.5B")
    check_model_reference("someone/adapter")  # an adapter repo has no config.json


def test_a_missing_models_smollm2_says_which_script_writes_it(tmp_path: Path, monkeypatch):
    """models/smollm2 (the SmolLM2 recipes' policy.path) reads like a hub id: offline, the hint names the
    script that writes it instead of `hf download`; another hub id keeps the general hint."""
    from ppo_cli.model_refs import check_model_reference

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.try_to_load_from_cache", lambda repo, name: None)
    with pytest.raises(ModelReferenceError) as err:
        check_model_reference("models/smollm2")
    assert err.value.message == "model 'models/smollm2' is not a local directory and the hub is offline (HF_HUB_OFFLINE=1)"
    assert err.value.hint == ("the SmolLM2 recipes' models/smollm2 is written by python scripts/fetch_smollm2.py, run "
                              f"from the repository root (paths are relative to the current directory, {tmp_path})")
    with pytest.raises(ModelReferenceError) as err:
        check_model_reference("someone/model")
    assert err.value.hint == "download it first (`hf download`) or point at a local directory"


def _write_final(target: Path, text: str) -> None:
    from ppo_cli.checkpoint import atomic_directory

    with atomic_directory(target, {"kind": "final"}) as tmp:
        (tmp / "weights.bin").write_text(text)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-aside"])
def test_final_is_replaced_whole_with_nothing_left_beside_it(tmp_path: Path, monkeypatch, exchange: bool):
    from ppo_cli import runs

    if exchange:
        probe_a, probe_b = tmp_path / "a", tmp_path / "b"
        probe_a.mkdir(), probe_b.mkdir()
        assert runs._exchange(probe_a, probe_b), "renameat2 RENAME_EXCHANGE is not available here"
        probe_a.rmdir(), probe_b.rmdir()
    else:
        monkeypatch.setattr(runs, "_exchange", lambda a, b: False)
    target = tmp_path / "final"
    for text in ("old", "new", "newer"):
        _write_final(target, text)
        assert (target / "weights.bin").read_text() == text
        assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_a_crash_between_the_renames_keeps_the_old_final(tmp_path: Path, monkeypatch):
    """Without an atomic exchange the old final/ is renamed aside first: killed before the new one goes
    in, the old one is put back (by the next write, or by resolving the run's model)."""
    from ppo_cli import runs

    monkeypatch.setattr(runs, "_exchange", lambda a, b: False)
    target = tmp_path / "final"
    _write_final(target, "old")
    real_rename = Path.rename

    def killed_before_moving_new_in(self, destination):
        if Path(destination) == target and self.name.startswith(".final-"):
            raise KeyboardInterrupt
        return real_rename(self, destination)

    monkeypatch.setattr(Path, "rename", killed_before_moving_new_in)
    with pytest.raises(KeyboardInterrupt):
        _write_final(target, "new")
    monkeypatch.setattr(Path, "rename", real_rename)
    assert not target.exists()  # the window the exchange closes
    runs.restore_replaced_directory(target)
    assert (target / "weights.bin").read_text() == "old"
    _write_final(target, "newest")
    assert (target / "weights.bin").read_text() == "newest"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


@pytest.mark.parametrize("ref, local", [
    ("Qwen/Qwen2.5-0.5B", False), ("gpt2", False), ("./model", True), ("/abs/model", True), ("~/model", True),
    ("runs/x/final", True), ("org/name/", True), ("models\\tiny", True),
])
def test_one_rule_tells_a_local_path_from_a_hub_id(ref, local):
    from ppo_cli.model_refs import looks_like_local_path

    assert looks_like_local_path(ref) is local


def test_policy_adapter_of_a_run_goes_with_base_and_adapter_models_but_not_full_weights(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lora = make_run(tmp_path / "runs", "lora")
    info = json.loads((lora / "final" / "ppo_cli.json").read_text())
    (lora / "final" / "ppo_cli.json").write_text(json.dumps({**info, "policy_adapter": "sft/adapter"}))
    assert resolve_model_reference("base", lora).base_adapter == "sft/adapter"
    assert resolve_model_reference("aligned", lora).base_adapter == "sft/adapter"
    assert resolve_model_reference("base", lora).describe() == "base = models/base-lora + adapter sft/adapter"
    # A final/ copied out of its run still knows the adapter under its base.
    (tmp_path / "copied").mkdir()
    for item in (lora / "final").iterdir():
        (tmp_path / "copied" / item.name).write_bytes(item.read_bytes())
    copied = resolve_model_reference("copied")
    assert (copied.base_path, copied.base_adapter) == ("somewhere/else", "sft/adapter")
    # Before final/ exists, the run's recipe says it; full weights already hold the adapter.
    full = make_run(tmp_path / "runs", "full", lora=False, final=False)
    (full / "recipe.yaml").write_text("name: full\npolicy:\n  path: models/base-full\n  adapter: sft/adapter\n")
    assert resolve_model_reference("base", full).base_adapter == "sft/adapter"
    checkpoint = resolve_model_reference(str(full / "checkpoints" / "step-000002"))
    assert checkpoint.full_model_dir is not None and checkpoint.base_adapter is None
