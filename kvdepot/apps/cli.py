"""The ``kvdepot`` command: daemons, a local cluster, stats and the demo.

This is the only place that reads the environment: each component's config
is built here from CLI flags > ``KVDEPOT_*`` environment > ``--config`` file.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

import kvdepot.apps.early_interrupt as early_interrupt  # first: see the module
from kvdepot.apps.cli_settings import (
    EXIT_BROKEN_PIPE,
    OneLineParser,
    add_setting_flags,
    check_environment,
    check_flag,
    check_store_room,
    check_up_room,
    discard_stdout,
    explained,
    flag_names,
    native_stderr_muted,
    setting_origin,
    setting_overrides,
    stdout_reader_gone,
    watermark_overrides,
)
from kvdepot.apps.explain_cli import add_commands as add_explain_commands
from kvdepot.config import load_config
from kvdepot.errors import KVDepotError

logger = logging.getLogger("kvdepot")

EXIT_ERROR = 1

if TYPE_CHECKING:
    # Only the type stubs make argparse's subparsers action generic.
    Subcommands = argparse._SubParsersAction[OneLineParser]


def _setup_logging(level: str, fmt: str) -> None:
    from kvdepot.logs import setup_logging

    setup_logging(level, fmt)


def _announce(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _run_until_signal(
    main: Callable[[], Coroutine[Any, Any, None]], stop_timeout_s: float | None = None
) -> int:
    from kvdepot.shutdown import run_until_signal

    return run_until_signal(main, stop_timeout_s)


# -- metadata -----------------------------------------------------------------
def cmd_metadata(args: argparse.Namespace) -> int:
    from kvdepot.metadata.config import MetadataConfig
    from kvdepot.metadata.service import MetadataServer
    from kvdepot.shutdown import finish, uninterrupted

    config = load_config(
        MetadataConfig,
        prefix="KVDEPOT_METADATA_",
        env=os.environ,
        file=args.config,
        section="metadata",
        overrides=setting_overrides(args, MetadataConfig),
        flags=flag_names(MetadataConfig),
    )
    security = _security(args)
    if args.check:
        print(json.dumps({"metadata": _asdict(config), "security": security.describe()}))
        return 0

    async def main() -> None:
        server = MetadataServer(config, security)
        try:
            # A signal while starting stops it once started (see run_store).
            port = await uninterrupted(server.start())
            ready: dict[str, Any] = {
                "role": "metadata",
                "port": port,
                "metrics_port": server.metrics_port,
            }
            if server.events is not None:
                ready["kv_events"] = server.events.endpoint
                ready["kv_events_replay"] = server.events.replay_endpoint
            _announce("KVDEPOT READY " + json.dumps(ready))
            await server.wait()
        finally:
            await finish(server.stop())

    return _run_until_signal(main, config.stop_timeout_s)


# -- store --------------------------------------------------------------------
def cmd_store(args: argparse.Namespace) -> int:
    from kvdepot.store.config import StoreConfig
    from kvdepot.store.daemon import run_store

    config = load_config(
        StoreConfig,
        prefix="KVDEPOT_STORE_",
        env=os.environ,
        file=args.config,
        section="store",
        overrides={**setting_overrides(args, StoreConfig), **watermark_overrides(args)},
        flags=flag_names(StoreConfig),
    )
    security = _security(args)
    if args.check:

        def origin(name: str) -> str:
            value = getattr(config, name)
            return setting_origin(args, StoreConfig, "KVDEPOT_STORE_", name, value)

        check_store_room(config, origin)
        print(json.dumps({"store": _asdict(config), "security": security.describe()}))
        return 0
    return _run_until_signal(
        lambda: run_store(config, announce=_announce, security=security), config.stop_timeout_s
    )


def _add_watermark_flag(s: argparse.ArgumentParser) -> None:
    # One option for three settings (cpu_watermarks, gpu_watermarks, ssd_watermarks).
    s.add_argument(
        "--watermarks",
        action="append",
        default=[],
        metavar="TIER=HIGH:LOW",
        help="tiers: demote above HIGH down to LOW, e.g. cpu=0.95:0.85 (repeatable)",
    )


# -- up -----------------------------------------------------------------------
def _check_up_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Validate what ``up``'s daemons will run with (its flags, and the
    ``KVDEPOT_*`` environment they inherit) and that their arenas fit,
    before starting any: one bad value is one line here, not a daemon dying
    during startup. Returns the daemons' settings, as ``--check`` shows them."""
    from kvdepot.metadata.config import MetadataConfig
    from kvdepot.store.config import StoreConfig

    if args.nodes < 1:
        raise KVDepotError(f"--nodes {args.nodes}: must be at least 1")
    if args.max_restarts < 0:
        raise KVDepotError(f"--max-restarts {args.max_restarts}: must be 0 or more")
    check_flag(args.restart_window, "--restart-window")
    metadata = load_config(
        MetadataConfig,
        prefix="KVDEPOT_METADATA_",
        env=os.environ,
        overrides={"host": args.host, "port": args.metadata_port, "index": args.index},
        flags={"host": "--host", "port": "--metadata-port", "index": "--index"},
    )
    store = load_config(
        StoreConfig,
        prefix="KVDEPOT_STORE_",
        env=os.environ,
        overrides={"host": args.host, "capacity_bytes": args.capacity, "port": 0},
        flags={"host": "--host", "capacity_bytes": "--capacity"},
    )
    check_up_room(args.nodes, store, args.capacity)
    return {"nodes": args.nodes, "metadata": _asdict(metadata), "store": _asdict(store)}


