"""Loading a recipe: the file, YAML with the line of every key, typed ``--set`` overrides, validation
against the schema (recipe.py), and every failure as one located line.

``recipe.yaml:14: ppo.kl_coeff: unknown key 'kl_coeff' in ppo`` plus a hint naming the fix.
Imports pydantic, yaml and the standard library only (never torch).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import re
import shlex
import types
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from ppo_cli.errors import RecipeError
from ppo_cli.foreign_names import foreign_key_hint, trl_value_hint
from ppo_cli.recipe import Recipe

# --- loading -------------------------------------------------------------------------------------
#
# load_recipe = read the file -> YAML with the line of every key -> --set overrides -> validate.
# Every failure becomes a RecipeError whose message is one line, `<file>:<line>: <key.path>: <what>`,
# and whose hint says what is allowed.

KeyPath = tuple[str, ...]  # ('reward', 'components', '0', 'weight'): list indexes as strings too

_MORE_ERRORS = " (and {n} more error{s}; run `{command}` for all)"


@dataclasses.dataclass(frozen=True)
class RecipeProblem:
    """One validation error of a recipe, located in its file (or on the command line)."""

    source: str  # the recipe file as given
    line: int | None  # the YAML line of the key (or of its parent mapping when the key is missing)
    key_path: str  # 'ppo.kl_coef'; '' when the error concerns the whole recipe
    message: str
    hint: str | None = None
    from_override: bool = False  # the value came from --set

    def __str__(self) -> str:
        if self.from_override:  # the value came from the command line, not from the file
            return f"--set {self.key_path}: {self.message}" if self.key_path else f"--set: {self.message}"
        where = self.source if self.line is None else f"{self.source}:{self.line}"
        return f"{where}: {self.key_path}: {self.message}" if self.key_path else f"{where}: {self.message}"


class RecipeValidationError(RecipeError):
    """The recipe does not validate; ``problems`` holds every error, the message the first one."""

    def __init__(self, message: str, hint: str | None, problems: Iterable[RecipeProblem]):
        super().__init__(message, hint)
        self.problems = tuple(problems)


def load_recipe(path: str | Path, overrides: Iterable[str] = ()) -> Recipe:
    """Read a YAML recipe, apply ``key.path=value`` overrides (``--set``) and validate it.

    Raises RecipeError (a RecipeValidationError for schema errors) with a one-line message.
    """
    path = Path(path)
    source = str(path)
    data, lines = load_yaml_with_lines(_read_text(path), source)
    if data is None:
        raise RecipeError(f"{source}: the recipe is empty", "a recipe needs at least name, policy, reward, data and train")
    if not isinstance(data, dict):
        raise RecipeError(
            f"{source}:{lines[()]}: the recipe must be a mapping of keys (name:, policy:, ...), not a {_yaml_kind(data)}",
            "see the recipes/ directory for examples",
        )
    overrides = list(overrides)
    data, set_paths = apply_overrides(data, overrides)
    return validate_recipe(data, source=source, lines=lines, set_paths=set_paths, overrides=overrides)


def dump_resolved(recipe: Recipe) -> str:
    """The recipe as YAML with every default filled in: load_recipe reads it back to an equal Recipe."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, allow_unicode=True, width=1_000)


