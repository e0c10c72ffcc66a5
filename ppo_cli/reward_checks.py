"""What `ppo validate` and `ppo train` check about each reward component before any model loads.

One check per reward ``type`` (CHECKS): the files a component names (a model reference, a function's
file, a judge's template) and, for the types served from elsewhere, that the server answers now and
that the environment holds the credentials the recipe points at. Each failure is one line naming the
component, the file or the URL, exit code 2. Imports no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ppo_cli.errors import DataError, RewardFunctionError, RewardServerUnreachable
from ppo_cli.recipe import RewardConfig

PROBE_TIMEOUT_S = 10.0  # the most one "does it answer" request waits, whatever the component's timeout_s
# Answers that mean the server is there but will not score: wrong path, no credentials, broken.
REFUSING = {401: "unauthorized: check the credentials", 403: "forbidden: check the credentials",
            404: "not found: check the path", 405: "does not take POST: check the path"}


def check_reward_components(reward: RewardConfig, contact_servers: bool = True, import_functions: bool = False) -> None:
    """Every component's files, and (``contact_servers``) that every server and judge answers.
    ``import_functions`` (train): reward functions are imported, so an import error shows now; else
    their files are only read."""
    for component in reward.components:
        if import_functions and component.type == "function":
            from ppo_cli.engine.function_reward import load_reward_function

            load_reward_function(component.function)
        else:
            CHECKS[component.type](component, contact_servers)


def _check_model(component, contact_servers: bool) -> None:
    from ppo_cli.model_refs import check_model_reference, has_chat_template

    check_model_reference(component.path)
    if component.text == "conversation" and has_chat_template(component.path) is False:
        raise DataError(
            f"reward component '{component.path}' reads text: conversation but its tokenizer has no chat template",
            hint="use a reward model whose tokenizer has a chat template, or text: prompt_and_response / response",
        )


def _check_function(component, contact_servers: bool) -> None:
    """The file exists and defines the name: read, not run (its code runs only when training)."""
    target, _, name = component.function.rpartition(":")
    if not target.endswith(".py"):
        return
    path = Path(target)
    if not path.is_file():
        raise RewardFunctionError(f"reward function file not found: {target}", hint="paths are relative to the current directory")
    _check_defines(path, name)


def _check_defines(path: Path, name: str) -> None:
    import ast
    import difflib

    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return  # importing it says what is wrong, when training
    defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    defined |= {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)}
    defined |= {a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom) for a in node.names}
    if name not in defined:
        close = difflib.get_close_matches(name, sorted(defined), n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"define def {name}(prompts, responses) -> list[float]"
        raise RewardFunctionError(f"'{path}' has no function '{name}'", hint=hint)


def _check_http(component, contact_servers: bool) -> None:
    from ppo_cli.engine.remote import Secrets

    secrets = Secrets()
    headers = {name: secrets.resolve(value, f"reward server {component.url} header '{name}'")
               for name, value in component.headers.items()}
    if contact_servers:
        _probe("POST", component.url, component, secrets, headers, {"prompts": [], "responses": [], "columns": {}})


def _check_judge(component, contact_servers: bool) -> None:
    from ppo_cli.engine.remote import Secrets

    template = Path(component.prompt)
    if not template.is_file():
        raise DataError(f"judge prompt template not found: {template}", hint="paths are relative to the current directory")
    if "{response}" not in template.read_text(encoding="utf-8", errors="replace"):
        raise DataError(f"judge prompt template {template} has no {{response}}",
                        hint="write {prompt} and {response} where the judge should read them")
    secrets = Secrets()
    headers = {}
    if component.api_key_env:
        headers["Authorization"] = "Bearer " + secrets.key(component.api_key_env, f"judge {component.base_url} (api_key_env)")
    if contact_servers:
        # OpenAI-compatible servers list their models here; one that has no such route still answered.
        _probe("GET", component.base_url.rstrip("/") + "/models", component, secrets, headers, None, allow={404, 405})


def _probe(method: str, url: str, component, secrets, headers: dict, body, allow: set[int] = frozenset()) -> None:
    """One request: a server that does not answer in time, or refuses, is one line naming the URL."""
    import httpx

    from ppo_cli.engine.remote import quote

    timeout = min(component.timeout_s, PROBE_TIMEOUT_S)
    hint = f"start the server (or fix the URL) and run again; checked with one request, {timeout:g} s timeout"
    try:
        response = httpx.request(method, url, headers=headers, json=body, timeout=timeout)
    except httpx.TimeoutException:
        raise RewardServerUnreachable(f"{component.type} reward {url} did not answer within {timeout:g} s", hint=hint) from None
    except httpx.HTTPError as err:
        raise RewardServerUnreachable(f"{component.type} reward {url} cannot be reached ({secrets.redact(str(err)) or type(err).__name__})",
                                      hint=hint) from None
    status = response.status_code
    if (status in REFUSING and status not in allow) or status >= 500:
        reason = REFUSING.get(status, "server error")
        raise RewardServerUnreachable(f"{component.type} reward {url} answered HTTP {status} ({reason}) "
                                      f"{quote(response.text, secrets)}", hint=hint)


# A reward component's ``type`` -> its check, called as check(component, contact_servers).
CHECKS: dict[str, Callable] = {"model": _check_model, "classifier": _check_model, "function": _check_function,
                               "http": _check_http, "judge": _check_judge}
