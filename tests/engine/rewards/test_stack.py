"""Reward components, their weights and penalties, and Python reward functions."""

import textwrap

import pytest
import torch

from ppo_cli.engine.rewards.function import load_reward_function
from ppo_cli.engine.rewards.model import ModelScorer
from ppo_cli.engine.rewards.stack import RewardStack
from ppo_cli.errors import DataError, RecipeError, RewardFunctionError, RewardFunctionFailed
from ppo_cli.recipe import ClassifierReward, RewardConfig


def _write(tmp_path, body: str):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(body))
    return path


def _classifier_scorer(**fields) -> ModelScorer:
    """A ModelScorer with its label map set by hand: only _logits_to_rewards is exercised."""
    scorer = ModelScorer.__new__(ModelScorer)
    scorer.component = ClassifierReward(type="classifier", path="x", labels={"negative": -1, "neutral": 0.1, "positive": 10}, **fields)
    scorer.label_values = torch.tensor([-1.0, 0.1, 10.0])
    return scorer


def test_classifier_dominant_label_times_confidence_seed_003_scheme():
    # probs: [0.1, 0.2, 0.7] -> positive, 10 * 0.7 = 7.0; [0.6, 0.3, 0.1] -> negative, -1 * 0.6 = -0.6
    probs = torch.tensor([[0.1, 0.2, 0.7], [0.6, 0.3, 0.1]])
    rewards = _classifier_scorer(scale_by_confidence=True)._logits_to_rewards(probs.log())
    torch.testing.assert_close(rewards, torch.tensor([7.0, -0.6]), atol=1e-6, rtol=0)


def test_classifier_without_confidence_and_expected_mode():
    probs = torch.tensor([[0.1, 0.2, 0.7]])
    plain = _classifier_scorer()._logits_to_rewards(probs.log())
    # expected: 0.1 * -1 + 0.2 * 0.1 + 0.7 * 10 = 6.92
    expected = _classifier_scorer(mode="expected")._logits_to_rewards(probs.log())
    torch.testing.assert_close(plain, torch.tensor([10.0]))
    torch.testing.assert_close(expected, torch.tensor([6.92]), atol=1e-6, rtol=0)


def test_function_reward_from_file_with_weights_and_penalties(tmp_path):
    path = _write(tmp_path, """
        def length_reward(prompts, responses):
            return [float(len(r)) for r in responses]
    """)
    config = RewardConfig(
        components=[{"type": "function", "function": f"{path}:length_reward", "weight": 0.5}],
        missing_eos_penalty=10.0, max_response_tokens=3, overlength_penalty=2.0,
    )
    result = RewardStack(config, torch.device("cpu")).score(
        ["p", "p", "p"], ["ab", "abcd", ""], finished=[True, False, True], response_lengths=[2, 4, 1]
    )
    # 0.5*2 = 1.0 ; 0.5*4 - 10 (no EOS) - 2 (4 > 3 tokens) = -10.0 ; 0.5*0 = 0.0
    assert result.scores == [1.0, -10.0, 0.0]
    assert result.components == {
        "length_reward": [2.0, 4.0, 0.0],
        "missing_eos_penalty": [0.0, -10.0, 0.0],
        "overlength_penalty": [0.0, -2.0, 0.0],
    }


def test_overlong_penalty_counts_the_policys_tokens(tmp_path):
    path = _write(tmp_path, """
        def one(prompts, responses):
            return [1.0 for _ in responses]
    """)
    config = RewardConfig(components=[{"type": "function", "function": f"{path}:one"}], overlong_buffer=4,
                          overlong_penalty=2.0)
    stack = RewardStack(config, torch.device("cpu"), max_new_tokens=10)
    result = stack.score(["p"] * 4, ["a", "b", "c", "d"], finished=[True] * 4, response_lengths=[6, 7, 9, 10])
    # free up to 10 - 4 = 6 tokens, then -2/4 = -0.5 per token: 0, -0.5, -1.5, -2.0
    assert result.components["overlong"] == [0.0, -0.5, -1.5, -2.0]
    assert result.scores == [1.0, 0.5, -0.5, -1.0]
    # in an episode with several turns the environment's tokens are in response_lengths, not in action_lengths
    result = stack.score(["p"], ["a"], finished=[True], response_lengths=[10], action_lengths=[7])
    assert result.components["overlong"] == [-0.5]


