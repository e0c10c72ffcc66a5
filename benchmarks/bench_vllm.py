"""Generation throughput, transformers generate vs vLLM, in one process on the same model and prompts.

Run in the vLLM venv (scripts/vllm_test.sh makes it), e.g.

    .venv-vllm/bin/python benchmarks/bench_vllm.py --model .cache/vllm-tiny/policy
    .venv-vllm/bin/python benchmarks/bench_vllm.py --shape qwen2.5-0.5b --dtype bfloat16

Both sample B prompts x T new tokens at temperature 1 from the full softmax (as PPO rollouts do):
transformers through ppo_cli's own generate(), vLLM through an in-process engine with the settings
ppo_cli's sampler uses (enforce_eager on CPU). The two alternate, after one warm-up call each, and the
median of the repeats is reported as generated tokens per second. --shape builds a random-weight model
of that layer shape (no download); vLLM on CPU needs head sizes of 32, 64, 80, 96, ...
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from ppo_cli.engine.precision_probe import machine_record

    print(f"machine: {machine_record()}", flush=True)  # every figure below was measured on it
    if (args.model is None) == (args.shape is None):
        ap.error("give --model or --shape")
    path = args.model or build_shape(args.shape, Path(tempfile.gettempdir()) / f"ppo_cli-bench-{args.shape}")

    import vllm
    from transformers import AutoModelForCausalLM
    from vllm.inputs import TokensPrompt

    from ppo_cli.engine.generate import generate
    from ppo_cli.recipe import GenerationConfig

    dtype = getattr(torch, args.dtype)
    threads = torch.get_num_threads()
    set_num_threads = torch.set_num_threads
    started = time.perf_counter()
    llm = vllm.LLM(model=str(path), dtype=args.dtype, skip_tokenizer_init=True, generation_config="vllm",
                   enforce_eager=True, kv_cache_memory_bytes=1 << 30, max_model_len=args.prompt_len + args.tokens,
                   seed=0)
    vllm_load = time.perf_counter() - started
    torch.set_num_threads = set_num_threads  # vLLM's CPU worker makes it a no-op for the process
    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    stop, pad = hf.config.eos_token_id, hf.config.pad_token_id

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
        out = generate(hf, prompt_ids, prompt_mask, gen, stop, pad)
        return int(out.response_mask.sum()), time.perf_counter() - t

    def run_vllm() -> tuple[int, float]:
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t

    rates = {"transformers": [], "vllm": []}
    run_hf(), run_vllm()  # warm-up
    for _ in range(args.repeats):
        for name, fn in (("transformers", run_hf), ("vllm", run_vllm)):
            tokens, seconds = fn()
            rates[name].append(tokens / seconds)
    print(f"model {path} ({args.dtype}), {args.prompts} prompts x {args.tokens} tokens, {threads} threads; "
          f"vLLM engine start {vllm_load:.1f} s")
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
