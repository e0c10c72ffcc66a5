"""`ppo plan`: the memory a recipe needs (ppo_cli/plan_memory.py's arithmetic), against a budget, as a table
with the changes that would make it fit.

Importing this module does not import torch; ``run()`` does (for the meta-device models).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from ppo_cli.plan_memory import (
    GB,
    Estimate,
    Settings,
    Suggestion,
    model_shapes,
    settings_from_recipe,
    suggestions,
    total_estimate,
)
from ppo_cli.plan_checkpointing import CheckpointingChoice, choose_gradient_checkpointing
from ppo_cli.recipe import Recipe

# --- the command ----------------------------------------------------------------------------------


@dataclass
class PlanResult:
    settings: Settings
    estimate: Estimate
    budget_gb: float | None
    budget_source: str | None
    suggestions: list[Suggestion] = field(default_factory=list)
    prompt_note: str = ""
    precision: str = ""  # how train.mixed_precision resolves (PrecisionChoice.describe)
    checkpointing: str = ""  # how train.gradient_checkpointing resolves (CheckpointingChoice.describe)
    filter_note: str = ""  # ppo.filter_groups: the extra rounds' time and memory (filter_rounds_note)

    @property
    def fits(self) -> bool | None:
        return None if self.budget_gb is None else self.estimate.total_gb <= self.budget_gb


def prompt_tokens(recipe: Recipe, limit: int = 2000) -> tuple[int, str]:
    """The longest prompt in tokens (at most max_prompt_tokens); the tokenizer is light to load."""
    maximum = recipe.data.max_prompt_tokens
    try:
        from ppo_cli.engine.chat import prompt_lengths
        from ppo_cli.engine.data import read_recipe_prompts
        from ppo_cli.engine.models import load_tokenizer

        prompts = read_recipe_prompts(recipe.data).prompts[:limit]
        tokenizer = load_tokenizer(recipe.policy.path, trust_remote_code=recipe.policy.trust_remote_code,
                                   revision=recipe.policy.revision)
        longest = max(prompt_lengths(prompts, tokenizer, recipe.data))
        if longest > maximum:  # the longest prompts are cut to it: say so, not only the bound
            return maximum, f"longest of {len(prompts)} prompts {longest}, cut to max_prompt_tokens {maximum}"
        return longest, f"longest of {len(prompts)} prompts, max_prompt_tokens {maximum}"
    except Exception:  # noqa: BLE001 - the bound is a safe fallback
        return maximum, "data.max_prompt_tokens (prompts not read)"


def filter_rounds_note(recipe: Recipe) -> str:
    """ppo.filter_groups' extra sampling rounds: time, up to 1 + max_filter_rounds rollouts per update; memory,
    none beyond one rollout's (each round's rollout is let go once its kept groups are copied out, and at most
    rollout_batch_size groups are kept). Empty without filter_groups."""
    ppo = recipe.ppo
    if not ppo.filter_groups:
        return ""
    rounds = 1 + ppo.max_filter_rounds
    return (f"ppo.filter_groups: 1 to {rounds} rollouts per update (at most {rounds} x {recipe.episodes_per_update} "
            f"episodes sampled and scored, {rounds} x the rollout's time); memory as one rollout: a round is let go "
            "once its kept groups are copied, and at most rollout_batch_size groups are kept")


def check_sharding(processes: int, sharding: str) -> None:
    """--num-processes / --sharding: one line naming the problem and the fix."""
    from ppo_cli.errors import UsageError
    from ppo_cli.plan_memory import SHARDING

    if processes < 1:
        raise UsageError(f"--num-processes must be at least 1, got {processes}", hint="give the number of GPUs, e.g. --num-processes 4")
    if sharding not in SHARDING:
        raise UsageError(f"unknown --sharding '{sharding}'", hint=f"use one of: {', '.join(SHARDING)}")
    if sharding != "none" and processes == 1:
        raise UsageError(f"--sharding {sharding} splits memory across processes, and there is one",
                         hint=f"add --num-processes N (N > 1), e.g. --num-processes 4 --sharding {sharding}")


def run(recipe: Recipe, gpu_memory_gb: float | None = None, device: str | None = None, processes: int = 1,
        sharding: str = "none") -> PlanResult:
    """The memory plan of ``recipe`` per process (of ``processes``, sharded as ``sharding`` says);
    against ``gpu_memory_gb`` (else the local GPU's memory, if any)."""
    import dataclasses

    import torch

    check_sharding(processes, sharding)

    budget, source = gpu_memory_gb, "--gpu-memory" if gpu_memory_gb is not None else None
    if device is None:
        wants_cuda = recipe.train.device == "cuda" or (recipe.train.device == "auto" and torch.cuda.is_available())
        device = "cuda" if gpu_memory_gb is not None or wants_cuda else "cpu"
    if budget is None and device == "cuda" and torch.cuda.is_available():
        budget, source = torch.cuda.get_device_properties(0).total_memory / GB, torch.cuda.get_device_name(0)
    prompt_len, note = prompt_tokens(recipe)
    settings = settings_from_recipe(recipe, device, prompt_len)
    precision = planned_precision(recipe, device, getattr(torch, settings.dtype))
    settings = dataclasses.replace(settings, mixed_precision=precision.value, processes=processes, sharding=sharding)
    shapes = model_shapes(recipe)
    memory, memory_source = (budget, source) if budget is not None else device_memory_gb(device)
    checkpointing = choose_gradient_checkpointing(recipe.train.gradient_checkpointing,
                                                  total_estimate(settings, shapes).lines, memory, memory_source)
    settings = dataclasses.replace(settings, gradient_checkpointing=checkpointing.value)
    result = PlanResult(settings, total_estimate(settings, shapes), budget, source, prompt_note=note,
                        precision=precision.describe(), checkpointing=checkpointing.describe(),
                        filter_note=filter_rounds_note(recipe))
    if budget is not None and not result.fits:
        result.suggestions = suggestions(settings, shapes, budget)
    return result


@dataclass(frozen=True)
class RunChoices:
    """What `ppo train` takes from the memory plan before it loads a model."""

    checkpointing: CheckpointingChoice  # train.gradient_checkpointing resolved
    heap_tuning: bool  # CPU: engine/malloc.tune_for_training (EngineOptions.cpu_malloc_tuning)
    heap_reason: str  # e.g. 'heap tuning on (planned 1.46 GB + 10% <= 80% of 22.0 GB available)'; '' off CPU

    def describe(self) -> str:
        return self.checkpointing.describe() + (f"; {self.heap_reason}" if self.heap_reason else "")


def planned_choices(recipe: Recipe, device: str, mixed_precision: str) -> RunChoices:
    """train.gradient_checkpointing and the CPU heap tuning as a run on ``device`` with ``mixed_precision``
    (resolved) takes them, from this plan against the device's memory: checkpointing true/false as
    written, auto by plan_checkpointing.py's rule over the plan made with it off; the heap tuning by
    engine/malloc.tuning_fits over the plan's peak as the run will compute. Reads the configs and the
    prompts, loads no weights (a plan that cannot be made leaves checkpointing off and the heap alone)."""
    import dataclasses

    from ppo_cli.engine.malloc import tuning_fits

    setting = recipe.train.gradient_checkpointing
    try:
        prompt_len, _ = prompt_tokens(recipe)
        settings = settings_from_recipe(recipe, device, prompt_len, mixed_precision)
        shapes = model_shapes(recipe)
    except Exception as err:  # noqa: BLE001 - the load reports a bad model itself, with its own message
        reason = f"no plan: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
        return RunChoices(CheckpointingChoice(setting, setting is True, reason), False,
                          "heap tuning off (no plan)" if device == "cpu" else "")
    memory, source = device_memory_gb(device)
    checkpointing = choose_gradient_checkpointing(setting, total_estimate(settings, shapes).lines, memory, source)
    planned = total_estimate(dataclasses.replace(settings, gradient_checkpointing=checkpointing.value), shapes)
    if device != "cpu":
        return RunChoices(checkpointing, True, "")
    if settings.cpu_heap_mapped and checkpointing.value:  # engine/malloc.heap_mapped: nothing kept, no memory to agree to
        return RunChoices(checkpointing, True, "heap: blocks of 2 MiB or more mapped on huge pages, freed at once")
    on, why = tuning_fits(planned.total_gb, memory)
    return RunChoices(checkpointing, on, why)


def device_memory_gb(device: str) -> tuple[float | None, str]:
    """(GB, where from) the run may use: the first GPU's memory; on CPU what the kernel says is available
    now (MemAvailable: free memory and reclaimable caches); (None, '') where it cannot be read."""
    if device == "cuda":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / GB, torch.cuda.get_device_name(0)
        return None, ""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024 / GB, "available memory"
    except (OSError, KeyError, ValueError):
        return None, ""


def planned_precision(recipe: Recipe, device: str, weights_dtype):
    """train.mixed_precision as a run on ``device`` would resolve it (engine/precision.py's rule): measured
    on this machine's CPU or GPU; a plan for a GPU on a machine without one assumes it supports bf16."""
    import torch

    from ppo_cli.engine.precision import choose_mixed_precision, probe_widths, resolve_mixed_precision

    setting = recipe.train.mixed_precision
    if device == "cuda" and not torch.cuda.is_available():
        return choose_mixed_precision(setting, "cuda", weights_dtype, cuda_bf16=True)
    here = torch.device(device)
    return resolve_mixed_precision(setting, here, weights_dtype, widths=probe_widths(recipe, here))


def set_args(overrides) -> list[str]:
    """``--set KEY=VALUE`` arguments for a command line (shlex.join quotes them)."""
    return [arg for override in overrides for arg in ("--set", override)]


def render(result: PlanResult):
    """A rich renderable: the table of parts, the total, and what would make it fit."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    s, est = result.settings, result.estimate
    per_process = f"per process of {s.processes}, {'DDP' if s.sharding == 'none' else s.sharding}, " if s.processes > 1 else ""
    table = Table(title=f"memory plan ({per_process}{s.device}, policy {s.dtype}"
                  f"{', ' + s.quantization if s.quantization != 'none' else ''}"
                  f"{', LoRA r=' + str(s.lora.r) if s.lora else ', full fine-tuning'}, value {s.value_kind})",
                  title_justify="left")
    for column, justify in (("role", "left"), ("part", "left"), ("GB", "right"), ("how", "left")):
        table.add_column(column, justify=justify)
    for line in est.lines:
        table.add_row(line.role, line.part, f"{line.gb:.3f}", line.how)
    parts = [
        table,
        Text(f"micro-batch {s.micro_batch} x ({s.prompt_tokens} prompt tokens [{result.prompt_note}] + "
             f"{s.response_tokens} response tokens); rollout batch {s.rollout_batch}"),
        *([Text(result.precision)] if result.precision else []),
        *([Text(result.checkpointing)] if result.checkpointing else []),
        *([Text(result.filter_note)] if result.filter_note else []),
        Text(f"peak = static {est.static_gb:.2f} GB + max(update {est.update_gb:.2f}, rollout {est.rollout_gb:.2f}) "
             f"= {est.total_gb:.2f} GB", style="bold"),
    ]
    if result.budget_gb is not None:
        verdict = "fits" if result.fits else "does NOT fit"
        parts.append(Text(f"{verdict} in {result.budget_gb:.1f} GB ({result.budget_source})",
                          style="green" if result.fits else "bold red"))
    if result.suggestions:
        fixes = Table(title="changes that would help", title_justify="left")
        for column in ("change", "--set", "total GB", "fits"):
            fixes.add_column(column, overflow="fold")  # wrapped, never cut: the overrides are for copying
        for sug in result.suggestions:
            sets = shlex.join(set_args(sug.overrides))
            fixes.add_row(sug.change, sets, f"{sug.total_gb:.2f}", "yes" if sug.fits else "no")
        parts.append(fixes)
    return Group(*parts)
