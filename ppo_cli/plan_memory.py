"""Memory arithmetic: how much a recipe needs, role by role, before any weights are loaded (`ppo plan`).

Only the model configs are read (a GGUF file's from its metadata: it loads dequantized, full size);
each model is instantiated on the meta device (no memory, no compute) to count its parameters
exactly: which sit in linear layers (what bitsandbytes quantizes and LoRA adapts) and which do not.
The rest is arithmetic on the recipe:

    weights      parameters x bytes (float32 4, bfloat16/float16 2, 8-bit ~1, 4-bit nf4 ~0.52)
    LoRA         r x (in + out) per adapted linear layer, float32
    gradients    one per trainable parameter, in its dtype
    optimizer    AdamW: two states per trainable parameter, in its dtype (1 B each with optim.name adamw_8bit)
    activations  what the update's forward keeps for the backward, per micro-batch of
                 micro_batch_size x (prompt + response) tokens; measured per token and layer for
                 Llama/Qwen-style decoders with SDPA attention (benchmarks/bench_vs_trl.py plan-check):
                 10 H + 4 I when the weights train, 8 H + 4 I + 7 r with a frozen LoRA base, plus the
                 logits of the response positions (four float32 copies: the logits and the gradients
                 through the log-softmax; seven with an entropy bonus) of one chunk of positions
                 (engine/logprobs.py: LOGITS_PER_CHUNK // V positions), or of the whole micro-batch
                 for a class whose log-probs take its own logits (logprob_path); a half-precision base under
                 float32 LoRA adapters adds peft's float32 copy of each adapted layer's input
                 (both measured on an H200: benchmarks/gpu_check.py);
                 with train.mixed_precision bf16/fp16 activations take 2 B a value, and
                 a full fine-tune keeps a half-precision copy of its weights for the update (autocast)
    rollout      KV cache of the generation + one no-grad forward of the reference/critic/reward (the
                 reward model's under the run's autocast: 2 B a value with bf16/fp16)
    runtime      the process itself: CPU ~0.45 GB (torch, transformers, tokenizers); CUDA context ~0.5 GB;
                 on CPU also the freed activations glibc keeps resident (CPU_HEAP_RETENTION, measured;
                 with gradient checkpointing a share of what the layers compute and free,
                 CPU_HEAP_RETENTION_CHECKPOINTED, or CPU_HEAP_RETENTION_MAPPED where the large
                 blocks are mapped on huge pages)

Peak = weights + LoRA + gradients + optimizer + runtime + max(update activations, rollout working set).
Importing this module does not import torch; ``describe_model`` does (for the meta-device models). Each
critic kind's own part comes from its class (engine/critics.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ppo_cli.auto import value_kind, value_model_path, value_settings, weights_dtype
from ppo_cli.engine.critics import CRITICS
from ppo_cli.engine.malloc import MAPPED_BLOCK_THRESHOLD, large_blocks_on_huge_pages
from ppo_cli.plan_units import DTYPE_BYTES, GB, QUANT_BYTES, Line, activation_floats_per_token_layer, weights_how
from ppo_cli.recipe import LoraConfig, Recipe

RUNTIME_GB = {"cpu": 0.45, "cuda": 0.5}
# CPU: peak RSS above the live tensors, in update activations: glibc keeps the freed ones for reuse
# (engine/malloc.keep_freed_memory) and fragments (docs/benchmarks.md, "Peak memory per configuration").
CPU_HEAP_RETENTION = {"frozen_base": 2.2, "trained": 0.8}
# CPU with gradient checkpointing: peak RSS above the live tensors, in the activations the layers compute
# and free (those the update would keep without checkpointing: each layer's forward and its recompute
# allocate them and free them at once). The live tensors stay small (SmolLM2, LoRA r16, 8 x 139 tokens:
# 0.19 GB above the step's start at the forward's peak, 0.22 in the backward, torch.profiler's memory
# events), but glibc's heap does not reuse the freed blocks, which the small long-lived allocations
# of the autograd graph, built in between, split; the resident set rose 0.81 / 1.43 / 2.81 GB
# beyond the weights at 4 / 8 / 16 rows: 0.84 / 0.80 / 0.83 x those activations over what the plan
# counts already (benchmarks/checkpointed_update_memory.py; docs/benchmarks.md, Round 4).
CPU_HEAP_RETENTION_CHECKPOINTED = 0.8
# ... and with the blocks of 2 MiB or more mapped on huge pages (engine/malloc.heap_mapped), where the
# hidden-state blocks are among them: what the smaller blocks left in the heap and the mapped blocks'
# page rounding add over the live tensors. The peak above this plan without it was 0.35 GB at
# SmolLM2's PPO short run (8 x 139 tokens, 1.46 GB computed: 0.24x) and 0.31 GB at its GRPO shape
# (16 x 91, 1.91 GB: 0.16x); 0.2x puts both within 5% (docs/memory.md, "Large blocks on huge pages").
CPU_HEAP_RETENTION_MAPPED = 0.2
# CPU under FSDP with several processes (engine/malloc.return_freed_memory: blocks of 1 MiB or more mapped,
# glibc trimming the heap's top): the update's peak held freed heap in proportion to the policy's layers
# x hidden size, whatever the micro-batch, read from glibc's main arena at the highest samples
# (benchmarks/glibc_heap_walk.py; docs/distributed.md, "FSDP2 with LoRA: the plan against the peak"):
# 0.46-0.59 GB at the 0.5B widths (24 x 896, LoRA, micro-batch 2 x 23), 0.48-0.58 (4 x 39), 0.08-0.13 with
# 6 of their layers, 0.40-0.50 at SmolLM2 (30 x 576, 2 x 59): 15-29 KB per layer and hidden unit. Where it
# comes from is not found: it follows neither the activations (0.12 to 0.40 GB computed) nor the weights.
# Counted beyond what the factors above give, as a line of its own (fsdp_heap_kept).
FSDP_CPU_HEAP_KEPT_PER_LAYER_HIDDEN = 24_000
# ... and besides the block that computes, FSDP2 holds the next one it prefetches and the all-gather's
# output, which it copies the weights out of: 0.18-0.19 GB of blocks mapped on their own at the 0.5B
# widths' highest samples, 3 x its 0.061 GB block.
FSDP_BLOCKS_IN_FLIGHT = 3
ADAMW_STATES = 2


# --- what the estimate needs from a model config --------------------------------------------------


@dataclass(frozen=True)
class Linear:
    name: str  # module path, e.g. model.layers.0.self_attn.q_proj
    in_features: int
    out_features: int
    bias: bool


@dataclass(frozen=True)
class ModelShape:
    """One model's parameter layout and sizes (from its config, on the meta device)."""

    path: str
    total_params: int  # every parameter once (tied embeddings counted once)
    linears: tuple[Linear, ...]  # the backbone's linear layers: quantizable and LoRA-adaptable
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    # causal LMs: positions per chunk of the chunked log-probs (engine/logprobs.py); None: the model's
    # own logits, whole (a class not in HEAD_STEPS, or not a causal LM)
    logits_chunk: int | None = None
    module_names: tuple[str, ...] = ()  # every module of the model, as peft names them (lm_head included)
    tied_head: bool = False  # the LM head's weight is the input embedding's
    shares_prompts: bool = False  # rows with the same prompt run it once (engine/shared_prompts.py)

    @property
    def linear_params(self) -> int:
        """Weights of the backbone's linear layers (biases excluded: bitsandbytes keeps them)."""
        return sum(l.in_features * l.out_features for l in self.linears)

    def adapted(self, lora: LoraConfig | None) -> list[Linear]:
        """The linear layers LoRA adapts."""
        if lora is None:
            return []
        targets = None if lora.target_modules == "all-linear" else set(lora.target_modules)
        return [l for l in self.linears if targets is None or l.name.rsplit(".", 1)[-1] in targets or l.name in targets]

    @property
    def linear_names(self) -> list[str]:
        """The linear layers' short names (q_proj, ...) in order: what LoRA's all-linear adapts."""
        return list(dict.fromkeys(l.name.rsplit(".", 1)[-1] for l in self.linears))

    def unmatched_targets(self, targets: list[str]) -> list[str]:
        """The names in a LoRA's target_modules that match no module as peft matches them: a module's
        name, or the end of it after a dot (peft's check_target_module_exists)."""
        return [t for t in targets if not any(name == t or name.endswith("." + t) for name in self.module_names)]

    def lora_params(self, lora: LoraConfig | None) -> int:
        return sum(lora.r * (l.in_features + l.out_features) for l in self.adapted(lora))

    def weight_bytes(self, dtype: str, quantization: str = "none", other_dtype_bytes: float | None = None) -> float:
        """Bytes of the weights: the linear layers quantized (or not), everything else in ``dtype``
        (or ``other_dtype_bytes``: prepare_model_for_kbit_training upcasts it to float32 under QLoRA)."""
        full = DTYPE_BYTES[dtype]
        if quantization == "none":
            return self.total_params * full
        rest = self.total_params - self.linear_params
        return self.linear_params * QUANT_BYTES[quantization] + rest * (other_dtype_bytes or full)


