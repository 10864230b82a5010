"""Run a real vLLM engine (CPU build) on a tiny random model, as its own process.

Used by the connector tests and ``benchmarks/vllm_ttft.py``::

    python -m tests.integration.vllm.engine SPEC.json

SPEC: ``{"model": dir, "prompts": [[ids…]…], "max_tokens": n, "logprobs": k,
"kv": {…KVTransferConfig fields…} | null}``, optionally ``"dtype"``,
``"hybrid"`` (false: vLLM's hybrid KV cache manager off), ``"num_blocks"``
(a KV cache that small), ``"together"`` (all prompts in one batch),
``"reset_cache"`` (vLLM's prefix cache and the connector's reset between
prompts), ``"tp"`` (tensor-parallel ranks, a process each) and
``"enforce_eager"`` (no torch.compile: a faster start). Prints one
JSON line with the generated tokens, their logprobs, the top-k per position,
timings, the connector's process counters, whether the hybrid manager ran,
the engine's block size and its preemptions.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

# What every tiny model shares: small vocabulary and width, 2 KV heads.
_TINY = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def _save_random(
    path: Path, family: str, config: dict[str, Any], seed: int, dtype: str, config_name: str = ""
) -> Path:
    """Save a random-weight ``{family}ForCausalLM`` (no hub access), weights
    large enough that greedy decoding does not collapse into repeats; the
    attention biases of a model that has them are random too."""
    import torch
    import transformers

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_name or f"{family}Config")(**config)
    model = getattr(transformers, f"{family}ForCausalLM")(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.25)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)  # q/k/v biases: they must move the KV
    model.to(getattr(torch, dtype)).save_pretrained(path)
    return path


def build_tiny_llama(
    path: Path,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
) -> Path:
    """A random-weight Llama in bfloat16."""
    config = {
        **_TINY,
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "torch_dtype": "bfloat16",
    }
    return _save_random(path, "Llama", config, seed, "bfloat16")


def build_tiny_gemma3(
    path: Path, *, sliding_window: int = 256, seed: int = 0, sliding_per_full: int = 1
) -> Path:
    """A random-weight Gemma3 text model with ``sliding_per_full``
    sliding-window layers, then one full-attention layer (Gemma3's own
    pattern is 5 to 1): vLLM's hybrid KV cache manager gives it KV cache
    groups of both kinds."""
    types = ["sliding_attention"] * sliding_per_full + ["full_attention"]
    config = {
        **_TINY,
        "num_hidden_layers": len(types),
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": sliding_window,
        "layer_types": types,
    }
    return _save_random(path, "Gemma3", config, seed, "bfloat16", "Gemma3TextConfig")


def build_tiny_deepseek_v2(path: Path, *, seed: int = 0) -> Path:
    """A random-weight DeepSeek-V2 with multi-head latent attention (its KV
    cache holds one compressed latent per token, no heads) and dense MLPs."""
    config = {
        **_TINY,
        "kv_lora_rank": 512,  # + the rope dims: 576, the one size the kernels take
        "q_lora_rank": None,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64,
        "v_head_dim": 32,
        "first_k_dense_replace": 2,  # every layer dense: no experts
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
    }
    return _save_random(path, "DeepseekV2", config, seed, "bfloat16")


def build_tiny_qwen2(path: Path, *, seed: int = 0) -> Path:
    """A random-weight Qwen2 (attention with bias), saved in float32."""
    return _save_random(path, "Qwen2", dict(_TINY), seed, "float32")


def engine_env(tmp: Path) -> dict[str, str]:
    """Environment that keeps vLLM in one process, small, and inside ``tmp``."""
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    # An engine's metrics are its own (vLLM sums every file in this directory).
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="0",
        TMPDIR=str(tmp),
        VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
        VLLM_CONFIG_ROOT=str(tmp / "vllm-config"),
        VLLM_RPC_BASE_PATH=str(tmp),
        TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"),
        XDG_CACHE_HOME=str(tmp / "xdg"),
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_LOGGING_LEVEL="WARNING",
    )
    return env


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = spec.get("kv")
    extra: dict[str, Any] = {}
    if spec.get("hybrid") is not None:
        extra["disable_hybrid_kv_cache_manager"] = not spec["hybrid"]
    if spec.get("tp", 1) > 1:
        # One process per rank, one core each (vLLM cannot bind them itself
        # on a machine with one NUMA node).
        extra["tensor_parallel_size"] = int(spec["tp"])
        extra["distributed_executor_backend"] = "mp"
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            str(c % (os.cpu_count() or 1)) for c in range(int(spec["tp"]))
        )
    if spec.get("block_size"):
        extra["block_size"] = int(spec["block_size"])
    if spec.get("num_blocks"):
        extra["num_gpu_blocks_override"] = int(spec["num_blocks"])
        extra["disable_log_stats"] = False  # to count preemptions
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype=spec.get("dtype", "bfloat16"),
        max_model_len=spec.get("max_model_len", 4096),
        distributed_executor_backend=extra.pop("distributed_executor_backend", "uni"),
        enable_prefix_caching=spec.get("prefix_caching", False),
        enforce_eager=bool(spec.get("enforce_eager", False)),
        kv_transfer_config=KVTransferConfig(**kv) if kv else None,
        seed=0,
        **extra,
    )
    params = SamplingParams(
        temperature=0.0,
        max_tokens=spec.get("max_tokens", 8),
        logprobs=spec.get("logprobs"),
        detokenize=False,
        ignore_eos=bool(spec.get("ignore_eos", False)),
    )
    if spec.get("plant_random"):
        _plant_random(llm, kv, spec["prompts"])
    for ids in spec.get("warmup", []):
        # First requests pay for kernel selection and allocation: not measured.
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=2), use_tqdm=False)
    outputs = []
    if spec.get("together"):
        batch = llm.generate([{"prompt_token_ids": ids} for ids in spec["prompts"]], params)
        outputs = [_output(b.outputs[0], None) for b in batch]
    for ids in [] if spec.get("together") else spec["prompts"]:
        if spec.get("reset_cache") and outputs:
            assert llm.reset_prefix_cache(reset_connector=True)
        ttft = None
        if spec.get("ttft"):
            # A one-token request alone: its latency is the prompt's prefill.
            one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)
            ttft = time.perf_counter() - t0
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
        outputs.append(_output(out, ttft))
    stats: dict[str, int] = {}
    engine_stats: dict[str, int] = {}
    if kv:
        from kvdepot.connector.vllm import ENGINE_STATS, PROCESS_STATS, wait_published

        # Publishing runs behind the engine: count what it did once it is done.
        wait_published(30.0)
        stats = dict(PROCESS_STATS)
        engine_stats = dict(ENGINE_STATS)
    config = llm.llm_engine.vllm_config
    return {
        "outputs": outputs,
        "connector": stats,
        "engine_connector": engine_stats,
        "hybrid": not config.scheduler_config.disable_hybrid_kv_cache_manager,
        "block_size": config.cache_config.block_size,
        "preemptions": _metric(llm, "vllm:num_preemptions") if spec.get("num_blocks") else None,
    }


def _output(out: Any, ttft: float | None) -> dict[str, Any]:
    logprobs = top = None
    if out.logprobs is not None:
        logprobs = [
            round(float(lp[t].logprob), 4)
            for t, lp in zip(out.token_ids, out.logprobs, strict=True)
        ]
        # Per position, the k most likely tokens (JSON keys are strings).
        top = [{str(t): round(float(x.logprob), 4) for t, x in lp.items()} for lp in out.logprobs]
    return {"tokens": list(out.token_ids), "logprobs": logprobs, "top": top, "ttft_s": ttft}


def _metric(llm: Any, name: str) -> int:
    """A counter of the engine's own metrics (tokens, requests)."""
    return int(sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name))


