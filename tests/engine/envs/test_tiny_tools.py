"""tiny-tools (tests/fixtures/tiny_tools.py): its chat template keeps the multi-turn contract, its corpus's
tool calls parse as the environment parses them, its data rows load as chat prompts, and its reward
(recipes/rewards/tool_answer.py) reads final answers. The built model's own checks are the slow tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from ppo_cli.engine.envs.episode import check_template_round_trip, sample_conversations
from ppo_cli.engine.envs.tool_calls import parse_tool_calls
from ppo_cli.engine.envs.tools import load_tools, tool_schemas
from ppo_cli.engine.rewards.function import load_reward_function
from tests.fixtures import tiny_tools

ROOT = Path(__file__).resolve().parents[3]
CALCULATOR = "recipes/tools/calculator.py:calculate"


@pytest.fixture(scope="module")
def tokenizer():
    """The builder's tokenizer, trained on 300 of its conversations (BPE in well under a second)."""
    rng = random.Random(0)
    texts = ["".join(text for text, _ in tiny_tools.segments(tiny_tools.make_conversation(rng))) for _ in range(300)]
    return tiny_tools.make_tokenizer(texts)


@pytest.fixture(scope="module")
def schemas():
    return tool_schemas(load_tools([str(ROOT / CALCULATOR)]))


def test_the_template_renders_a_tool_conversation_as_the_training_text(tokenizer, schemas):
    conversation = tiny_tools.make_conversation(random.Random(1), tool=True)
    assert tokenizer.apply_chat_template(conversation, tools=schemas, tokenize=False) == "".join(
        text for text, _ in tiny_tools.segments(conversation))
    assert tokenizer.apply_chat_template(conversation[:1], tools=schemas, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nTools: calculate<|im_end|>\n<|im_start|>user\n" + conversation[0]["content"]
        + "<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("role", ["user", "tool"])
def test_the_template_passes_the_episode_round_trip(tokenizer, schemas, role):
    check_template_round_trip(tokenizer, sample_conversations(role), tokenizer.convert_tokens_to_ids("<|im_end|>"),
                              schemas)
    assert tokenizer.eos_token == "<|im_end|>"


def test_the_corpus_tool_call_parses_and_the_calculator_answers_it():
    text = tiny_tools.tool_call_text("37 - 48")
    assert text == '<tool_call>{"name": "calculate", "arguments": {"expression": "37 - 48"}}</tool_call>'
    [call] = parse_tool_calls(text)
    assert (call.name, call.arguments, call.error) == ("calculate", {"expression": "37 - 48"}, None)
    tools = load_tools([str(ROOT / CALCULATOR)])
    assert tools["calculate"].function(**call.arguments) == "-11"


def test_the_tool_call_tags_are_single_tokens_kept_by_decode(tokenizer):
    ids = tokenizer(tiny_tools.tool_call_text("12 + 30"), add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids[:1] + ids[-1:]) == ["<tool_call>", "</tool_call>"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == tiny_tools.tool_call_text("12 + 30")


def test_digits_are_single_tokens(tokenizer):
    # Qwen's split regex isolates each digit (\p{N}): copying a number is copying its digits one by one.
    assert tokenizer.tokenize("The answer is 85.") == ["The", "Ġanswer", "Ġis", "Ġ", "8", "5", "."]


def test_an_answer_only_row_trains_the_answer_and_not_the_call(tokenizer):
    conversation = tiny_tools.make_conversation(random.Random(2), tool=True)
    trained = [text for text, is_trained in tiny_tools.segments(conversation, train_call=False) if is_trained]
    assert trained == [conversation[-1]["content"] + "<|im_end|>"]
    trained = [text for text, is_trained in tiny_tools.segments(conversation) if is_trained]
    assert trained == [conversation[1]["content"] + "<|im_end|>", conversation[-1]["content"] + "<|im_end|>"]


def test_numbers_are_not_trained_where_the_model_could_only_guess_them(tokenizer):
    numbers = tiny_tools.number_token_ids(tokenizer)
    assert sorted(tokenizer.convert_ids_to_tokens(list(numbers))) == ["-", *"0123456789", "Ġ-"]
    guess = [{"role": "user", "content": "What is 12 - 30?"}, {"role": "assistant", "content": "It is -18."}]
    ids, labels = tiny_tools.encode(tokenizer, guess, number_ids=numbers)
    trained = [tokenizer.convert_ids_to_tokens(i) for i, label in zip(ids, labels) if label != -100]
    assert trained == ["It", "Ġis", ".", "<|im_end|>"]  # ' -' is one token ('Ġ-'), '1' '8' two more
    # after the tool's message the same answer is a copy: trained, digits and sign included
    copied = guess[:1] + [{"role": "assistant", "content": tiny_tools.tool_call_text("12 - 30")},
                          {"role": "tool", "content": "-18"}] + guess[1:]
    ids, labels = tiny_tools.encode(tokenizer, copied, train_call=False, number_ids=numbers)
    trained = [tokenizer.convert_ids_to_tokens(i) for i, label in zip(ids, labels) if label != -100]
    assert trained == ["It", "Ġis", "Ġ-", "1", "8", ".", "<|im_end|>"]


@pytest.mark.parametrize("name, rows", [("tiny_tools.jsonl", 400), ("tiny_tools_eval.jsonl", 32)])
def test_data_rows_are_chat_prompts_with_their_answer(name, rows):
    lines = [json.loads(line) for line in (ROOT / "recipes" / "data" / name).read_text().splitlines()]
    assert len(lines) == rows
    for row in lines:
        [message] = row["prompt"]
        assert message["role"] == "user"
        a, op, b = [t for t in message["content"].replace("?", " ").replace(".", " ").split() if t[-1].isdigit() or t in "+-"][:3]
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))


