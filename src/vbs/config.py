"""Configuration: one TOML file per node (``vbs.toml``), overridable by ``VBS_*`` env vars and flags.

Each service reads its own section (``[controller]``, ``[storage_agent]``, ``[host_agent]``).
A key ``port`` of section ``controller`` is overridden by ``VBS_CONTROLLER_PORT``, then by a flag.
The shared secret between controller and agents may also come from ``VBS_AGENT_TOKEN``, so that it
never has to appear on a command line.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from vbs.errors import InvalidParameter
from vbs.net import endpoints
from vbs.net.endpoints import DEFAULT_CONTROLLER_PORT as DEFAULT_CONTROLLER_PORT  # still vbs.config's too
from vbs.wire.connection import IQN_RE
from vbs.wire.storage import MAX_POOLS, POOL_NAME_RE, ZONE_NAME_RE

DRIVER_NAME_RE = r"^[a-z0-9][a-z0-9_-]{0,31}$"


class _Section(BaseModel):
    # An error names the key, never the value given: a URL may carry a password.
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)


class _Service(_Section):
    """What every service has: its TLS files (mutual TLS between services) and the explicit opt-out.

    ``tls_cert``/``tls_key`` are this service's certificate (server and client); ``tls_ca`` is the
    CA its peers' certificates must chain to. ``insecure`` lets a service run without credentials
    or TLS, and it says so on every start."""

    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    insecure: bool = False


class ControllerConfig(_Service):
    host: str = "127.0.0.1"
    port: int = Field(DEFAULT_CONTROLLER_PORT, ge=1, le=65535)
    data_dir: Path = Path("./var")
    # None: SQLite in data_dir. A URL with a password belongs in database_url_file (0600), not on a
    # command line (other users see argv) nor in a log (vbs.controller.db.session.redact).
    database_url: str | None = None
    database_url_file: Path | None = None
    deleted_retention_s: int = Field(3600, ge=0)
    heartbeat_timeout_s: float = Field(30.0, gt=0)
    # attach-volume warns when the host's measured RTT to the volume's storage node exceeds this.
    rtt_warn_ms: float = Field(2.0, ge=0)
    # A table of throughput and IOPS against RTT per protocol (bench/rtt.py --calibration-out): the
    # advice's model uses it where it has one (vbs.controller.placement.rtt_model).
    rtt_calibration_file: Path | None = None
    workflow_threads: int = Field(16, ge=1, le=256)
    # Instance-id resolvers: attach-volume --instance SCHEME:ID, each scheme mapped to a resolver
    # plug-in ("DRIVER" or "DRIVER:ARGUMENT"; vbs.controller.resolvers).
    resolvers: dict[str, str] = Field(default_factory=lambda: {"nova": "libvirt-metadata"}, max_length=32)
    resolver_profile_dirs: list[Path] = Field(default_factory=lambda: [Path("/etc/vbs/profiles")])
    max_volume_gib: int = Field(16384, ge=1)
    overcommit_ratio: float = Field(4.0, gt=0, le=1000)
    retry_interval_s: float = Field(2.0, gt=0)
    # A step (or an undo) that keeps failing is retried with back-off this long at most; then its
    # operation ends failed, with the resource in a stable state and the reason (never stuck).
    give_up_after_s: float = Field(600.0, gt=0)
    operation_retention_s: int = Field(7 * 86400, ge=0)
    detach_timeout_s: float = Field(10.0, gt=0, le=600)
    reconcile_interval_s: float = Field(30.0, gt=0)
    orphan_grace_s: float = Field(120.0, ge=0)
    # Public API keys: these, VBS_ACCESS_KEY_ID/VBS_SECRET_ACCESS_KEY, and every profile of the
    # credentials file (default: <data_dir>/credentials, if it exists).
    access_keys: list[dict[str, str]] = Field(default_factory=list)
    credentials_file: Path | None = None
    # Seals the secrets of keys made by `vbs create-key` (default: <data_dir>/master.key, made on first use).
    master_key_file: Path | None = None
    # Per-tenant limits (VolumeLimitExceeded / SnapshotLimitExceeded); operators and benchmarks raise them.
    quota_volumes: int = Field(5000, ge=0, le=10_000_000)
    quota_gib: int = Field(1_048_576, ge=0, le=1 << 40)
    quota_snapshots: int = Field(10000, ge=0, le=10_000_000)
    region: str = Field("us-east-1", pattern=r"^[a-z0-9-]{1,32}$")
    # The zone of every storage node that names none (older agents too): the region's first zone.
    availability_zone: str = Field("us-east-1a", pattern=ZONE_NAME_RE)
    # Several controllers on one PostgreSQL database (docs/scale-out.md): each has its own id (default:
    # <hostname>-<port>) and URL; an operation whose controller stops renewing its lease for this long
    # is adopted by another one.
    controller_id: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    advertise_url: str | None = Field(None, pattern=r"^https?://[A-Za-z0-9._:\[\]-]{1,200}/?$")
    operation_lease_s: float = Field(15.0, ge=1, le=600)
    # Enforce a volume type's nominal limits (gp3: 3,000 IOPS and 125 MiB/s) where a volume has none of
    # its own; limits a user gave are enforced always. Off: an unlimited volume is as fast as the node.
    enforce_type_limits: bool = False
    # Requests in progress at once (then 503 RequestLimitExceeded), each budget on its own: per client
    # address, per access key, per tenant, and per agent node (heartbeats share nothing with users).
    max_requests_per_address: int = Field(128, ge=1, le=100_000)
    max_requests_per_key: int = Field(64, ge=1, le=100_000)
    max_requests_per_tenant: int = Field(96, ge=1, le=100_000)
    max_requests_per_node: int = Field(16, ge=1, le=100_000)
    # A request body must arrive at body_min_rate bytes a second at least once body_grace_s have
    # passed (then 408): a body trickled a byte at a time holds its slot for seconds, not minutes.
    # The grace is the idle bound's 10 s: a client on a loaded machine may send its head and its
    # body seconds apart, and that is not an attack (Apache's mod_reqtimeout allows 20 s).
    body_min_rate: float = Field(1024.0, ge=0, le=1 << 30)
    body_grace_s: float = Field(10.0, gt=0, le=30)
    # Reverse proxies whose X-Forwarded-For/X-Forwarded-Proto are believed (addresses or networks,
    # e.g. ["10.0.0.5"]); none by default, not even loopback (docs/security.md, "Behind a proxy").
    trusted_proxies: list[str] = Field(default_factory=list, max_length=64)
    # The longest lifetime (X-Amz-Expires) a presigned EC2 URL may claim: one hour by default, at most
    # AWS's own week. A URL that claims more is refused, whenever it is used.
    presigned_url_max_s: int = Field(3600, ge=1, le=7 * 24 * 3600)
    # EBS direct APIs: how long a block token of ListSnapshotBlocks / ListChangedBlocks is good for, and how
    # many snapshots a tenant may have pending (started, not completed) at once.
    ebs_block_token_ttl_s: int = Field(24 * 3600, ge=1, le=7 * 24 * 3600)
    ebs_pending_snapshots_max: int = Field(100, ge=1, le=10_000)
    # How long one "day" of a Recycle Bin retention period or rule unlock delay lasts: a day, or less for
    # a test or a demo only (docs/recycle-bin.md).
    recycle_bin_day_s: int = Field(86400, ge=1, le=86400)
    # Data Lifecycle Manager (docs/lifecycle-policies.md): how often each controller looks for due runs of
    # the snapshot policies, and how many policies a tenant may have.
    lifecycle_poll_s: float = Field(10.0, ge=0.5, le=300)
    lifecycle_policies_max: int = Field(100, ge=1, le=10_000)

    @field_validator("trusted_proxies", mode="before")
    @classmethod
    def _proxies(cls, v: Any) -> Any:
        items = [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else v
        if isinstance(items, list):
            for item in items:
                try:
                    ipaddress.ip_network(str(item), strict=False)
                except ValueError:
                    raise ValueError(f"trusted_proxies: {str(item)[:64]!r} is not an IP address or network") from None
        return items


# A libvirt connection URI (driver[+transport]://[user@][host[:port]]/path[?params]).
LIBVIRT_URI_RE = r"^[a-z][a-z0-9]{0,15}(\+[a-z]{1,8})?://[A-Za-z0-9._@:\[\]-]{0,255}/[A-Za-z0-9._/=&?,:%-]{0,512}$"
CEPH_USER_RE = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
RBD_POOL_RE = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"


class _AgentSection(_Service):
    """What every agent has: where it listens, its node name, its controllers and its own token.
    Settings of drivers that are not VBS's own go in ``options.<driver name>``."""

    host: str = "127.0.0.1"
    # The install's controllers: one URL, a TOML list, or (env, flag) URLs separated by commas. The
    # agent reports to one at a time and moves on to the next when it fails (vbs.net.web.ApiClient).
    controller_url: tuple[str, ...] = (f"http://127.0.0.1:{DEFAULT_CONTROLLER_PORT}",)
    advertise_url: str | None = None
    # This node's own credential (``vbs node-token`` on the controller's machine prints it): from
    # VBS_AGENT_TOKEN, or better a 0600 file the agent re-reads when it changes (rotation).
    agent_token: str | None = None
    agent_token_file: Path | None = None
    options: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @field_validator("controller_url", mode="before")
    @classmethod
    def _controller_urls(cls, v: Any) -> tuple[str, ...]:
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list | tuple) or not all(isinstance(u, str) for u in items):
            raise ValueError("controller_url is a URL or a list of URLs")
        try:
            return endpoints.parse(items, what="controller_url")
        except InvalidParameter as exc:
            raise ValueError(exc.message) from None


