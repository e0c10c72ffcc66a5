"""train.mixed_precision: resolving 'auto', refusing what cannot run, autocast, and accelerate's singleton."""

import pytest
import torch

from ppo_cli.distributed import launcher_mixed_precision
from ppo_cli.engine import precision
from ppo_cli.engine.precision import autocast_context, check_mixed_precision, resolve_mixed_precision
from ppo_cli.errors import UsageError

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("setting", ["no", "bf16", "fp16"])
def test_resolve_explicit_setting_wins_over_launcher_and_hardware(setting):
    assert resolve_mixed_precision(setting, CPU, torch.float32, launcher="fp16") == setting


def test_resolve_auto_takes_the_launchers_choice():
    assert resolve_mixed_precision("auto", CPU, torch.float32, launcher="no") == "no"
    assert resolve_mixed_precision("auto", CUDA, torch.float32, launcher="fp16") == "fp16"


@pytest.mark.parametrize("bf16_supported, expected", [(True, "bf16"), (False, "no")])
def test_resolve_auto_on_cuda_follows_bf16_support(monkeypatch, bf16_supported, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_supported)
    assert resolve_mixed_precision("auto", CUDA, torch.float32) == expected


@pytest.mark.parametrize("native, expected", [(True, "bf16"), (False, "no")])
def test_resolve_auto_on_cpu_follows_hardware_bf16(monkeypatch, native, expected):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    assert resolve_mixed_precision("auto", CPU, torch.float32) == expected
    assert resolve_mixed_precision("auto", CPU, torch.bfloat16) == "no"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_resolve_auto_leaves_half_precision_weights_alone(monkeypatch, dtype):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_mixed_precision("auto", CUDA, dtype) == "no"


@pytest.mark.parametrize("env, expected", [(None, None), ("no", None), ("NO", None), ("bf16", "bf16"), ("FP16", "fp16")])
def test_launcher_precision_counts_only_an_asked_for_half_precision(monkeypatch, env, expected):
    # accelerate launch writes 'no' when nothing was asked (and our own --num-processes launch does).
    if env is None:
        monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    else:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", env)
    assert launcher_mixed_precision() == expected


def test_fp16_on_cpu_is_refused_with_the_fix():
    with pytest.raises(UsageError) as err:
        check_mixed_precision("fp16", CPU)
    assert str(err.value) == "train.mixed_precision 'fp16' needs a GPU: accelerate does not autocast to float16 on CPU"
    assert err.value.hint == "use train.mixed_precision: bf16 (or auto) on CPU"
    check_mixed_precision("bf16", CPU)
    check_mixed_precision("no", CPU)


def test_autocast_context_runs_linear_layers_in_bf16_and_no_leaves_float32():
    layer = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with autocast_context("bf16", CPU):
        assert layer(x).dtype == torch.bfloat16
    with autocast_context("no", CPU):
        assert layer(x).dtype == torch.float32


def test_value_head_stays_float32_inside_autocast():
    from types import SimpleNamespace

    from ppo_cli.engine.logprobs import values_from_hidden

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 1)
    ac = SimpleNamespace(value_head=head)
    hidden = torch.randn(2, 3, 16) * 10
    expected = head(hidden).squeeze(-1)
    with autocast_context("bf16", CPU):
        values = values_from_hidden(ac, hidden)
    assert values.dtype == torch.float32
    torch.testing.assert_close(values, expected, rtol=0, atol=0)


class _RecordsAutocast(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)
        self.seen = []

    def forward(self, x):
        enabled = torch.is_autocast_enabled("cpu")
        self.seen.append(torch.get_autocast_dtype("cpu") if enabled else None)
        return self.layer(x)


def test_two_accelerators_with_different_precisions_in_one_process_each_get_theirs():
    from ppo_cli.distributed import Distributed

    models = {}
    for wanted in ("bf16", "no", "bf16"):
        dist = Distributed("cpu", wanted)
        assert dist.mixed_precision == wanted
        models[len(models)] = dist.accelerator.prepare(_RecordsAutocast())
    # Models prepared earlier keep the autocast they were prepared with.
    for model in models.values():
        out = model(torch.randn(1, 2))
        assert out.dtype == torch.float32  # accelerate converts the outputs back
    assert [m.seen for m in models.values()] == [[torch.bfloat16], [None], [torch.bfloat16]]


def test_distributed_refuses_fp16_on_cpu():
    from ppo_cli.distributed import Distributed

    with pytest.raises(UsageError, match="needs a GPU"):
        Distributed("cpu", "fp16")
