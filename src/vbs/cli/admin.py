"""Administration: the consistency check, access keys, operations, node tokens, certificates and the
rotation of keys."""

# No ``from __future__ import annotations`` here: Typer reads every command's signature, and string
# annotations would be evaluated again on each run (twice per command), most of a --help's time.
from pathlib import Path
from typing import Annotated, Any

import typer

from vbs.cli import output
from vbs.cli.context import Context
from vbs.errors import InvalidParameter

# Registered into the app by vbs.cli.main, in the order of ``vbs --help``.
commands = typer.Typer()


@commands.command("check")
def check(
    ctx: typer.Context,
    repair: Annotated[bool, typer.Option("--repair", help="Repair what drifted (orphans after their grace).")] = False,
    now: Annotated[bool, typer.Option("--now", help="With --repair: remove orphans and mark the volumes of lost "
                                      "pools without the grace period.")]
    = False,
    store: Annotated[bool, typer.Option("--store/--no-store", help="Check the stored snapshots in their "
                                        "snapshot stores: manifests read, chunks found.")] = True,
    deep: Annotated[bool, typer.Option("--deep", help="Fetch every stored chunk and hash it again (reads the "
                                       "whole store).")] = False,
) -> None:
    """Compare what the agents really have with the DB (orphans, missing files, exports and disks), and
    check the snapshot stores."""
    c: Context = ctx.obj
    if repair and deep:
        raise InvalidParameter("--deep checks the snapshot stores, which --repair does not: run them one at a time")
    report = (c.client.call("POST", f"/v1/admin/reconcile?now={str(now).lower()}") if repair
              else c.client.call("GET", f"/v1/admin/check?store={str(store or deep).lower()}"
                                 f"&deep={str(deep).lower()}"))
    if output.is_machine(c.fmt):
        output.emit(report, "json")
    else:
        print(f"checked {report['storage_nodes']} storage node(s) and {report['hosts']} host(s): "
              + ("everything agrees" if report["clean"] else f"{len(report['findings'])} finding(s)"))
        if report["findings"]:
            output.emit(report["findings"], c.fmt, output.FINDING_COLUMNS)
        _emit_pool_details(report.get("pools", []), c.fmt)
        _emit_stores(report, c.fmt)
    if not report["clean"] and not repair:
        raise typer.Exit(1)


def _emit_pool_details(pools: list[dict[str, Any]], fmt: str) -> None:
    """``vbs check``'s tables of what pools keep besides volumes: trash, clone chains, flattens."""
    for key, columns, title in (("trash", output.TRASH_COLUMNS, "trash (images of deleted volumes)"),
                                ("chains", output.CHAIN_COLUMNS, "clone chains deeper than 1"),
                                ("flattens", output.FLATTEN_COLUMNS, "flattens")):
        rows = [{"node": p["node"], "pool": p["pool"], **item} for p in pools for item in p[key]]
        if rows:
            output.emit(rows, fmt, columns, title=title)


def _emit_stores(report: dict[str, Any], fmt: str) -> None:
    """``vbs check``'s tables of the snapshot stores: each store checked, and snapshots not in it yet."""
    if report.get("stores"):
        output.emit(report["stores"], fmt, output.STORE_CHECK_COLUMNS, title="snapshot stores")
    if report.get("unstored"):
        output.emit(report["unstored"], fmt, output.UNSTORED_COLUMNS, title="snapshots not in their store yet")


@commands.command("create-key")
def create_key(
    ctx: typer.Context,
    tenant: Annotated[str, typer.Option(help="The tenant whose volumes and snapshots the key sees.")],
    role: Annotated[str, typer.Option(help="admin | user | metrics (reads /metrics only)")] = "user",
) -> None:
    """Make an access key (admin only); its secret is shown this once."""
    c: Context = ctx.obj
    key = c.client.call("POST", "/v1/keys", {"tenant": tenant, "role": role})
    if output.is_machine(c.fmt):
        output.emit({"access_key_id": key["access_key_id"], "secret_access_key": key["secret_access_key"]}, "json")
    else:
        print(f"access key id:     {key['access_key_id']}\nsecret access key: {key['secret_access_key']}\n"
              f"tenant: {key['tenant']}, role: {key['role']} (the secret is not shown again)")


