"""Showing things to people with rich: training progress, summaries, eval and compare reports.
Takes plain data only (dicts, lists, numbers, strings)."""

from __future__ import annotations

import contextlib
import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

console = Console(stderr=False, highlight=False)

KEY_METRICS = (
    ("objective/scores", "score", "{:+.2f}"),
    ("eos_rate", "eos", "{:.0%}"),
    ("objective/kl", "kl", "{:.2f}"),
    ("policy/clipfrac_avg", "clip", "{:.2f}"),
    ("loss/value_avg", "vf", "{:.3f}"),
    ("response_length", "len", "{:.1f}"),
)


def metrics_line(metrics: dict) -> str:
    return "  ".join(fmt.format(metrics[key]).join((f"{label} ", "")) for key, label, fmt in KEY_METRICS if key in metrics)


class TrainProgress:
    """A progress bar with ETA and a live line of the key metrics; plain log lines when not a terminal."""

    def __init__(self, total: int, completed: int = 0, log_every: int = 1, enabled: bool = True):
        self.log_every = log_every
        self.enabled = enabled  # off on all but the main process of a multi-process run
        self.interactive = console.is_terminal and enabled
        self.progress = Progress(
            TextColumn("[bold]update"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
            TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[line]}"),
            console=console, disable=not self.interactive,
        )
        self.task = self.progress.add_task("train", total=total, completed=completed, line="")

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        self.progress.__exit__(*exc)

    def update(self, metrics: dict) -> None:
        line = metrics_line(metrics)
        self.progress.update(self.task, completed=metrics["step"], line=line)
        if self.enabled and not self.interactive and metrics["step"] % self.log_every == 0:
            console.print(f"update {metrics['step']}/{self.progress.tasks[0].total}  {line}")
            sys.stdout.flush()

    def note(self, message: str) -> None:
        console.print(message)


def print_train_summary(summary: dict) -> None:
    table = Table(title=f"run {summary['run_dir']}", show_header=True, header_style="bold")
    table.add_column("")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    for label, key, fmt in (("mean score", "score", "{:+.3f}"), ("EOS rate", "eos_rate", "{:.0%}"),
                            ("response length", "response_length", "{:.1f}")):
        before, after = summary.get("before", {}), summary.get("after", {})
        if key in before and key in after:
            table.add_row(label, fmt.format(before[key]), fmt.format(after[key]))
    console.print(table)
    console.print(
        f"{summary['updates']} updates, {summary['episodes']} episodes in {summary['seconds']:.1f} s "
        f"({summary['episodes'] / max(summary['seconds'], 1e-9):.2f} episodes/s), "
        f"peak memory {summary['peak_memory_gb']:.2f} GB"
    )
    console.print(f"final model: {summary['final_dir']}")


# --- rollout / score / eval / compare ------------------------------------------------------------

err_console = Console(stderr=True, highlight=False, soft_wrap=True)  # one note, one line


def note(message: str) -> None:
    """A side remark on stderr (which model, which recipe, skipped lines), so stdout stays the result."""
    err_console.print(Text(message, style="dim"))