def _linear_layers(backbone) -> tuple[Linear, ...]:
    from torch import nn

    return tuple(
        Linear(name, m.in_features, m.out_features, m.bias is not None)
        for name, m in backbone.named_modules()
        if isinstance(m, nn.Linear)
    )


def describe_model(path: str, kind: str, *, trust_remote_code: bool = False, revision: str | None = None,
                   attn_implementation: str | None = None) -> ModelShape:
    """``kind``: 'causal_lm' (policy, reference), 'backbone' (a separate critic) or 'classifier' (reward);
    ``attn_implementation``: the recipe's (None or 'auto': the model's default)."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    from ppo_cli.errors import ModelLoadError, first_line
    from ppo_cli.gguf_cache import gguf_config
    from ppo_cli.model_refs import check_model_reference, is_gguf

    check_model_reference(path)
    try:
        if is_gguf(path):  # the config comes from the file's metadata; the model loads dequantized (full size)
            config = gguf_config(path)
        else:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, revision=revision)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read the config of '{path}': {first_line(err)}") from err
    auto = {"causal_lm": AutoModelForCausalLM, "backbone": AutoModel, "classifier": AutoModelForSequenceClassification}[kind]
    with torch.device("meta"):
        model = auto.from_config(config, trust_remote_code=trust_remote_code)
    backbone = model.base_model if kind != "backbone" else model
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    logits_chunk, tied_head, shares_prompts = None, False, False
    if kind == "causal_lm":
        head = model.get_output_embeddings()
        tied_head = head is not None and head.weight is model.get_input_embeddings().weight
        from ppo_cli.engine.logprobs import LOGITS_PER_CHUNK, logprob_path

        if logprob_path(model) == "chunked":
            logits_chunk = max(1, LOGITS_PER_CHUNK // model.get_output_embeddings().weight.shape[0])
        from ppo_cli.engine.shared_prompts import sharing_model

        if attn_implementation not in (None, "auto"):  # the attention the run will load, not the config's default
            model.config._attn_implementation = attn_implementation
        shares_prompts = sharing_model(model)
    return ModelShape(
        path=path,
        total_params=sum(p.numel() for p in model.parameters()),
        linears=_linear_layers(backbone),
        hidden=text.hidden_size,
        intermediate=getattr(text, "intermediate_size", 4 * text.hidden_size),
        layers=text.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        vocab=text.vocab_size,
        logits_chunk=logits_chunk,
        tied_head=tied_head,
        shares_prompts=shares_prompts,
        module_names=tuple(name for name, _ in model.named_modules()),
    )


# --- the estimate -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """The recipe values the estimate depends on (suggestions change these, not the recipe)."""

    device: str  # cpu | cuda
    dtype: str  # policy dtype, resolved
    quantization: str  # policy base
    lora: LoraConfig | None
    gradient_checkpointing: bool
    reference: str  # 'adapter' (LoRA disabled) | 'copy'
    reference_dtype: str
    reference_quantization: str
    value_kind: str  # head | adapter | model
    value_dtype: str
    value_lora: LoraConfig | None
    rewards: tuple[tuple[str, str, int], ...]  # (dtype, quantization, batch_size) per model component
    micro_batch: int
    mini_batch: int
    rollout_batch: int
    prompt_tokens: int
    response_tokens: int
    token_budget: bool = False  # micro-batches sized by ppo.micro_batch_tokens (micro_batch: what fits)
    value_frozen: bool = False  # value.kind model with train_backbone false: only its head trains
    value_shared: bool = False  # ... and it is the reward model already loaded (no second copy)
    optimizer: str = "adamw"  # optim.name: adamw keeps two moments in the parameter dtype, the 8-bit ones 1 B each
    processes: int = 1  # data-parallel processes (one per GPU); the estimate is per process
    sharding: str = "none"  # none (DDP) | zero2 | zero3 | fsdp (full shard): what is split across processes
    mixed_precision: str = "no"  # train.mixed_precision resolved: bf16/fp16 autocast computes activations in 2 B
    fsdp_per_block: bool = False  # FSDP never gathers the whole policy: rollout per block, no evaluation
    entropy_bonus: bool = False  # ppo.entropy_coef > 0: the entropy's softmax is kept for the backward
    group: int = 1  # generation.num_generations: completions per prompt, which share its forward
    cpu_heap_mapped: bool = False  # CPU: large blocks get huge pages, so a checkpointed update maps them (engine/malloc.heap_mapped)
    pack_weights: bool = True  # generation.pack_weights with backend hf: generate() may pack (sampling_packs)


@dataclass
class Estimate:
    lines: list[Line]
    update_gb: float  # the update's transient peak (activations, logits)
    rollout_gb: float  # the rollout's transient peak (KV cache, no-grad forwards)

    @property
    def static_gb(self) -> float:
        return sum(l.gb for l in self.lines if l.phase in ("static", "runtime"))

    @property
    def total_gb(self) -> float:
        return self.static_gb + max(self.update_gb, self.rollout_gb)


def estimate(s: Settings, policy: ModelShape, value: ModelShape | None, rewards: list[ModelShape],
             reference: ModelShape | None = None) -> Estimate:
    reference = reference or policy
    lines: list[Line] = []
    b = DTYPE_BYTES
    lora = s.lora
    # --- policy
    qlora_rest = 4.0 if s.quantization != "none" and lora is not None else None
    if (lora is not None and s.quantization == "none" and s.mixed_precision != "no" and b[s.dtype] > 2
            and s.processes == 1 and s.sharding == "none"):
        # the frozen base's linear layers stored in the autocast dtype (engine/frozen_weights.py)
        rest = policy.total_params - policy.linear_params
        lines.append(Line("policy", "weights", (policy.linear_params * 2 + rest * b[s.dtype]) / GB,
                          f"{policy.linear_params / 1e6:.1f}M frozen in linear layers x 2 B ({s.mixed_precision}) "
                          f"+ {rest / 1e6:.1f}M x {b[s.dtype]:g} B ({s.dtype})"))
    else:
        lines.append(Line("policy", "weights", policy.weight_bytes(s.dtype, s.quantization, qlora_rest) / GB,
                          weights_how(policy, s.dtype, s.quantization)))
    if lora is not None:
        n = policy.lora_params(lora)
        lines.append(Line("policy", "LoRA adapter", n * 4 / GB, f"{n / 1e6:.2f}M params (r={lora.r}) x 4 B"))
        trainable_policy, grad_bytes = n, 4.0
    else:
        trainable_policy, grad_bytes = policy.total_params, b[s.dtype]
    lines.append(Line("policy", "gradients", trainable_policy * grad_bytes / GB,
                      f"{trainable_policy / 1e6:.2f}M trainable x {grad_bytes:g} B"))
    state_bytes = _optimizer_state_bytes(s.optimizer, grad_bytes)
    lines.append(Line("policy", "AdamW states", ADAMW_STATES * trainable_policy * state_bytes / GB,
                      f"2 x {trainable_policy / 1e6:.2f}M x {state_bytes:g} B"
                      + (" (8-bit AdamW)" if s.optimizer != "adamw" else "")))
    # --- reference
    if s.reference == "adapter":
        lines.append(Line("reference", "weights", 0.0, "the policy's base with the LoRA adapter disabled"))
    else:
        lines.append(Line("reference", "weights",
                          reference.weight_bytes(s.reference_dtype, s.reference_quantization) / GB,
                          "frozen copy: " + weights_how(reference, s.reference_dtype, s.reference_quantization)))
    # --- value: what the critic kind keeps besides the policy (engine/critics.py)

    critic = CRITICS[s.value_kind].memory(s, policy, value, lora)
    lines += critic.static
    value_state_bytes = _optimizer_state_bytes(s.optimizer, critic.param_bytes)
    if critic.trainable:  # value.kind none trains nothing
        lines.append(Line("value", "gradients + AdamW states",
                          (critic.param_bytes + ADAMW_STATES * value_state_bytes) * critic.trainable / GB,
                          f"{critic.trainable / 1e6:.2f}M x ({critic.param_bytes:g} + 2 x {value_state_bytes:g}) B"))
    # --- reward
    for shape, (dtype, quantization, _) in zip(rewards, s.rewards):
        lines.append(Line("reward", f"weights ({Path(shape.path).name})", shape.weight_bytes(dtype, quantization) / GB,
                          weights_how(shape, dtype, quantization)))

    # --- update: activations of one micro-batch, forward kept for the backward
    B, L, T = s.micro_batch, s.prompt_tokens + s.response_tokens, s.response_tokens
    cb = 2.0 if s.mixed_precision != "no" else b[s.dtype]  # autocast: matmul outputs in half precision
    trains_weights = lora is None
    r = lora.r if lora is not None else 0
    rows, width, shape_how = update_rows(policy, s)  # the micro-batch as its forward runs it
    tokens = rows * width
    per_layer = activation_floats_per_token_layer(policy, trains_weights, r, width)
    computed = tokens * policy.layers * per_layer * cb  # what the layers compute for the backward, all of them
    if s.gradient_checkpointing:  # layer inputs kept; one layer's activations live during its recompute
        per_token = policy.layers * policy.hidden + per_layer
        how = f"checkpointed: {shape_how} x ({policy.layers} layer inputs + 1 layer) x {cb:g} B"
    else:
        per_token = policy.layers * per_layer
        how = f"{shape_how} x {policy.layers} layers x {per_layer:,.0f} values x {cb:g} B"
    act = tokens * per_token * cb
    update = [Line("policy", "activations (update)", act / GB, how, "update")]
    if s.mixed_precision != "no" and trains_weights and b[s.dtype] > 2:
        # autocast caches the half-precision copy of each trainable weight for the forward and backward
        update.append(Line("policy", "autocast weight copies (update)", policy.linear_params * 2 / GB,
                           f"{policy.linear_params / 1e6:.1f}M linear weights x 2 B ({s.mixed_precision})", "update"))
    if lora is not None and s.mixed_precision == "no" and b[s.dtype] < 4:
        # peft keeps the adapters in float32 and casts each adapted layer's half-precision input up to
        # them: a float32 copy per adapted layer (q, k and v each their own), kept for the backward
        per_layer = sum(l.in_features for l in policy.adapted(lora)) / policy.layers
        layers = 1 if s.gradient_checkpointing else policy.layers
        update.append(Line("policy", "LoRA input casts (update)", tokens * layers * per_layer * 4 / GB,
                           f"{shape_how} x {layers} layers x {per_layer:,.0f} adapted inputs x 4 B (float32 "
                           "adapters)", "update"))
    update += critic.update
    # Alive at the backward's peak: the float32 logits and three gradients through the log-softmax; an
    # entropy bonus adds its softmax and three more gradients (the allocator's history of a 1.5B update
    # on an H200: 4 copies without, 7 with; the graph, so the count, is the same on a CPU). Chunked
    # (engine/logprobs.py), of one chunk's positions: the backward recomputes a chunk at a time.
    copies = 7 if s.entropy_bonus else 4
    rows, rows_how = logits_rows(policy, B, T)
    logits = copies * rows * policy.vocab * 4
    update.append(Line("policy", "logits (update)", logits / GB,
                       f"{copies} float32 copies (log-softmax and its backward{', entropy' if s.entropy_bonus else ''}) x "
                       f"{rows_how} x {policy.vocab} vocab x 4 B", "update"))
    if s.device == "cpu" and s.gradient_checkpointing:
        # What the heap keeps follows what the layers compute and free, not the layer inputs kept. Mapped
        # on huge pages, blocks of MAPPED_BLOCK_THRESHOLD or more go back to the kernel when freed; where a
        # hidden-state block (B, L, H) is smaller, the layers' many such blocks stay in the heap and split
        # it as before (0.5B widths at 16 x 31 tokens: 1.8 MB). FSDP maps its own way (return_freed_memory).
        hidden_block = tokens * policy.hidden * cb
        mapped = s.cpu_heap_mapped and s.sharding != "fsdp" and hidden_block >= MAPPED_BLOCK_THRESHOLD
        factor = CPU_HEAP_RETENTION_MAPPED if mapped else CPU_HEAP_RETENTION_CHECKPOINTED
        how = ", blocks of 2 MiB or more mapped on huge pages" if mapped else ""
        update.append(Line("runtime", "freed memory kept (update)", factor * computed / GB,
                           f"CPU heap: {factor:g} x the {computed / GB:.2f} GB of activations the checkpointed "
                           f"layers compute and free stay resident (measured{how})", "update"))
    elif s.device == "cpu":
        factor = CPU_HEAP_RETENTION["trained" if trains_weights else "frozen_base"]
        # The activations only: counting the logits in too overestimates a large vocabulary's peak
        # (docs/benchmarks.md, "Peak memory per configuration").
        activations = sum(l.gb for l in update if l.part.startswith("activations"))
        update.append(Line("runtime", "freed memory kept (update)", factor * activations,
                           f"CPU heap: {factor:g} x the update's activations stay resident (measured)", "update"))

    # --- rollout: KV cache of the generation, one no-grad forward's working set
    R = s.rollout_batch
    # Keys and values leave RoPE in float32 under autocast (bf16 projections x float32 cos/sin), so
    # transformers' KV cache keeps the weights' dtype; the reserved cache (engine/reserved_cache.py, for
    # the classes that take a caller's cache) holds them in the autocast dtype the attention casts them to.
    reserved = policy.shares_prompts and s.mixed_precision in ("bf16", "fp16")
    kvb = 2.0 if reserved else b[s.dtype]
    kv = 2 * policy.layers * policy.kv_heads * policy.head_dim * R * L * kvb
    work = B * L * (3 * policy.intermediate + 4 * policy.hidden) * cb + 2 * rows * policy.vocab * 4
    for shape, (dtype, _, batch) in zip(rewards, s.rewards):
        # a reward model computes under the run's autocast (engine/rewards/model.py): 2 B a value then
        rb = 2.0 if s.mixed_precision != "no" else b[dtype]
        work = max(work, min(batch, R) * L * (3 * shape.intermediate + 4 * shape.hidden) * rb)
    rollout = [
        Line("rollout", "KV cache", kv / GB,
             f"2 x {policy.layers} layers x {policy.kv_heads} KV heads x {policy.head_dim} x {R} x {L} tokens x {kvb:g} B", "rollout"),
        Line("rollout", "no-grad forward working set", work / GB, "one layer's temporaries + logits, largest model", "rollout"),
    ]
    if sampling_packs(s):
        # engine/lean_lora.py: each adapted layer's frozen weight joined to its scaled B, (out, in + r), and
        # engine/packed_linear.py the head, laid out for oneDNN once per generate() call, beside the weights
        adapted = sum((l.in_features + lora.r) * l.out_features for l in policy.adapted(lora))
        rollout.append(Line("rollout", "bf16 weights packed for sampling", adapted * 2 / GB,
                            f"{adapted / 1e6:.1f}M adapted linear weights and their B x 2 B, while sampling",
                            "rollout"))
        rollout.append(Line("rollout", "LM head packed for sampling", policy.vocab * policy.hidden * 2 / GB,
                            f"the head, {policy.vocab} x {policy.hidden} x 2 B, while sampling", "rollout"))
    elif (lora is not None and s.mixed_precision != "no" and b[s.dtype] > 2 and policy.tied_head
          and not decodes_per_block(s)):
        # engine/generate.py head_cast_once: the frozen tied head cast once for the whole generate() call
        # (with the policy whole while sampling: FSDP per block shards it, and head_cast_once leaves it)
        rollout.append(Line("rollout", "LM head cast for sampling", policy.vocab * policy.hidden * 2 / GB,
                            f"the tied head, {policy.vocab} x {policy.hidden} x 2 B ({s.mixed_precision}), while sampling",
                            "rollout"))
    runtime = Line("runtime", "process" if s.device == "cpu" else "CUDA context", RUNTIME_GB[s.device],
                   "torch + transformers + tokenizers, resident" if s.device == "cpu" else "CUDA context and kernels",
                   "runtime")
    lines, update, rollout = shard(s, policy, lines, update, rollout, rewards)
    return Estimate(lines + update + rollout + [runtime], sum(l.gb for l in update), sum(l.gb for l in rollout))


def sampling_packs(s: Settings) -> bool:
    """Whether generate() packs the policy's bf16 products (engine/packed_linear.py): generation.pack_weights
    with backend hf, a LoRA policy on a whole (not 4-bit, not per-block sharded) base under bf16 autocast,
    on a CPU where oneDNN computes bf16, for responses long enough to pay."""
    from ppo_cli.engine.packed_linear import packing_pays

    return (s.pack_weights and s.lora is not None and s.quantization == "none" and s.mixed_precision == "bf16"
            and not decodes_per_block(s) and packing_pays(s.device, s.response_tokens))


def decodes_per_block(s: Settings) -> bool:
    """FSDP shards the policy and each block gathers itself in its forward while sampling (the recipe's
    train.fsdp_rollout per_block counts only under FSDP)."""
    return s.sharding == "fsdp" and s.fsdp_per_block


def fsdp_heap_kept(policy: ModelShape, update: list[Line]) -> list[Line]:
    """CPU, FSDP over several processes: the freed heap measured there (FSDP_CPU_HEAP_KEPT_PER_LAYER_HIDDEN)
    beyond the ``update``'s `freed memory kept` line, as a line of its own: checkpointing does not
    shrink it, so plan_checkpointing does not count it among the activations."""
    kept = policy.layers * policy.hidden * FSDP_CPU_HEAP_KEPT_PER_LAYER_HIDDEN / GB
    by_factor = sum(l.gb for l in update if l.part == "freed memory kept (update)")
    if by_factor >= kept:
        return []
    return [Line("runtime", "freed heap of the gathers (update)", kept - by_factor,
                 f"CPU heap under FSDP: {policy.layers} layers x {policy.hidden} hidden x "
                 f"{FSDP_CPU_HEAP_KEPT_PER_LAYER_HIDDEN // 1000} KB freed and kept in all (measured), less the "
                 f"line above", "update")]


def logits_rows(policy: ModelShape, micro_batch: int, response_tokens: int) -> tuple[int, str]:
    """Positions whose float32 logits live at once in a forward (and its backward), and how that was
    counted: one chunk of the micro-batch's response positions (chunked log-probs), else all of them."""
    positions = micro_batch * response_tokens
    if policy.logits_chunk is None:
        return positions, f"{micro_batch} x {response_tokens} response tokens"
    if policy.logits_chunk >= positions:
        return positions, f"{micro_batch} x {response_tokens} response tokens (one chunk)"
    return policy.logits_chunk, f"{policy.logits_chunk} positions (a chunk of {micro_batch} x {response_tokens})"


