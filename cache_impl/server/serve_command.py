"""The serve command: the embedded torch engine on the tiered KV cache behind an OpenAI-compatible HTTP API.

It runs as `kvgate-serve` (the console script, or `python -m cache_impl.server.serve_command`) and as `kvgate serve`,
which adds the same options with `add_serve_arguments` and calls `serve`. Messages start with the name the
command was run by. Exit codes: 0 stopped by SIGTERM after draining, 2 usage or configuration error.

Only `serve` imports torch and uvicorn, so `--help` and a bad option answer in a moment.
"""

from __future__ import annotations

import argparse
import errno
import signal
import socket
import sys
import time
from pathlib import Path

from cache_impl.cache.config import ConfigError, RemoteTierConfig
from cache_impl.platform.heap import fix_mmap_threshold
from cache_impl.server.auth import admin_token_from_env, api_key_from_env
from cache_impl.weights.safetensors_dir import CheckpointFormatError
from kvcore.loader_names import LOADERS
from kvcore.printable import printable
from kvcore.settings import load_yaml_mapping

SERVE_HELP = "serve the embedded engine over an OpenAI-compatible HTTP API"
SERVE_DESCRIPTION = ("Run the embedded torch engine on the tiered KV cache behind /v1/completions and "
                     "/v1/chat/completions. SIGTERM drains running requests and flushes the cache.")
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The serve command's options on `parser`; its defaults name `serve` as the handler and the parser's
    prog as the name messages start with."""
    parser.add_argument("--mode", choices=["tiered", "device-only", "recompute"], help="cache mode (default: tiered)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=_port, default=8000,
                        help="port, 1-65535, free on --host (default: %(default)s)")
    parser.add_argument("--cache-dir", type=Path, help="the disk tier's directory")
    parser.add_argument("--remote", metavar="URL",
                        help="the shared pool below the disk tier: redis://HOST:PORT/DB or "
                             "mooncake://MASTER_HOST:PORT?metadata=URL[&segment=SIZE]")
    parser.add_argument("--preset", help="model size preset: tiny, small (default), base; with --weights, the "
                                         "directory's own (an explicit one must agree with it)")
    parser.add_argument("--weights", type=Path, metavar="DIR",
                        help="load the weights from this safetensors directory (kvgate export-weights writes one) "
                             "instead of making them from the seed")
    parser.add_argument("--load-format", choices=LOADERS,
                        help="the loader of --weights (default: kvgate, its own parallel O_DIRECT reads; "
                             "safetensors is what engines do by default)")
    parser.add_argument("--require-checksums", action="store_true",
                        help="refuse --weights without their checksum sidecar and index (exit 2, naming what is "
                             "missing); without it they are served with a warning on the start line")
    parser.add_argument("--config", type=Path, help="YAML file; its `engine:` section configures the engine")
    parser.add_argument("--api-key-env", default="KVGATE_API_KEY",
                        help="environment variable holding the API key clients must send, at least 16 printable "
                             "ASCII characters (default: %(default)s; unset: no key, with a warning off loopback)")
    parser.add_argument("--admin", action="store_true",
                        help="add /admin/cache/{evict,flush,drop-page-cache,locate} and /admin/faults (the gates use "
                             "them to place prefixes and inject disk faults); needs an admin token, which clients "
                             "send in the X-Kvgate-Admin-Token header (with an API key, also the Bearer key)")
    parser.add_argument("--admin-token-env", default="KVGATE_ADMIN_TOKEN", metavar="NAME",
                        help="environment variable holding the admin token, at least 16 printable ASCII characters "
                             "(default: %(default)s); --admin without it is an error (exit 2), on loopback too: "
                             "every local user can reach loopback")
    parser.add_argument("--max-request-bytes", metavar="SIZE",
                        help="largest request body, e.g. 4MiB (default: the config's engine.max_request_bytes, "
                             "else 4MiB); larger ones get 413 before they are read")
    parser.set_defaults(handler=serve, serve_name=parser.prog)


def engine_settings(args: argparse.Namespace) -> dict:
    """The engine section of --config, overridden by command-line flags."""
    settings: dict = {}
    if args.config is not None:
        settings = load_yaml_section(args.config, "engine")
    if args.mode:
        settings["mode"] = args.mode
    if args.preset:
        settings["preset"] = args.preset
    if args.max_request_bytes is not None:
        settings["max_request_bytes"] = args.max_request_bytes
    if args.weights is not None:
        settings["weights"] = str(args.weights)
    if args.load_format is not None:
        settings["load_format"] = args.load_format
    if args.require_checksums:
        settings["require_checksums"] = True
    if args.cache_dir is not None:
        cache = dict(settings.get("cache") or {})
        cache["disk"] = {**(cache.get("disk") or {}), "path": str(args.cache_dir)}
        settings["cache"] = cache
    if args.remote is not None:
        remote = RemoteTierConfig.from_url(args.remote).model_dump(exclude_defaults=True)
        settings["cache"] = {**(settings.get("cache") or {}), "remote": remote}
    return settings


def load_yaml_section(path: Path, section: str) -> dict:
    """One top-level mapping of a YAML file (empty when absent); a ConfigError names it when it is not a mapping."""
    data = load_yaml_mapping(path, str(path))
    if not isinstance(data.get(section, {}), dict):
        raise ConfigError(f"{path}: {section}: expected a mapping, found {type(data.get(section)).__name__}")
    return dict(data.get(section) or {})


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number 1-65535, found {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 1-65535, found {value}")
    return value


def _check_bindable(host: str, port: int) -> None:
    """A ConfigError unless `port` can be bound on `host` now (uvicorn binds it the same way, later)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as error:
        raise ConfigError(f"--host: expected an address of this machine, found {host!r} ({error})") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
        try:
            probe.bind(address)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise ConfigError(f"--port: expected a free port on {host}, found {port} in use") from None
            raise ConfigError(f"--host/--port: expected an address and port this user can bind, found "
                              f"{host}:{port} refused ({error.strerror})") from None