def validate_recipe(
    data: Any, *, source: str = "<recipe>", lines: dict[KeyPath, int] | None = None, set_paths: Iterable[KeyPath] = (),
    overrides: Iterable[str] = (),
) -> Recipe:
    """Validate parsed YAML; errors are located with ``lines`` (key path -> line) and ``set_paths``. ``overrides``:
    the --set items, repeated in the `ppo validate ... --all-errors` line that lists every error."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        problems = describe_errors(exc, source=source, lines=lines or {}, set_paths=frozenset(set_paths))
    more = len(problems) - 1
    message = str(problems[0])
    if more:
        command = shlex.join(["ppo", "validate", source, *(a for item in overrides for a in ("--set", item)), "--all-errors"])
        message += _MORE_ERRORS.format(n=more, s="s" if more > 1 else "", command=command)
    raise RecipeValidationError(message, problems[0].hint, problems)


# --- reading and YAML with line numbers ---


def _read_text(path: Path) -> str:
    source = str(path)
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.y*ml"))
        hint = f"recipes in it: {', '.join(found[:8])}" if found else "pass a .yaml recipe file"
        raise RecipeError(f"{source}: is a directory, not a recipe file", hint)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        siblings = {p.stem: p for p in path.parent.glob("*.y*ml")} if path.parent.is_dir() else {}
        close = difflib.get_close_matches(path.stem, list(siblings), n=1)
        hint = f"did you mean {siblings[close[0]]}?" if close else "check the path; shipped recipes are in recipes/"
        raise RecipeError(f"{source}: no such recipe file", hint) from None
    except PermissionError:
        raise RecipeError(f"{source}: permission denied", "check the file's permissions") from None
    except OSError as err:
        raise RecipeError(f"{source}: cannot read the recipe: {err.strerror or err}") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise RecipeError(
            f"{source}:{line}: not UTF-8 text (byte 0x{raw[err.start]:02x})", "save the recipe as UTF-8"
        ) from None


def load_yaml_with_lines(text: str, source: str = "<recipe>") -> tuple[Any, dict[KeyPath, int]]:
    """Parse one YAML document; also return the 1-based line of every key and list item by key path.

    ``()`` maps to the document's first line. Duplicate keys (which YAML silently resolves to the last
    one) are an error.
    """
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}
        lines: dict[KeyPath, int] = {(): node.start_mark.line + 1}
        _record_lines(node, (), lines, source, frozenset())
        return loader.construct_document(node), lines
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        hint = "check the indentation, and quote values that contain ': ', ' #' or start with a special character"
        problem = err.problem or err.context
        if err.context and problem.startswith("but "):  # "expected a single document ... but found another"
            problem = f"{err.context} {problem}"
        elif err.context and err.context_mark is not None:
            hint = f"{err.context} at line {err.context_mark.line + 1}; {hint}"
        raise RecipeError(f"{source}{line}: YAML syntax error: {problem}", hint) from None
    except yaml.YAMLError as err:
        raise RecipeError(f"{source}: YAML error: {_one_line(str(err))}") from None
    finally:
        loader.dispose()


def _record_lines(node: yaml.Node, path: KeyPath, lines: dict[KeyPath, int], source: str, active: frozenset) -> None:
    if id(node) in active:  # a recursive alias
        return
    active = active | {id(node)}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # merged keys ('<<') fall back to the line of their parent
            key_path = path + (key_node.value,)
            line = key_node.start_mark.line + 1
            if key_path in lines:
                raise RecipeError(
                    f"{source}:{line}: {'.'.join(key_path)}: duplicate key (first at line {lines[key_path]})",
                    "YAML keeps only the last one; remove one of them",
                )
            lines[key_path] = line
            _record_lines(value_node, key_path, lines, source, active)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines[path + (str(index),)] = item.start_mark.line + 1
            _record_lines(item, path + (str(index),), lines, source, active)


# --- --set overrides ---


def apply_overrides(data: dict, overrides: Iterable[str]) -> tuple[dict, frozenset[KeyPath]]:
    """Apply ``key.path=value`` overrides to a copy of ``data``; return it and the paths that were set.

    The value is parsed as YAML (``0.1``, ``null``, ``[a, b]``, ``{r: 8}``) and typed later by validation.
    Key paths are checked against the schema first, so a misspelt key fails here with the allowed keys.
    """
    data = copy.deepcopy(data)
    set_paths = set()
    for item in overrides:
        parts, value = _parse_override(item)
        kinds, leaf = _check_override_path(data, parts, item)
        if isinstance(value, (bool, int, float)) or not isinstance(value, (str, list, dict, type(None))):
            if _is_str_type(leaf):  # `--set name=2024`: a string field keeps the text as typed
                value = item.partition("=")[2].strip()
        _write(data, parts, kinds, value)
        set_paths.add(tuple(parts))
    return data, frozenset(set_paths)


def _parse_override(item: str) -> tuple[list[str], Any]:
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise RecipeError(
            f"--set {item or repr(item)}: expected key.path=value",
            "for example --set ppo.kl_coef=0.1 or --set policy.lora=null",
        )
    parts = key.split(".")
    if not all(parts):
        raise RecipeError(f"--set {item}: empty key in '{key}'", "separate keys with single dots: --set ppo.kl_coef=0.1")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or _one_line(str(err))
        raise RecipeError(
            f"--set {item}: the value is not valid YAML: {problem}",
            f"quote the value, e.g. --set '{key}=\"...\"'",
        ) from None
    return parts, value


def _check_override_path(data: dict, parts: list[str], item: str) -> tuple[list[type], Any]:
    """Walk the schema along ``parts``; return the container kind (dict or list) each part indexes
    into, and the type of the leaf. Unknown keys and bad indexes raise RecipeError."""
    tp: Any = Recipe
    node: Any = data
    kinds: list[type] = []
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth])
        tp = _strip_optional(tp)
        if _is_plain_union(tp):  # e.g. list[str] | 'all-linear': index into the list member
            tp = next((a for a in get_args(tp) if get_origin(a) is list), tp) if part.isdigit() else tp
        fields = _fields_of(tp, node)
        if fields is not None:
            if part not in fields:
                close = difflib.get_close_matches(part, fields, n=1)
                raise RecipeError(
                    f"--set {item}: unknown key '{part}' in {where or 'the recipe'}; allowed: {', '.join(fields)}",
                    _key_home(part, where, [parts[depth + 1:end] for end in range(depth + 1, len(parts) + 1)])
                    or (f"did you mean '{close[0]}'?" if close else "run `ppo validate RECIPE` to see every key"),
                )
            kinds.append(dict)
            tp, node = fields[part].annotation, node.get(part) if isinstance(node, dict) else None
        elif get_origin(tp) is list:
            length = len(node) if isinstance(node, list) else 0
            if not part.isdigit():
                raise RecipeError(f"--set {item}: {where} is a list; index it with a number, e.g. {where}.0")
            if int(part) > length:
                raise RecipeError(
                    f"--set {item}: index {part} is out of range: {where} has {length} item{'s' * (length != 1)}",
                    f"use {where}.{length} to append an item",
                )
            kinds.append(list)
            tp, node = get_args(tp)[0], node[int(part)] if int(part) < length else None
        elif get_origin(tp) is dict:
            kinds.append(dict)
            tp, node = get_args(tp)[1], node.get(part) if isinstance(node, dict) else None
        else:
            raise RecipeError(f"--set {item}: {where} is a single value, not a section", f"use --set {where}=VALUE")
    return kinds, _strip_optional(tp)


def _write(data: dict, parts: list[str], kinds: list[type], value: Any) -> None:
    container: Any = data
    for depth, part in enumerate(parts):
        key: Any = int(part) if kinds[depth] is list else part
        if depth == len(parts) - 1:
            child = value
        else:
            current = container[key] if _has(container, key) else None
            child = current if isinstance(current, kinds[depth + 1]) else kinds[depth + 1]()
        if isinstance(container, list) and key == len(container):
            container.append(child)
        else:
            container[key] = child
        container = child


def _has(container: Any, key: Any) -> bool:
    return key < len(container) if isinstance(container, list) else key in container


# --- ValidationError -> located one-line problems ---

_EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "a whole number",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping (key: value lines)",
    "model_type": "a mapping (key: value lines)",
    "model_attributes_type": "a mapping (key: value lines)",
}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


@dataclasses.dataclass
class _Where:
    path: list[str]  # key path in the YAML (union member labels removed)
    owner: type[BaseModel] | None  # the model holding the last key
    field: FieldInfo | None  # the schema field of the last key
    tp: Any  # the schema type at the path
    union_member: bool  # the error is about one member of a plain union (e.g. list[str] | 'all-linear')


def describe_errors(
    exc: ValidationError, *, source: str, lines: dict[KeyPath, int], set_paths: frozenset[KeyPath]
) -> list[RecipeProblem]:
    """Turn pydantic's errors into located one-line problems, first in the file first."""
    described: list[tuple[_Where, str, str | None, str | None]] = []  # where, message, hint, expected
    for err in exc.errors(include_url=False):
        loc = section = tuple(err["loc"])
        if err["type"] == "recipe_rule" and (err.get("ctx") or {}).get("key"):
            loc += tuple(err["ctx"]["key"].split("."))
        where = _walk_loc(loc)
        message, hint = _message_and_hint(err, where)
        if err["type"] == "recipe_rule":
            message += _also_set(section, tuple(where.path), message, set_paths)
        expected = _expected(err)
        previous = described[-1] if described else None
        if previous and where.union_member and previous[0].union_member and previous[0].path == where.path:
            if previous[3] and expected:  # one message for all members: "expected a list or 'all-linear'"
                merged = f"{previous[3]} or {expected}"
                message, hint = f"expected {merged}, got {_show(err['input'])}", _takes_hint(where, merged)
                described[-1] = (where, message, hint, merged)
            continue
        described.append((where, message, hint, expected))
    problems = [_locate(where.path, message, hint, source, lines, set_paths) for where, message, hint, _ in described]
    return sorted(problems, key=lambda p: (p.from_override, p.line or 0))