# What each sharding splits across the processes, by (role, part); the rest stays whole on every process.
SHARDED_PARTS = {
    "none": set(),
    "zero2": {("policy", "gradients"), ("policy", "AdamW states"), ("value", "gradients + AdamW states")},
}
SHARDING = ("none", "zero2", "zero3", "fsdp")


def shard(s: Settings, policy: ModelShape, lines: list[Line], update: list[Line], rollout: list[Line],
          rewards: list[ModelShape] = ()):
    """Per-process lines under ``s.sharding`` over ``s.processes``. ZeRO-2 splits the gradients and AdamW
    states of what trains; ZeRO-3 and FSDP (full shard) also split the weights of the model handed to
    prepare() (the policy, its frozen LoRA base included unless quantized, and the critic). FSDP also
    shards each unquantized reward model block by block (Distributed.shard_reward_models), gathering
    what no block holds and one block at a time while scoring; the frozen reference copy, quantized
    reward models and one that is the frozen critic's backbone stay whole. Generation needs the whole policy: ppo_cli gathers it
    for the rollout (counted: the full weights less the process's own shard under ZeRO-3, the full
    weights under FSDP2, whose gathered buffers are separate from the shard; per block under FSDP
    with train.fsdp_rollout per_block), and the update gathers one decoder layer at a time (counted:
    the weights / layers). FSDP under bf16/fp16 gathers in that dtype (Distributed.prepare's
    MixedPrecisionPolicy), the shards staying in theirs: every gathered figure at 2 B a value, and no
    autocast copies of the weights (they arrive in the compute dtype). FSDP on CPU also holds two more
    layers in the update (the next one prefetched, the all-gather's buffer) and the freed heap its gathers
    leave (fsdp_heap_kept), both measured."""
    n = s.processes
    if s.sharding == "none" or n == 1:
        return lines, update, rollout
    full_shard = s.sharding in ("zero3", "fsdp")
    # value_shared: which reward model is the critic's is not known here; all stay whole (an overestimate)
    sharded_rewards = [(shape, f"weights ({Path(shape.path).name})", dtype)
                       for shape, (dtype, quantization, _) in zip(rewards, s.rewards)
                       if s.sharding == "fsdp" and quantization == "none" and not s.value_shared]

    def split(line: Line) -> bool:
        key = (line.role, line.part)
        if key in SHARDED_PARTS["zero2"]:
            return True
        if not full_shard or line.phase != "static":
            return False
        policy_weights = key == ("policy", "weights") and s.quantization == "none"
        reward_weights = line.role == "reward" and any(line.part == part for _, part, _ in sharded_rewards)
        return policy_weights or key == ("policy", "LoRA adapter") or line.role == "value" or reward_weights

    out = [dataclasses.replace(line, gb=line.gb / n, how=f"{line.how}, / {n} ({s.sharding})") if split(line) else line
           for line in lines]
    if full_shard:
        weights = sum(line.gb for line in lines if line.role == "policy" and line.part in ("weights", "LoRA adapter"))
        gathered = weights - sum(line.gb for line in out if line.role == "policy" and line.part in ("weights", "LoRA adapter"))
        if s.sharding == "fsdp" and s.quantization == "none":
            # the policy's gathers in the compute dtype: its weights (and adapters) scaled from their own
            # bytes to 2 (the shards stay as they are, counted above)
            cast = fsdp_gather_bytes(s, s.dtype) / DTYPE_BYTES[s.dtype]
            weights, gathered = weights * cast, gathered * cast
            if cast < 1:
                update = [line for line in update if line.part != "autocast weight copies (update)"]
        note = f", in {s.mixed_precision} (2 B a value)" if s.sharding == "fsdp" and s.mixed_precision in ("bf16", "fp16") else ""
        if s.sharding == "fsdp" and s.fsdp_per_block:
            # What no block holds (embeddings, final norm; the linear layers are all in blocks) stays
            # gathered; one block at a time is whole.
            linear = policy.linear_params / policy.total_params
            outside, block = gathered * (1 - linear), weights * linear / policy.layers
            line = Line("rollout", "policy gathered for generation", outside + block,
                        f"the other {n - 1} processes' shards of the weights outside the blocks, and one "
                        f"block whole at a time (train.fsdp_rollout: per_block){note}", "rollout")
        elif s.sharding == "fsdp":
            # FSDP2 gathers into buffers of its own: the process's shard stays beside the whole weights
            # (docs/benchmarks.md, "FSDP's freed blocks unmapped": fsdp-gathered).
            line = Line("rollout", "policy gathered for generation", weights,
                        f"the whole policy, beside the process's own shard, while sampling{note}", "rollout")
        else:
            line = Line("rollout", "policy gathered for generation", gathered,
                        f"the other {n - 1} processes' shards of the policy, whole while sampling", "rollout")
        rollout = rollout + [line]
        if sharded_rewards:
            # Scoring gathers the root (embeddings, final norm, head) and one block at a time; the largest model's.
            def gathered_gb(shape: ModelShape, dtype: str) -> float:
                linear = shape.linear_params / shape.total_params
                weights = shape.weight_bytes(dtype, "none") / GB * fsdp_gather_bytes(s, dtype) / DTYPE_BYTES[dtype]
                return weights * (1 - linear) * (n - 1) / n + weights * linear / shape.layers

            rollout = rollout + [Line("rollout", "reward model gathered for scoring",
                                      max(gathered_gb(shape, dtype) for shape, _, dtype in sharded_rewards),
                                      f"the other {n - 1} processes' shards of the weights outside the blocks, "
                                      f"and one block whole at a time{note}", "rollout")]
        update = update + [Line("policy", "one layer gathered (update)", weights / policy.layers,
                                f"policy weights / {policy.layers} layers, gathered layer by layer{note}", "update")]
        if s.sharding == "fsdp" and s.device == "cpu":
            extra = FSDP_BLOCKS_IN_FLIGHT - 1
            update.append(Line("policy", "next layer and all-gather buffer (update)", extra * weights / policy.layers,
                               f"{extra} x one layer: FSDP2's prefetch of the next and the buffer it gathers into "
                               f"(measured on CPU){note}", "update"))
            update += fsdp_heap_kept(policy, update)
    return out, update, rollout


