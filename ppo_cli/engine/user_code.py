"""The user's code a recipe names, 'path/to/file.py:name' or 'package.module:name', imported only when named.

One loader for reward functions (engine/rewards/function.py), tools and environment classes (engine/envs/).
A file is imported once per process, as a module named for its resolved path (``ppo_user_<digest>``), put in
``sys.modules`` before it runs (dataclasses and pickling look their module up there) and taken out again if
it raises, so the next attempt runs it again and says the same. A file named twice (a tool file that also
holds a reward) is one module, its module-level state shared. The file's directory goes on the import
path (at its end), so that it can import the files beside it, as when Python runs it as a script.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from ppo_cli.errors import PpoError


def import_named(spec: str, what: str, error: type[PpoError], *, kind: str | None = None,
                 define: str | None = None) -> Any:
    """The object ``spec`` names. ``what`` says what it is in the error lines ("reward function", "tool"),
    ``error`` is the PpoError they are raised as; ``kind``, if given, names the missing object instead of
    ``what`` ("'f.py' has no function 'g'"); ``define`` is the hint when no name there is close to it."""
    target, _, name = spec.rpartition(":")
    module = _import_file(target, what, error) if target.endswith(".py") else _import_module(target, name, what, error)
    found = getattr(module, name, None)
    if found is None:
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        close = difflib.get_close_matches(name, public, n=1)
        hint = f"did you mean '{close[0]}'?" if close else (define or f"define {name} in {target}")
        raise error(f"'{target}' has no {kind or what} '{name}'", hint=hint)
    return found


def _import_file(target: str, what: str, error: type[PpoError]):
    path = Path(target)
    if not path.is_file():
        raise error(f"{what} file not found: {target}", hint=f"paths are relative to the current directory ({Path.cwd()})")
    module_name = "ppo_user_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    module = sys.modules.get(module_name)
    if module is not None:
        return module
    directory = str(path.resolve().parent)
    if directory not in sys.path:  # its own imports of files beside it work, as when Python runs it as a script
        sys.path.append(directory)  # last: an installed package of the same name is not shadowed
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException as err:
        del sys.modules[module_name]
        if not isinstance(err, Exception):  # Ctrl-C while importing is not the module's fault
            raise
        hint = (f"a module it imports must be installed, on PYTHONPATH or a file in {directory}"
                if isinstance(err, ModuleNotFoundError) else None)
        raise error(f"cannot import {what} module '{target}': {type(err).__name__}: {err}", hint=hint) from err
    return module


def _import_module(target: str, name: str, what: str, error: type[PpoError]):
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as err:
        missing_itself = err.name is not None and (target == err.name or target.startswith(err.name + "."))
        hint = (f"a file is written path/to/file.py:{name}; a module must be importable (installed, or on PYTHONPATH)"
                if missing_itself else None)
        raise error(f"cannot import {what} module '{target}': {type(err).__name__}: {err}", hint=hint) from err
    except Exception as err:  # the user's module raised while importing
        raise error(f"cannot import {what} module '{target}': {type(err).__name__}: {err}") from err


def defined_names(path: Path, error: type[PpoError], syntax_hint: str) -> set[str] | None:
    """The names a Python file defines at its top level (functions, classes, assignments, imports), read
    with ``ast`` and not run: what `ppo validate` checks a recipe's names against. A syntax error is
    raised as ``error`` with ``syntax_hint``; None where the file cannot be parsed for another reason
    (importing it says what is wrong, when training)."""
    import ast

    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))  # bytes: a coding cookie is honoured, as on import
    except SyntaxError as err:
        line = f":{err.lineno}" if err.lineno else ""
        raise error(f"{path}{line}: Python syntax error: {err.msg}", hint=syntax_hint) from None
    except (ValueError, OSError):
        return None
    defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    defined |= {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)}
    defined |= {a.asname or a.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for a in node.names}
    defined |= {a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom) for a in node.names}
    return defined


def last_binding(path: Path, name: str):
    """The top-level statement of the file ``path`` that binds ``name`` last (a def, class, assignment or
    import), read with ``ast``, not run; None when the file does not parse or does not bind it."""
    import ast

    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError):
        return None
    bound = [node for node in tree.body if name in _names_bound(node)]
    return bound[-1] if bound else None


def _names_bound(node) -> set[str]:
    import ast

    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return {name for target in targets for name in _target_names(target)}


def _target_names(target) -> set[str]:
    """The names an assignment target binds: ``a``, ``a, b``, ``*a``; not ``a.x`` or ``a[0]``."""
    import ast

    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return {name for element in target.elts for name in _target_names(element)}
    return _target_names(target.value) if isinstance(target, ast.Starred) else set()
