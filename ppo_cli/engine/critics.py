"""Critics: one class per ``value.kind``, holding everything that kind means.

| kind    | network under the scalar value head                         | its values come from                 |
| ------- | ----------------------------------------------------------- | ------------------------------------ |
| head    | the policy's own decoder states (no second network)         | the policy's forward, at no cost     |
| adapter | a second LoRA adapter ``value`` on the policy's base         | a forward of the base with it active |
| model   | a separate model: the policy's, the reward model's or value.path | its own forward                 |

A kind knows how it is built (``build``: the network the head reads, and what the head starts
from), which parameters it trains, its default learning rate, the features its head reads
(``features``), what it saves and loads in a checkpoint's critic/ folder, and the memory ``ppo plan``
counts for it (``memory``: pure arithmetic on the plan's Settings and model shapes). The head itself
(a float32 ``nn.Linear(H, 1)``) is common to every kind and saved by the checkpoint code.

Adding a kind: a class here, listed in CRITICS, and its name and description in the schema's
CRITIC_KINDS (recipe.py; a test checks the two agree). Which kind 'auto' stands for is ppo_cli/auto.py.
Importing this module does not import torch (``ppo plan`` reads each kind's memory).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from ppo_cli.auto import value_model_path, value_settings
from ppo_cli.plan_units import DTYPE_BYTES, GB, Line, activation_floats_per_token_layer, weights_how

if TYPE_CHECKING:
    import torch

    from ppo_cli.recipe import Recipe

VALUE_ADAPTER = "value"
VALUE_HEAD_LR_WIDTH = 4.0  # value.kind head's default lr = this / hidden_size (HeadCritic.default_lr)


class CriticMemory(NamedTuple):
    """A critic kind's part of ``ppo plan`` (ppo_cli/plan_memory.py)."""

    static: list  # Lines held for the whole run (weights, adapter)
    update: list  # Lines of the update's activations
    trainable: int  # parameters the value loss trains, the head included
    param_bytes: float  # bytes per trained parameter (and per gradient)


class Critic:
    """The common part: a kind's name, and what a kind without a network of its own does."""

    kind: ClassVar[str]
    reads_policy_hidden: ClassVar[bool] = False  # values come with the policy's own forward
    trains: ClassVar[bool] = True  # a value head (and maybe a network) that the value loss trains and a checkpoint keeps

    @classmethod
    def build(cls, recipe: Recipe, policy, device, loaded: dict, common: dict):
        """(the network the head reads or None, its hidden size, a reward model to start the head from or None)."""
        raise NotImplementedError

    def trained_parameters(self, ac) -> list:
        """The parameters the value loss trains besides the head."""
        return []

    def value_parameters(self, ac) -> list:
        """Every parameter the value loss trains: the head's, then the kind's own (trained_parameters)."""
        return list(ac.value_head.parameters()) + self.trained_parameters(ac)

    def default_lr(self, ac, policy_lr: float) -> float:
        """A critic that trains a backbone learns at the policy's rate."""
        return policy_lr

    def forward_parameters(self, ac, policy: int) -> int:
        """Parameters the critic's own forward reads, for the update's FLOPs (perf.py's MFU);
        ``policy``: the policy's parameter count. 0 when the values come with the policy's forward."""
        backbone = ac.value_backbone
        return sum(p.numel() for p in backbone.parameters()) if backbone is not None else 0

    def features_fixed(self, ac) -> bool:
        """Are the features for a rollout the same at every update (a frozen network)? Then the update
        reuses the rollout's instead of running the critic again."""
        return False

    def features(self, ac, sequences, attention_mask, response_len: int) -> torch.Tensor:
        """What the head reads (B, T, H) at the response positions, from the critic's own network (a
        critic that reads_policy_hidden has none: its features come with the policy's forward)."""
        raise NotImplementedError

    def values(self, ac, sequences, attention_mask, response_len: int) -> torch.Tensor:
        """Values (B, T) at the response positions: the head over ``features`` (a critic that
        reads_policy_hidden gets its values from the policy's forward instead: actor_critic.value_forward)."""
        return values_from_hidden(ac, self.features(ac, sequences, attention_mask, response_len))

    def save(self, ac, critic_dir: Path, full_state: dict | None = None) -> None:
        """Write the critic's network (not the head) into ``critic_dir``; ``full_state``: the
        ActorCritic's state dict gathered from sharded processes (FSDP), None to read the modules."""

    def load(self, ac, critic_dir: Path) -> None:
        """Inverse of save, into the already-built network."""

    @staticmethod
    def memory(s, policy, value, lora) -> CriticMemory:
        """What ``ppo plan`` counts for this kind besides the policy (s: memory.Settings; shapes: memory.ModelShape)."""
        raise NotImplementedError


