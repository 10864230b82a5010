#!/bin/sh
# An OpenAI-compatible vLLM server (CPU) on $MODEL, port $PORT. KV_ROLE
# (kv_producer, kv_consumer, kv_both) wires in the kvdepot connector, with
# KV_NODE the store it publishes to first and METADATA the metadata replicas;
# KV_ROLE=none serves without it (a plain engine). Prompts are token ids
# (the tiny model has no tokenizer). Eager mode: torch.compile would need a
# C++ compiler in the image (and minutes of compiling at each start).
set -eu
role="${KV_ROLE:-none}"
set -- --model "$MODEL" --host 0.0.0.0 --port "$PORT" --skip-tokenizer-init \
    --dtype bfloat16 --max-model-len 4096 --no-enable-prefix-caching \
    --distributed-executor-backend uni --enforce-eager "$@"
if [ "$role" != none ]; then
    kv=$(printf '{"kv_connector":"KVDepotConnector","kv_connector_module_path":"kvdepot.connector.vllm","kv_role":"%s","kv_connector_extra_config":{"metadata":"%s","chunk_tokens":%s,"node_id":"%s"}}' \
        "$role" "${METADATA:-metadata-0:7700,metadata-1:7700}" "${CHUNK_TOKENS:-128}" "${KV_NODE:-}")
    set -- "$@" --kv-transfer-config "$kv"
fi
mkdir -p "$TMPDIR"
exec python3 -m vllm.entrypoints.openai.api_server "$@"