def test_overlong_component_is_the_metric_name():
    from ppo_cli import metric_names
    from ppo_cli.engine.rewards.stack import OVERLONG

    assert metric_names.reward_component(OVERLONG) == metric_names.REWARD_OVERLONG


def test_function_reward_from_module_path():
    fn = load_reward_function("ppo_cli.examples.rewards:positive_words")
    assert fn(["x", "x"], ["great and wonderful", "terrible"]) == [2.0, -1.0]


@pytest.mark.parametrize(
    "body, spec_name, message",
    [
        ("def f(prompts, responses): return []", "g", "has no function 'g'"),
        ("def f(responses): return []", "f", "must take two arguments (prompts, responses)"),
        ("raise RuntimeError('boom')", "f", "cannot import reward function module"),
    ],
)
def test_bad_reward_functions_get_one_clear_error(tmp_path, body, spec_name, message):
    path = _write(tmp_path, body)
    with pytest.raises(RewardFunctionError, match=None) as info:
        load_reward_function(f"{path}:{spec_name}")
    assert message in info.value.message


ONE_EACH = "return a list with one number (or None) per response, in the order given"


@pytest.mark.parametrize(
    "returns, message",
    [
        ("[1.0]", "returned 1 value for 2 responses"),
        ("[1.0, 2.0, 3.0]", "returned 3 values for 2 responses"),
        ("1.0", "returned float, not a list of numbers"),
        ("'0.5'", "returned str, not a list of numbers"),
        ("{'a': 1.0}", "returned dict, not a list of numbers"),
        ("[1.0, '0.5']", "returned the string '0.5' for response 2, not a number"),
        ("[1.0, [2.0]]", "must return a list of numbers"),
    ],
)
def test_a_reward_function_returning_something_else_than_one_number_per_response_is_one_line(tmp_path, returns, message):
    path = _write(tmp_path, f"def f(prompts, responses): return {returns}")
    config = RewardConfig(components=[{"type": "function", "function": f"{path}:f"}])
    with pytest.raises(RewardFunctionError) as info:
        RewardStack(config, torch.device("cpu")).score(["a", "b"], ["a", "b"], [True, True], [1, 1])
    assert info.value.message == f"reward function '{path}:f' {message}"
    assert info.value.hint == ONE_EACH


def test_a_reward_function_may_return_a_tuple_or_a_tensor(tmp_path):
    path = _write(tmp_path, "import torch\ndef f(prompts, responses): return torch.tensor([1.0, -2.0])\n"
                            "def g(prompts, responses): return (0.5, None)")
    for name, expected in (("f", [1.0, -2.0]), ("g", [0.5, None])):
        config = RewardConfig(components=[{"type": "function", "function": f"{path}:{name}"}])
        result = RewardStack(config, torch.device("cpu")).score(["a", "b"], ["a", "b"], [True, True], [1, 1])
        assert result.components[name] == expected  # a function component is named by its function


def test_missing_reward_function_file(tmp_path):
    with pytest.raises(RewardFunctionError, match="reward function file not found"):
        load_reward_function(f"{tmp_path}/nope.py:f")


@pytest.mark.slow
def test_classifier_with_unknown_label_names_lists_the_real_ones(tiny_models):
    config = RewardConfig(components=[{"type": "classifier", "path": str(tiny_models / "reward"), "labels": {"happy": 1.0}}])
    with pytest.raises(RecipeError, match="has no label\\(s\\) happy") as info:
        RewardStack(config, torch.device("cpu"))
    assert info.value.hint == "its labels are: negative, neutral, positive"


@pytest.mark.slow
def test_tiny_classifier_scores_positive_text_above_negative(tiny_models):
    config = RewardConfig(components=[{
        "type": "classifier", "path": str(tiny_models / "reward"),
        "labels": {"negative": -1.0, "neutral": 0.1, "positive": 10.0}, "scale_by_confidence": True,
    }])
    stack = RewardStack(config, torch.device("cpu"))
    first = stack.score(["The movie was"] * 2, [" wonderful and I loved it.", " boring and awful."], [True, True], [5, 4])
    again = stack.score(["The movie was"] * 2, [" wonderful and I loved it.", " boring and awful."], [True, True], [5, 4])
    assert first.scores[0] > 5.0 > 0 > first.scores[1]
    assert first.scores == again.scores