class PoolConfig(_Section):
    """One pool an agent serves: its name (unique on the node) and where its data lives."""

    name: str = Field(pattern=POOL_NAME_RE)
    path: Path

    @classmethod
    def parse(cls, spec: str) -> PoolConfig:
        """``NAME=PATH``, as ``--pool`` and ``VBS_STORAGE_AGENT_POOLS`` give it."""
        name, sep, path = spec.partition("=")
        if not sep or not re.fullmatch(POOL_NAME_RE, name) or not path:
            raise ValueError(f"pool {spec[:80]!r} must be NAME=PATH, NAME of 1-63 characters a-z, 0-9, _ and - "
                             "(starting with a letter or digit)")
        return cls(name=name, path=Path(path))


# Where a storage agent's snapshots go, as ``--snapshot-store`` and ``vbs up`` take it: S3's bucket rules
# (the s3 driver checks them again, with the rest of its settings).
S3_BUCKET_RE = r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]"
S3_PREFIX_RE = r"([A-Za-z0-9][A-Za-z0-9._-]{0,127}/?){0,8}"
NO_SNAPSHOT_STORE = "none"


class SnapshotStoreConfig(_Section):
    """``[storage_agent.snapshot_store]``: the snapshot store's driver by name (``dir``, ``s3``, a plug-in's,
    or ``none``: snapshots stay in their pool only) and the driver's own settings beside it (``path``;
    ``bucket``, ``prefix``, ``endpoint_url``, ``region``, ``credentials_file`` …), which the driver
    validates when the agent starts (docs/snapshots.md). Default: a ``dir`` store in
    ``<state_dir>/snapshots``; ``vbs up`` gives its storage agents one in ``<data-dir>/snapshots``."""

    model_config = ConfigDict(extra="allow", hide_input_in_errors=True)

    driver: str = Field("dir", pattern=DRIVER_NAME_RE)
    # Garbage collection (docs/snapshots.md): at most one run per interval among the agents sharing the
    # store (0: never), deleting the chunks nothing claims once older than the grace period.
    gc_interval_s: float = Field(86400.0, ge=0, le=366 * 86400)
    gc_grace_s: float = Field(86400.0, ge=0, le=366 * 86400)

    def options(self) -> dict[str, Any]:
        """The driver's settings: everything but ``driver`` and the garbage collection's."""
        return dict(self.model_extra or {})