def _also_set(section: KeyPath, key: KeyPath, message: str, set_paths: frozenset[KeyPath]) -> str:
    """A rule across fields is located at one of them, in the file: where another field it names came
    from --set (the value that broke it, most likely), say so, e.g. ' (ppo.rollout_batch_size from --set)'.
    Nothing where the located field is itself from --set: the line already starts with --set."""
    if any(key[:n] in set_paths for n in range(1, len(key) + 1)):
        return ""
    named = sorted(".".join(p) for p in set_paths
                   if p[:len(section)] == section and len(p) > len(section) and p != key[:len(p)]
                   and re.search(rf"\b{re.escape(p[-1])}\b", message))
    return f" ({', '.join(named)} from --set)" if named else ""


def _walk_loc(loc: tuple) -> _Where:
    """Follow pydantic's error location through the schema, dropping the union labels it inserts."""
    where = _Where([], None, None, Recipe, False)
    for item in loc:
        tp = _strip_optional(where.tp) if where.tp is not None else None
        if tp is not None and _is_discriminated(tp):  # the item is the tag, e.g. 'function'
            where.tp = _member_for_tag(tp, item)
            continue
        if tp is not None and _is_plain_union(tp):  # the item is a member label, e.g. 'list[str]'
            where.tp, where.union_member = None, True
            continue
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            where.owner, where.field = tp, _keyed_fields(tp).get(str(item))
            where.tp = where.field.annotation if where.field else None
        elif get_origin(tp) in (list, dict):
            where.tp = get_args(tp)[-1]
        else:
            where.tp = None
        where.path.append(str(item))
    return where


