"""Lifecycle policy commands (docs/lifecycle-policies.md): create, list, show, change and delete snapshot
policies, and show a policy's runs (when each was due, the controller that ran it, its snapshots, its error).
A policy's document is AWS's PolicyDetails, as JSON (the same file ``aws dlm create-lifecycle-policy
--policy-details file://…`` takes)."""

# No ``from __future__ import annotations`` here: Typer reads every command's signature, and string
# annotations would be evaluated again on each run (twice per command), most of a --help's time.
import json
from pathlib import Path
from typing import Annotated, Any

import typer

from vbs.cli import output
from vbs.cli.context import Context, TagOpt, tags
from vbs.errors import InvalidParameter

# Registered into the app by vbs.cli.main, in the order of ``vbs --help``.
commands = typer.Typer()

DOCUMENT_MAX = 64 * 1024
POLICY_COLUMNS: list[output.Column] = [
    ("PolicyId", lambda p: p["policy_id"]),
    ("State", lambda p: p["state"]),
    ("Description", lambda p: p["description"]),
    ("Schedules", lambda p: ", ".join(_cadence(s) for s in p["policy_details"].get("Schedules", []))),
    ("LastRun", lambda p: _last(p.get("last_run"))),
]
RUN_COLUMNS: list[output.Column] = [
    ("Due", lambda r: r["due_at"]),
    ("Schedule", lambda r: r["schedule_name"]),
    ("Status", lambda r: r["status"]),
    ("Controller", lambda r: r.get("controller") or ""),
    ("Snapshots", lambda r: " ".join(x for ids in r["snapshots"].values() for x in ids)),
    ("Retired", lambda r: " ".join(r["retired"])),
    ("Error", lambda r: r.get("error") or ""),
]
DetailsOpt = Annotated[Path | None, typer.Option("--policy-details", help="A file of AWS's PolicyDetails JSON.")]
DescriptionOpt = Annotated[str | None, typer.Option("--description")]
StateOpt = Annotated[str | None, typer.Option("--state", help="ENABLED or DISABLED.")]


def _cadence(schedule: dict[str, Any]) -> str:
    rule = schedule.get("CreateRule", {})
    every = rule.get("CronExpression") or f"every {rule.get('Interval')} {str(rule.get('IntervalUnit', '')).lower()}"
    return f"{schedule.get('Name')}: {every}"


def _last(run: dict[str, Any] | None) -> str:
    if not run:
        return "(none yet)"
    return f"{run['due_at']} {run['status']}" + (f": {run['error']}" if run.get("error") else "")


def _details(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        text = path.read_bytes()[:DOCUMENT_MAX + 1]
    except OSError as exc:
        raise InvalidParameter(f"cannot read {path}: {exc.strerror}") from None
    if len(text) > DOCUMENT_MAX:
        raise InvalidParameter(f"{path} is larger than {DOCUMENT_MAX} bytes")
    try:
        found = json.loads(text)
    except ValueError as exc:
        raise InvalidParameter(f"{path} is not JSON: {exc}") from None
    if not isinstance(found, dict):
        raise InvalidParameter(f"{path} must hold a JSON object (PolicyDetails)")
    return found


@commands.command("create-lifecycle-policy")
def create_lifecycle_policy(ctx: typer.Context, policy_details: DetailsOpt = None, description: DescriptionOpt = None,
                            state: StateOpt = "ENABLED", tag: TagOpt = None) -> None:
    """A snapshot policy: volumes or instances chosen by tags, snapshotted on a schedule, the old ones retired."""
    c: Context = ctx.obj
    body = {"policy_details": _details(policy_details), "description": description or "", "state": state,
            "tags": tags(tag)}
    output.emit(c.client.call("POST", "/v1/lifecycle-policies", body), c.fmt, POLICY_COLUMNS)


@commands.command("get-lifecycle-policies")
def get_lifecycle_policies(ctx: typer.Context, state: StateOpt = None) -> None:
    """Your lifecycle policies, each with its last run."""
    c: Context = ctx.obj
    out = c.client.call("GET", "/v1/lifecycle-policies", params=[("state", state)] if state else [])
    output.emit(out if output.is_machine(c.fmt) else out["policies"], c.fmt, POLICY_COLUMNS)


@commands.command("get-lifecycle-policy")
def get_lifecycle_policy(ctx: typer.Context, policy_id: str) -> None:
    """One lifecycle policy: its document, state, status message and last run."""
    c: Context = ctx.obj
    output.emit(c.client.call("GET", f"/v1/lifecycle-policies/{policy_id}"), c.fmt, POLICY_COLUMNS)


@commands.command("update-lifecycle-policy")
def update_lifecycle_policy(ctx: typer.Context, policy_id: str, policy_details: DetailsOpt = None,
                            description: DescriptionOpt = None, state: StateOpt = None) -> None:
    """Change a policy's document, description or state (ENABLED, DISABLED)."""
    c: Context = ctx.obj
    body = {k: v for k, v in (("policy_details", _details(policy_details)), ("description", description),
                              ("state", state)) if v is not None}
    output.emit(c.client.call("PATCH", f"/v1/lifecycle-policies/{policy_id}", body), c.fmt, POLICY_COLUMNS)


@commands.command("delete-lifecycle-policy")
def delete_lifecycle_policy(ctx: typer.Context, policy_id: str) -> None:
    """Delete a policy and its runs (the snapshots it made stay)."""
    c: Context = ctx.obj
    output.emit(c.client.call("DELETE", f"/v1/lifecycle-policies/{policy_id}"), c.fmt)


@commands.command("describe-policy-runs")
def describe_policy_runs(ctx: typer.Context, policy_id: str,
                         max_results: Annotated[int, typer.Option("--max-results")] = 20) -> None:
    """A policy's newest runs: due time, status, the controller that ran it, its snapshots and errors."""
    c: Context = ctx.obj
    out = c.client.call("GET", f"/v1/lifecycle-policies/{policy_id}/runs",
                        params=[("max_results", str(max_results))])
    output.emit(out if output.is_machine(c.fmt) else out["runs"], c.fmt, RUN_COLUMNS)
