"""Peak resident memory per process: DDP against FSDP2, 2 CPU processes, LoRA and full fine-tuning.

    python benchmarks/bench_sharding.py --shape tiny                 # LoRA and full, DDP and FSDP
    python benchmarks/bench_sharding.py --shape 0.5b --modes lora    # the Qwen2.5-0.5B shape (random weights)
    python benchmarks/bench_sharding.py --shape 0.5b --modes lora --set ppo.micro_batch_size=4   # another shape

Each configuration is one `ppo train` of 2 updates under `accelerate launch` (DDP: --multi_gpu, as
`ppo train --num-processes 2` launches; FSDP: recipes/accelerate/fsdp.yaml, with the rollout per block
(train.fsdp_rollout: per_block, the default) and gathered whole). Every training process runs through
this file (`_rank`), which records its own peak RSS (getrusage ru_maxrss) at exit; the figures are
the two processes' peaks, their ratio FSDP / DDP, and the rollout seconds per update (the mean over
both updates, of rank 0; wall-clock, so only comparable within one quiet run). Models: the tiny review LM
(PPO_TINY_MODELS or models/tiny) or the 0.5B shape built by `python benchmarks/bench_vs_trl.py models`
(.cache/bench/0.5b, or PPO_BENCH_CACHE/0.5b; reward model of the same shape). Run on a quiet machine: the 0.5B shape with
LoRA needs about 2 x 6 GB. BENCH_PHASES=1 also prints each process's resident and peak memory after
each phase (loading, prepare, evaluation, every update, final/), the highest resident set (anonymous
and file-backed) within each update's rollout, forwards, backwards and optimizer steps (sampled every
10 ms), and after each update forward the FSDP units left whole, what autograd saved and the tensors
Python sees; BENCH_MALLOC_TUNING=off leaves glibc's
own trimming on (EngineOptions.cpu_malloc_tuning, given to load_engine). Never imported by ppo_cli or its tests.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FSDP_CONFIG = ROOT / "recipes/accelerate/fsdp.yaml"


def _rank_main(out_dir: str, argv: list[str]) -> None:
    """One training process: `ppo ...argv`, then this process's peak RSS into out_dir/rank<N>.json."""
    from ppo_cli.cli import main

    if os.environ.get("BENCH_PHASES"):
        _trace_phases()
    if os.environ.get("BENCH_MALLOC_TUNING") == "off":  # glibc's own trimming (EngineOptions.cpu_malloc_tuning)
        import functools

        import ppo_cli.engine.engine as engine_module

        # commands/train.py imports load_engine when it runs: it gets this one
        engine_module.load_engine = functools.partial(
            engine_module.load_engine, options=engine_module.EngineOptions(cpu_malloc_tuning=False))
    code = 0
    try:
        sys.argv = ["ppo", *argv]
        main()
    except SystemExit as exit_:
        code = exit_.code or 0
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB
    rank = os.environ.get("RANK", "0")
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"peak_rss_gb": peak_gb, "exit": code}))
    sys.exit(code)


def _trace_phases() -> None:
    """Print this process's resident and peak memory after each phase (BENCH_PHASES=1)."""
    import functools

    import ppo_cli.commands.train as train_cmd
    import ppo_cli.engine.engine as engine_module
    import ppo_cli.train_setup as train_setup
    import ppo_cli.trainer as trainer
    import ppo_cli.checkpoint as checkpoint

    def rss() -> str:
        current = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
        return f"rss {current:.2f} GB, peak {peak:.2f} GB"

    def traced(module, name):
        inner = getattr(module, name, None)
        if inner is None:  # renamed since: trace the phases that are still there
            print(f"[rank {os.environ.get('RANK', '0')}] not traced: {module.__name__}.{name}", file=sys.stderr)
            return

        @functools.wraps(inner)
        def wrapper(*args, **kwargs):
            out = inner(*args, **kwargs)
            print(f"[rank {os.environ.get('RANK', '0')}] after {name}: {rss()}", file=sys.stderr, flush=True)
            return out

        setattr(module, name, wrapper)

    for module, name in ((engine_module, "load_engine"), (train_setup, "init_state"), (trainer, "train_step"),
                         (train_cmd, "_evaluate_before"), (train_cmd, "evaluate"), (train_cmd, "_finish"),
                         (checkpoint, "gathered_model_state")):
        traced(module, name)
    _sample_inner_phases()


