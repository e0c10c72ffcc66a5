"""glibc's main arena of a running process, read from outside without stopping it for long: bytes held,
in use, free in the bins, and blocks mapped on their own (which are always live).

    gdb -batch -iex 'set auto-solib-add off' -p PID -ex 'sharedlibrary libc' -x benchmarks/glibc_heap_walk.py

A gdb script (needs libc's debug symbols): it only reads memory, calls nothing in the process (a call
into malloc_info could deadlock on an arena lock held by a stopped thread), and pauses it ~0.5 s.
Walks the main arena's bins (fastbin links demangled: glibc >= 2.32 safe-linking); tcache and other
threads' arenas are not walked (counted as in use / not counted). Used for the FSDP update's memory
(docs/distributed.md, "FSDP2 with LoRA: the plan against the peak"). Never imported.
"""
import struct

import gdb

inferior = gdb.selected_inferior()


def word(address: int) -> int:
    return struct.unpack("<Q", bytes(inferior.read_memory(address, 8)))[0]


arena = gdb.parse_and_eval("main_arena")
system, top = int(arena["system_mem"]), int(arena["top"])
top_free = word(top + 8) & ~7
bins = int(arena["bins"].address)
free = chunks = 0
for index in range(1, 127):  # bin i's header: a fake chunk whose fd is bins[2 (i - 1)]
    head = bins + 16 * (index - 1) - 16
    chunk = word(head + 16)
    while chunk != head and chunks < 3_000_000:
        free += word(chunk + 8) & ~7
        chunk, chunks = word(chunk + 16), chunks + 1
fast = 0
fastbins = int(arena["fastbinsY"].address)
for index in range(10):
    chunk = word(fastbins + 8 * index)
    while chunk:
        fast += word(chunk + 8) & ~7
        chunk = ((chunk + 16) >> 12) ^ word(chunk + 16)  # safe-linking
params = gdb.parse_and_eval("mp_")
print(f"HEAPWALK system_mem={system / 1e9:.3f} top_free={top_free / 1e9:.3f} bins_free={free / 1e9:.3f} "
      f"({chunks} chunks) fast={fast / 1e9:.4f} in_use={(system - top_free - free - fast) / 1e9:.3f} "
      f"mmapped={int(params['mmapped_mem']) / 1e9:.3f} n_mmaps={int(params['n_mmaps'])}")
