"""pyproject's dependency floors: never below the releases that have what ppo_cli calls, and met by
the environment the tests run in (so the floors are versions something was tested with or above)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.conftest import ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

# The oldest release of each package with what ppo_cli uses, and the use.
KNOWN_MINIMUMS = {
    "torch": ("2.6", "torch.distributed.fsdp.FSDPModule (FSDP2) is public from 2.6"),
    "accelerate": ("1.15", "FSDP2 puts tied embeddings in one fully_shard group, which torch 2.13 requires"),
    "transformers": ("5.0", "from_pretrained(dtype=...), TokenizersBackend tokenizer files"),
    "peft": ("0.18", "the first peft that works with transformers 5"),
    "typer": ("0.27.2", "typer.TyperException, caught by cli.py"),
    "pydantic": ("2.7", "pydantic v2 models (ConfigDict, field_validator, errors(include_url=False))"),
}


def _requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return {Requirement(line).name: Requirement(line) for line in project["dependencies"]}


def _floor(requirement: Requirement) -> Version | None:
    floors = [Version(spec.version) for spec in requirement.specifier if spec.operator == ">="]
    return max(floors) if floors else None


@pytest.mark.parametrize("name", sorted(KNOWN_MINIMUMS))
def test_dependency_floor_is_at_least_the_oldest_release_with_what_ppo_cli_uses(name):
    minimum, use = KNOWN_MINIMUMS[name]
    floor = _floor(_requirements()[name])
    assert floor is not None and floor >= Version(minimum), f"{name}: floor {floor}, needs >= {minimum} ({use})"


def test_installed_versions_satisfy_pyproject():
    unmet = []
    for name, requirement in _requirements().items():
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        try:
            installed = version(name)
        except PackageNotFoundError:
            unmet.append(f"{name}: not installed")
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            unmet.append(f"{name} {installed} does not satisfy {requirement.specifier}")
    assert not unmet, unmet


def test_torch_upper_bound_keeps_the_cpu_build_installed_first():
    """pip keeps an installed torch 2.13.0+cpu only if the range admits it, and never reaches a newer CUDA build."""
    specifier = _requirements()["torch"].specifier
    assert specifier.contains("2.13.0+cpu") and not specifier.contains("2.14.0")


def test_the_apis_the_floors_protect_exist_in_the_installed_versions():
    import typer
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FSDPModule  # noqa: F401

    assert issubclass(typer.TyperException, Exception)
    assert "fsdp_version" in FullyShardedDataParallelPlugin.__dataclass_fields__
