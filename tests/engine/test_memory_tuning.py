"""engine/malloc.py keep_freed_memory: on glibc, freed activation-sized blocks stay in the process for reuse instead of
being unmapped and faulted in again (docs/benchmarks.md: backward 9.8 -> 5.8 s at the 0.5B shape)."""

import ctypes
import subprocess
import sys

import pytest

import torch

from ppo_cli.engine import engine as engine_module
from ppo_cli.engine import malloc as malloc_module
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
    monkeypatch.setattr(engine_module, "tune_for_training", lambda checkpointing: calls.append("keep"))
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


@pytest.mark.parametrize(("mode", "environ", "torch_loaded", "asks"), [
    ("madvise", {}, False, True),   # the kernel grants huge pages on request: torch asks for them
    ("always", {}, False, False),   # every mapping gets them already
    ("never", {}, False, False),
    (None, {}, False, False),       # no THP (not Linux)
    ("madvise", {"THP_MEM_ALLOC_ENABLE": "0"}, False, False),  # the user's choice stands
    ("madvise", {}, True, False),   # too late: torch read its switch at its first allocation
])
def test_ppo_asks_torch_for_huge_pages_only_where_the_kernel_grants_them_on_request(mode, environ, torch_loaded, asks):
    from ppo_cli.engine.malloc import ask_torch_for_huge_pages, large_blocks_on_huge_pages

    modules = {"torch": object()} if torch_loaded else {}
    assert ask_torch_for_huge_pages(environ, modules, mode) is asks
    assert environ.get("THP_MEM_ALLOC_ENABLE") == ("1" if asks else None if mode != "madvise" or not environ else "0")
    assert large_blocks_on_huge_pages(environ, mode) is (asks or mode == "always")


def test_the_kernels_thp_mode_is_the_bracketed_word(tmp_path):
    from ppo_cli.engine.malloc import transparent_huge_pages

    (tmp_path / "enabled").write_text("always [madvise] never\n")
    assert transparent_huge_pages(str(tmp_path / "enabled")) == "madvise"
    assert transparent_huge_pages(str(tmp_path / "missing")) is None


def test_training_maps_large_blocks_where_they_get_huge_pages_else_keeps_the_heap(monkeypatch):
    from ppo_cli.engine import malloc

    calls = []
    monkeypatch.setattr(malloc, "map_large_blocks", lambda: calls.append("map"))
    monkeypatch.setattr(malloc, "keep_freed_memory", lambda: calls.append("keep"))
    monkeypatch.setattr(malloc, "huge_pages_allowed", lambda allowed: calls.append(f"huge pages {allowed}"))
    monkeypatch.setattr(malloc, "large_blocks_on_huge_pages", lambda: True)
    assert malloc.tune_for_training(gradient_checkpointing=True) == "mapped"
    assert malloc.tune_for_training(gradient_checkpointing=False) == "kept"  # mapped costs +30% CPU there
    monkeypatch.setattr(malloc, "large_blocks_on_huge_pages", lambda: False)
    assert malloc.tune_for_training(gradient_checkpointing=True) == "kept"
    # a kept heap gets no huge pages: on it they cost the update's forward +45% (docs/memory.md)
    assert calls == ["huge pages True", "map", "huge pages False", "keep", "huge pages False", "keep"]


# Defines smaps_field(address, name) in a probe: the values of /proc/self/smaps's line `name:` for the
# mapping that holds ``address``.
SMAPS_FIELD = """
def smaps_field(address, name):
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith(name + ":"):
                return line.split()[1:]
"""

KEPT_HEAP_PROBE = SMAPS_FIELD + """
from ppo_cli.engine import malloc
malloc.ask_torch_for_huge_pages()  # as `ppo`'s entry point does, before torch loads
import torch
def thp_enabled():
    with open("/proc/self/status") as f:
        return next(line.split()[1] for line in f if line.startswith("THP_enabled:"))
print(malloc.tune_for_training(gradient_checkpointing=False), thp_enabled(), end=" ")
block = torch.ones(8 * 2**20 // 4)  # 8 MiB from the kept heap: advised by torch, refused by the kernel
print(smaps_field(block.data_ptr(), "AnonHugePages")[0], end=" ")
malloc.return_freed_memory()  # FSDP on CPU maps its blocks after the engine loaded: huge pages back
print(thp_enabled(), malloc.tune_for_training(gradient_checkpointing=False), thp_enabled(), end=" ")
print(malloc.tune_for_training(gradient_checkpointing=True), thp_enabled())
"""


@pytest.mark.skipif(not _glibc(), reason="glibc malloc only")
def test_a_kept_heap_gets_no_huge_pages_and_a_mapped_one_gets_them_back():
    """tune_for_training turns the process's huge pages off for a kept heap (prctl; /proc's THP_enabled
    reads 0 and an 8 MiB block torch advised holds none) and on again where it maps its large blocks
    (a checkpointed update, or FSDP's return_freed_memory), also where the flag came from the parent (set at the child's start, as if inherited)."""
    from ppo_cli.engine.malloc import transparent_huge_pages

    if transparent_huge_pages() != "madvise":
        pytest.skip(f"the kernel's THP mode is {transparent_huge_pages()!r}, not madvise")
    env = {k: v for k, v in __import__("os").environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    for inherited in (0, 1):
        parent_flag = f"import ctypes; ctypes.CDLL('libc.so.6').prctl({malloc_module.PR_SET_THP_DISABLE}, {inherited}, 0, 0, 0)\n"
        out = subprocess.run([sys.executable, "-c", parent_flag + KEPT_HEAP_PROBE], capture_output=True, text=True,
                             check=True, env=env)
        assert out.stdout.split() == ["kept", "0", "0", "1", "kept", "0", "mapped", "1"], inherited


HUGE_PAGE_PROBE = SMAPS_FIELD + """
import os
from ppo_cli.engine import malloc
assert malloc.ask_torch_for_huge_pages()  # as `ppo`'s entry point does, before torch loads
import torch
assert malloc.tune_for_training(gradient_checkpointing=True) == "mapped"
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = resident()
block = torch.ones(6 * 2**20 // 4)  # 6 MiB: an activation of SmolLM2's MLP at 8 x 139 tokens is 6.5
flags = smaps_field(block.data_ptr(), "VmFlags")
held = resident() - before
del block
print("hg" in flags, held, resident() - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not _glibc(), reason="glibc malloc only")
def test_a_large_block_is_advised_for_huge_pages_and_unmapped_when_freed():
    """Where the kernel grants huge pages on request: ppo's entry point turns torch's switch on, the
    block's mapping carries MADV_HUGEPAGE ('hg'), and freeing it hands its memory back at once."""
    from ppo_cli.engine.malloc import transparent_huge_pages

    if transparent_huge_pages() != "madvise":
        pytest.skip(f"the kernel's THP mode is {transparent_huge_pages()!r}, not madvise")
    env = {k: v for k, v in __import__("os").environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", HUGE_PAGE_PROBE], capture_output=True, text=True, check=True, env=env)
    advised, held, left = out.stdout.split()[-3:]
    assert advised == "True"
    assert int(held) > 5 * 2**20 and int(held) - int(left) > 5 * 2**20  # resident while alive, returned on free
