"""`ppo rollout`, `ppo score`, `ppo eval` and `ppo compare` on the tiny models, through the real CLI.

One small run is trained once for the module (2 updates of 4 episodes, a checkpoint after the
first); every test samples from it. Errors are checked line for line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppo_cli.cli import app
from tests.conftest import ROOT, tiny_overrides

# Every test uses the run the module fixture trains: the slow suite.
pytestmark = pytest.mark.slow

RECIPE = ROOT / "recipes" / "tiny_sentiment.yaml"
PROMPTS = ["I think the book was", "The movie was", "Overall, the product is"]
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def ok(*args):
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    return result


def errors(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith(("error:", "hint:"))]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@dataclass(frozen=True)
class Workspace:
    root: Path
    run: Path
    prompts: Path  # .txt with a blank line
    policy: Path  # the tiny base model directory


@pytest.fixture(scope="module")
def ws(tiny_models: Path, tmp_path_factory) -> Workspace:
    root = tmp_path_factory.mktemp("inference")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join([PROMPTS[0], "", *PROMPTS[1:]]) + "\n", encoding="utf-8")
    settings = {
        "name": "tiny", "data.prompts": prompts, "data.eval_prompts": ROOT / "recipes/prompts/reviews_eval.txt", "train.total_updates": 2,
        "train.save_every": 1, "train.device": "cpu", "ppo.rollout_batch_size": 4, "ppo.mini_batch_size": 4,
        "ppo.micro_batch_size": 4, "ppo.ppo_epochs": 1, "generation.max_new_tokens": 12,
    }
    # float32: the KL and log-probs are checked against plain float32 forwards to 1e-5.
    sets = [x for item in tiny_overrides(tiny_models, root / "runs", float32=True, **settings) for x in ("--set", item)]
    ok("train", RECIPE, *sets)
    return Workspace(root, root / "runs" / "tiny", prompts, tiny_models / "policy")


# --- rollout ----------------------------------------------------------------------------------


def test_rollout_writes_one_row_per_prompt_and_sample(ws: Workspace, tmp_path: Path):
    out = tmp_path / "rollouts.jsonl"
    result = ok("rollout", "aligned", "--run", ws.run, "--prompts", ws.prompts, "--out", out, "--num-samples", 2, "--seed", 5)
    assert f"note: skipped 1 blank line in {ws.prompts}" in result.stderr
    rows = read_jsonl(out)
    assert [(r["prompt"], r["sample"]) for r in rows] == [(p, s) for p in PROMPTS for s in (0, 1)]
    row = rows[0]
    assert set(row) == {"prompt", "response", "finished", "prompt_tokens", "response_tokens", "prompt_index", "sample",
                        "model", "model_path", "seed", "generation"}
    assert (row["model"], row["model_path"], row["seed"]) == ("aligned", str(ws.run / "final"), 5)
    assert row["generation"]["max_new_tokens"] == 12 and row["generation"]["temperature"] == 1.0
    assert all(0 < r["response_tokens"] <= 12 and r["prompt_tokens"] > 0 for r in rows)
    assert all(r["finished"] or r["response_tokens"] == 12 for r in rows)
    assert "wrote 6 rows (3 prompts)" in result.stdout


def test_rollout_says_which_prompts_are_cut_as_train_does(ws: Workspace, tmp_path: Path):
    out = tmp_path / "cut.jsonl"
    result = ok("rollout", "aligned", "--run", ws.run, "--prompts", ws.prompts, "--out", out, "--max-new-tokens", 2,
                "--set", "data.max_prompt_tokens=3")
    longest = max(len(p.split()) for p in PROMPTS)  # the tiny tokenizer: at least a token per word
    note = next(line for line in result.stderr.splitlines() if "longer than data.max_prompt_tokens (3" in line)
    assert note.startswith("note: ") and "of 3 prompts" in note and "lose their first tokens" in note
    assert all(r["prompt_tokens"] == 3 for r in read_jsonl(out)) and longest > 3


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "dataset"])
def test_rollout_reads_each_prompt_format(ws: Workspace, tmp_path: Path, fmt: str):
    extra = []
    if fmt == "txt":
        source = ws.prompts
    elif fmt == "jsonl":
        source = tmp_path / "prompts.jsonl"
        source.write_text("".join(json.dumps({"text": p, "id": i}) + "\n" for i, p in enumerate(PROMPTS)))
        extra = ["--field", "text"]
    else:
        source = tmp_path / "dataset"
        source.mkdir()
        (source / "part-0.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
        (source / "part-1.txt").write_text(PROMPTS[2] + "\n")
    out = tmp_path / "out.jsonl"
    ok("rollout", "base", "--run", ws.run, "--prompts", source, "--out", out, "--max-new-tokens", 4, *extra)
    assert [r["prompt"] for r in read_jsonl(out)] == PROMPTS


def test_rollout_is_deterministic_under_a_fixed_seed(ws: Workspace, tmp_path: Path):
    first, second, other = tmp_path / "1.jsonl", tmp_path / "2.jsonl", tmp_path / "3.jsonl"
    for out, seed in ((first, 3), (second, 3), (other, 4)):
        ok("rollout", "aligned", "--run", ws.run, "--prompts", ws.prompts, "--out", out, "--seed", seed, "--num-samples", 2)
    assert first.read_bytes() == second.read_bytes()
    assert [r["response"] for r in read_jsonl(first)] != [r["response"] for r in read_jsonl(other)]


@pytest.mark.parametrize("ref", ["base", "aligned", "RUN", "RUN/final", "RUN/checkpoints/step-000001", "POLICY"])
def test_rollout_accepts_every_kind_of_model_reference(ws: Workspace, tmp_path: Path, ref: str):
    model = ref.replace("RUN", str(ws.run)).replace("POLICY", str(ws.policy))
    out = tmp_path / "out.jsonl"
    ok("rollout", model, "--run", ws.run, "--prompts", ws.prompts, "--out", out, "--max-new-tokens", 2)
    expected = {"base": ws.policy, "aligned": ws.run / "final", "RUN": ws.run / "final", "RUN/final": ws.run / "final",
                "RUN/checkpoints/step-000001": ws.run / "checkpoints" / "step-000001", "POLICY": ws.policy}[ref]
    assert {Path(r["model_path"]).resolve() for r in read_jsonl(out)} == {expected.resolve()}


def test_aliases_default_to_the_latest_run_under_runs(ws: Workspace, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(ws.root)
    out = tmp_path / "out.jsonl"
    result = ok("rollout", "aligned", "--prompts", ws.prompts, "--out", out, "--max-new-tokens", 2)
    assert "model: aligned = runs/tiny/final (LoRA adapter on" in result.stderr
    assert read_jsonl(out)[0]["model_path"] == "runs/tiny/final"


def test_aliases_with_a_recipe_mean_the_run_it_names_else_the_latest(ws: Workspace, tmp_path: Path):
    """--recipe names a run (output_dir/name): base and aligned are that run's when it has run, not a
    newer run's beside it; a recipe whose run does not exist keeps the latest run under its output_dir."""
    import os
    import shutil

    import yaml

    runs = tmp_path / "runs"
    for name in ("tiny", "newer"):
        shutil.copytree(ws.run, runs / name)
    os.utime(runs / "newer", (os.path.getmtime(runs / "tiny") + 60,) * 2)  # the latest run
    recipe = yaml.safe_load((ws.run / "recipe.yaml").read_text())
    recipe["output_dir"] = str(runs)
    for name in ("tiny", "absent"):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({**recipe, "name": name}))
    for name, expected in (("tiny", runs / "tiny"), ("absent", runs / "newer")):
        out = tmp_path / f"{name}.jsonl"
        ok("rollout", "aligned", "--recipe", tmp_path / f"{name}.yaml", "--prompts", ws.prompts, "--out", out,
           "--max-new-tokens", 2)
        assert Path(read_jsonl(out)[0]["model_path"]) == expected / "final"