class ArchiveStoreConfig(SnapshotStoreConfig):
    """``[storage_agent.archive_store]``: a separate store archived snapshots move to (docs/snapshot-tiers.md),
    set as the snapshot store is (``driver`` and the driver's settings; ``--archive-store``), collected by the
    same garbage collection. Default ``none``: archived snapshots stay in the snapshot store."""

    driver: str = Field(NO_SNAPSHOT_STORE, pattern=DRIVER_NAME_RE)


def parse_snapshot_store(spec: str, *, s3_endpoint: str | None = None, s3_credentials_file: Path | None = None,
                         flag: str = "--snapshot-store", s3_flags: str = "--s3") -> dict[str, Any]:
    """``dir:PATH``, ``s3://BUCKET[/PREFIX]`` or ``none`` (``--snapshot-store``), with the S3 store's
    endpoint and credentials file, as the ``[storage_agent.snapshot_store]`` table says it. The error
    names what is wrong, never a secret (there is none in these)."""
    s3_only = [name for name, value in ((f"{s3_flags}-endpoint", s3_endpoint),
                                        (f"{s3_flags}-credentials-file", s3_credentials_file)) if value is not None]
    if spec == NO_SNAPSHOT_STORE:
        if s3_only:
            raise InvalidParameter(f"{s3_only[0]} goes with {flag} s3://BUCKET/PREFIX")
        return {"driver": NO_SNAPSHOT_STORE}
    if spec.startswith("dir:"):
        if s3_only:
            raise InvalidParameter(f"{s3_only[0]} goes with {flag} s3://BUCKET/PREFIX")
        path = spec[len("dir:"):]
        if not path or "\0" in path:
            raise InvalidParameter(f"{flag} dir:PATH needs a directory")
        return {"driver": "dir", "path": str(Path(path).resolve())}
    if spec.startswith("s3://"):
        bucket, _, prefix = spec[len("s3://"):].partition("/")
        if not re.fullmatch(S3_BUCKET_RE, bucket):
            raise InvalidParameter(f"{flag}: {bucket[:80]!r} is not an S3 bucket name (3-63 characters "
                                   "a-z, 0-9, . and -, starting and ending with a letter or digit)")
        if not re.fullmatch(S3_PREFIX_RE, prefix):
            raise InvalidParameter(f"{flag}: {prefix[:80]!r} is not a prefix (up to 8 segments of "
                                   "A-Z, a-z, 0-9, ., _ and -, each starting with a letter or digit, separated by /)")
        found: dict[str, Any] = {"driver": "s3", "bucket": bucket, "prefix": prefix.strip("/")}
        if s3_endpoint is not None:
            if not re.fullmatch(r"https?://[^\s/@]+(/[^\s@]*)?", s3_endpoint):
                raise InvalidParameter(f"{s3_flags}-endpoint must be http(s)://HOST[:PORT][/PATH], with no user or "
                                       "password")
            found["endpoint_url"] = s3_endpoint
        if s3_credentials_file is not None:
            found["credentials_file"] = str(s3_credentials_file.resolve())
        return found
    raise InvalidParameter(f"{flag} {spec[:80]!r}: expecting dir:PATH, s3://BUCKET/PREFIX or none")


