"""What ``vbs up`` prints once everything is up (``banner``), and what it reads from its own flags to say it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from vbs.cli.up_storage import RbdChoice, SnapshotStoreChoice
from vbs.trust import credentials

if TYPE_CHECKING:
    from vbs.cli.up import Child

VM_DIR = "vms"  # the host agent's --vm-dir: QEMU's QMP sockets <vm>.qmp


def hypervisor_of(host_agent_flags: tuple[str, ...]) -> str:
    """The host agent's hypervisor driver, as its flags name it (``qemu`` when they do not)."""
    flags = list(host_agent_flags)
    return flags[flags.index("--hypervisor") + 1] if "--hypervisor" in flags[:-1] else "qemu"


def banner(data_dir: Path, endpoints: list[str], storage_agents: Sequence[Child], services_file: Path, *,
            tls: bool, rbd: RbdChoice | None = None, cli_credentials: Path | None = None,
            store: SnapshotStoreChoice | None = None, demo_vm: bool = False) -> str:
    """What ``vbs up`` prints once everything is up: where things are, and the lines to paste into
    another shell. Keys are named by the 0600 files that hold them, never printed. ``demo_vm``: the host
    agent finds QEMU VMs by their QMP sockets, so ``vbs demo-vm`` gives it one to attach volumes to."""
    where = (f"endpoint {endpoints[0]}" if len(endpoints) == 1
             else f"endpoints {','.join(endpoints)} (give them all as VBS_ENDPOINT)")
    nodes = "" if len(storage_agents) == 1 else f", storage nodes {', '.join(a.name for a in storage_agents)}"
    services = "" if len(endpoints) == 1 and len(storage_agents) == 1 else f", services in {services_file}"
    key_file = data_dir / "credentials"
    cli_file = cli_credentials or credentials.user_file()
    first = (f"VBS is up: {where}{nodes}, data in {data_dir}, VMs found in {data_dir / VM_DIR}, "
             f"credentials in {key_file}{services}"
             + (f", CA certificate {data_dir / 'ca.pem'}" if tls else "")
             + (f", volumes in Ceph pool {rbd.pool} (rbd -c {rbd.conf} ls {rbd.pool})" if rbd is not None else "")
             + " (Ctrl-C stops)")
    lines = [first]
    if store is not None:
        note = f"; {store.note}" if store.note else ""
        lines.append(f"Snapshots go to {store.where or 'no snapshot store'}{note}")
    lines += ["In another shell:",
             f"  export VBS_ENDPOINT={','.join(endpoints)}",
             f"  # the vbs CLI finds its key by itself: section [{credentials.endpoint_key(endpoints[0])}] "
             f"of {cli_file} (0600)"]
    if tls:
        lines.append(f"  export VBS_CA_BUNDLE={data_dir / 'ca.pem'}")
    lines.append(f"  export AWS_SHARED_CREDENTIALS_FILE={key_file}   # the AWS CLI and boto3: profile default")
    if demo_vm:
        also = "" if data_dir == Path("var") else f" --data-dir {data_dir}"
        lines.append(f"  vbs demo-vm vm1{also}   # a small VM to attach volumes to (QEMU, in the background)")
    lines.append(f"Web console: {endpoints[0]}/console (sign in with the access key in {key_file})")
    return "\n".join(lines)
