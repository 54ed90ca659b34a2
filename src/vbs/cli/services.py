"""The service commands: controller, storage-agent and host-agent, and ``vbs up`` (the embedded install,
run by vbs.cli.up). Their modules load only when the command runs."""

# No ``from __future__ import annotations`` here: Typer reads every command's signature, and string
# annotations would be evaluated again on each run (twice per command), most of a --help's time.
import re
from pathlib import Path
from typing import Annotated, Any

import typer

from vbs.cli.database import warn_if_password_on_argv
from vbs.net.endpoints import DEFAULT_CONTROLLER_PORT

# Registered into the app by vbs.cli.main, in the order of ``vbs --help``.
commands = typer.Typer()


# Options every service command takes, declared once.
ConfigOpt = Annotated[Path | None, typer.Option(help="vbs.toml")]
HostOpt = Annotated[str | None, typer.Option(help="Address to listen on.")]
PortOpt = Annotated[int | None, typer.Option(help="Port to listen on.")]
NodeNameOpt = Annotated[str | None, typer.Option(help="This node's name, unique among nodes of its kind.")]
ControllerUrlsOpt = Annotated[list[str] | None, typer.Option(
    help="A controller's URL; repeat it (or separate URLs by commas) for each controller.")]
TlsCertOpt = Annotated[Path | None, typer.Option(help="This service's certificate (PEM).")]
TlsKeyOpt = Annotated[Path | None, typer.Option(help="Its private key (PEM, 0600).")]
TlsCaOpt = Annotated[Path | None, typer.Option(help="CA that peers' certificates chain to.")]
InsecureOpt = Annotated[bool, typer.Option("--insecure", help="Run without credentials/TLS (says so).")]
TokenFileOpt = Annotated[Path | None, typer.Option(help="File with this node's token (0600).")]
LogJsonOpt = Annotated[bool, typer.Option("--log-json")]
SnapshotStoreOpt = Annotated[str | None, typer.Option(
    help="Where snapshots go: dir:PATH, s3://BUCKET/PREFIX, or none (they stay in their pool only).")]
S3EndpointOpt = Annotated[str | None, typer.Option(
    "--s3-endpoint", help="s3 snapshot store: the endpoint URL (RADOS Gateway, MinIO; default: AWS).")]
S3CredentialsOpt = Annotated[Path | None, typer.Option(
    "--s3-credentials-file", help="s3 snapshot store: a 0600 file in the AWS credentials format (default: "
                                  "boto3's chain, e.g. AWS_ACCESS_KEY_ID).")]
ArchiveStoreOpt = Annotated[str | None, typer.Option(
    help="A separate store archived snapshots move to (docs/snapshot-tiers.md): dir:PATH or s3://BUCKET/PREFIX "
         "(default: none, they stay in the snapshot store).")]
ArchiveS3EndpointOpt = Annotated[str | None, typer.Option(
    "--archive-s3-endpoint", help="s3 archive store: the endpoint URL (default: AWS).")]
ArchiveS3CredentialsOpt = Annotated[Path | None, typer.Option(
    "--archive-s3-credentials-file", help="s3 archive store: a 0600 file in the AWS credentials format.")]