def serve(args: argparse.Namespace) -> int:
    """Build the engine and its app from `args` (the options `add_serve_arguments` adds), print the start line
    and serve until SIGTERM. A bad option or config raises ConfigError before the port is taken."""
    import uvicorn  # deferred: the serve command's stack (uvicorn, torch: seconds) loads for serving only

    from cache_impl.engine.engine import Engine, EngineConfig  # deferred: torch (seconds), for serving only
    from cache_impl.platform.openmp import hand_threads_to_engine  # deferred: torch (seconds), for serving only
    from cache_impl.server.server import create_app  # deferred: torch (seconds), for serving only

    imports_done = time.time()          # Python, torch and the engine loaded: the start-up's first phase
    fix_mmap_threshold()  # before the engine allocates: a freed buffer goes back to the OS, not to an arena

    name = args.serve_name
    admin_token = admin_token_from_env(args.admin_token_env) if args.admin else None
    api_key = api_key_from_env(args.api_key_env)
    config = EngineConfig.from_dict(engine_settings(args))
    _check_bindable(args.host, args.port)
    if args.host not in LOOPBACK_HOSTS:
        if api_key is None:
            print(f"{name}: warning: the API is open to the network on {args.host} without an API key "
                  f"(set one in {args.api_key_env})", file=sys.stderr, flush=True)
        if admin_token is not None:
            print(f"{name}: warning: the admin routes listen on {args.host} over plain HTTP; anyone who "
                  f"sees the traffic sees the admin token", file=sys.stderr, flush=True)
    engine = Engine(config, threads=hand_threads_to_engine())
    app = create_app(engine, api_key=api_key, admin_token=admin_token, imports_done=imports_done)
    remote = config.cache.remote
    room = engine.cache.disk_room() if engine.cache is not None else None
    if room is not None and room.warning():
        print(f"{name}: warning: {room.warning()}", file=sys.stderr, flush=True)
    print(f"{name}: {engine.model_name}, {engine.weights_load.describe()}, mode {config.mode}, "
          f"disk tier {f'{room.path} ({room.describe()})' if room is not None else 'off'}, "
          f"shared pool {remote.backend if remote is not None and config.mode == 'tiered' else 'off'}, "
          f"http://{args.host}:{args.port}/v1", flush=True)
    # uvicorn drains on SIGTERM, then re-raises the signal to the previous handler: make that a clean exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=30)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """`kvgate-serve`'s parser: the serve command on its own."""
    parser = argparse.ArgumentParser(prog="kvgate-serve", description=SERVE_DESCRIPTION)
    add_serve_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`kvgate-serve`: serve, or print a usage or configuration error naming the field and return 2."""
    args = build_parser().parse_args(argv)
    try:
        return serve(args)
    except (ConfigError, CheckpointFormatError) as error:
        print(f"{args.serve_name}: {printable(str(error))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
