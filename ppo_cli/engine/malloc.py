"""CPU: glibc malloc tuned for training (mallopt, malloc_trim through ctypes).

Each function is a no-op off glibc. Whether to tune at all is the caller's choice
(EngineOptions.cpu_malloc_tuning: load_engine, and Distributed.prepare under FSDP); `ppo train` takes it
from ``tuning_fits`` over the memory plan.
"""

from __future__ import annotations

import contextlib


def _tunable_libc():
    """The C library, where malloc may be tuned: Linux; None otherwise."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _mallopt():
    """glibc's mallopt, where malloc may be tuned (_tunable_libc); None otherwise (musl has none)."""
    return getattr(_tunable_libc(), "mallopt", None)


# What keep_freed_memory may add to a run's peak resident memory, as a share of the plan's peak:
# measured +2.7% on the tiny models, +3-5% at the 0.5B shape, SmolLM2 in docs/memory.md ("The glibc
# heap tuning"); rounded up so that the rule errs on the side of the user's memory.
TUNING_PEAK_SHARE = 0.10
# The share of the memory available at start a tuned run may plan to use: the rest stays the machine's.
TUNING_MEMORY_SHARE = 0.8


def tuning_fits(planned_peak_gb: float | None, available_gb: float | None) -> tuple[bool, str]:
    """(keep_freed_memory on?, why): on where the plan's peak with the tuning's extra still leaves a fifth
    of the memory available at start free; off where it would not, or where either is unknown (the
    tuning buys time with memory the user did not offer). Pure: numbers in, a choice out."""
    if planned_peak_gb is None or available_gb is None:
        return False, "heap tuning off (the plan or the available memory is unknown)"
    tuned = planned_peak_gb * (1 + TUNING_PEAK_SHARE)
    room = available_gb * TUNING_MEMORY_SHARE
    if tuned <= room:
        return True, f"heap tuning on (planned {planned_peak_gb:.2f} GB + {TUNING_PEAK_SHARE:.0%} <= " \
                     f"{TUNING_MEMORY_SHARE:.0%} of {available_gb:.1f} GB available)"
    return False, f"heap tuning off (planned {planned_peak_gb:.2f} GB + {TUNING_PEAK_SHARE:.0%} > " \
                  f"{TUNING_MEMORY_SHARE:.0%} of {available_gb:.1f} GB available)"


# glibc's mallopt parameters (malloc.h) and its defaults on 64-bit Linux.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
GLIBC_TRIM_THRESHOLD, GLIBC_TOP_PAD = 128 * 1024, 128 * 1024
# Under FSDP on CPU, blocks of this size or more are mapped on their own (return_freed_memory).
FSDP_MMAP_THRESHOLD = 2**20
# A checkpointed update where large blocks get huge pages: blocks of this size or more mapped (map_large_blocks),
# torch's own threshold for asking huge pages, so that every mapped block is on them. At 1 MiB the
# blocks of 1-2 MiB were mapped on 4 KiB pages: at the 0.5B widths (hidden states of 1.8 MB) -42%
# peak instead of -24%, for +8% CPU (docs/memory.md).
MAPPED_BLOCK_THRESHOLD = 2**21


def keep_freed_memory() -> None:
    """CPU training: stop glibc from returning freed activation memory to the kernel on every free.

    By default glibc maps blocks above a (self-raising) threshold with mmap and unmaps them when they
    are freed, and trims the heap top once more than 2x that threshold is free. A training step frees
    and reallocates the same few gigabytes of activations and gradients every micro-batch, so the
    kernel zeroes and faults in those pages again each time: at the 0.5B shape that was a third of the
    step's wall time, spent in the kernel. Serving every block up to glibc's 32 MB mmap limit from the
    heap and (almost) never trimming it keeps those pages resident and reused; the resident set then
    stays at its peak (which it reaches anyway). A no-op off glibc.
    """
    mallopt = _mallopt()
    if mallopt is None:
        return
    mallopt(M_MMAP_THRESHOLD, 32 * 2**20)  # glibc's maximum on 64-bit (also fixes it)
    mallopt(M_TRIM_THRESHOLD, 2**31 - 1)  # a C int: trim only above 2 GB free at the top
    mallopt(M_TOP_PAD, 512 * 2**20)  # grow the heap in large steps


