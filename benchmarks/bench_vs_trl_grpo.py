#!/usr/bin/env python
"""ppo_cli's GRPO against TRL 1.16.0's GRPOTrainer: the same work, each tool's defaults, resident memory
phase by phase (issue 33, items 0 and 6).

    python benchmarks/bench_vs_trl_grpo.py setup                       # TRL 1.16.0 in .cache/trl116-venv
    python benchmarks/bench_vs_trl_grpo.py compare --rounds 2          # ours and TRL alternately, fresh processes
    python benchmarks/bench_vs_trl_grpo.py report                      # the tables (docs/benchmarks.md)
    python benchmarks/bench_vs_trl_grpo.py compare --shape 0.5b --tag 0.5b   # the 0.5B shape (bench_vs_trl.py models first)

The work (the issue's): SmolLM2-135M-Instruct (.cache/smollm2-0.1.2, scripts/fetch_smollm2.py; ``--shape 0.5b``:
Qwen2.5-0.5B's layer sizes, random weights, vocabulary 1,089, review openers as text prompts), 4 prompts
x 4 completions x 48 new tokens (chat questions, recipes/prompts/chat_questions.jsonl), one optimizer
step per update over the 16 episodes in one forward (TRL: per_device_train_batch_size 16, ours:
mini/micro batch 16), LoRA r16 alpha 32 all-linear, a Python reward (recipes/rewards/concise.py), KL
coefficient 0.04 (so both run the reference forward), temperature 1, 5 updates. Everything else is each
tool's default: ours ``mixed_precision: auto`` (the probe picks per CPU), TRL's GRPOConfig (bf16
autocast, gradient checkpointing, loss_type dapo, max_grad_norm 1, lr 1e-6).

``ours`` and ``trl`` run one tool in this process (``trl`` under .cache/trl116-venv/bin/python) with
benchmarks/phase_rss.py naming the phases: loading (until the first update), sampling, reward,
old/ref log-probs (the rollout's no-grad forwards), forward (the loss's), backward, optimizer step, other.
CPU seconds per update are process CPU time (robust to other jobs on the cores; wall is not).
Never imported by ppo_cli or its tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from phase_rss import PhaseTracer  # noqa: E402  (beside this file; standard library only)

VENV = ROOT / ".cache" / "trl116-venv"
TRL_VERSION = "1.16.0"
PINS = ("torch==2.13.0+cpu", "transformers==5.24.0", "peft==0.21.2", "accelerate==1.15.0")  # ours, as TRL allows
RESULTS = ROOT / ".cache" / "bench" / "results" / "vs-trl116-grpo.jsonl"
SMOLLM2 = ROOT / ".cache" / "smollm2-0.1.2"
PROMPTS = ROOT / "recipes" / "prompts" / "chat_questions.jsonl"
# --shape: the model and its prompts. 0.5b: Qwen2.5-0.5B's layer sizes with random weights and the tiny
# tokenizer (vocabulary 1,089; no chat template, so text prompts), built by `bench_vs_trl.py models`.
MODELS = {"smollm2": (SMOLLM2, PROMPTS),
          "0.5b": (ROOT / ".cache" / "bench" / "0.5b" / "policy", ROOT / ".cache" / "bench" / "prompts.txt")}


def model_and_prompts(args) -> tuple[Path, Path]:
    model, prompts = MODELS[args.shape]
    if not model.exists():
        sys.exit(f"{model} is missing: " + ("python scripts/fetch_smollm2.py" if args.shape == "smollm2"
                                            else "python benchmarks/bench_vs_trl.py models"))
    return model, prompts
SHAPE = dict(prompts=4, generations=4, new_tokens=48, lora_r=16, lora_alpha=32, kl_coef=0.04, temperature=1.0,
             max_prompt_tokens=64)
PHASES = ("loading", "sampling", "reward", "old/ref log-probs", "forward", "backward", "optimizer step", "other")


def env() -> dict:
    e = dict(os.environ)
    e.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    return e


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def cpu_record() -> dict:
    model, flags = "unknown", []
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and model == "unknown":
            model = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            flags = line.split(":", 1)[1].split()
    return {"cpu": model, "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags,
            "avx512f": "avx512f" in flags, "cores": os.cpu_count()}


def cmd_setup(args) -> None:
    py = VENV / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run(pip + [PINS[0]], check=True)  # first, so nothing pulls a CUDA build
    subprocess.run(pip + [f"trl=={TRL_VERSION}", *PINS[1:]], check=True)
    print(subprocess.run([str(py), "-c", "import torch, transformers, peft, trl; print(torch.__version__, "
                          "transformers.__version__, peft.__version__, trl.__version__)"],
                         check=True, capture_output=True, text=True, env=env()).stdout.strip())


def per_update(marks: list[float]) -> list[float]:
    return [b - a for a, b in zip(marks, marks[1:])]


# --- ours ----------------------------------------------------------------------------------------


def ours_recipe(args) -> dict:
    episodes = SHAPE["prompts"] * SHAPE["generations"]
    return {
        "name": f"bench-vs-trl116-grpo-{args.tag}", "seed": args.seed, "output_dir": str(ROOT / ".cache" / "bench" / "runs"),
        "policy": {"path": str(model_and_prompts(args)[0]), "dtype": "float32",
                   "lora": {"r": SHAPE["lora_r"], "alpha": SHAPE["lora_alpha"], "target_modules": "all-linear"}},
        "reward": {"components": [{"type": "function", "function": str(ROOT / "recipes/rewards/concise.py") + ":concise"}]},
        "data": {"prompts": str(model_and_prompts(args)[1]), "max_prompt_tokens": SHAPE["max_prompt_tokens"]},
        "generation": {"max_new_tokens": SHAPE["new_tokens"], "temperature": SHAPE["temperature"],
                       "num_generations": SHAPE["generations"]},
        "ppo": {"advantage": "grpo", "rollout_batch_size": SHAPE["prompts"], "mini_batch_size": episodes,
                "micro_batch_size": episodes, "ppo_epochs": 1, "kl_coef": SHAPE["kl_coef"]},
        "train": {"total_updates": args.updates, "num_threads": args.threads, "sample_every": 0, "device": "cpu",
                  **({"mixed_precision": args.mixed_precision} if args.mixed_precision else {})},
    }


def cmd_ours(args) -> None:
    from ppo_cli.engine.malloc import ask_torch_for_huge_pages

    ask_torch_for_huge_pages()  # as `ppo`'s entry point does, before torch loads (engine/malloc.py)
    tracer = PhaseTracer()
    import yaml

    import accelerate
    from ppo_cli import trainer
    from ppo_cli.commands.train import run
    from ppo_cli.engine.engine import Engine
    from ppo_cli.recipe_loading import load_recipe

    tracer.wrap_method(Engine, "sample", "sampling")
    tracer.wrap_method(Engine, "score", "reward")
    tracer.wrap_method(Engine, "evaluate_logprobs_and_values", "old/ref log-probs")
    tracer.wrap_method(trainer, "micro_batch_loss", "forward")
    tracer.wrap_method(accelerate.Accelerator, "backward", "backward")
    tracer.hook_optimizer_steps()
    marks, cpu_marks, precision = [], [], {}
    step = trainer.train_step

    def timed_step(state):
        tracer.next_update()
        if not marks:
            precision["mixed_precision"] = state.engine.mixed_precision  # train.mixed_precision resolved
            precision["gradient_checkpointing"] = state.engine.gradient_checkpointing  # train.gradient_checkpointing resolved
            marks.append(time.perf_counter()), cpu_marks.append(time.process_time())
        out = step(state)
        marks.append(time.perf_counter()), cpu_marks.append(time.process_time())
        return out

    trainer.train_step = timed_step
    path = ROOT / ".cache" / "bench" / "recipes" / f"bench-vs-trl116-grpo-{args.tag}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    recipe = ours_recipe(args)
    for item in args.set:  # section.key=value, as `ppo train --set`
        dotted, value = item.split("=", 1)
        section, key = dotted.split(".")
        recipe.setdefault(section, {})[key] = yaml.safe_load(value)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    started = time.perf_counter()
    result = run(load_recipe(path), recipe_path=path, overwrite=True)
    tracer.stop()
    write(args, "ours", {"command": f"ppo train {path} --overwrite", "precision": precision,
                         "seconds_per_update": per_update(marks), "cpu_seconds_per_update": per_update(cpu_marks),
                         "total_s": time.perf_counter() - started}, tracer)


# --- TRL -----------------------------------------------------------------------------------------


def cmd_trl(args) -> None:
    tracer = PhaseTracer()
    import importlib.util

    import accelerate
    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    spec = importlib.util.spec_from_file_location("concise", ROOT / "recipes" / "rewards" / "concise.py")
    concise = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(concise)

    def reward(prompts, completions, **kwargs):  # conversational: completions are [{"role", "content"}]
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return concise.concise(prompts, texts)

    model, prompts = model_and_prompts(args)
    lines = [line for line in prompts.read_text().splitlines() if line.strip()]
    rows = [json.loads(line) for line in lines] if prompts.suffix == ".jsonl" else [{"prompt": line} for line in lines]
    dataset = Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    episodes = SHAPE["prompts"] * SHAPE["generations"]
    import tempfile

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl116-grpo-bench-"),
        per_device_train_batch_size=episodes, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=SHAPE["generations"], num_iterations=1, max_steps=args.updates,
        max_completion_length=SHAPE["new_tokens"], max_prompt_length=SHAPE["max_prompt_tokens"],
        temperature=SHAPE["temperature"], beta=SHAPE["kl_coef"],
        report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, seed=args.seed, use_cpu=True,
        dataloader_num_workers=0, log_completions=False,
    ) if "max_prompt_length" in GRPOConfig.__dataclass_fields__ else GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl116-grpo-bench-"),
        per_device_train_batch_size=episodes, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=SHAPE["generations"], num_iterations=1, max_steps=args.updates,
        max_completion_length=SHAPE["new_tokens"], temperature=SHAPE["temperature"], beta=SHAPE["kl_coef"],
        report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, seed=args.seed, use_cpu=True,
        dataloader_num_workers=0, log_completions=False,
    )
    marks, cpu_marks = [], []

    class Marks(TrainerCallback):
        def on_step_begin(self, *a, **k):
            tracer.next_update()
            if not marks:
                marks.append(time.perf_counter()), cpu_marks.append(time.process_time())

        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter()), cpu_marks.append(time.process_time())

    tracer.wrap_method(GRPOTrainer, "_generate", "sampling")
    tracer.wrap_method(GRPOTrainer, "_calculate_rewards", "reward")
    tracer.wrap_method(GRPOTrainer, "compute_loss", "forward")
    # the same function serves the rollout's no-grad forwards and the loss's: only the former are old/ref
    tracer.wrap_method(GRPOTrainer, "_get_per_token_logps_and_entropies", "old/ref log-probs", unless=("forward",))
    tracer.wrap_method(accelerate.Accelerator, "backward", "backward")
    tracer.hook_optimizer_steps()
    started = time.perf_counter()
    peft_config = LoraConfig(r=SHAPE["lora_r"], lora_alpha=SHAPE["lora_alpha"], target_modules="all-linear",
                             task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=str(model), reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config, callbacks=[Marks()])
    trainer.train()
    tracer.stop()
    write(args, "trl", {"trl_version": trl.__version__, "precision": {
        "bf16": config.bf16, "gradient_checkpointing": config.gradient_checkpointing, "loss_type": config.loss_type,
        "model_dtype": str(next(trainer.model.parameters()).dtype)},
        "seconds_per_update": per_update(marks), "cpu_seconds_per_update": per_update(cpu_marks),
        "total_s": time.perf_counter() - started}, tracer)


def write(args, impl: str, record: dict, tracer: PhaseTracer) -> None:
    import resource

    record.update(impl=impl, tag=args.tag, cpu=cpu_record(), threads=args.threads, updates=args.updates,
                  shape={**SHAPE, "model": args.shape}, phases=tracer.table(),
                  peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"{impl}: peak {record['peak_rss_gb']:.2f} GB, CPU s/update "
          f"{[round(c, 1) for c in record['cpu_seconds_per_update']]}", flush=True)


# --- both, alternately; the tables ---------------------------------------------------------------


def cmd_compare(args) -> None:
    for round_ in range(args.rounds):
        for impl in (("ours", "trl") if round_ % 2 == 0 else ("trl", "ours")):
            py = str(VENV / "bin" / "python") if impl == "trl" else sys.executable
            command = [py, __file__, impl, "--updates", str(args.updates), "--threads", str(args.threads),
                       "--tag", f"{args.tag}-r{round_}", "--shape", args.shape]
            print(f"[round {round_}] {impl} (load {load_average():.2f})", flush=True)
            before = load_average()
            subprocess.run(command, env=env(), cwd=ROOT, check=True)
            with RESULTS.open() as f:
                last = f.readlines()[-1]
            rec = json.loads(last)
            rec["load_average"] = [before, load_average()]
            lines = RESULTS.read_text().splitlines()
            RESULTS.write_text("\n".join(lines[:-1] + [json.dumps(rec)]) + "\n")


def cmd_report(args) -> None:
    runs = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]
    runs = [r for r in runs if r["tag"].startswith(args.tag)]
    by = {impl: [r for r in runs if r["impl"] == impl] for impl in ("trl", "ours")}
    cpu = runs[0]["cpu"] if runs else {}
    print(f"CPU: {cpu.get('cpu')}, avx512_bf16 {cpu.get('avx512_bf16')}, {cpu.get('cores')} cores; "
          f"threads {runs[0]['threads'] if runs else '-'}; load averages "
          f"{[r.get('load_average') for r in runs]}\n")
    med = {}
    for impl, rs in by.items():
        if not rs:
            continue
        cpu_s = statistics.median(c for r in rs for c in r["cpu_seconds_per_update"][1:5])
        wall = statistics.median(c for r in rs for c in r["seconds_per_update"][1:5])
        peak = statistics.median(r["peak_rss_gb"] for r in rs)
        med[impl] = (cpu_s, wall, peak)
    if len(med) == 2:
        print("| | TRL " + by["trl"][0].get("trl_version", "") + " GRPOTrainer | ppo_cli GRPO | ours / TRL |")
        print("| --- | ---: | ---: | ---: |")
        for i, name in enumerate(("CPU s per update (median of updates 2-5)", "wall s per update", "peak RSS (GB)")):
            print(f"| {name} | {med['trl'][i]:.2f} | {med['ours'][i]:.2f} | {med['ours'][i] / med['trl'][i]:.2f}x |")
        print(f"\nruns: TRL {len(by['trl'])}, ours {len(by['ours'])}; precision: TRL {by['trl'][0]['precision']}, "
              f"ours {by['ours'][0]['precision']}\n")
    # the phase table: peak RSS within each phase, the first update (1) and the last (median over runs)
    print("| phase | TRL peak GB, update 1 | ours peak GB, update 1 | TRL peak GB, update 2+ (max) | ours peak GB, update 2+ (max) |")
    print("| --- | ---: | ---: | ---: | ---: |")

    def phase_peak(rs, phase, first: bool) -> str:
        vals = []
        for r in rs:
            ups = r["phases"]
            keys = ["0"] if phase == "loading" else (["1"] if first else [u for u in ups if int(u) >= 2])
            got = [ups[u][phase]["peak_gb"] for u in keys if u in ups and phase in ups[u]]
            if got:
                vals.append(max(got))
        return f"{statistics.median(vals):.2f}" if vals else "-"

    for phase in PHASES:
        print(f"| {phase} | {phase_peak(by['trl'], phase, True)} | {phase_peak(by['ours'], phase, True)} | "
              f"{phase_peak(by['trl'], phase, False)} | {phase_peak(by['ours'], phase, False)} |")

    # the time table: CPU seconds per phase, median over updates 2-5 of every run (runs recorded before
    # the tracer timed its phases have none)
    def phase_cpu(rs, phase) -> float | None:
        vals = [r["phases"][u][phase]["cpu_s"] for r in rs for u in r["phases"]
                if 2 <= int(u) <= 5 and phase in r["phases"][u] and "cpu_s" in r["phases"][u][phase]]
        return statistics.median(vals) if vals else None

    timed = {impl: {phase: phase_cpu(rs, phase) for phase in PHASES if phase != "loading"} for impl, rs in by.items()}
    if any(v is not None for t in timed.values() for v in t.values()):
        print("\n| phase | TRL CPU s per update | ours CPU s per update | ours / TRL |")
        print("| --- | ---: | ---: | ---: |")
        for phase in timed["trl"]:
            trl, ours = timed["trl"][phase], timed["ours"][phase]
            ratio = f"{ours / trl:.2f}x" if trl and ours is not None and trl > 0.05 else "-"
            print(f"| {phase} | {'-' if trl is None else f'{trl:.2f}'} | {'-' if ours is None else f'{ours:.2f}'} | {ratio} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("setup")
    for name in ("ours", "trl", "compare"):
        p = sub.add_parser(name)
        p.add_argument("--updates", type=int, default=5)
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--tag", default="smollm2")
        p.add_argument("--shape", choices=sorted(MODELS), default="smollm2")
        if name == "ours":
            p.add_argument("--mixed-precision", default=None, help="override ours' default (auto)")
            p.add_argument("--set", action="append", default=[], help="section.key=value in ours' recipe, e.g. "
                           "train.gradient_checkpointing=false (a lever, not a default)")
        if name == "compare":
            p.add_argument("--rounds", type=int, default=2)
    p = sub.add_parser("report")
    p.add_argument("--tag", default="smollm2")
    args = ap.parse_args(argv)
    {"setup": cmd_setup, "ours": cmd_ours, "trl": cmd_trl, "compare": cmd_compare, "report": cmd_report}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