class HeadCritic(Critic):
    kind = "head"
    reads_policy_hidden = True

    @classmethod
    def build(cls, recipe, policy, device, loaded, common):
        from ppo_cli.engine.models import hidden_size_of

        return None, hidden_size_of(policy), None

    def default_lr(self, ac, policy_lr):
        """A value head alone is a read-out layer: its Adam step moves the value by about lr * hidden_size
        (every weight moves by lr, in step with its feature), so its rate scales as 1 / width (as in muP).
        Measured on the tiny task (hidden 96, docs/benchmarks.md): the reward curve improves with the
        head's rate up to 4 / hidden_size and a little beyond; the policy's 1e-3 was far too slow."""
        from ppo_cli.engine.models import hidden_size_of

        return VALUE_HEAD_LR_WIDTH / hidden_size_of(ac.policy)

    @staticmethod
    def memory(s, policy, value, lora):
        head = policy.hidden + 1
        line = Line("value", "head", head * 4 / GB, f"scalar head on the policy's hidden states ({head} params)")
        return CriticMemory([line], [], head, 4.0)


class AdapterCritic(Critic):
    kind = "adapter"

    @classmethod
    def build(cls, recipe, policy, device, loaded, common):
        from ppo_cli.engine.models import hidden_size_of, peft_lora_config

        policy.add_adapter(VALUE_ADAPTER, peft_lora_config(recipe.value.lora or recipe.policy.lora))
        policy.peft_config[VALUE_ADAPTER].base_model_name_or_path = recipe.policy.path
        for name, param in policy.named_parameters():  # add_adapter leaves the inactive adapter frozen
            if "lora_" in name:
                param.requires_grad_(True)
        return None, hidden_size_of(policy), None

    def trained_parameters(self, ac):
        return [p for n, p in ac.policy.named_parameters() if f".{VALUE_ADAPTER}." in n and p.requires_grad]

    def forward_parameters(self, ac, policy):
        return policy  # the policy's base, with the value adapter active

    def features(self, ac, sequences, attention_mask, response_len):
        from ppo_cli.engine.logprobs import backbone_hidden, response_slice

        # Checkpointed like the policy's forward where checkpointing is on: each layer's recompute runs
        # under the adapter of its forward (ActorCritic.recompute_under_the_forwards_adapter).
        with ac.adapter_active(VALUE_ADAPTER):
            hidden = backbone_hidden(ac.policy, sequences, attention_mask)
        return response_slice(hidden, response_len)

    def save(self, ac, critic_dir, full_state=None):
        from ppo_cli.engine.models import save_adapter
        from ppo_cli.engine.weights import part_of

        save_adapter(ac.policy, VALUE_ADAPTER, critic_dir / "value_adapter", state_dict=part_of(full_state, "policy."))

    def load(self, ac, critic_dir):
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        state = load_file(critic_dir / "value_adapter" / "adapter_model.safetensors")
        set_peft_model_state_dict(ac.policy, state, adapter_name=VALUE_ADAPTER)

    @staticmethod
    def memory(s, policy, value, lora):
        n = policy.lora_params(s.value_lora or lora) + policy.hidden + 1
        static = [Line("value", "LoRA adapter + head", n * 4 / GB,
                       f"2nd adapter on the policy's base: {n / 1e6:.2f}M params x 4 B")]
        B, L, r = s.micro_batch, s.prompt_tokens + s.response_tokens, lora.r
        per_layer = activation_floats_per_token_layer(policy, False, r, L)
        # checkpointed as the policy's forward: the layers' inputs and one layer's activations
        per = policy.layers * policy.hidden + per_layer if s.gradient_checkpointing else policy.layers * per_layer
        update = [Line("value", "activations (update)", B * L * per * DTYPE_BYTES[s.dtype] / GB,
                       f"the critic's own forward: {B} x {L} tokens x {policy.layers} layers"
                       + (" (checkpointed)" if s.gradient_checkpointing else ""), "update")]
        return CriticMemory(static, update, n, 4.0)