@commands.command("delete-key")
def delete_key(ctx: typer.Context, access_key_id: str) -> None:
    """Delete an access key made by create-key (admin only); requests signed with it are refused at once."""
    c: Context = ctx.obj
    output.emit(c.client.call("DELETE", f"/v1/keys/{access_key_id}"), "json")


@commands.command("describe-keys")
def describe_keys(ctx: typer.Context) -> None:
    """Access keys, their tenants and roles, never their secrets (admin only)."""
    c: Context = ctx.obj
    body = c.client.call("GET", "/v1/keys")
    output.emit(body if output.is_machine(c.fmt) else body["keys"], c.fmt, output.KEY_COLUMNS)


@commands.command("describe-operation")
def describe_operation(ctx: typer.Context, operation_id: str) -> None:
    """One workflow's steps and their states."""
    c: Context = ctx.obj
    output.emit(c.client.call("GET", f"/v1/operations/{operation_id}"), "json")


NodeKindOpt = Annotated[str, typer.Option("--kind", help="storage | host")]


@commands.command("node-token")
def node_token(
    name: Annotated[str, typer.Argument(help="The node's name (its --node-name).")],
    kind: NodeKindOpt = "host",
    data_dir: Annotated[Path, typer.Option(help="The controller's data dir.")] = Path("./var"),
) -> None:
    """Print a node's token (run where the controller's data dir is); give it to that agent only."""
    from vbs.trust.node_credentials import NodeKeyring

    print(NodeKeyring.for_data_dir(data_dir).ensure().token(kind, name))


@commands.command("bootstrap-key")
def bootstrap_key(
    data_dir: Annotated[Path, typer.Option(help="The controller's data dir.")] = Path("./var"),
) -> None:
    """Make the install's first access key (an admin of tenant default) in DATA_DIR/credentials, and the
    secrets every controller of the install shares (node-secret, master.key), each unless it exists (0600);
    run where the controller's data dir is, before its first start."""
    from vbs.controller.auth.keys import MasterKey
    from vbs.trust import credentials
    from vbs.trust.fail_closed import harden
    from vbs.trust.node_credentials import NodeKeyring

    harden(data_dir)
    path = data_dir / "credentials"
    key = credentials.ensure_file(path, env={})
    NodeKeyring.for_data_dir(data_dir).ensure()
    MasterKey(data_dir / "master.key").ensure()
    print(f"access key {key.access_key_id} in {path} (0600): the controller's first key; the CLI uses it with "
          f"VBS_CREDENTIALS_FILE={path}\nnode secret {data_dir / 'node-secret'}, master key {data_dir / 'master.key'} "
          "(0600): copy all three to every other controller of the install")


@commands.command("issue-cert")
def issue_cert(
    name: Annotated[str, typer.Argument(help="The node's name (its --node-name): the certificate's CN.")],
    host: Annotated[list[str], typer.Option("--host", help="An address or DNS name the node serves on and "
                                                          "reports (repeat).")],
    data_dir: Annotated[Path, typer.Option(help="The data dir that holds the install's CA.")] = Path("./var"),
    out_dir: Annotated[Path | None, typer.Option(help="Where to write NAME.pem and NAME-key.pem.")] = None,
) -> None:
    """Issue a node's certificate from the install's CA (run where the CA is; made on first use). The node
    serves with it, presents it to the controller, and may report only the addresses it names."""
    from vbs.trust.fail_closed import harden
    from vbs.trust.pki import CertificateAuthority

    harden(data_dir)
    ca = CertificateAuthority.in_data_dir(data_dir)
    directory = out_dir or data_dir / "tls"
    cert, key = directory / f"{name}.pem", directory / f"{name}-key.pem"
    if cert.exists() or key.exists():
        raise InvalidParameter(f"{cert} or {key} exists already: remove them to issue a new certificate")
    files = ca.issue(name, host, cert, key)
    print(f"certificate {files.cert}\nkey         {files.key} (0600)\nCA          {files.ca}\n"
          f"run the node with --tls-cert {files.cert} --tls-key {files.key} --tls-ca {files.ca}")