def _print_up(cluster: Any, host: str) -> None:
    """What ``up`` started: addresses and pids (a supervisor or a test
    signals them by pid), and the metrics endpoints."""
    meta = cluster.metadata
    print(f"kvdepot cluster up: metadata {cluster.metadata_address}, pid {meta.pid}", flush=True)
    for s in cluster.stores:
        print(
            f"  store {s.info['node_id']}: data {s.info['address']}, "
            f"gRPC {s.info['grpc_address']}, pid {s.pid}",
            flush=True,
        )
    for d in cluster.daemons():
        if d.info.get("metrics_port") is not None:
            url = f"http://{host}:{d.info['metrics_port']}/metrics"
            print(f"  {d.name} metrics: {url}", flush=True)
    print("Ctrl-C stops all.", flush=True)


def cmd_up(args: argparse.Namespace) -> int:
    """A local cluster, supervised: a daemon that dies is restarted (see
    :class:`~kvdepot.apps.cluster.Supervisor`); one that keeps dying ends
    ``up`` with an error. Only a signal to ``up`` itself is a clean stop."""
    from kvdepot.apps.cluster import LocalCluster, RestartPolicy, Supervisor

    settings = _check_up_settings(args)
    if args.check:
        print(json.dumps({"up": settings, "security": _security(args).describe()}))
        return 0
    cluster = LocalCluster(
        nodes=args.nodes,
        metadata_port=args.metadata_port,
        capacity=args.capacity,
        host=args.host,
        index=args.index,
        metrics=args.metrics,
        log_format=args.log_format,
        security=_security(args),
    )
    # Children get SIGINT from the terminal too: once it came, their exits
    # are the stop, not crashes to restart.
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # As the daemons do: SIGUSR1 writes where each thread is (a supervisor
    # about to give up on a hung `up` asks first).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        cluster.start(abort=lambda: stop)  # stops what it started if it fails
    except KVDepotError:
        if stop:  # interrupted: a daemon stopped by the signal is no error
            return 130
        raise
    policy = RestartPolicy(
        max_restarts=args.max_restarts, window_s=check_flag(args.restart_window, "--restart-window")
    )
    supervisor = Supervisor(cluster, policy, stopping=lambda: stop)
    try:
        _print_up(cluster, args.host)
        while not stop:
            supervisor.poll()  # raises once a daemon ran out of restarts
            time.sleep(0.2)
    finally:
        cluster.stop()
    return 0