@commands.command("controller")
def controller(
    config: ConfigOpt = None, host: HostOpt = None, port: PortOpt = None,
    data_dir: Annotated[Path | None, typer.Option()] = None,
    database_url: Annotated[str | None, typer.Option(
        help="postgresql+psycopg://… (default: SQLite in the data dir); a password belongs in the file.")] = None,
    database_url_file: Annotated[Path | None, typer.Option(help="A 0600 file holding the database URL.")] = None,
    tls_cert: TlsCertOpt = None, tls_key: TlsKeyOpt = None, tls_ca: TlsCaOpt = None, insecure: InsecureOpt = False,
    overcommit_ratio: Annotated[float | None, typer.Option(help="A pool promises up to capacity x this.")] = None,
    quota_volumes: Annotated[int | None, typer.Option(help="Volumes per tenant.")] = None,
    quota_gib: Annotated[int | None, typer.Option(help="GiB of volumes per tenant.")] = None,
    quota_snapshots: Annotated[int | None, typer.Option(help="Snapshots per tenant.")] = None,
    controller_id: Annotated[str | None, typer.Option(
        help="This controller's id among several on one database (default: <hostname>-<port>).")] = None,
    advertise_url: Annotated[str | None, typer.Option(
        help="The URL others reach this controller at (vbs describe-controllers).")] = None,
    log_json: LogJsonOpt = False,
) -> None:
    """Run the controller (REST API, metadata DB, workflows)."""
    from vbs import config as cfgmod
    from vbs.controller.app import serve
    from vbs.system import logs

    logs.setup("controller", json_lines=log_json)
    warn_if_password_on_argv(database_url)
    cfg = cfgmod.load(cfgmod.ControllerConfig, "controller", config_file=config, overrides={
        "host": host, "port": port, "data_dir": data_dir, "database_url": database_url,
        "database_url_file": database_url_file,
        "overcommit_ratio": overcommit_ratio, "quota_volumes": quota_volumes, "quota_gib": quota_gib,
        "quota_snapshots": quota_snapshots, "controller_id": controller_id, "advertise_url": advertise_url,
        **_security(tls_cert, tls_key, tls_ca, insecure)})
    serve(cfg)


@commands.command("storage-agent")
def storage_agent(
    config: ConfigOpt = None, host: HostOpt = None, port: PortOpt = None,
    node_name: NodeNameOpt = None, controller_url: ControllerUrlsOpt = None,
    pool_path: Annotated[Path | None, typer.Option(help="The directory of the one pool 'default'.")] = None,
    pool: Annotated[list[str] | None, typer.Option(
        "--pool", help="NAME=PATH: a pool this node serves (repeat for several; replaces --pool-path).")] = None,
    availability_zone: Annotated[str | None, typer.Option(
        help="This node's zone (default: the controller's zone, e.g. us-east-1a).")] = None,
    clone_method: Annotated[str | None, typer.Option(help="reflink | copy (default: detect)")] = None,
    state_dir: Annotated[Path | None, typer.Option(help="Export daemons' sockets and state.")] = None,
    backend: Annotated[str | None, typer.Option(help="Backend driver by name (default: file).")] = None,
    export: Annotated[str | None, typer.Option(help="Export driver by name: nbd | nbdkit | iscsi.")] = None,
    nbd_port: Annotated[int | None, typer.Option()] = None,
    nbd_socket_dir: Annotated[Path | None, typer.Option(
        help="Serve NBD on <dir>/nbd.sock (a 0700 directory) instead of TCP: hypervisors on this machine.")] = None,
    iscsi_port: Annotated[int | None, typer.Option()] = None,
    iscsi_control: Annotated[int | None, typer.Option(help="tgtd control number (-C).")] = None,
    ceph_conf: Annotated[Path | None, typer.Option(
        help="rbd backend: the cluster's ceph.conf (it names the user's keyring).")] = None,
    ceph_user: Annotated[str | None, typer.Option(help="rbd backend: the cephx user (default: admin).")] = None,
    rbd_pool: Annotated[str | None, typer.Option(help="rbd backend: the Ceph pool (default: rbd).")] = None,
    rbd_max_clone_depth: Annotated[int | None, typer.Option(
        help="rbd backend: flatten clones deeper than this in the background (default: 5).")] = None,
    rbd_max_flattens: Annotated[int | None, typer.Option(
        help="rbd backend: at most this many flattens at once (default: 2).")] = None,
    rbd_max_snapshots_per_volume: Annotated[int | None, typer.Option(
        help="rbd backend: the most snapshots a volume may have (default and most: 450).")] = None,
    rbd_worker: Annotated[bool | None, typer.Option(
        "--rbd-worker/--no-rbd-worker",
        help="rbd backend: serve the snapshot path's calls through one long-lived worker (default) or the "
             "rbd tool only.")] = None,
    backend_profile: Annotated[str | None, typer.Option(
        help="command backend: the profile, by name (qemu-img, lvm, or one in --backend-profile-dir) or as a "
             "path to a TOML file.")] = None,
    backend_profile_dir: Annotated[list[Path] | None, typer.Option(
        "--backend-profile-dir", help="command backend: where profiles are looked up first (default: "
                                      "/etc/vbs/profiles); repeatable.")] = None,
    snapshot_store: SnapshotStoreOpt = None, s3_endpoint: S3EndpointOpt = None,
    s3_credentials_file: S3CredentialsOpt = None,
    archive_store: ArchiveStoreOpt = None, archive_s3_endpoint: ArchiveS3EndpointOpt = None,
    archive_s3_credentials_file: ArchiveS3CredentialsOpt = None,
    tls_cert: TlsCertOpt = None, tls_key: TlsKeyOpt = None, tls_ca: TlsCaOpt = None, insecure: InsecureOpt = False,
    agent_token_file: TokenFileOpt = None, log_json: LogJsonOpt = False,
) -> None:
    """Run a storage agent (backends and exports of one volume server)."""
    from vbs import config as cfgmod
    from vbs.storage.service import serve
    from vbs.system import logs

    logs.setup("storage-agent", json_lines=log_json)
    cfg = cfgmod.load(cfgmod.StorageAgentConfig, "storage_agent", config_file=config, overrides={
        "host": host, "port": port, "node_name": node_name, "controller_url": controller_url,
        "pool_path": pool_path, "pools": pool, "availability_zone": availability_zone,
        "clone_method": clone_method, "state_dir": state_dir, "backend": backend,
        "export": export, "nbd_port": nbd_port, "nbd_socket_dir": nbd_socket_dir,
        "iscsi_port": iscsi_port, "iscsi_control": iscsi_control,
        "ceph_conf": ceph_conf, "ceph_user": ceph_user, "rbd_pool": rbd_pool,
        "rbd_max_clone_depth": rbd_max_clone_depth, "rbd_max_flattens": rbd_max_flattens,
        "rbd_max_snapshots_per_volume": rbd_max_snapshots_per_volume, "rbd_worker": rbd_worker,
        "profile": backend_profile, "profile_dirs": backend_profile_dir or None,
        "snapshot_store": _snapshot_store(snapshot_store, s3_endpoint, s3_credentials_file),
        "archive_store": _archive_store(archive_store, archive_s3_endpoint, archive_s3_credentials_file),
        "agent_token_file": agent_token_file, **_security(tls_cert, tls_key, tls_ca, insecure)})
    serve(cfg)