class ModelCritic(Critic):
    kind = "model"

    @classmethod
    def build(cls, recipe, policy, device, loaded, common):
        from transformers import AutoModel, AutoModelForSequenceClassification

        from ppo_cli.engine.models import freeze, is_quantized, load_causal_lm, load_pretrained, resolve_dtype

        pol, value = recipe.policy, value_settings(recipe)
        path = value_model_path(recipe)
        dtype = resolve_dtype(value.dtype or pol.dtype, device)
        frozen = value.train_backbone is False  # a head on frozen features (None: trained, the default)
        shared, init_from = loaded.get(path), None
        if frozen and shared is not None and shared.dtype == dtype and not is_quantized(shared):
            backbone, init_from = shared.base_model, shared  # the reward model itself: no second copy
        elif path == pol.path and pol.adapter is not None:  # the critic starts from the starting policy
            backbone = load_causal_lm(pol.path, pol.adapter, dtype=dtype, **common).base_model
            backbone.train()
        else:
            backbone = load_pretrained(AutoModel, path, dtype=dtype, **common)
            backbone.train()
            if frozen:
                freeze(backbone)
        if value.init_from == "reward" and init_from is None:
            import torch

            init_from = load_pretrained(AutoModelForSequenceClassification, path, dtype=torch.float32, **common)
        return backbone, backbone.config.hidden_size, init_from

    def trained_parameters(self, ac):
        return [p for p in ac.value_backbone.parameters() if p.requires_grad]

    def features_fixed(self, ac):
        return not any(p.requires_grad for p in ac.value_backbone.parameters())

    def features(self, ac, sequences, attention_mask, response_len):
        from ppo_cli.engine.logprobs import backbone_hidden, response_slice

        return response_slice(backbone_hidden(ac.value_backbone, sequences, attention_mask), response_len)

    def save(self, ac, critic_dir, full_state=None):
        from ppo_cli.engine.weights import part_of

        ac.value_backbone.save_pretrained(critic_dir / "value_model", safe_serialization=True,
                                          state_dict=part_of(full_state, "value_backbone."))

    def load(self, ac, critic_dir):
        from ppo_cli.engine.weights import load_safetensors_into

        load_safetensors_into(ac.value_backbone, sorted((critic_dir / "value_model").glob("*.safetensors")))

    @staticmethod
    def memory(s, policy, value, lora):
        head = value.hidden + 1 if value is not None else policy.hidden + 1
        if s.value_shared:
            static = [Line("value", "weights", 0.0, "the reward model's, shared (frozen)")]
        else:
            static = [Line("value", "weights", value.total_params * DTYPE_BYTES[s.value_dtype] / GB,
                           ("separate frozen model: " if s.value_frozen else "separate model: ")
                           + weights_how(value, s.value_dtype, "none"))]
        if s.value_frozen:  # only the head trains, and nothing is kept for a backward
            return CriticMemory(static, [], head, 4.0)
        B, L = s.micro_batch, s.prompt_tokens + s.response_tokens
        per = value.layers * activation_floats_per_token_layer(value, True, lora.r if lora else 0, L)
        if s.gradient_checkpointing:  # its backbone is checkpointed too (engine/actor_critic.py)
            per = value.layers * value.hidden + activation_floats_per_token_layer(value, True, lora.r if lora else 0, L)
        update = [Line("value", "activations (update)", B * L * per * DTYPE_BYTES[s.value_dtype] / GB,
                       f"the critic's own forward: {B} x {L} tokens x {value.layers} layers"
                       + (" (checkpointed)" if s.gradient_checkpointing else ""), "update")]
        return CriticMemory(static, update, value.total_params + head, DTYPE_BYTES[s.value_dtype])


class NoCritic(Critic):
    """value.kind none, for the critic-free estimators (ppo.advantage grpo, rloo, reinforce_pp), and the
    inference engine: no network and no head, so nothing is built, trained (``trains`` False: no value
    loss, no optimizer group, no metrics of values), saved or loaded; its values are 0 (no baseline)."""

    kind = "none"
    trains = False

    @classmethod
    def build(cls, recipe, policy, device, loaded, common):
        return None, None, None

    def value_parameters(self, ac):
        return []

    def forward_parameters(self, ac, policy):
        return 0

    def values(self, ac, sequences, attention_mask, response_len):
        """Zeros (B, T) float32: nothing runs, and nothing trains on them."""
        import torch

        return torch.zeros((sequences.shape[0], response_len), dtype=torch.float32, device=sequences.device)

    @staticmethod
    def memory(s, policy, value, lora):
        return CriticMemory([], [], 0, 4.0)


def values_from_hidden(ac, hidden: torch.Tensor) -> torch.Tensor:
    """Scalar value per position (B, T) from hidden states (B, T, H); the head runs in float32,
    also inside a mixed-precision forward (bf16 would round values of +-10 by ~0.04)."""
    from ppo_cli.engine.precision import full_precision

    head = ac.value_head
    with full_precision(hidden.device):
        return head(hidden.to(head.weight.dtype)).squeeze(-1)


CRITICS: dict[str, type[Critic]] = {cls.kind: cls for cls in (AdapterCritic, HeadCritic, ModelCritic, NoCritic)}