# -- stats --------------------------------------------------------------------
def _client(args: argparse.Namespace) -> Any:
    """A client of the metadata service for the query commands."""
    from kvdepot.connector.client import ClientConfig, KVDepotClient

    config = load_config(
        ClientConfig,
        prefix="KVDEPOT_CLIENT_",
        env=os.environ,
        overrides={
            "metadata": args.metadata,
            # Its own default deadline, under KVDEPOT_CLIENT_RPC_TIMEOUT_S.
            "rpc_timeout_s": args.timeout
            or (None if "KVDEPOT_CLIENT_RPC_TIMEOUT_S" in os.environ else "5"),
            "security": _security(args),
        },
        flags={"metadata": "--metadata", "rpc_timeout_s": "--timeout"},
    )
    return KVDepotClient(config)


def cmd_stats(args: argparse.Namespace) -> int:
    from kvdepot.apps.stats import render_table, stats_to_dict

    check_flag(args.interval, "--interval")
    with _client(args) as client:
        while True:
            data = stats_to_dict(client.stats())
            if args.json:
                print(json.dumps(data), flush=True)
            else:
                if args.watch and sys.stdout.isatty():
                    sys.stdout.write("\x1b[H\x1b[2J")
                print(render_table(data), flush=True)
            if not args.watch:
                return 0
            time.sleep(float(args.interval))


# -- demo ---------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> int:
    from kvdepot.apps.demo import DemoOptions, run_demo

    options = DemoOptions(
        prompts=args.prompts,
        shared_prefixes=args.shared_prefixes,
        prefix_chunks=args.prefix_chunks,
        suffix_chunks=args.suffix_chunks,
        chunk_bytes=args.chunk_bytes,
        nodes=args.nodes,
        metadata=args.metadata or "",
        progress=sys.stderr.isatty() and not args.json,
    )
    summary = run_demo(options, _security(args))
    if args.json:
        print(json.dumps(summary))
    else:
        from kvdepot.apps.demo import render_summary

        print(render_summary(summary))
    return 0 if summary["verified"] else EXIT_ERROR


# -- proxy --------------------------------------------------------------------
def cmd_proxy(args: argparse.Namespace) -> int:
    from kvdepot.keys import Namespace
    from kvdepot.proxy.config import ENV_PREFIX, ProxyConfig, UpstreamConfig
    from kvdepot.proxy.router import parse_node_map

    namespace = None
    if args.routing == "kv-aware":
        if not args.model:
            raise KVDepotError("--routing kv-aware needs --model (the engines' model id)")
        namespace = Namespace(
            model=args.model,
            kv_dtype=args.kv_dtype,
            kv_layout=args.kv_layout,
            tp_size=args.tp_size,
            chunk_tokens=args.chunk_tokens,
            extra=(args.cache_salt,) if args.cache_salt else (),
        )
    config = ProxyConfig(
        prefill=tuple(u for v in args.prefill for u in v.split(",") if u),
        decode=tuple(u for v in args.decode for u in v.split(",") if u),
        host=args.host,
        port=args.port,
        routing=args.routing,
        prefill_nodes=parse_node_map(args.prefill_node),
        decode_nodes=parse_node_map(args.decode_node),
        metadata=args.metadata or "",
        namespace=namespace,
        upstream=load_config(
            UpstreamConfig,
            prefix=ENV_PREFIX,
            env=os.environ,
            overrides=setting_overrides(args, UpstreamConfig),
            flags=flag_names(UpstreamConfig),
        ),
    )
    if args.check:
        print(json.dumps({"proxy": _asdict(config)}))
        return 0
    from kvdepot.proxy.server import serve  # aiohttp: not needed to check the settings

    security = _security(args)
    return _run_until_signal(lambda: serve(config, announce=_announce, security=security))


