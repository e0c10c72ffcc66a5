import pytest
import torch

from ppo_cli.engine.logprobs import position_ids_from_mask, selective_log_softmax


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-5)])
def test_selective_log_softmax_matches_log_softmax_gather(dtype, atol):
    # Half-precision logits are upcast to float32 inside, so bfloat16 inputs are as exact as float32.
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 7, 50, generator=gen) * 3).to(dtype)
    index = torch.randint(0, 50, (5, 7), generator=gen)
    naive = torch.log_softmax(logits.double(), dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    fast = selective_log_softmax(logits, index, chunk_rows=2)
    assert fast.shape == (5, 7)
    torch.testing.assert_close(fast.double(), naive, atol=atol, rtol=0)


def test_selective_log_softmax_gradient_matches_naive():
    logits = torch.randn(3, 4, 11, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, 11, (3, 4))
    selective_log_softmax(logits, index).sum().backward()
    fast_grad = logits.grad.clone()
    logits.grad = None
    torch.log_softmax(logits, -1).gather(-1, index.unsqueeze(-1)).sum().backward()
    torch.testing.assert_close(fast_grad, logits.grad, atol=1e-12, rtol=0)


def test_position_ids_count_real_tokens_after_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]], dtype=torch.bool)
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 1, 2, 2]]
