"""Bad input of every kind through the real CLI: non-zero exit, one line naming the problem, no
traceback, nothing half-written, nothing already written lost."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import yaml
from typer.testing import CliRunner

from ppo_cli.cli import app
from ppo_cli.errors import EXIT_RUNTIME, EXIT_USAGE
from tests.conftest import ROOT

runner = CliRunner()
CONVERSATION_ROW = '{"prompt": [{"role": "user", "content": "How was the movie?"}]}\n'
TEMP_MARKERS = (".tmp", ".final-", ".step-")


@dataclass
class Env:
    tmp: Path
    models: Path

    def recipe(self, edit: Callable[[dict], None] | None = None, text: str | None = None) -> str:
        """The demo recipe pointed at the tiny models and tmp/, optionally edited; returns its path."""
        data = yaml.safe_load((ROOT / "recipes" / "tiny_sentiment.yaml").read_text())
        data["policy"]["path"] = str(self.models / "policy")
        data["reward"]["components"][0]["path"] = str(self.models / "reward")
        for component in data["reward"]["components"]:  # the recipe's reward files, from any directory
            if component["type"] == "function" and component["function"].startswith("recipes/"):
                component["function"] = str(ROOT / component["function"])
        data["data"]["prompts"] = str(ROOT / "recipes/prompts/reviews.txt")
        data["data"]["eval_prompts"] = None
        data["output_dir"] = str(self.tmp / "runs")
        data["train"]["save_every"] = 1
        if edit:
            edit(data)
        path = self.tmp / "recipe.yaml"
        path.write_text(text if text is not None else yaml.safe_dump(data, sort_keys=False))
        return str(path)

    def file(self, name: str, content: str | bytes) -> str:
        path = self.tmp / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return str(path)

    def policy_without_template(self) -> str:
        """The policy with tokenizer files whose config defines no chat template (a base model's)."""
        target = self.tmp / "base-policy"
        shutil.copytree(self.models / "policy", target)
        (target / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
        return str(target)

    def corrupt_model(self, name: str) -> str:
        """A copy of a tiny model whose weights file is cut short: found by every check, fails to load."""
        target = self.tmp / f"corrupt-{name}"
        shutil.copytree(self.models / name, target)
        weights = target / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
        return str(target)

    def fake_run(self, corrupt: bool = False, manifest: bool = True, checkpoints: bool = True,
                 final_step: int | None = None) -> Path:
        """runs/tiny-sentiment with its recipe.yaml and one checkpoint (tiny files, not real weights),
        and with ``final_step`` a final/ that says how many updates the run finished."""
        from ppo_cli.checkpoint import write_manifest
        from ppo_cli.recipe_loading import dump_resolved, load_recipe

        recipe_path = self.recipe()
        run = self.tmp / "runs" / "tiny-sentiment"
        checkpoint = run / "checkpoints" / "step-000001"
        checkpoint.mkdir(parents=True)
        (run / "recipe.yaml").write_text(dump_resolved(load_recipe(recipe_path)))
        (run / "metrics.jsonl").write_text('{"step": 1}\n')
        if final_step is not None:
            (run / "final").mkdir()
            (run / "final" / "ppo_cli.json").write_text(json.dumps({"step": final_step}))
        if not checkpoints:
            checkpoint.rmdir()
            return run
        (checkpoint / "trainer_state.json").write_text('{"step": 1}')
        (checkpoint / "value_head.safetensors").write_bytes(b"weights")
        if manifest:
            write_manifest(checkpoint, {"kind": "checkpoint", "step": 1})
        if corrupt:
            (checkpoint / "value_head.safetensors").write_bytes(b"weightz")
        return run


def _set(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


def _edit(path: str, value) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        *parents, leaf = path.split(".")
        node = data
        for key in parents:
            node = node[int(key)] if key.isdigit() else node[key]
        if value is _DELETE:
            del node[leaf]
        else:
            node[leaf] = value

    return edit


_DELETE = object()
CSV_WITHOUT_QUESTION = "text,id\na,1\n"
CONVERSATION_ROW = '{"prompt": [{"role": "user", "content": "hi"}]}\n'


def _both(*edits: Callable[[dict], None]) -> Callable[[dict], None]:
    return lambda data: [edit(data) for edit in edits] and None


NOT_UTF8 = "I think the book was\n".encode() + b"\xff\xfe bad bytes\n"
FN_OK = "def reward(prompts, responses):\n    return [1.0] * len(responses)\n"
FN_SYNTAX_ERROR = "def reward(prompts, responses:\n"
FN_TAKES_SOLUTION = "def reward(prompts, responses, solution):\n    return [1.0] * len(responses)\n"
ROWS_WITH_ANSWER = '{"prompt": "What is 1+1?", "answer": "2"}\n'


def _reward_function(e: Env, source: str) -> list[str]:
    return _set(f"reward.components=[{{type: function, function: '{e.file('fn.py', source)}:reward'}}]")


def _columns(command: str, source: str, eval_rows: str | None = None) -> Callable[[Env], list[str]]:
    """`ppo COMMAND` with prompt rows that have an answer, held-out rows ``eval_rows`` and the reward function ``source``."""
    def build(e: Env) -> list[str]:
        edits = [_edit("data.prompts", e.file("p.jsonl", ROWS_WITH_ANSWER))]
        if eval_rows is not None:
            edits.append(_edit("data.eval_prompts", e.file("eval.jsonl", eval_rows)))
        return [command, e.recipe(_both(*edits))] + _reward_function(e, source)

    return build


# (id, argv builder, text the one error line must contain)
CASES: list[tuple[str, Callable[[Env], list[str]], str]] = [
    # --- recipes ---
    ("recipe-missing", lambda e: ["train", str(e.tmp / "nope.yaml")], "nope.yaml"),
    ("recipe-is-directory", lambda e: ["train", str(e.tmp)], "directory"),
    ("recipe-yaml-syntax", lambda e: ["train", e.recipe(text="name: x\npolicy: [unclosed\n")], "recipe.yaml:3: YAML syntax error"),
    ("recipe-not-a-mapping", lambda e: ["train", e.recipe(text="- a\n- b\n")], "mapping"),
    ("recipe-empty", lambda e: ["train", e.recipe(text="")], "empty"),
    ("recipe-unknown-key", lambda e: ["train", e.recipe(_edit("ppo.kl_coeff", 0.1))], "kl_coeff"),
    ("recipe-wrong-type", lambda e: ["train", e.recipe(_edit("ppo.ppo_epochs", "four"))], "ppo.ppo_epochs"),
    ("recipe-bad-choice", lambda e: ["train", e.recipe(_edit("ppo.kl_estimator", "k9"))], "ppo.kl_estimator"),
    ("recipe-missing-key", lambda e: ["train", e.recipe(_edit("train.total_updates", _DELETE))], "train.total_updates"),
    ("recipe-batches-dont-divide", lambda e: ["train", e.recipe(_edit("ppo.mini_batch_size", 5))], "mini_batch_size"),
    ("recipe-4bit-without-lora", lambda e: ["train", e.recipe(_edit("policy.lora", None))] + _set("policy.quantization=4bit", "value.kind=auto"), "cannot be trained without LoRA"),
    ("recipe-negative-lr", lambda e: ["train", e.recipe(_edit("optim.lr", -1.0))], "optim.lr"),
    ("recipe-bad-function-spec", lambda e: ["train", e.recipe()] + _set("reward.components=[{type: function, function: no_colon}]"), "reward.components.0.function"),
    # --- overrides ---
    ("override-no-equals", lambda e: ["train", e.recipe()] + _set("ppo.kl_coef"), "ppo.kl_coef"),
    ("override-unknown-path", lambda e: ["train", e.recipe()] + _set("ppo.kl_coeff=0.1"), "kl_coeff"),
    ("override-wrong-type", lambda e: ["train", e.recipe()] + _set("train.total_updates=many"), "train.total_updates"),
    ("override-bad-index", lambda e: ["train", e.recipe()] + _set("reward.components.7.weight=2"), "reward.components"),
    # --- prompt files ---
    ("prompts-missing", lambda e: ["train", e.recipe(_edit("data.prompts", str(e.tmp / "none.txt")))], "prompts file not found"),
    ("prompts-empty", lambda e: ["train", e.recipe(_edit("data.prompts", e.file("p.txt", "")))], "no prompts"),
    ("prompts-blank-lines-only", lambda e: ["train", e.recipe(_edit("data.prompts", e.file("p.txt", "\n  \n\n")))], "no prompts"),
    ("prompts-not-utf8", lambda e: ["train", e.recipe(_edit("data.prompts", e.file("p.txt", NOT_UTF8)))], "not UTF-8"),
    ("prompts-jsonl-not-object", lambda e: ["train", e.recipe(_edit("data.prompts", e.file("p.jsonl", '["a"]\n')))], "expected a JSON object"),
    ("prompts-jsonl-missing-field", lambda e: ["train", e.recipe(_edit("data.prompts", e.file("p.jsonl", '{"text": "a"}\n')))], "no 'prompt' or 'messages' field"),
    ("prompts-jsonl-invalid-json", lambda e: ["train", e.recipe(_edit("data.prompts", e.file("p.jsonl", '{"prompt": \n')))], "not valid JSON"),
    ("prompts-hub-id-offline", lambda e: ["train", e.recipe(_edit("data.prompts", "someorg/no-such-prompts"))], "dataset 'someorg/no-such-prompts' is not a local file and the hub is offline (HF_HUB_OFFLINE=1)"),
    ("prompts-conversation-bad-message", lambda e: ["validate", e.recipe(_edit("data.prompts", e.file("p.jsonl", '{"messages": [{"role": "user"}]}\n')))], "p.jsonl:1: 'messages' message 0: no 'content' (keys: role)"),
    ("prompts-csv-unknown-column", lambda e: ["train", e.recipe(_both(_edit("data.field", "question"), _edit("data.prompts", e.file("p.csv", CSV_WITHOUT_QUESTION))))], "p.csv: no 'question' column (columns: text, id)"),
    ("prompts-conversations-with-prompt-and-response-reward", lambda e: ["train", e.recipe(_both(_edit("reward.components.0.text", "prompt_and_response"), _edit("data.prompts", e.file("p.jsonl", CONVERSATION_ROW))))], "reads text: prompt_and_response, but the prompts are conversations"),
    ("eval-prompts-missing", lambda e: ["train", e.recipe(_edit("data.eval_prompts", str(e.tmp / "none.txt")))], "prompts file not found"),
    # --- model paths ---
    ("policy-dir-missing", lambda e: ["train", e.recipe(_edit("policy.path", str(e.tmp / "no-model")))], "policy.path: model directory not found"),
    ("policy-path-is-file", lambda e: ["train", e.recipe(_edit("policy.path", e.file("model.bin", "x")))], "is a file"),
    ("policy-dir-without-config", lambda e: ["train", e.recipe(_edit("policy.path", str(e.tmp)))], "no config.json"),
    ("policy-hub-id-offline", lambda e: ["train", e.recipe(_edit("policy.path", "Qwen/Qwen2.5-1.5B"))], "hub is offline"),
    ("plan-policy-dir-missing", lambda e: ["plan", e.recipe(_edit("policy.path", str(e.tmp / "no-model")))], "policy.path: model directory not found"),
    ("plan-reward-model-hub-id-offline", lambda e: ["plan", e.recipe(_edit("reward.components.0.path", "someorg/rm"))], "reward.components.0.path: model 'someorg/rm' is not a local directory"),
    ("policy-weights-corrupt", lambda e: ["train", e.recipe(_edit("policy.path", e.corrupt_model("policy")))], "cannot load"),
    ("adapter-dir-missing", lambda e: ["train", e.recipe()] + _set(f"policy.adapter={e.tmp / 'no-adapter'}"), "policy.adapter: model directory not found"),
    ("adapter-dir-is-a-model", lambda e: ["validate", e.recipe()] + _set(f"policy.adapter={e.models / 'policy'}"), "no adapter_config.json here, so it is not a peft adapter"),
    ("adapter-hub-id-offline", lambda e: ["validate", e.recipe()] + _set("policy.adapter=someone/sft-adapter"), "policy.adapter: model 'someone/sft-adapter' is not a local directory"),
    ("lora-target-not-in-the-model", lambda e: ["train", e.recipe()] + _set("policy.lora.target_modules=[foo_proj]"), "policy.lora.target_modules: foo_proj not found in"),
    ("reward-model-missing", lambda e: ["train", e.recipe(_edit("reward.components.0.path", str(e.tmp / "no-rm")))], "reward.components.0.path: model directory not found"),
    ("reward-labels-unknown", lambda e: ["train", e.recipe(_edit("reward.components.0.labels", {"happy": 1.0}))], "has no label(s) happy"),
    # --- reward functions ---
    ("function-file-missing", lambda e: ["train", e.recipe()] + _set(f"reward.components=[{{type: function, function: '{e.tmp}/none.py:reward'}}]"), "reward function file not found"),
    ("function-name-missing", lambda e: ["train", e.recipe()] + _set(f"reward.components=[{{type: function, function: '{e.file('fn.py', FN_OK)}:other'}}]"), "has no function 'other'"),
    ("function-bad-signature", lambda e: ["train", e.recipe()] + _set(f"reward.components=[{{type: function, function: '{e.file('fn.py', 'def reward(x): return []')}:reward'}}]"), "must take two arguments"),
    ("function-import-error", lambda e: ["train", e.recipe()] + _set(f"reward.components=[{{type: function, function: '{e.file('fn.py', 'import no_such_module')}:reward'}}]"), "cannot import reward function module"),
    ("function-module-missing", lambda e: ["train", e.recipe()] + _set("reward.components=[{type: function, function: 'no_such_pkg.rewards:reward'}]"), "cannot import reward function module"),
    # --- output directories and checkpoints ---
    ("run-exists-without-overwrite", lambda e: (e.fake_run(), ["train", e.recipe()])[1], "already holds a run"),
    ("output-dir-is-a-run", lambda e: (e.fake_run(), ["train", e.recipe(_edit("output_dir", str(e.tmp / "runs" / "tiny-sentiment")))])[1], "is an existing run's directory, so this run would be nested in it"),
    ("output-dir-is-a-file", lambda e: ["train", e.recipe(_edit("output_dir", e.file("runs-file", "x")))], "runs-file"),
    ("resume-without-a-run", lambda e: ["train", e.recipe(), "--resume", "latest"], "no run to resume at"),
    ("resume-without-checkpoints", lambda e: (e.fake_run(checkpoints=False), ["train", e.recipe(), "--resume", "latest"])[1], "no complete checkpoint"),
    ("resume-a-complete-run", lambda e: (e.fake_run(final_step=30), ["train", e.recipe(), "--resume", "latest"])[1], "is already complete (30/30 updates)"),
    ("resume-from-final", lambda e: (e.fake_run(final_step=30), ["train", e.recipe(), "--resume", str(e.tmp / "runs" / "tiny-sentiment" / "final")])[1], "holds the trained weights but no optimizer, scheduler or data state"),
    ("resume-corrupted-checkpoint", lambda e: (e.fake_run(corrupt=True), ["train", e.recipe(), "--resume", "latest"])[1], "does not match its manifest"),
    ("resume-incomplete-checkpoint", lambda e: (e.fake_run(manifest=False), ["train", e.recipe(), "--resume", str(e.tmp / "runs/tiny-sentiment/checkpoints/step-000001")])[1], "incomplete"),
    ("resume-other-runs-checkpoint", lambda e: (e.fake_run(), ["train", e.recipe(), "--resume", str(e.tmp)])[1], "is not a checkpoint of run"),
    ("resume-missing-path", lambda e: (e.fake_run(), ["train", e.recipe(), "--resume", str(e.tmp / "nowhere")])[1], "checkpoint not found"),
    ("conversations-for-a-model-without-template", lambda e: ["train", e.recipe()] + _set(f"data.prompts={e.file('chat.jsonl', CONVERSATION_ROW)}", f"policy.path={e.policy_without_template()}"), "but the tokenizer of"),
    ("validate-conversations-without-template", lambda e: ["validate", e.recipe()] + _set("data.chat_template=true", f"policy.path={e.policy_without_template()}"), "the prompts need a chat template (conversation rows, data.chat_template or data.system_prompt) but the tokenizer of"),
    ("base-with-policy-path-set", lambda e: (e.fake_run(), ["rollout", "base", "--recipe", e.recipe(), "--out", str(e.tmp / "out.jsonl")] + _set(f"policy.path={e.models / 'reward'}"))[1], "does not change `base`: that is run"),
    ("resume-changed-recipe", lambda e: (e.fake_run(), ["train", e.recipe(_edit("ppo.kl_coef", 0.5)), "--resume", "latest"])[1], "ppo.kl_coef: 0.4 -> 0.5"),
    ("resume-with-overwrite", lambda e: ["train", e.recipe(), "--resume", "latest", "--overwrite"], "cannot be used together"),
    ("validate-unknown-key", lambda e: ["validate", e.recipe(_edit("policy.lora.rank", 8))], "rank"),
    ("validate-function-syntax-error", lambda e: ["validate", e.recipe()] + _reward_function(e, FN_SYNTAX_ERROR), "fn.py:1: Python syntax error: '(' was never closed"),
    ("function-column-missing", _columns("train", FN_TAKES_SOLUTION), "takes the column(s) solution, which the rows of"),
    ("validate-function-column-missing", _columns("validate", FN_TAKES_SOLUTION), "(they have: answer, prompt)"),
    ("validate-function-eval-column-missing", _columns("validate", FN_TAKES_SOLUTION.replace("solution", "answer"), '{"prompt": "2+2?", "solution": "4"}\n'), "eval.jsonl do not have (they have: prompt, solution)"),
    ("validate-function-name-missing", lambda e: ["validate", e.recipe()] + _set(f"reward.components=[{{type: function, function: '{e.file('fn.py', FN_OK)}:rewrd'}}]"), "has no function 'rewrd'"),
]


# Damaged files found while running exit 1 (errors.py); everything else is bad input and exits 2.
RUNTIME_FAILURES = {"policy-weights-corrupt", "resume-corrupted-checkpoint", "resume-incomplete-checkpoint"}


def _snapshot(root: Path) -> dict[str, str]:
    """Every file's hash and every directory (as "dir"), by path under ``root``."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in root.rglob("*")}


def test_there_are_at_least_30_distinct_bad_inputs():
    assert len({case_id for case_id, _, _ in CASES}) == len(CASES) >= 30


# Cases that load weights (the corrupt copy of the policy; the reward model, to read its labels): run with the tiny models, in the slow suite.
# Every other case fails on the recipe, the files or the configs before any weights load, so stub model
# directories (STUB_CONFIGS: config.json only) stand in for the tiny models and no model is built.
MODEL_CASES = {"policy-weights-corrupt", "reward-labels-unknown"}
_QWEN2 = {"model_type": "qwen2", "vocab_size": 1089, "hidden_size": 96, "intermediate_size": 384, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "eos_token_id": 0, "pad_token_id": 1, "tie_word_embeddings": True}
STUB_CONFIGS = {
    "policy": {"architectures": ["Qwen2ForCausalLM"], **_QWEN2},
    "reward": {"architectures": ["Qwen2ForSequenceClassification"], **_QWEN2,
               "id2label": {"0": "negative", "1": "neutral", "2": "positive"},
               "label2id": {"negative": 0, "neutral": 1, "positive": 2}},
}


@pytest.fixture(scope="module")
def stub_models(tmp_path_factory) -> Path:
    """models/policy and models/reward holding the tiny models' config.json and nothing else."""
    root = tmp_path_factory.mktemp("stub-models")
    for name, config in STUB_CONFIGS.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    return root


def _cases(model_cases: bool) -> list:
    return [pytest.param(*case, id=case[0]) for case in CASES if (case[0] in MODEL_CASES) == model_cases]


@pytest.mark.parametrize("case_id, build, expected", _cases(model_cases=False))
def test_bad_input_gets_one_clear_line_and_a_nonzero_exit(case_id, build, expected, stub_models, tmp_path, monkeypatch):
    _check_bad_input(case_id, build, expected, stub_models, tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("case_id, build, expected", _cases(model_cases=True))
def test_bad_model_gets_one_clear_line_and_a_nonzero_exit(case_id, build, expected, tiny_models, tmp_path, monkeypatch):
    _check_bad_input(case_id, build, expected, tiny_models, tmp_path, monkeypatch)


def test_every_bad_input_case_runs_in_one_of_the_two_tests():
    assert MODEL_CASES <= {case_id for case_id, _, _ in CASES}


def _check_bad_input(case_id, build, expected, models: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    env = Env(tmp_path, models)
    args = build(env)
    before = _snapshot(tmp_path)
    result = runner.invoke(app, args)
    output = result.output
    assert result.exit_code == (EXIT_RUNTIME if case_id in RUNTIME_FAILURES else EXIT_USAGE), output
    assert "Traceback" not in output
    error_lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, output
    assert expected in error_lines[0], output
    other = [l for l in output.splitlines() if l.strip() and not l.startswith(("error:", "hint:", "loading models"))]
    assert not other, output
    after = _snapshot(tmp_path)
    assert not [name for name in after if any(marker in name for marker in TEMP_MARKERS)], after
    changed = [name for name in before if after.get(name) != before[name]]
    assert not changed, f"files changed or lost: {changed}"
    created = sorted(set(after) - set(before))
    assert not created, f"a failed command left files behind: {created}"


RAISES_IN_UPDATE_1 = "def reward(prompts, responses):\n    raise ValueError('broken reward')\n"


@pytest.mark.slow
@pytest.mark.parametrize("existing", [False, True], ids=["new-output-dir", "folder-with-user-files"])
def test_a_run_failing_in_its_first_update_takes_back_only_what_it_wrote(existing, tiny_models, tmp_path, monkeypatch):
    """Nothing half-started blocks the next run or becomes 'the latest run'; the user's files stay."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    env = Env(tmp_path, tiny_models)
    recipe = env.recipe(_edit("reward.components", [{"type": "function", "function": f"{env.file('fn.py', RAISES_IN_UPDATE_1)}:reward"}]))
    run = tmp_path / "runs" / "tiny-sentiment"
    if existing:  # the run's own directory names, holding the user's files, but no run
        for name in ("plots/keep.png", "checkpoints/keep.txt", "notes.txt"):
            (run / name).parent.mkdir(parents=True, exist_ok=True)
            (run / name).write_text("mine")
    before = _snapshot(tmp_path)
    result = runner.invoke(app, ["train", recipe])
    assert result.exit_code == EXIT_RUNTIME, result.output
    assert [line for line in result.output.splitlines() if line.startswith("error:")] == [
        f"error: reward function '{tmp_path / 'fn.py'}:reward' raised ValueError: broken reward"], result.output
    assert _snapshot(tmp_path) == before  # recipe.yaml, metrics.jsonl, runs/ itself: all gone again


@pytest.mark.parametrize("command", ["train", "validate"])
@pytest.mark.parametrize("key, override", [
    ("policy.lora", "policy.lora.target_modules=[foo_proj, q_proj]"),
    ("value.lora", "value.lora={target_modules: [v_proj, bar, 'self_attn.o_proj']}"),  # the value adapter's own
])
def test_lora_target_modules_the_policy_lacks_are_named_beside_its_linear_modules(command, key, override, stub_models,
                                                                                   tmp_path, monkeypatch):
    """Read from the config on the meta device (the stub models have no weights), before any model loads."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    missing = "foo_proj" if key == "policy.lora" else "bar"
    result = runner.invoke(app, [command, Env(tmp_path, stub_models).recipe(), "--set", "name=tm", "--set", override])
    assert result.exit_code == EXIT_USAGE, result.output
    assert result.stderr.splitlines() == [
        f"error: {key}.target_modules: {missing} not found in {stub_models / 'policy'}; its linear modules are q_proj, "
        "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj",
        f"hint: set {key}.target_modules to some of them, or to all-linear",
    ]
    assert not (tmp_path / "runs").exists()


OUTSIDE_ROOT = ("the path is relative to the current directory ({cwd}): run ppo from the repository root (python "
                "scripts/make_tiny_models.py there builds models/tiny/ and models/tiny-tools/), or give an absolute path")


@pytest.mark.parametrize("path, hint, in_root", [
    ("models/tiny-tools/policy", "build the tiny models: python scripts/make_tiny_models.py, from the repository root (it "
     "writes models/tiny/ and models/tiny-tools/; scripts/demo.sh builds models/tiny/ only)", True),
    ("./models/tiny/policy", "build the tiny models: python scripts/make_tiny_models.py, from the repository root (it "
     "writes models/tiny/ and models/tiny-tools/; scripts/demo.sh builds models/tiny/ only)", True),
    ("models/tiny-tools/policy", OUTSIDE_ROOT, False),  # run from elsewhere: the models may well be built
    ("mine/models/policy", "check the path (relative to the current directory)", False),
])
def test_a_missing_tiny_model_says_how_to_build_it(path, hint, in_root, stub_models, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if in_root:  # a checkout's root: its scripts/ is there
        (tmp_path / "scripts").mkdir()
        (tmp_path / "scripts" / "make_tiny_models.py").write_text("")
    result = runner.invoke(app, ["validate", Env(tmp_path, stub_models).recipe(_edit("policy.path", path))])
    assert result.exit_code == EXIT_USAGE, result.output
    assert result.stderr.splitlines() == [f"error: policy.path: model directory not found: {path}",
                                          f"hint: {hint.format(cwd=tmp_path)}"]


def test_a_finished_run_without_checkpoints_says_how_to_train_further(tmp_path):
    """Raising total_updates cannot help a run that wrote no checkpoints: the hint must not send the user
    in a circle, but to a new run that starts from final/."""
    from ppo_cli.resume import check_not_complete
    from ppo_cli.errors import UsageError
    from ppo_cli.runs import RunDir

    run = RunDir(tmp_path / "run")
    run.final.mkdir(parents=True)
    (run.final / "ppo_cli.json").write_text(json.dumps({"step": 30}))
    with pytest.raises(UsageError) as with_checkpoints:
        check_not_complete(run, 30, has_checkpoints=True)
    assert with_checkpoints.value.hint.startswith("raise train.total_updates to train further (--set train.total_updates=60)")
    with pytest.raises(UsageError) as without:
        check_not_complete(run, 30, has_checkpoints=False)
    assert "total_updates" not in without.value.hint
    assert without.value.hint.startswith(f"it wrote no checkpoints (train.save_every: 0), so it cannot continue; "
                                         f"train further from its result in a new run: --set policy.adapter={run.final}")


def test_a_resume_names_the_settings_it_changes_and_says_when_checkpoints_stop():
    """A recipe file resumed without the --set a run started with changes train.save_every silently
    otherwise: the resume says what it changed, and what a save_every of 0 means for the run."""
    from ppo_cli.recipe import Recipe
    from ppo_cli.resume import recipe_differences, resume_changes

    started = Recipe.model_validate({"name": "r", "policy": {"path": "m"}, "data": {"prompts": "p.txt"},
                                     "reward": {"components": [{"type": "function", "function": "f.py:f"}]},
                                     "train": {"total_updates": 2, "save_every": 1}})
    resumed = started.model_copy(update={"train": started.train.model_copy(update={"total_updates": 4, "save_every": 0})})
    assert resume_changes(started, resumed) == [
        "train.save_every: 1 -> 0", "train.total_updates: 2 -> 4",
        "so this run writes no more checkpoints (pass --set train.save_every=N to keep them)"]
    assert recipe_differences(started, resumed) == []  # both may change on a resume
    assert resume_changes(started, started) == []


def test_an_environments_timeouts_and_retries_may_change_on_a_resume_what_it_computes_may_not():
    from ppo_cli.recipe import Recipe
    from ppo_cli.resume import recipe_differences, resume_changes

    base = {"name": "r", "policy": {"path": "m"}, "data": {"prompts": "p.txt"}, "train": {"total_updates": 2},
            "reward": {"components": [{"type": "function", "function": "f.py:f"}]}}
    environment = {"type": "http", "url": "http://127.0.0.1:8000", "timeout_s": 10, "retries": 2, "max_turns": 3}
    started = Recipe.model_validate({**base, "environment": environment})
    slower = Recipe.model_validate({**base, "environment": {**environment, "timeout_s": 60, "retries": 5}})
    assert recipe_differences(started, slower) == []
    assert resume_changes(started, slower) == ["environment.retries: 2 -> 5", "environment.timeout_s: 10.0 -> 60.0"]
    longer = Recipe.model_validate({**base, "environment": {**environment, "max_turns": 4}})
    assert recipe_differences(started, longer) == ["environment.max_turns: 3 -> 4"]


def test_validate_reads_the_reward_file_for_the_function_name_without_running_it(tmp_path):
    from ppo_cli.engine.rewards.function import check_defines as _check_defines
    from ppo_cli.errors import RewardFunctionError

    path = tmp_path / "fn.py"
    path.write_text("raise SystemExit('ran')\n\ndef reward(prompts, responses):\n    return []\n")
    _check_defines(path, "reward")  # found, and the module's code did not run
    with pytest.raises(RewardFunctionError) as err:
        _check_defines(path, "rewrd")
    assert (str(err.value), err.value.hint) == (f"'{path}' has no function 'rewrd'", "did you mean 'reward'?")
    # no close name: the file's functions are listed (verl's compute_score named as `score`), not its constants
    path.write_text("LIMIT = 3\n\ndef compute_score(data_source, solution_str, ground_truth):\n    return 0.0\n\n"
                    "async def helper(x):\n    return x\n")
    with pytest.raises(RewardFunctionError) as err:
        _check_defines(path, "grade")
    assert err.value.hint == ("it defines compute_score, helper: name one of them, or "
                              "define def grade(prompts, responses) -> list[float]")


def test_train_refuses_a_reward_column_the_prompt_rows_lack_before_loading_a_model(stub_models, tmp_path, monkeypatch):
    """Found in preflight, as `ppo eval` finds it, not after the models load (45 s on a real model)."""
    import ppo_cli.commands.train as train

    def load_the_models(*args, **kwargs):
        raise AssertionError("the models were loaded before the reward's columns were checked")

    monkeypatch.setattr(train, "_run_processes", load_the_models)  # everything from loading the models on
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    env = Env(tmp_path, stub_models)
    prompts = env.file("train.jsonl", ROWS_WITH_ANSWER)
    result = runner.invoke(app, ["train", env.recipe(_edit("data.prompts", prompts))] + _reward_function(env, FN_TAKES_SOLUTION))
    assert result.exit_code == EXIT_USAGE, result.output
    assert result.output.splitlines() == [
        f"error: reward function '{tmp_path}/fn.py:reward' takes the column(s) solution, which the rows of {prompts} "
        "do not have (they have: answer, prompt)",
        "hint: use a .jsonl or dataset whose rows carry them (each row's other fields are its columns)",
    ]


@pytest.mark.parametrize("command", ["validate", "train"])
@pytest.mark.parametrize("source", ["def reward(completions, **kwargs):\n    return [1.0] * len(completions)\n",
                                    "def reward(prompts, responses, answer):\n    return [1.0] * len(responses)\n"])
def test_a_prompt_in_two_rows_with_different_columns_is_refused_before_training(stub_models, tmp_path, monkeypatch,
                                                                                command, source):
    """A row's columns are found by its prompt: a duplicated question with another id would stop the run
    in whichever update first drew it; refused before any model loads instead."""
    import ppo_cli.commands.train as train

    monkeypatch.setattr(train, "_run_processes", lambda *a, **k: pytest.fail("the models were loaded"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    env = Env(tmp_path, stub_models)
    rows = '{"prompt": "What is 1+1?", "answer": "2", "id": 1}\n{"prompt": "What is 2+2?", "answer": "4", "id": 2}\n' \
           '{"prompt": "What is 1+1?", "answer": "2", "id": 3}\n'
    prompts = env.file("train.jsonl", rows)
    result = runner.invoke(app, [command, env.recipe(_edit("data.prompts", prompts))] + _reward_function(env, source))
    assert result.exit_code == EXIT_USAGE, result.output
    assert result.output.splitlines() == [
        f'error: prompt "What is 1+1?" is in rows 1 and 3 of {prompts} with different columns, so a reward function '
        "cannot be given its row's columns",
        "hint: make the prompts unique (or their columns equal): a row's columns are found by its prompt",
    ]
    plain = "def reward(prompts, responses):\n    return [1.0] * len(responses)\n"  # reads no column: nothing to refuse
    result = runner.invoke(app, ["validate", env.recipe(_edit("data.prompts", prompts))] + _reward_function(env, plain))
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("command", ["validate", "train"])
def test_verls_per_row_compute_score_is_refused_in_the_same_words_by_validate_and_train(stub_models, tmp_path,
                                                                                      monkeypatch, command):
    """verl's compute_score(data_source, solution_str, ground_truth, extra_info) on rows with a ground_truth column:
    validate reads it from the source, train from the imported function; the run would have passed it the lists."""
    import ppo_cli.commands.train as train

    monkeypatch.setattr(train, "_run_processes", lambda *a, **k: pytest.fail("the models were loaded"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    env = Env(tmp_path, stub_models)
    prompts = env.file("train.jsonl", '{"prompt": "What is 1+1?", "data_source": "gsm8k", "ground_truth": "2"}\n')
    source = "def reward(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    result = runner.invoke(app, [command, env.recipe(_edit("data.prompts", prompts))] + _reward_function(env, source))
    assert result.exit_code == EXIT_USAGE, result.output
    assert result.output.splitlines() == [
        f"error: reward function '{tmp_path}/fn.py:reward' names its parameters data_source and solution_str as verl's "
        "per-row compute_score(data_source, solution_str, ground_truth, extra_info) does: ppo calls reward functions "
        "batched, f(prompts, responses, **columns) -> list, so data_source would get the list of prompts and "
        "solution_str the list of responses",
        f"hint: add this wrapper to {tmp_path}/fn.py and name it in the recipe (function: {tmp_path}/fn.py:reward_batched):",
        "    def reward_batched(prompts, responses, ground_truth, data_source=None, extra_info=None):",
        "        rows = zip(data_source or [None] * len(responses), responses, ground_truth, extra_info or [None] * len(responses))",
        "        return [reward(d, r, g, e) for d, r, g, e in rows]",
    ]


def test_output_dir_set_to_a_run_directory_is_refused_before_loading(stub_models, tmp_path, monkeypatch):
    """output_dir: runs/NAME would train a second run at runs/NAME/NAME; the line says where to point it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    env = Env(tmp_path, stub_models)
    run = env.fake_run()
    result = runner.invoke(app, ["train", env.recipe(_edit("output_dir", str(run)))])
    assert result.exit_code == EXIT_USAGE, result.output
    assert result.output.splitlines() == [
        f"error: output_dir {run} is an existing run's directory, so this run would be nested in it at "
        f"{run / 'tiny-sentiment'}",
        f"hint: set output_dir to the directory that holds runs (--set output_dir={tmp_path / 'runs'}), or pass "
        "--resume to continue that run",
    ]


def test_output_dir_below_a_run_directory_is_refused_but_a_folder_with_a_recipe_is_not(tmp_path):
    from ppo_cli.errors import UsageError
    from ppo_cli.runs import RunDir, check_run_dir

    run = tmp_path / "runs" / "a"
    (run / "checkpoints").mkdir(parents=True)
    (run / "recipe.yaml").write_text("name: a\n")
    with pytest.raises(UsageError) as err:
        check_run_dir(RunDir(run / "checkpoints" / "b"), overwrite=False)
    assert err.value.message == (f"output_dir {run / 'checkpoints'} is inside {run}, an existing run's directory, "
                                 f"so this run would be nested in it at {run / 'checkpoints' / 'b'}")
    project = tmp_path / "project"  # a recipe.yaml of the user's own, beside runs/: not a run
    project.mkdir()
    (project / "recipe.yaml").write_text("name: b\n")
    check_run_dir(RunDir(project / "runs" / "b"), overwrite=False)