def _message_and_hint(err: dict, where: _Where) -> tuple[str, str | None]:
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    leaf = where.path[-1] if where.path else ""
    parent = ".".join(where.path[:-1])
    description = where.field.description if where.field is not None else None
    if kind == "missing":
        hint = f"add `{leaf}:` under `{parent}:`" if parent else f"add `{leaf}:` at the top level"
        return "missing required key", hint + (f" — {description}" if description else "")
    if kind == "extra_forbidden":
        allowed = list(_keyed_fields(where.owner)) if where.owner is not None else []
        close = difflib.get_close_matches(leaf, allowed, n=1)
        home = _key_home(leaf, parent, _written_below(value))
        hint = (f"{home}; " if home else f"did you mean '{close[0]}'? " if close else "")
        hint += f"allowed keys: {', '.join(allowed)}"
        return f"unknown key '{leaf}'" + (f" in {parent}" if parent else ""), hint
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        where.path.append(ctx.get("discriminator", "'type'").strip("'"))
        allowed = ", ".join(repr(tag) for tag in _tags(_strip_optional(where.tp)))
        if kind == "union_tag_not_found":
            return "missing required key", f"add `{where.path[-1]}:` to this item; allowed values: {allowed}"
        return f"invalid value {_show(ctx.get('tag'))}", _did_you_mean(ctx.get("tag"), allowed) + f"allowed values: {allowed}"
    if kind == "literal_error":
        expected = ctx.get("expected", "")
        trl = trl_value_hint(".".join(where.path), value)
        if trl is not None:
            return f"invalid value {_show(value)}", f"{trl}; allowed values: {expected}"
        return f"invalid value {_show(value)}", _did_you_mean(value, expected) + f"allowed values: {expected}"
    if kind == "recipe_rule":
        return err["msg"], ctx.get("hint")
    if kind == "value_error":
        return _one_line(str(ctx.get("error", err["msg"]))), description
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {_show(value)}", _takes_hint(where, _EXPECTED[kind])
    if kind in _BOUNDS:
        limit = next(iter(ctx.values()))
        return f"must be {_BOUNDS[kind]} {limit}, got {_show(value)}", _range_hint(where, leaf, description)
    if kind == "too_short":
        n = ctx.get("min_length")
        return f"needs at least {n} item{'s' * (n != 1)}", description
    if kind == "string_pattern_mismatch":
        return f"invalid value {_show(value)}", description or f"must match {ctx.get('pattern')}"
    return _one_line(err["msg"][:1].lower() + err["msg"][1:]), description