def return_freed_memory() -> None:
    """CPU under FSDP: give every freed block of 1 MB or more back to the kernel at once.

    FSDP gathers a block's whole weights before its forward (and again in the backward) and frees them
    after, for every block, in the rollout's every decoding step and in the update. With the heap
    tuned by keep_freed_memory those frees stay resident and the heap grows past them instead of
    reusing them: measured at the 0.5B shape with LoRA, 2 processes, each peaked at 6.4 GB (1.9 GB
    above the live tensors in the update's forward, 1.7 GB in the rollout), 3.95 GB with this on
    (docs/benchmarks.md); glibc's own thresholds are not enough (it raises its mmap threshold to the
    largest block freed, so the 17 MB weights come from the heap again). Mapping each
    block of FSDP_MMAP_THRESHOLD or more on its own (a fixed threshold, with glibc's own top pad and
    trimming) unmaps it on free; the cost is the kernel faulting the pages in again at each gather.
    A no-op off glibc.
    """
    mallopt = _mallopt()
    if mallopt is None:
        return
    mallopt(M_TOP_PAD, GLIBC_TOP_PAD)
    mallopt(M_TRIM_THRESHOLD, GLIBC_TRIM_THRESHOLD)
    mallopt(M_MMAP_THRESHOLD, FSDP_MMAP_THRESHOLD)  # a fixed value: glibc stops raising it
    huge_pages_allowed(True)  # mapped blocks, not a kept heap: those of 2 MiB or more fault in as 2 MiB pages


# The kernel's transparent huge pages setting, and torch's switch for asking them for its large blocks
# (c10's alloc_cpu: MADV_HUGEPAGE on each block of 2 MiB or more). torch reads the switch once, at its
# first allocation: it must be in the environment before torch is imported.
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
TORCH_THP_SWITCH = "THP_MEM_ALLOC_ENABLE"


