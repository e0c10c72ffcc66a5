"""Prompts to token ids: chat templates, special tokens exactly once, truncation that keeps the template.

Plain-text prompts are tokenised with the tokenizer's special tokens (a base model needs its BOS)
and truncated from the left. A conversation (a conversational row, or a string when
data.chat_template or data.system_prompt asks for it) is rendered with the tokenizer's chat template
and tokenised WITHOUT adding special tokens: templates that begin with ``{{ bos_token }}`` (Llama 3,
Mistral, Gemma) already wrote it, and adding it again gives two BOS tokens.

A conversation longer than data.max_prompt_tokens loses the start of its last user message's
content; the template, the system prompt, the earlier turns and the generation prompt stay whole.
If even an empty last user message does not fit, that is an error naming data.max_prompt_tokens.

No torch import at module level: ``ppo plan`` counts prompt tokens without it.
"""

from __future__ import annotations

from ppo_cli.engine.data import Message, Prompt
from ppo_cli.errors import DataError


def prompt_messages(prompt: Prompt, data) -> list[Message] | None:
    """The conversation the policy is prompted with, or None for plain text (no template).

    data.system_prompt is added as a first system turn unless the row has its own system turn.
    """
    if isinstance(prompt, str) and not (data.chat_template or data.system_prompt):
        return None
    return as_messages(prompt, data.system_prompt)


def as_messages(prompt: Prompt, system_prompt: str | None) -> list[Message]:
    """A string as one user turn; ``system_prompt`` first unless the conversation has its own."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def check_chat_template(tokenizer, why: str, hint: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{why} but the tokenizer has no chat template", hint=hint)


PROMPTS_NEED_TEMPLATE = "the prompts need a chat template (conversation rows, data.chat_template or data.system_prompt)"
NO_TEMPLATE_HINT = "use a chat model, or plain-text prompts without data.chat_template and data.system_prompt"


def needs_chat_template(prompts: list[Prompt], data) -> bool:
    """Whether any prompt reaches the policy through its chat template (prompt_messages)."""
    return bool(data.chat_template or data.system_prompt) or any(not isinstance(p, str) for p in prompts)


def policy_template_ids(messages: list[Message], tokenizer) -> list[int]:
    """template_ids of a prompt's conversation, refused in one line where the policy's tokenizer has no template."""
    check_chat_template(tokenizer, PROMPTS_NEED_TEMPLATE, NO_TEMPLATE_HINT)
    return template_ids(messages, tokenizer)


def render_template(tokenizer, messages: list[Message], add_generation_prompt: bool = False) -> str:
    """The chat template's text. A template may refuse a conversation (Mistral's and Gemma's raise on a
    system turn, most on roles that do not alternate): that is the data's fault, said in one line."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except TemplateError as err:
        roles = ", ".join(m["role"] for m in messages)
        hint = ("this template takes no system turn: remove data.system_prompt (or the rows' system messages)"
                if any(m["role"] == "system" for m in messages) else "check the rows' roles against the model's chat template")
        raise DataError(f"the chat template of '{tokenizer.name_or_path}' refuses a conversation ({roles}): {err}",
                        hint=hint) from None


def plain_text_note(prompts: list[Prompt], tokenizer, data) -> str | None:
    """A note where string prompts go to a policy without the chat template its tokenizer has
    (data.chat_template off, as TRL does with plain-text prompts): a chat model given a bare string
    often ends its answer at once, and a reward that likes short answers then pays for empty ones."""
    if data.chat_template or data.system_prompt or not getattr(tokenizer, "chat_template", None):
        return None
    if not any(isinstance(prompt, str) for prompt in prompts):
        return None
    return ("note: the prompts are plain text and reach the policy without its tokenizer's chat template; "
            "a chat model may answer them with nothing: set data.chat_template: true to send each as a user turn")


def prompt_lengths(prompts: list[Prompt], tokenizer, data) -> list[int]:
    """Each prompt's tokens as the policy would read it uncut (encode_prompt before data.max_prompt_tokens)."""
    lengths = []
    for prompt in prompts:
        messages = prompt_messages(prompt, data)
        lengths.append(len(tokenizer(prompt, add_special_tokens=True)["input_ids"]) if messages is None
                       else len(policy_template_ids(messages, tokenizer)))
    return lengths