# -- health / config -------------------------------------------------------------
def cmd_health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvdepot.rpc.security import channel as secure_channel

    with secure_channel(args.target, _security(args)) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service),
                timeout=check_flag(args.timeout, "--timeout"),
            )
        except grpc.RpcError as exc:
            from kvdepot.errors import Unavailable

            kind = Unavailable if exc.code() == grpc.StatusCode.UNAVAILABLE else KVDepotError
            raise kind(f"health check of {args.target} failed: {exc.code().name}") from None
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else EXIT_ERROR


def cmd_config(args: argparse.Namespace) -> int:
    from kvdepot.metadata.config import MetadataConfig
    from kvdepot.store.config import StoreConfig

    out = {
        "metadata": _asdict(
            load_config(
                MetadataConfig,
                prefix="KVDEPOT_METADATA_",
                env=os.environ,
                file=args.config,
                section="metadata",
            )
        ),
        "store": _asdict(
            load_config(
                StoreConfig,
                prefix="KVDEPOT_STORE_",
                env=os.environ,
                file=args.config,
                section="store",
            )
        ),
        "security": _security(args).describe(),
    }
    print(json.dumps(out, indent=2))
    return 0


# -- certs ------------------------------------------------------------------------
def cmd_certs(args: argparse.Namespace) -> int:
    from kvdepot.apps.certs import make_certs

    hosts = [h for v in args.hosts for h in v.split(",") if h] or None
    paths = make_certs(args.dir, *([hosts] if hosts else []), days=args.days, force=args.force)
    print(f"wrote a test CA and certificates to {paths.ca.parent}:")
    print(f"  CA          {paths.ca}  (key {paths.ca_key})")
    print(f"  daemons     {paths.server_cert}  (key {paths.server_key})")
    print(f"  clients     {paths.client_cert}  (key {paths.client_key})")
    print(
        "daemons: --tls-cert server.pem --tls-key server.key --tls-ca ca.pem "
        "[--tls-client-auth]; clients: --tls-ca ca.pem [--tls-cert client.pem "
        "--tls-key client.key]"
    )
    return 0


# -- security flags (every command that serves or calls gRPC) ----------------------
def _add_security_flags(p: argparse.ArgumentParser) -> None:
    from kvdepot.rpc.security_config import SECURITY_GROUP, SecurityConfig

    about = (
        "the token itself comes from KVDEPOT_AUTH_TOKEN or a file, never a flag; "
        "see README 'Security'"
    )
    add_setting_flags(p, SecurityConfig, descriptions={SECURITY_GROUP: about})


def _security(args: argparse.Namespace) -> Any:
    from kvdepot.rpc.security_config import SecurityConfig, load_security

    return load_security(
        os.environ,
        getattr(args, "config", None),
        setting_overrides(args, SecurityConfig),
        flag_names(SecurityConfig),
    )


def _asdict(obj: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(obj)


def _add_metadata_command(sub: Subcommands) -> None:
    """`kvdepot metadata`: the metadata service's flags."""
    from kvdepot.metadata.config import MetadataConfig

    m = sub.add_parser("metadata", help="run the metadata service")
    m.add_argument("--config", help="TOML/JSON file with a [metadata] table")
    add_setting_flags(m, MetadataConfig)
    m.add_argument("--check", action="store_true", help="validate the config, print it, exit")
    _add_security_flags(m)
    m.set_defaults(func=cmd_metadata)


def _add_store_command(sub: Subcommands) -> None:
    """`kvdepot store`: a store daemon's flags."""
    from kvdepot.store.config import StoreConfig

    s = sub.add_parser("store", help="run a store daemon")
    s.add_argument("--config", help="TOML/JSON file with a [store] table")
    add_setting_flags(s, StoreConfig)
    _add_watermark_flag(s)
    s.add_argument("--check", action="store_true", help="validate the config, print it, exit")
    _add_security_flags(s)
    s.set_defaults(func=cmd_store)


def _add_up_command(sub: Subcommands) -> None:
    """`kvdepot up`: a local cluster of metadata and N stores."""
    u = sub.add_parser("up", help="run a local cluster: metadata + N stores")
    u.add_argument("--nodes", type=int, default=2, help="store daemons (default 2)")
    u.add_argument("--metadata-port", type=int, default=7700, help="metadata port (default 7700)")
    u.add_argument("--capacity", default="512MiB", help="arena per store (default 512MiB)")
    u.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    u.add_argument(
        "--metrics", action="store_true", help="serve /metrics on each daemon (free ports)"
    )
    u.add_argument("--index", default="memory://", help="index backend (e.g. redis://host:6379)")
    u.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="restarts of a daemon that dies within --restart-window before up gives up "
        "(default 5; 0: never restart)",
    )
    u.add_argument(
        "--restart-window", default="60", help="seconds restarts are counted over (default 60)"
    )
    u.add_argument("--check", action="store_true", help="validate the settings, print them, exit")
    _add_security_flags(u)
    u.set_defaults(func=cmd_up)