def _snapshot_store(spec: str | None, endpoint: str | None, credentials_file: Path | None) -> dict[str, Any] | None:
    """``--snapshot-store`` with its S3 flags as the config's table; None: the config's (or its default)."""
    from vbs.config import parse_snapshot_store
    from vbs.errors import InvalidParameter

    if spec is None:
        if endpoint is not None or credentials_file is not None:
            raise typer.BadParameter("--s3-endpoint and --s3-credentials-file go with --snapshot-store s3://BUCKET/PREFIX")
        return None
    try:
        return parse_snapshot_store(spec, s3_endpoint=endpoint, s3_credentials_file=credentials_file)
    except InvalidParameter as exc:
        raise typer.BadParameter(exc.message) from None


def _archive_store(spec: str | None, endpoint: str | None, credentials_file: Path | None) -> dict[str, Any] | None:
    """``--archive-store`` with its S3 flags as the config's table; None: the config's (or its default)."""
    from vbs.config import parse_snapshot_store
    from vbs.errors import InvalidParameter

    if spec is None:
        if endpoint is not None or credentials_file is not None:
            raise typer.BadParameter("--archive-s3-endpoint and --archive-s3-credentials-file go with "
                                     "--archive-store s3://BUCKET/PREFIX")
        return None
    try:
        return parse_snapshot_store(spec, s3_endpoint=endpoint, s3_credentials_file=credentials_file,
                                    flag="--archive-store", s3_flags="--archive-s3")
    except InvalidParameter as exc:
        raise typer.BadParameter(exc.message) from None


LibvirtUriOpt = Annotated[str | None, typer.Option(
    help="libvirt hypervisor driver: the libvirt connection URI (default: qemu:///system).")]
# Not --profile: that is the CLI's named profile, a global option anywhere on the line.
ProfileOpt = Annotated[str | None, typer.Option(
    "--hypervisor-profile",
    help="command hypervisor driver: the profile, by name (virsh-path, virsh, xen, proxmox, qemu-monitor, "
         "csi-node, or one in --hypervisor-profile-dir) or as a path to a TOML file.")]
