"""train.gradient_checkpointing auto: on or off from the memory plan (plan_memory.py), and why.

Gradient checkpointing keeps each decoder layer's input instead of its activations and recomputes the
layer in the backward: the same numbers for one more forward per update. It pays where the
activations are what the update's peak is made of, and is needed where they would not fit. The rule
reads the plan made with checkpointing off:

    on   the peak does not fit the device's memory (a GPU's; on CPU the memory available at start)
    on   the activations (with the freed heap they leave resident on CPU) are the largest single term
         of the update's peak: weights, adapters, gradients, optimizer states, logits, the process
    off  otherwise: the activations are small beside something checkpointing cannot shrink, and the
         extra forward would cost time for little memory (the tiny test models: the process's own
         0.45 GB is larger than anything they compute)

Imports no torch: plain data in, a choice out.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppo_cli.plan_units import Line

# The plan's lines that grow with the activations checkpointing removes: each role's update activations,
# peft's float32 copies of a half-precision base's inputs and, on CPU, the freed heap the activations
# leave resident (plan_memory.CPU_HEAP_RETENTION x activations).
ACTIVATION_PARTS = ("activations (update)", "LoRA input casts (update)", "freed memory kept (update)")


@dataclass(frozen=True)
class CheckpointingChoice:
    """train.gradient_checkpointing resolved: ``value`` for ``setting`` ('auto', True or False), and why."""

    setting: str | bool
    value: bool
    reason: str = ""  # why 'auto' became ``value`` ('' for an explicit setting)

    def describe(self) -> str:
        """e.g. 'gradient checkpointing auto -> on (without it the update's activations would be 4.67 GB, its largest term; ...)'."""
        state = "on" if self.value else "off"
        if self.setting != "auto":
            return f"gradient checkpointing {state}"
        return f"gradient checkpointing auto -> {state}" + (f" ({self.reason})" if self.reason else "")


def choose_gradient_checkpointing(setting: str | bool, lines: list[Line], budget_gb: float | None,
                                  budget_source: str = "") -> CheckpointingChoice:
    """The rule for ``setting`` over the plan's ``lines`` made with checkpointing off (Estimate.lines);
    ``budget_gb``: the device's memory (None: not known, the fit is not judged)."""
    if setting != "auto":
        return CheckpointingChoice(setting, bool(setting))
    peak = [l for l in lines if l.phase in ("static", "runtime", "update")]
    static = sum(l.gb for l in lines if l.phase in ("static", "runtime"))
    update = sum(l.gb for l in lines if l.phase == "update")
    rollout = sum(l.gb for l in lines if l.phase == "rollout")
    activations = sum(l.gb for l in peak if l.part in ACTIVATION_PARTS)
    others = [l for l in peak if l.part not in ACTIVATION_PARTS]
    largest = max(others, key=lambda l: l.gb, default=None)
    total = static + max(update, rollout)
    where = f" ({budget_source})" if budget_source else ""
    if budget_gb is not None and total > budget_gb:
        return CheckpointingChoice(setting, True, f"the plan's peak without it, {total:.2f} GB, does not fit "
                                                  f"{budget_gb:.1f} GB{where}")
    other = f"{largest.role} {largest.part} {largest.gb:.2f} GB" if largest is not None else "nothing else"
    if activations > 0 and (largest is None or activations > largest.gb):
        return CheckpointingChoice(setting, True, f"without it the update's activations would be {activations:.2f} GB, "
                                                  f"its largest term; next: {other}")
    fits = f"; {total:.2f} GB fits {budget_gb:.1f} GB{where}" if budget_gb is not None else ""
    return CheckpointingChoice(setting, False, f"the update's activations, {activations:.2f} GB, are below "
                                               f"{other}{fits}")
