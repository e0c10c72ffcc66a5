"""generation.backend: vllm_server — rollouts sampled by a running, OpenAI-compatible `vllm serve`.

The server holds the base model; the trainer holds the policy. Before every rollout the policy's LoRA
adapter crosses over by file, and prompts and completions cross as token ids:

    1. the adapter saved (peft save_pretrained) to generation.server_adapter_dir/<name>/
    2. POST /v1/load_lora_adapter   {"lora_name": <name>, "lora_path": <that directory>}
    3. POST /v1/unload_lora_adapter {"lora_name": <the previous name>}; its directory removed
    4. POST /v1/completions, one per group of num_generations rows:
         {"model": <name>, "prompt": [token ids], "n": G, "seed": s, "logprobs": 0, "return_token_ids": true, ...}
       -> choices[i] (i < G): "token_ids", "logprobs": {"token_logprobs"}, "prompt_token_ids"

Each update's adapter gets a name never used before (vLLM caches adapters by name, and a resumed run
must not collide with the one it resumes). The tokens are never decoded and re-encoded on either side.
The server must run with --logprobs-mode processed_logprobs (the log-prob the token was drawn with, as
the in-process engine reports) and --generation-config vllm (the model's generation_config.json would
change the sampling defaults); docs/vllm.md gives the line.

Requests are bounded by generation.server_timeout_s and retried generation.server_retries times
(engine/rewards/remote.py, as reward servers are); what fails for good is one line (SamplerServerError).
Full fine-tuning is refused by the recipe: vLLM 0.32's server takes weights only through its dev-mode
/collective_rpc or an NCCL group, neither of which is a file it can read.
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from pathlib import Path

import torch

from ppo_cli.engine.rewards.remote import Policy, RemoteFailure, Secrets, gather_bounded, new_client, request_json
from ppo_cli.engine.sampler import Sampled, trimmed, with_budget
from ppo_cli.engine.vllm_sampler import build_generation, group_size, sampling_kwargs
from ppo_cli.errors import RESUME, SamplerServerError, UsageError
from ppo_cli.recipe import GenerationConfig, Recipe

ADAPTER_DIR_NAME = "server_adapters"  # under the run directory unless generation.server_adapter_dir says where
MAX_REQUESTS_IN_FLIGHT = 64  # groups sent at once: the server batches them itself
# Unloading the last adapter at the end: one short try (a server that is gone must not hold up the exit).
CLOSING = Policy(timeout_s=5.0, retries=0, retry_backoff_s=0.0, max_concurrency=1)
PROBE = Policy(timeout_s=10.0, retries=0, retry_backoff_s=0.0, max_concurrency=1)  # before anything loads
START_HINT = ("start the server as docs/vllm.md shows (vllm serve MODEL --enable-lora ..., with "
              "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) or fix generation.server_url")
SERVER_HINT = START_HINT + f"; then run again (a training run goes on from its last checkpoint: {RESUME})"
ONE_PROCESS_ONLY = ("generation.backend 'vllm_server' is supported with one training process only",
                    "train with one process (no --num-processes / accelerate launch), or set generation.backend: hf")


def base_url(server_url: str) -> str:
    """The server's root, with or without the /v1 the OpenAI clients add: 'http://h:8000/v1/' -> 'http://h:8000'."""
    url = server_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def completion_body(model: str, prompt: list[int], gen: GenerationConfig, stop_token_id: int, seed: int, n: int) -> dict:
    """The /v1/completions request for one group: the in-process engine's SamplingParams (sampling_kwargs)
    as vLLM's OpenAI-compatible fields, the prompt as token ids, the completions' ids and log-probs asked back.

    ignore_eos: stop at the stop token only, as transformers' generate does (vLLM's server would also stop at
    the tokenizer's EOS); the stop token, EOS by default, still stops it through stop_token_ids."""
    params = sampling_kwargs(gen, stop_token_id, seed, n=n)
    params.pop("detokenize")  # not a request field: the server decodes for "text", which is never read
    return {"model": model, "prompt": prompt, **params, "return_token_ids": True, "ignore_eos": True}


def parse_choices(answer, prompt: list[int], n: int, where: str) -> tuple[list[list[int]], list[list[float]]]:
    """One /v1/completions answer -> its n completions' token ids and log-probs, in index order.
    RemoteFailure when the answer is not that (too few choices, no token ids, a prompt read differently)."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != n:
        got = len(choices) if isinstance(choices, list) else "no"
        raise RemoteFailure(f"{where} answered {got} completions for a request of n={n}")
    tokens, logprobs = [], []
    for choice in sorted(choices, key=lambda c: c.get("index", 0)):
        ids = choice.get("token_ids")
        lps = (choice.get("logprobs") or {}).get("token_logprobs")
        if not isinstance(ids, list) or not isinstance(lps, list) or len(ids) != len(lps):
            raise RemoteFailure(f"{where} answered a completion without its token ids and their log-probs "
                                "(a vLLM before return_token_ids?)")
        sent_back = choice.get("prompt_token_ids")
        if sent_back is not None and list(sent_back) != prompt:
            raise RemoteFailure(f"{where} read the prompt as {len(sent_back)} other token ids than the {len(prompt)} sent")
        tokens.append([int(t) for t in ids])
        logprobs.append([float(x) if x is not None else 0.0 for x in lps])
    return tokens, logprobs


def served_model(answer, where: str) -> str:
    """The base model's name in a /v1/models answer (adapters are listed with a parent)."""
    models = answer.get("data") if isinstance(answer, dict) else None
    bases = [m.get("id") for m in models or () if isinstance(m, dict) and not m.get("parent")]
    if not bases or not isinstance(bases[0], str):
        raise RemoteFailure(f"{where} lists no model: is it a vLLM server?")
    return bases[0]


