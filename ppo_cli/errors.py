"""Errors meant for people: one line naming the problem, an optional hint naming the fix.

Every error the CLI can explain is a ``PpoError``; ``cli.main`` prints ``error: <message>`` and
``hint: <hint>`` and exits with the error's code. Anything else is a bug and shows a traceback only
with ``--debug``.
"""

from __future__ import annotations

import contextlib
import os

# Exit codes (documented in docs/errors.md; tests/test_docs.py checks its table).
EXIT_OK = 0
EXIT_RUNTIME = 1  # a failure while running: model load, training diverged, I/O
EXIT_USAGE = 2  # bad usage, recipe, override, prompts file or model reference
EXIT_DOES_NOT_FIT = 3  # `ppo plan`: the recipe does not fit the memory budget (--gpu-memory or the local GPU)
EXIT_INTERRUPTED = 130  # stopped by Ctrl-C / SIGTERM after saving a checkpoint
EXIT_STDOUT_CLOSED = 141  # the reader of stdout went away (`ppo ... | head`): 128 + SIGPIPE, as a shell reports

# How a hint says "continue the run from its last checkpoint". Printed, it becomes the command of the run
# at hand (resume.resume_command): `ppo train` passes it to print_error, and to the processes a launch
# starts (they see the command line less the launcher's options) in RESUME_ENV.
RESUME = "ppo train RECIPE --resume"
RESUME_ENV = "PPO_RESUME_COMMAND"


class PpoError(Exception):
    """An error with a message for people and an optional hint naming the fix."""

    exit_code = EXIT_RUNTIME
    label = "error"  # the word before the message on stderr

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class UsageError(PpoError):
    exit_code = EXIT_USAGE


class RecipeError(UsageError):
    """The recipe (or an override) does not validate."""


class DataError(UsageError):
    """A prompts or rollouts file cannot be used."""


class ModelReferenceError(UsageError):
    """A model path, hub id or alias cannot be resolved."""


class ModelLoadError(PpoError):
    """A model was found but could not be loaded."""


@contextlib.contextmanager
def naming_field(key: str, kinds: tuple[type[PpoError], ...] = (ModelReferenceError, ModelLoadError)):
    """A model that cannot be found (or, by default, read), named by the recipe field that gave it
    ('policy.path: ...'): a recipe names several models (the Qwen recipe two), and the message alone
    does not say which."""
    try:
        yield
    except kinds as err:
        raise type(err)(f"{key}: {err.message}", hint=err.hint) from None


class CheckpointError(PpoError):
    """A checkpoint is missing, incomplete or does not match its manifest."""


class RewardFunctionError(UsageError):
    """A Python reward function cannot be imported or has the wrong signature."""


class RewardFunctionFailed(PpoError):
    """A Python reward function raised while scoring (the user's code, not ours: no bug report)."""


class RewardServerError(PpoError):
    """A reward server or judge failed while scoring (every completion of a rollout, or any with on_failure: error)."""


class RewardServerUnreachable(UsageError):
    """A reward server or judge does not answer before training starts, or its credentials are missing."""


class SamplerServerError(PpoError):
    """The vLLM server that samples the rollouts (generation.backend vllm_server) did not answer, answered an
    error or lost the policy's adapter."""


class EnvironmentSetupError(UsageError):
    """An episode environment (its tools, class or server) cannot be used: not found, wrong signature, no docstring."""


class EnvironmentFailed(PpoError):
    """An environment's step failed with environment.on_failure: error (the user's environment, not ours)."""


class TrainingError(PpoError):
    """Training cannot go on (for example, repeated non-finite updates)."""


class Interrupted(PpoError):
    """Stopped by Ctrl-C / SIGTERM after saving a checkpoint."""

    exit_code = EXIT_INTERRUPTED
    label = "stopped"  # asked for, and nothing lost: not an error


def first_line(err: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message (its type name when the message is empty)."""
    text = str(err).strip()
    return text.splitlines()[0][:limit] if text else type(err).__name__


def with_resume_command(hint: str, resume: str | None = None) -> str:
    """``hint`` with RESUME replaced by ``resume``, else by RESUME_ENV's command when set."""
    resume = resume or os.environ.get(RESUME_ENV)
    return hint.replace(RESUME, resume) if resume else hint


def print_error(message: str, hint: str | None = None, resume: str | None = None, label: str = "error") -> None:
    """``error: <message>`` and ``hint: <hint>`` on stderr: how every process (the CLI, the launcher,
    the collective watchdog) shows a PpoError (``label``: its own word, 'stopped' for an interrupted run).
    ``resume``: the run's resume command (with_resume_command)."""
    from rich.text import Text

    console = stderr_console()
    # Text, not a markup string: messages quote user input such as '[bold]' or '[/]'.
    console.print(Text.assemble((f"{label}:", "bold red" if label == "error" else "bold"), " ", message))
    if hint:
        console.print(Text.assemble(("hint:", "bold"), " ", with_resume_command(hint, resume)))


def stderr_console():  # type: ignore[no-untyped-def]
    from rich.console import Console

    # Made per call so a redirected sys.stderr (tests, CliRunner) is honoured; soft_wrap: one line stays one.
    return Console(stderr=True, highlight=False, soft_wrap=True)
