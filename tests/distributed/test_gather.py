"""Distributed.gather keeps the dtype of what it gathers, whichever process pads."""

import torch

from ppo_cli.distributed import Distributed


class _PaddingAccelerator:
    """Two processes as accelerate 1.15 sees them: the other one's tensors are ``width`` columns wide.
    Padding is accelerate's own (zeros + the pad value), which makes a bool tensor int64."""

    num_processes = 2

    def __init__(self, width: int):
        self.width = width

    def pad_across_processes(self, tensor, dim):
        if tensor.shape[dim] >= self.width:
            return tensor
        padded = tensor.new_zeros((tensor.shape[0], self.width)) + 0
        padded[:, :tensor.shape[1]] = tensor
        return padded

    def gather(self, tensor):
        return torch.cat([tensor, tensor])


def _dist(width: int) -> Distributed:
    dist = Distributed.__new__(Distributed)
    dist.accelerator = _PaddingAccelerator(width)
    return dist


def test_a_response_mask_stays_bool_on_the_process_that_pads():
    """Once a process's longest response is shorter than the other's, only it pads: an int64 mask
    there against a bool mask elsewhere was a collective mismatch (gloo aborted the shipped recipe)."""
    mask = torch.tensor([[True, False], [True, True]])
    gathered = _dist(width=4).gather(mask)
    assert gathered.dtype == torch.bool
    assert gathered.tolist() == [[True, False, False, False], [True, True, False, False]] * 2
    assert _dist(width=2).gather(mask).dtype == torch.bool  # the process that does not pad
