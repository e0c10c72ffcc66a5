"""`ppo validate`: the resolved recipe and the sizes derived from it. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ppo_cli.recipe import Recipe, dump_resolved


@dataclass(frozen=True)
class ValidateResult:
    resolved_yaml: str  # every default filled in; what `ppo train` writes to runs/<name>/recipe.yaml
    run_dir: Path
    num_mini_batches: int  # optimizer steps per PPO epoch
    grad_accum_steps: int  # micro-batches per optimizer step
    value_kind: str  # 'auto' resolved: adapter / head / model

    @property
    def summary(self) -> str:
        return (
            f"valid: run directory {self.run_dir}; num_mini_batches={self.num_mini_batches}, "
            f"grad_accum_steps={self.grad_accum_steps}, value kind={self.value_kind}"
        )


def run(recipe: Recipe) -> ValidateResult:
    return ValidateResult(
        resolved_yaml=dump_resolved(recipe),
        run_dir=recipe.run_dir,
        num_mini_batches=recipe.ppo.num_mini_batches,
        grad_accum_steps=recipe.ppo.grad_accum_steps,
        value_kind=recipe.value_kind,
    )