def _conversation_scorer(tokenizer, text: str, system_prompt=None) -> ModelScorer:
    """A ModelScorer with its tokenizer set by hand: only the text it reads is exercised."""
    scorer = ModelScorer.__new__(ModelScorer)
    scorer.component = ClassifierReward(type="classifier", path="rm", labels={"x": 1}, text=text)
    scorer.tokenizer, scorer.system_prompt = tokenizer, system_prompt
    return scorer


def test_conversation_text_is_the_reward_tokenizers_template_of_prompt_and_response(chat_tokenizer):
    scorer = _conversation_scorer(chat_tokenizer, "conversation", system_prompt="be brief")
    conversation = [{"role": "user", "content": "the dog"}]
    assert scorer.texts([conversation, "the fox"], ["yes", "no"]) == [
        "<s><|start|>system\nbe brief<|end|><|start|>user\nthe dog<|end|><|start|>assistant\nyes<|end|>",
        "<s><|start|>system\nbe brief<|end|><|start|>user\nthe fox<|end|><|start|>assistant\nno<|end|>",
    ]


def test_prompt_and_response_text_refuses_a_conversation(chat_tokenizer):
    scorer = _conversation_scorer(chat_tokenizer, "prompt_and_response")
    assert scorer.texts(["the dog "], ["yes"]) == ["the dog yes"]
    with pytest.raises(DataError) as err:
        scorer.texts(["a", [{"role": "user", "content": "b"}]], ["x", "y"])
    assert str(err.value) == "reward component 'rm' reads text: prompt_and_response, but prompt 1 is a conversation"


def test_function_reward_gets_conversations_as_lists_and_cannot_change_them(tmp_path):
    path = _write(tmp_path, """
        def turns(prompts, responses):
            out = [float(len(p)) if isinstance(p, list) else -1.0 for p in prompts]
            for p in prompts:
                if isinstance(p, list):
                    p.clear()
            return out
    """)
    config = RewardConfig(components=[{"type": "function", "function": f"{path}:turns"}])
    conversation = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    result = RewardStack(config, torch.device("cpu")).score(["plain", conversation], ["a", "b"], [True, True], [1, 1])
    assert result.scores == [-1.0, 2.0]
    assert len(conversation) == 2



def test_a_reward_function_written_for_trl_is_called_by_keyword_with_trls_completions(tmp_path):
    # TRL's GRPOTrainer calls reward_func(prompts=, completions=, completion_ids=, **columns); a completion
    # is the text for a plain prompt and [{"role": "assistant", "content": text}] for a conversation.
    path = _write(tmp_path, """
        seen = []

        def accuracy(completions, solution, **kwargs):
            seen.append((completions, solution, sorted(kwargs)))
            texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
            return [1.0 if t.strip() == s else 0.0 for t, s in zip(texts, solution)]

        def strict(prompts, completions, solution):  # no **kwargs: only the names it has
            return [float(len(p)) + (10.0 if c == s else 0.0) for p, c, s in zip(prompts, completions, solution)]
    """)
    conversation = [{"role": "user", "content": "2+2?"}]
    columns = {"solution": ["4", "9"], "source": ["a", "b"]}
    config = RewardConfig(components=[{"type": "function", "function": f"{path}:accuracy"}])
    result = RewardStack(config, torch.device("cpu")).score([conversation, "3*3="], [" 4", "9"], [True, True], [1, 1],
                                                             columns=columns)
    assert result.scores == [1.0, 1.0]
    module = load_reward_function(f"{path}:accuracy").__globals__
    assert module["seen"] == [([[{"role": "assistant", "content": " 4"}], "9"], ["4", "9"], ["prompts", "responses", "source"])]
    config = RewardConfig(components=[{"type": "function", "function": f"{path}:strict"}])
    result = RewardStack(config, torch.device("cpu")).score(["ab", "abc"], ["4", "8"], [True, True], [1, 1],
                                                             columns=columns)
    assert result.scores == [12.0, 3.0]


