"""Episodes of several turns through the real engine, on the tiny policy with a chat template and a
scripted environment: what is trained is what was sampled, environment tokens get no gradient, the
rollout's log-probs are the model's own forward over the whole episode, and training runs with every
estimator (critic included)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ppo_cli.cli import app
from tests.conftest import ROOT

pytestmark = pytest.mark.slow
runner = CliRunner()

# generation.stop_token "." (the tiny policy ends a sentence within a few tokens, so episodes have
# several turns); the template ends every assistant turn with it, then the end-of-text token (which
# keeps "." from merging with the newline after it).
TEMPLATE = ("{% for m in messages %}{{ m.role }}:\n{{ m.content }}{% if m.role == 'assistant' %}.<|endoftext|>{% endif %}\n"
            "{% endfor %}{% if add_generation_prompt %}assistant:\n{% endif %}")
ENVIRONMENT = '''
class Critic:
    """Answers every turn with a user message, rewards each step 0.5, done after two steps."""

    def __init__(self, **kwargs):
        self.steps = 0

    def reset(self, row, seed):
        self.seed = seed
        return None

    def step(self, message):
        self.steps += 1
        return {"observation": f"tell me more (seed {self.seed % 100})", "reward": 0.5, "done": self.steps >= 2}
'''
REWARD = '''
def length(prompts, responses, messages, **kwargs):
    """The last message's length in words, and the transcript must be there."""
    assert all(m[0]["role"] == "assistant" for m in messages)
    return [float(len(r.split())) / 10 for r in responses]