ProfileDirOpt = Annotated[list[Path] | None, typer.Option(
    "--hypervisor-profile-dir", help="command hypervisor driver: where profiles are looked up first (default: "
                          "/etc/vbs/profiles); repeatable.")]


@commands.command("host-agent")
def host_agent(
    config: ConfigOpt = None, host: HostOpt = None, port: PortOpt = None,
    node_name: NodeNameOpt = None, controller_url: ControllerUrlsOpt = None,
    vm_dir: Annotated[Path | None, typer.Option(help="Directory of <vm>.qmp sockets.")] = None,
    state_dir: Annotated[Path | None, typer.Option(help="This agent's own state (0700; fences).")] = None,
    address: Annotated[str | None, typer.Option(help="This node's address, for export ACLs.")] = None,
    hypervisor: Annotated[str | None, typer.Option(help="Hypervisor driver by name (default: qemu).")] = None,
    libvirt_uri: LibvirtUriOpt = None,
    libvirt_persist: Annotated[bool, typer.Option(
        "--libvirt-persist", help="libvirt: an attach also goes into a persistent domain's configuration.")] = False,
    profile: ProfileOpt = None, profile_dir: ProfileDirOpt = None,
    local_pool: Annotated[list[str] | None, typer.Option(
        help="A local pool NAME=PATH on this node's own disks (semi-shared storage; repeatable).")] = None,
    local_backend: Annotated[str | None, typer.Option(help="Backend driver of the local pools (default: file).")]
    = None,
    tls_cert: TlsCertOpt = None, tls_key: TlsKeyOpt = None, tls_ca: TlsCaOpt = None, insecure: InsecureOpt = False,
    agent_token_file: TokenFileOpt = None, log_json: LogJsonOpt = False,
) -> None:
    """Run a host agent (hot-plug into the VMs of one hypervisor node)."""
    from vbs import config as cfgmod
    from vbs.host.service import serve
    from vbs.system import logs

    logs.setup("host-agent", json_lines=log_json)
    cfg = cfgmod.load(cfgmod.HostAgentConfig, "host_agent", config_file=config, overrides={
        "host": host, "port": port, "node_name": node_name, "controller_url": controller_url, "vm_dir": vm_dir,
        "state_dir": state_dir,
        "address": address, "hypervisor": hypervisor, "agent_token_file": agent_token_file,
        "libvirt_uri": libvirt_uri, "libvirt_persist": libvirt_persist or None,
        "profile": profile, "profile_dirs": profile_dir or None,
        "local_pools": local_pool or None, "local_backend": local_backend,
        **_security(tls_cert, tls_key, tls_ca, insecure)})
    serve(cfg)


