"""Prompts to token ids: special tokens once, truncation that keeps the chat template, left padding."""

import pytest

from ppo_cli.engine.chat import conversation_text, encode_prompt, prompt_messages, tokenize_prompts
from ppo_cli.errors import DataError
from ppo_cli.recipe import DataConfig

GENERATION_PROMPT = "<|start|>assistant\n"


def _data(**fields) -> DataConfig:
    return DataConfig(prompts="p.txt", **fields)


def _text(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_templated_prompt_has_exactly_one_bos(chat_tokenizer):
    bos = chat_tokenizer.bos_token_id
    conversation = [{"role": "user", "content": "the lazy dog"}]
    for prompt, data in ((conversation, _data()), ("the lazy dog", _data(chat_template=True))):
        ids = encode_prompt(prompt, chat_tokenizer, data)
        assert ids.count(bos) == 1 and ids[0] == bos
        assert _text(chat_tokenizer, ids) == "<s><|start|>user\nthe lazy dog<|end|>" + GENERATION_PROMPT


def test_plain_text_prompt_keeps_the_tokenizers_bos_and_left_truncation(chat_tokenizer):
    ids = encode_prompt("the quick brown fox jumps over the lazy dog", chat_tokenizer, _data(max_prompt_tokens=4))
    assert len(ids) == 4 and ids[0] == chat_tokenizer.bos_token_id
    assert _text(chat_tokenizer, ids) == "<s>y dog"  # the last 3 tokens of the text after the BOS


def test_system_prompt_is_added_unless_the_row_has_its_own(chat_tokenizer):
    data = _data(system_prompt="be brief")
    assert prompt_messages("hi", data) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    own = [{"role": "system", "content": "mine"}, {"role": "user", "content": "hi"}]
    assert prompt_messages(own, data) == own
    assert prompt_messages("hi", _data()) is None  # plain text: no template


def test_too_long_conversation_loses_the_start_of_the_last_user_message_only(chat_tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "the dog"},
        {"role": "assistant", "content": "the fox"},
        {"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 10 + "END"},
    ]
    limit = 60
    ids = encode_prompt(messages, chat_tokenizer, _data(max_prompt_tokens=limit))
    text = _text(chat_tokenizer, ids)
    assert limit - 3 <= len(ids) <= limit  # a token or two may merge at the cut
    assert ids.count(chat_tokenizer.bos_token_id) == 1
    head = "<s><|start|>system\nbe brief<|end|><|start|>user\nthe dog<|end|><|start|>assistant\nthe fox<|end|><|start|>user\n"
    assert text.startswith(head)
    assert text.endswith("lazy dog END<|end|>" + GENERATION_PROMPT)
    generation_ids = chat_tokenizer(GENERATION_PROMPT, add_special_tokens=False)["input_ids"]
    assert ids[-len(generation_ids):] == generation_ids


def test_template_that_cannot_fit_names_max_prompt_tokens(chat_tokenizer):
    data = _data(max_prompt_tokens=8, system_prompt="be brief")
    with pytest.raises(DataError) as err:
        encode_prompt("the dog", chat_tokenizer, data)
    overhead = len(encode_prompt("", chat_tokenizer, _data(max_prompt_tokens=100, system_prompt="be brief")))
    assert str(err.value) == (
        f"a prompt's chat template, system prompt and earlier turns take {overhead} tokens, "
        "more than data.max_prompt_tokens (8)"
    )


def test_conversation_without_a_chat_template_is_one_line(chat_tokenizer):
    tokenizer = chat_tokenizer.__class__(tokenizer_object=chat_tokenizer.backend_tokenizer, bos_token="<s>", pad_token="<pad>")
    with pytest.raises(DataError, match="the prompts need a chat template .* but the tokenizer has no chat template"):
        encode_prompt([{"role": "user", "content": "hi"}], tokenizer, _data())


def test_batch_is_left_padded_with_a_mask(chat_tokenizer):
    ids, mask = tokenize_prompts(["the dog", [{"role": "user", "content": "the dog"}]], chat_tokenizer, _data(), "cpu")
    plain = encode_prompt("the dog", chat_tokenizer, _data())
    assert ids.shape == mask.shape and ids.shape[0] == 2
    assert ids[0, -len(plain):].tolist() == plain
    assert mask[0].tolist() == [False] * (ids.shape[1] - len(plain)) + [True] * len(plain)
    assert mask[1].all()


def test_reward_conversation_uses_the_reward_tokenizers_template_with_the_response(chat_tokenizer):
    text = conversation_text("the dog", "the fox", chat_tokenizer, system_prompt="be brief")
    assert text == "<s><|start|>system\nbe brief<|end|><|start|>user\nthe dog<|end|><|start|>assistant\nthe fox<|end|>"


def test_a_template_that_refuses_a_system_turn_is_one_line_naming_the_fix(chat_tokenizer):
    """Mistral's and Gemma's templates raise on a system turn: bad data, not a bug of ours."""
    import copy

    from ppo_cli.engine.chat import encode_prompt
    from ppo_cli.recipe import DataConfig

    strict = copy.deepcopy(chat_tokenizer)
    strict.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    data = DataConfig(prompts="unused.txt", system_prompt="Be brief.", max_prompt_tokens=64)
    with pytest.raises(DataError) as err:
        encode_prompt("the dog", strict, data)
    assert str(err.value).endswith("refuses a conversation (system, user): System role not supported")
    assert err.value.hint.startswith("this template takes no system turn: remove data.system_prompt")


def test_plain_text_prompts_to_a_chat_model_without_its_template_get_a_note(chat_tokenizer):
    from ppo_cli.engine.chat import plain_text_note

    conversation = [{"role": "user", "content": "hi"}]
    note = plain_text_note(["Write a haiku.", conversation], chat_tokenizer, _data())
    assert note == ("note: the prompts are plain text and reach the policy without its tokenizer's chat template; "
                    "a chat model may answer them with nothing: set data.chat_template: true to send each as a user turn")
    assert plain_text_note(["Write a haiku."], chat_tokenizer, _data(chat_template=True)) is None
    assert plain_text_note(["Write a haiku."], chat_tokenizer, _data(system_prompt="Be brief.")) is None
    assert plain_text_note([conversation], chat_tokenizer, _data()) is None  # conversations use the template
    no_template = chat_tokenizer.__class__(tokenizer_object=chat_tokenizer.backend_tokenizer, bos_token="<s>", pad_token="<pad>")
    assert plain_text_note(["The movie was"], no_template, _data()) is None  # a base model: text is what it reads


def test_prompts_longer_than_max_prompt_tokens_are_counted_in_a_note(chat_tokenizer):
    from ppo_cli.engine.chat import cut_prompts_note, encode_prompt, prompt_lengths, template_ids

    data = _data(max_prompt_tokens=8)
    short, long = "hi", "one two three four five six seven eight nine ten eleven twelve"
    conversation = [{"role": "user", "content": long}]
    lengths = prompt_lengths([short, long, conversation], chat_tokenizer, data)
    # what the policy would read uncut: the plain prompt with its BOS, the conversation templated
    assert lengths == [len(chat_tokenizer(short).input_ids), len(chat_tokenizer(long).input_ids),
                       len(template_ids(conversation, chat_tokenizer))]
    assert lengths[0] <= 8 < lengths[1] and len(encode_prompt(long, chat_tokenizer, data)) == 8  # cut, as noted
    note = cut_prompts_note([short, long, conversation], chat_tokenizer, data)
    assert note == (f"note: 2 of 3 prompts are longer than data.max_prompt_tokens (8; the longest {max(lengths)} tokens) "
                    "and lose their first tokens: raise data.max_prompt_tokens to keep them whole")
    assert cut_prompts_note([short, long], chat_tokenizer, data, limit=1) is None  # only the first is measured
    assert cut_prompts_note([long, short], chat_tokenizer, data, limit=1).startswith("note: 1 of the first 1 prompts")
    assert cut_prompts_note([short], chat_tokenizer, data) is None
