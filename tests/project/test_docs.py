"""README.md and docs/*.md kept true: every link resolves, every page is reachable from the README,
every documented `ppo` command line parses with the CLI as it is (subcommand, options, `--set` keys),
and the lists the pages give (exit codes, health rules, critic kinds, estimators, the README's recipe
excerpt, an error's exact text) are the code's. Fast: nothing is trained or loaded."""

from __future__ import annotations

import re
import shlex
import typing
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# Placeholders the pages write in command lines, and what a test reads them as.
PLACEHOLDERS = {"RECIPE": "recipes/tiny_sentiment.yaml"}


def _prose(path: Path) -> str:
    """The page without its fenced blocks (a link or heading inside a code block is not one)."""
    return FENCE.sub("", path.read_text())


def _blocks(path: Path, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(path.read_text()) if lang == language]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", _prose(path), re.M)}


def _links(path: Path) -> list[str]:
    """Relative links (no scheme) of a page."""
    return [t for t in LINK.findall(_prose(path)) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_every_relative_link_points_at_an_existing_file_and_heading():
    broken = []
    for page in PAGES:
        for target in _links(page):
            file, _, anchor = target.partition("#")
            resolved = (page.parent / file).resolve() if file else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and (resolved.suffix != ".md" or anchor not in _anchors(resolved)):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n## Real heading\n\n[ok](#real-heading) [gone](gone.md) [bad](#nowhere)\n"
                    "```\n[in a code block](ignored.md)\n```\n")
    assert _links(page) == ["#real-heading", "gone.md", "#nowhere"]
    assert _anchors(page) == {"a-page", "real-heading"}
    assert _slug("Round s4 (2026-11-23): each tool's defaults") == "round-s4-2026-11-23-each-tools-defaults"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _links(README)}
    assert [p.name for p in DOCS if p.resolve() not in linked] == []


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_each_docs_page_starts_with_a_title_and_one_line_saying_what_it_covers(page):
    lines = page.read_text().splitlines()
    assert lines[0].startswith("# ") and lines[1] == ""
    assert lines[2] and not lines[2].startswith(("#", "`", "|", "-", "<")), lines[2]


def test_the_readme_keeps_its_two_commands():
    """scripts/test.sh passing its arguments to pytest is tests/test_setup_scripts.py's; here: the
    README shows the two commands first, and both scripts are there to run."""
    first = _blocks(README, "bash")[0]
    assert [shlex.split(line, comments=True) for line in first.splitlines()] == [["scripts/demo.sh"], ["scripts/test.sh"]]
    for script in ("demo.sh", "test.sh"):
        assert (ROOT / "scripts" / script).stat().st_mode & 0o111, f"scripts/{script} is not executable"
    assert 'scripts/test.sh -m "not slow"' in README.read_text()
    assert "recipes/tiny_sentiment.yaml" in (ROOT / "scripts" / "demo.sh").read_text()


# --- documented command lines ------------------------------------------------------------------


def _command_lines(path: Path) -> list[list[str]]:
    """Each command of a page's bash blocks as argv: continuations joined, comments dropped,
    placeholders filled in."""
    commands = []
    for block in _blocks(path, "bash"):
        block = re.sub(r"\[(--[^\]]*)\]", r"\1", block)  # [--set k=v]: optional, read as given
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                argv = [PLACEHOLDERS.get(a, a) for a in shlex.split(part, comments=True)]
                if argv:
                    commands.append(argv)
    return commands


PPO_LINES = [(page.name, argv) for page in PAGES for argv in _command_lines(page) if argv[0] == "ppo"]


def test_the_pages_document_ppo_commands():
    assert len(PPO_LINES) > 30
    assert {argv[1] for _, argv in PPO_LINES} >= {"validate", "train", "plan", "plot", "rollout", "score", "eval", "compare"}


@pytest.mark.parametrize("page, argv", PPO_LINES, ids=[f"{p}: {' '.join(a)[:70]}" for p, a in PPO_LINES])
def test_a_documented_ppo_command_parses_and_its_files_and_keys_exist(page, argv):
    import typer

    from ppo_cli.cli import _bare_resume, app

    group = typer.main.get_command(app)
    parent = group.make_context("ppo", [argv[1]], resilient_parsing=True)
    command = group.get_command(parent, argv[1])
    assert command is not None, f"no command {argv[1]!r}"
    context = command.make_context(argv[1], _bare_resume(argv[2:]), parent=parent)  # raises on an unknown option
    for arg in argv[2:]:
        if arg.startswith(("recipes/", "scripts/", "benchmarks/")):
            assert (ROOT / arg).exists(), arg
    recipe = context.params.get("recipe")
    if argv[1] in ("validate", "train", "plan") and recipe is not None:
        from ppo_cli.recipe_loading import RecipeError, load_recipe

        overrides = context.params.get("overrides") or []
        if page == "errors.md":  # the page's examples are bad input, shown with the error they get
            with pytest.raises(RecipeError):
                load_recipe(ROOT / recipe, overrides)
        else:
            load_recipe(ROOT / recipe, overrides)  # every --set key exists and its value types


