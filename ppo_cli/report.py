"""Showing things to people with rich: training progress, summaries. Takes plain data only."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

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

    def __init__(self, total: int, completed: int = 0, log_every: int = 1):
        self.log_every = log_every
        self.interactive = console.is_terminal
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
        if not self.interactive and metrics["step"] % self.log_every == 0:
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
