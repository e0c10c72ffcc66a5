"""Whitening across processes equals whitening of the concatenated batch (2 real gloo processes)."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ppo_cli.algo.masking import global_masked_mean_var, masked_var, masked_whiten


def _batches():
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(3, 5, generator=gen, dtype=torch.float64) * 4 + 1, torch.randn(2, 7, generator=gen, dtype=torch.float64)]
    masks = [torch.rand(3, 5, generator=gen) > 0.3, torch.rand(2, 7, generator=gen) > 0.5]
    return values, masks


def _rank(rank: int, port: int, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    def reduce_sum(t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    values, masks = _batches()
    out[rank] = masked_whiten(values[rank], masks[rank], reduce_sum=reduce_sum)
    dist.destroy_process_group()


def _concat(values, masks):
    width = max(v.shape[1] for v in values)
    pad = lambda t, fill: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill)  # noqa: E731
    return torch.cat([pad(v, 0.0) for v in values]), torch.cat([pad(m, False) for m in masks])


@pytest.mark.slow
def test_masked_whiten_across_two_processes_equals_whitening_the_concatenated_batch():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_rank, args=(port, out), nprocs=2, join=True)
    values, masks = _batches()
    all_values, all_mask = _concat(values, masks)
    expected = masked_whiten(all_values, all_mask)
    torch.testing.assert_close(out[0], expected[:3, :5], atol=1e-12, rtol=0)
    torch.testing.assert_close(out[1], expected[3:, :7], atol=1e-12, rtol=0)


def test_global_mean_var_with_an_identity_reduce_is_the_local_statistics():
    values, masks = _batches()
    mean, var = global_masked_mean_var(values[0], masks[0], reduce_sum=lambda t: t)
    torch.testing.assert_close(var, masked_var(values[0], masks[0]), atol=1e-12, rtol=0)
    torch.testing.assert_close(mean, values[0][masks[0]].mean(), atol=1e-12, rtol=0)
