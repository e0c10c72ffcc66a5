"""Showing things to people with rich: training progress, summaries, eval and compare reports.
Takes plain data only (dicts, lists, numbers, strings)."""

from __future__ import annotations

import contextlib
import math
import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from ppo_cli.metric_names import (
    EOS_RATE, HELD_OUT_EOS_RATE, HELD_OUT_KL, HELD_OUT_RESPONSE_LENGTH, HELD_OUT_SCORE, LOSS_VALUE_AVG, OBJECTIVE_KL,
    OBJECTIVE_SCORES, POLICY_CLIPFRAC_AVG, RESPONSE_LENGTH, REWARD_FAILED_RATE, STEP,
)

console = Console(stderr=False, highlight=False)

KEY_METRICS = (
    (OBJECTIVE_SCORES, "score", "{:+.2f}"),
    (EOS_RATE, "eos", "{:.0%}"),
    (OBJECTIVE_KL, "kl", "{:.2f}"),
    (POLICY_CLIPFRAC_AVG, "clip", "{:.2f}"),
    (LOSS_VALUE_AVG, "vf", "{:.3f}"),
    (RESPONSE_LENGTH, "len", "{:.1f}"),
)


def metrics_line(metrics: dict) -> str:
    """The progress line's key metrics; a metric the run does not measure (the KL without a reference
    forward, kl_coef 0: NaN in metrics.jsonl) is left out rather than shown as nan."""
    line = "  ".join(fmt.format(metrics[key]).join((f"{label} ", "")) for key, label, fmt in KEY_METRICS
                     if key in metrics and not (isinstance(metrics[key], float) and math.isnan(metrics[key])))
    if metrics.get(REWARD_FAILED_RATE):  # episodes without a reward left the update
        line += f"  no reward {metrics[REWARD_FAILED_RATE]:.0%}"
    return line


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
        self.progress.update(self.task, completed=metrics[STEP], line=line)
        if not self.interactive and metrics[STEP] % self.log_every == 0:
            console.print(f"update {metrics[STEP]}/{self.progress.tasks[0].total}  {line}")
            sys.stdout.flush()


class TrainScreen:
    """`ppo train`'s screen: called as ``show(what, data)`` by the run (commands/train.py's Show);
    draws the loading line, the progress bar with its metrics line, health warnings and notes."""

    def __init__(self):
        self.progress: TrainProgress | None = None

    def __call__(self, what: str, data: dict) -> None:
        if what == "loading":
            choices = "; ".join(data[k] for k in ("precision", "checkpointing") if data.get(k))
            console.print(f"loading models for [bold]{data['name']}[/] ({choices}) ...", soft_wrap=True)
        elif what == "resumed":
            console.print(f"resumed from {data['checkpoint']} at update {data['step']}", soft_wrap=True)
            if data.get("changes"):
                console.print("with recipe changes: " + "; ".join(data["changes"]), soft_wrap=True)
        elif what == "start":
            self.progress = TrainProgress(data["total"], data["step"], data["log_every"]).__enter__()
        elif what == "update" and self.progress is not None:
            self.progress.update(data)
        elif what == "warning":
            print_health_warning(data)
        elif what == "note":
            note(data["message"])
        elif what == "end" and self.progress is not None:
            self.progress, progress = None, self.progress
            progress.__exit__(None, None, None)


def print_health_warning(warning: dict) -> None:
    """A health warning (monitor.HealthWarning as a dict): what is seen, the likely cause, the fix.
    A reminder of one still active repeats the message and the fix only."""
    reminder = warning["since"] != warning["step"]
    when = f"update {warning['step']}" + (f" (active since update {warning['since']})" if reminder else "")
    lines = [Text.assemble(("warning", "bold yellow"), f" {when}: ", warning["message"], (f"  [{warning['rule']}]", "dim"))]
    if not reminder:
        lines.append(Text.assemble(("  likely cause: ", "bold"), warning["cause"]))
    lines.append(Text.assemble(("  fix: ", "bold"), warning["fix"]))
    for line in lines:
        console.print(line, soft_wrap=True)  # one line each in a log file; the terminal wraps


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s" if minutes else f"{seconds:.1f} s"


