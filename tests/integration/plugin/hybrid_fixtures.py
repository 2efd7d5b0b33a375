"""Helpers of the tests of holds on a hybrid model against vLLM's real KVCacheManager
(``test_plugin_hybrid_holds*.py``): the manager over the KV-cache groups vLLM forms for a
layer pattern, and a bench with the plugin attached and one session cached."""

from __future__ import annotations

import json
import random

from kvhint.engine_plugin.config import PluginConfig
from kvhint.engine_plugin.core import PluginCore
from kvhint.engine_plugin.headless import _block_hasher, _request_factory

BLOCK = 16
# 12 layers, every sixth full attention, the rest a 32-token sliding window (Gemma 3's 5:1
# pattern): one full-attention group and five sliding-window groups.
GEMMA = "WWWWWF" * 2
# Layer 0 full: the full-attention group comes first.
GEMMA_FULL_FIRST = "FWWWWW" * 2
# Two full-attention layers a window one: vLLM forms two full-attention groups (layers
# 0 and 3, 1 and 4) and one sliding-window group.
TWO_FULL = "FFW" * 2
# Full attention beside chunked local attention of 64 tokens (Llama 4's kind): vLLM forms
# one full-attention group and two chunked-local groups, of a kind no hold can take.
CHUNKED = "FCC" * 2
# Mamba layers beside full attention (Jamba's, Granite 4's, Qwen3-Next's kind): vLLM forms
# three Mamba groups and one full-attention group; prefix caching with Mamba needs vLLM's
# ``mamba_cache_mode`` "align" (what vLLM sets when prefix caching is on) and the Mamba
# state's block size equal to attention's (its page padded to attention's).
MAMBA = "MMMF" * 2


def hybrid_manager(layout: str = GEMMA, num_blocks: int = 60, use_eagle: bool = False,
                   retention_interval: int | None = None):
    """vLLM's KVCacheManager over the groups vLLM forms for ``layout`` (one letter a
    layer: ``F`` full attention, ``W`` a 32-token sliding window, ``C`` 64-token chunked
    local attention, ``M`` a Mamba state in "align" mode); ``use_eagle``: vLLM's EAGLE
    flag (what the scheduler passes with an EAGLE or MTP speculative config);
    ``retention_interval``: vLLM's ``--prefix-cache-retention-interval`` (None: dense)."""
    import torch
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        MambaSpec,
        SlidingWindowSpec,
    )

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8,
                             dtype=torch.float32)
    window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=8,
                               dtype=torch.float32, sliding_window=2 * BLOCK)
    chunked = ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8,
                                        dtype=torch.float32, attention_chunk_size=4 * BLOCK)
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float32,),
                      page_size_padded=full.page_size_bytes, mamba_cache_mode="align")
    specs = {"F": full, "W": window, "C": chunked, "M": mamba}
    layers = {f"model.layers.{i}.self_attn.attn": specs[kind]
              for i, kind in enumerate(layout)}
    groups = kcu._get_kv_cache_groups_uniform_page_size(layers)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    config.hash_block_size = BLOCK
    config.prefix_cache_retention_interval = retention_interval
    return KVCacheManager(kv_cache_config=config, max_model_len=num_blocks * BLOCK,
                          scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                          enable_caching=True, use_eagle=use_eagle, log_stats=False,
                          enable_kv_cache_events=True)


class Bench:
    """A hybrid manager with the plugin attached, session ``s`` cached (4 blocks of
    prompt, its 5th partial), and unrelated traffic to evict what is not held."""

    def __init__(self, layout: str = GEMMA, num_blocks: int = 60, host_tier=None,
                 use_eagle: bool = False, **config) -> None:
        self.manager = hybrid_manager(layout, num_blocks, use_eagle)
        self.mamba, self.use_eagle = "M" in layout, use_eagle
        self.core = PluginCore.attach(self.manager, PluginConfig(worker_id="w0", **config),
                                      host_tier=host_tier)
        self.make_request = _request_factory(_block_hasher(BLOCK))
        self.rng = random.Random(1)
        self.prefix = [self.rng.randrange(1, 500) for _ in range(4 * BLOCK)]
        self.admit(self.prefix + [1, 2, 3], "s")
        # Hybrid caching works (with EAGLE vLLM's hit drops the last matched block).
        assert self.admit(self.prefix + [9, 9, 9]) == (4 - use_eagle) * BLOCK

    def admit(self, prompt: list[int], session: str | None = None) -> int:
        manager = self.manager
        request = self.make_request(prompt, session_id=session)
        blocks, hit, _ = manager.get_computed_blocks(request)
        # A Mamba layout's prefill stops at the last block boundary whose state vLLM
        # caches, as the Scheduler splits it (``_mamba_block_aligned_split``).
        ends = [request.num_tokens]
        if self.mamba:
            from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

            ends.insert(0, get_mamba_prefill_checkpoint_position(request.num_tokens, BLOCK,
                                                                 self.use_eagle))
        done = hit
        for end in ends:
            if end <= done:
                continue
            manager.new_step_starts()  # each chunk a Scheduler step
            assert manager.allocate_slots(request, end - done,
                                          num_new_computed_tokens=hit if done == hit else 0,
                                          new_computed_blocks=blocks if done == hit else None
                                          ) is not None
            request.num_computed_tokens = done = end
        manager.free(request)
        self.core.sync()
        return hit

    def hint(self, action_type: str, payload: dict, action_id: str = "a1"):
        (outcome,) = self.core.apply_hints(json.dumps({
            "protocol_version": "1", "message_id": f"m-{action_id}", "actions": [{
                "action_id": action_id, "action_type": action_type, "action_version": "1.0",
                "payload": payload}]}).encode())
        return outcome

    def traffic(self) -> None:
        for _ in range(30):  # enough to evict every unheld block
            self.admit([self.rng.randrange(1, 500) for _ in range(3 * BLOCK + 2)])

    def next_turn_hit(self) -> int:
        _, hit, _ = self.manager.get_computed_blocks(self.make_request(self.prefix + [5, 5]))
        return hit

    def positions(self) -> list:
        """The session's 4 positions' handles (the followed group's), root first."""
        adapter = self.core.adapter
        return [adapter.lookup(k) for k in self.core.index.session_prefix("s", 4)]