def check_server(recipe: Recipe, world_size: int = 1, models=()) -> None:
    """Before any model loads: one training process, models the server can sample (``models``: the
    ResolvedModels of `ppo rollout / eval / compare`), and a server that answers GET /v1/models."""
    if world_size > 1:
        raise UsageError(ONE_PROCESS_ONLY[0], hint=ONE_PROCESS_ONLY[1])
    for model in models:
        if model.full_model_dir is not None or (model.base_adapter is not None and model.adapter_dir is not None):
            raise UsageError(
                f"generation.backend 'vllm_server' cannot sample {model.reference}: the server holds the base model "
                "and takes LoRA adapters only, and this model's weights are not the base's",
                hint="sample it with --set generation.backend=hf",
            )
    url = base_url(recipe.generation.server_url)
    try:
        asyncio.run(_get_models(url, PROBE))
    except RemoteFailure as err:
        raise SamplerServerError(f"vLLM server {url} does not answer: {err}", hint=START_HINT) from None


async def _get_models(url: str, policy: Policy):
    async with new_client() as client:
        return served_model(await request_json(client, "GET", url + "/v1/models", policy, Secrets()), url)


class VllmServerSampler:
    """A Sampler (engine/sampler.py) whose completions come from a vLLM server; built by engine.make_sampler
    when generation.backend is vllm_server. Training: the policy's adapter is handed over before every
    rollout. ``model`` (a ResolvedModel, `ppo rollout / eval / compare`): its saved adapter is loaded as is,
    once; a model without one is the server's own base."""

    streams = False  # whole batches come back: the reward requests go out after sampling
    copies_weights = True  # the server samples with its own copy of the weights (the adapter as saved)

    def __init__(self, recipe: Recipe, stop_token_id: int, pad_token_id: int, model=None, adapter_dir: Path | None = None):
        import torch.distributed as torch_dist

        if torch_dist.is_available() and torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
            raise UsageError(ONE_PROCESS_ONLY[0], hint=ONE_PROCESS_ONLY[1])
        gen = recipe.generation
        self.recipe, self.stop_token_id, self.pad_token_id = recipe, stop_token_id, pad_token_id
        self.url = base_url(gen.server_url)
        self.policy = Policy(gen.server_timeout_s, gen.server_retries, retry_backoff_s=1.0,
                             max_concurrency=MAX_REQUESTS_IN_FLIGHT)
        self.secrets = Secrets()
        self._fixed = model
        self._adapter_root = Path(adapter_dir or gen.server_adapter_dir or recipe.run_dir / ADAPTER_DIR_NAME)
        self._made_root = False
        self._prefix = f"ppo-{uuid.uuid4().hex[:8]}"  # this process's adapters: fresh after a resume too
        self._count = 0
        self._fingerprint: bytes | None = None  # of the adapter the server has (engine/sampler.weights_fingerprint)
        self.adapter: tuple[str, Path | None] | None = None  # (name on the server, directory we wrote or None)
        self.base_model = served_model(self._request("GET", "/v1/models"), self.url)

    # --- HTTP -------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body=None, what: str = "", policy: Policy | None = None):
        return asyncio.run(self._requests([(method, path, body)], what, policy))[0]

    async def _requests(self, calls: list[tuple[str, str, object]], what: str, policy: Policy | None = None) -> list:
        policy = policy or self.policy

        async def one(method, path, body):
            # The adapter endpoints answer plain text ("Success: LoRA adapter ... added successfully.")
            return await request_json(client, method, self.url + path, policy, self.secrets, body=body,
                                      json_answer="lora_adapter" not in path)

        async with new_client() as client:
            results = await gather_bounded([lambda c=c: one(*c) for c in calls], policy.max_concurrency)
        for result in results:
            if isinstance(result, RemoteFailure):
                raise self._failure(str(result), what)
            if isinstance(result, BaseException):
                raise result
        return results

    def _failure(self, text: str, what: str) -> SamplerServerError:
        lost = self.adapter is not None and "HTTP 404" in text and self.adapter[0] in text
        if lost:
            return SamplerServerError(f"the vLLM server {self.url} no longer has the policy's adapter {self.adapter[0]} "
                                      "(restarted, or unloaded by someone else)", hint=SERVER_HINT)
        doing = f" while {what}" if what else ""
        return SamplerServerError(f"vLLM server failed{doing}: {self.secrets.redact(text)}", hint=SERVER_HINT)

    # --- the adapter on the server ----------------------------------------------------------------

    def sync(self, policy) -> str:
        """The name to sample with: the policy's adapter as it is now, loaded under a fresh name (the
        previous one unloaded, its directory removed); inference: the model's saved adapter, once."""
        if self._fixed is not None:
            if self.adapter is None:
                if self._fixed.adapter_dir is None:
                    self.adapter = (self.base_model, None)
                else:
                    self._load(Path(self._fixed.adapter_dir).resolve(), written=False)
            return self.adapter[0]
        from ppo_cli.engine.models import POLICY_ADAPTER, adapter_tensors, save_adapter
        from ppo_cli.engine.sampler import weights_fingerprint

        fingerprint = weights_fingerprint(adapter_tensors(policy, POLICY_ADAPTER))
        if self.adapter is not None and fingerprint is not None and fingerprint == self._fingerprint:
            return self.adapter[0]  # the server has these weights already (an evaluation's next batch, a turn)
        self._count += 1
        directory = self._adapter_root / f"{self._prefix}-{self._count}"
        if not self._adapter_root.exists():
            self._adapter_root.mkdir(parents=True)
            self._made_root = True
        save_adapter(policy, POLICY_ADAPTER, directory)
        previous = self.adapter
        self._load(directory.resolve(), written=True)
        self._fingerprint = fingerprint
        if previous is not None:
            self._unload(previous)
        return self.adapter[0]

    def _load(self, directory: Path, written: bool) -> None:
        name = f"{self._prefix}-{self._count}" if written else f"{self._prefix}-{directory.name}"
        body = {"lora_name": name, "lora_path": str(directory)}
        try:
            self._request("POST", "/v1/load_lora_adapter", body, what=f"loading the adapter {directory}")
        except SamplerServerError:
            if written:
                shutil.rmtree(directory, ignore_errors=True)
            raise
        self.adapter = (name, directory if written else None)

    def _unload(self, adapter: tuple[str, Path | None], policy: Policy | None = None) -> None:
        name, directory = adapter
        self._request("POST", "/v1/unload_lora_adapter", {"lora_name": name}, what=f"unloading the adapter {name}",
                      policy=policy)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    # --- sampling ---------------------------------------------------------------------------------

    def sample(self, policy, prompt_ids, prompt_mask, *, with_logprobs=False, keep_hidden=False, on_finished=None,
               max_new_tokens=None) -> Sampled:
        """The Sampler protocol: the server's tokens and log-probs (policy_logprobs False: compared with
        the policy's, never trained on), no hidden states; ``on_finished`` ignored."""
        generation, logprobs = self.generate(policy, prompt_ids, prompt_mask, max_new_tokens)
        return trimmed(generation, logprobs, None, policy_logprobs=False)

    @torch.no_grad()
    def generate(self, policy, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int | None = None):
        """generate.generate's Generation for these (B, P) left-padded prompts and the server's (B, T)
        log-probs, 0 outside the response mask. One request per group of equal rows (n = G), each with a
        seed from torch's global RNG (a resumed run samples what the uninterrupted one did)."""
        gen = with_budget(self.recipe.generation, max_new_tokens)
        name = self.sync(policy)
        G = group_size(prompt_ids, prompt_mask, gen.num_generations)
        seeds = torch.randint(0, 2**31 - 1, (prompt_ids.shape[0] // G,), device="cpu").tolist()
        prompts = [ids[mask].tolist() for ids, mask in zip(prompt_ids[::G], prompt_mask[::G])]
        calls = [("POST", "/v1/completions", completion_body(name, p, gen, self.stop_token_id, s, G))
                 for p, s in zip(prompts, seeds)]
        answers = asyncio.run(self._requests(calls, what="sampling"))
        tokens, logprobs = [], []
        for answer, prompt in zip(answers, prompts):
            try:
                ids, lps = parse_choices(answer, prompt, G, self.url + "/v1/completions")
            except RemoteFailure as err:
                raise self._failure(str(err), "sampling") from None
            tokens += ids
            logprobs += lps
        return build_generation(prompt_ids, prompt_mask, tokens, logprobs, gen.max_new_tokens, self.stop_token_id,
                                self.pad_token_id)

    def close(self) -> None:
        """Unload the last adapter from the server (best effort: the run's outcome does not hang on it) and
        remove the directories this sampler wrote."""
        adapter, self.adapter = self.adapter, None
        if adapter is not None and (adapter[1] is not None or self._fixed is not None) and adapter[0] != self.base_model:
            try:
                self._unload(adapter, CLOSING)
            except SamplerServerError:
                if adapter[1] is not None:
                    shutil.rmtree(adapter[1], ignore_errors=True)
        if self._made_root:
            try:
                self._adapter_root.rmdir()  # only when empty: never anything it did not write
            except OSError:
                pass
