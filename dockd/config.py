"""Typed configuration, validated in one place, and the environment variables dockd reads."""

from __future__ import annotations

import dataclasses
import os
import re

from dockd import limits, owners
from dockd.errors import DockValueError
from dockd.owners import is_loopback

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1000, "KIB": 1 << 10, "M": 1 << 20, "MB": 1000**2, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1000**3, "GIB": 1 << 30, "T": 1 << 40, "TB": 1000**4, "TIB": 1 << 40}

#: Environment variables read by dockd (all optional).
ENV_VARS = {
    "DOCKD_WAREHOUSE": "warehouse a client writes to: an id or host:port (default: one on this host)",
    "DOCKD_CONNECT_TIMEOUT": "seconds a client waits to connect to a daemon (default 10)",
    "DOCKD_RECONNECT_TIMEOUT": "seconds a client keeps retrying a daemon that went away before it gives up (default 30)",
    "DOCKD_FETCH_TIMEOUT": "seconds a get without a timeout (and fetch, read) waits for a warehouse to answer before "
                           "DockTimeout (default 60)",
    "DOCKD_TRANSPORT": "'auto' (default: shared memory to same-host daemons, Mooncake where the warehouse runs its "
                       "engine and the package is installed, TCP otherwise), 'tcp', or 'mooncake' (required: reads "
                       "from a warehouse that cannot use it raise)",
    "DOCKD_SPIN_US": "the most microseconds a same-host client call polls for its reply before sleeping; it polls about "
                     "1.5x as long as that kind of request's replies take, and not at all where they take longer "
                     "(default 1000; 0: never)",
    "DOCKD_COMMIT_BATCH": "warehouse daemons: 0 sends every commit to the controller alone, as its own message (default 1: "
                          "the commits of puts read together go as one message; 0 is the baseline of "
                          "benchmarks.commit_batch)",
    "DOCKD_COMMITS_IN_FLIGHT": "warehouse daemons: commit messages on their way to the controller at once (default 1: "
                               "commits made while one is unanswered go together with its answer; 0: no bound)",
    "DOCKD_RECV_POOL_BYTES": "bytes of warm receive buffers a client keeps for large socket replies (default 1 GiB)",
    "DOCKD_KEEP_MAPPINGS": "bytes of same-host reply mappings a client process keeps (over all its docks) once their "
                           "values are gone, to map the segments a streaming consumer is passed again without page "
                           "faults; each goes after 1 s unused, at close, or least recently used first (default "
                           "64 MiB; 0: none, every mapping unmapped once its values are gone). Its RSS counts them, "
                           "and a segment the warehouse closed meanwhile stays in memory until they go",
    "DOCKD_DEVICE_LINK_TIMEOUT": "seconds a device link's join or transfer may take before it is aborted (default 60)",
    "DOCKD_TOKEN": "the dock's token, for clients (prefer DOCKD_TOKEN_FILE)",
    "DOCKD_TOKEN_FILE": "file holding the dock's token: clients prove it; `dockd serve` uses it like --token-file",
    "DOCKD_TLS_CA": "CA file (PEM) a client checks TLS daemons' certificates with; set: TCP connections use TLS "
                    "(daemons started with --tls-cert)",
    "DOCKD_DAEMON_SECRET": "hex per-dock daemon secret handed by start_local to the daemons it starts (tokenless mode)",
    "DOCKD_CPU_DEVICE_TIER": "1: run the device tier's paths on CPU through shared host memory (tests, no accelerator)",
    "DOCKD_NCCL_LIB": "path of the libnccl.so.2 the device bindings load (default: the nvidia-nccl wheel, then the system)",
    "DOCKD_HCCL_LIB": "path of the libhccl.so the device bindings load on Ascend NPUs",
    "DOCKD_ADDRESS": "plugins: the dock's controller address (host:port) when none is passed",
    "DOCKD_OPENRLHF_CONFIG": "OpenRLHF plugin: JSON of the replay buffer's dock settings, for Ray workers",
    "DOCKD_TRANSFER_QUEUE": "verl plugin: 1 makes `import transfer_queue` load dockd's switch in Ray workers",
    "DOCKD_METRICS_ENDPOINT": "verl plugin: the dock's Prometheus endpoint the transfer_queue switch reports",
    "DOCKD_BENCH_LOG": "benchmarks: log level of the scenario processes (default INFO)",
    "DOCKD_BENCH_DELTA_OUT": "benchmarks.weights: the file the delta-fraction hook of examples/grpo_tiny.py appends to",
}

