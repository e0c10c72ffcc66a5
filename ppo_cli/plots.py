"""Learning curves of a run as one PNG: RUN_DIR/plots/learning_curves.png.

Seed 003's four panels (mean reward, policy and value loss, KL to the reference, EOS rate) plus clip
fraction and response length; raw points faint, an exponential moving average drawn over them.
matplotlib is optional (``pip install 'ppo_cli[plot]'``) and imported only here, inside
``plot_run``; it draws through the Agg canvas directly, so no GUI backend or pyplot state is touched.
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from pathlib import Path

import yaml

from ppo_cli.errors import PpoError, UsageError
from ppo_cli.metric_names import (
    EOS_RATE, HEALTH_WARNINGS, LOSS_POLICY_AVG, LOSS_VALUE_AVG, OBJECTIVE_KL, OBJECTIVE_RLHF_REWARD, OBJECTIVE_SCORES,
    POLICY_CLIPFRAC_AVG, RESPONSE_LENGTH, REWARD_FAILED_RATE, STEP,
)
from ppo_cli.recipe import MonitorConfig
from ppo_cli.runs import RunDir, temp_file_beside

PLOT_NAME = "learning_curves.png"
MATPLOTLIB_HINT = "pip install 'ppo_cli[plot]'   (or: pip install matplotlib)"


def read_metrics(path: Path) -> list[dict]:
    """The rows of metrics.jsonl; a line cut short by a crash (the last one) is skipped."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def _number(value) -> float:
    """A metric as written by runs.JsonlWriter: NaN is null, infinities are "inf" / "-inf"."""
    if isinstance(value, bool) or value is None:
        return math.nan
    if isinstance(value, (int, float)):
        return float(value)
    if value in ("inf", "-inf"):
        return float(value)
    return math.nan


def series(rows: list[dict], name: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows that have ``name``."""
    pairs = [(float(r[STEP]), _number(r[name])) for r in rows if name in r and STEP in r]
    return [s for s, _ in pairs], [v for _, v in pairs]


def smooth(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: a debiased exponential moving average; NaN/inf points are skipped."""
    out, average, total = [], 0.0, 0.0
    for value in values:
        if math.isfinite(value):
            average = weight * average + (1 - weight) * value
            total = weight * total + (1 - weight)
        out.append(average / total if total > 0 else math.nan)
    return out


def smoothing_weight(points: int) -> float:
    """More smoothing for longer runs: about 10 points' worth of memory per 100 updates, none below 10."""
    return min(0.98, max(0.0, 1.0 - 10.0 / max(points, 1)))


def first_warnings(rows: list[dict]) -> dict[str, int]:
    """Each health rule that fired -> the first update where it was active."""
    first: dict[str, int] = {}
    for row in rows:
        for rule in row.get(HEALTH_WARNINGS) or ():
            first.setdefault(rule, int(row.get(STEP, 0)))
    return first


def _clipfrac_band(run_dir: Path) -> tuple[float, float]:
    defaults = MonitorConfig()
    try:
        monitor = (yaml.safe_load(RunDir(run_dir).recipe.read_text(encoding="utf-8")) or {}).get("monitor") or {}
        return float(monitor.get("clipfrac_low", defaults.clipfrac_low)), float(monitor.get("clipfrac_high", defaults.clipfrac_high))
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError):
        return defaults.clipfrac_low, defaults.clipfrac_high


# (title, y label, [(metric, legend label)], options)
PANELS = (
    ("Mean reward", "score", [(OBJECTIVE_SCORES, "score"), (OBJECTIVE_RLHF_REWARD, "score − β·KL")], {}),
    ("Policy and value loss", "policy loss", [(LOSS_POLICY_AVG, "policy loss")], {"twin": (LOSS_VALUE_AVG, "value loss")}),
    ("KL to the reference", "KL (nats per response)", [(OBJECTIVE_KL, "KL")], {"floor": 0.0}),
    # a run whose rewards can fail (functions, servers, judges) also draws the share left without one
    ("EOS rate", "share of responses", [(EOS_RATE, "EOS rate"), (REWARD_FAILED_RATE, "without a reward")], {"percent": True}),
    ("Clip fraction", "fraction of tokens clipped", [(POLICY_CLIPFRAC_AVG, "clip fraction")], {"band": True, "floor": 0.0}),
    ("Response length", "tokens", [(RESPONSE_LENGTH, "mean length")], {"floor": 0.0}),
)
COLORS = ("tab:blue", "tab:green", "tab:orange", "tab:purple")