def _add_stats_command(sub: Subcommands) -> None:
    """`kvdepot stats`: cluster statistics over gRPC."""
    st = sub.add_parser("stats", help="cluster statistics over gRPC")
    st.add_argument("--metadata", help="metadata host:port (default 127.0.0.1:7700)")
    st.add_argument("--json", action="store_true", help="print one JSON object")
    st.add_argument("--watch", action="store_true", help="refresh until interrupted")
    st.add_argument("--interval", default="2", help="--watch period in seconds")
    st.add_argument("--timeout", help="RPC deadline in seconds (default 5)")
    _add_security_flags(st)
    st.set_defaults(func=cmd_stats)


def _add_demo_command(sub: Subcommands) -> None:
    """`kvdepot demo`: publish and pull KV across processes."""
    d = sub.add_parser("demo", help="publish and pull KV across processes, verify every byte")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.add_argument("--metadata", help="use an existing cluster instead of starting one")
    d.add_argument("--nodes", type=int, default=2, help="stores of the local cluster (default 2)")
    d.add_argument("--prompts", type=int, default=16, help="prompts published (default 16)")
    d.add_argument("--shared-prefixes", type=int, default=4, help="distinct system prompts")
    d.add_argument("--prefix-chunks", type=int, default=4, help="chunks per system prompt")
    d.add_argument("--suffix-chunks", type=int, default=2, help="unique chunks per prompt")
    d.add_argument("--chunk-bytes", default="1MiB", help="bytes of KV per chunk (default 1MiB)")
    _add_security_flags(d)
    d.set_defaults(func=cmd_demo)


def _add_proxy_command(sub: Subcommands) -> None:
    """`kvdepot proxy`: the prefill -> decode proxy and its kv-aware routing namespace."""
    px = sub.add_parser("proxy", help="disaggregated prefill -> decode OpenAI-compatible proxy")
    px.add_argument("--prefill", action="append", required=True, help="prefill engine URL(s)")
    px.add_argument("--decode", action="append", required=True, help="decode engine URL(s)")
    px.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    px.add_argument("--port", type=int, default=8000, help="listen port (default 8000; 0 picks)")
    px.add_argument(
        "--routing",
        choices=["round-robin", "kv-aware"],
        default="round-robin",
        help="engine choice: round-robin (default) or by cached prefix (Route)",
    )
    px.add_argument(
        "--prefill-node",
        action="append",
        default=[],
        metavar="URL=NODE_ID",
        help="store node of a prefill engine (kv-aware)",
    )
    px.add_argument(
        "--decode-node",
        action="append",
        default=[],
        metavar="URL=NODE_ID",
        help="store node of a decode engine (kv-aware; else decode is round-robin)",
    )
    px.add_argument("--metadata", help="metadata service host:port (kv-aware)")
    px.add_argument("--model", help="model id of the engines' key namespace (kv-aware)")
    px.add_argument("--kv-dtype", default="bfloat16", help="namespace KV dtype (bfloat16)")
    px.add_argument("--kv-layout", default="default", help="namespace KV layout signature")
    px.add_argument("--tp-size", type=int, default=1, help="namespace tensor-parallel size")
    px.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk (256)")
    px.add_argument("--cache-salt", default="", help="namespace cache salt, if any")
    px.add_argument("--check", action="store_true", help="validate the config, print it, exit")
    from kvdepot.proxy.config import UpstreamConfig

    add_setting_flags(px, UpstreamConfig)
    _add_security_flags(px)
    px.set_defaults(func=cmd_proxy)


