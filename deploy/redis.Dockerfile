# Redis from Debian's redis-server package, for hosts without an image registry:
#   docker build -f deploy/redis.Dockerfile --build-arg BASE=local/debian:bookworm -t kvdepot-redis .
# (set REDIS_IMAGE=kvdepot-redis in deploy/.env). A base that already holds
# redis-server is used as it is; others install it with apt-get.
ARG BASE=debian:bookworm-slim
FROM ${BASE}
RUN command -v redis-server >/dev/null 2>&1 || { \
      apt-get update && apt-get install -y --no-install-recommends redis-server \
      && rm -rf /var/lib/apt/lists/*; }
USER redis
WORKDIR /var/lib/redis
EXPOSE 6379
CMD ["redis-server", "--bind", "0.0.0.0", "--protected-mode", "no", "--save", "", "--appendonly", "no"]