def fsdp_gather_bytes(s: Settings, dtype: str) -> float:
    """Bytes a value that FSDP gathers weights stored in ``dtype`` into: 2 under bf16/fp16 mixed precision
    (fsdp_mixed_precision_policy in distributed.py casts the gathers), else the stored dtype's."""
    stored = DTYPE_BYTES[dtype]
    return min(2.0, stored) if s.mixed_precision in ("bf16", "fp16") else stored


def _optimizer_state_bytes(optimizer: str, param_bytes: float) -> float:
    """Bytes per AdamW moment per parameter: the parameter's own dtype, or 1 for the 8-bit optimizers
    (their per-block scales add under 1%)."""
    return param_bytes if optimizer == "adamw" else 1.0


# --- suggestions ----------------------------------------------------------------------------------


@dataclass
class Suggestion:
    change: str  # in words
    overrides: list[str]  # --set items that make it
    total_gb: float
    fits: bool


def suggestions(s: Settings, shapes: dict, budget_gb: float) -> list[Suggestion]:
    """Recipe changes, one at a time and all together, with the total each gives."""
    out: list[tuple[str, list[str], Settings]] = []
    combined, combined_sets, n_combined = s, [], 0

    def offer(change: str, sets: list[str], alt: Settings, combine: bool = True) -> None:
        nonlocal combined, combined_sets, n_combined
        out.append((change, sets, alt))
        if combine:
            combined, combined_sets, n_combined = _merge(combined, alt, s), combined_sets + sets, n_combined + 1

    if s.lora is None and s.value_kind == "none":
        offer("train a LoRA adapter (the reference is then the adapter disabled)", ["policy.lora={r: 16}"],
              dataclasses.replace(s, lora=LoraConfig(), reference="adapter"))
    elif s.lora is None:
        offer("train a LoRA adapter (the reference is then the adapter disabled; value head on the policy)",
              ["policy.lora={r: 16}", "value.kind=head"],
              dataclasses.replace(s, lora=LoraConfig(), reference="adapter", value_kind="head"))
    elif s.value_kind not in ("head", "none"):
        offer("value head on the policy instead of a separate critic", ["value.kind=head"],
              dataclasses.replace(s, value_kind="head"))
    if s.lora is not None and s.quantization == "none":
        offer("4-bit policy base (QLoRA)", ["policy.quantization=4bit"], dataclasses.replace(s, quantization="4bit"))
    elif s.lora is None:  # only together with the LoRA change above
        combined = dataclasses.replace(combined, quantization="4bit")
        combined_sets.append("policy.quantization=4bit")
    if s.reference == "copy" and s.reference_quantization == "none":
        # With the LoRA change there is no copy any more: not part of the combination.
        offer("4-bit reference copy", ["reference.quantization=4bit"],
              dataclasses.replace(s, reference_quantization="4bit"), combine=s.lora is not None)
    if any(q == "none" for _, q, _ in s.rewards):
        sets = [f"reward.components.{i}.quantization=4bit" for i, (_, q, _) in enumerate(s.rewards) if q == "none"]
        offer("4-bit reward model", sets, dataclasses.replace(s, rewards=tuple((d, "4bit", n) for d, _, n in s.rewards)))
    if s.lora is None and s.optimizer == "adamw":
        offer("8-bit AdamW (bitsandbytes)", ["optim.name=adamw_8bit"], dataclasses.replace(s, optimizer="adamw_8bit"))
    if sampling_packs(s):
        offer("sample on the weights as they are (no packed copy)", ["generation.pack_weights=false"],
              dataclasses.replace(s, pack_weights=False))
    if not s.gradient_checkpointing:
        offer("gradient checkpointing", ["train.gradient_checkpointing=true"],
              dataclasses.replace(s, gradient_checkpointing=True))
    smaller = [m for m in range(s.micro_batch - 1, 0, -1) if s.mini_batch % m == 0]
    for micro in smaller:
        sets = ([f"ppo.micro_batch_tokens={micro * (s.prompt_tokens + s.response_tokens)}"] if s.token_budget
                else [f"ppo.micro_batch_size={micro}"])
        offer(f"micro-batch {micro} (same mini-batch, more gradient accumulation)", sets,
              dataclasses.replace(s, micro_batch=micro), combine=micro == smaller[-1])
    if n_combined > 1:
        out.append(("all of the above", combined_sets, combined))
    totals = [(change, sets, total_estimate(alt, shapes).total_gb) for change, sets, alt in out]
    return [Suggestion(change, sets, total, total <= budget_gb) for change, sets, total in totals]


