"""``vbs csi``: the Container Storage Interface driver (docs/kubernetes.md)."""

# No ``from __future__ import annotations``: Typer reads the signature (see vbs.cli.context).
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from vbs.csi.vbs_api import VbsApi

commands = typer.Typer()


@commands.command("csi")
def csi(
    endpoint: Annotated[str, typer.Option(help="Where to serve: unix:///PATH (the sidecars' --csi-address).")],
    controller_url: Annotated[list[str] | None, typer.Option(
        help="Controller service: a VBS controller's URL (repeatable); without it, the Node service only.")]
    = None,
    credentials_file: Annotated[Path | None, typer.Option(
        help="Controller service: a credentials file (aws_access_key_id / aws_secret_access_key) with the key "
             "of a VBS user; never on the command line. A call whose secrets carry a key (accessKeyId, "
             "secretAccessKey) uses that one.")] = None,
    credentials_profile: Annotated[str, typer.Option(help="The file's profile holding the key.")] = "default",
    ca_bundle: Annotated[Path | None, typer.Option(help="The CA that signed the controllers' certificates.")]
    = None,
    node_id: Annotated[str | None, typer.Option(
        help="Node service: this node's VBS host name (its host agent's --node-name); without it, no Node "
             "service.")] = None,
    zone: Annotated[str | None, typer.Option(
        help="Node service (required with it): this node's availability zone, whose volumes it mounts.")] = None,
    disk_dir: Annotated[Path, typer.Option(
        help="Node service: where the csi-node hypervisor profile links the volumes published to this node.")]
    = Path("/run/vbs-csi/disks"),
    node_vm: Annotated[str, typer.Option(
        help="The VM the csi-node hypervisor profile reports on each node (volumes are attached to it).")]
    = "csi-node",
    wait: Annotated[float, typer.Option(
        help="Controller service: the longest a call waits for VBS before answering ABORTED (the sidecar "
             "retries).")] = 120.0,
    log_json: Annotated[bool, typer.Option("--log-json")] = False,
) -> None:
    """Run the CSI driver: Identity, Controller (with --controller-url) and Node (with --node-id) services."""
    from vbs.csi.server import CsiConfig, serve, socket_of
    from vbs.system import logs

    logs.setup("csi", json_lines=log_json)
    api = None
    if controller_url:
        api = _api(controller_url, credentials_file, credentials_profile, ca_bundle, wait)
    serve(CsiConfig(socket=socket_of(endpoint), api=api, node_id=node_id, zone=zone, disk_dir=disk_dir,
                    node_vm=node_vm))


def _api(urls: list[str], credentials_file: Path | None, profile: str, ca_bundle: Path | None,
         wait: float) -> "VbsApi":
    from vbs.csi.vbs_api import VbsApi
    from vbs.net import endpoints
    from vbs.trust import credentials
    from vbs.trust.tls import client_verify

    if credentials_file is None:
        raise typer.BadParameter("the Controller service needs --credentials-file (a VBS user's access key)")
    keys = credentials.read(credentials_file, profile)
    if not keys:
        raise typer.BadParameter(f"{credentials_file} has no key in profile [{profile}]")
    parsed = endpoints.parse(urls, what="--controller-url")
    https = not all(url.startswith("http://") for url in parsed)
    return VbsApi.connect(parsed, keys[0], verify=client_verify(str(ca_bundle) if ca_bundle else None, https=https),
                          wait_s=wait)