def _sample_inner_phases() -> None:
    """Sample the resident set (anonymous and file-backed apart) every 10 ms and keep each inner
    phase's highest: the rollout, the update's forwards, backwards and optimizer steps. Printed after
    each update (BENCH_PHASES=1); the peak of a phase is what it held at most, whatever came before."""
    import functools
    import threading
    import time

    import ppo_cli.engine.actor_critic as actor_critic
    import ppo_cli.engine.engine as engine_module
    import ppo_cli.trainer as trainer
    from accelerate import Accelerator

    current = ["start"]
    peaks: dict[str, tuple[float, float]] = {}

    def sample() -> None:
        while True:
            fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
            anon, file = (int(fields[key].split()[0]) * 1024 / 1e9 for key in ("RssAnon", "RssFile"))
            phase = current[0]
            best = peaks.get(phase, (0.0, 0.0))
            if anon + file > sum(best):
                peaks[phase] = (anon, file)
            time.sleep(0.01)

    threading.Thread(target=sample, daemon=True).start()

    def labelled(owner, name, label):
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def wrapper(*args, **kwargs):
            outer, current[0] = current[0], label
            try:
                return inner(*args, **kwargs)
            finally:
                current[0] = outer

        setattr(owner, name, wrapper)

    labelled(engine_module.Engine, "collect_rollout", "rollout")
    labelled(trainer, "optimise", "update (between)")
    labelled(actor_critic.PolicyAndValue, "forward", "update forward")
    forward = actor_critic.PolicyAndValue.forward

    def counted_forward(self, *args, **kwargs):
        import gc

        import torch

        saved = {}

        def pack(tensor):
            try:
                storage = tensor.untyped_storage()
                saved[storage.data_ptr()] = (storage.nbytes(), tuple(tensor.shape), str(tensor.dtype))
            except RuntimeError:  # a DTensor or a freed storage: nothing of its own held here
                pass
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = forward(self, *args, **kwargs)
        live = {}
        for obj in gc.get_objects():
            try:
                if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
                    storage = obj.untyped_storage()
                    live[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # a freed storage (an FSDP unit's resharded parameter)
                pass
        biggest = sorted(saved.values(), reverse=True)[:3]
        print(f"[rank {os.environ.get('RANK', '0')}] after the update's forward: {_unsharded(self)}; "
              f"saved for backward {sum(v[0] for v in saved.values()) / 1e9:.2f} GB ({len(saved)} storages, "
              f"biggest {biggest}); Python-visible tensors {sum(live.values()) / 1e9:.2f} GB",
              file=sys.stderr, flush=True)
        return out

    actor_critic.PolicyAndValue.forward = counted_forward
    labelled(Accelerator, "backward", "update backward")
    from accelerate.optimizer import AcceleratedOptimizer

    labelled(AcceleratedOptimizer, "step", "optimizer step")
    step = trainer.train_step

    def train_step(*args, **kwargs):
        out = step(*args, **kwargs)
        rank = os.environ.get("RANK", "0")
        for phase, (anon, file) in peaks.items():
            print(f"[rank {rank}] peak in {phase}: {anon + file:.2f} GB (anon {anon:.2f}, file {file:.2f})",
                  file=sys.stderr, flush=True)
        peaks.clear()
        return out

    trainer.train_step = train_step


def _unsharded(model) -> str:
    """How many FSDP units of ``model`` hold their parameters whole, and their bytes."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    whole = [group for unit in units for group in unit._get_fsdp_state()._fsdp_param_groups if group.is_unsharded]
    size = sum(p.unsharded_param.numel() * p.unsharded_param.element_size() for g in whole for p in g.fsdp_params)
    return f"{len(whole)} of {len(units)} FSDP units whole ({size / 1e9:.2f} GB)"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _models(shape: str) -> tuple[Path, Path, str]:
    """(policy, reward, reward component type)."""
    if shape == "tiny":
        tiny = Path(os.environ.get("PPO_TINY_MODELS", ROOT / "models/tiny"))
        return tiny / "policy", tiny / "reward", "classifier"
    big = Path(os.environ.get("PPO_BENCH_CACHE", ROOT / ".cache/bench")) / "0.5b"
    if not (big / "reward/config.json").exists():
        sys.exit(f"{big} is missing: run python benchmarks/bench_vs_trl.py models first")
    return big / "policy", big / "reward", "model"


def _settings(shape: str, mode: str, out: Path) -> list[str]:
    policy, reward, kind = _models(shape)
    component = f"{{type: {kind}, path: '{reward}'" + (", labels: {negative: -1.0, neutral: 0.1, positive: 10.0}}" if kind == "classifier" else "}")
    sets = {
        "policy.path": policy, "output_dir": out, "reward.components": f"[{component}]",
        "data.prompts": ROOT / "recipes/prompts/reviews.txt", "data.eval_prompts": "null",
        "ppo.rollout_batch_size": 4, "ppo.mini_batch_size": 2, "ppo.micro_batch_size": 2,
        "generation.max_new_tokens": 16, "train.total_updates": 2, "train.save_every": 0,
        "train.sample_every": 0, "train.num_threads": 1, "train.device": "cpu",
    }
    if mode == "full":
        sets.update({"policy.lora": "null", "value.kind": "model", "optim.lr": 1e-5})
    return [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]


def measure(shape: str, strategy: str, mode: str, sets: list[str] = ()) -> tuple[list[float], float]:
    """Peak RSS (GB) of each of the 2 processes of one run, and its rollout seconds per update."""
    with tempfile.TemporaryDirectory(prefix="bench-sharding-") as tmp:
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(_free_port())]
        if strategy.startswith("fsdp"):
            launcher += ["--config_file", str(FSDP_CONFIG)]
        else:  # what `ppo train --num-processes 2` launches (ppo_cli/launch.py)
            launcher += ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                         "--dynamo_backend", "no"]
        recipe = ROOT / "recipes/tiny_sentiment.yaml"
        rollout = ["--set", "train.fsdp_rollout=gathered"] if strategy == "fsdp-gathered" else []
        args = [*launcher, __file__, "_rank", tmp, "train", str(recipe), *_settings(shape, mode, Path(tmp) / "runs"),
                *rollout, *(arg for item in sets for arg in ("--set", item))]
        result = subprocess.run(args, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
        if os.environ.get("BENCH_PHASES"):
            print("\n".join(line for line in result.stderr.splitlines() if "] after " in line or "] peak in " in line), flush=True)
        if result.returncode != 0:
            sys.exit(f"{shape} {strategy} {mode} failed:\n{result.stderr[-3000:]}")
        metrics = [json.loads(line) for line in next(Path(tmp, "runs").glob("*/metrics.jsonl")).read_text().splitlines()]
        seconds = sum(m["time/rollout_s"] for m in metrics) / len(metrics)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text())["peak_rss_gb"] for r in (0, 1)], seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("tiny", "0.5b"), default="tiny")
    parser.add_argument("--modes", nargs="+", choices=("lora", "full"), default=["lora", "full"])
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES),
                        help="ddp first: the ratios are to it")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override after the bench's own, e.g. ppo.micro_batch_size=4 (repeatable)")
    args = parser.parse_args()
    from ppo_cli.engine.precision_probe import machine_record

    print(f"machine: {machine_record()}", flush=True)  # every figure below was measured on it
    print("| shape | mode | strategy | peak RSS per process (GB, rank 0 / 1) | / DDP | rollout s per update |")
    print("|---|---|---|---|---|---|")
    for mode in args.modes:
        ddp = None
        for strategy in args.strategies:
            peaks, seconds = measure(args.shape, strategy, mode, args.sets)
            ddp = max(peaks) if strategy == "ddp" else ddp
            ratio = f"{max(peaks) / ddp:.2f}" if ddp else "-"
            print(f"| {args.shape} | {mode} | {strategy} | {' / '.join(f'{p:.2f}' for p in peaks)} | {ratio} | "
                  f"{seconds:.1f} |", flush=True)


STRATEGIES = ("ddp", "fsdp", "fsdp-gathered")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_rank":
        _rank_main(sys.argv[2], sys.argv[3:])
    else:
        main()