def cut_prompts_note(prompts: list[Prompt], tokenizer, data, limit: int = 2000) -> str | None:
    """A note where prompts are longer than data.max_prompt_tokens, so that they are cut (from the start; a
    conversation: the start of its last user message) without a word otherwise. The first ``limit``
    prompts are measured: tokenizing a whole large dataset at start would cost more than it tells."""
    measured = prompts[:limit]
    cut = [n for n in prompt_lengths(measured, tokenizer, data) if n > data.max_prompt_tokens]
    if not cut:
        return None
    of = f"{len(measured)} prompts" if len(measured) == len(prompts) else f"the first {len(measured)} prompts"
    return (f"note: {len(cut)} of {of} are longer than data.max_prompt_tokens ({data.max_prompt_tokens}; the longest "
            f"{max(cut)} tokens) and lose their first tokens: raise data.max_prompt_tokens to keep them whole")


def template_ids(messages: list[Message], tokenizer, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of the templated conversation; the template's own special tokens only."""
    text = render_template(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_prompt(prompt: Prompt, tokenizer, data) -> list[int]:
    """Token ids of one prompt, at most data.max_prompt_tokens (see the module docstring)."""
    limit = data.max_prompt_tokens
    messages = prompt_messages(prompt, data)
    if messages is None:
        tokenizer.truncation_side = "left"
        return tokenizer(prompt, truncation=True, max_length=limit, add_special_tokens=True)["input_ids"]
    ids = policy_template_ids(messages, tokenizer)
    return ids if len(ids) <= limit else _truncate_last_user_turn(messages, tokenizer, limit)


def _truncate_last_user_turn(messages: list[Message], tokenizer, limit: int) -> list[int]:
    """Keep the last tokens of the last user message's content so the templated prompt fits ``limit``.

    Re-rendering after each cut, rather than splicing ids, keeps the tokenisation the template
    would give; each pass cuts at least one more token, so it ends by the empty content at worst.
    """
    turn = max(i for i, m in enumerate(messages) if m["role"] == "user")
    with_content = lambda text: [*messages[:turn], {**messages[turn], "content": text}, *messages[turn + 1 :]]  # noqa: E731
    overhead = len(template_ids(with_content(""), tokenizer))
    if overhead > limit:
        raise DataError(
            f"a prompt's chat template, system prompt and earlier turns take {overhead} tokens, "
            f"more than data.max_prompt_tokens ({limit})",
            hint=f"raise data.max_prompt_tokens to at least {overhead + 1}, or shorten the system prompt / conversation",
        )
    content_ids = tokenizer(messages[turn]["content"], add_special_tokens=False)["input_ids"]
    keep = limit - overhead
    while True:
        kept = tokenizer.decode(content_ids[len(content_ids) - keep :] if keep else [], skip_special_tokens=False)
        ids = template_ids(with_content(kept), tokenizer)
        if len(ids) <= limit or keep == 0:
            return ids
        keep = max(0, keep - (len(ids) - limit))


def encode_prompts(prompts: list[Prompt], tokenizer, data) -> list[list[int]]:
    return [encode_prompt(p, tokenizer, data) for p in prompts]


def tokenize_prompts(prompts: list[Prompt], tokenizer, data, device):
    """Left-padded prompt ids and bool mask, each (B, P)."""
    tokenizer.padding_side = "left"
    enc = tokenizer.pad({"input_ids": encode_prompts(prompts, tokenizer, data)}, padding=True, return_tensors="pt")
    return enc["input_ids"].to(device), enc["attention_mask"].to(device).bool()


def conversation_text(prompt: Prompt, response: str, tokenizer, system_prompt: str | None) -> str:
    """A reward model's input: prompt + response as one conversation in the reward model's own chat
    template (the policy's data.system_prompt included, as the policy saw it)."""
    messages = [*as_messages(prompt, system_prompt), {"role": "assistant", "content": response}]
    return render_template(tokenizer, messages)
