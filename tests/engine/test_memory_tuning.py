"""engine/malloc.py keep_freed_memory: on glibc, freed activation-sized blocks stay in the process for reuse instead of
being unmapped and faulted in again (docs/benchmarks.md: backward 9.8 -> 5.8 s at the 0.5B shape)."""

import ctypes
import subprocess
import sys

import pytest

import torch

from ppo_cli.engine import engine as engine_module
from ppo_cli.engine.engine import EngineOptions
from ppo_cli.recipe_loading import load_recipe

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]

PROBE = """
import os, sys, torch
from ppo_cli.engine import malloc
if sys.argv[1] == "on":  # EngineOptions.cpu_malloc_tuning
    malloc.keep_freed_memory()
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
block = torch.ones(24 * 2**20 // 4)  # 24 MB: above glibc's default mmap threshold, below the tuned one
before = resident()
del block
print(before - resident())
"""


def _glibc() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "gnu_get_libc_version")
    except OSError:
        return False


def _released_mb(setting: str) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE, setting], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1]) / 2**20


@pytest.mark.slow
@pytest.mark.skipif(not _glibc(), reason="glibc malloc only")
def test_freed_block_stays_resident_only_when_tuned():
    assert _released_mb("off") > 20  # glibc's default: the block was mapped on its own and unmapped
    assert _released_mb("on") < 4  # tuned: it went back to the heap, pages kept for the next tensor


class _StopLoading(Exception):
    pass


def _raise_stop(*args, **kwargs):
    raise _StopLoading


@pytest.mark.parametrize("tuning", [False, True])
def test_load_engine_tunes_malloc_on_cpu_only_when_its_options_say(monkeypatch, tuning):
    calls = []
    monkeypatch.setattr(engine_module, "keep_freed_memory", lambda: calls.append("keep"))
    monkeypatch.setattr(engine_module, "load_tokenizer", _raise_stop)  # stop before any model loads
    recipe = load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml", ["train.num_threads=null"])
    with pytest.raises(_StopLoading):
        engine_module.load_engine(recipe, torch.device("cpu"), "no", options=EngineOptions(cpu_malloc_tuning=tuning))
    assert calls == (["keep"] if tuning else [])


RELEASE_PROBE = """
import os, sys, torch
from ppo_cli.engine import malloc
malloc.keep_freed_memory()
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
blocks = [torch.ones(8 * 2**20 // 4) for _ in range(32)]  # 256 MB of weight-sized tensors, from the heap
held = resident()
del blocks
kept = resident()
malloc.release_freed_memory()
print(held - kept, kept - resident())
"""


@pytest.mark.slow
@pytest.mark.skipif(not _glibc(), reason="glibc malloc only")
def test_release_hands_a_large_free_back_to_the_kernel():
    out = subprocess.run([sys.executable, "-c", RELEASE_PROBE], capture_output=True, text=True, check=True)
    kept_on_free, released = (int(n) / 2**20 for n in out.stdout.split()[-2:])
    assert kept_on_free < 16  # tuned: freeing 256 MB leaves the pages resident
    assert released > 200  # release_freed_memory (after FSDP shards the loaded policy) returns them


RETURN_PROBE = """
import os, sys, torch
from ppo_cli.engine import malloc
malloc.keep_freed_memory()
malloc.return_freed_memory()
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = resident()
blocks = [torch.ones(2 * 2**20 // 4) for _ in range(64)]  # 128 MB of one FSDP block's weight-sized tensors
held = resident() - before
del blocks
print(held, resident() - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not _glibc(), reason="glibc malloc only")
def test_return_freed_memory_unmaps_each_freed_block_at_once():
    out = subprocess.run([sys.executable, "-c", RETURN_PROBE], capture_output=True, text=True, check=True)
    held, left = (int(n) / 2**20 for n in out.stdout.split()[-2:])
    assert held > 120  # the 2 MB blocks were resident while alive
    assert left < 8  # under FSDP each freed block goes back to the kernel, even after keep_freed_memory


@pytest.mark.parametrize(("device", "tuning", "trims"),
                         [("cpu", True, 1), ("cpu", False, 0), ("cuda", True, 0), ("cuda", False, 0)])
def test_update_hands_the_tuned_heap_back_once_on_cpu_only(monkeypatch, device, tuning, trims):
    """trainer.release_update_memory, called once per train_step after the update: kept past the update,
    the tuned heap grew from update to update (docs/memory.md)."""
    from types import SimpleNamespace

    from ppo_cli import trainer

    calls = []
    monkeypatch.setattr(trainer, "release_freed_memory", lambda: calls.append("trim"))
    engine = SimpleNamespace(device=torch.device(device), options=EngineOptions(cpu_malloc_tuning=tuning))
    trainer.release_update_memory(engine)
    assert len(calls) == trims
