"""Token in, token out: environment deltas, the template round trip, cutting long observations."""

from __future__ import annotations

import pytest

from ppo_cli.engine.envs.episode import check_template_round_trip, cut_middle, observation_ids, sample_conversations
from ppo_cli.errors import EnvironmentSetupError
from tests.engine.envs.conftest import DROPS_THINK


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_observation_ids_are_the_text_after_the_stop_token_up_to_the_next_generation_prompt(chatml):
    history = [{"role": "user", "content": "Guess."}, {"role": "assistant", "content": "5"}]
    delta = observation_ids(chatml, history, [{"role": "user", "content": "Higher."}], "<|im_end|>")
    # ChatML closes a turn with <|im_end|> then a newline: the newline was never sampled, so it leads the delta.
    assert delta == ids(chatml, "\n<|im_start|>user\nHigher.<|im_end|>\n<|im_start|>assistant\n")


def test_two_environment_messages_of_one_step_are_one_delta(chatml):
    history = [{"role": "user", "content": "Guess."}, {"role": "assistant", "content": "5"}]
    observation = [{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]
    assert observation_ids(chatml, history, observation, "<|im_end|>") == ids(
        chatml, "\n<|im_start|>tool\na<|im_end|>\n<|im_start|>tool\nb<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("role", ["user", "tool"])
def test_chatml_passes_the_round_trip(chatml, role):
    check_template_round_trip(chatml, sample_conversations(role), chatml.convert_tokens_to_ids("<|im_end|>"))


def test_a_template_that_drops_earlier_think_blocks_is_refused_in_one_line(chatml):
    drops = chatml.__class__(tokenizer_object=chatml.backend_tokenizer, eos_token="<|im_end|>", pad_token="<pad>")
    drops.chat_template = DROPS_THINK
    with pytest.raises(EnvironmentSetupError) as info:
        check_template_round_trip(drops, sample_conversations("user"), drops.convert_tokens_to_ids("<|im_end|>"))
    assert info.value.message == (
        "the tokenizer's chat template cannot build episodes token by token (the conversation rendered with the "
        "environment's messages does not start with its rendering before them): the trained tokens would not be the "
        "sampled ones")
    assert info.value.hint.startswith("give the tokenizer a chat template that renders every turn verbatim")
    assert "\n" not in info.value.message


def test_a_stop_token_the_template_never_writes_is_refused(chatml):
    with pytest.raises(EnvironmentSetupError, match="does not end the assistant's turn with the stop token '<pad>'"):
        check_template_round_trip(chatml, sample_conversations("user"), chatml.pad_token_id)


def test_cut_middle_keeps_head_and_tail_with_a_marker(chatml):
    text = "Higher. Lower. Correct! " * 10
    full = ids(chatml, text)
    cut = cut_middle(chatml, text, 6)
    assert cut == (chatml.decode(full[:3]) + f"\n[... {len(full) - 6} tokens cut ...]\n" + chatml.decode(full[-3:]))
    assert cut_middle(chatml, "Higher.", 6) == "Higher."


# Qwen2.5's way with tool answers: consecutive tool messages share one user turn, each in <tool_response>.
GROUPS_TOOL_ANSWERS = (
    "{%- for m in messages %}{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\n<tool_response>\n' + m.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}{%- endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_template_that_groups_tool_answers_gets_one_delta_per_step_and_passes(chatml):
    grouping = chatml.__class__(tokenizer_object=chatml.backend_tokenizer, eos_token="<|im_end|>", pad_token="<pad>")
    grouping.chat_template = GROUPS_TOOL_ANSWERS
    check_template_round_trip(grouping, sample_conversations("tool"), grouping.convert_tokens_to_ids("<|im_end|>"))
    history = [{"role": "user", "content": "Add."}, {"role": "assistant", "content": "calls"}]
    observation = [{"role": "tool", "content": "3"}, {"role": "tool", "content": "4"}]
    assert observation_ids(grouping, history, observation, "<|im_end|>") == ids(
        grouping, "\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n4\n</tool_response>"
                  "<|im_end|>\n<|im_start|>assistant\n")
