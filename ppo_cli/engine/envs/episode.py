"""Token in, token out: an episode is one token sequence, grown turn by turn and never re-tokenized.

The sequence is the prompt's ids, then for each turn the ids the policy sampled (exactly as sampled,
stop token included) and the chat template's rendering of the environment's answer appended as a
delta: the text of the conversation rendered up to the environment's messages with the generation
prompt for the next assistant turn, minus the text rendered up to the assistant's stop token. Only
that delta is tokenized; nothing earlier ever is, so the ids trained are the ids sampled.

``check_template_round_trip`` checks, before any episode runs, that sequences built so equal the
template's rendering of the whole conversation: a template that rewrites earlier turns once later
ones follow (Qwen3's drops earlier <think> blocks) would make the two differ, and is refused.

The budget: ``max_episode_tokens`` counts every token after the prompt, the policy's and the
environment's. An environment message longer than ``max_observation_tokens`` is cut in the middle.
What the environment says after the policy's last turn (done, max_turns, or no room left for another
turn) is in the transcript, not in the tokens: the sequence ends with the policy's last token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ppo_cli.errors import EnvironmentSetupError

Message = dict[str, Any]
# max_new_tokens: a turn reached generation.max_new_tokens without its stop token (the message is cut: the episode ends)
ENDED_BY = ("done", "max_turns", "max_episode_tokens", "max_new_tokens", "failed")
REWRITES_HINT = ("give the tokenizer a chat template that renders every turn verbatim whatever follows it "
                 "(Qwen3's drops earlier <think> blocks: use one that keeps them), e.g. in chat_template.jinja")


def no_chat_template_error(path: str) -> EnvironmentSetupError:
    """An episode's turns are the chat template's rendering: a policy without one cannot run them."""
    return EnvironmentSetupError(
        f"environment: an episode of several turns is rendered with the policy's chat template, but '{path}' has none",
        hint="use a chat model (a tokenizer with a chat template) as policy.path, e.g. models/tiny-tools/policy",
    )


class TemplateRewrites(Exception):
    """The chat template rendered an earlier part of a conversation differently once more followed."""


def render(tokenizer, messages: list[Message], tools: list[dict] | None, add_generation_prompt: bool) -> str:
    from jinja2 import TemplateError

    extra = {"tools": tools} if tools else {}
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
    except TemplateError as err:
        roles = ", ".join(m["role"] for m in messages)
        raise EnvironmentSetupError(f"the chat template of '{tokenizer.name_or_path}' refuses an episode's conversation "
                                    f"({roles}): {err}", hint="use a chat template that takes these roles") from None


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def observation_ids(tokenizer, history: list[Message], observation: list[Message], stop_text: str,
                    tools: list[dict] | None = None) -> list[int]:
    """The ids that follow the assistant's stop token: ``observation`` rendered after ``history`` (which
    ends with that assistant message), then the next assistant turn's generation prompt."""
    before = render(tokenizer, history, tools, add_generation_prompt=False)
    after = render(tokenizer, history + observation, tools, add_generation_prompt=True)
    if not after.startswith(before):
        raise TemplateRewrites("the conversation rendered with the environment's messages does not start with its "
                               "rendering before them")
    stop = before.rfind(stop_text)
    if stop < 0:
        raise TemplateRewrites(f"the chat template does not end the assistant's turn with the stop token {stop_text!r}")
    return encode(tokenizer, before[stop + len(stop_text):] + after[len(before):])


def cut_middle(tokenizer, text: str, max_tokens: int) -> str:
    """``text`` with at most ``max_tokens`` of its tokens kept, head and tail, a marker between them
    saying how many were cut (the marker's own tokens come on top)."""
    ids = encode(tokenizer, text)
    if len(ids) <= max_tokens:
        return text
    head = max_tokens // 2
    tail = max_tokens - head
    kept_tail = tokenizer.decode(ids[len(ids) - tail:], skip_special_tokens=False) if tail else ""
    return (tokenizer.decode(ids[:head], skip_special_tokens=False) + f"\n[... {len(ids) - max_tokens} tokens cut ...]\n"
            + kept_tail)


def cut_observation(tokenizer, observation: list[Message], max_tokens: int) -> list[Message]:
    return [{**m, "content": cut_middle(tokenizer, m["content"], max_tokens)} for m in observation]