#: Variables of other software that dockd reads (never sets for itself); `env` accepts these too.
FOREIGN_ENV = {
    "XDG_RUNTIME_DIR": "per-user runtime directory; a tokenless controller keeps its daemon secret below it "
                       "(default /tmp)",
    "LD_LIBRARY_PATH": "device bindings: directories searched for libnccl.so.2 / libhccl.so after the wheels",
    "ASCEND_HOME_PATH": "device bindings: the CANN toolkit (set by its set_env.sh); lib64/libhccl.so is tried",
    "ASCEND_TOOLKIT_HOME": "device bindings: the CANN toolkit, tried after ASCEND_HOME_PATH",
    "ASCEND_RT_VISIBLE_DEVICES": "device tier: the NPUs visible to this process (maps local to physical ids)",
    "TQ_CONTROLLER_GET_METADATA_TIMEOUT": "verl plugin: seconds transfer_queue's get_meta waits for samples "
                                          "(TransferQueue's own variable; default 1)",
    "ARROW_DEFAULT_MEMORY_POOL": "pyarrow's allocator (mimalloc, jemalloc, system); set for a daemon, it serves all of "
                                 "the warehouse's private memory (default: values of 64 KiB and more from jemalloc)",
}


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def parse_size(text: str | int) -> int:
    """'8GiB', '512M', '1e9' or an int -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise DockValueError(f"cannot parse size {text!r}; use e.g. 8GiB, 512MiB, 1G or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def env(name: str, default: str = "") -> str:
    """A registered environment variable (ENV_VARS or FOREIGN_ENV), read now (never cached at import);
    `default` when it is unset or empty. dockd reads the environment only through this."""
    if name not in ENV_VARS and name not in FOREIGN_ENV:
        raise KeyError(f"{name} is not a registered environment variable (add it to dockd.config.ENV_VARS, "
                       "or to FOREIGN_ENV for another program's variable)")
    return os.environ.get(name) or default


def env_float(name: str, default: float) -> float:
    raw = env(name)
    if raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise DockValueError(f"environment variable {name}={raw!r} is not a number") from None


def env_amount(name: str, default: float, what: str) -> float:
    """A registered variable holding a finite amount >= 0 (`what` says of what, for the refusal)."""
    value = env_float(name, default)
    if not 0 <= value < float("inf"):  # (NaN fails it too)
        raise DockValueError(f"environment variable {name}={env(name)!r}: give a finite number of {what}, 0 or more "
                             "(unset it for the default)")
    return value


def commits_in_flight() -> int:
    """Commit messages a link keeps on their way to the controller at once (DOCKD_COMMITS_IN_FLIGHT, default
    1). While that many are unanswered, new commits wait and go together with the next answer: a window that
    the controller's own round trip times, so the busier the controller, the more commits each message
    carries, and an idle one sees no wait at all. 0: no bound, every turn's batch goes at once."""
    n = env_float("DOCKD_COMMITS_IN_FLIGHT", 1)
    if not 0 <= n < 1e6 or n != int(n):  # (NaN and inf fail the first)
        raise DockValueError(f"DOCKD_COMMITS_IN_FLIGHT={n:g}: give a whole number of commit messages, 1 or more "
                             "(0: no bound)")
    return int(n)


MAX_SIZE = (1 << 63) - 1
"""The largest size (bytes) a daemon's option may give: sizes travel as 64-bit ints."""