def _key_home(key: str, section: str, below: list[list[str]] = ([],)) -> str | None:
    """Where an unknown ``key`` of ``section`` ('' at the top level) belongs: a TRL, verl or OpenRLHF
    option's recipe key, the top level, or the section that has a key of that name; None when it belongs
    nowhere (a typo). ``below``: the key paths written under it, [] first (verl's nested config:
    ``algorithm: {kl_ctrl: {kl_coef: 0.001}}`` or ``--set algorithm.kl_ctrl.kl_coef=0.001``)."""
    written = [[*section.split("."), key, *path] if section else [key, *path] for path in below]
    if (elsewhere := foreign_key_hint(written, _recipe_keys())) is not None:
        return elsewhere
    if "." in section:  # inside a list item or a nested block: no other section to point to
        return None
    if section and key in Recipe.model_fields:
        return f"{key} is a top-level key: write it without a section"
    homes = [name for name, field in Recipe.model_fields.items()
             if name != section and key in _section_keys(_strip_optional(field.annotation))]
    return f"{key} is a key of {' and '.join(homes)}: write {homes[0]}.{key}" if homes else None


def _written_below(value: Any) -> list[list[str]]:
    """The key paths of a mapping written under an unknown key, [] (the key itself) first."""
    paths: list[list[str]] = [[]]
    if isinstance(value, dict):
        for key, inner in value.items():
            paths += [[str(key), *path] for path in _written_below(inner)]
    return paths


@functools.cache
def _recipe_keys() -> frozenset[str]:
    """Every key of the top level and of its sections."""
    return frozenset(Recipe.model_fields).union(*(_section_keys(_strip_optional(field.annotation))
                                                  for field in Recipe.model_fields.values()))


def _section_keys(tp: Any) -> dict[str, FieldInfo]:
    return _keyed_fields(tp) if isinstance(tp, type) and issubclass(tp, BaseModel) else {}


def _did_you_mean(value, allowed: str) -> str:
    """"did you mean 'head'? " when ``value`` is a near miss of one of the quoted values in ``allowed``."""
    if not isinstance(value, str):
        return ""
    choices = re.findall(r"'([^']*)'", allowed)
    close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6) or [c for c in choices if c.lower() == value.lower()]
    return f"did you mean '{close[0]}'? " if close else ""


def _takes_hint(where: _Where, expected: str) -> str:
    description = where.field.description if where.field is not None else None
    return f"`{'.'.join(where.path)}` takes {expected}" + (f": {description}" if description else "")


