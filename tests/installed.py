"""VBS as an operator installs it (docs/install.md): the wheel ``python -m build`` makes from this tree, a
wheelhouse of it and its dependencies, and a fresh venv of Debian's python3 that installs from that
wheelhouse alone (``pip install --no-index``). The install tests run the ``vbs`` of that venv, never
this tree's.

Why a wheelhouse: it is what docs/install.md has an operator do (build once, install on every node
without reaching an index), and it keeps the install itself offline. Making it is the one step that
asks PyPI (``pip wheel``, through pip's cache, so a second session fetches and builds nothing).

A past release installs the same way from its own tree, taken from this repository's history by its commit
(``release_tree``): tests/test_rolling_upgrade.py runs it beside this tree's.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import vbs

REPO = Path(__file__).resolve().parent.parent
# The interpreter docs/install.md installs VBS with (Debian's python3 and python3-venv).
DEBIAN_PYTHON = Path("/usr/bin/python3")
UNITS = REPO / "deploy" / "systemd"
ROLES = {"controller": "vbs-controller.service", "storage-agent": "vbs-storage-agent.service",
         "host-agent": "vbs-host-agent.service"}
UNIT_VBS, UNIT_CONFIG = "/opt/vbs/bin/vbs", "/etc/vbs/vbs.toml"
# Building and fetching compete with everything else on a loaded machine: generous.
BUILD_TIMEOUT_S = 1800


def run(argv: list[str | Path], *, env: dict[str, str] | None = None, timeout: float = BUILD_TIMEOUT_S,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (no shell); fail with its output if it fails."""
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    assert proc.returncode == 0, f"{' '.join(map(str, argv))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    """An environment without this session's VBS settings or Python paths, its home in ``home``."""
    kept = {k: v for k, v in os.environ.items()
            if not k.startswith(("VBS_", "PYTHON", "PIP_", "VIRTUAL_ENV", "AWS_")) and k not in ("XDG_CONFIG_HOME",)}
    return {**kept, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), **extra}


@dataclass(frozen=True)
class Release:
    """A release of VBS in this repository's history: its version and the commit it was made from."""

    version: str
    commit: str


# The first release (CHANGELOG.md, "0.1.0"), found by its commit: a checkout (CI's too) may hold the history
# without the tag v0.1.0.
FIRST_RELEASE = Release("0.1.0", "f439ad9c1b221cb50594a553ca86463543df6798")


def this_tree(out: Path) -> Path:
    """A copy of this tree's sources in ``out``/source (a build writes build/ and *.egg-info beside its sources,
    and two builds of one tree at once would share them)."""
    source = out / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return source


def release_tree(release: Release, out: Path) -> Path:
    """The sources of ``release`` in ``out``/source, from this repository's history (``git archive`` of its
    commit); fails, saying what to fetch, where the history lacks that commit."""
    git = ["git", "-C", str(REPO)]
    has = subprocess.run([*git, "cat-file", "-e", f"{release.commit}^{{commit}}"], capture_output=True, timeout=60)
    assert has.returncode == 0, (
        f"this repository's history lacks commit {release.commit}, release {release.version}: fetch the whole "
        f"history (git fetch --unshallow) or the tag v{release.version}")
    said = run([*git, "show", f"{release.commit}:src/vbs/__init__.py"]).stdout
    assert f'\n__version__ = "{release.version}"\n' in f"\n{said}", (
        f"commit {release.commit} is not release {release.version}: its src/vbs/__init__.py says\n{said}")
    archive = out / f"vbs-{release.version}.tar"
    run([*git, "archive", "--format=tar", f"--output={archive}", release.commit, "pyproject.toml", "README.md", "src"])
    source = out / "source"
    with tarfile.open(archive) as tar:
        tar.extractall(source, filter="data")
    archive.unlink()
    return source


def build_wheel(source: Path, out: Path) -> Path:
    """The wheel of the tree ``source``, in ``out``/dist."""
    dist = out / "dist"
    run([sys.executable, "-m", "build", "--wheel", "--outdir", dist, source])
    (wheel,) = dist.glob("vbs-*.whl")
    return wheel


