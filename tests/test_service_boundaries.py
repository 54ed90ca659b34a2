"""Nothing crosses between the three services but ``vbs.wire`` (docs/architecture.md): no module of the
controller, the storage agent or the host agent imports another service's package. Read from the source
with ``ast``, so an import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parent.parent / "src" / "vbs"
SERVICES = ("controller", "storage", "host")


def imported(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_no_service_imports_another_services_package() -> None:
    crossings = []
    for service in SERVICES:
        modules = sorted((SRC / service).rglob("*.py"))
        assert modules, f"no modules under {service}/"
        for path in modules:
            for name in imported(path):
                parts = name.split(".")
                if parts[0] == "vbs" and len(parts) > 1 and parts[1] in SERVICES and parts[1] != service:
                    crossings.append(f"{path.relative_to(SRC)} imports {name}")
    assert crossings == [], "\n".join(crossings)
