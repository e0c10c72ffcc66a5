#!/usr/bin/env python
"""Side-by-side benchmark: `ppo train` against TRL 1.12.0's PPOTrainer on the same models, prompts and config.

    python benchmarks/bench_vs_trl.py setup      # TRL 1.12.0 in its own venv (.cache/trl-venv), versions matched to ours
    python benchmarks/bench_vs_trl.py models     # bench models under .cache/bench/ (tiny + the 0.5B shape), prompts
    python benchmarks/bench_vs_trl.py models --smollm2   # also the real SmolLM2-135M-Instruct (compare --shape smollm2)
    python benchmarks/bench_vs_trl.py compare --shape 0.5b --updates 5 --rounds 2
    python benchmarks/bench_vs_trl.py compare --shape tiny --updates 40 --rounds 3    # also the reward curves
    python benchmarks/bench_vs_trl.py scaling --shape 0.5b                            # ours at 3 batch sizes, 3 lengths
    python benchmarks/bench_vs_trl.py memory --shape 0.5b                             # ours, peak memory per configuration
    python benchmarks/bench_vs_trl.py report     # markdown tables from .cache/bench/results/*.jsonl

Shapes: ``tiny`` is the test suite's tiny review LM (scripts/make_tiny_models.py) with a scalar reward
model derived from its sentiment classifier (score = logit(positive) - logit(negative)); ``0.5b`` has
random weights (seeded) with Qwen2.5-0.5B's layer sizes (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, tied embeddings) on the tiny tokenizer's vocabulary, and a 1-label reward model of
the same shape; ``smollm2`` is a real pretrained model, SmolLM2-135M-Instruct (scripts/fetch_smollm2.py:
Llama, 30 layers, hidden 576, dequantized from a Q4_1 GGUF), with a 1-label reward model made of the same
weights and a seeded random score head. TRL takes the reward model as its reward and, as in TRL's examples, as the value
model's initialisation; ppo_cli takes the same model as a `type: model` reward component.

Runs alternate between the two implementations (the order flips every round) so that machine noise
hits both. Every run is a separate process; its peak memory is the process's peak resident set size
(CPU) and includes model loading. Seconds per update are medians after dropping warm-up updates.

Never imported by ppo_cli or its tests.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "bench"
RESULTS = CACHE / "results"
TRL_VENV = ROOT / ".cache" / "trl-venv"
TRL_VERSION = "1.12.0"
TORCH_VERSION = "2.13.0"  # any other version pulls a multi-GB CUDA build

QWEN_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                intermediate_size=4864, tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                max_position_embeddings=512)


def env() -> dict:
    e = dict(os.environ)
    e.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return e


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def wait_for_quiet(limit: float, max_wait: float = 1800) -> float:
    """Poll the 1-minute load every 30 s until it is below ``limit`` (or max_wait passes)."""
    waited = 0.0
    while load_average() >= limit and waited < max_wait:
        print(f"  load {load_average():.2f} >= {limit}: waiting 30 s", flush=True)
        time.sleep(30)
        waited += 30
    return load_average()


# --- setup: TRL in its own venv ------------------------------------------------------------------


def cmd_setup(args) -> None:
    py = TRL_VENV / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run(pip + [f"torch=={TORCH_VERSION}"], check=True)  # first, so nothing pulls a CUDA build
    pins = [f"{name}=={md.version(name)}" for name in ("transformers", "peft", "accelerate")]
    subprocess.run(pip + [f"trl=={TRL_VERSION}", *pins], check=True)
    out = subprocess.run([str(py), "-c", "import torch, transformers, peft, trl; print(torch.__version__, "
                          "transformers.__version__, peft.__version__, trl.__version__)"],
                         check=True, capture_output=True, text=True, env=env())
    print("trl-venv:", out.stdout.strip())


# --- models and prompts --------------------------------------------------------------------------


def tiny_source(args) -> Path:
    if getattr(args, "tiny_models", None):
        return Path(args.tiny_models)
    if os.environ.get("PPO_TINY_MODELS"):
        return Path(os.environ["PPO_TINY_MODELS"])
    sys.path.insert(0, str(ROOT))
    from tests.fixtures.model_cache import built_tiny_models

    return built_tiny_models(env())


def _tiny_script():
    """The tiny models' builder (its review generator writes the prompts)."""
    sys.path.insert(0, str(ROOT))
    from tests.fixtures import tiny_models

    return tiny_models