@dataclass(frozen=True)
class Installed:
    """A venv with VBS ``version`` installed from its wheel."""

    root: Path
    version: str
    wheel: Path
    wheelhouse: Path
    venv: Path

    @property
    def vbs(self) -> Path:
        return self.venv / "bin" / "vbs"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


def install(root: Path, release: Release | None = None) -> Installed:
    """Build the wheel of this tree (or of ``release``), its wheelhouse, and a fresh venv that installs it
    from the wheelhouse alone; everything readable by every user (umask 022, whatever this process's was:
    a machine's /opt/vbs is, and a service may run it as a user of its own)."""
    previous = os.umask(0o022)
    try:
        return _install(root, release)
    finally:
        os.umask(previous)


def _install(root: Path, release: Release | None) -> Installed:
    version = vbs.__version__ if release is None else release.version
    wheel = build_wheel(this_tree(root) if release is None else release_tree(release, root), root)
    assert wheel.name == f"vbs-{version}-py3-none-any.whl", wheel
    wheelhouse = root / "wheelhouse"
    home = root / "home"
    home.mkdir()
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", wheelhouse, wheel],
        env=clean_env(home, PIP_CACHE_DIR=str(Path.home() / ".cache" / "pip")))
    venv = root / "venv"
    run([DEBIAN_PYTHON, "-m", "venv", venv], env=clean_env(home))
    run([venv / "bin" / "pip", "install", "--quiet", "--no-index", "--find-links", wheelhouse, f"vbs=={version}"],
        env=clean_env(home))
    # What the venv imports (0.1.0 has no `vbs --version`).
    said = run([venv / "bin" / "python", "-c", "import vbs; print(vbs.__version__)"], env=clean_env(home), cwd=root)
    assert said.stdout == f"{version}\n", said.stdout
    return Installed(root, version, wheel, wheelhouse, venv)


def newer_release(installed: Installed, name: str, *, release: str, wire: int) -> Path:
    """Another venv with the same wheel, made to be a later release that speaks wire version ``wire`` and
    serves no older one (its vbs/__init__.py and vbs/versions.py edited after the install): what a machine
    upgraded across a change of wire version runs. Its ``vbs``."""
    venv = installed.root / name
    env = clean_env(installed.root / "home")
    run([DEBIAN_PYTHON, "-m", "venv", venv], env=env)
    run([venv / "bin" / "pip", "install", "--quiet", "--no-index", "--find-links", installed.wheelhouse,
         f"vbs=={installed.version}"], env=env)
    (package,) = venv.glob("lib/python3*/site-packages/vbs")
    edits = ((package / "__init__.py", f'__version__ = "{installed.version}"', f'__version__ = "{release}"'),
             (package / "versions.py", "WIRE_VERSION = 1\n", f"WIRE_VERSION = {wire}\n"),
             (package / "versions.py", "OLDEST_WIRE = 1\n", f"OLDEST_WIRE = {wire}\n"))
    for path, old, new in edits:
        text = path.read_text()
        assert text.count(old) == 1, f"{path} has no single {old!r}"
        path.write_text(text.replace(old, new))
    # pip compiled them at install: an edit within the same second and of the same size would go unseen.
    shutil.rmtree(package / "__pycache__")
    said = run([venv / "bin" / "vbs", "--version"], env=env).stdout
    assert said == f"vbs {release} (wire version {wire})\n", said
    return venv / "bin" / "vbs"


def unit_lines(name: str, key: str) -> list[str]:
    """The values of ``key`` in the unit ``name`` of deploy/systemd."""
    return [line.split("=", 1)[1] for line in (UNITS / name).read_text().splitlines() if line.startswith(f"{key}=")]


def exec_start(role: str, vbs_path: Path, config: Path) -> list[str]:
    """The argv the unit of ``role`` starts: its ExecStart, with ``vbs_path`` for /opt/vbs/bin/vbs and
    ``config`` for /etc/vbs/vbs.toml (what systemd would run on a machine installed as docs/install.md says)."""
    (line,) = unit_lines(ROLES[role], "ExecStart")
    return [str(vbs_path) if a == UNIT_VBS else str(config) if a == UNIT_CONFIG else a for a in shlex.split(line)]
