"""final/README.md: the hub's model card for a trained policy (YAML front matter + text). No torch.

The front matter is what the hub indexes: ``base_model`` (a hub id, so the model page links to its
base), ``library_name`` (peft for an adapter, transformers for full weights) and ``tags``.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from ppo_cli.metric_names import HELD_OUT_EOS_RATE, HELD_OUT_KL, HELD_OUT_RESPONSE_LENGTH, HELD_OUT_SCORE
from ppo_cli.model_refs import HUB_ID, gguf_location, is_gguf

TAGS = ["ppo_cli", "ppo", "rlhf", "reinforcement-learning"]

# (summary key, row label, format) of the before/after table; summary.json's before/after carry them.
RESULT_ROWS = (
    (HELD_OUT_SCORE, "mean reward", "{:+.3f}"),
    (HELD_OUT_EOS_RATE, "EOS rate", "{:.0%}"),
    (HELD_OUT_RESPONSE_LENGTH, "mean length (tokens)", "{:.1f}"),
    (HELD_OUT_KL, "KL to the reference (nats per response)", "{:.3f}"),
)


def hub_base_model(policy_path: str) -> str | None:
    """The hub id of the policy's base, or None when only a local path is known.

    A path that is not a local directory was loaded from the hub, so it is the id. A local model is
    named by the hub id its config.json records (transformers 4 saved it as ``_name_or_path``), when
    that is a hub id and not itself a path.
    """
    if is_gguf(policy_path):
        return None  # a GGUF file names no hub repository reliably
    local = Path(policy_path).expanduser()
    if not local.exists():
        return policy_path
    try:
        recorded = json.loads((local / "config.json").read_text(encoding="utf-8")).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(recorded, str) and HUB_ID.match(recorded) and not Path(recorded).expanduser().exists():
        return recorded
    return None


def front_matter(policy_path: str, is_adapter: bool) -> dict:
    meta = {}
    base = hub_base_model(policy_path)
    if base is not None:
        meta["base_model"] = base
    meta["library_name"] = "peft" if is_adapter else "transformers"
    meta["tags"] = list(TAGS)
    return meta


def _results_table(before: dict | None, after: dict | None) -> str:
    if not before or not after:
        return "No held-out prompts were set (data.eval_prompts), so there are no before/after numbers.\n"
    lines = ["| | before | after |", "| --- | ---: | ---: |"]
    for key, label, fmt in RESULT_ROWS:
        if key in before or key in after:
            cells = [fmt.format(d[key]) if d.get(key) is not None else "" for d in (before, after)]
            lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def _from_pretrained_args(path: str) -> str:
    """A GGUF file loads as ``from_pretrained(directory, gguf_file=name)`` (transformers dequantizes it)."""
    if not is_gguf(path):
        return repr(path)
    directory, name = gguf_location(path)
    return f"{directory!r}, gguf_file={name!r}"


def _usage(policy_path: str, policy_adapter: str | None, is_adapter: bool) -> str:
    code = ["from transformers import AutoModelForCausalLM, AutoTokenizer"]
    if is_adapter or policy_adapter:
        code.append("from peft import PeftModel")
    code.append("")
    if is_adapter:
        code.append(f"model = AutoModelForCausalLM.from_pretrained({_from_pretrained_args(policy_path)})")
        if policy_adapter:
            code.append(f"model = PeftModel.from_pretrained(model, {policy_adapter!r}).merge_and_unload()  # the starting adapter")
        code.append('model = PeftModel.from_pretrained(model, "PATH/TO/final")')
    else:
        code.append('model = AutoModelForCausalLM.from_pretrained("PATH/TO/final")')
    code.append('tokenizer = AutoTokenizer.from_pretrained("PATH/TO/final")')
    return "```python\n" + "\n".join(code) + "\n```\n"


ALGORITHMS = {"gae": "PPO (RLHF)", "grpo": "GRPO (RLHF, no critic)", "rloo": "RLOO (RLHF, no critic)",
              "reinforce_pp": "REINFORCE++ (RLHF, no critic)"}  # ppo.advantage -> the card's words


def render_model_card(info: dict, recipe_yaml: str, before: dict | None = None, after: dict | None = None) -> str:
    """README.md for final/. ``info`` is final/ppo_cli.json's content (policy_path, policy_adapter,
    lora, step, value_kind, advantage); ``before``/``after`` are summary.json's held-out numbers."""
    policy_path, policy_adapter, is_adapter = info["policy_path"], info.get("policy_adapter"), bool(info.get("lora"))
    what = "A LoRA adapter (peft)" if is_adapter else "A full fine-tune"
    start = f"`{policy_path}`" + (" (a GGUF file, dequantized at load)" if is_gguf(policy_path) else "") + \
        (f" with the adapter `{policy_adapter}` merged in" if policy_adapter else "")
    text = [
        "---\n" + yaml.safe_dump(front_matter(policy_path, is_adapter), sort_keys=False) + "---\n",
        f"# {info.get('name', 'ppo_cli policy')}\n",
        f"{what} trained with {ALGORITHMS[info.get('advantage', 'gae')]} by ppo_cli for {info.get('step')} "
        f"updates, starting from {start}. "
        "The reference for the KL penalty was the starting model.\n",
    ]
    if policy_adapter:
        text.append(
            f"The policy started from `{policy_adapter}` (for example the result of supervised fine-tuning) "
            f"merged into `{policy_path}`" + (", and this adapter was trained on top of that merged model: "
            "merge the starting adapter first, as below, or use merged/ when present.\n" if is_adapter else ".\n")
        )
    text += [
        "## Results on held-out prompts\n", _results_table(before, after),
        "## Usage\n", _usage(policy_path, policy_adapter, is_adapter),
        "## Files\n",
        ("The policy at the top" + (" (peft adapter)" if is_adapter else " (transformers weights)") +
         " with its tokenizer; " + ("" if info.get("value_kind") == "none" else
                                    "the critic PPO trained in `critic/` (not needed to generate); ") + "`merged/`, when "
         "present, the policy with every adapter folded into plain transformers weights; `ppo_cli.json`, "
         "the run's facts; `manifest.json`, every file's size and checksum.\n"),
        "## Recipe\n",
        "```yaml\n" + recipe_yaml.rstrip("\n") + "\n```\n",
    ]
    return "\n".join(text)


def parse_front_matter(card: str) -> dict:
    """The YAML between the card's opening and closing ``---`` lines."""
    if not card.startswith("---\n"):
        return {}
    head, _, _ = card[4:].partition("\n---\n")
    return yaml.safe_load(head) or {}