def pools_as_text(v: Any) -> Any:
    """Pools given as "NAME=PATH" strings (a list, or one string separated by commas) as PoolConfigs."""
    if isinstance(v, str):
        v = [item for item in v.split(",") if item.strip()]
    if isinstance(v, list):
        return [PoolConfig.parse(item.strip()) if isinstance(item, str) else item for item in v]
    return v


# An agent's pools: tables, or "NAME=PATH" strings (pools_as_text).
Pools = Annotated[list[PoolConfig], Field(max_length=MAX_POOLS), BeforeValidator(pools_as_text)]


class StorageAgentConfig(_AgentSection):
    port: int = Field(8771, ge=1, le=65535)
    node_name: str = Field("storage-1", pattern=r"^[a-z0-9][a-z0-9.-]{0,62}$")
    # The one pool of an agent that lists no ``pools``.
    pool_name: str = Field("default", pattern=POOL_NAME_RE)
    pool_path: Path = Path("./var/pool")
    # Several pools: [[storage_agent.pools]] tables, "NAME=PATH" strings (--pool, repeatable), or
    # VBS_STORAGE_AGENT_POOLS="NAME=PATH,NAME=PATH".
    pools: Pools = Field(default_factory=list)
    # None: the controller's own zone (its [controller] availability_zone, by default its region's first).
    availability_zone: str | None = Field(None, pattern=ZONE_NAME_RE)
    clone_method: Literal["reflink", "copy"] | None = None
    heartbeat_interval_s: float = Field(5.0, gt=0)
    state_dir: Path = Path("./var/storage-state")
    # Drivers by their registered names (vbs.drivers).
    backend: str = Field("file", pattern=DRIVER_NAME_RE)
    export: str = Field("nbd", pattern=DRIVER_NAME_RE)
    export_host: str = "127.0.0.1"
    nbd_port: int = Field(10809, ge=1, le=65535)
    # NBD over TCP: "x509" (tls_cert/tls_key/tls_ca of this section), "psk", or "off" (--insecure
    # only); true/false of older configs mean "psk"/"off". nbd_socket_dir: listen on
    # <dir>/nbd.sock instead (a 0700 directory; the hypervisor on this machine; `vbs up`).
    nbd_tls: Literal["x509", "psk", "off"] = "x509"
    nbd_socket_dir: Path | None = None
    iscsi_port: int = Field(3260, ge=1, le=65535)
    iscsi_control: int = Field(7, ge=0, le=32767)
    # The rbd backend: the cluster's ceph.conf (it names the keyring of ceph_user), the cephx user
    # and the Ceph pool that holds this node's volumes.
    ceph_conf: Path | None = None
    ceph_user: str = Field("admin", pattern=CEPH_USER_RE)
    rbd_pool: str = Field("rbd", pattern=RBD_POOL_RE)
    # A volume cloned from a snapshot whose chain of clones would be deeper than this is flattened
    # in the background, at most rbd_max_flattens at once; a volume has at most this many snapshots.
    rbd_max_clone_depth: int = Field(5, ge=1, le=16)
    rbd_max_flattens: int = Field(2, ge=1, le=16)
    rbd_max_snapshots_per_volume: int = Field(450, ge=1, le=450)
    # The snapshot path's rbd calls through one long-lived worker holding a rados connection
    # (/usr/bin/python3 with python3-rbd; the rbd tool when it cannot start), or the tool only.
    rbd_worker: bool = True
    # Where snapshots go (docs/snapshots.md): [storage_agent.snapshot_store], or --snapshot-store.
    snapshot_store: SnapshotStoreConfig = Field(default_factory=SnapshotStoreConfig)
    # Where archived snapshots go (docs/snapshot-tiers.md): [storage_agent.archive_store], or --archive-store.
    archive_store: ArchiveStoreConfig = Field(default_factory=ArchiveStoreConfig)

    @model_validator(mode="after")
    def _pools_are_distinct(self) -> StorageAgentConfig:
        if self.pools and {"pool_name", "pool_path"} & self.model_fields_set:
            raise ValueError("give either pools (--pool NAME=PATH) or pool_name/pool_path (--pool-path), not both")
        names: set[str] = set()
        paths: dict[Path, str] = {}
        for pool in self.pools:
            if pool.name in names:
                raise ValueError(f"the pool name {pool.name!r} is given twice; each pool of a node needs its own")
            names.add(pool.name)
            where = pool.path.resolve()
            if where in paths:
                raise ValueError(f"the pools {paths[where]!r} and {pool.name!r} have the same directory {pool.path}")
            paths[where] = pool.name
        return self

    @model_validator(mode="after")
    def _archive_is_another_store(self) -> StorageAgentConfig:
        archive, store = self.archive_store, self.snapshot_store
        if archive.driver == NO_SNAPSHOT_STORE:
            return self
        if store.driver == NO_SNAPSHOT_STORE:
            raise ValueError("an archive store needs a snapshot store: snapshots are archived from it")
        if archive.driver == store.driver and archive.options() == store.options():
            raise ValueError("the archive store is the snapshot store: give it another directory or bucket")
        return self

    def served_pools(self) -> list[PoolConfig]:
        """The pools this agent serves: ``pools``, or else the one ``pool_name`` at ``pool_path``."""
        return list(self.pools) or [PoolConfig(name=self.pool_name, path=self.pool_path)]

    def for_pool(self, pool: PoolConfig) -> StorageAgentConfig:
        """This config as a backend of ``pool`` reads it: ``pool_name``/``pool_path`` name that pool."""
        return self.model_copy(update={"pool_name": pool.name, "pool_path": pool.path, "pools": []})

    # The command backend: its profile (a name looked up in profile_dirs and then among the
    # shipped ones, or a path to a TOML file).
    profile: str | None = Field(None, max_length=4096)
    profile_dirs: list[Path] = Field(default_factory=lambda: [Path("/etc/vbs/profiles")])

    @field_validator("nbd_tls", mode="before")
    @classmethod
    def _nbd_tls_of_old_configs(cls, v: Any) -> Any:
        flags = {True: "psk", False: "off", "true": "psk", "false": "off", "1": "psk", "0": "off"}
        return flags.get(v.lower() if isinstance(v, str) else v, v)