# --- score and eval ----------------------------------------------------------------------------


def test_score_adds_reward_components_and_is_repeatable(ws: Workspace, tmp_path: Path):
    rollouts = tmp_path / "rollouts.jsonl"
    ok("rollout", "base", "--run", ws.run, "--prompts", ws.prompts, "--out", rollouts, "--max-new-tokens", 6)
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    ok("score", rollouts, "--recipe", ws.run / "recipe.yaml", "--out", first)
    ok("score", rollouts, "--run", ws.run, "--out", second)
    assert first.read_bytes() == second.read_bytes()
    for row in read_jsonl(first):
        parts = row["reward_components"]
        assert set(parts) == {"classifier:reward", "missing_eos_penalty"}
        assert parts["missing_eos_penalty"] == (0.0 if row["finished"] else -10.0)
        assert row["reward"] == pytest.approx(parts["classifier:reward"] + parts["missing_eos_penalty"], abs=1e-9)


def test_score_without_a_recipe_uses_the_run_that_wrote_the_rollouts(ws: Workspace, tmp_path: Path, monkeypatch):
    """Not the latest run's: a newer run with another reward must not rescore older rollouts."""
    import os
    import shutil
    import time

    shutil.copytree(ws.run, tmp_path / "runs" / "tiny")
    monkeypatch.chdir(tmp_path)
    rollouts = tmp_path / "rollouts.jsonl"
    ok("rollout", "runs/tiny/final", "--prompts", ws.prompts, "--out", rollouts, "--max-new-tokens", 4)
    newer = tmp_path / "runs" / "newer"
    newer.mkdir()
    recipe = (ws.run / "recipe.yaml").read_text()
    assert "missing_eos_penalty: 10.0" in recipe
    (newer / "recipe.yaml").write_text(recipe.replace("missing_eos_penalty: 10.0", "missing_eos_penalty: 3.0"))
    later = time.time() + 100
    os.utime(newer / "recipe.yaml", (later, later))
    result = ok("score", rollouts, "--out", tmp_path / "scored.jsonl")
    assert "recipe: runs/tiny/recipe.yaml" in result.stderr
    penalties = {row["reward_components"]["missing_eos_penalty"] for row in read_jsonl(tmp_path / "scored.jsonl")}
    assert penalties <= {0.0, -10.0} and -10.0 in penalties  # 4 tokens: most responses do not end


