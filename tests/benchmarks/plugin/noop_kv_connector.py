"""A KV connector that does nothing: the baseline for what any connector costs in vLLM.

Loaded by ``bench_plugin_serving.py --noop-baseline`` through ``kv_connector_module_path``
(with this folder on PYTHONPATH) to tell vLLM's connector machinery apart from the
plugin's own work.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)


class NoopMetadata(KVConnectorMetadata):
    pass


class NoopKvConnector(KVConnectorBase_V1, SupportsHMA):
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return NoopMetadata()

    def request_finished_all_groups(self, request: Any, block_ids: Any
                                    ) -> tuple[bool, dict | None]:
        return False, None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