#: What a client's `transport` setting may be (dockd.net.transport): tried in order under "auto".
CLIENT_TRANSPORTS = ("auto", "tcp", "mooncake")
#: How a daemon serves remote readers (`dockd serve --transport`, dockd.net.mooncake).
SERVE_TRANSPORTS = ("auto", "socket", "mooncake")


def client_transport(value: str) -> str:
    """A client's `transport` setting, checked (dockd.connect(transport=...), DOCKD_TRANSPORT)."""
    if value not in CLIENT_TRANSPORTS:
        raise DockValueError(f"transport {value!r}: use one of {', '.join(CLIENT_TRANSPORTS)}")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ClientConfig:
    """A client's settings from the environment (see ENV_VARS); arguments to `dockd.connect` override them."""

    warehouse: str = ""
    connect_timeout: float = 10.0
    reconnect_timeout: float = 30.0
    fetch_timeout: float = 60.0
    transport: str = "auto"
    spin_s: float = 1e-3
    recv_pool_bytes: int = 1 << 30
    keep_mappings: int = 64 << 20
    tls: str = ""
    """CA file (PEM) to check the daemons' TLS certificates with; "": TCP without TLS."""

    @classmethod
    def from_env(cls) -> ClientConfig:
        transport = env("DOCKD_TRANSPORT", "auto")
        if transport not in CLIENT_TRANSPORTS:
            raise DockValueError(f"DOCKD_TRANSPORT={transport!r}: use 'auto', 'tcp' or 'mooncake'")
        return cls(
            warehouse=env("DOCKD_WAREHOUSE"),
            connect_timeout=env_float("DOCKD_CONNECT_TIMEOUT", 10.0),
            reconnect_timeout=env_float("DOCKD_RECONNECT_TIMEOUT", 30.0),
            fetch_timeout=env_float("DOCKD_FETCH_TIMEOUT", 60.0),
            transport=transport,
            spin_s=env_amount("DOCKD_SPIN_US", 1000.0, "microseconds") / 1e6,
            recv_pool_bytes=int(env_amount("DOCKD_RECV_POOL_BYTES", float(1 << 30), "bytes")),
            keep_mappings=int(env_amount("DOCKD_KEEP_MAPPINGS", float(64 << 20), "bytes")),
            tls=env("DOCKD_TLS_CA"),
        )


def shards_need(controller: bool, controllers: tuple[str, ...]) -> None:
    """--shards is the controllers' (all of them, the same): refuse it on a node that is not one of several."""
    if not controller:
        raise DockValueError("--shards goes with --controller: a warehouse learns the dock's spread partitions from "
                             "the controller it joins; drop --shards here and give it to every controller")
    if not controllers:
        raise DockValueError("--shards spreads a partition over several controllers: give every controller "
                             "--controllers HOST:PORT,... (at least as many as the largest shard count) and the "
                             "same --shards")


