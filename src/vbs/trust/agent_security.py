"""What both agents do before they serve: refuse to start unsafely, own their files, know their token.

An agent's credential is its own node token (vbs.trust.node_credentials): it answers only a caller that
presents it (the controller), and presents it in its heartbeats. With TLS files it serves HTTPS,
requires the controller's client certificate, and verifies the controller against the CA.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from starlette.responses import Response

from vbs.config import _AgentSection
from vbs.net.web import ApiClient, Scope, agent_auth
from vbs.trust.fail_closed import check_start, harden
from vbs.trust.fencing import FenceBook
from vbs.trust.node_credentials import TokenSource
from vbs.trust.tls import TlsFiles


@dataclass(frozen=True)
class AgentSecurity:
    tls: TlsFiles | None
    token: TokenSource
    insecure: bool
    # The highest fencing token seen per resource (vbs.trust.fencing): a controller that lost an operation
    # to another one is refused.
    fences: FenceBook
    # This agent as a refusal names it ("storage agent storage-1").
    me: str = "this agent"

    @property
    def auth(self) -> Callable[[Scope], Response | None]:
        return agent_auth(self.token, insecure=self.insecure, fences=self.fences, me=self.me)

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None and self.tls.serves else "http"

    def controller(self, urls: Sequence[str], *, label: str) -> ApiClient:
        """The client of every call this agent makes to its controllers: it fails over among ``urls``."""
        verify = self.tls.client_context() if self.tls is not None else True
        return ApiClient(urls, self.token.current, verify=verify, label=label)


def prepare(service: str, cfg: _AgentSection, *dirs: Path, node_name: str,
            fence_file: Path | None = None) -> AgentSecurity:
    """``fence_file`` keeps the fence book across restarts (in a state dir of the agent's own)."""
    token = TokenSource(cfg.agent_token, cfg.agent_token_file)
    tls = check_start(service, cfg, has_credentials=token.configured,
                      what="node token (VBS_AGENT_TOKEN or agent_token_file; `vbs node-token` prints it)")
    harden(*dirs)
    return AgentSecurity(tls, token, cfg.insecure, FenceBook(fence_file), me=f"{service} {node_name}")
