"""trainer.train stops after train.max_consecutive_skips skipped updates in a row, with the likely cause and
a resume command that accepts the changed setting (resuming unchanged would meet the same numbers)."""

from types import SimpleNamespace

import pytest

from ppo_cli import trainer
from ppo_cli.errors import RESUME, TrainingError, with_resume_command


def _state(max_skips: int):
    recipe = SimpleNamespace(train=SimpleNamespace(total_updates=10, max_consecutive_skips=max_skips))
    return SimpleNamespace(recipe=recipe, step=0, consecutive_skips=0, last_skip_reason=None)


def test_the_run_stops_after_the_skips_in_a_row_with_the_cause_and_a_resume_that_accepts_a_fix(monkeypatch):
    def skipped_step(state):
        state.step += 1
        state.consecutive_skips += 1
        state.last_skip_reason = "non-finite loss or gradients"
        return {}, None

    monkeypatch.setattr(trainer, "train_step", skipped_step)
    state = _state(max_skips=3)
    with pytest.raises(TrainingError) as caught:
        for _ in trainer.train(state):
            pass
    assert state.step == 3
    assert caught.value.message == "stopped at update 3: 3 updates in a row skipped for non-finite loss or gradients"
    assert with_resume_command(caught.value.hint, "ppo train runs/r/recipe.yaml --resume") == (
        "likely cause: the learning rate is too high or the KL penalty too small: lower optim.lr, set "
        "optim.max_grad_norm, raise ppo.kl_coef; the last checkpoint is intact: change the setting, then continue "
        "from it with ppo train runs/r/recipe.yaml --resume --force (which accepts the changed recipe)")
    assert RESUME in caught.value.hint


def test_a_good_update_resets_the_count(monkeypatch):
    steps = iter([True, True, False, True, True, False, True, True])  # skipped?

    def step(state):
        state.step += 1
        if next(steps):
            state.consecutive_skips, state.last_skip_reason = state.consecutive_skips + 1, "non-finite values"
        else:
            state.consecutive_skips = 0
        return {}, None

    monkeypatch.setattr(trainer, "train_step", step)
    state = _state(max_skips=3)
    state.recipe.train.total_updates = 8
    assert len(list(trainer.train(state))) == 8  # never 3 in a row


def test_the_updates_run_with_the_objects_alive_before_them_frozen_and_give_them_back_after(monkeypatch):
    """engine/malloc.run_objects_frozen: each update's full collection walks what the update made, not the
    models; a cycle made during the updates is still collected; after the loop nothing stays frozen."""
    import gc
    import weakref

    class Node:
        pass

    seen = []

    def step(state):
        state.step += 1
        cycle = Node()
        cycle.me = cycle  # garbage only the cyclic collector frees
        alive = weakref.ref(cycle)
        del cycle
        gc.collect()
        seen.append((gc.get_freeze_count(), alive() is None))
        return {}, None

    monkeypatch.setattr(trainer, "train_step", step)
    state = _state(max_skips=3)
    state.recipe.train.total_updates = 2
    before = gc.get_freeze_count()
    list(trainer.train(state))
    assert len(seen) == 2 and all(frozen > before + 1000 and collected for frozen, collected in seen)
    assert gc.get_freeze_count() == before == 0
