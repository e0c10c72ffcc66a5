"""`ppo train`'s run prints nothing itself: what people see goes through the ``show`` callback the CLI
passes (report.TrainScreen). The modules the run is made of neither import report nor call print."""

from __future__ import annotations

import ast
from pathlib import Path

import ppo_cli

QUIET = ("commands/train.py", "observe.py", "evaluation.py", "resume.py", "trainer.py", "train_setup.py",
         "train_checks.py", "train_metrics.py")


def printing_in(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module == "ppo_cli" and any(a.name == "report" for a in node.names):
            found.append(f"line {node.lineno}: imports report")
        elif isinstance(node, ast.ImportFrom) and node.module == "ppo_cli.report":
            found.append(f"line {node.lineno}: imports report")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
            found.append(f"line {node.lineno}: print()")
    return found


def test_the_train_run_shows_things_only_through_its_callback():
    root = Path(ppo_cli.__file__).parent
    found = {name: printing_in(root / name) for name in QUIET}
    assert {name: lines for name, lines in found.items() if lines} == {}


def test_the_check_sees_a_module_that_prints(tmp_path):
    noisy = tmp_path / "noisy.py"
    noisy.write_text("from ppo_cli import report\n\ndef f():\n    print('x')\n")
    assert printing_in(noisy) == ["line 1: imports report", "line 4: print()"]
