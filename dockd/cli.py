"""The `dockd` command: serve a node, run the demo, watch a dock, run benchmarks."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time

from dockd import config, limits, owners
from dockd._version import __version__
from dockd.errors import DockError, DockValueError

_FIELD = re.compile(r"""(\w+)=('[^']*'|"[^"]*"|\S+)""")
_TAG = re.compile(r"\[(\w+)\]\s*")
_RESERVED = {"ts", "level", "logger", "pid", "component", "event", "msg", "exc"}


_INT = re.compile(r"-?\d+")
_FLOAT = re.compile(r"-?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?")
_CONSTANTS = {"True": True, "true": True, "False": False, "false": False, "None": None, "null": None}


def _value(text: str):
    """A logged `key=value`'s value as JSON: numbers and booleans as themselves, None as null; a quoted
    value ('7', "a b") stays the string it quotes."""
    if text[:1] in ("'", '"'):
        return text[1:-1]
    text = text.rstrip(";,")
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    return _CONSTANTS.get(text, text)


class JsonFormatter(logging.Formatter):
    """One JSON object per line for log shippers: the message's [component], its event (the
    words before the first key=value) and every key=value field, next to the whole message."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        out: dict = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name, "pid": record.process,
        }
        tag = _TAG.match(msg)
        if tag:
            out["component"] = tag.group(1)
        rest = msg[tag.end():] if tag else msg
        first = _FIELD.search(rest)
        out["event"] = (rest[: first.start()] if first else rest).strip().rstrip(":;,") or None
        for key, value in _FIELD.findall(rest):
            if key not in _RESERVED:
                out[key] = _value(value)
        out["msg"] = msg
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def _setup_logging(level: str, fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s pid=%(process)d %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])


def _serve(args) -> int:
    from dockd.config import NodeConfig, parse_size
    from dockd.node.daemon import serve

    controllers = owners.parse(args.controllers) if args.controllers else ()
    cfg = NodeConfig(
        host=args.host, port=args.port, grpc_port=args.grpc_port, advertise=args.advertise,
        controller=args.controller, warehouse=not args.no_warehouse, join=args.join or "",
        controllers=controllers, shards=owners.parse_shards(args.shards) if args.shards else {},
        capacity=parse_size(args.capacity), device_capacity=parse_size(args.device_capacity), lease_timeout=args.lease_timeout, shm=not args.no_shm,
        state_dir=args.state_dir or "", data_dir=args.data_dir or "", drop_damaged_files=args.drop_damaged_files,
        spill_dir=args.spill_dir or "", spill_capacity=parse_size(args.spill_capacity), join_timeout=args.join_timeout, controller_grace=args.controller_grace,
        commit_window=args.commit_window,
        warehouse_grace=args.warehouse_grace, replicas=args.replicas, token_file=args.token_file or config.env("DOCKD_TOKEN_FILE"),
        daemon_token_file=args.daemon_token_file or "", insecure=args.insecure, max_connections=args.max_connections,
        handshake_timeout=args.handshake_timeout, stall_timeout=args.stall_timeout, idle_timeout=args.idle_timeout,
        min_rate=parse_size(args.min_rate), max_samples=args.max_samples, checkpoint_root=args.checkpoint_root or "",
        daemon_timeout=args.daemon_timeout, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
        heartbeat_interval=args.heartbeat_interval, heartbeat_timeout=args.heartbeat_timeout,
        tls_cert=args.tls_cert or "", tls_key=args.tls_key or "", tls_ca=args.tls_ca or "",
        transport=args.transport, mooncake_protocol=args.mooncake_protocol,
    )
    _check_host(cfg.host)
    _check_token_files(cfg)
    _check_state_dir(cfg)
    _hold_spill_dir(cfg)
    if cfg.warehouse and cfg.transport == "auto" and not cfg.shm:
        logging.getLogger("dockd").info("[mooncake] transport=socket: --transport auto with --no-shm (the engine serves "
                                        "reads from shared-memory segments)")
    elif cfg.warehouse and cfg.transport != "socket":  # this process's Mooncake engine, before the node starts
        from dockd.errors import DockError
        from dockd.net import mooncake

        try:
            chosen = mooncake.start(cfg.transport, cfg.host, cfg.advertise, cfg.mooncake_protocol)
        except DockError as e:
            logging.getLogger("dockd").error("[node] cannot start: %s", e)
            return 2
        if chosen == "mooncake" and (cfg.token_file or cfg.tls_cert):
            logging.getLogger("dockd").warning(
                "[serve] --transport %s: the Mooncake engine's data path has no authentication or encryption; the "
                "token and TLS guard only the dock's own connections (see docs/cluster.md)", cfg.transport)
    if cfg.insecure and not cfg.token_file:
        logging.getLogger("dockd").warning(
            "[serve] --insecure: no authentication; anyone who reaches %s:%d can read, write and wedge this dock",
            args.host, args.port)
    return serve(cfg)


def _check_host(host: str) -> None:
    """--host must be an address of this machine: a name that does not resolve, or another machine's
    address, failed at listen with a message that pointed at --port."""
    import errno
    import socket

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise DockValueError(f"--host {host}: cannot resolve it ({e.strerror}); give an address of this machine "
                             "(127.0.0.1, one of its interfaces', or 0.0.0.0 for all)") from None
    with socket.socket(family, kind, proto) as probe:
        try:
            probe.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise DockValueError(f"--host {host} is not an address of this machine: give one of its interfaces' "
                                     "addresses, or 0.0.0.0 for all (others reach it at --advertise)") from None


def _check_token_files(cfg) -> None:
    """--daemon-token-file holding the dock's token would let every client prove the daemon role."""
    from pathlib import Path

    if not cfg.daemon_token_file:
        return
    try:
        same = Path(cfg.daemon_token_file).read_bytes().strip() == Path(cfg.token_file).read_bytes().strip()
    except OSError:
        return  # (loading them says what is wrong with either file)
    if same:
        raise DockValueError(
            f"--daemon-token-file {cfg.daemon_token_file} holds the same token as --token-file {cfg.token_file}, "
            "which every client holds: a client could then act as a daemon. Give the daemons a token of their own "
            "(e.g. `openssl rand -hex 32 > FILE`, the same file on every daemon), or drop --daemon-token-file")