def _add_health_command(sub: Subcommands) -> None:
    """`kvdepot health`: a daemon's gRPC health check."""
    h = sub.add_parser("health", help="gRPC health check of a daemon (exit 0 when SERVING)")
    h.add_argument("--target", default="127.0.0.1:7700", help="daemon gRPC host:port")
    h.add_argument("--service", default="", help="service name (default: the server)")
    h.add_argument("--timeout", default="3", help="deadline in seconds")
    _add_security_flags(h)
    h.set_defaults(func=cmd_health)


def _add_config_command(sub: Subcommands) -> None:
    """`kvdepot config`: print the effective daemon configuration."""
    cf = sub.add_parser("config", help="print the effective daemon configuration")
    cf.add_argument("--print", action="store_true", dest="print_", help="print it (default)")
    cf.add_argument("--config", help="TOML/JSON file with [metadata] and [store] tables")
    _add_security_flags(cf)
    cf.set_defaults(func=cmd_config)


def _add_certs_command(sub: Subcommands) -> None:
    """`kvdepot certs`: a local CA and TLS certificates for testing."""
    ce = sub.add_parser("certs", help="make a local CA and TLS certificates for testing")
    ce.add_argument("dir", help="directory to write ca.pem, server.pem, client.pem and keys to")
    ce.add_argument(
        "--hosts",
        action="append",
        default=[],
        help="names/addresses of the daemons' certificate (default localhost,127.0.0.1,::1)",
    )
    ce.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    ce.add_argument("--force", action="store_true", help="overwrite existing files")
    ce.set_defaults(func=cmd_certs)


def _version() -> str:
    """The installed distribution's version (a source tree run in place has
    none installed: the package's own then)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvdepot")
    except PackageNotFoundError:
        from kvdepot import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="kvdepot", description="KV cache store for LLM inference")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    p.add_argument("--log-level", default="INFO", help="daemon log level (default INFO)")
    p.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=None,
        help="log lines on stderr: text (default) or json, one object per line "
        "(env KVDEPOT_LOG_FORMAT)",
    )
    sub = p.add_subparsers(dest="command", required=True)
    _add_metadata_command(sub)
    _add_store_command(sub)
    _add_up_command(sub)
    _add_stats_command(sub)
    add_explain_commands(sub, _add_security_flags, _client)
    _add_demo_command(sub)
    _add_proxy_command(sub)
    _add_health_command(sub)
    _add_config_command(sub)
    _add_certs_command(sub)
    for command in sub.choices.values():
        # An unknown flag is reported by the command it was given to.
        command.set_defaults(parser=command)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    early_interrupt.restore()
    try:
        # Building the parser imports the configs (and grpc with the security one).
        parser = build_parser()
    except KeyboardInterrupt:
        return 130
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        check_environment()
        if args.log_format is None:
            args.log_format = os.environ.get("KVDEPOT_LOG_FORMAT", "text")
        with native_stderr_muted(args.command in ("stats", "health", "namespaces", "explain")):
            _setup_logging(args.log_level, args.log_format)
            code: int = args.func(args)
        return code
    except BrokenPipeError:
        if not stdout_reader_gone():
            raise
        # `kvdepot stats --watch | head -1`: the reader has what it wanted.
        discard_stdout()
        return EXIT_BROKEN_PIPE
    except KVDepotError as exc:
        print(f"kvdepot: error: {explained(exc, args, lambda: _security(args))}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
