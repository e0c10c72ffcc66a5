"""The ActorCritic: policy, reference and critic behind one module, and its forward passes.

``build_actor_critic`` loads the roles as the recipe describes (engine/models.py loads each model,
engine/critics.py builds the value.kind's network); ``policy_forward`` / ``value_forward`` /
``PolicyAndValue`` give the rollout's and the update's log-probs, entropies and values (the per-token
log-prob forward itself, in chunks of positions, is engine/logprobs.py).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from ppo_cli.auto import same_tokenizer, value_kind, value_model_path
from ppo_cli.engine.critics import CRITICS, Critic, values_from_hidden
from ppo_cli.engine.logprobs import response_hidden, response_logprobs
from ppo_cli.engine.models import (
    POLICY_ADAPTER,
    freeze,
    load_causal_lm,
    peft_lora_config,
    resolve_dtype,
    unwrap_causal_lm,
)
from ppo_cli.errors import ModelReferenceError
from ppo_cli.recipe import Recipe


class ActorCritic(nn.Module):
    """Policy, value and reference behind one interface, whatever the memory layout.

    ``critic``: the value model's kind (engine/critics.py), which knows its network and parameters
    (value.kind none: a NoCritic, never None);
    ``value_head`` (float32 ``Linear(H, 1)``) and ``value_backbone`` (kind model's network) are
    registered here so that one module holds every trained parameter.
    """

    def __init__(self, policy: nn.Module, critic: Critic, value_head: nn.Linear | None,
                 value_backbone: nn.Module | None = None, ref_model: nn.Module | None = None,
                 head_trains_backbone: bool = False):
        super().__init__()
        self.policy = policy
        self.critic = critic
        self.head_trains_backbone = head_trains_backbone
        self.value_head = value_head
        self.value_backbone = value_backbone
        self.ref_model = ref_model
        self.reference_is_policy = False  # inference on the reference itself: the KL is 0 by definition
        self.is_peft = hasattr(policy, "disable_adapter")
        self._trainable = [p for p in self.parameters() if p.requires_grad]
        self._trainable_names = {name for name, p in self.named_parameters() if p.requires_grad}

    @property
    def value_kind(self) -> str:
        return self.critic.kind

    # peft's set_adapter also flips requires_grad so that only the named adapter trains; both of
    # ours must keep their gradients (one backward covers both), so restore them after switching.
    # By name: under FSDP the registered parameter objects change (sharded or gathered ones).
    def use_adapter(self, name: str) -> None:
        if self.is_peft and self.policy.active_adapter != name:
            self.policy.set_adapter(name)
            for param_name, param in self.named_parameters():
                if param_name in self._trainable_names:
                    param.requires_grad_(True)

    @contextlib.contextmanager
    def adapter_active(self, name: str):
        """``name`` the active adapter inside, the one active before restored after."""
        previous = self.policy.active_adapter
        self.use_adapter(name)
        try:
            yield
        finally:
            self.use_adapter(previous)

    def recompute_under_the_forwards_adapter(self) -> None:
        """Gradient checkpointing of a peft policy with several adapters: each layer's recompute, which runs
        in the backward, runs under the adapter that was active in its forward (torch's context_fn), so a
        forward under the value adapter (value.kind adapter) can be checkpointed like the policy's.
        Without it the recompute would take whatever adapter is active in the backward (the policy's)
        and the value adapter would get the policy adapter's gradients."""
        from torch.utils.checkpoint import checkpoint

        def context_fn():
            return contextlib.nullcontext(), self.adapter_active(self.policy.active_adapter)

        recompute = functools.partial(checkpoint, **CHECKPOINT_KWARGS, context_fn=context_fn)
        for module in self.policy.modules():
            if getattr(module, "gradient_checkpointing", False) is True:
                module._gradient_checkpointing_func = recompute

    @contextlib.contextmanager
    def reference_context(self):
        """Inside it, ``self.policy`` computes the reference (LoRA disabled) when there is no separate copy."""
        if self.ref_model is None and self.is_peft:
            with self.policy.disable_adapter():
                yield
        else:
            yield

    def default_value_lr(self, policy_lr: float) -> float:
        return self.critic.default_lr(self, policy_lr)

    @property
    def value_features_fixed(self) -> bool:
        return self.critic.features_fixed(self)

    @property
    def value_reads_policy_hidden(self) -> bool:
        return self.critic.reads_policy_hidden

    def list_trainable_again(self) -> None:
        """Read the trainable parameters anew, after sharding replaced a module's parameters
        (Distributed.keep_value_head_in_float32); the list made at construction holds the replaced ones."""
        self._trainable = [p for p in self.parameters() if p.requires_grad]

    def policy_parameters(self) -> list[nn.Parameter]:
        value_ids = {id(p) for p in self.value_parameters()}
        return [p for p in self._trainable if id(p) not in value_ids]

    def value_parameters(self) -> list[nn.Parameter]:
        return self.critic.value_parameters(self)


def _value_head(hidden_size: int, device: torch.device, init_from: nn.Module | None = None) -> nn.Linear:
    head = nn.Linear(hidden_size, 1, bias=True)
    nn.init.normal_(head.weight, std=1.0 / (hidden_size + 1) ** 0.5)
    nn.init.zeros_(head.bias)
    score = getattr(init_from, "score", None) if init_from is not None else None
    if isinstance(score, nn.Linear) and score.out_features == 1:  # a scalar reward model's head (InstructGPT)
        with torch.no_grad():
            head.weight.copy_(score.weight.float())
            if score.bias is not None:
                head.bias.copy_(score.bias.float())
    return head.to(device=device, dtype=torch.float32)


# Non-reentrant checkpointing: a frozen base's layer inputs need no requires_grad for the LoRA
# adapters inside the layer to get their gradients (peft's enable_input_require_grads is for the
# reentrant kind), and keyword arguments (attention masks, position embeddings) pass through.
CHECKPOINT_KWARGS = {"use_reentrant": False}


def build_actor_critic(recipe: Recipe, device: torch.device, loaded: dict[str, nn.Module] | None = None,
                       gradient_checkpointing: bool = False) -> ActorCritic:
    """Load the policy (+LoRA), the reference and the value model as the recipe describes.

    ``loaded``: sequence-classification models already in memory (the reward's), by path. A frozen
    value model on one of them (value.train_backbone: false) shares its weights instead of a copy.
    ``gradient_checkpointing``: train.gradient_checkpointing resolved, for the policy and a trained
    value.kind model's backbone.
    """
    pol = recipe.policy
    dtype = resolve_dtype(pol.dtype, device)
    common = dict(device=device, trust_remote_code=pol.trust_remote_code, revision=pol.revision,
                  attn_implementation=pol.attn_implementation)
    policy = load_causal_lm(pol.path, pol.adapter, dtype=dtype, quantization=pol.quantization, **common)
    if gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs=CHECKPOINT_KWARGS)
    if pol.lora is not None:
        from peft import get_peft_model, prepare_model_for_kbit_training

        if pol.quantization != "none":
            policy = prepare_model_for_kbit_training(policy, use_gradient_checkpointing=gradient_checkpointing,
                                                     gradient_checkpointing_kwargs=CHECKPOINT_KWARGS)
        policy = get_peft_model(policy, peft_lora_config(pol.lora), adapter_name=POLICY_ADAPTER)
        # What adapter_config.json names as the base: the path or hub id as the recipe gave it, never
        # a path resolved on this machine (nor a temporary directory the merged model came from).
        policy.peft_config[POLICY_ADAPTER].base_model_name_or_path = pol.path
    # Train mode everywhere on the policy (dropout is already off): bitsandbytes repacks 4-bit weights
    # after a no-grad forward in eval mode and then breaks the backward.
    policy.train()

    ref_model = None
    if pol.lora is None or recipe.reference.path is not None:
        ref = recipe.reference
        ref_model = load_causal_lm(
            ref.path or pol.path, None if ref.path else pol.adapter, dtype=resolve_dtype(ref.dtype or pol.dtype, device),
            quantization=ref.quantization, **common,
        )
        freeze(ref_model)

    critic = CRITICS[value_kind(recipe)]()
    value_backbone, hidden, init_from = critic.build(recipe, policy, device, loaded or {}, common)
    if gradient_checkpointing and value_backbone is not None and any(p.requires_grad for p in value_backbone.parameters()):
        value_backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs=CHECKPOINT_KWARGS)
    torch.manual_seed(recipe.seed)  # the value head's init is part of the run's seed
    if hidden is None:  # value.kind none: a NoCritic, no head
        model = ActorCritic(policy, critic, None, None, ref_model)
    else:
        model = ActorCritic(policy, critic, _value_head(hidden, device, init_from), value_backbone, ref_model,
                            head_trains_backbone=bool(recipe.value.train_backbone))
    model.use_adapter(POLICY_ADAPTER)
    if gradient_checkpointing and model.is_peft:
        model.recompute_under_the_forwards_adapter()
    return model


def check_value_model_tokenizer(recipe: Recipe) -> None:
    """A separate value model reads the policy's token ids, so it must share the policy's vocabulary
    (a reward classifier on another tokenizer would read garbage, or index past its embeddings).
    Compared from the models' files (auto.same_tokenizer), before anything is loaded."""
    pol = recipe.policy
    if value_kind(recipe) != "model" or (path := value_model_path(recipe)) == pol.path:
        return
    same = same_tokenizer(pol.path, pol.revision, path)
    if same is False:
        raise ModelReferenceError(
            f"value model '{path}' has a different tokenizer from the policy's, but reads the policy's token ids",
            hint="use value.kind: adapter or head, or a value model (value.path) built on the policy's tokenizer",
        )
    if same is None:
        raise ModelReferenceError(
            f"value model '{path}' has no tokenizer files to compare with the policy's, but reads the policy's token ids",
            hint="save the tokenizer it was trained with beside it (tokenizer.json), or use value.kind: adapter or head",
        )


def policy_forward(ac: ActorCritic, sequences, attention_mask, response_ids, temperature: float, entropy: str = "none"):
    """(log-probs (B, T), entropies (B, T), values (B, T) or None) of the response tokens (B, T) at the end of
    ``sequences``: values come free when the critic reads the policy's states. ``entropy``: "none"
    (zeros), "value", "grad" (engine/logprobs.py's chunked_logprobs); no (B, T, V) logits are returned."""
    ac.use_adapter(POLICY_ADAPTER)
    with_head = ac.value_reads_policy_hidden
    logprobs, entropies, hidden = response_logprobs(ac.policy, sequences, attention_mask, response_ids, temperature,
                                                    entropy, keep_hidden=with_head)
    values = None
    if with_head:
        # Detached by default: the value loss would otherwise dominate the shared weights' gradient
        # (returns of +-10 against a policy loss near 0.1), and Adam would follow the critic's needs.
        values = values_from_hidden(ac, hidden if ac.head_trains_backbone else hidden.detach())
    return logprobs, entropies, values


def value_forward(ac: ActorCritic, sequences, attention_mask, response_len: int) -> torch.Tensor:
    """Values (B, T) from the critic (NoCritic: zeros); a value head reads the policy's states (no log-probs)."""
    if ac.critic.reads_policy_hidden:
        ac.use_adapter(POLICY_ADAPTER)
        hidden = response_hidden(ac.policy, sequences, attention_mask, response_len)
        return values_from_hidden(ac, hidden if ac.head_trains_backbone else hidden.detach())
    return ac.critic.values(ac, sequences, attention_mask, response_len)


def reference_logprobs(ac: ActorCritic, sequences, attention_mask, response_ids, temperature: float) -> torch.Tensor:
    """log pi_ref of the response tokens (B, T): the base with LoRA disabled, or the frozen copy."""
    model = ac.ref_model if ac.ref_model is not None else ac.policy
    with ac.reference_context():
        return response_logprobs(model, sequences, attention_mask, response_ids, temperature)[0]


class PolicyAndValue(nn.Module):
    """The update's forward as one module call: (log-probs (B, T), entropies (B, T), values (B, T);
    NoCritic's zeros without a critic).

    One call per backward, so a DDP or DeepSpeed wrapper from ``accelerator.prepare`` sees every
    trainable parameter used and synchronises the gradients (TRL's PolicyAndValueWrapper).
    """

    def __init__(self, actor_critic: ActorCritic):
        super().__init__()
        self.actor_critic = actor_critic

    @property
    def _no_split_modules(self) -> list[str]:
        """The transformer block classes of the models inside: FSDP's auto-wrap shards each block as one
        unit (accelerate reads this attribute of the module it prepares, as of a transformers model)."""
        models = [m for m in (self.actor_critic.policy, self.actor_critic.value_backbone) if m is not None]
        names = [name for m in models for name in getattr(unwrap_causal_lm(m), "_no_split_modules", None) or []]
        return list(dict.fromkeys(names))

    def forward(self, sequences, attention_mask, response_ids, temperature: float,
                fixed_value_features: torch.Tensor | None = None, entropy: str = "value"):
        """``fixed_value_features`` (B, T, H): the rollout's, for a frozen value model (no second run);
        ``entropy`` as in policy_forward."""
        ac = self.actor_critic
        logprobs, entropies, values = policy_forward(ac, sequences, attention_mask, response_ids, temperature, entropy)
        if ac.value_reads_policy_hidden:  # the head's values came with the policy's forward
            return logprobs, entropies, values
        if fixed_value_features is not None:
            return logprobs, entropies, values_from_hidden(ac, fixed_value_features)
        return logprobs, entropies, value_forward(ac, sequences, attention_mask, response_ids.shape[1])
