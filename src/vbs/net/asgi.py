"""The shape every ASGI middleware of VBS has: it acts on HTTP requests and lets anything else
(lifespan events) through untouched."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class HttpMiddleware(ABC):
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.http(scope, receive, send)

    @abstractmethod
    async def http(self, scope: Any, receive: Any, send: Any) -> None:
        """Handle one HTTP request (``self.app`` is the rest of the stack)."""