HOST_IQN_PREFIX = "iqn.2026-11.org.vbs.host"


def host_initiator_name(node_name: str) -> str:
    """The initiator name of a host that configures none: one per node name, the same at every start."""
    name = f"{HOST_IQN_PREFIX}:{node_name}"
    if not re.fullmatch(IQN_RE, name):
        raise InvalidParameter(f"node name {node_name[:80]!r} gives no valid initiator name")
    return name


class HostAgentConfig(_AgentSection):
    port: int = Field(8772, ge=1, le=65535)
    node_name: str = Field("host-1", pattern=r"^[a-z0-9][a-z0-9.-]{0,62}$")
    address: str = "127.0.0.1"
    # The iSCSI initiator name this host's QEMU (libiscsi) and libvirt log in with; by default
    # derived from node_name (``host_initiator_name``). Storage agents on loopback or behind the TLS
    # tunnel bind it in their targets' ACL, where the address tells no host from another.
    initiator_name: str | None = Field(None, pattern=IQN_RE)
    vm_dir: Path = Path("./var/vms")
    # Where the agent keeps what must outlive it (the highest fence seen per volume); None: in memory.
    state_dir: Path | None = None
    heartbeat_interval_s: float = Field(2.0, gt=0)
    # RTT probes to each storage node (vbs.host.probes): how often (0: never) and how many bytes
    # the throughput transfer takes (at most 4 MiB, what a storage agent serves).
    probe_interval_s: float = Field(60.0, ge=0)
    probe_bytes: int = Field(1 << 20, ge=64 << 10, le=4 << 20)
    qmp_timeout_s: float = Field(10.0, gt=0)
    hypervisor: str = Field("qemu", pattern=DRIVER_NAME_RE)
    # The libvirt hypervisor driver: the libvirtd it drives, and whether an attach also goes into
    # the domains' persistent configuration (so the disk is there again after a VM restart).
    libvirt_uri: str = Field("qemu:///system", pattern=LIBVIRT_URI_RE)
    libvirt_persist: bool = False
    # NBD over X.509 through libvirt: the directory the libvirtd's qemu.conf names as
    # nbd_tls_x509_cert_dir. The agent writes this host's client certificate there (tls_cert,
    # tls_key, tls_ca); without it such exports are refused.
    libvirt_nbd_tls_dir: Path | None = None
    # The command hypervisor driver: its profile (a name looked up in profile_dirs and then among
    # the shipped ones, or a path to a TOML file).
    profile: str | None = Field(None, max_length=4096)
    profile_dirs: list[Path] = Field(default_factory=lambda: [Path("/etc/vbs/profiles")])
    # Semi-shared storage: local pools on this node's own disks ("NAME=PATH", --local-pool, repeatable,
    # or VBS_HOST_AGENT_LOCAL_POOLS), made by the storage agents' backend drivers (local_backend).
    local_pools: Pools = Field(default_factory=list)
    local_backend: str = Field("file", pattern=DRIVER_NAME_RE)

    @model_validator(mode="after")
    def _initiator_name_of_the_node(self) -> HostAgentConfig:
        if self.initiator_name is None:
            self.initiator_name = host_initiator_name(self.node_name)
        return self

    @model_validator(mode="after")
    def _local_pools_are_distinct(self) -> HostAgentConfig:
        if len({p.name for p in self.local_pools}) != len(self.local_pools):
            raise ValueError("a local pool name is given twice; each local pool of a host needs its own")
        return self