def _plant_random(llm: Any, kv: dict[str, Any], prompts: list[list[int]]) -> None:
    """Negative control: store well-formed chunks of random KV under the
    prompts' real keys, so a consumer that uses loaded KV must change its output."""
    import numpy as np
    import torch

    from kvdepot.connector.client import ClientConfig, KVDepotClient
    from kvdepot.connector.codec import create_codec
    from kvdepot.connector.vllm.chunk_format import build_object, head_key
    from kvdepot.connector.vllm.layout import layout_from_config, namespace_for
    from kvdepot.connector.vllm.settings import ConnectorSettings
    from kvdepot.keys import chunk_keys

    cfg = llm.llm_engine.vllm_config
    settings = ConnectorSettings.from_extra(kv["kv_connector_extra_config"])
    layout = layout_from_config(cfg, settings)
    ns = namespace_for(cfg, settings, layout, 0)
    codec = create_codec(settings.codec_spec())
    shape = (2, layout.chunk_tokens, layout.head_size)
    torch.manual_seed(7)
    with KVDepotClient(ClientConfig(metadata=settings.metadata)) as client:
        for ids in prompts:
            # Small normal values in bf16, encoded with the namespace's codec,
            # in the chunk format: well-formed objects, just not this prompt's KV.
            for key in chunk_keys(ns, ids):
                for h in range(layout.total_kv_heads):
                    layers = [torch.randn(shape) for _ in range(layout.num_layers)]
                    data = build_object(codec, layers, torch.bfloat16)
                    client.put([head_key(ns.digest(), key, h)], [np.frombuffer(data, np.uint8)])


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    result = run(spec)
    print("KVDEPOT RESULT " + json.dumps(result), flush=True)
    # vLLM's atexit hooks can be slow; the result is out.
    os._exit(0)