def test_train_and_eval_questions_are_disjoint():
    def questions(name):
        return {json.loads(line)["prompt"][0]["content"] for line in (ROOT / "recipes/data" / name).read_text().splitlines()}

    assert not questions("tiny_tools.jsonl") & questions("tiny_tools_eval.jsonl")


REWARD = str(ROOT / "recipes/rewards/tool_answer.py") + ":correct"


@pytest.mark.parametrize("response, answer, reward", [
    ("The answer is 85.", "85", 1.0),
    ("37 + 48 = 85.", "85", 1.0),          # the last integer is the answer, not the operands
    ("It is 84.", "85", 0.0),
    ("It is -11.", "-11", 1.0),
    ("It is 11.", "-11", 0.0),
    ("I do not know.", "85", 0.0),
    ("", "85", 0.0),
    # an episode cut off by max_turns ends on a call: its numbers are the question's, never an answer
    ('<tool_call>{"name": "calculate", "arguments": {"expression": "37 + 85"}}</tool_call>', "85", 0.0),
    ('<tool_call>{"name": "calculate", "arguments": {"expression": "37 + 85', "85", 0.0),
    ('Let me check. <tool_call>{"name": "calculate", "arguments": {"expression": "1 + 2"}}</tool_call> 3', "3", 1.0),
])
def test_the_reward_checks_the_final_integer_against_the_answer(response, answer, reward):
    correct = load_reward_function(REWARD)
    assert correct(["What is it?"], [response], answer=[answer]) == [reward]


def test_the_reward_scores_each_response_against_its_own_row():
    correct = load_reward_function(REWARD)
    assert correct(["q"] * 3, ["It is 5.", "It is 5.", "It is 7."], answer=["5", "6", "7"], extra=[1, 2, 3]) == [1.0, 0.0, 1.0]
    assert correct(["q"] * 2, ["It is 5.", "It is 5."], answer=[5, None]) == [1.0, None]  # ints read; no answer: unscored


@pytest.mark.slow
def test_the_built_model_calls_the_tool_sometimes_and_is_right_mostly_with_it(tiny_tools_model):
    """What makes tiny-tools an RL task: calling the tool pays, and the model does not always call it."""
    info = json.loads((tiny_tools_model / "build_info.json").read_text())
    assert 0.15 <= info["tool_call_rate"] <= 0.6, info
    assert info["accuracy_with_tool"] >= 0.6, info
    assert info["accuracy_without_tool"] <= 0.25, info


@pytest.mark.slow
def test_the_built_tokenizer_keeps_the_contract_and_its_corpus_calls_parse(tiny_tools_model, schemas):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tools_model / "policy")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.padding_side == "left"
    for role in ("user", "tool"):
        check_template_round_trip(tokenizer, sample_conversations(role), tokenizer.eos_token_id, schemas)
    rows = [json.loads(line) for line in (tiny_tools_model / "corpus.jsonl").read_text().splitlines()[:200]]
    calls = [m["content"] for row in rows for m in row["messages"] if "<tool_call>" in m["content"]]
    assert calls
    for text in calls:
        [call] = parse_tool_calls(text)
        assert call.name == "calculate" and call.error is None
    for row in rows[:20]:
        text = tokenizer.apply_chat_template(row["messages"], tools=schemas, tokenize=False)
        assert text == "".join(piece for piece, _ in tiny_tools.segments(row["messages"]))