'''


@pytest.fixture(scope="module")
def chat_policy(tiny_models, tmp_path_factory) -> Path:
    """The tiny policy with a chat template whose assistant turns end with its stop token."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("chat") / "policy"
    shutil.copytree(tiny_models / "policy", out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def recipe_files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("files")
    (folder / "critic_env.py").write_text(ENVIRONMENT)
    (folder / "length.py").write_text(REWARD)
    return folder


def _sets(policy: Path, files: Path, out: Path, overlap: bool = False, **extra) -> list[str]:
    sets = {
        "name": "mt", "output_dir": str(out), "policy.path": str(policy),
        "reward.components": f"[{{type: function, function: '{files / 'length.py'}:length'}}]",
        "data.prompts": str(ROOT / "recipes/prompts/reviews.txt"),
        "data.eval_prompts": str(ROOT / "recipes/prompts/reviews_eval.txt"),
        "environment": f"{{type: python, class: '{files / 'critic_env.py'}:Critic', max_turns: 3, "
                       f"max_episode_tokens: 64{', overlap: true' if overlap else ''}}}",
        "generation.max_new_tokens": 16, "generation.stop_token": ".", "train.total_updates": 1,
        "ppo.rollout_batch_size": 4, "ppo.mini_batch_size": 4, "ppo.micro_batch_size": 4,
        **extra,
    }
    return [item for key, value in sets.items() for item in ("--set", f"{key}={value}")]


def _engine(policy: Path, files: Path, tmp_path: Path, *extra: str):
    from ppo_cli.engine.engine import load_engine
    from ppo_cli.recipe_loading import load_recipe

    sets = _sets(policy, files, tmp_path, **{"train.mixed_precision": "no"})
    overrides = [sets[i + 1] for i in range(0, len(sets), 2)] + list(extra)
    return load_engine(load_recipe(ROOT / "recipes/tiny_sentiment.yaml", overrides))


def test_trained_tokens_are_the_sampled_ones_with_holes_at_the_environments(chat_policy, recipe_files, tmp_path):
    engine = _engine(chat_policy, recipe_files, tmp_path)
    torch.manual_seed(0)
    rollout = engine.collect_rollout(["The movie was"] * 2 + ["I think the book is"] * 2)
    gen, episodes = rollout.generation, rollout.episodes
    assert all(e.ended_by in ("done", "max_episode_tokens", "max_new_tokens") for e in episodes)
    for b, episode in enumerate(episodes):
        ids = gen.response_ids[b][gen.response_mask[b]].tolist()
        action = gen.action_mask[b][gen.response_mask[b]].tolist()
        # the policy's turns, decoded from the trained tokens, are the transcript's assistant messages
        turns, current = [], []
        for token, trained in zip(ids, action):
            if trained:
                current.append(token)
            elif current:
                turns.append(current)
                current = []
        turns += [current] if current else []
        assistant = [m["content"] for m in episode.messages if m["role"] == "assistant"]
        stop = engine.stop_token_id  # a turn's text is its tokens up to its stop token, as sampled
        texts = [engine.tokenizer.decode(t[:-1] if t[-1] == stop else t, skip_special_tokens=False) for t in turns]
        assert texts == assistant
        assert len(turns) == episode.turns
        if episode.turns > 1:  # the environment's answer sits in a hole of the action mask
            assert not all(action) and "tell me more" in engine.tokenizer.decode(
                [t for t, a in zip(ids, action) if not a])
    # reward: the function's score, the steps' rewards (0.5 each) and the missing-EOS penalty of an
    # episode whose last turn did not stop
    penalty = engine.recipe.reward.missing_eos_penalty
    for b, episode in enumerate(episodes):
        words = len(episode.last_response.split()) / 10
        steps = sum(0.5 for m in episode.messages if m["role"] == "user")
        assert episode.step_reward == (pytest.approx(steps) if steps else None)
        expected = words + steps - (0.0 if gen.finished[b] else penalty)
        assert float(rollout.scores[b]) == pytest.approx(expected, abs=1e-5)
    # a prompt's group resets with one seed, another prompt with another
    observations = [[m["content"] for m in e.messages if m["role"] == "user"] for e in episodes]
    seeds = [o[0] if o else None for o in observations]
    assert seeds[0] is None or seeds[1] is None or seeds[0] == seeds[1]


def test_logprobs_are_the_models_own_forward_over_the_whole_episode(chat_policy, recipe_files, tmp_path):
    from ppo_cli.engine.logprobs import selective_log_softmax

    engine = _engine(chat_policy, recipe_files, tmp_path)
    torch.manual_seed(1)
    rollout = engine.collect_rollout(["Overall, the film is"] * 4)
    gen = rollout.generation
    assert (gen.action_mask != gen.response_mask).any(), "no episode had an environment turn"
    policy = engine.actor_critic.policy
    with torch.no_grad():
        logits = policy(input_ids=gen.sequences, attention_mask=gen.attention_mask.long()).logits.float()
    T = gen.response_ids.shape[1]
    own = selective_log_softmax(logits[:, -T - 1:-1] / engine.recipe.generation.temperature, gen.response_ids)
    own = own.masked_fill(~gen.action_mask, 0.0)
    torch.testing.assert_close(rollout.logprobs, own, atol=1e-5, rtol=0)
    assert (rollout.logprobs[~gen.action_mask] == 0).all() and (rollout.ref_logprobs[~gen.action_mask] == 0).all()


def test_environment_tokens_get_no_gradient(chat_policy, recipe_files, tmp_path):
    """The update's loss (clipped surrogate, KL in the loss, entropy bonus) backpropagated to the logits:
    the rows that predict the environment's tokens get exactly zero gradient."""
    from ppo_cli.algo.aggregation import aggregate_loss
    from ppo_cli.algo.kl import kl_penalty
    from ppo_cli.algo.losses import clipped_policy_loss, entropy_from_logits
    from ppo_cli.algo.masking import masked_mean
    from ppo_cli.engine.logprobs import selective_log_softmax

    engine = _engine(chat_policy, recipe_files, tmp_path)
    torch.manual_seed(2)
    rollout = engine.collect_rollout(["The movie was"] * 4)
    gen, mask = rollout.generation, rollout.train_mask
    holes = gen.response_mask & ~gen.action_mask
    assert holes.any()
    T = gen.response_ids.shape[1]
    logits = engine.actor_critic.policy(input_ids=gen.sequences, attention_mask=gen.attention_mask.long()).logits
    logits = logits[:, -T - 1:-1].float().detach().requires_grad_(True)
    logprobs = selective_log_softmax(logits, gen.response_ids)
    advantages = torch.randn(mask.shape)
    policy = clipped_policy_loss(logprobs, rollout.logprobs, advantages, mask, 0.2)
    kl = aggregate_loss(kl_penalty(torch.where(mask, logprobs, 0), torch.where(mask, rollout.ref_logprobs, 0), "k3"),
                        mask, "token_mean", T)
    loss = policy.loss + 0.1 * kl - 0.01 * masked_mean(entropy_from_logits(logits), mask)
    loss.backward()
    assert (logits.grad[holes] == 0).all()
    assert (logits.grad[mask].abs().sum(dim=-1) > 0).all()


@pytest.mark.parametrize("advantage", ["gae", "grpo", "rloo", "reinforce_pp"])
def test_ppo_train_with_an_environment_and_each_estimator(chat_policy, recipe_files, tmp_path, advantage):
    extra = {"ppo.advantage": advantage}
    if advantage != "gae":
        extra.update({"generation.num_generations": 2, "ppo.mini_batch_size": 8, "value.kind": "none"})
    result = runner.invoke(app, ["train", str(ROOT / "recipes/tiny_sentiment.yaml"),
                                 *_sets(chat_policy, recipe_files, tmp_path, **extra)])
    assert result.exit_code == 0, result.output
    run = tmp_path / "mt"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    row = metrics[-1]
    assert row["skipped"] == 0
    assert abs(row["val/ratio_first_minibatch"] - 1.0) <= 1e-4
    assert 1.0 <= row["env/turns"] <= 3.0 and row["env/failed_rate"] == 0.0
    ended = sum(row[f"env/ended_by/{r}"] for r in ("done", "max_turns", "max_episode_tokens", "max_new_tokens"))
    assert ended == pytest.approx(1.0)
    if advantage == "gae":
        assert "val/explained_variance" in row  # the critic saw the episodes
    sample = json.loads((run / "samples.jsonl").read_text().splitlines()[0])
    assert sample["messages"][0]["role"] == "assistant" and sample["turns"] >= 1


def test_ppo_rollout_tokens_and_eval_run_the_environment(chat_policy, recipe_files, tmp_path):
    """`ppo rollout --tokens` writes each episode's transcript and exactly what training sees; `ppo eval`
    runs the same episodes and reports turns."""
    sets = _sets(chat_policy, recipe_files, tmp_path)
    out = tmp_path / "episodes.jsonl"
    common = ["--recipe", str(ROOT / "recipes/tiny_sentiment.yaml"), *sets,
              "--prompts", str(ROOT / "recipes/prompts/reviews_eval.txt")]
    result = runner.invoke(app, ["rollout", str(chat_policy), "--out", str(out), "--tokens", *common])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_policy)
    several = 0
    for row in rows:
        ids, mask, logprobs = row["token_ids"], row["loss_mask"], row["logprobs"]
        assert len(ids) == len(mask) == len(logprobs) == row["prompt_tokens"] + len(ids) - row["prompt_tokens"]
        assert sum(mask) == row["response_tokens"]  # the policy's tokens only
        assert all((lp < 0) == bool(m) for lp, m in zip(logprobs, mask))  # a log-prob exactly where trained
        assert row["messages"][0]["role"] == "assistant" and row["turns"] == sum(
            m["role"] == "assistant" for m in row["messages"])
        holes = [t for t, m in zip(ids[row["prompt_tokens"]:], mask[row["prompt_tokens"]:]) if not m]
        if row["turns"] > 1:
            several += 1
            assert "tell me more" in tokenizer.decode(holes)
    assert several > 0
    # `ppo score` scores the transcripts as training does: the last message, plus the steps' rewards
    result = runner.invoke(app, ["score", str(out), "--recipe", str(ROOT / "recipes/tiny_sentiment.yaml"), *sets])
    assert result.exit_code == 0, result.output
    penalty = 10.0  # tiny_sentiment.yaml's reward.missing_eos_penalty
    for row in (json.loads(line) for line in out.with_name("episodes.scored.jsonl").read_text().splitlines()):
        steps = 0.5 * sum(m["role"] == "user" for m in row["messages"])
        expected = len(row["response"].split()) / 10 + steps - (0.0 if row["finished"] else penalty)
        assert row["reward"] == pytest.approx(expected, abs=1e-5)
    result = runner.invoke(app, ["eval", str(chat_policy), "--out", str(tmp_path / "eval.json"), *common])
    assert result.exit_code == 0, result.output
    assert "turns" in result.output


def test_ppo_compare_shows_turns_and_keeps_the_transcripts(chat_policy, recipe_files, tmp_path):
    sets = _sets(chat_policy, recipe_files, tmp_path)
    result = runner.invoke(app, ["compare", str(chat_policy), str(chat_policy), "--recipe",
                                 str(ROOT / "recipes/tiny_sentiment.yaml"), *sets, "--prompts",
                                 str(ROOT / "recipes/prompts/reviews_eval.txt"), "--out", str(tmp_path / "cmp")])
    assert result.exit_code == 0, result.output
    assert "mean turns" in result.output and "tool-call rate" in result.output and " turn" in result.output
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    row = report["rows"][0]
    assert row["a_messages"] == row["b_messages"] and row["a_messages"][0]["role"] == "assistant"
    assert row["a_turns"] == sum(m["role"] == "assistant" for m in row["a_messages"])


@pytest.mark.parametrize("overlap", [False, True])
def test_a_resumed_run_with_an_environment_equals_the_uninterrupted_one(chat_policy, recipe_files, tmp_path, overlap):
    """The reset seeds come from torch's random state, which a checkpoint keeps: update 2 after a resume
    samples the same episodes and gives the same numbers; with overlap too (its waves are fixed, not timed)."""
    def metrics(run: Path) -> list[dict]:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in row.items() if not k.startswith(("time/", "perf/", "tokens_per_s"))} for row in rows]

    base = {"generation.num_generations": 2, "ppo.mini_batch_size": 8, "value.kind": "none", "ppo.advantage": "grpo",
            "train.save_every": 1}
    whole = runner.invoke(app, ["train", str(ROOT / "recipes/tiny_sentiment.yaml"),
                                *_sets(chat_policy, recipe_files, tmp_path / "whole", overlap, **base,
                                      **{"train.total_updates": 2})])
    assert whole.exit_code == 0, whole.output
    first = runner.invoke(app, ["train", str(ROOT / "recipes/tiny_sentiment.yaml"),
                                *_sets(chat_policy, recipe_files, tmp_path / "parts", overlap, **base)])
    assert first.exit_code == 0, first.output
    resumed = runner.invoke(app, ["train", str(ROOT / "recipes/tiny_sentiment.yaml"),
                                  *_sets(chat_policy, recipe_files, tmp_path / "parts", overlap, **base,
                                         **{"train.total_updates": 2}),
                                  "--resume", "latest"])
    assert resumed.exit_code == 0, resumed.output
    assert metrics(tmp_path / "parts" / "mt") == metrics(tmp_path / "whole" / "mt")