def test_rollout_then_score_gives_the_eval_mean_reward(ws: Workspace, tmp_path: Path):
    common = ["--run", ws.run, "--prompts", ws.prompts, "--seed", 11, "--num-samples", 2]
    rollouts, scored, summary_path = tmp_path / "r.jsonl", tmp_path / "s.jsonl", tmp_path / "eval.json"
    ok("rollout", "aligned", *common, "--out", rollouts)
    ok("score", rollouts, "--run", ws.run, "--out", scored)
    result = ok("eval", "aligned", *common, "--out", summary_path)
    rows, summary = read_jsonl(scored), json.loads(summary_path.read_text())
    assert summary["reward"]["mean"] == pytest.approx(sum(r["reward"] for r in rows) / len(rows), abs=1e-9)
    assert summary["eos_rate"] == pytest.approx(sum(r["finished"] for r in rows) / len(rows))
    assert summary["response_length"] == pytest.approx(sum(r["response_tokens"] for r in rows) / len(rows))
    assert set(summary) >= {"reward", "reward_components", "eos_rate", "response_length", "kl", "distinct_1", "distinct_2",
                            "model", "model_path", "prompts", "seed", "num_samples", "generation"}
    assert set(summary["reward"]) == {"mean", "median", "std", "min", "max"}
    assert summary["kl"] != 0.0  # the adapter moved the policy away from its base
    assert "mean reward" in result.stdout and "distinct-1 / distinct-2" in result.stdout


