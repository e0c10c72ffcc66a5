"""A ChatML tokenizer (SmolLM2's chat template) built here, no network; and a scripted inner sampler."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from ppo_cli.types import Generation

# SmolLM2-135M-Instruct's chat template (ChatML).
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The same, but earlier assistant turns lose their <think> block once a later message follows (as Qwen3's do).
DROPS_THINK = (
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip() %}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    'What is 12 times 7? <tool_call>{"name": "calculate", "arguments": {"expression": "12 * 7"}}</tool_call>',
    "The answer is 84. system user assistant tool error: unknown tool wrong arguments raised",
    "Guess my number. Higher. Lower. Correct! I am thinking of a number from 1 to 10.",
]


@pytest.fixture(scope="session")
def chatml():
    import sys
    from pathlib import Path

    from transformers import PreTrainedTokenizerFast

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fixtures"))
    from byte_level import train_byte_level_bpe

    tok = train_byte_level_bpe(CORPUS * 5, 400, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>",
                                        padding_side="left")
    tokenizer.chat_template = CHATML
    return tokenizer


@dataclass(frozen=True)
class Sampled:  # engine/sampler.py's, until it is merged
    generation: Generation
    logprobs: torch.Tensor | None
    hidden: torch.Tensor | None
    policy_logprobs: bool


class ScriptedSampler:
    """Each call answers the rows it is given with the next turn's texts, in row order; a text is sampled
    as its ids + the stop token, unless it ends with NO_STOP. Log-prob of a sampled id: -id / 1000; hidden
    state: the id, H = 2. Records every call's (sequences, mask, max_new_tokens)."""

    NO_STOP = "<no stop>"

    def __init__(self, tokenizer, turns: list[list[str]]):
        self.tokenizer = tokenizer
        self.turns = list(turns)
        self.calls: list[tuple[list[list[int]], int | None]] = []

    def sample(self, policy, prompt_ids, prompt_mask, *, with_logprobs=False, keep_hidden=False, on_finished=None,
               max_new_tokens=None):
        texts = self.turns.pop(0)
        assert len(texts) == prompt_ids.shape[0], (texts, prompt_ids.shape)
        self.calls.append(([row[m].tolist() for row, m in zip(prompt_ids, prompt_mask)], max_new_tokens))
        stop, pad = self.tokenizer.convert_tokens_to_ids("<|im_end|>"), self.tokenizer.pad_token_id
        rows = []
        for text in texts:
            if text.endswith(self.NO_STOP):
                rows.append(self.tokenizer(text.removesuffix(self.NO_STOP), add_special_tokens=False)["input_ids"])
            else:
                rows.append(self.tokenizer(text, add_special_tokens=False)["input_ids"] + [stop])
        T = max(len(r) for r in rows) + 2  # trailing padding, as generate leaves
        ids = torch.full((len(rows), T), pad)
        mask = torch.zeros((len(rows), T), dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = True
        finished = torch.tensor([r[-1] == stop for r in rows])
        generation = Generation(prompt_ids, prompt_mask, ids, mask, finished, mask.clone())
        logprobs = torch.where(mask, -ids.float() / 1000, 0.0) if with_logprobs else None
        hidden = ids.float().unsqueeze(-1).expand(-1, -1, 2).clone() if keep_hidden else None
        return Sampled(generation, logprobs, hidden, True)


# Python environment classes the multi-turn and overlap tests name by `path:Class` (envs_file).
ENVIRONMENTS = '''
import asyncio, time

class Crashes:
    def reset(self, row, seed):
        return None
    def step(self, message):
        raise RuntimeError("the game server fell over")

class CrashesAtReset:
    def reset(self, row, seed):
        raise KeyError("board")
    def step(self, message):
        return {"done": True}

class Sleeps:
    def reset(self, row, seed):
        return None
    def step(self, message):
        time.sleep(5)

class Async:
    closed = []
    def __init__(self, answer="Lower."):
        self.answer = answer
    async def reset(self, row, seed):
        await asyncio.sleep(0)
        return [{"role": "user", "content": f"row {row['prompt']}, seed {seed}"}]
    async def step(self, message):
        await asyncio.sleep(0.01)
        return {"observation": self.answer, "reward": 0.5, "done": False}
    async def close(self):
        Async.closed.append(True)

class BadAnswer:
    def reset(self, row, seed):
        return None
    def step(self, message):
        return {"observation": 3, "done": False}

class CrashesOnP3:
    closed = []
    def reset(self, row, seed):
        self.prompt = row["prompt"]
    def step(self, message):
        if self.prompt == "p3":
            raise RuntimeError("p3's board is gone")
        return {"observation": "again", "done": False}
    def close(self):
        CrashesOnP3.closed.append(self.prompt)

class Seeded:
    def reset(self, row, seed):
        return f"row {row['prompt']}, seed {seed}"
    async def step(self, message):
        return {"observation": "more", "reward": 0.5, "done": False}
'''


@pytest.fixture()
def envs_file(tmp_path) -> str:
    """ENVIRONMENTS written to a fresh file: each test imports its own module (class-level state such as
    `closed` starts empty)."""
    path = tmp_path / "envs.py"
    path.write_text(ENVIRONMENTS)
    return str(path)