@dataclasses.dataclass(kw_only=True, slots=True)
class NodeConfig:
    host: str = "127.0.0.1"
    """Address to bind. Anything but loopback exposes the dock to the network."""
    port: int = 0
    """Framed data port; 0 picks a free one (printed in the ready line)."""
    grpc_port: int = 0
    """gRPC health/admin port; 0 picks a free one."""
    advertise: str = ""
    """Host name other nodes and clients use to reach this one (default: host)."""
    controller: bool = False
    """Also host the controller."""
    warehouse: bool = True
    """Host a warehouse (only a controller may run without one: --no-warehouse)."""
    join: str = ""
    """host:port of the controller to join as a warehouse (required without controller); with several
    controllers, a comma-separated list of some of them: the first that answers names them all."""
    controllers: tuple[str, ...] = ()
    """Controller: every controller's host:port, this one's among them, the same list on each
    (several controllers share the metadata: dockd.owners); empty: this is the dock's only one."""
    shards: dict[str, int] = dataclasses.field(default_factory=dict)
    """Controller with controllers: partitions spread over several controllers (--shards NAME=S): each is S
    ordinary partitions, its shards (dockd.owners.shard_name), on S different controllers; the same on every
    controller. A request naming NAME itself is refused (clients spread it). Warehouses learn it at join."""
    capacity: int = 8 << 30
    """Bytes this warehouse holds before puts wait (backpressure)."""
    device_capacity: int = 0
    """Bytes of device memory the device tier holds (put(device="keep")); 0: no device tier."""
    lease_timeout: float = 120.0
    """Seconds an acquired sample stays leased without a confirmed fetch."""
    max_frame: int = 1 << 36
    """Largest frame body accepted, in bytes."""
    join_timeout: float | None = None
    """Seconds a warehouse waits for its controller at start (None: as long as it takes)."""
    controller_grace: float = 60.0
    """Seconds a put waits for an unreachable controller before it fails (the warehouse keeps retrying)."""
    commit_window: float = 0.0
    """Seconds the commits of puts answered before their commit wait to go to the controller together
    (0: every put is answered after its commit). See docs/design.md, "Puts answered before their commit"."""
    warehouse_grace: float = 15.0
    """Controller: seconds a warehouse whose connection dropped has to rejoin before its samples are lost."""
    state_dir: str = ""
    """Controller: journal its state here and recover it on restart (empty: keep nothing)."""
    replicas: int = 1
    """Controller: 2 keeps each put's values on two warehouses (the one it was put to, and a copy on the next
    one) before the put is answered, so a warehouse lost for good loses nothing; 1: one warehouse."""
    data_dir: str = ""
    """Warehouse (--join): keep every stored put in a file here before it is acknowledged, and re-adopt
    them when restarted on the same dir (empty: stored data lives only in this process)."""
    drop_damaged_files: bool = False
    """With data_dir: a stored file that fails its check is moved aside (DIR/damaged) and its samples are
    reported lost, instead of refusing the start."""
    spill_dir: str = ""
    """Warehouse: when host memory (--capacity) is full, move stored puts nobody is reading to Arrow IPC
    files here, least recently used first, and read them back on a fetch (empty: puts wait for room)."""
    spill_capacity: int = 0
    """Bytes of spill files at most (0: the filesystem's free space less a margin)."""
    shm: bool = True
    """Serve same-host clients over a Unix socket with shared-memory payloads (Linux)."""
    transport: str = "socket"
    """How remote readers get stored bytes: "socket" (in the frames' bodies over TCP), "mooncake" (read with
    their Mooncake Transfer Engine from registered segments; the daemon refuses to start without one) or
    "auto" (Mooncake where the engine starts). See dockd.net.mooncake."""
    mooncake_protocol: str = "tcp"
    """The Mooncake engine's protocol: "tcp", or "rdma" on nodes with RDMA NICs."""
    token_file: str = ""
    """File holding the dock's token: every connection must prove it (challenge-response)."""
    daemon_token_file: str = ""
    """File holding the token daemons prove to each other; clients never hold it. Without it the
    controller draws a per-dock secret that only warehouses on its own host can read."""
    insecure: bool = False
    """Allow binding a non-loopback address without a token (no authentication at all)."""
    max_connections: int = 4096
    """Connections this daemon accepts at once; more are refused."""
    handshake_timeout: float = 10.0
    """Seconds a new connection has to authenticate."""
    stall_timeout: float = 60.0
    """Seconds a frame may go without a byte before its connection is closed."""
    min_rate: int = 64 << 10
    """Bytes a second a frame must average once it has taken 10 s (a put trickled in slower holds its
    admitted capacity from everyone else); its connection is closed below that."""
    checkpoint_root: str = ""
    """Controller: checkpoints (dock.save / dock.load) are written and read only below this directory
    (empty: anywhere the daemons' user can write; set it when clients are not all trusted alike)."""
    max_samples: int = limits.MAX_DOCK_SAMPLES
    """Controller: samples of all partitions together (the controller keeps ~24 bytes of metadata each);
    puts of new samples past it fail with DockFull."""
    idle_timeout: float = 3600.0
    """Seconds a client connection may make no request before it is closed (clients reconnect)."""
    daemon_timeout: float = 30.0
    """Seconds the controller waits for a warehouse to answer (e.g. to free a cleared partition)."""
    heartbeat_interval: float = 1.0
    """Controller: seconds between heartbeats (a Hello over its link) to each connected warehouse."""
    heartbeat_timeout: float = 5.0
    """Controller: seconds a warehouse may leave a heartbeat unanswered before it is marked
    `unresponsive` (its connection open, the process stopped or hung): clients then stop choosing it
    for puts and gets of its samples fail at once with DockTimeout; its first answer makes it
    `joined` again, with nothing lost."""
    metrics_port: int | None = None
    """Serve Prometheus metrics over HTTP on this port (0 picks a free one; None: off)."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint binds (it needs no token: keep it off untrusted networks)."""
    tls_cert: str = ""
    """Certificate (PEM) this daemon serves TLS with on its TCP port (with tls_key; "": no TLS)."""
    tls_key: str = ""
    """Private key (PEM) of tls_cert."""
    tls_ca: str = ""
    """CA file (PEM) this daemon checks other daemons' certificates with when it connects to them
    (its controller); "": tls_cert itself (one self-signed certificate for the whole dock)."""

    @property
    def join_addresses(self) -> list[str]:
        """The controllers --join names, in order (the first names the dock in a data dir without a token)."""
        return [a.strip() for a in self.join.split(",") if a.strip()]

    def __post_init__(self) -> None:
        if self.warehouse and self.join:
            commits_in_flight()  # (checked at start: the warehouse's links read it when they are made)
        if self.transport not in SERVE_TRANSPORTS:
            raise DockValueError(f"--transport {self.transport!r}: use one of {', '.join(SERVE_TRANSPORTS)}")
        if self.transport == "mooncake" and not self.shm:
            raise DockValueError("--transport mooncake serves reads from the shared-memory segments it registers "
                                 "with the engine; drop --no-shm")
        if self.mooncake_protocol not in ("tcp", "rdma"):
            raise DockValueError(f"--mooncake-protocol {self.mooncake_protocol!r}: use 'tcp' or 'rdma'")
        if self.controller == bool(self.join):
            raise DockValueError(
                "a node either hosts the controller (--controller) or joins one (--join HOST:PORT), exactly one of the two"
            )
        if self.join and not all(re.fullmatch(r".+:\d+", a) for a in self.join_addresses):
            raise DockValueError(f"--join expects HOST:PORT (or several, comma-separated), got {self.join!r}")
        for address in self.join_addresses if self.port else ():
            if owners.names_this_node(address, self.host, self.port, self.advertise):
                raise DockValueError(f"--join {address} is this warehouse's own address (--port {self.port}): give "
                                     "the controller's HOST:PORT, the port its ready line prints")
        if ":" in self.advertise.strip("[]") and not _is_ip(self.advertise):
            raise DockValueError(f"--advertise {self.advertise!r}: give the host name or address others reach this "
                                 "node by, without a port (they use --port with it)")
        if not 0 <= self.port < 65536 or not 0 <= self.grpc_port < 65536:
            raise DockValueError(f"ports must be in 0..65535, got {self.port} and {self.grpc_port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise DockValueError(f"--metrics-port must be in 0..65535, got {self.metrics_port}")
        self._check_numbers()
        if not self.warehouse and not self.controller:
            raise DockValueError("--no-warehouse needs --controller: a node without a warehouse only runs the controller")
        if self.controllers:
            if not self.controller:
                raise DockValueError("--controllers goes with --controller (warehouses --join any one of them)")
            if self.port == 0:
                raise DockValueError("--controllers needs a fixed --port: the other daemons find this controller "
                                     "at the address the list gives")
            owners.own_index(self.controllers, self.host, self.port, self.advertise)
        if self.shards:
            shards_need(self.controller, self.controllers)
            owners.check_shards(self.shards, len(self.controllers))
        if self.replicas not in (1, 2):
            raise DockValueError(f"--replicas is 1 or 2 (warehouses holding each value), got {self.replicas}")
        if self.replicas != 1 and not self.controller:
            raise DockValueError("--replicas is the controller's (dock-wide); give it with --controller")
        if self.state_dir and not self.controller:
            raise DockValueError("--state-dir is the controller's journal; give it with --controller")
        if self.drop_damaged_files and not self.data_dir:
            raise DockValueError("--drop-damaged-files goes with --data-dir (it is about that dir's files)")
        if self.data_dir and not self.join:
            raise DockValueError("--data-dir keeps a joining warehouse's data across restarts; give it with --join "
                                 "(the controller's own warehouse restarts with the controller: not supported)")
        if self.spill_capacity and not self.spill_dir:
            raise DockValueError("--spill-capacity goes with --spill-dir")
        if self.spill_dir and not self.warehouse:
            raise DockValueError("--spill-dir is a warehouse's; drop it with --no-warehouse")
        self._check_commit_window()
        if self.data_dir and self.device_capacity:
            raise DockValueError("--data-dir does not keep the device tier's bytes; drop --device-capacity, or "
                                 "--data-dir")
        if self.daemon_token_file and not self.token_file:
            raise DockValueError("--daemon-token-file goes with --token-file (clients need a token of their own)")
        if not self.token_file and not self.insecure and not is_loopback(self.host):
            raise DockValueError(
                f"binding {self.host} exposes the dock beyond this host: give it a token (--token-file FILE, the "
                "same file on every node; e.g. `openssl rand -hex 32 > FILE`), or pass --insecure to run without "
                "authentication on a network you trust"
            )
        if bool(self.tls_cert) != bool(self.tls_key) or (self.tls_ca and not self.tls_cert):
            raise DockValueError("TLS needs --tls-cert and --tls-key together (and --tls-ca only with them)")

    def _check_numbers(self) -> None:
        """Sizes, counts and seconds: in range, and a number (a NaN fails every `> 0`)."""
        if self.capacity <= 0:
            raise DockValueError(f"capacity must be > 0 bytes, got {self.capacity}")
        for flag, size in (("--capacity", self.capacity), ("--device-capacity", self.device_capacity),
                           ("--spill-capacity", self.spill_capacity), ("--min-rate", self.min_rate)):
            if size > MAX_SIZE:
                raise DockValueError(f"{flag} {size} is past the {MAX_SIZE} bytes (8 EiB) a size may be; give the "
                                     "bytes this node really has")
        if self.device_capacity < 0:
            raise DockValueError(f"--device-capacity must be >= 0 bytes (0: no device tier), got {self.device_capacity}")
        if not self.lease_timeout > 0:  # (NaN fails it too, as in the other timeouts)
            raise DockValueError(f"lease timeout must be > 0 seconds, got {self.lease_timeout}")
        if self.max_samples < 1:
            raise DockValueError(f"--max-samples must be 1 or more (every put of new samples would fail with "
                                 f"DockFull), got {self.max_samples}")
        if self.spill_capacity < 0:
            raise DockValueError(f"--spill-capacity must be >= 0 bytes (0: up to the disk's free space), got "
                                 f"{self.spill_capacity}")
        for name in ("controller_grace", "warehouse_grace", "handshake_timeout", "stall_timeout", "idle_timeout",
                     "daemon_timeout", "heartbeat_interval", "heartbeat_timeout"):
            if not getattr(self, name) > 0:
                raise DockValueError(f"{name.replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_connections < 8:
            raise DockValueError(f"max connections must be >= 8, got {self.max_connections}")
        if self.join_timeout is not None and not self.join_timeout > 0:
            raise DockValueError(f"join timeout must be > 0 seconds, got {self.join_timeout}")

    def _check_commit_window(self) -> None:
        if not 0 <= self.commit_window <= 10:  # (NaN fails it too)
            raise DockValueError(f"--commit-window must be between 0 and 10 seconds (0: off), got {self.commit_window}")
        if self.commit_window and not self.warehouse:
            raise DockValueError("--commit-window is a warehouse's; drop it with --no-warehouse")