def test_a_trl_reward_function_that_needs_completion_ids_is_refused_when_it_loads(tmp_path):
    path = _write(tmp_path, "def f(completions, completion_ids, **kwargs): return [0.0] * len(completions)")
    with pytest.raises(RewardFunctionError) as info:
        load_reward_function(f"{path}:f")
    assert info.value.message == (f"reward function '{path}:f' requires completion_ids, which ppo_cli does not pass "
                                  "(it passes prompts, completions and the rows' columns, by keyword)")
    assert info.value.hint == "give completion_ids a default (=None), or drop it and take **kwargs (kwargs.get(...) is None here)"
    path = tmp_path / "logging_reward.py"  # TRL 1.16's logging callbacks: required, refused; read from kwargs, a hint
    path.write_text("def h(completions, log_metric, **kwargs): return [0.0] * len(completions)\n"
                    "def k(completions, **kwargs):\n    kwargs['log_metric']('x', 1.0)\n    return [0.0] * len(completions)\n")
    with pytest.raises(RewardFunctionError, match="requires log_metric, which ppo_cli does not pass"):
        load_reward_function(f"{path}:h")
    config = RewardConfig(components=[{"type": "function", "function": f"{path}:k"}])
    with pytest.raises(RewardFunctionFailed) as info:
        RewardStack(config, torch.device("cpu")).score(["a"], ["b"], [True], [1])
    assert info.value.message == f"reward function '{path}:k' raised KeyError: 'log_metric'"
    assert info.value.hint == "ppo_cli does not pass TRL's log_metric: read it with kwargs.get('log_metric') and skip it when None"
    path = tmp_path / "columns_reward.py"
    path.write_text("def g(completions, solution, **kwargs): return [0.0] * len(completions)")
    config = RewardConfig(components=[{"type": "function", "function": f"{path}:g"}])
    with pytest.raises(RewardFunctionError, match="takes the column\\(s\\) solution"):
        RewardStack(config, torch.device("cpu")).score(["a"], ["b"], [True], [1], columns={"answer": ["4"]})

@pytest.mark.slow
def test_min_length_floor_of_the_demo_recipe_counts_tokens_as_the_tiny_tokenizer_does(tiny_models):
    from transformers import AutoTokenizer

    from tests.conftest import ROOT

    too_short = load_reward_function(f"{ROOT}/recipes/rewards/min_length.py:too_short")
    responses = [" a real delight.", " it's wonderful!", " excellent. I would happily watch it again.",
                 " really great and I would recommend it to anyone. Highly recommended.", ""]
    values = too_short(["The movie was"] * len(responses), responses)
    assert values == [-4.0, -3.0, 0.0, 0.0, -8.0]
    # The function sees only text; its count must be the policy's token count for the floor to mean 8 tokens.
    tokenizer = AutoTokenizer.from_pretrained(tiny_models / "policy")
    assert values == [float(min(0, len(tokenizer.tokenize(r)) - 8)) for r in responses]


@pytest.mark.parametrize("kind", ["classifier", "model"])
def test_a_causal_lm_is_no_reward_model(architecture_models, kind):
    """transformers gives a causal-LM checkpoint a random score head when it is loaded as a classifier:
    refuse it in one line instead of training on noise."""
    path = str(architecture_models / "llama")
    component = {"type": kind, "path": path, **({"labels": {"LABEL_0": -1.0, "LABEL_1": 1.0}} if kind == "classifier" else {})}
    with pytest.raises(RecipeError) as err:
        RewardStack(RewardConfig(components=[component]), torch.device("cpu"))
    assert str(err.value) == f"reward model '{path}' is a LlamaForCausalLM checkpoint with no classification head: its score would be random"


def test_a_sequence_classifier_passes_the_score_head_check():
    from transformers import LlamaConfig

    from ppo_cli.engine.rewards.model import check_has_trained_score_head

    check_has_trained_score_head(LlamaConfig(architectures=["LlamaForSequenceClassification"]), "rm")
    check_has_trained_score_head(LlamaConfig(), "rm")  # no architectures saved: nothing to go on


def test_the_smollm2_recipes_concise_reward_is_graded_by_length():
    from ppo_cli.engine.rewards.function import load_reward_function
    from tests.conftest import ROOT

    concise = load_reward_function(f"{ROOT}/recipes/rewards/concise.py:concise")
    words = lambda n: " ".join(["word"] * n)  # noqa: E731
    responses = ["", "Yes.", words(3), words(25), words(26), words(50), words(75), words(85)]
    # 3-25 words full marks, then 1/50 less a word: 26 -> 0.98, 50 -> 0.5, 75 -> 0, 85 -> -0.2.
    assert concise(["Q?"] * len(responses), responses) == pytest.approx([-1.0, -1.0, 1.0, 1.0, 0.98, 0.5, 0.0, -0.2])
