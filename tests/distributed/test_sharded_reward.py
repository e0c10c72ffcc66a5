"""A frozen reward model sharded under FSDP2 (Distributed.shard_reward_models) scores as the whole model
does, with the processes scoring different numbers of batches (2 real gloo processes, tiny models)."""

import os
import socket

import pytest
import torch.multiprocessing as mp

TEXTS = ["a wonderful film", "dull and slow", "I loved every minute of it", "terrible acting", "it was fine",
         "the best thing I have seen this year", "boring"]
# rank 0 scores 5 rows in 3 batches of at most 2, rank 1 2 rows in 1 batch: rank 1 runs 2 forwards
# without rows; then rank 0 scores 1 row and rank 1 none (an empty share of the held-out prompts).
SHARES = {0: TEXTS[:5], 1: TEXTS[5:]}


def _rank(rank: int, port: int, reward_path: str, out) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "ACCELERATE_USE_FSDP": "true",
                       "FSDP_VERSION": "2", "HF_HUB_OFFLINE": "1"})
    import torch

    from ppo_cli.distributed import Distributed
    from ppo_cli.engine.rewards.stack import RewardStack
    from ppo_cli.recipe import RewardConfig

    config = RewardConfig.model_validate({"components": [
        {"type": "classifier", "path": reward_path, "labels": {"negative": -1.0, "neutral": 0.1, "positive": 10.0},
         "mode": "expected", "batch_size": 2}]})
    dist = Distributed("cpu")
    reward = RewardStack(config, torch.device("cpu"))
    scorer = reward.scorers[0][2]
    whole = scorer(SHARES[rank], SHARES[rank])
    whole_one = scorer(TEXTS[:1], TEXTS[:1])
    params = sum(p.numel() for p in scorer.model.parameters())

    sharded = dist.shard_reward_models(reward, actor_critic=None)
    scorer = reward.scorers[0][2]
    local = sum(p.to_local().numel() for p in scorer.model.parameters())
    got = scorer(SHARES[rank], SHARES[rank])
    if rank == 0:
        got_one = scorer(TEXTS[:1], TEXTS[:1])
    else:
        got_one = None
        reward.take_part_without_rows()
    whole_units = sum(group.is_unsharded for unit in scorer.model.modules()
                      if hasattr(unit, "_get_fsdp_state") for group in unit._get_fsdp_state()._fsdp_param_groups)
    out[rank] = {"sharded": sharded, "whole": whole, "got": got, "whole_one": whole_one, "got_one": got_one,
                 "params": params, "local": local, "whole_units": whole_units}
    dist.wait()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_sharded_reward_model_scores_as_the_whole_model_across_unequal_batches(tiny_models):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_rank, args=(port, str(tiny_models / "reward"), out), nprocs=2, join=True)
    for rank in (0, 1):
        result = out[rank]
        assert result["sharded"] == 1
        assert len(result["got"]) == len(SHARES[rank])
        # float32 on both sides: the all-gathered weights are the loaded ones, bit for bit
        assert max(abs(a - b) for a, b in zip(result["got"], result["whole"])) <= 1e-6
        assert result["local"] <= result["params"] // 2 + 1000  # half of every tensor (padding aside)
        assert result["whole_units"] == 0  # the root resharded after scoring, the blocks after their forwards
    assert abs(out[0]["got_one"][0] - out[0]["whole_one"][0]) <= 1e-6