def _before_after(summary: dict):
    before, after = summary.get("before") or {}, summary.get("after") or {}
    if not before or not after:
        return Text("no held-out prompts: set data.eval_prompts for a before/after comparison", style="dim")
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False, title="held-out prompts",
                  title_justify="left", title_style="bold")
    for name, justify in (("", "left"), ("before", "right"), ("after", "right"), ("change", "right")):
        table.add_column(name, justify=justify)
    for label, key, fmt, change in (("mean reward", HELD_OUT_SCORE, "{:+.3f}", "{:+.3f}"),
                                    ("EOS rate", HELD_OUT_EOS_RATE, "{:.0%}", "{:+.0%}"),
                                    ("response length", HELD_OUT_RESPONSE_LENGTH, "{:.1f}", "{:+.1f}"),
                                    ("KL to reference", HELD_OUT_KL, "{:.3f}", "{:+.3f}")):
        if key in before and key in after:
            table.add_row(label, fmt.format(before[key]), fmt.format(after[key]), change.format(after[key] - before[key]))
    if min(before.get(HELD_OUT_KL, 0.0), after.get(HELD_OUT_KL, 0.0)) < 0:
        from rich.console import Group

        return Group(table, Text(KL_BELOW_ZERO.replace("mean KL", "the held-out KL", 1), style="dim"))
    return table


def no_warnings_line(updates: int, window: int | None) -> str:
    """What "no health warnings" means after ``updates`` updates, when the rules wait for a full
    ``window`` (monitor.py; None: the monitor was off)."""
    if window is None:
        return "no health checks (monitor.enabled: false)"
    if updates < window:
        return (f"no health warnings, but most rules wait for {window} updates (monitor.window) and this run had "
                f"{updates}: only the ratio and failed-reward checks ran")
    return "no health warnings"


def _warnings_block(warnings: list[dict], updates: int, window: int | None):
    if not warnings:
        return Text(no_warnings_line(updates, window), style="green" if window is not None and updates >= window else "dim")
    table = Table(show_header=False, box=None, pad_edge=False, title=f"health warnings ({len(warnings)})",
                  title_justify="left", title_style="bold yellow")
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")
    for w in warnings:
        span = f"updates {w['first_step']}-{w['last_step']}" if w["last_step"] != w["first_step"] else f"update {w['first_step']}"
        state = ", still active at the end" if w["active_at_end"] else ""
        table.add_row(Text(w["rule"], style="yellow"), Text.assemble(f"{span}{state}: ", w["message"], ("\nfix: ", "bold"), w["fix"]))
    return table


def _peak_phase(summary: dict) -> str:
    """' (in the update)': the phase that held the most, where it was measured (CUDA)."""
    by_phase = summary.get("peak_memory_gb_by_phase")
    return f" (in the {max(by_phase, key=by_phase.get)})" if by_phase else ""


def print_train_summary(summary: dict) -> None:
    """The end of `ppo train`: held-out before/after, time and throughput, warnings, files."""
    from rich.console import Group
    from rich.panel import Panel

    episodes_per_s = summary.get("episodes_per_s", summary["episodes"] / max(summary["seconds"], 1e-9))
    throughput = Text(
        f"{summary['updates']} update{'s' * (summary['updates'] != 1)} · {summary['episodes']} episodes in {_duration(summary['seconds'])} · "
        f"{episodes_per_s:.2f} episodes/s · peak memory {summary['peak_memory_gb']:.2f} GB{_peak_phase(summary)}"
    )
    files = Table(show_header=False, box=None, pad_edge=False, title="files", title_justify="left", title_style="bold")
    files.add_column(style="dim", no_wrap=True)
    files.add_column(overflow="fold")
    for name, path in (summary.get("files") or {"final model": summary["final_dir"]}).items():
        files.add_row(name, path)
    body = Group(_before_after(summary), Text(""), throughput, Text(""), _warnings_block(summary.get("warnings") or [], summary["updates"], summary.get("health_window", 10)),
                 Text(""), files)
    console.print(Panel(body, title=f"[bold]run {summary['run_dir']}[/]", title_align="left", expand=False))


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


# The label of episodes' own step rewards beside the reward components (no function name has a space).
STEP_REWARDS = "environment steps"


def _number(value: float | None, spec: str) -> str:
    """``value`` formatted by ``spec``; n/a for None or nan (nothing to average: no row had one)."""
    return "n/a" if value is None or math.isnan(value) else format(value, spec)


def _signed(value: float | None, digits: int = 2) -> str:
    return _number(value, f"+.{digits}f")


def _eos(finished: bool) -> str:
    return "yes" if finished else "no"


def _say(message: str) -> None:
    """One plain line on stdout: no markup (paths and prompts may hold '[...]'), never wrapped."""
    console.print(Text(message), soft_wrap=True)


def print_rollout(out: str, rows: int, prompts: int, model: str, env_failed: int = 0,
                  env_failure: str | None = None) -> None:
    _say(f"wrote {rows} rows ({prompts} prompts) from {model} to {out}")
    if env_failed:
        _say(env_failure_line(env_failed, rows, env_failure))