def _merge(current: Settings, alt: Settings, base: Settings) -> Settings:
    changed = {f.name: getattr(alt, f.name) for f in dataclasses.fields(Settings) if getattr(alt, f.name) != getattr(base, f.name)}
    return dataclasses.replace(current, **changed)


# --- from a recipe ---------------------------------------------------------------------------------


def settings_from_recipe(recipe: Recipe, device: str, prompt_len: int, mixed_precision: str = "no") -> Settings:
    """``mixed_precision``: train.mixed_precision resolved (commands/plan.py's planned_precision)."""

    def dtype(name: str | None, fallback: str) -> str:
        return weights_dtype(name or fallback, device)

    pol, value = recipe.policy, value_settings(recipe)
    policy_dtype = dtype(pol.dtype, "float32")
    value_dtype = dtype(value.dtype, policy_dtype)
    frozen = value.kind == "model" and value.train_backbone is False
    rewards = tuple(
        (dtype(c.dtype, "float32"), c.quantization, c.batch_size)
        for c in recipe.reward.components if c.loads_model
    )
    return Settings(
        device=device, dtype=policy_dtype, quantization=pol.quantization, lora=pol.lora,
        # auto: off here, resolved by commands/plan.py's planned_checkpointing over this estimate
        gradient_checkpointing=recipe.train.gradient_checkpointing is True,
        reference="adapter" if pol.lora is not None and recipe.reference.path is None else "copy",
        reference_dtype=dtype(recipe.reference.dtype, policy_dtype), reference_quantization=recipe.reference.quantization,
        value_kind=value.kind, value_dtype=value_dtype, value_lora=recipe.value.lora,
        rewards=rewards, micro_batch=update_micro_batch(recipe, prompt_len), mini_batch=recipe.ppo.mini_batch_size,
        rollout_batch=recipe.episodes_per_update,
        prompt_tokens=prompt_len, response_tokens=response_budget(recipe),
        token_budget=recipe.ppo.micro_batch_tokens is not None,
        value_frozen=frozen, optimizer=recipe.optim.name,
        mixed_precision=mixed_precision,
        entropy_bonus=recipe.ppo.entropy_coef > 0,
        group=recipe.generation.num_generations,
        pack_weights=recipe.generation.pack_weights and recipe.generation.backend == "hf",
        cpu_heap_mapped=device == "cpu" and large_blocks_on_huge_pages(),
        # Evaluation gathers the whole policy on every process.
        fsdp_per_block=recipe.train.fsdp_rollout == "per_block" and not recipe.data.eval_prompts,
        value_shared=frozen and any(
            c.path == value_model_path(recipe) and dtype(c.dtype, "float32") == value_dtype and c.quantization == "none"
            for c in recipe.reward.components if c.loads_model
        ),
    )