def test_eval_of_base_has_zero_kl_and_default_summary_name(ws: Workspace, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ok("eval", "base", "--run", ws.run, "--prompts", ws.prompts, "--max-new-tokens", 4)
    assert not (tmp_path / "eval-base.json").exists()  # beside the run it measures, not where the command ran
    summary = json.loads((Path(ws.run) / "eval-base.json").read_text())
    assert summary["kl"] == 0.0
    assert summary["num_prompts"] == 3


def test_model_outside_the_run_is_measured_against_a_separate_reference(ws: Workspace, tmp_path: Path):
    """A copy of the base is another model: its reference (the recipe's policy) is loaded beside it,
    and the KL of identical weights is 0 up to float noise."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(ws.policy, copy)
    out = tmp_path / "eval.json"
    result = ok("eval", copy, "--run", ws.run, "--prompts", ws.prompts, "--max-new-tokens", 6, "--out", out)
    assert f"model: {copy}" in result.stderr
    summary = json.loads(out.read_text())
    assert summary["model_path"] == str(copy)
    assert summary["kl"] == pytest.approx(0.0, abs=1e-4)


def test_kl_matches_a_plain_full_softmax_forward(ws: Workspace):
    """The KL of eval/compare equals sum_t log pi - log pi_ref from plain transformers forwards."""
    import torch

    from ppo_cli.evaluation import sequence_kl
    from ppo_cli.engine.inference import load_inference_engine
    from ppo_cli.model_refs import resolve_model_reference
    from ppo_cli.recipe_loading import load_recipe

    model = resolve_model_reference("aligned", ws.run)
    engine = load_inference_engine(load_recipe(model.recipe_path), model)
    torch.manual_seed(0)
    generation = engine.generate(PROMPTS)
    logprobs, ref_logprobs, _, _ = engine.evaluate_logprobs_and_values(generation, engine.recipe.ppo.micro_batch_size)
    kl = sequence_kl(logprobs, ref_logprobs, generation)  # (B,)

    peft_model = engine.actor_critic.policy
    seq, attn = generation.sequences, generation.attention_mask.long()
    P, T = generation.prompt_ids.shape[1], generation.response_ids.shape[1]

    def response_logprobs():  # (B, T) from a full log_softmax
        position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = peft_model(input_ids=seq, attention_mask=attn, position_ids=position_ids).logits[:, P - 1 : P + T - 1]
        return logits.float().log_softmax(-1).gather(-1, generation.response_ids.unsqueeze(-1)).squeeze(-1)

    with torch.no_grad():
        logprobs = response_logprobs()
        with peft_model.disable_adapter():
            ref_logprobs = response_logprobs()
    expected = ((logprobs - ref_logprobs) * generation.response_mask).sum(dim=1)
    torch.testing.assert_close(kl, expected, rtol=1e-5, atol=1e-5)
    assert kl.abs().sum() > 0


# --- compare ------------------------------------------------------------------------------------


def test_compare_base_aligned_side_by_side_and_files(ws: Workspace, tmp_path: Path):
    out = tmp_path / "report"
    args = ["--run", ws.run, "--prompts", ws.prompts, "--seed", 2]
    result = ok("compare", "base", "aligned", *args, "--out", out)
    assert "A: base" in result.stdout and "B: aligned" in result.stdout
    assert "win rate of B" in result.stdout and "95% CI" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == ["compare.json", "compare.md", "rows.jsonl"]
    report = json.loads((out / "compare.json").read_text())
    rows = read_jsonl(out / "rows.jsonl")
    assert [r["prompt"] for r in rows] == PROMPTS == [r["prompt"] for r in report["rows"]]
    assert all(r["a_kl"] == 0.0 for r in rows)
    diff = report["difference"]
    assert diff["mean_reward_diff"] == pytest.approx(report["b"]["reward"]["mean"] - report["a"]["reward"]["mean"])
    assert diff["ci95"][0] <= diff["mean_reward_diff"] <= diff["ci95"][1]
    assert 0.0 <= diff["win_rate_b"] <= 1.0
    markdown = (out / "compare.md").read_text()
    assert markdown.startswith("# base vs aligned\n")
    assert "| Prompt | A: base | reward | EOS | B: aligned | reward | EOS |" in markdown

    # Each side is exactly what `ppo eval` reports with the same seed and settings.
    summary_path = tmp_path / "eval.json"
    ok("eval", "aligned", *args, "--out", summary_path)
    assert json.loads(summary_path.read_text())["reward"] == report["b"]["reward"]


# --- bad input: one line, non-zero exit, no output file ----------------------------------------


def _bad(ws: Workspace, tmp_path: Path, name: str, content: bytes | str) -> Path:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.txt", "\n  \n", "error: {path}: no prompts in this file"),
        ("latin1.txt", b"caf\xe9 prompt\n", "error: {path}: not UTF-8 text (byte 3)"),
        ("list.jsonl", '{"prompt": "a"}\n[1, 2]\n', "error: {path}:2: expected a JSON object, got list"),
        ("nofield.jsonl", '{"text": "a"}\n', "error: {path}:1: no 'prompt' or 'messages' field (fields: text)"),
    ],
)
def test_bad_prompts_files_get_one_line_and_no_output(ws: Workspace, tmp_path: Path, name, content, message):
    path = _bad(ws, tmp_path, name, content)
    out = tmp_path / "out.jsonl"
    result = invoke("rollout", "aligned", "--run", ws.run, "--prompts", path, "--out", out)
    assert result.exit_code == 2
    assert errors(result)[0] == message.format(path=path)
    assert "Traceback" not in result.output
    assert not out.exists()


def test_unknown_model_reference_and_missing_run(ws: Workspace, tmp_path: Path):
    out = tmp_path / "out.jsonl"
    result = invoke("rollout", "alignd", "--run", ws.run, "--prompts", ws.prompts, "--out", out)
    assert (result.exit_code, errors(result)) == (2, [
        "error: unknown model reference 'alignd'",
        "hint: did you mean 'aligned'? a model is 'base' or 'aligned' (of --run DIR, default the latest run), a run or "
        "checkpoint directory, a local model directory or .gguf file, or a hub id",
    ])
    missing = tmp_path / "no-such-run"
    result = invoke("compare", "base", "aligned", "--run", missing, "--prompts", ws.prompts)
    assert (result.exit_code, errors(result)[0]) == (2, f"error: run directory not found: {missing}")
    result = invoke("eval", "aligned", "--run", ws.root, "--prompts", ws.prompts, "--out", tmp_path / "e.json")
    assert errors(result)[0] == f"error: {ws.root} is not a run directory (no recipe.yaml)"
    assert not out.exists() and not (tmp_path / "e.json").exists()


def test_bad_rollout_rows_are_rejected_and_the_old_output_kept(ws: Workspace, tmp_path: Path):
    out = tmp_path / "scored.jsonl"
    out.write_text("previous\n")
    cases = [
        ('{"prompt": "a", "response": "b", "finished": true}\n"text"\n', "{path}:2: expected a JSON object, got str"),
        ('{"prompt": "a", "finished": true}\n', "{path}:1: no 'response' field (fields: finished, prompt)"),
        ('{"prompt": "a", "response": "b"}\n', "{path}:1: no 'finished' field (fields: prompt, response)"),
        ("", "{path}: no rows in this file"),
    ]
    for i, (content, message) in enumerate(cases):
        path = _bad(ws, tmp_path, f"rollouts{i}.jsonl", content)
        result = invoke("score", path, "--run", ws.run, "--out", out)
        assert (result.exit_code, errors(result)[0]) == (2, "error: " + message.format(path=path))
    assert out.read_text() == "previous\n"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_bad_flags_fail_before_loading(ws: Workspace, tmp_path: Path):
    missing = tmp_path / "missing.txt"
    result = invoke("eval", "aligned", "--run", ws.run, "--prompts", missing)
    assert (result.exit_code, errors(result)) == (2, [
        f"error: prompts file not found: {missing}", "hint: check --prompts (relative to the current directory)"])
    result = invoke("eval", "aligned", "--run", ws.run, "--prompts", ws.prompts, "--temperature", 0)
    assert (result.exit_code, errors(result)[0]) == (2, "error: --temperature must be > 0, got 0")
    result = invoke("rollout", "aligned", "--run", ws.run, "--prompts", ws.prompts, "--out", tmp_path)
    assert (result.exit_code, errors(result)[0]) == (2, f"error: --out {tmp_path} is a directory")


# --- conversations ------------------------------------------------------------------------------

CHATS = [
    {"messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "The movie was"},
                  {"role": "assistant", "content": "great."}]},
    {"messages": [{"role": "user", "content": "Overall, the product is"}]},
]
ROLE_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"


def test_rollout_of_conversations_keeps_the_messages_and_templates_them(ws: Workspace, tmp_path: Path):
    import shutil

    from transformers import AutoTokenizer

    chat_policy = tmp_path / "chat-policy"
    shutil.copytree(ws.policy, chat_policy)
    (chat_policy / "chat_template.jinja").write_text(ROLE_TEMPLATE)
    prompts = tmp_path / "chats.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in CHATS))
    out = tmp_path / "rollouts.jsonl"
    ok("rollout", chat_policy, "--run", ws.run, "--prompts", prompts, "--out", out, "--max-new-tokens", 2)
    rows = read_jsonl(out)
    assert [r["prompt"] for r in rows] == [CHATS[0]["messages"][:2], CHATS[1]["messages"]]  # the answer dropped
    tokenizer = AutoTokenizer.from_pretrained(chat_policy)
    text = "system: Be kind.\nuser: The movie was\nassistant:"
    assert rows[0]["prompt_tokens"] == len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_conversations_for_a_policy_without_a_chat_template_is_one_line(ws: Workspace, tmp_path: Path):
    prompts = tmp_path / "chats.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in CHATS))
    out = tmp_path / "rollouts.jsonl"
    result = invoke("rollout", "aligned", "--run", ws.run, "--prompts", prompts, "--out", out)
    assert result.exit_code == 2
    assert errors(result)[0] == ("error: the prompts need a chat template (conversation rows, data.chat_template or "
                                 "data.system_prompt) but the tokenizer has no chat template")
    assert not out.exists()