def _draw(ax, rows, metric, label, color, weight, linestyle="-"):
    steps, values = series(rows, metric)
    if not steps:
        return None
    ax.plot(steps, values, color=color, alpha=0.3, linewidth=0.8, marker="o", markersize=2.5, linestyle=linestyle)
    (line,) = ax.plot(steps, smooth(values, weight), color=color, linewidth=2.0, label=label, linestyle=linestyle)
    return line


def _panel(ax, rows, title, ylabel, metrics, options, weight, band):
    lines = [_draw(ax, rows, metric, label, COLORS[i], weight, "-" if i == 0 else "--") for i, (metric, label) in enumerate(metrics)]
    if "twin" in options:
        metric, label = options["twin"]
        twin = ax.twinx()
        lines.append(_draw(twin, rows, metric, label, "tab:red", weight))
        twin.set_ylabel(label, color="tab:red")
        twin.tick_params(axis="y", colors="tab:red")
        ax.set_ylabel(ylabel, color=COLORS[0])
        ax.tick_params(axis="y", colors=COLORS[0])
    else:
        ax.set_ylabel(ylabel)
    drawn = [line for line in lines if line is not None]
    if not drawn:
        ax.text(0.5, 0.5, "not in metrics.jsonl", ha="center", va="center", transform=ax.transAxes, color="grey")
    if options.get("percent"):
        from matplotlib.ticker import PercentFormatter

        ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
        ax.set_ylim(-0.05, 1.05)
    elif "floor" in options and drawn:
        ax.set_ylim(bottom=options["floor"])
    if options.get("band") and drawn:
        ax.axhspan(band[0], band[1], color="tab:green", alpha=0.08, label=f"healthy {band[0]:g}–{band[1]:g}")
    ax.set_title(title, fontsize=12, fontweight="bold")
    ax.set_xlabel("update")
    ax.grid(True, alpha=0.3)
    handles = drawn + ([h for h in ax.get_legend_handles_labels()[0] if h not in drawn] if options.get("band") else [])
    if len(handles) > 1:
        ax.legend(handles=handles, labels=[h.get_label() for h in handles], fontsize=9, loc="best")


def plot_run(run_dir: str | Path) -> Path:
    """Draw the learning curves of the run at ``run_dir``; return the PNG's path."""
    run = RunDir(Path(run_dir))
    if not run.path.is_dir():
        raise UsageError(f"run directory not found: {run.path}", hint="give a directory written by `ppo train`, e.g. runs/NAME")
    if not run.metrics.exists():
        raise UsageError(f"{run.path} has no metrics.jsonl", hint="give a directory written by `ppo train`, e.g. runs/NAME")
    rows = [row for row in read_metrics(run.metrics) if STEP in row]
    if not rows:
        raise UsageError(f"{run.metrics} has no updates yet", hint="plot again once training has logged an update")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PpoError("plots need matplotlib, which is not installed", hint=MATPLOTLIB_HINT) from None

    figure = Figure(figsize=(13, 12), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(3, 2)
    weight, band = smoothing_weight(len(rows)), _clipfrac_band(run.path)
    for ax, (title, ylabel, metrics, options) in zip(axes.flat, PANELS):
        _panel(ax, rows, title, ylabel, metrics, options, weight, band)
    warnings = ", ".join(f"{rule} (from update {step})" for rule, step in first_warnings(rows).items())
    subtitle = textwrap.fill(f"health warnings: {warnings}" if warnings else "no health warnings", width=150)
    figure.suptitle(f"{run.path.name}: {len(rows)} updates\n{subtitle}", fontsize=13)

    out = run.plots / PLOT_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_file_beside(out)
    os.close(fd)
    try:
        figure.savefig(tmp, format="png")
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out