def update_rows(policy: ModelShape, s: Settings) -> tuple[int, int, str]:
    """(rows, tokens per row, how) of an update micro-batch as its forward runs it: B x (P + T), or where
    the policy shares prompts and every mini-batch holds whole groups (the rollout in one mini-batch),
    each prompt's completions packed behind it (engine/shared_prompts.py), k to a row as its cost model
    chooses. trainer.prompts_together puts a group's completions in one micro-batch."""
    B, P, T = s.micro_batch, s.prompt_tokens, s.response_tokens
    plain = (B, P + T, f"{B} x {P + T} tokens")
    if not policy.shares_prompts or s.group < 2 or s.token_budget or s.mini_batch < s.rollout_batch:
        return plain
    from ppo_cli.engine.shared_prompts import completions_per_row, packed_rows, pair_and_token_cost

    sizes = [s.group] * (B // s.group) + ([B % s.group] if B % s.group else [])
    k = completions_per_row(sizes, P, T, *pair_and_token_cost(policy.hidden, policy.intermediate))
    if k == 1:
        return plain
    rows, width = packed_rows(sizes, P, T, k)
    return rows, width, f"{rows} x {width} tokens ({B} episodes: each prompt once for {min(k, max(sizes))} completions)"


def response_budget(recipe: Recipe) -> int:
    """The most tokens after a prompt: generation.max_new_tokens, or with an environment its
    max_episode_tokens (the policy's turns and the environment's messages together)."""
    if recipe.environment is not None:
        return recipe.environment.max_episode_tokens
    return recipe.generation.max_new_tokens


def update_micro_batch(recipe: Recipe, prompt_len: int) -> int:
    """Episodes per update forward: micro_batch_size, or, with a token budget, as many full-length
    episodes as fit in it (the worst case: every response runs to response_budget)."""
    ppo = recipe.ppo
    if ppo.micro_batch_tokens is None:
        return ppo.micro_batch_size
    return max(1, min(ppo.mini_batch_size, ppo.micro_batch_tokens // (prompt_len + response_budget(recipe))))


def model_shapes(recipe: Recipe) -> dict:
    pol = recipe.policy
    common = dict(trust_remote_code=pol.trust_remote_code)
    shapes = {"policy": described("policy.path", pol.path, "causal_lm", revision=pol.revision,
                                  attn_implementation=pol.attn_implementation, **common)}
    if recipe.reference.path is not None:
        shapes["reference"] = described("reference.path", recipe.reference.path, "causal_lm", **common)
    if value_kind(recipe) == "model":
        shapes["value"] = described("value.path", value_model_path(recipe), "backbone", **common)
    shapes["rewards"] = [
        described(f"reward.components.{index}.path", c.path, "classifier", trust_remote_code=c.trust_remote_code)
        for index, c in enumerate(recipe.reward.components) if c.loads_model
    ]
    return shapes


def described(key: str, path: str, kind: str, **options) -> ModelShape:
    from ppo_cli.errors import naming_field

    with naming_field(key):
        return describe_model(path, kind, **options)


def total_estimate(s: Settings, shapes: dict) -> Estimate:
    return estimate(s, shapes["policy"], shapes.get("value"), shapes["rewards"], shapes.get("reference"))
