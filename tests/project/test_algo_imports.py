"""ppo_cli/algo/ stays pure maths: it may import only torch, math, typing, __future__, dataclasses."""

import ast
from pathlib import Path

import pytest

ALGO_DIR = Path(__file__).resolve().parents[2] / "ppo_cli" / "algo"
ALLOWED_ROOTS = {"torch", "math", "typing", "__future__", "dataclasses"}


def find_forbidden_imports(source: str) -> list:
    """Names of the modules ``source`` imports that fall outside ALLOWED_ROOTS.

    ``from . import x`` / ``from .x import y`` stay inside algo/ and are allowed; ``from ..``
    reaches the rest of ppo_cli and is not.
    """
    forbidden = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            forbidden += [alias.name for alias in node.names if alias.name.split(".")[0] not in ALLOWED_ROOTS]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1:
                continue
            if node.level > 1 or (node.module or "").split(".")[0] not in ALLOWED_ROOTS:
                forbidden.append("." * node.level + (node.module or ""))
    return forbidden


def algo_files():
    return sorted(ALGO_DIR.glob("*.py"))


def test_algo_package_has_the_expected_modules():
    names = {path.name for path in algo_files()}
    assert {"masking.py", "kl.py", "advantages.py", "losses.py"} <= names


@pytest.mark.parametrize("path", algo_files(), ids=lambda path: path.name)
def test_algo_module_imports_only_allowed_modules(path):
    assert find_forbidden_imports(path.read_text()) == [], f"{path.name} imports outside {sorted(ALLOWED_ROOTS)}"


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import numpy as np", ["numpy"]),
        ("import torch.nn.functional as F\nimport os", ["os"]),
        ("from ppo_cli.recipe import Recipe", ["ppo_cli.recipe"]),
        ("from ..recipe import Recipe", ["..recipe"]),
        ("def f():\n    import yaml", ["yaml"]),
        ("from .masking import masked_mean\nfrom typing import Tuple\nimport math", []),
        ("from __future__ import annotations\nfrom dataclasses import dataclass\nfrom torch import Tensor", []),
    ],
)
def test_find_forbidden_imports_flags_imports_outside_allowed_roots(source, expected):
    assert find_forbidden_imports(source) == expected