@commands.command("up")
def up(
    data_dir: Annotated[Path, typer.Option(help="DB, pool and state of the embedded install.")] = Path("./var"),
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = DEFAULT_CONTROLLER_PORT,
    clone_method: Annotated[str | None, typer.Option(help="reflink | copy (default: detect)")] = None,
    export: Annotated[str, typer.Option(help="nbd | nbdkit | iscsi")] = "nbd",
    tls: Annotated[bool, typer.Option("--tls", help="HTTPS everywhere, with a private CA in the data dir.")] = False,
    overcommit_ratio: Annotated[float | None, typer.Option(help="Controller: a pool promises up to capacity x this.")]
    = None,
    quota_volumes: Annotated[int | None, typer.Option(help="Controller: volumes per tenant.")] = None,
    quota_gib: Annotated[int | None, typer.Option(help="Controller: GiB of volumes per tenant.")] = None,
    quota_snapshots: Annotated[int | None, typer.Option(help="Controller: snapshots per tenant.")] = None,
    enforce_type_limits: Annotated[bool, typer.Option(
        "--enforce-type-limits", help="Controller: throttle volumes without limits of their own to their type's "
                                      "nominal ones (gp3: 3,000 IOPS, 125 MiB/s).")] = False,
    database_url: Annotated[str | None, typer.Option(
        help="Controller: metadata in this PostgreSQL (postgresql+psycopg://…), upgraded by `vbs db upgrade`.")]
    = None,
    database_url_file: Annotated[Path | None, typer.Option(help="A 0600 file holding that URL.")] = None,
    postgres: Annotated[bool, typer.Option(
        "--postgres", help="Metadata in a PostgreSQL cluster of the data dir's own, started and stopped with it.")]
    = False,
    controllers: Annotated[int, typer.Option(
        help="Controllers (1-8), on --port and the ports after it; more than one needs PostgreSQL.")] = 1,
    storage_nodes: Annotated[int, typer.Option(
        help="Storage agents (1-16), each with its own pool (with --backend rbd: all on the one Ceph pool).")] = 1,
    backend: Annotated[str, typer.Option(
        help="file | rbd (Ceph: the data dir's own single-node cluster, or --ceph-conf's) | command "
             "(with --backend-profile).")] = "file",
    backend_profile: Annotated[str | None, typer.Option(
        help="command backend: the profile (qemu-img, or a path to a TOML file).")] = None,
    ceph_conf: Annotated[Path | None, typer.Option(help="rbd: an existing cluster's ceph.conf.")] = None,
    ceph_user: Annotated[str, typer.Option(help="rbd: the cephx user (with --ceph-conf).")] = "admin",
    rbd_pool: Annotated[str, typer.Option(help="rbd: the Ceph pool of the volumes.")] = "vbs",
    hypervisor: Annotated[str, typer.Option(
        help="The host agent's hypervisor driver: qemu | libvirt | command.")] = "qemu",
    libvirt_uri: LibvirtUriOpt = None,
    profile: ProfileOpt = None, profile_dir: ProfileDirOpt = None,
    local_pool: Annotated[list[str] | None, typer.Option(
        help="The host's local pool NAME=PATH, for local volumes (semi-shared storage; repeatable).")] = None,
    snapshot_store: Annotated[str | None, typer.Option(
        help="Where every storage agent puts snapshots: dir:PATH, s3://BUCKET/PREFIX (with --s3-endpoint URL, "
             "--s3-credentials-file F) or none (default: dir:DATA_DIR/snapshots).")] = None,
    s3_endpoint: S3EndpointOpt = None, s3_credentials_file: S3CredentialsOpt = None,
    archive_store: ArchiveStoreOpt = None, archive_s3_endpoint: ArchiveS3EndpointOpt = None,
    archive_s3_credentials_file: ArchiveS3CredentialsOpt = None,
    log_json: LogJsonOpt = False,
) -> None:
    """Run the embedded default: controller, storage agent and host agent on this machine, until Ctrl-C;
    or a small cluster of them (--controllers, --storage-nodes)."""
    from vbs import drivers
    from vbs.cli.up import Shape, run_embedded
    from vbs.cli.up_storage import RbdChoice
    from vbs.config import CEPH_USER_RE, RBD_POOL_RE

    shape = Shape(controllers, storage_nodes)
    if backend not in ("file", "rbd", "command"):
        raise typer.BadParameter("--backend must be file, rbd or command")
    storage_flags = _backend_profile_flags(backend, backend_profile)
    if backend == "file" and (ceph_conf is not None or ceph_user != "admin" or rbd_pool != "vbs"):
        raise typer.BadParameter("--ceph-conf, --ceph-user and --rbd-pool go with --backend rbd")
    if ceph_conf is None and ceph_user != "admin":
        raise typer.BadParameter("--ceph-user goes with --ceph-conf (the data dir's own cluster uses admin)")
    if not re.fullmatch(CEPH_USER_RE, ceph_user) or not re.fullmatch(RBD_POOL_RE, rbd_pool):
        raise typer.BadParameter("invalid --ceph-user or --rbd-pool")
    if ceph_conf is not None and not ceph_conf.is_file():
        raise typer.BadParameter(f"--ceph-conf {ceph_conf} is not a file")
    rbd = RbdChoice(ceph_conf.resolve() if ceph_conf else None, ceph_user, rbd_pool) if backend == "rbd" else None
    if export not in drivers.available("export"):
        raise typer.BadParameter(f"--export must be one of {', '.join(drivers.available('export'))}")
    if hypervisor not in drivers.available("hypervisor"):
        raise typer.BadParameter(f"--hypervisor must be one of {', '.join(drivers.available('hypervisor'))}")
    host_agent_flags = ("--hypervisor", hypervisor, *(("--libvirt-uri", libvirt_uri) if libvirt_uri else ()),
                        *_profile_flags(hypervisor, profile, profile_dir or []),
                        *_local_pool_flags(local_pool or []))
    limits = {"overcommit_ratio": overcommit_ratio, "quota_volumes": quota_volumes, "quota_gib": quota_gib,
              "quota_snapshots": quota_snapshots}
    controller_env = {f"VBS_CONTROLLER_{k.upper()}": str(v) for k, v in limits.items() if v is not None}
    if enforce_type_limits:
        controller_env["VBS_CONTROLLER_ENFORCE_TYPE_LIMITS"] = "true"
    if sum((database_url is not None, database_url_file is not None, postgres)) > 1:
        raise typer.BadParameter("give one of --database-url, --database-url-file and --postgres")
    warn_if_password_on_argv(database_url)
    if database_url_file is not None:
        database_url = database_url_file.read_text().strip() or None
    store = _snapshot_store(snapshot_store, s3_endpoint, s3_credentials_file)
    archive = _archive_store(archive_store, archive_s3_endpoint, archive_s3_credentials_file)
    raise typer.Exit(run_embedded(data_dir, host, port, shape=shape,
                                  clone_method=clone_method, export=export, log_json=log_json, tls=tls,
                                  controller_env=controller_env, database_url=database_url, postgres=postgres,
                                  rbd=rbd, host_agent_flags=host_agent_flags, storage_flags=storage_flags,
                                  snapshot_store=store, archive_store=archive))