def test_a_command_with_an_unknown_option_does_not_parse():
    import typer

    from ppo_cli.cli import app

    group = typer.main.get_command(app)
    parent = group.make_context("ppo", ["plan"], resilient_parsing=True)
    with pytest.raises(Exception, match="--gpu-memry"):
        group.get_command(parent, "plan").make_context("plan", ["recipes/tiny_sentiment.yaml", "--gpu-memry", "24"], parent=parent)


def test_documented_scripts_and_configs_exist():
    missing = []
    for page in PAGES:
        for argv in _command_lines(page):
            if argv[0] in ("python", "accelerate", "bash") or argv[0].startswith("scripts/"):
                missing += [f"{page.name}: {a}" for a in argv if a.startswith(("recipes/", "scripts/", "benchmarks/"))
                            and a.endswith((".py", ".sh", ".yaml")) and not (ROOT / a).exists()]
    assert missing == []


# --- the lists the pages give are the code's ---------------------------------------------------


def _table_first_column(path: Path, header: str) -> list[str]:
    """The first cells of the markdown table whose header row starts with ``| header |``."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1].strip().strip("`"))
    return rows


def test_the_exit_code_table_is_errors_py():
    from ppo_cli import errors

    codes = {value for name, value in vars(errors).items() if name.startswith("EXIT_")}
    assert sorted(int(c) for c in _table_first_column(ROOT / "docs/errors.md", "code")) == sorted(codes)


def test_every_health_rule_is_in_the_table_and_nothing_else():
    from ppo_cli.monitor import RULES

    assert sorted(_table_first_column(ROOT / "docs/errors.md", "rule")) == sorted(rule.id for rule in RULES)


def test_the_critic_kinds_and_estimators_are_the_recipe_schemas():
    from ppo_cli.recipe import CRITIC_KINDS, PPOConfig

    kinds = [cell.split("`")[0] for cell in _table_first_column(ROOT / "docs/critics.md", "`value.kind`")]
    assert sorted(kinds) == sorted(["auto", *CRITIC_KINDS])
    estimators = typing.get_args(PPOConfig.model_fields["advantage"].annotation)
    block = "\n".join(_blocks(ROOT / "docs/estimators.md", "yaml"))
    comment = re.search(r"^  advantage: \w+ +# (.*)$", block, re.M).group(1)  # gae (default: ...) | grpo | ...
    assert sorted(name.strip() for name in re.sub(r"\(.*?\)", "", comment).split("|")) == sorted(estimators)


def test_the_verl_and_openrlhf_table_names_what_the_hints_know():
    """Each name in docs/estimators.md's verl and OpenRLHF columns is one ppo_cli/foreign_names.py points
    to a recipe key (a verl name may be written by its last parts), or a recipe key of the same name."""
    from ppo_cli.foreign_names import OPENRLHF_KEYS, VERL_KEYS
    from ppo_cli.recipe_loading import _recipe_keys

    text = (ROOT / "docs/estimators.md").read_text()
    section = text.partition("## Coming from verl or OpenRLHF")[2].partition("\n## ")[0]
    rows = [line.strip("|").split("|")[:2] for line in section.splitlines() if line.startswith("|")]
    verl_names = {tail for name in VERL_KEYS for tail in (name, *(".".join(name.split(".")[-n:]) for n in (1, 2)))}
    unknown = [name for verl, openrlhf in rows[2:] for name, known in
               [*((n, verl_names) for n in re.findall(r"`([\w.]+)`", verl)),
                *((n, set(OPENRLHF_KEYS) | _recipe_keys()) for n in re.findall(r"`([\w.]+)`", openrlhf))]
               if name not in known]
    assert len(rows) == 25 and unknown == []


def _leaves(value, prefix=""):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{prefix}{key}.")
    elif isinstance(value, list) and value and isinstance(value[0], dict):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{prefix}{i}.")
    else:
        yield prefix.rstrip("."), value


def test_the_readmes_recipe_excerpt_is_the_demo_recipe():
    excerpt = dict(_leaves(yaml.safe_load(_blocks(README, "yaml")[0])))
    recipe = dict(_leaves(yaml.safe_load((ROOT / "recipes/tiny_sentiment.yaml").read_text())))
    assert len(excerpt) > 15
    assert {key: value for key, value in excerpt.items() if recipe.get(key, "missing") != value} == {}


def test_the_error_example_is_what_validate_prints(monkeypatch):
    """docs/errors.md shows a bash block with a command, then a block with what it prints on stderr."""
    from typer.testing import CliRunner

    from ppo_cli.cli import app

    text = (ROOT / "docs/errors.md").read_text()
    command, printed = re.search(r"```bash\n(ppo .*?)\n```\n\n```\n(.*?)\n```", text, re.S).groups()
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(app, shlex.split(command)[1:])
    assert result.exit_code == 2 and "(exit code 2)" in text
    assert result.stderr.strip() == printed.strip()
