"""What `ppo validate` and `ppo train` check about each reward component before any model loads.

Each reward type's own ``check`` (engine/rewards/registry.py): the files a component names (a model
reference, a function's file, a judge's template) and, for the types served from elsewhere, that the
server answers now and that the environment holds the credentials the recipe points at. Each failure
is one line naming the component, the file or the URL, exit code 2. Imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ppo_cli.engine.rewards.registry import REWARD_TYPES
from ppo_cli.recipe import RewardConfig

if TYPE_CHECKING:
    from ppo_cli.engine.data import PromptSet


def check_reward_components(reward: RewardConfig, contact_servers: bool = True, import_functions: bool = False) -> None:
    """Every component's files, and (``contact_servers``) that every server and judge answers.
    ``import_functions`` (train): reward functions are imported, so an import error shows now; else
    their files are only read."""
    from ppo_cli.errors import ModelReferenceError, naming_field

    for index, component in enumerate(reward.components):
        with naming_field(f"reward.components.{index}.path", (ModelReferenceError,)):
            REWARD_TYPES[component.type].check(component, contact_servers=contact_servers, import_functions=import_functions)


def check_reward_columns(reward: RewardConfig, rows: list[tuple[str, PromptSet]], given: set[str] = frozenset(),
                         import_functions: bool = False) -> None:
    """Every component that reads the rows' columns by name (a type module's ``check_columns``) against
    the rows of each prompts source (``rows``: (source, PromptSet) pairs); ``given``: columns every row gets
    besides. ``import_functions`` as for check_reward_components."""
    for component in reward.components:
        check = getattr(REWARD_TYPES[component.type], "check_columns", None)
        if check is not None:
            check(component, rows, given, import_functions=import_functions)