def _range_hint(where: _Where, leaf: str, description: str | None) -> str | None:
    """'allowed: 0.0 <= gamma <= 1.0' from the field's gt/ge/lt/le constraints."""
    if where.field is None:
        return description
    low = high = ""
    for meta in where.field.metadata:
        for attr, op in (("gt", "<"), ("ge", "<=")):
            if getattr(meta, attr, None) is not None:
                low = f"{getattr(meta, attr)} {op} "
        for attr, op in (("lt", "<"), ("le", "<=")):
            if getattr(meta, attr, None) is not None:
                high = f" {op} {getattr(meta, attr)}"
    allowed = f"allowed: {low}{leaf}{high}" if low or high else None
    return "; ".join(part for part in (allowed, description) if part) or None


def _expected(err: dict) -> str | None:
    if err["type"] == "literal_error":
        return (err.get("ctx") or {}).get("expected")
    return _EXPECTED.get(err["type"])


def _locate(
    path: list[str], message: str, hint: str | None, source: str, lines: dict[KeyPath, int], set_paths: frozenset
) -> RecipeProblem:
    key = tuple(path)
    dotted = ".".join(path)
    set_here = any(key[:n] in set_paths for n in range(1, len(key) + 1))
    set_below = key not in lines and any(p[:len(key)] == key for p in set_paths)  # --set environment.kwargs.tries=3
    if set_here or set_below:
        return RecipeProblem(source, None, dotted, message, hint, from_override=True)
    line = next((lines[key[:n]] for n in range(len(key), -1, -1) if key[:n] in lines), None)
    return RecipeProblem(source, line, dotted, message, hint)


# --- schema introspection ---


def _strip_optional(tp: Any) -> Any:
    """``X | None`` -> X; ``Annotated[X, ...]`` -> X unless it carries a discriminator."""
    while True:
        origin = get_origin(tp)
        if origin is Annotated and not _is_discriminated(tp):
            tp = get_args(tp)[0]
        elif origin in (Union, types.UnionType) and type(None) in get_args(tp):
            rest = [a for a in get_args(tp) if a is not type(None)]
            tp = rest[0] if len(rest) == 1 else Union[tuple(rest)]
        else:
            return tp


def _is_discriminated(tp: Any) -> bool:
    return get_origin(tp) is Annotated and any(
        isinstance(meta, FieldInfo) and meta.discriminator for meta in get_args(tp)[1:]
    )


def _is_plain_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _members(tp: Any) -> list[type[BaseModel]]:
    return list(get_args(get_args(tp)[0]))


def _tags(tp: Any) -> list[str]:
    return [tag for member in _members(tp) for tag in get_args(member.model_fields["type"].annotation)]


def _member_for_tag(tp: Any, tag: Any) -> type[BaseModel] | None:
    return next((m for m in _members(tp) if tag in get_args(m.model_fields["type"].annotation)), None)


def _fields_of(tp: Any, node: Any) -> dict[str, FieldInfo] | None:
    """The fields allowed at a mapping of type ``tp``: a model's, or for a discriminated union the
    member named by the node's ``type`` (all members' fields when it has none). None: not a model."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return _keyed_fields(tp)
    if _is_discriminated(tp):
        member = _member_for_tag(tp, node.get("type")) if isinstance(node, dict) else None
        if member is not None:
            return _keyed_fields(member)
        return {name: f for m in _members(tp) for name, f in _keyed_fields(m).items()}
    return None


def _keyed_fields(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """A model's fields by the key a recipe writes: the alias where there is one (environment.class, the
    field class_), else the field's name."""
    return {field.alias or name: field for name, field in model.model_fields.items()}


def _is_str_type(tp: Any) -> bool:
    if tp is str:
        return True
    return get_origin(tp) is Literal and all(isinstance(a, str) for a in get_args(tp))


def _show(value: Any) -> str:
    """A value as the user wrote it in YAML: strings quoted, true/false/null, short."""
    text = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
    return _one_line(text if len(text) <= 60 else text[:57] + "...")


def _yaml_kind(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "value")


def _one_line(text: str) -> str:
    return " ".join(text.split())
