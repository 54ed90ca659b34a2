"""What every client command shares: the context the global options make (and its client of the
controller), KEY=VALUE tags, describe's pages, and an operation's outcome."""

# No ``from __future__ import annotations`` in the CLI's command modules: Typer reads every command's
# signature, and string annotations would be evaluated again on each run.
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import urlencode

import typer

from vbs.cli import output
from vbs.cli.client import wait_operation
from vbs.errors import InvalidParameter
from vbs.net.endpoints import DEFAULT_CONTROLLER_PORT

if TYPE_CHECKING:
    from vbs.net.api_client import ApiClient

# Options several client commands take, declared once.
TagOpt = Annotated[list[str] | None, typer.Option(help="KEY=VALUE, repeatable.")]
CommentOpt = Annotated[str, typer.Option()]
# A describe's: the ids, filters and one page.
IdsArg = Annotated[list[str] | None, typer.Argument()]
FilterOpt = Annotated[list[str] | None, typer.Option("--filter", help="name=value, repeatable.")]
MaxResultsOpt = Annotated[int | None, typer.Option()]
NextTokenOpt = Annotated[str | None, typer.Option()]


@dataclass
class Context:
    """What the global options say, and the client of the controller they name (made on first use)."""

    endpoint: str | None
    fmt: str
    ca_bundle: str | None = None
    _: KW_ONLY
    paginate: bool = True
    profile: str | None = None
    region: str | None = None
    _client: "ApiClient | None" = field(default=None, init=False, repr=False)

    @property
    def client(self) -> "ApiClient":
        """The client of the endpoints (checked here: the service commands do not use them)."""
        if self._client is None:
            from vbs.cli import profiles
            from vbs.net import endpoints
            from vbs.net.api_client import ApiClient
            from vbs.trust import credentials
            from vbs.trust.tls import client_verify

            # --endpoint and --ca-bundle (or their variables) first, then the named profile's.
            named = profiles.load(self.profile or "default")
            region = self.region or named.region
            endpoint = self.endpoint or named.endpoint_for(region) or f"http://127.0.0.1:{DEFAULT_CONTROLLER_PORT}"
            urls = endpoints.parse(endpoint, what="--endpoint (VBS_ENDPOINT)")
            key = credentials.for_client(urls, profile=self.profile)
            https = not all(url.startswith("http://") for url in urls)
            client = ApiClient(urls, key.bearer if key else None, timeout=60,
                               verify=client_verify(self.ca_bundle or named.ca_bundle, https=https))
            if region is not None:
                served = client.call("GET", "/v1/region")["region"]
                if served != region:
                    raise InvalidParameter(f"{endpoint} serves region {served}, not {region}: give the endpoint of "
                                           f"{region} (or endpoint_{region} in the profile)", code="RegionMismatch")
            self._client = client
        return self._client

    @property
    def interactive(self) -> bool:
        return output.resolve_format(self.fmt) == "table"


def tags(values: list[str] | None) -> dict[str, str]:
    """``--tag KEY=VALUE`` options as a dict."""
    out: dict[str, str] = {}
    for item in values or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"tag {item!r} must be KEY=VALUE")
        out[key] = value
    return out


def pages(c: Context, path: str, collection: str, params: list[tuple[str, str]]) -> dict[str, Any]:
    """Every page of a describe, merged: the API answers at most 1,000 items a call."""
    body = c.client.call("GET", f"{path}?" + urlencode(params))
    if not c.paginate:
        return dict(body)  # --no-paginate: this page and its next token
    items = list(body[collection])
    while body.get("next_token"):
        body = c.client.call("GET", f"{path}?" + urlencode([*params, ("next_token", body["next_token"])]))
        items += body[collection]
    return {collection: items}


def describe(c: Context, collection: str, id_param: str, resource_ids: list[str] | None,
             filters: list[str] | None, max_results: int | None, next_token: str | None,
             columns: list[output.Column]) -> None:
    """Everything that matches, or one page (and the next token) where --max-results or --next-token ask for it."""
    params = [(id_param, v) for v in resource_ids or []] + [("filter", f) for f in filters or []]
    if max_results is None and next_token is None:
        body = pages(c, f"/v1/{collection}", collection, params + ([] if resource_ids else [("max_results", "1000")]))
    else:
        if max_results is not None:
            params.append(("max_results", str(max_results)))
        if next_token:
            params.append(("next_token", next_token))
        body = c.client.call("GET", f"/v1/{collection}?" + urlencode(params))
    _emit_page(c, body, collection, columns)


def describe_all(c: Context, collection: str, path: str, columns: list[output.Column]) -> None:
    """Every item of a collection that takes no filters."""
    _emit_page(c, pages(c, path, collection, [("max_results", "1000")]), collection, columns)


def _emit_page(c: Context, body: dict[str, Any], collection: str, columns: list[output.Column]) -> None:
    """A describe's answer: whole for a script; for a reader, its items and the next token if there is one."""
    if output.is_machine(c.fmt):
        output.emit(body, c.fmt)
        return
    output.emit(body[collection], c.fmt, columns)
    if body.get("next_token"):
        print(f"next token: {body['next_token']}")


def emit_operation(c: Context, started: dict[str, Any], *, wait: bool, label: str) -> None:
    """Print a started move with its operation's status and error (once it ends, with ``wait``); exit 1
    if the operation failed."""
    if wait:
        op = wait_operation(c.client, started["operation_id"], label=label, show=c.interactive)
    else:
        op = c.client.call("GET", f"/v1/operations/{started['operation_id']}")
    output.emit({**started, "status": op["status"], "error": op["error"]}, "json")
    if op["status"] in ("rolled-back", "failed"):
        raise typer.Exit(1)