SectionT = TypeVar("SectionT", bound=_Section)


def _from_env(text: str) -> Any:
    """An environment value: a table or list is written as JSON (``{"nova": "libvirt-metadata"}``)."""
    if text.startswith(("{", "[")):
        try:
            return json.loads(text)
        except ValueError as exc:
            raise InvalidParameter(f"invalid JSON in a VBS_ environment variable: {exc}") from exc
    return text


def load(
    model: type[SectionT],
    section: str,
    *,
    config_file: Path | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> SectionT:
    """Defaults < TOML file section < ``VBS_<SECTION>_<KEY>`` env vars < explicit ``overrides``."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    path = config_file or (Path(env["VBS_CONFIG"]) if env.get("VBS_CONFIG") else None)
    if path is not None:
        try:
            with path.open("rb") as fh:
                values.update(tomllib.load(fh).get(section, {}))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise InvalidParameter(f"cannot read config file {path}: {exc}") from exc
    prefix = f"VBS_{section.upper()}_"
    for key in model.model_fields:
        if key == "agent_token" and env.get("VBS_AGENT_TOKEN"):
            values[key] = env["VBS_AGENT_TOKEN"]
        if env.get(prefix + key.upper()) is not None:
            values[key] = _from_env(env[prefix + key.upper()])
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise InvalidParameter(f"invalid [{section}] configuration: {exc}") from exc
