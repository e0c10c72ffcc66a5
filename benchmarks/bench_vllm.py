"""Generation throughput, transformers generate vs vLLM, in one process on the same model and prompts.

Run in the vLLM venv (scripts/vllm_test.sh makes it), e.g.

    .venv-vllm/bin/python benchmarks/bench_vllm.py --model .cache/vllm-tiny/policy
    .venv-vllm/bin/python benchmarks/bench_vllm.py --shape qwen2.5-0.5b --dtype bfloat16
    .venv-vllm/bin/python benchmarks/bench_vllm.py --model models/smollm2 --lora 16 --autocast bf16 \
        --prompts 16 --tokens 48 --prompt-len 40

--lora R samples both through the same LoRA adapter of rank R on every linear layer (nonzero, as after
training), transformers through peft, vLLM as ppo_cli's sampler hands it over. --autocast bf16 is what
`train.mixed_precision: auto` does on a bf16 CPU: float32 weights, transformers generating under bf16
autocast; vLLM then computes in bf16 (ppo_cli's sampler does the same: vllm_sampler.engine_dtype), unless
--vllm-dtype says otherwise. The engine's start-up time and the resident memory it adds are printed too.

Both sample B prompts x T new tokens at temperature 1 from the full softmax (as PPO rollouts do):
transformers through ppo_cli's own generate(), vLLM through an in-process engine with the settings
ppo_cli's sampler uses (enforce_eager on CPU). The two alternate, after one warm-up call each, and the
median of the repeats is reported as generated tokens per second. --shape builds a random-weight model
of that layer shape (no download); vLLM on CPU needs head sizes of 32, 64, 80, 96, ...
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

SHAPES = {
    # Qwen2.5-0.5B's layer sizes (config.json of the released model), random weights.
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=0, pad_token_id=1),
}


def build_shape(name: str, out: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if not (out / "config.json").exists():
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[name]))
        model.save_pretrained(out)
    return out


def resident_gb() -> float:
    """This process's resident set now (Linux), GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1e6
    return float("nan")


def add_lora(model, rank: int, out: Path):
    """``model`` with a LoRA adapter of ``rank`` on every linear layer, B nonzero (an untrained adapter
    changes nothing and could be skipped), and the vLLM LoRARequest of the same adapter saved at ``out``."""
    from peft import LoraConfig, get_peft_model
    from vllm.lora.request import LoRARequest

    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=1e-3)
    model.save_pretrained(out)
    return model.eval(), LoRARequest("bench", 1, str(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lora", type=int, default=0, help="rank of a LoRA adapter on every linear layer (0: none)")
    ap.add_argument("--autocast", default="no", choices=["no", "bf16"], help="transformers under this autocast")
    ap.add_argument("--vllm-dtype", choices=["float32", "bfloat16"], help="vLLM's dtype (default: as ppo_cli picks)")
    args = ap.parse_args()
    from ppo_cli.engine.precision_probe import machine_record

    print(f"machine: {machine_record()}", flush=True)  # every figure below was measured on it
    if (args.model is None) == (args.shape is None):
        ap.error("give --model or --shape")
    path = args.model or build_shape(args.shape, Path(tempfile.gettempdir()) / f"ppo_cli-bench-{args.shape}")

    import vllm
    from transformers import AutoConfig, AutoModelForCausalLM
    from vllm.inputs import TokensPrompt

    from ppo_cli.engine.generate import generate
    from ppo_cli.recipe import GenerationConfig

    from ppo_cli.engine.vllm_sampler import engine_dtype, kv_cache_bytes_for, max_lora_rank

    dtype = getattr(torch, args.dtype)
    vllm_dtype = args.vllm_dtype or str(engine_dtype(dtype, args.autocast)).removeprefix("torch.")
    threads = torch.get_num_threads()
    set_num_threads = torch.set_num_threads
    lora_kwargs = dict(enable_lora=True, max_lora_rank=max_lora_rank(args.lora), max_loras=1) if args.lora else {}
    # The KV cache ppo_cli's sampler gives a rollout batch of this shape.
    config = AutoConfig.from_pretrained(path)
    kv_bytes = kv_cache_bytes_for(args.prompts, args.prompt_len + args.tokens, config, getattr(torch, vllm_dtype))
    rss_before, started = resident_gb(), time.perf_counter()
    llm = vllm.LLM(model=str(path), dtype=vllm_dtype, skip_tokenizer_init=True, generation_config="vllm",
                   enforce_eager=True, kv_cache_memory_bytes=kv_bytes, max_model_len=args.prompt_len + args.tokens,
                   seed=0, **lora_kwargs)
    vllm_load, vllm_gb = time.perf_counter() - started, resident_gb() - rss_before
    torch.set_num_threads = set_num_threads  # vLLM's CPU worker makes it a no-op for the process
    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    stop, pad = hf.config.eos_token_id, hf.config.pad_token_id
    lora_request = None
    if args.lora:
        hf, lora_request = add_lora(hf, args.lora, Path(tempfile.mkdtemp(prefix="ppo_cli-bench-lora-")))
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if args.autocast == "bf16"
                else contextlib.nullcontext())

    torch.manual_seed(0)
    vocab = hf.config.vocab_size
    prompt_ids = torch.randint(2, vocab, (args.prompts, args.prompt_len))
    prompt_mask = torch.ones_like(prompt_ids, dtype=torch.bool)
    gen = GenerationConfig(max_new_tokens=args.tokens, temperature=1.0)
    params = vllm.SamplingParams(temperature=1.0, top_k=-1, top_p=1.0, max_tokens=args.tokens,
                                 stop_token_ids=[stop], detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=row.tolist()) for row in prompt_ids]

    def run_hf() -> tuple[int, float]:
        t = time.perf_counter()
        with autocast:
            out = generate(hf, prompt_ids, prompt_mask, gen, stop, pad)
        return int(out.response_mask.sum()), time.perf_counter() - t

    def run_vllm() -> tuple[int, float]:
        t = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=lora_request, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t

    rates = {"transformers": [], "vllm": []}
    run_hf(), run_vllm()  # warm-up
    for _ in range(args.repeats):
        for name, fn in (("transformers", run_hf), ("vllm", run_vllm)):
            tokens, seconds = fn()
            rates[name].append(tokens / seconds)
    lora = f"LoRA r{args.lora}" if args.lora else "no LoRA"
    print(f"model {path} ({args.dtype}, autocast {args.autocast}; vLLM {vllm_dtype}), {lora}, {args.prompts} prompts "
          f"x {args.tokens} tokens, {threads} threads; vLLM engine start {vllm_load:.1f} s, +{vllm_gb:.2f} GB resident")
    # On a shared machine single calls vary several-fold: the best call is the least disturbed one, and
    # each round's ratio compares two calls made one right after the other.
    for name, values in rates.items():
        print(f"  {name:12s} best {max(values):8.1f} tok/s, median {statistics.median(values):8.1f} "
              f"(of {len(values)}; lowest {min(values):.1f})")
    ratios = [v / h for v, h in zip(rates["vllm"], rates["transformers"])]
    print(f"  vllm / transformers: best-to-best {max(rates['vllm']) / max(rates['transformers']):.2f}, "
          f"median of the rounds' ratios {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
