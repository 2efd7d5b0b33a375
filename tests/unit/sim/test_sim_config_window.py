"""SimConfig refuses a sliding window that leaves the pool no block: before, the
scheduler engine's max_model_len came out at zero or below and vLLM failed inside, with
no word of which setting was wrong."""

from __future__ import annotations

import pytest

from kvhint.router.sim.config import SimConfig


def test_a_window_the_pool_cannot_hold_is_refused_clearly() -> None:
    # A window of 1024 and a step of 8192 tokens in blocks of 512: 18 + 1 blocks.
    config = SimConfig(engine="scheduler", sliding_window=1024, gpu_blocks=20)
    assert config.window_blocks() == 19
    for gpu_blocks in (2, 10, 19):
        with pytest.raises(ValueError, match=rf"gpu_blocks \({gpu_blocks}\) must exceed "
                                             r"the 19 blocks the sliding window takes"):
            SimConfig(engine="scheduler", sliding_window=1024, gpu_blocks=gpu_blocks)


def test_the_bound_follows_the_step_and_the_block_size() -> None:
    small = SimConfig(engine="scheduler", sliding_window=64, gpu_blocks=5, block_size=32,
                      max_num_batched_tokens=32)
    assert small.window_blocks() == 4  # (64 + 32) / 32 + 1
    with pytest.raises(ValueError, match="must exceed the 4 blocks"):
        SimConfig(engine="scheduler", sliding_window=64, gpu_blocks=4, block_size=32,
                  max_num_batched_tokens=32)
    # No window: nothing reserved, the pool's floor stays gpu_blocks >= 2.
    assert SimConfig(gpu_blocks=2).window_blocks() == 0


def test_the_scheduler_engine_builds_at_the_smallest_pool_allowed() -> None:
    from kvhint.router.sim.scheduler_worker import build_scheduler_worker

    config = SimConfig(engine="scheduler", sliding_window=64, gpu_blocks=5, block_size=32,
                       max_num_batched_tokens=32, max_num_seqs=4)
    worker = build_scheduler_worker("w0", config, lambda: 0.0, lambda *_: None)
    assert worker.max_model_len == 32  # one block left beside the window
