"""EC2's XML answers: ``<ActionResponse xmlns=…><requestId/>…</ActionResponse>`` and the error envelope.

Values are built as nested dicts and lists: a dict becomes child elements, a list becomes ``<item>``
elements (EC2's ``…Set`` convention), None is left out, booleans are ``true``/``false``.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any
from xml.sax.saxutils import escape

NAMESPACE = "http://ec2.amazonaws.com/doc/2016-11-15/"

# Characters XML 1.0 cannot carry at all, even escaped.
_INVALID_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def timestamp(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime):
        return timestamp(value)
    return escape(_INVALID_XML.sub("\ufffd", str(value)))


def _render(name: str, value: Any, out: list[str]) -> None:
    if value is None:
        return
    if isinstance(value, dict):
        out.append(f"<{name}>")
        for key, child in value.items():
            _render(key, child, out)
        out.append(f"</{name}>")
    elif isinstance(value, list):
        out.append(f"<{name}>")
        for item in value:
            _render("item", item, out)
        out.append(f"</{name}>")
    else:
        out.append(f"<{name}>{_text(value)}</{name}>")


def response(action: str, request_id: str, body: dict[str, Any]) -> str:
    out = ['<?xml version="1.0" encoding="UTF-8"?>', f'<{action}Response xmlns="{NAMESPACE}">',
           f"<requestId>{request_id}</requestId>"]
    for key, value in body.items():
        _render(key, value, out)
    out.append(f"</{action}Response>")
    return "".join(out)


def error(code: str, message: str, request_id: str) -> str:
    return ('<?xml version="1.0" encoding="UTF-8"?>'
            f"<Response><Errors><Error><Code>{_text(code)}</Code><Message>{_text(message)}</Message></Error>"
            f"</Errors><RequestID>{request_id}</RequestID></Response>")