@contextlib.contextmanager
def progress_bar(description: str, total: int):
    """Yields ``advance(n)``; draws a bar on stderr when it is a terminal, nothing otherwise."""
    progress = Progress(TextColumn(f"[bold]{description}"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
                        TextColumn("eta"), TimeRemainingColumn(), console=err_console, transient=True,
                        disable=not err_console.is_terminal)
    task = progress.add_task(description, total=total)
    with progress:
        yield lambda n: progress.advance(task, n)


def _signed(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:+.{digits}f}"


def _eos(finished: bool) -> str:
    return "yes" if finished else "no"


def print_rollout(out: str, rows: int, prompts: int, model: str) -> None:
    console.print(f"wrote {rows} rows ({prompts} prompts) from {model} to {out}")


def print_score(out: str, rows: int, mean_reward: float, components: dict[str, float]) -> None:
    parts = ", ".join(f"{name} {_signed(value)}" for name, value in components.items())
    console.print(f"scored {rows} rows: mean reward {_signed(mean_reward, 3)} ({parts}); wrote {out}")


def _metric_rows(summary: dict) -> list[tuple[str, str]]:
    reward = summary["reward"]
    rows = [("mean reward", _signed(reward["mean"], 3)), ("median reward", _signed(reward["median"], 3)),
            ("std reward", f"{reward['std']:.3f}"), ("min / max reward", f"{_signed(reward['min'])} / {_signed(reward['max'])}"),
            ("EOS rate", f"{summary['eos_rate']:.0%}"), ("mean response length", f"{summary['response_length']:.1f} tokens"),
            ("mean KL to reference", "n/a" if summary["kl"] is None else f"{summary['kl']:.3f}"),
            ("distinct-1 / distinct-2", f"{summary['distinct_1']:.3f} / {summary['distinct_2']:.3f}")]
    rows += [(f"  {name}", _signed(value, 3)) for name, value in summary["reward_components"].items()]
    return rows


def print_eval(summary: dict, out: str | None = None) -> None:
    console.print(f"eval: {summary['description']}")
    table = Table(header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, value in _metric_rows(summary):
        table.add_row(label, value)
    console.print(table)
    console.print(f"{summary['num_prompts']} prompts x {summary['num_samples']} sample(s) from {summary['prompts']}, "
                  f"seed {summary['seed']}, recipe {summary['recipe']}")
    if out:
        console.print(f"wrote {out}")


def compare_table(a: dict, b: dict, pairs: list[dict]) -> Table:
    """Seed 003's "Base vs Aligned" table: the prompt, then each model's response, reward and EOS."""
    table = Table(title=f"A = {a['model']}   B = {b['model']}", header_style="bold", show_lines=True,
                  title_justify="left", expand=True)
    table.add_column("prompt", ratio=2, overflow="fold")
    for side, summary in (("A", a), ("B", b)):
        table.add_column(f"{side}: {summary['model']}", ratio=3, overflow="fold")
        table.add_column("reward", justify="right", no_wrap=True)
        table.add_column("EOS", no_wrap=True)
    for pair in pairs:
        table.add_row(Text(pair["prompt"]), Text(pair["a_response"].strip()), _signed(pair["a_reward"]),
                      _eos(pair["a_finished"]), Text(pair["b_response"].strip()), _signed(pair["b_reward"]),
                      _eos(pair["b_finished"]))
    return table


def _summary_rows(a: dict, b: dict, difference: dict) -> list[tuple[str, str, str, str, str]]:
    low, high = difference["ci95"]
    kl = lambda s: "n/a" if s["kl"] is None else f"{s['kl']:.2f}"  # noqa: E731
    return [
        ("mean reward", _signed(a["reward"]["mean"]), _signed(b["reward"]["mean"]),
         _signed(difference["mean_reward_diff"]), f"[{_signed(low)}, {_signed(high)}]"),
        ("win rate of B", "", "", f"{difference['win_rate_b']:.0%}", ""),
        ("EOS rate", f"{a['eos_rate']:.0%}", f"{b['eos_rate']:.0%}", f"{(b['eos_rate'] - a['eos_rate']) * 100:+.0f} pts", ""),
        ("mean length", f"{a['response_length']:.1f}", f"{b['response_length']:.1f}",
         _signed(b["response_length"] - a["response_length"], 1), ""),
        ("mean KL to ref", kl(a), kl(b), "", ""),
        ("distinct-1 / -2", f"{a['distinct_1']:.2f} / {a['distinct_2']:.2f}", f"{b['distinct_1']:.2f} / {b['distinct_2']:.2f}", "", ""),
    ]


def _summary_footnote(a: dict, difference: dict) -> str:
    boot = difference["bootstrap"]
    return (f"{difference['pairs']} pairs ({a['num_prompts']} prompts x {a['num_samples']} sample(s) from {a['prompts']}, "
            f"seed {a['seed']}, recipe {a['recipe']}). Win rate: pairs where B's reward is higher, ties count half. "
            f"95% CI of B - A: paired bootstrap, {boot['resamples']} resamples. Length in tokens; KL summed over "
            f"response tokens (k1).")


def _summary_headers(a: dict, b: dict) -> list[str]:
    return ["", f"A: {a['model']}", f"B: {b['model']}", "B - A", "95% CI"]


def print_compare(a: dict, b: dict, difference: dict, pairs: list[dict], files: list[str] = ()) -> None:
    console.print(compare_table(a, b, pairs))
    table = Table(title="summary", header_style="bold", title_justify="left")
    for name, justify in zip(_summary_headers(a, b), ("left", "right", "right", "right", "left")):
        table.add_column(name, justify=justify)
    for row in _summary_rows(a, b, difference):
        table.add_row(*row)
    console.print(table)
    console.print(f"A: {a['description']}\nB: {b['description']}\n{_summary_footnote(a, difference)}")
    for path in files:
        console.print(f"wrote {path}")


def _md(text: str) -> str:
    """A table cell: pipes escaped, line breaks as <br>."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r\n", "\n").replace("\n", "<br>") or " "


def compare_markdown(a: dict, b: dict, difference: dict, pairs: list[dict]) -> str:
    """The compare report as Markdown: the summary, then the side-by-side rows."""
    lines = [f"# {a['model']} vs {b['model']}", "",
             f"- A: {_md(a['description'])}", f"- B: {_md(b['description'])}",
             "", "## Summary", "",
             f"| {' | '.join(_md(h) for h in _summary_headers(a, b))} |", "| --- | ---: | ---: | ---: | --- |"]
    lines += [f"| {' | '.join(_md(cell) for cell in row)} |" for row in _summary_rows(a, b, difference)]
    lines += ["", _summary_footnote(a, difference)]
    lines += ["", "## Responses", "",
              f"| Prompt | A: {_md(a['model'])} | reward | EOS | B: {_md(b['model'])} | reward | EOS |",
              "| --- | --- | ---: | --- | --- | ---: | --- |"]
    for p in pairs:
        cells = [p["prompt"], p["a_response"].strip(), _signed(p["a_reward"]), _eos(p["a_finished"]),
                 p["b_response"].strip(), _signed(p["b_reward"]), _eos(p["b_finished"])]
        lines.append(f"| {' | '.join(_md(cell) for cell in cells)} |")
    return "\n".join(lines) + "\n"