def _backend_profile_flags(backend: str, profile: str | None) -> tuple[str, ...]:
    """The storage agents' flags of the command backend, its profile checked now."""
    if backend != "command":
        if profile is not None:
            raise typer.BadParameter("--backend-profile goes with --backend command")
        return ()
    if profile is None:
        raise typer.BadParameter("--backend command needs --backend-profile NAME or PATH")
    from vbs.errors import InvalidParameter
    from vbs.profiles import DEFAULT_PROFILE_DIR, load_profile
    from vbs.storage.backends.command import BACKEND_PROFILES

    try:
        load_profile(BACKEND_PROFILES, profile, [DEFAULT_PROFILE_DIR])
    except InvalidParameter as exc:
        raise typer.BadParameter(exc.message) from exc
    path = str(Path(profile).resolve()) if "/" in profile or profile.endswith(".toml") else profile
    return ("--backend", "command", "--backend-profile", path)


def _profile_flags(hypervisor: str, profile: str | None, dirs: list[Path]) -> tuple[str, ...]:
    """The host agent's profile flags, the profile checked now: one that fails stops ``vbs up``
    before anything starts, with the file, line and key or placeholder at fault."""
    if hypervisor != "command":
        if profile is not None or dirs:
            raise typer.BadParameter("--hypervisor-profile and --hypervisor-profile-dir go with --hypervisor command")
        return ()
    if profile is None:
        raise typer.BadParameter("--hypervisor command needs --hypervisor-profile NAME or PATH")
    from vbs.errors import InvalidParameter
    from vbs.host.hypervisors.command import HYPERVISOR_PROFILES
    from vbs.profiles import DEFAULT_PROFILE_DIR, load_profile

    resolved = [d.resolve() for d in dirs]
    try:
        load_profile(HYPERVISOR_PROFILES, profile, resolved or [DEFAULT_PROFILE_DIR])
    except InvalidParameter as exc:
        raise typer.BadParameter(exc.message) from exc
    path = str(Path(profile).resolve()) if "/" in profile or profile.endswith(".toml") else profile
    return ("--hypervisor-profile", path,
            *(flag for d in resolved for flag in ("--hypervisor-profile-dir", str(d))))


def _security(tls_cert: Path | None, tls_key: Path | None, tls_ca: Path | None, insecure: bool) -> dict[str, Any]:
    return {"tls_cert": tls_cert, "tls_key": tls_key, "tls_ca": tls_ca, "insecure": insecure or None}


def _local_pool_flags(specs: list[str]) -> tuple[str, ...]:
    """``vbs up --local-pool`` as its host agent takes it (each NAME=PATH checked here first)."""
    from vbs.config import PoolConfig

    flags: list[str] = []
    for spec in specs:
        try:
            pool = PoolConfig.parse(spec)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        flags += ["--local-pool", f"{pool.name}={pool.path.resolve()}"]
    return tuple(flags)
