"""What `ppo train` does with each update's metrics besides training on: health warnings, trackers,
and at the end the learning-curve plot and the summary's warnings and file list.

    observer = RunObserver(recipe, run_dir, resumed_at=state.step, show=show)   # main process only
    observer.observe(metrics, step)   # shows new warnings; adds metrics["health/warnings"]
    observer.log(metrics, step)       # TensorBoard / accelerate trackers, on metrics.jsonl's schedule
    observer.close()
    summary.update(observer.finish(summary))   # plot + warnings + files, for summary.json

Nothing is printed here: warnings and notes go to ``show`` (commands/train.py's Show), as
show("warning", HealthWarning as a dict) and show("note", {"message": ...}). No torch: the engine's
numbers arrive here as plain floats.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Callable

from ppo_cli.errors import PpoError
from ppo_cli.metric_names import HEALTH_WARNINGS, STEP
from ppo_cli.monitor import HealthMonitor
from ppo_cli.plots import plot_run, read_metrics
from ppo_cli.recipe import Recipe
from ppo_cli.runs import RunDir
from ppo_cli.tracking import Trackers

class RunObserver:
    def __init__(self, recipe: Recipe, run_dir: RunDir, resumed_at: int = 0,
                 show: Callable[[str, dict], None] = lambda what, data: None):
        self.recipe, self.run_dir, self.show = recipe, run_dir, show
        self.monitor = HealthMonitor(recipe.monitor)
        if resumed_at and run_dir.metrics.exists():
            # Rebuild the windows from the metrics already logged, quietly: a resumed run keeps its
            # warnings' history (exact when train.log_every is 1).
            for row in read_metrics(run_dir.metrics):
                if isinstance(row.get(STEP), int) and row[STEP] <= resumed_at:
                    self.monitor.observe(row, row[STEP])
        self.trackers = Trackers(recipe.logging, run_dir.path, recipe.name, recipe.model_dump(mode="json"), resumed_at)

    def observe(self, metrics: dict, step: int) -> None:
        for warning in self.monitor.observe(metrics, step):
            self.show("warning", asdict(warning))
        metrics[HEALTH_WARNINGS] = list(self.monitor.active)

    def log(self, metrics: dict, step: int) -> None:
        self.trackers.log(metrics, step)

    def close(self) -> None:
        self.trackers.close()

    def finish(self, summary: dict) -> dict:
        """The learning-curve plot, then what the summary adds: throughput, warnings, files."""
        plot = None
        try:
            plot = plot_run(self.run_dir.path)
        except PpoError as err:  # matplotlib missing, or nothing logged: the run itself is fine
            self.show("note", {"message": f"no plot: {err.message}" + (f" ({err.hint})" if err.hint else "")})
        files = {
            "final model": self.run_dir.final, "metrics": self.run_dir.metrics, "samples": self.run_dir.samples,
            "held-out eval": self.run_dir.eval, "learning curves": plot, "tensorboard": self.trackers.tensorboard_dir,
            "summary": self.run_dir.summary,
        }
        seconds = max(summary.get("seconds", 0.0), 1e-9)
        return {
            "episodes_per_s": summary.get("episodes", 0) / seconds,
            "warnings": self.monitor.summary(),
            "files": {name: str(path) for name, path in files.items() if path is not None and _will_exist(path, name)},
        }


def _will_exist(path: Path, name: str) -> bool:
    return name == "summary" or Path(path).exists()
