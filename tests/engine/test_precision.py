"""train.mixed_precision: resolving 'auto', refusing what cannot run, autocast, and accelerate's singleton."""

import json

import pytest
import torch

from ppo_cli.distributed import launcher_mixed_precision
from ppo_cli.engine import precision_probe
from ppo_cli.engine.precision import (
    autocast_context,
    check_mixed_precision,
    choose_mixed_precision,
    resolve_mixed_precision,
)
from ppo_cli.engine.precision_probe import ProbeResult
from ppo_cli.errors import UsageError

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def probe(fp32_ms: float, bf16_ms: float) -> ProbeResult:
    """Timings as the CPU probe would report them (split evenly between its two shapes)."""
    return ProbeResult(fp32_ms / 2, bf16_ms / 2, fp32_ms / 2, bf16_ms / 2, update_flops=1e9, cpu="Test CPU")


@pytest.mark.parametrize("setting", ["no", "bf16", "fp16"])
def test_explicit_setting_wins_over_launcher_hardware_and_probe(setting):
    for timings in (probe(8.8, 14.5), probe(14.5, 8.8)):
        choice = choose_mixed_precision(setting, "cpu", torch.float32, launcher="fp16", cuda_bf16=True, probe=timings)
        assert choice.value == setting


def test_auto_takes_the_launchers_choice():
    assert choose_mixed_precision("auto", "cpu", torch.float32, launcher="no", probe=probe(14.5, 8.8)).value == "no"
    assert choose_mixed_precision("auto", "cuda", torch.float32, launcher="fp16", cuda_bf16=True).value == "fp16"


@pytest.mark.parametrize("bf16_supported, expected", [(True, "bf16"), (False, "no")])
def test_auto_on_cuda_follows_bf16_support(monkeypatch, bf16_supported, expected):
    assert choose_mixed_precision("auto", "cuda", torch.float32, cuda_bf16=bf16_supported).value == expected
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_supported)
    assert resolve_mixed_precision("auto", CUDA, torch.float32).value == expected


# The Intel Xeon (avx512_bf16, no AMX) a user measured: a (256 x 896) @ (896 x 4864) matmul took 8.8 ms
# in float32 and 14.5 ms in bf16; the AMD EPYC here ran bf16 faster.
@pytest.mark.parametrize("fp32_ms, bf16_ms, expected", [
    (8.8, 14.5, "no"),  # bf16 slower
    (10.0, 6.0, "bf16"),  # bf16 faster
    (10.0, 9.5, "no"),  # within BF16_MARGIN: not worth autocast's casts
    (10.0, 9.0, "bf16"),  # exactly at the margin
])
def test_auto_on_cpu_follows_the_probe(fp32_ms, bf16_ms, expected):
    choice = choose_mixed_precision("auto", "cpu", torch.float32, probe=probe(fp32_ms, bf16_ms))
    assert choice.value == expected
    assert choice.describe() == (f"mixed precision auto -> {expected} "
                                 f"(probe: fp32 {fp32_ms:.1f} ms, bf16 {bf16_ms:.1f} ms per step on Test CPU)")


def test_auto_on_cpu_without_a_probe_stays_float32():
    choice = choose_mixed_precision("auto", "cpu", torch.float32)
    assert (choice.value, choice.describe()) == ("no", "mixed precision auto -> no (not measured)")


def test_explicit_setting_describes_the_probe_beside_it():
    choice = choose_mixed_precision("bf16", "cpu", torch.float32, probe=probe(8.8, 14.5))
    assert choice.describe() == "mixed precision bf16 (probe: fp32 8.8 ms, bf16 14.5 ms per step on Test CPU)"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_auto_leaves_half_precision_weights_alone(dtype):
    assert choose_mixed_precision("auto", "cuda", dtype, cuda_bf16=True).value == "no"
    choice = choose_mixed_precision("auto", "cpu", dtype, probe=probe(10.0, 5.0))
    assert choice.describe().startswith(f"mixed precision auto -> no (the weights are {str(dtype)[6:]} already; probe:")


def test_resolve_on_cpu_probes_at_the_given_widths_once(monkeypatch, tmp_path):
    monkeypatch.setenv("PPO_CLI_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_probe(hidden, intermediate):
        calls.append((hidden, intermediate))
        return probe(10.0, 6.0)

    monkeypatch.setattr(precision_probe, "run_probe", fake_probe)
    monkeypatch.setattr(precision_probe, "load_average", lambda: None)  # trusted: the answer is kept for good
    for _ in range(2):
        assert resolve_mixed_precision("auto", CPU, torch.float32, widths=(96, 384)).value == "bf16"
    assert calls == [(96, 384)]
    assert resolve_mixed_precision("no", CPU, torch.float32, widths=(96, 384)).value == "no"


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

    from ppo_cli.engine.actor_critic import values_from_hidden

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


def test_a_resumed_run_keeps_what_its_checkpoint_chose_unless_the_recipe_says_otherwise():
    measured_fp32_faster = probe(8.8, 14.5)
    resumed = choose_mixed_precision("auto", "cpu", torch.float32, probe=measured_fp32_faster, resumed="bf16")
    assert (resumed.value, resumed.reason) == ("bf16", "as the run being resumed chose it")
    assert choose_mixed_precision("no", "cpu", torch.float32, resumed="bf16").value == "no"  # explicit wins
    assert choose_mixed_precision("auto", "cpu", torch.float32, launcher="fp16", resumed="bf16").value == "fp16"
    assert choose_mixed_precision("auto", "cpu", torch.float32, probe=measured_fp32_faster).value == "no"  # not resumed


def test_the_precision_a_checkpoint_recorded(tmp_path):
    from ppo_cli.checkpoint import recorded_mixed_precision

    assert recorded_mixed_precision(None) is None
    assert recorded_mixed_precision(tmp_path) is None  # no trainer_state.json
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 2}))
    assert recorded_mixed_precision(tmp_path) is None  # written before the precision was recorded
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 2, "mixed_precision": "bf16"}))
    assert recorded_mixed_precision(tmp_path) == "bf16"