def write_prompts(path: Path, n: int = 256, seed: int = 1234) -> None:
    tiny = _tiny_script()
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        category = rng.choice(sorted(tiny.SUBJECTS))
        prompts.append(tiny.make_opener(rng, rng.choice(tiny.SUBJECTS[category]), category))
    path.write_text("\n".join(prompts) + "\n")


SMOLLM2 = ROOT / ".cache" / "smollm2-0.1.2"  # written by scripts/fetch_smollm2.py


def shape_paths(shape: str) -> dict[str, Path]:
    base = CACHE / shape
    policy = SMOLLM2 if shape == "smollm2" else base / "policy"
    return {"policy": policy, "reward": base / "reward", "prompts": CACHE / "prompts.txt"}


def smollm2_reward_model(seed: int) -> None:
    """The real SmolLM2 weights under a seeded 1-label score head, as both tools' reward model."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    paths = shape_paths("smollm2")
    if (paths["reward"] / "config.json").exists():
        return
    subprocess.run([sys.executable, str(ROOT / "scripts" / "fetch_smollm2.py")], check=True, cwd=ROOT)
    torch.manual_seed(seed + 1)
    rm = AutoModelForSequenceClassification.from_pretrained(paths["policy"], num_labels=1, dtype=torch.float32)
    rm.config.pad_token_id = rm.config.eos_token_id  # the score is read at the last non-pad token
    rm.save_pretrained(paths["reward"])
    AutoTokenizer.from_pretrained(paths["policy"]).save_pretrained(paths["reward"])
    print("wrote", paths["reward"])


def cmd_models(args) -> None:
    import torch
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2ForSequenceClassification,
    )

    CACHE.mkdir(parents=True, exist_ok=True)
    src = tiny_source(args)
    if not (CACHE / "prompts.txt").exists():
        write_prompts(CACHE / "prompts.txt")
    tokenizer = AutoTokenizer.from_pretrained(src / "policy")

    tiny = shape_paths("tiny")
    if not (tiny["reward"] / "config.json").exists():
        # The tiny policy as built; a scalar reward model from the 3-label sentiment classifier.
        tiny["policy"].parent.mkdir(parents=True, exist_ok=True)
        if not tiny["policy"].exists():
            shutil.copytree(src / "policy", tiny["policy"])
        cls = AutoModelForSequenceClassification.from_pretrained(src / "reward", dtype=torch.float32)
        label = {v.lower(): int(k) for k, v in cls.config.id2label.items()}
        config = cls.config
        config.num_labels = 1
        config.id2label, config.label2id = {0: "LABEL_0"}, {"LABEL_0": 0}
        config.problem_type = "regression"
        scalar = Qwen2ForSequenceClassification(config)
        state = cls.state_dict()
        weight = state.pop("score.weight")
        state["score.weight"] = (weight[label["positive"]] - weight[label["negative"]]).unsqueeze(0)
        scalar.load_state_dict(state)
        scalar.save_pretrained(tiny["reward"])
        tokenizer.save_pretrained(tiny["reward"])
        print("wrote", tiny["reward"])

    big = shape_paths("0.5b")
    if not (big["reward"] / "config.json").exists():
        config = Qwen2Config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **QWEN_05B)
        torch.manual_seed(args.seed)
        lm = Qwen2ForCausalLM(config)
        lm.save_pretrained(big["policy"])
        tokenizer.save_pretrained(big["policy"])
        del lm
        torch.manual_seed(args.seed + 1)
        config.num_labels = 1
        rm = Qwen2ForSequenceClassification(config)
        rm.save_pretrained(big["reward"])
        tokenizer.save_pretrained(big["reward"])
        print("wrote", big["policy"], big["reward"],
              f"({sum(p.numel() for p in rm.parameters()) / 1e6:.1f}M parameters each)")
    if args.smollm2:
        smollm2_reward_model(args.seed)


# --- one run of each implementation --------------------------------------------------------------


def bench_config(args, **override) -> dict:
    """The shared settings of one comparison (both implementations get exactly these)."""
    cfg = dict(
        shape=args.shape, lora=True, updates=args.updates, batch=8, mini_batches=1, micro_batch=8, epochs=4,
        response_length=24, temperature=1.0, kl_coef=0.05, lr=None, missing_eos_penalty=None, seed=0,
        threads=getattr(args, "threads", 2),
        value_kind="head", rollout_logprobs="generation", precision="fp32", device="cpu",
    )
    cfg.update(override)
    if cfg["lr"] is None:
        cfg["lr"] = 3e-3 if cfg["lora"] else 1e-4
    if cfg["missing_eos_penalty"] is None and cfg["shape"] == "tiny":
        cfg["missing_eos_penalty"] = 10.0  # the tiny task's penalty (recipes/tiny_sentiment.yaml)
    return cfg


VALUE_CONFIGS = {
    # a separate critic initialised from the reward model, as TRL's value model
    "model-reward": {"kind": "model", "init_from": "reward"},
    # the same with its backbone frozen (only the head trains; shares the reward model's weights)
    "model-reward-frozen": {"kind": "model", "init_from": "reward", "train_backbone": False},
}


def ours_recipe(cfg: dict, name: str, extra: dict | None = None) -> dict:
    paths = shape_paths(cfg["shape"])
    recipe = {
        "name": name,
        "seed": cfg["seed"],
        "output_dir": str(CACHE / "runs"),
        "policy": {"path": str(paths["policy"]), "dtype": "float32",
                   "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"} if cfg["lora"] else None},
        "value": VALUE_CONFIGS.get(cfg["value_kind"], {"kind": cfg["value_kind"]}),
        "reward": {"components": [{"type": "model", "path": str(paths["reward"]), "batch_size": 64}],
                   "missing_eos_penalty": cfg["missing_eos_penalty"]},
        "data": {"prompts": str(paths["prompts"]), "max_prompt_tokens": 32},
        "generation": {"max_new_tokens": cfg["response_length"], "temperature": cfg["temperature"]},
        "ppo": {"rollout_batch_size": cfg["batch"], "mini_batch_size": cfg["batch"] // cfg["mini_batches"],
                "micro_batch_size": cfg["micro_batch"], "ppo_epochs": cfg["epochs"], "kl_coef": cfg["kl_coef"],
                "kl_estimator": "k1", "cliprange": 0.2, "cliprange_value": 0.2, "vf_coef": 0.1, "gamma": 1.0,
                "gae_lambda": 0.95, "whiten_advantages": True, "whiten_rewards": False,
                "rollout_logprobs": cfg["rollout_logprobs"]},
        "optim": {"lr": cfg["lr"], "max_grad_norm": None, "scheduler": "constant"},  # TRL never clips
        "train": {"total_updates": cfg["updates"], "sample_every": 0, "device": cfg.get("device", "cpu"), "num_threads": cfg["threads"],
                  "mixed_precision": "no" if cfg.get("precision", "fp32") == "fp32" else "auto"},
    }
    for key, value in (extra or {}).items():  # dotted keys, e.g. {"reference.quantization": "4bit"}
        if key == "_reward_component":
            recipe["reward"]["components"][0].update(value)
            continue
        node = recipe
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return recipe


def run_ours(cfg: dict, tag: str, extra: dict | None = None) -> dict:
    import yaml

    name = f"bench-{tag}"
    recipe_path = CACHE / "recipes" / f"{name}.yaml"
    recipe_path.parent.mkdir(parents=True, exist_ok=True)
    recipe_path.write_text(yaml.safe_dump(ours_recipe(cfg, name, extra), sort_keys=False))
    ppo = ROOT / ".venv" / "bin" / "ppo"
    command = [str(ppo) if ppo.exists() else "ppo", "train", str(recipe_path), "--overwrite"]
    started = time.perf_counter()
    proc = subprocess.run(command, env=env(), capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"ppo train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    run_dir = CACHE / "runs" / name
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "impl": "ours",
        "command": " ".join(command[1:]),
        "seconds_per_update": [m["time/step_s"] for m in metrics],
        "cpu_seconds_per_update": [m["time/step_cpu_s"] for m in metrics],
        "rollout_seconds": [m["time/rollout_s"] for m in metrics],
        "scores": [m["objective/scores"] for m in metrics],
        "kl": [m["objective/kl"] for m in metrics],
        "generated_tokens": [m["response_length"] * cfg["batch"] for m in metrics],
        "peak_memory_gb": summary["peak_memory_gb"],
        "wall_s": time.perf_counter() - started,
    }


def run_trl(cfg: dict, tag: str) -> dict:
    paths = shape_paths(cfg["shape"])
    out = CACHE / "trl-out" / f"{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [
        str(TRL_VENV / "bin" / "python"), str(ROOT / "benchmarks" / "bench_trl_driver.py"),
        "--policy", str(paths["policy"]), "--reward", str(paths["reward"]), "--prompts", str(paths["prompts"]),
        "--updates", str(cfg["updates"]), "--batch", str(cfg["batch"]), "--mini-batches", str(cfg["mini_batches"]),
        "--micro-batch", str(cfg["micro_batch"]), "--epochs", str(cfg["epochs"]),
        "--response-length", str(cfg["response_length"]), "--temperature", str(cfg["temperature"]),
        "--kl-coef", str(cfg["kl_coef"]), "--lr", str(cfg["lr"]), "--seed", str(cfg["seed"]),
        "--threads", str(cfg["threads"]), "--out", str(out),
    ]
    if cfg["lora"]:
        command.append("--lora")
    if cfg.get("precision") == "native":
        command.append("--bf16")  # TRL's PPOConfig default
    if cfg["missing_eos_penalty"] is not None:
        command += ["--missing-eos-penalty", str(cfg["missing_eos_penalty"])]
    return run_trl_driver(command, out)


def run_trl_driver(command: list[str], out: Path) -> dict:
    """Run a TRL driver (its venv's python first in ``command``) and read the JSON it wrote to ``out``,
    with the command and the wall time added."""
    started = time.perf_counter()
    proc = subprocess.run(command, env=env(), capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    result["command"] = " ".join(Path(c).name if i == 0 else c for i, c in enumerate(command))
    result["wall_s"] = time.perf_counter() - started
    return result


def record(result: dict, cfg: dict, kind: str, path: Path) -> None:
    from ppo_cli.engine.precision_probe import machine_record

    result.update(cfg=cfg, kind=kind, load_at_start=result.get("load_at_start"), time=time.strftime("%Y-%m-%d %H:%M:%S"),
                  machine=machine_record(), auto_precision=auto_precision(cfg))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(result) + "\n")


def _brief(result: dict, warmup: int) -> str:
    s = result["seconds_per_update"][warmup:] or result["seconds_per_update"]
    cpu = result.get("cpu_seconds_per_update") or []
    cpu = f", {statistics.median(cpu[warmup:] or cpu):.2f} CPU s/update" if cpu else ""
    return (f"{result['impl']:>5}: {statistics.median(s):7.2f} s/update{cpu}, peak {result['peak_memory_gb']:.2f} GB, "
            f"mean score {statistics.fmean(result['scores']):+.3f}")


def cmd_compare(args) -> None:
    """Rounds of side-by-side runs: TRL once per --precision, ours once per (--value-kind, precision it
    resolves to); the order flips every round."""
    out = RESULTS / f"compare-{args.shape}{args.tag}.jsonl"
    modes = [m.strip() for m in args.modes.split(",")]
    precisions = [p.strip() for p in args.precision.split(",")]
    # "model-reward@fp32": that critic at that precision only
    kind_precisions = {k.split("@")[0]: [k.split("@")[1]] for k in args.value_kind.split(",") if "@" in k}
    kinds = value_kinds(",".join(k.split("@")[0] for k in args.value_kind.split(",")))
    impls = args.impls.split(",")
    for round_ in range(args.rounds):
        for mode in modes:
            runs = [("trl", None, p) for p in precisions if "trl" in impls]
            runs += [("ours", k, p) for k in kinds for p in ours_precisions(precisions)
                     if "ours" in impls and p in kind_precisions.get(k, precisions)]
            for impl, kind, precision in runs if round_ % 2 == 0 else runs[::-1]:
                cfg = bench_config(args, lora=(mode == "lora"), value_kind=kind or "model-reward", seed=args.seed + round_,
                                   lr=args.lr, precision=precision)
                load = wait_for_quiet(args.max_load) if args.max_load else load_average()
                tag = f"{args.shape}{args.tag}-{mode}-{impl}-{kind or 'trl'}-{precision}-r{round_}"
                print(f"[round {round_}] {tag} (load {load:.2f})", flush=True)
                result = run_ours(cfg, tag) if impl == "ours" else run_trl(cfg, tag)
                result["load_at_start"] = load
                record(result, cfg, "compare", out)
                print("   ", _brief(result, args.warmup), flush=True)


def auto_precision(cfg: dict) -> str:
    """What train.mixed_precision auto resolves to on this machine at the run's policy widths, with the
    probe's timings (PrecisionChoice.describe)."""
    import torch

    from ppo_cli.engine.precision import model_widths, resolve_mixed_precision

    torch.set_num_threads(cfg["threads"])
    path = shape_paths(cfg["shape"])["policy"]
    widths = model_widths(str(path)) if Path(path).exists() else None
    return resolve_mixed_precision("auto", torch.device("cpu"), torch.float32, widths=widths).describe()


def ours_precisions(precisions: list[str], widths: tuple[int, int] | None = None) -> list[str]:
    """Ours runs 'native' (train.mixed_precision auto) only where auto is not fp32 already (the probe decides)."""
    if "native" not in precisions:
        return precisions
    import torch

    from ppo_cli.engine.precision import resolve_mixed_precision

    native_is_fp32 = resolve_mixed_precision("auto", torch.device("cpu"), torch.float32, widths=widths).value == "no"
    return [p for p in precisions if not (p == "native" and native_is_fp32 and "fp32" in precisions)]


VALUE_KINDS = ("head", "adapter", "model", "model-reward", "model-reward-frozen", "auto")


def value_kinds(spec: str) -> list[str]:
    """--value-kind auto,model-reward -> ['auto', 'model-reward'] (ours runs once per kind)."""
    kinds = [k.strip() for k in spec.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in VALUE_KINDS]
    if unknown or not kinds:
        raise SystemExit(f"--value-kind: unknown {unknown}; choose from {', '.join(VALUE_KINDS)}")
    return kinds


def cmd_scaling(args) -> None:
    out = RESULTS / f"scaling-{args.shape}{args.tag}.jsonl"
    points = [("batch", b, 24) for b in (4, 8, 16)] + [("length", 8, n) for n in (12, 24, 48)]
    if args.only:  # e.g. "b8-n24,b8-n48,b8-n12,b8-n12,b8-n48,b8-n24": these points, in this order
        points = []
        for point in args.only.split(","):
            batch, length = (int(part[1:]) for part in point.split("-"))
            points.append(("batch" if length == 24 else "length", batch, length))
    for axis, batch, length in points:
        cfg = bench_config(args, batch=batch, micro_batch=batch, response_length=length, value_kind=args.value_kind)
        load = wait_for_quiet(args.max_load) if args.max_load else load_average()
        tag = f"{args.shape}-scale-b{batch}-n{length}"
        print(f"{tag} (load {load:.2f})", flush=True)
        result = run_ours(cfg, tag)
        result.update(load_at_start=load, axis=axis)
        record(result, cfg, "scaling", out)
        print("   ", _brief(result, args.warmup), flush=True)


MEMORY_CONFIGS = {
    # name: (lora, value kind, recipe extras)
    "full, separate critic + reference copy": (False, "model", {}),
    "full, value head on the policy": (False, "head", {}),
    "full, value head, 4-bit reference + reward": (False, "head", {"reference.quantization": "4bit",
                                                                   "reward.components.0.quantization": "4bit"}),
    "LoRA, critic = 2nd adapter": (True, "adapter", {}),
    "LoRA, value head on the policy": (True, "head", {}),
    "QLoRA (4-bit base), value head, 4-bit reward": (True, "head", {"policy.quantization": "4bit",
                                                                  "reward.components.0.quantization": "4bit"}),
}


def cmd_memory(args) -> None:
    out = RESULTS / f"memory-{args.shape}.jsonl"
    names = list(MEMORY_CONFIGS) if not args.only else [n for n in MEMORY_CONFIGS if args.only in n]
    for i, name in enumerate(names):
        lora, kind, extra = MEMORY_CONFIGS[name]
        cfg = bench_config(args, lora=lora, value_kind=kind)
        load = wait_for_quiet(args.max_load) if args.max_load else load_average()
        print(f"{name} (load {load:.2f})", flush=True)
        result = run_ours(cfg, f"{args.shape}-mem{i}", _reward_extra(extra))
        result.update(load_at_start=load, config_name=name, extra=extra)
        record(result, cfg, "memory", out)
        print("   ", _brief(result, args.warmup), flush=True)


def _reward_extra(extra: dict) -> dict:
    """'reward.components.0.x' cannot be set through the dict walk (a list): rewrite it here."""
    fixed = {}
    for key, value in extra.items():
        if key.startswith("reward.components.0."):
            fixed.setdefault("_reward_component", {})[key.rsplit(".", 1)[1]] = value
        else:
            fixed[key] = value
    return fixed


def cmd_plan_check(args) -> None:
    """`ppo plan`'s estimate for every measured ppo_cli run, against its measured peak."""
    from ppo_cli.commands.plan import run as plan
    from ppo_cli.recipe_loading import load_recipe

    rows = []
    for path in sorted(RESULTS.glob("*.jsonl")):
        for r in _load(path):
            if r["impl"] != "ours":
                continue
            recipe_path = Path(r["command"].split()[1])
            if not recipe_path.exists():
                continue
            est = plan(load_recipe(recipe_path), device="cpu").estimate
            label = r.get("config_name") or f"{'LoRA' if r['cfg']['lora'] else 'full'}, value {r['cfg']['value_kind']}"
            rows.append((r["time"], r["cfg"]["shape"], label, r["cfg"]["batch"], r["cfg"]["response_length"],
                         est.total_gb, r["peak_memory_gb"]))
    print("| shape | configuration | batch | response tokens | plan GB | measured peak GB | measured | error |")
    print("|---|---|---|---|---|---|---|---|")
    latest = {}  # the latest measurement per configuration: the code measured is the code planned
    for row in sorted(rows):
        latest[row[1:5]] = row
    for when, shape, label, batch, length, est, peak in latest.values():
        print(f"| {shape} | {label} | {batch} | {length} | {est:.2f} | {peak:.2f} | {when[11:16]} | {100 * (est - peak) / peak:+.0f}% |")


# --- report --------------------------------------------------------------------------------------


def _load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def summarise(results: list[dict], warmup: int) -> dict:
    seconds = [s for r in results for s in (r["seconds_per_update"][warmup:] or r["seconds_per_update"])]
    tokens = [t for r in results for t in (r["generated_tokens"][warmup:] or r["generated_tokens"])]
    batch = results[0]["cfg"]["batch"]
    med = statistics.median(seconds)
    return {
        "s_per_update": med,
        "episodes_per_s": batch / med,
        "tokens_per_s": sum(tokens) / sum(seconds),
        "peak_gb": statistics.median(r["peak_memory_gb"] for r in results),
        "mean_score": statistics.fmean(s for r in results for s in r["scores"]),
        "last_score": statistics.fmean(s for r in results for s in r["scores"][-max(1, len(r["scores"]) // 4):]),
        "runs": len(results),
        "updates_measured": len(seconds),
        "load": [r.get("load_at_start") for r in results],
    }


def side_by_side_table(results: list[dict], shape: str, warmup: int, title: str) -> None:
    """One row per (implementation, critic, precision); ours is divided by TRL at the same precision
    (fp32) and, for ours' own default, by TRL at its own default (bf16) too."""
    times = sorted({r["time"][11:16] for r in results})
    print(f"### {shape}: side by side{title} (runs finished {times[0]}-{times[-1]}; median after {warmup} warm-up update(s) per run)\n")
    print("| mode | impl | precision | s/update | episodes/s | gen tokens/s | peak GB | mean score/update | runs x updates | ours/TRL time | ours/TRL memory |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = []
    precision_of = lambda r: r["cfg"].get("precision", "fp32")  # noqa: E731
    for mode in ("lora", "full"):
        groups = [("trl", None, p) for p in ("fp32", "native")]
        groups += [("ours", k, p) for k in ("auto", "head", "adapter", "model", "model-reward", "model-reward-frozen")
                   for p in ("fp32", "native")]
        rows = {}
        for impl, kind, precision in groups:
            sel = [r for r in results if r["impl"] == impl and r["cfg"]["lora"] == (mode == "lora")
                   and precision_of(r) == precision and (kind is None or r["cfg"]["value_kind"] == kind)]
            if not sel:
                continue
            s = rows[impl, kind, precision] = summarise(sel, warmup)
            label = "TRL 1.12.0" if impl == "trl" else f"ppo_cli, value {kind}"
            shown = {"fp32": "fp32", "native": "bf16 (TRL default)" if impl == "trl" else "auto"}[precision]
            ratio = " | "
            trl = rows.get(("trl", None, precision))
            if impl == "ours" and trl is not None:
                t, m = s["s_per_update"] / trl["s_per_update"], s["peak_gb"] / trl["peak_gb"]
                ratio = f"{t:.2f} | {m:.2f}"
                ratios.append((mode, kind, precision, precision, t, m))
            print(f"| {mode} | {label} | {shown} | {s['s_per_update']:.2f} | {s['episodes_per_s']:.2f} | {s['tokens_per_s']:.1f} | "
                  f"{s['peak_gb']:.2f} | {s['mean_score']:+.3f} | {s['runs']} x {s['updates_measured'] // s['runs']} | {ratio} |")
        # Each tool at its own default: ours fp32 (auto on CPU) against TRL's bf16.
        trl_native = rows.get(("trl", None, "native"))
        for (impl, kind, precision), s in rows.items():
            if impl == "ours" and precision == "fp32" and trl_native is not None:
                ratios.append((mode, kind, "fp32", "native", s["s_per_update"] / trl_native["s_per_update"],
                               s["peak_gb"] / trl_native["peak_gb"]))
    for mode, kind, ours_p, trl_p, t, m in ratios:
        print(f"\n{shape} {mode}, value {kind}, ours {ours_p} vs TRL {trl_p}: ours/TRL seconds per update = {t:.2f}, "
              f"peak memory = {m:.2f}")
    print()


def scaling_table(results: list[dict], shape: str, tag: str) -> None:
    """Every run in the order it ran; with a tag (e.g. -interleaved), also the mean per point and the
    growth per doubling, so runs taken early and late in the pass weigh the same for every point."""
    if not results:
        return
    print(f"### {shape}: scaling (ours){' ' + tag.lstrip('-') if tag else ''}\n\n| finished | rollout batch | response tokens | "
          "s/update | rollout s | s per generated token | peak GB |")
    print("|---|---|---|---|---|---|---|")
    per_point: dict[tuple[int, int], list[float]] = {}
    for r in results:
        s = summarise([r], 1)
        rollout = statistics.median(r["rollout_seconds"][1:] or r["rollout_seconds"])
        per_point.setdefault((r["cfg"]["batch"], r["cfg"]["response_length"]), []).append(s["s_per_update"])
        print(f"| {r['time'][11:16]} | {r['cfg']['batch']} | {r['cfg']['response_length']} | {s['s_per_update']:.2f} | "
              f"{rollout:.2f} | {s['s_per_update'] / (r['cfg']['batch'] * r['cfg']['response_length']):.4f} | "
              f"{r['peak_memory_gb']:.2f} |")
    print()
    if tag:
        points = sorted(per_point)
        means = {p: statistics.fmean(v) for p, v in per_point.items()}
        print("| rollout batch | response tokens | runs | mean s/update | x previous point |\n|---|---|---|---|---|")
        for i, p in enumerate(points):
            growth = f"{means[p] / means[points[i - 1]]:.2f}x" if i else ""
            print(f"| {p[0]} | {p[1]} | {len(per_point[p])} | {means[p]:.2f} | {growth} |")
        print()


def _se(values: list[float]) -> str:
    return f" ± {statistics.stdev(values) / len(values) ** 0.5:.2f}" if len(values) > 1 else ""


def cmd_report(args) -> None:
    from ppo_cli.engine.precision_probe import machine as cpu

    print(f"machine: {machine()}; {cpu().describe()}\n")
    for shape in ("tiny", "0.5b"):
        # compare-{shape}.jsonl, plus -arch (ours with other value kinds) and, for tiny, the curve runs;
        # a later round (-late) gets its own table: the machine's speed drifts over an hour.
        # Timing tables: compare-{shape}.jsonl (and the first tiny curve pairs), then one table per later
        # round (e.g. -late): the machine's speed drifts over an hour. Other curve files (-earlier: under
        # load; -lr1e-3: beside CI; -s3: ours alone) are reward curves only.
        main = _load(RESULTS / f"compare-{shape}.jsonl") + (_load(RESULTS / "compare-tiny-curve.jsonl") if shape == "tiny" else [])
        later = [p for p in sorted(RESULTS.glob(f"compare-{shape}-*.jsonl")) if "curve" not in p.stem]
        warmup = 1 if shape == "0.5b" else 3
        for results, title in [(main, "")] + [(_load(p), f", round {p.stem.split('-', 2)[2]}") for p in later]:
            if results:
                side_by_side_table(results, shape, warmup, title)
    # Every curve run, the latest per (implementation, value kind, mode, lr, seed).
    latest = {}
    runs = [r for path in RESULTS.glob("compare-tiny-curve*.jsonl") for r in _load(path)]
    for r in sorted(runs, key=lambda r: r["time"]):
        c = r["cfg"]
        latest[r["impl"], c["value_kind"] if r["impl"] == "ours" else None, c["lora"], c["lr"], c["seed"]] = r
    curves = list(latest.values())
    if curves:
        print("### tiny: reward curves (objective/scores per update, mean over seeds)\n")
        n = min(len(r["scores"]) for r in curves)
        size = max(1, n // 8)
        blocks = [(i, min(n, i + size)) for i in range(0, n, size)]
        # "± x": the standard error over seeds (of each seed's mean over the run, or over the last 10)
        print("| mode | impl | seeds | " + " | ".join(f"{a + 1}-{b}" for a, b in blocks) + " | all | last 10 | worst seed, last 10 |")
        print("|---|---|---|" + "---|" * (len(blocks) + 3))
        for lora, lr in sorted({(k[2], k[3]) for k in latest}, reverse=True):
            for impl, kind in sorted({(k[0], k[1]) for k in latest if (k[2], k[3]) == (lora, lr)},
                                     key=lambda x: (x[0] != "trl", x[1] or "")):
                sel = [r for k, r in latest.items() if k[:4] == (impl, kind, lora, lr)]
                mean = [statistics.fmean(r["scores"][i] for r in sel) for i in range(n)]
                per_seed_all = [statistics.fmean(r["scores"][:n]) for r in sel]
                per_seed_last = [statistics.fmean(r["scores"][n - 10:n]) for r in sel]
                worst = min(per_seed_last)
                label = "TRL 1.12.0 (value model = reward model copy)" if impl == "trl" else f"ppo_cli, value {kind}"
                cells = [f"{statistics.fmean(mean[a:b]):+.2f}" for a, b in blocks]
                print(f"| {'LoRA' if lora else 'full'} (lr {lr:g}) | {label} | {len(sel)} | " + " | ".join(cells)
                      + f" | {statistics.fmean(mean):+.2f}{_se(per_seed_all)} | {statistics.fmean(mean[-10:]):+.2f}{_se(per_seed_last)}"
                      f" | {worst:+.2f} |")
        print()
    for shape in ("tiny", "0.5b"):
        for path in sorted(RESULTS.glob(f"scaling-{shape}*.jsonl")):
            scaling_table(_load(path), shape, path.stem[len(f"scaling-{shape}"):])
        results = _load(RESULTS / f"memory-{shape}.jsonl")
        if results:
            print(f"### {shape}: peak memory per configuration (ours, CPU)\n\n| configuration | peak GB |")
            print("|---|---|")
            for r in results:
                print(f"| {r['config_name']} | {r['peak_memory_gb']:.2f} |")
            print()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("setup")
    p = sub.add_parser("models")
    p.add_argument("--tiny-models", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smollm2", action="store_true", help="also the smollm2 shape (fetches the real weights)")
    for name in ("compare", "scaling", "memory"):
        p = sub.add_parser(name)
        p.add_argument("--shape", choices=("tiny", "0.5b", "smollm2"), default="0.5b")
        p.add_argument("--updates", type=int, default=5)
        p.add_argument("--rounds", type=int, default=2)
        p.add_argument("--modes", default="lora,full")
        p.add_argument("--value-kind", default="head",
                       help=f"ours' critic, or several comma-separated (compare: one run of ours each): {', '.join(VALUE_KINDS)}")
        p.add_argument("--precision", default="fp32",
                       help="fp32 for both, native: each tool's own default (TRL: PPOConfig's bf16=True; ours: "
                            "train.mixed_precision auto), or fp32,native (compare: one run per precision)")
        p.add_argument("--impls", default="trl,ours")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--warmup", type=int, default=1)
        p.add_argument("--max-load", type=float, default=1.2, help="wait until the 1-minute load is below this (0: never)")
        p.add_argument("--only", default=None)
        p.add_argument("--tag", default="", help="suffix of the results file, e.g. -curve")
        p.add_argument("--threads", type=int, default=2, help="torch threads per run (1 on a shared machine)")
        p.add_argument("--lr", type=float, default=None, help="default: 3e-3 with LoRA, 1e-4 full")
    sub.add_parser("plan-check")
    p = sub.add_parser("report")
    p.add_argument("--value-kind", default="head")
    args = ap.parse_args(argv)
    {"setup": cmd_setup, "models": cmd_models, "compare": cmd_compare, "scaling": cmd_scaling,
     "memory": cmd_memory, "report": cmd_report, "plan-check": cmd_plan_check}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
