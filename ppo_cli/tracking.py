"""Metrics beyond metrics.jsonl, through accelerate's tracker classes: TensorBoard event files and
the experiment trackers.

``logging.tensorboard: true`` starts accelerate's TensorBoardTracker (torch.utils.tensorboard's
SummaryWriter), writing RUN_DIR/tensorboard/events.out.tfevents.*; it needs the tensorboard package
(``pip install 'ppo_cli[tensorboard]'``). A resumed run passes SummaryWriter ``purge_step``, the first
new step: its new event file opens with a SessionLog START there, and TensorBoard drops the older files'
points from that step on (logged after the checkpoint, before the interruption), as metrics.jsonl drops
those lines.

``logging.trackers: [wandb, mlflow, ...]`` go through the same classes (each needs its own package).
``check_trackers`` says which package is missing before any model loads. Every tracker gets the metrics
with the same names as metrics.jsonl; values that are not finite numbers are left out.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping

from ppo_cli.errors import UsageError
from ppo_cli.metric_names import STEP
from ppo_cli.recipe import LoggingConfig

TENSORBOARD_DIR = "tensorboard"
TRACKERS_DIR = "trackers"
TENSORBOARD_HINT = "pip install 'ppo_cli[tensorboard]'   (or: pip install tensorboard)"


# --- accelerate's trackers ------------------------------------------------------------------------


def check_trackers(config: LoggingConfig) -> None:
    """Fail before any model loads when a tracker the recipe asks for cannot run here."""
    if not config.tensorboard and not config.trackers:
        return
    from accelerate import tracking

    available = {str(name) for name in tracking.get_available_trackers()}
    if config.tensorboard and "tensorboard" not in available:
        raise UsageError("logging.tensorboard: TensorBoard event files need the tensorboard package, which is not installed",
                         hint=TENSORBOARD_HINT)
    for name in config.trackers:
        if name not in tracking.LOGGER_TYPE_TO_CLASS:
            raise UsageError(f"logging.trackers: this accelerate version has no '{name}' tracker",
                             hint="upgrade accelerate or remove it from logging.trackers")
        if name not in available:
            raise UsageError(f"logging.trackers: '{name}' needs the {name} package, which is not installed",
                             hint=f"pip install {name.replace('_', '-')}   (or remove it from logging.trackers)")


def _flat_config(values: Mapping, prefix: str = "") -> dict:
    """The recipe as tracker hyperparameters: dotted keys, lists as text."""
    flat = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flat_config(value, name + "."))
        else:
            flat[name] = value if isinstance(value, (bool, int, float, str)) or value is None else str(value)
    return flat


def scalar_metrics(metrics: Mapping[str, object]) -> dict[str, float]:
    """The finite numbers of a metrics line; the step is the x axis, not a metric, and lists (such as
    health/warnings) and NaN are left out."""
    return {
        name: float(value) for name, value in metrics.items()
        if name != STEP and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    }


# How each tracker names a run inside its project (the others name runs themselves).
RUN_NAME_ARGUMENT = {"wandb": "name", "mlflow": "run_name", "trackio": "name"}


def _run_name_kwarg(tracker: str, run_name: str) -> dict[str, str]:
    argument = RUN_NAME_ARGUMENT.get(tracker)
    return {argument: run_name} if argument else {}


def start_tensorboard(run_dir: Path, resumed_at: int = 0):
    """accelerate's TensorBoardTracker on RUN_DIR/tensorboard (it writes to logging_dir/run_name). A resumed
    run's SummaryWriter gets purge_step: TensorBoard hides the points from that step on in older files."""
    from accelerate.tracking import TensorBoardTracker

    purge = {"purge_step": resumed_at + 1} if resumed_at else {}
    tracker = TensorBoardTracker(TENSORBOARD_DIR, logging_dir=run_dir, **purge)
    # No store_init_configuration: add_hparams would write a second, timestamped run under tensorboard/
    # on every start and resume; the recipe is RUN_DIR/recipe.yaml.
    tracker.start()
    return tracker


class Trackers:
    """Everything that receives the metrics besides metrics.jsonl; a no-op when nothing is asked for."""

    def __init__(self, config: LoggingConfig, run_dir: Path, run_name: str, recipe_values: Mapping | None = None,
                 resumed_at: int = 0):
        self.tensorboard = start_tensorboard(run_dir, resumed_at) if config.tensorboard else None
        self.tensorboard_dir = run_dir / TENSORBOARD_DIR if config.tensorboard else None
        self.trackers = []
        if config.trackers:
            from accelerate import tracking

            for name in config.trackers:
                cls = tracking.LOGGER_TYPE_TO_CLASS[name]
                # As accelerate's init_trackers: the project first, then the tracker's own init kwargs.
                kwargs = {**_run_name_kwarg(name, run_name), **config.init_kwargs.get(name, {})}
                if cls.requires_logging_directory:
                    kwargs.setdefault("logging_dir", run_dir / TRACKERS_DIR)
                tracker = cls(config.project, **kwargs)
                tracker.start()
                tracker.store_init_configuration(_flat_config(recipe_values or {}))
                self.trackers.append(tracker)

    def _all(self) -> list:
        return ([self.tensorboard] if self.tensorboard is not None else []) + self.trackers

    def log(self, metrics: Mapping[str, object], step: int) -> None:
        scalars = scalar_metrics(metrics)
        for tracker in self._all():
            tracker.log(scalars, step=step)

    def close(self) -> None:
        for tracker in self._all():
            tracker.finish()
