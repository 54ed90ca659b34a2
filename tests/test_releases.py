"""The releases tests/test_rolling_upgrade.py installs are found in this repository's history by their commit
(tests/installed.py ``release_tree``), checked against the version they say, and a history without one fails
saying what to fetch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.installed import FIRST_RELEASE, REPO, Release, release_tree, run

pytestmark = pytest.mark.unit


def test_the_first_release_is_0_1_0_and_its_tree_says_so(tmp_path: Path) -> None:
    assert FIRST_RELEASE.version == "0.1.0" and re.fullmatch(r"[0-9a-f]{40}", FIRST_RELEASE.commit)
    source = release_tree(FIRST_RELEASE, tmp_path)
    assert '\n__version__ = "0.1.0"\n' in (source / "src" / "vbs" / "__init__.py").read_text()
    assert 'version = "0.1.0"' in (source / "pyproject.toml").read_text()
    assert (source / "src" / "vbs" / "controller" / "db" / "migrations" / "env.py").is_file()
    assert not (source / "tests").exists()


def test_the_first_release_is_in_the_changelog() -> None:
    assert "\n## 0.1.0\n" in (REPO / "CHANGELOG.md").read_text()


def test_a_history_without_the_release_s_commit_fails_saying_what_to_fetch(tmp_path: Path) -> None:
    missing = Release("0.1.0", "0" * 40)
    with pytest.raises(AssertionError, match=r"lacks commit 0{40}, release 0\.1\.0: fetch the whole history "
                                             r"\(git fetch --unshallow\) or the tag v0\.1\.0"):
        release_tree(missing, tmp_path)


def test_a_commit_of_another_version_is_not_taken_for_the_release(tmp_path: Path) -> None:
    head = run(["git", "-C", REPO, "rev-parse", "HEAD"]).stdout.strip()
    with pytest.raises(AssertionError, match=rf"commit {head} is not release 0\.1\.0"):
        release_tree(Release("0.1.0", head), tmp_path)