def transparent_huge_pages(path: str = THP_SETTING) -> str | None:
    """The kernel's THP mode, the bracketed word of ``path`` ('always', 'madvise', 'never'); None where
    it cannot be read (not Linux, no THP)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


_READ = "read the kernel's setting"


def ask_torch_for_huge_pages(environ=None, modules=None, mode: str | None = _READ) -> bool:
    """Before torch is imported (`ppo`'s entry point): have torch put its blocks of 2 MiB or more on
    transparent huge pages where the kernel grants them on request ('madvise'). Sets the switch only
    where the user has not set it and torch is not loaded yet; True where it did."""
    import os
    import sys

    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    mode = transparent_huge_pages() if mode is _READ else mode
    if mode != "madvise" or TORCH_THP_SWITCH in environ or "torch" in modules:
        return False
    environ[TORCH_THP_SWITCH] = "1"
    return True


def large_blocks_on_huge_pages(environ=None, mode: str | None = _READ) -> bool:
    """Whether torch's large blocks get transparent huge pages in this process: the kernel gives them
    to every mapping ('always'), or on request ('madvise') and torch's switch is on (set by
    ask_torch_for_huge_pages before torch loaded, or by the user; c10's check_env takes "1" only)."""
    import os

    environ = os.environ if environ is None else environ
    mode = transparent_huge_pages() if mode is _READ else mode
    return mode == "always" or (mode == "madvise" and environ.get(TORCH_THP_SWITCH) == "1")


def heap_mapped(gradient_checkpointing: bool) -> bool:
    """Whether training maps its large blocks (tune_for_training) rather than keeping the heap."""
    return gradient_checkpointing and large_blocks_on_huge_pages()


def map_large_blocks() -> None:
    """CPU training where torch's large blocks get transparent huge pages: map every block of 2 MiB or
    more on its own, so that it goes back to the kernel when freed.

    With the heap kept (keep_freed_memory) a checkpointed update's resident set grows by most of the
    activations its layers compute and free, since the autograd graph's small allocations split the
    freed blocks (docs/benchmarks.md, "Where the checkpointed update's memory goes"); mapped, nothing is
    left behind. Mapping costs the kernel zeroing and faulting the pages in at every allocation: with
    4 KiB pages +40% CPU at SmolLM2's update, with 2 MiB pages none measured (docs/memory.md, "Large
    blocks on huge pages"). The heap below that threshold is kept as keep_freed_memory keeps it: trimmed
    at glibc's 128 KiB, the smaller blocks at its top were faulted in again and again (+17% CPU per
    run measured). A no-op off glibc.
    """
    mallopt = _mallopt()
    if mallopt is None:
        return
    keep_freed_memory()
    mallopt(M_MMAP_THRESHOLD, MAPPED_BLOCK_THRESHOLD)  # a fixed value: glibc stops raising it


def tune_for_training(gradient_checkpointing: bool) -> str:
    """CPU training: map_large_blocks where the update is checkpointed and large blocks get huge pages,
    else keep_freed_memory with huge pages off for the process (huge_pages_allowed). Returns which
    ('mapped' or 'kept').

    Without checkpointing the update keeps its activations for the backward and the heap does not
    fragment as much: mapped there, SmolLM2's micro-batch peaked at 2.72 GB instead of 4.14 for +30% CPU
    (the kernel zeroing fresh pages), a price the user did not agree to (docs/memory.md). A kept heap on
    huge pages (torch advises its large blocks, which now come from the heap) cost the update's forward
    +45% at the 0.5B shape, in the kernel (docs/memory.md, "A kept heap gets no huge pages")."""
    if heap_mapped(gradient_checkpointing):
        huge_pages_allowed(True)
        map_large_blocks()
        return "mapped"
    huge_pages_allowed(False)
    keep_freed_memory()
    return "kept"


# prctl options (linux/prctl.h): the process's "no transparent huge pages" flag, inherited by its children.
PR_SET_THP_DISABLE = 41


def huge_pages_allowed(allowed: bool) -> bool:
    """Linux: let the kernel give this process transparent huge pages or not (prctl PR_SET_THP_DISABLE;
    pages already huge stay so). Off for a kept heap: torch advises every block of 2 MiB or more for
    huge pages, and on the heap the kernel then faults in, compacts and collapses 2 MiB pages under the
    update's feet (its forward +45% at the 0.5B shape, docs/memory.md). Set both ways, whoever set it
    before: the flag is inherited, so a process started by one that kept its heap (a test suite's
    subprocess) would otherwise map its blocks on 4 KiB pages. Returns whether the kernel took it
    (False off Linux)."""
    prctl = getattr(_tunable_libc(), "prctl", None)
    if prctl is None:
        return False
    return prctl(PR_SET_THP_DISABLE, 0 if allowed else 1, 0, 0, 0) == 0


@contextlib.contextmanager
def run_objects_frozen():
    """Inside, every object alive on entry (the models, the tokenizer, the optimizer: they live for the
    run) is out of the cyclic garbage collector's sight (gc.freeze), so that release_freed_memory's full
    collection after each update walks only what the update made. At SmolLM2's GRPO run it walked 514k
    objects in 0.25 s, 1.2% of an update (AMD EPYC); frozen, about 100 in no measurable time. Frozen
    objects are still freed by reference counting; a cycle among them waits for the exit, which gives
    them back to the collector (gc.unfreeze), so that a process that trains again (the tests) keeps
    nothing."""
    import gc

    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def release_freed_memory() -> None:
    """CPU: hand the heap's free pages back to the kernel now (glibc malloc_trim), after a large free.

    keep_freed_memory makes glibc keep what is freed, which is right for the update's activations
    (freed and reallocated every micro-batch) but not for a one-off free: under FSDP each process
    loads the whole policy before prepare() shards it, and the whole weights, freed there, would
    stay in the resident set for the rest of the run. A no-op off glibc.
    """
    libc = _tunable_libc()
    if libc is None:
        return
    import gc

    gc.collect()
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:  # musl has none
        trim(0)
