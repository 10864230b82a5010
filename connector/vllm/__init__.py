"""``KVDepotConnector``: vLLM V1 KV connector backed by kvdepot.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVDepotConnector",
                           "kv_connector_module_path": "kvdepot.connector.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"metadata": "127.0.0.1:7700",
                                                         "chunk_tokens": 256}}'

The facade builds one role object: :class:`SchedulerSide` in the scheduler
(lookups with a deadline and a breaker, load and save plans) or
:class:`WorkerSide` in each worker (asynchronous loads, staged saves
published in the background). Nothing kvdepot does waits on the engine's
thread for the network: a frozen metadata service costs a new request at
most ``lookup_timeout_max_s``, a frozen store costs the requests whose KV is on
it their ``load_timeout_s``, after which they recompute.

What is stored: every whole chunk of a prompt (and, with ``save_decode``, of
the generated tokens), and the whole engine blocks after the last whole
chunk, block by block (``save_tail``), so the same prompt loads all but its
last partial block. ``"kv_codec": "fp8_e4m3"`` stores and moves the KV as
e4m3 with per-block scales (about half the bytes of bf16), dequantized on
load; lossy, so it is part of the namespace (see ``kvdepot.connector.codec``).
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.connector.codec import create_codec
from kvdepot.connector.vllm.layout import (
    KVLayout,
    cache_groups,
    describe_namespace,
    layout_from_config,
    namespace_for,
)
from kvdepot.connector.vllm.model_identity import model_identity as _identity_of
from kvdepot.connector.vllm.namespace_report import (
    flush_reports,
    register_namespace,
    use_namespace,
)
from kvdepot.connector.vllm.plan import KVDepotConnectorMetadata
from kvdepot.connector.vllm.scheduler import PD_TOKENS_PARAM, SchedulerSide
from kvdepot.connector.vllm.settings import ConnectorSettings
from kvdepot.connector.vllm.stats import (
    ENGINE_STATS,
    PROCESS_STATS,
    Counters,
    KVDepotConnectorStats,
    KVDepotPromMetrics,
    attach_to_vllm_logging,
)
from kvdepot.connector.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

_WORKERS: weakref.WeakSet[WorkerSide] = weakref.WeakSet()


def wait_published(timeout_s: float = 30.0) -> bool:
    """Wait until every save this process staged was published (or failed).

    For tests and benchmarks that read the counters when their requests are
    done: publishing runs behind the engine.
    """
    deadline = time.monotonic() + timeout_s
    done = all(w.wait_published(max(0.0, deadline - time.monotonic())) for w in list(_WORKERS))
    flush_reports()  # and what the scheduler owes the cluster's counters
    return done


def check_config(vllm_config: Any) -> tuple[ConnectorSettings, KVLayout]:
    """Validate the connector's settings against the engine's configuration.

    Called as early as vLLM lets a connector see its configuration (when
    the attention backend asks for the KV cache layout, before the weights
    load), so a bad setting fails at engine start.

    Raises:
        InvalidArgument: A setting kvdepot cannot run with, naming it.
    """
    tc = vllm_config.kv_transfer_config
    settings = ConnectorSettings.from_extra(dict(tc.kv_connector_extra_config or {}))
    return settings, layout_from_config(vllm_config, settings)


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return int(get_tensor_model_parallel_rank())
    except (AssertionError, RuntimeError):
        return 0


class KVDepotConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM V1 KV connector publishing to and loading from kvdepot.

    It runs with vLLM's hybrid KV cache manager: full-attention and
    sliding-window groups (see :class:`CacheGroups`); a group it cannot
    store stops the engine at start, naming the flag that turns the
    manager off.
    """

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        attach_to_vllm_logging()
        tc = self._kv_transfer_config
        self.settings, self.layout = check_config(vllm_config)
        self.groups = cache_groups(kv_cache_config, self.layout)
        self.is_producer = bool(tc.is_kv_producer)
        self.is_consumer = bool(tc.is_kv_consumer)
        scheduler = role == KVConnectorRole.SCHEDULER
        self._counters = Counters(scheduler)
        s = self.settings
        self._client = KVDepotClient(
            ClientConfig(
                metadata=s.metadata,
                node_id=s.node_id,
                transport=s.transport,
                tokens_per_chunk=s.chunk_tokens,
                # The scheduler only looks up, and must never wait long.
                rpc_timeout_s=s.lookup_ceiling_s() if scheduler else s.rpc_timeout_s,
                io_timeout_s=s.io_timeout_s,
                connect_timeout_s=min(5.0, s.io_timeout_s),
                # Publishing runs on a thread of its own: the next save need
                # not wait for the index (see ClientConfig).
                defer_index_commit=True,
                # vLLM loads this class: like a command, it reads the environment.
                security=s.security(os.environ),
            )
        )
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        # Every rank has the same namespace: the chunk format does not depend
        # on the rank (see chunk_format).
        # (_identity_of: the package's attribute model_identity stays the module.)
        identity = _identity_of(vllm_config, s.model_id)
        ns = namespace_for(vllm_config, s, self.layout, 0, self.groups, identity)
        if scheduler:
            if s.force_recompute_on_load_error and self.is_consumer:
                # The scheduler reads the policy right after creating us: a
                # failed or corrupt chunk must be recomputed, never fail the request.
                tc.kv_load_failure_policy = "recompute"
            self._scheduler = SchedulerSide(
                s,
                self.layout,
                ns,
                self._client,
                kv_role=str(tc.kv_role),
                is_producer=self.is_producer,
                is_consumer=self.is_consumer,
                counters=self._counters,
                groups=self.groups,
            )
            register_namespace(self._client, ns, s, identity)
        else:
            self._worker = WorkerSide(
                s,
                self.layout,
                create_codec(s.codec_spec()),
                self._client,
                namespace=ns,
                is_producer=self.is_producer,
                counters=self._counters,
                groups=self.groups,
                tp_rank=_tp_rank(),
            )
            use_namespace(self._client, ns)
            _WORKERS.add(self._worker)
        logger.info(
            "KVDepotConnector (%s, %s): metadata %s, KV cache groups: %s; %s",
            role.name,
            tc.kv_role,
            s.metadata,
            self.groups.describe(),
            describe_namespace(ns, identity, s.cache_salt),
        )

    # ------------------------------------------------------------ checks
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        if vllm_config is not None and vllm_config.kv_transfer_config is not None:
            check_config(vllm_config)
        return None

    # ------------------------------------------------------------- stats
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._counters.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVDepotConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        # vLLM's log line of an interval is DEBUG once the engine idles:
        # these series are where the counters always show.
        return KVDepotPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ===================================================== scheduler side
    def _sched(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on a worker"
        return self._scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(
            set(connector_output.finished_recving or ()),
            set(connector_output.failed_recving or ()),
            set(connector_output.invalid_block_ids or ()),
            getattr(connector_output.kv_connector_stats, "data", None),
        )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Saves copy their blocks out in the step: no group's blocks are held.
        return self._sched().request_finished(request, list(block_ids[0]) if block_ids else [])

    def reset_cache(self) -> bool | None:
        return self._scheduler.reset_cache() if self._scheduler is not None else None

    # ======================================================== worker side
    def _work(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call on the scheduler"
        return self._worker

    def _meta(self) -> KVDepotConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KVDepotConnectorMetadata) else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._work().start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work().wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._work().save_kv_layer(self._meta(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._work().wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, (self.get_transfer_results(finished_req_ids).finished_recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        recved, failed = self._work().get_finished()
        # A failed load is finished too: vLLM then recomputes the request.
        return KVConnectorTransferResults(finished_recving=recved | failed, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        self._client.close()


__all__ = [
    "ENGINE_STATS",
    "PD_TOKENS_PARAM",
    "PROCESS_STATS",
    "ConnectorSettings",
    "KVDepotConnector",
    "KVDepotConnectorMetadata",
    "KVDepotConnectorStats",
    "wait_published",
]