def _check_state_dir(cfg) -> None:
    """A controller's state dir keeps the partitions it owned under the controller list the dock agreed on
    (owners.LIST_FILE): a start under another list is refused. One controller records its (empty) list
    now; several record theirs once they all agree (dockd.node.controller_probe)."""
    if not (cfg.controller and cfg.state_dir):
        return
    own = cfg.controllers[owners.own_index(cfg.controllers, cfg.host, cfg.port, cfg.advertise)] \
        if cfg.controllers else ""
    owners.check_recorded(cfg.state_dir, cfg.controllers, own)
    if not cfg.controllers:
        owners.record_list(cfg.state_dir, (), "")


def _hold_spill_dir(cfg) -> None:
    """One warehouse per --spill-dir, held for the life of the process (dockd.dirlock): a second one
    removed the first one's spill files at its start and wrote its own under the same names, which the
    first then served as its samples' values. A dir that is also this node's --data-dir or --state-dir
    is held by that (the same lock file)."""
    import os

    from dockd import dirlock

    if not cfg.spill_dir or not cfg.warehouse:
        return
    spill = os.path.realpath(cfg.spill_dir)
    if spill in {os.path.realpath(d) for d in (cfg.data_dir, cfg.state_dir) if d}:
        return
    mask = os.umask(0o077)  # (dirs made on the way are this user's only, as a data dir made by its warehouse)
    try:
        os.makedirs(spill, mode=0o700, exist_ok=True)
    except OSError:
        return  # (the spill tier says what is wrong with the dir)
    finally:
        os.umask(mask)
    dirlock.hold(cfg.spill_dir, "--spill-dir", DockValueError)  # (kept until the process exits)


def _connect(args):
    import dockd
    from dockd.net.auth import load_token

    token = load_token(args.token_file) if args.token_file else None
    return dockd.connect(args.address, token=token, connect_timeout=args.connect_timeout, tls=args.tls_ca)


def _stats(args) -> int:
    with _connect(args) as dock:
        print(json.dumps(dock.stats(), indent=2, default=str))
    return 0


def _status(args) -> int:
    from dockd.status import run

    if not args.interval >= 0 or (args.watch and args.interval == 0):  # (NaN fails the first)
        raise DockValueError(f"--interval must be > 0 seconds with --watch (>= 0 without), got {args.interval:g}")
    with _connect(args) as dock:
        return run(dock, address=args.address, watch=args.watch, interval=args.interval, as_json=args.json)


