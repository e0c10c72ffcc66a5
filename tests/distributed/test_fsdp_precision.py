"""FSDP2 under mixed precision: parameters gathered in the compute dtype, gradients, shards and optimizer
states float32 (ppo_cli/distributed.py fsdp_mixed_precision_policy). The slow test trains 2 real gloo
processes with train.mixed_precision bf16 and looks at the gathered weights inside the forwards."""

import math
import os
import socket

import pytest
import torch

from ppo_cli.distributed import fsdp_mixed_precision_policy


@pytest.mark.parametrize("mixed_precision, gathered", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_fsdp_policy_gathers_in_the_compute_dtype_and_reduces_gradients_in_float32(mixed_precision, gathered):
    policy = fsdp_mixed_precision_policy(mixed_precision)
    assert policy.param_dtype is gathered
    assert policy.reduce_dtype is torch.float32  # gradients reduce-scattered into float32 shards
    assert policy.output_dtype is None  # the forward's outputs as the forward computed them
    assert policy.cast_forward_inputs is False  # autocast casts what the matmuls read; a frozen critic's features stay float32


def test_fsdp_policy_without_mixed_precision_casts_nothing():
    policy = fsdp_mixed_precision_policy("no")
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (None, None, None)