@dataclass
class Episode:
    """One episode while it runs: its sequence (prompt, then every token after it) and its record."""

    prompt_ids: list[int]
    prompt_messages: list[Message]
    budget: int  # max_episode_tokens: tokens after the prompt
    token_ids: list[int] = field(default_factory=list)  # every token after the prompt
    action: list[bool] = field(default_factory=list)  # per token_ids: True where the policy sampled it
    logprobs: list[float] = field(default_factory=list)  # per token_ids: the sampler's log-prob, 0.0 at environment tokens
    hidden: list[tuple[int, Any]] = field(default_factory=list)  # (start in token_ids, a turn's (n, H) hidden states)
    messages: list[Message] = field(default_factory=list)  # the transcript after the prompt
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    observation_tokens: int = 0
    step_reward: float | None = None  # sum of the steps' rewards; None while no step gave one
    finished: bool = False  # the last turn ended with the stop token
    failure: str | None = None  # why the environment failed (one line)
    ended_by: str | None = None  # one of ENDED_BY once the episode is over

    @property
    def remaining(self) -> int:
        return self.budget - len(self.token_ids)

    @property
    def sequence(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    def add_turn(self, ids: list[int], stopped: bool, logprobs: list[float] | None = None, hidden=None) -> None:
        """The policy's ids of one turn, exactly as sampled; ``stopped``: its last id is the stop token."""
        if hidden is not None:
            self.hidden.append((len(self.token_ids), hidden))
        self.token_ids += ids
        self.action += [True] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.turns += 1
        self.finished = stopped

    def add_observation(self, ids: list[int]) -> None:
        """The environment's delta (observation_ids): attended, never trained."""
        self.token_ids += ids
        self.action += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.observation_tokens += len(ids)

    def add_reward(self, reward: float | None) -> None:
        if reward is not None:
            self.step_reward = reward + (self.step_reward or 0.0)

    def end(self, reason: str, failure: str | None = None) -> None:
        assert reason in ENDED_BY, reason
        self.ended_by = reason
        self.failure = failure


def assistant_message(text: str) -> Message:
    """How a sampled turn enters the template when rendering deltas: its text verbatim. (The transcript's
    copy may add ``tool_calls``; the deltas never depend on how the template renders the assistant.)"""
    return {"role": "assistant", "content": text}


def sample_conversations(observation_role: str) -> list[list[Message]]:
    """Conversations for check_template_round_trip: prompt, then assistant turns (with <think> blocks and a
    hermes tool call) and environment messages (``observation_role``), one step giving two messages."""
    env = {"role": observation_role, **({"name": "calculate"} if observation_role == "tool" else {})}
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "12 * 7"}}</tool_call>'
    return [
        [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "What is 12 times 7?"},
         {"role": "assistant", "content": f"<think>\nI should use the calculator.\n</think>\n{call}"},
         {**env, "content": "84"},
         {"role": "assistant", "content": "<think>\nThe tool says 84.\n</think>\n12 times 7 is 84."}],
        [{"role": "user", "content": "Guess my number."},
         {"role": "assistant", "content": "Is it 5?"},
         {**env, "content": "Higher."},
         {**env, "content": "You have 2 guesses left."},
         {"role": "assistant", "content": "Is it 8?"},
         {**env, "content": "Lower."},
         {"role": "assistant", "content": "7"}],
    ]


def check_template_round_trip(tokenizer, conversations: list[list[Message]], stop_token_id: int,
                              tools: list[dict] | None = None) -> None:
    """Build each conversation the way episodes are built (prompt ids with the generation prompt, each
    assistant turn as its content's ids + the stop token, each environment step as observation_ids) and
    require the result to equal the template's rendering of the whole conversation, tokenized, up to the
    last stop token. One line naming the fix when it does not."""
    stop_text = tokenizer.decode([stop_token_id], skip_special_tokens=False)
    path = getattr(tokenizer, "name_or_path", "")
    whose = f"the chat template of '{path}'" if path else "the tokenizer's chat template"
    for conversation in conversations:
        first = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
        ids = encode(tokenizer, render(tokenizer, conversation[:first], tools, add_generation_prompt=True))
        pending: list[Message] = []
        try:
            for i in range(first, len(conversation)):
                message = conversation[i]
                if message["role"] != "assistant":
                    pending.append(message)
                    continue
                if pending:
                    ids += observation_ids(tokenizer, conversation[:i - len(pending)], pending, stop_text, tools)
                    pending = []
                ids += encode(tokenizer, message["content"]) + [stop_token_id]
            whole = render(tokenizer, conversation, tools, add_generation_prompt=False)
            expected = encode(tokenizer, whole[:whole.rfind(stop_text) + len(stop_text)])
            if ids != expected:
                raise TemplateRewrites("a conversation rendered whole differs from its turns appended one by one")
        except TemplateRewrites as why:
            raise EnvironmentSetupError(
                f"{whose} cannot build episodes token by token ({why}): the trained tokens would "
                "not be the sampled ones", hint=REWRITES_HINT) from None