def env_failure_line(failed: int, episodes: int, first: str | None) -> str:
    """Episodes of several turns whose environment failed (no reward; training leaves them out of the
    update), with the first one's failure: otherwise only a rate says so."""
    return (f"note: the environment failed in {failed} of {episodes} episodes (env_failed: no reward)"
            + (f"; the first: {first}" if first else ""))


def _summary_env_failures(summary: dict) -> str:
    """env_failure_line for an eval summary (evaluation.py's), over all its episodes."""
    return env_failure_line(summary["env_failed"], summary["num_prompts"] * summary["num_samples"], summary.get("env_failure"))


def print_score(out: str, rows: int, mean_reward: float, components: dict[str, float], failed: int = 0,
                failure: str | None = None, weights: dict[str, float] | None = None,
                covered: dict[str, int] | None = None) -> None:
    """``components``: each one's mean before its weight, over the rows it scored; ``weights``: those not 1,
    shown beside them; ``covered``: how many rows the components that skipped some (a function's None) scored."""
    weights, covered = weights or {}, covered or {}
    parts = ", ".join(f"{name} {_signed(value)}" + (f" x {weights[name]:g}" if name in weights else "")
                      + (f" on {covered[name]} of {rows} rows" if name in covered else "")
                      for name, value in components.items())
    unscored = f"; {failed} row{'s' * (failed != 1)} without a reward (null{f': {failure}' if failure else ''})" if failed else ""
    _say(f"scored {rows} rows: mean reward {_signed(mean_reward, 3)} ({parts}){unscored}; wrote {out}")


def _metric_rows(summary: dict) -> list[tuple[str, str]]:
    reward = summary["reward"]
    rows = [("mean reward", _signed(reward["mean"], 3)), ("median reward", _signed(reward["median"], 3)),
            ("std reward", _number(reward["std"], ".3f")), ("min / max reward", f"{_signed(reward['min'])} / {_signed(reward['max'])}"),
            ("EOS rate", f"{summary['eos_rate']:.0%}"), ("mean response length", f"{summary['response_length']:.1f} tokens"),
            ("mean KL to reference", "n/a" if summary["kl"] is None else f"{summary['kl']:.3f}"),
            ("distinct-1 / distinct-2", f"{summary['distinct_1']:.3f} / {summary['distinct_2']:.3f}")]
    rows += [(f"  {name}", _signed(value, 3)) for name, value in summary["reward_components"].items()]
    if "step_reward" in summary:  # the episodes' reward adds their steps' (the mean reward's other part)
        rows.append((f"  {STEP_REWARDS}", _signed(summary["step_reward"], 3)))
    if "turns" in summary:  # episodes of several turns
        rows += [("mean turns", f"{summary['turns']:.2f}"), ("tool-call rate", f"{summary['tool_call_rate']:.0%}")]
        if summary.get("tool_error_rate") is not None:
            rows.append(("  calls answered with an error", f"{summary['tool_error_rate']:.0%}"))
        rows.append(("environment failed", f"{summary['env_failed_rate']:.0%}"))
        rows += [(f"  ended by {reason}", f"{share:.0%}") for reason, share in summary["ended_by"].items() if share]
    if summary.get("reward_failed"):
        rows.append(("rows without a reward", str(summary["reward_failed"])))
    return rows


# The sampled-token estimate (k1: log p - log p_ref per token, summed) is unbiased but not each sample's
# true KL, so a mean over few samples of a policy close to its reference can fall below zero.
KL_BELOW_ZERO = ("mean KL to reference is below zero: it is estimated from the sampled tokens (log p - log p_ref), "
                 "which is unbiased but noisy; a small negative value means the model is close to the reference")