@commands.command("rotate-keys")
def rotate_keys(
    ctx: typer.Context,
    node: Annotated[str | None, typer.Option(help="Rotate this node's token.")] = None,
    access_key: Annotated[str | None, typer.Option(help="Make a successor of this access key (admin).")] = None,
    master_key: Annotated[bool, typer.Option("--master-key", help="Re-seal every access key's secret and every "
                                                                  "volume data key under a new master key.")] = False,
    kind: NodeKindOpt = "host",
    data_dir: Annotated[Path, typer.Option(help="The controller's data dir.")] = Path("./var"),
    database_url: Annotated[str | None, typer.Option(help="The controller's database, if not in the data dir.")] = None,
    write_to: Annotated[Path | None, typer.Option(help="Write the new node token to this file (0600).")] = None,
    revoke: Annotated[bool, typer.Option("--revoke", help="Invalidate the node's tokens at once.")] = False,
) -> None:
    """New credentials without downtime: a node's token (the old one is accepted until the node uses the
    new one), an access key's successor (the old key works until `vbs delete-key`), or the master key."""
    chosen = [name for name, given in (("--node", node), ("--access-key", access_key), ("--master-key", master_key))
              if given]
    if len(chosen) != 1:
        raise InvalidParameter("say what to rotate: one of --node NAME, --access-key ID, --master-key")
    if access_key is not None:
        _rotate_access_key(ctx.obj, access_key)
    elif master_key:
        _rotate_master_key(data_dir, database_url)
    elif node is not None:
        _rotate_node_token(node, kind, data_dir, write_to, revoke)


def _rotate_access_key(c: Context, access_key_id: str) -> None:
    key = c.client.call("POST", f"/v1/keys/{access_key_id}/rotate")
    if output.is_machine(c.fmt):
        output.emit({"access_key_id": key["access_key_id"], "secret_access_key": key["secret_access_key"],
                     "replaces": access_key_id}, "json")
    else:
        print(f"access key id:     {key['access_key_id']}\nsecret access key: {key['secret_access_key']}\n"
              f"tenant: {key['tenant']}, role: {key['role']} (the secret is not shown again)\n"
              f"{access_key_id} keeps working: switch the clients over, then `vbs delete-key {access_key_id}`")


def _rotate_master_key(data_dir: Path, database_url: str | None) -> None:
    from vbs import config as cfgmod
    from vbs.controller.app import database_for
    from vbs.controller.auth.keys import MasterKey

    cfg = cfgmod.load(cfgmod.ControllerConfig, "controller",
                      overrides={"data_dir": data_dir, "database_url": database_url})
    db = database_for(cfg)
    try:
        count = MasterKey(cfg.master_key_file or cfg.data_dir / "master.key").rotate(db)
    finally:
        db.dispose()
    print(f"{count} secrets (access keys, volume data keys) re-sealed under a new master key; a running controller "
          "reads it at once")


def _rotate_node_token(node: str, kind: str, data_dir: Path, write_to: Path | None, revoke: bool) -> None:
    from vbs.system.files import write_private
    from vbs.trust.node_credentials import NodeKeyring

    keyring = NodeKeyring.for_data_dir(data_dir).ensure()
    if revoke:
        keyring.revoke(kind, node)
        print(f"every token of {kind} node {node} is revoked; `vbs node-token {node} --kind {kind}` prints its new one")
        return
    token = keyring.rotate(kind, node)
    if write_to is not None:
        write_private(write_to, token + "\n")
        print(f"new token of {kind} node {node} written to {write_to}; the old one is accepted until the node uses it")
    else:
        print(token)