def _clear(args) -> int:
    with _connect(args) as dock:
        n = dock.clear(args.partition)
    print(f"cleared partition {args.partition!r}: {n} samples")
    return 0


def _demo(args) -> int:
    from dockd.demo import run_demo

    run_demo(steps=args.steps, prompts=args.prompts, group_size=args.group_size, warehouses=args.warehouses)
    return 0


def _bench(args) -> int:
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent  # the checkout of an editable install
    if not (root / "benchmarks" / "__init__.py").is_file():
        print("dockd bench runs the benchmarks/ package of a source checkout (pip install -e .); "
              "it is not part of the installed wheel", file=sys.stderr)
        return 2
    # `python -m benchmarks` from the checkout: the benchmarks live in the source tree, not the package
    return subprocess.call([sys.executable, "-m", "benchmarks", *args.rest], cwd=root)


# `dockd serve`'s options, in the order --help lists them: (flag, add_argument's arguments, help)
SERVE_OPTIONS: tuple[tuple[str, dict, str], ...] = (
    ("--host", {"default": "127.0.0.1"}, "address to bind (default 127.0.0.1)"),
    ("--port", {"type": int, "default": 7450}, "framed data port (0: pick a free one; default 7450)"),
    ("--grpc-port", {"type": int, "default": 0}, "gRPC health/admin port (0: pick a free one)"),
    ("--advertise", {"default": ""}, "host name others use to reach this node (default: --host)"),
    ("--controller", {"action": "store_true"}, "also host the controller"),
    ("--join", {"metavar": "HOST:PORT[,...]"},
     "join the controller at HOST:PORT as a warehouse; with several controllers, any of them, or "
     "a comma-separated list of some (the first that answers gives the rest)"),
    ("--controllers", {"metavar": "HOST:PORT,..."},
     "with --controller: every controller of the dock, this one's address among them, the same "
     "list on each; partitions are spread over them (warehouses --join any one)"),
    ("--shards", {"metavar": "NAME=S[,NAME=S...]"},
     "with --controllers: spread partition NAME over S of the controllers (2 <= S <= their number), "
     "S ordinary partitions NAME~shard-k-of-S that clients put to and get from as one; the same "
     "on every controller (warehouses learn it when they join)"),
    ("--capacity", {"default": "8GiB"}, "bytes this warehouse holds before puts wait (default 8GiB)"),
    ("--device-capacity", {"default": "0"},
     "bytes of accelerator memory the device tier holds for put(device='keep'), all of this "
     "node's devices together (default 0: no device tier; such puts are stored in host memory)"),
    ("--lease-timeout", {"type": float, "default": 120.0, "metavar": "SECONDS"},
     "controller: how long a lease holds a consumer's samples before they are handed out again "
     "(default 120). get confirms on its own; samples whose lease expires unconfirmed, or whose "
     "client dies or releases them, go back to that consumer's pool. Per lease: "
     "acquire(lease_timeout=...), longer with dock.extend(lease)"),
    ("--no-shm", {"action": "store_true"}, "serve same-host clients over TCP only (no shared memory)"),
    ("--transport", {"choices": ["auto", "socket", "mooncake"], "default": "socket"},
     "how remote readers get stored bytes: socket (default: in the TCP stream), mooncake (read "
     "with the Mooncake Transfer Engine from registered memory; refuses to start without it), "
     "auto (mooncake where the engine starts, logged)"),
    ("--mooncake-protocol", {"choices": ["tcp", "rdma"], "default": "tcp"},
     "the Mooncake engine's protocol (default tcp; rdma needs RDMA NICs)"),
    ("--no-warehouse", {"action": "store_true"},
     "with --controller: run only the controller (no data on this node; it can restart without loss)"),
    ("--state-dir", {"metavar": "DIR"},
     "with --controller: journal the controller's state in DIR and recover it on restart (one "
     "controller per DIR: a second refuses to start)"),
    ("--data-dir", {"metavar": "DIR"},
     "with --join: write each stored put to a file in DIR before acknowledging it, so that a "
     "warehouse killed and restarted on the same DIR re-adopts its samples (tmpfs such as "
     "/dev/shm for speed; see docs/operations.md). One warehouse per DIR: a second refuses to "
     "start"),
    ("--drop-damaged-files", {"action": "store_true"},
     "with --data-dir: a stored file that fails its check (checksum, size, not a regular file) "
     "is moved to DIR/damaged and its samples are reported lost (DockDataLost), instead of "
     "refusing the start"),
    ("--spill-dir", {"metavar": "DIR"},
     "when --capacity is full, move stored puts nobody is reading to Arrow IPC files in DIR (least "
     "recently used first) and read them back on a fetch; puts fail with DockFull only once the "
     "spill space is full too (see docs/operations.md)"),
    ("--spill-capacity", {"default": "0", "metavar": "SIZE"},
     "with --spill-dir: bytes of spill files at most (default 0: the disk's free space less a "
     "margin of 1 GiB or 5%%)"),
    ("--join-timeout", {"type": float, "default": None, "metavar": "SECONDS"},
     "a warehouse waits this long for its controller at start (default: as long as it takes)"),
    ("--controller-grace", {"type": float, "default": 60.0, "metavar": "SECONDS"},
     "puts wait this long for an unreachable controller before failing (default 60)"),
    ("--commit-window", {"type": float, "default": 0.0, "metavar": "SECONDS"},
     "answer a put of new samples once it is stored, before its commit, and send the commits to the "
     "controller together every SECONDS (indexes come from blocks the controller grants ahead; it needs "
     "a --state-dir). Other clients see the samples up to SECONDS later; the writer sees its own at once. "
     "Default 0: every put is answered after its commit"),
    ("--token-file", {"metavar": "FILE"},
     "the dock's token (also $DOCKD_TOKEN_FILE): every connection must prove it; required to bind "
     "a non-loopback address"),
    ("--daemon-token-file", {"metavar": "FILE"},
     "the token daemons prove to each other (the same file on the controller and every warehouse on "
     "another host; never give it to clients). Without it only warehouses on the controller's host "
     "can join: the dock's token never proves the daemon role"),
    ("--insecure", {"action": "store_true"}, "allow a non-loopback address without a token (no authentication at all)"),
    ("--tls-cert", {"metavar": "FILE"},
     "serve TLS on the TCP port with this certificate (PEM; with --tls-key). Off by default; "
     "clients then need the CA (tls=, DOCKD_TLS_CA), and every daemon of the dock needs TLS"),
    ("--tls-key", {"metavar": "FILE"}, "the private key (PEM) of --tls-cert"),
    ("--tls-ca", {"metavar": "FILE"},
     "CA (PEM) this daemon checks the daemons it connects to (its controller) with "
     "(default: --tls-cert itself, for one self-signed certificate shared by the dock)"),
    ("--max-connections", {"type": int, "default": 4096}, "connections accepted at once (default 4096)"),
    ("--handshake-timeout", {"type": float, "default": 10.0, "metavar": "SECONDS"},
     "a new connection must authenticate within this (default 10)"),
    ("--stall-timeout", {"type": float, "default": 60.0, "metavar": "SECONDS"},
     "a frame may go this long without a byte before its connection is closed (default 60)"),
    ("--checkpoint-root", {"metavar": "DIR"},
     "controller: checkpoints are saved and loaded only below DIR (default: anywhere the "
     "daemon's user can write)"),
    ("--max-samples", {"type": int, "default": limits.MAX_DOCK_SAMPLES, "metavar": "N"},
     f"controller: samples of all partitions together (default {limits.MAX_DOCK_SAMPLES}; ~24 bytes "
     "of metadata each, 2 more per column and 8 per tag, and their consumers' state up to 16 more)"),
    ("--min-rate", {"default": "64KiB", "metavar": "BYTES"},
     "a frame taking over 10 s must average this many bytes a second (default 64KiB)"),
    ("--idle-timeout", {"type": float, "default": 3600.0, "metavar": "SECONDS"},
     "a client connection making no request is closed after this (default 3600; clients reconnect)"),
    ("--daemon-timeout", {"type": float, "default": 30.0, "metavar": "SECONDS"},
     "the controller waits this long for a warehouse's answer, e.g. to a clear (default 30)"),
    ("--heartbeat-interval", {"type": float, "default": 1.0, "metavar": "SECONDS"},
     "controller: a heartbeat to each warehouse this often (default 1)"),
    ("--heartbeat-timeout", {"type": float, "default": 5.0, "metavar": "SECONDS"},
     "controller: a warehouse that leaves a heartbeat unanswered this long is marked unresponsive "
     "until it answers again (default 5)"),
    ("--warehouse-grace", {"type": float, "default": 15.0, "metavar": "SECONDS"},
     "controller: a warehouse that dropped its connection has this long to rejoin (default 15)"),
    ("--replicas", {"type": int, "default": 1, "metavar": "N"},
     "controller: 2 keeps each put's values on two warehouses before the put is answered, so a "
     "warehouse lost for good loses nothing (default 1; give every controller the same N)"),
    ("--metrics-port", {"type": int, "default": None, "metavar": "PORT"},
     "serve Prometheus metrics at http://HOST:PORT/metrics (0: pick a free one; default: off)"),
    ("--metrics-host", {"default": "127.0.0.1"},
     "address the metrics endpoint binds (default 127.0.0.1; it needs no token)"),
    ("--log-level", {"dest": "serve_log_level", "default": None}, argparse.SUPPRESS),
    ("--log-format", {"dest": "serve_log_format", "choices": ("text", "json"), "default": None}, argparse.SUPPRESS),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dockd", description="dockd: a distributed transfer dock for RL post-training")
    p.add_argument("--version", action="version", version=f"dockd {__version__}")
    p.add_argument("--log-level", default=None,
                   help="DEBUG, INFO, WARNING or ERROR (default INFO for serve and demo, WARNING otherwise)")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="text (default) or json: one JSON object per line, with the key=value fields split out")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run a node daemon (a warehouse; --controller also hosts the controller)")
    for flag, kw, help_ in SERVE_OPTIONS:
        s.add_argument(flag, help=help_, **kw)
    s.set_defaults(fn=_serve)

    d = sub.add_parser("demo", help="start a local dock and run a synthetic GRPO pipeline through it")
    d.add_argument("--steps", type=int, default=12)
    d.add_argument("--prompts", type=int, default=32, help="prompts per step")
    d.add_argument("--group-size", type=int, default=8, help="responses per prompt")
    d.add_argument("--warehouses", type=int, default=2)
    d.set_defaults(fn=_demo)

    def client_args(q: argparse.ArgumentParser) -> None:
        q.add_argument("address", help="the controller's host:port (a warehouse's works too)")
        q.add_argument("--token-file", metavar="FILE", help="the dock's token (default: $DOCKD_TOKEN_FILE)")
        q.add_argument("--tls-ca", metavar="FILE",
                       help="CA (PEM) of a dock whose daemons run with --tls-cert (default: $DOCKD_TLS_CA)")
        q.add_argument("--connect-timeout", type=float, default=5.0, metavar="SECONDS",
                       help="how long to wait for the dock (default 5)")

    st = sub.add_parser("stats", help="print a dock's stats as JSON")
    client_args(st)
    st.set_defaults(fn=_stats)

    sv = sub.add_parser("status", help="a dock at a glance: warehouses, traffic, each consumer's progress")
    client_args(sv)
    sv.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    sv.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                    help="seconds between snapshots; traffic rates are measured over it (default 1; 0: no rates)")
    sv.add_argument("--json", action="store_true", help="print JSON (one object per snapshot) instead of the view")
    sv.set_defaults(fn=_status)

    cl = sub.add_parser("clear", help="free a partition's data on every warehouse and forget it")
    client_args(cl)
    cl.add_argument("partition", help="the partition to clear")
    cl.set_defaults(fn=_clear)

    b = sub.add_parser("bench", help="run the sample-flow benchmarks (from a source checkout); --help for theirs",
                       add_help=False)
    b.set_defaults(fn=_bench, rest=[])
    return p


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if args.cmd == "bench":
        args.rest = extra  # everything after `bench` belongs to the benchmark runner
    elif extra:
        build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    level = getattr(args, "serve_log_level", None) or args.log_level
    _setup_logging(level or ("INFO" if args.cmd in ("serve", "demo") else "WARNING"),
                   getattr(args, "serve_log_format", None) or args.log_format)
    try:
        return args.fn(args)
    except DockError as e:
        print(f"dockd: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