def print_eval(summary: dict, out: str | None = None, replaced: bool = False) -> None:
    _say(f"eval: {summary['description']}")
    table = Table(header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, value in _metric_rows(summary):
        table.add_row(Text(label), Text(value))
    console.print(table)
    _say(f"{summary['num_prompts']} prompts x {summary['num_samples']} sample(s) from {summary['prompts']}, "
         f"seed {summary['seed']}, recipe {summary['recipe']}")
    if summary["kl"] is not None and summary["kl"] < 0:
        _say(KL_BELOW_ZERO)
    if summary.get("env_failed"):
        _say(_summary_env_failures(summary))
    if out:
        _say(f"wrote {out}" + (" (replacing the previous file)" if replaced else ""))


def prompt_text(prompt) -> str:
    """A prompt for people: the text, or a conversation as 'role: content' lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def compare_table(a: dict, b: dict, pairs: list[dict]) -> Table:
    """Seed 003's "Base vs Aligned" table: the prompt, then each model's response, reward and EOS."""
    table = Table(title=Text(f"A = {a['model']}   B = {b['model']}"), header_style="bold", show_lines=True,
                  title_justify="left", expand=True)
    table.add_column("prompt", ratio=2, overflow="fold")
    for side, summary in (("A", a), ("B", b)):
        table.add_column(Text(f"{side}: {summary['model']}"), ratio=3, overflow="fold")
        table.add_column("reward", justify="right", no_wrap=True)
        table.add_column("EOS", no_wrap=True)
    for pair in pairs:
        table.add_row(Text(prompt_text(pair["prompt"])), Text(_shown_response(pair, "a")), _signed(pair["a_reward"]),
                      _eos(pair["a_finished"]), Text(_shown_response(pair, "b")), _signed(pair["b_reward"]),
                      _eos(pair["b_finished"]))
    return table


def _shown_response(pair: dict, side: str) -> str:
    """The response as the table shows it: an episode of several turns as its final answer and its turn and
    tool-call counts (the whole transcript is in the JSON file)."""
    text = pair[f"{side}_response"].strip()
    if f"{side}_turns" not in pair:
        return text
    turns, calls = pair[f"{side}_turns"], pair[f"{side}_tool_calls"]
    return f"{text}\n[{turns} turn{'s' * (turns != 1)}, {calls} tool call{'s' * (calls != 1)}]"



def _summary_rows(a: dict, b: dict, difference: dict) -> list[tuple[str, str, str, str, str]]:
    low, high = difference["ci95"]
    kl = lambda s: "n/a" if s["kl"] is None else f"{s['kl']:.2f}"  # noqa: E731
    return [
        ("mean reward", _signed(a["reward"]["mean"]), _signed(b["reward"]["mean"]),
         _signed(difference["mean_reward_diff"]), f"[{_signed(low)}, {_signed(high)}]"),
        ("win rate of B", "", "", _number(difference["win_rate_b"], ".0%"), ""),
        ("EOS rate", f"{a['eos_rate']:.0%}", f"{b['eos_rate']:.0%}", f"{(b['eos_rate'] - a['eos_rate']) * 100:+.0f} pts", ""),
        ("mean length", f"{a['response_length']:.1f}", f"{b['response_length']:.1f}",
         _signed(b["response_length"] - a["response_length"], 1), ""),
        ("mean KL to ref", kl(a), kl(b), "", ""),
        ("distinct-1 / -2", f"{a['distinct_1']:.2f} / {a['distinct_2']:.2f}", f"{b['distinct_1']:.2f} / {b['distinct_2']:.2f}", "", ""),
    ] + ([("mean turns", f"{a['turns']:.2f}", f"{b['turns']:.2f}", _signed(b["turns"] - a["turns"], 2), ""),
          ("tool-call rate", f"{a['tool_call_rate']:.0%}", f"{b['tool_call_rate']:.0%}",
           f"{(b['tool_call_rate'] - a['tool_call_rate']) * 100:+.0f} pts", "")] if "turns" in a and "turns" in b else []) + (
        [("  calls with an error", _share(a.get("tool_error_rate")), _share(b.get("tool_error_rate")), "", "")]
        if a.get("tool_error_rate") is not None or b.get("tool_error_rate") is not None else []) + (
        [("environment failed", f"{a['env_failed_rate']:.0%}", f"{b['env_failed_rate']:.0%}", "", "")]
        if a.get("env_failed") or b.get("env_failed") else [])


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


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
        table.add_column(Text(name), justify=justify)
    for row in _summary_rows(a, b, difference):
        table.add_row(*map(Text, row))
    console.print(table)
    _say(f"A: {a['description']}")
    _say(f"B: {b['description']}")
    console.print(Text(_summary_footnote(a, difference), style="dim"))
    if any(s["kl"] is not None and s["kl"] < 0 for s in (a, b)):
        _say(KL_BELOW_ZERO)
    for side, s in (("A", a), ("B", b)):
        if s.get("env_failed"):
            _say(f"{side}: " + _summary_env_failures(s))
    for path in files:
        _say(f"wrote {path}")


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
        cells = [prompt_text(p["prompt"]), p["a_response"].strip(), _signed(p["a_reward"]), _eos(p["a_finished"]),
                 p["b_response"].strip(), _signed(p["b_reward"]), _eos(p["b_finished"])]
        lines.append(f"| {' | '.join(_md(cell) for cell in cells)} |")
    return "\n".join(lines) + "\n"
