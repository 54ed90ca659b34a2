"""The web console at /console, in a real browser: Debian's chromium driven by Playwright.

A real ``vbs up`` with a QEMU test guest behind its host agent; the browser signs in, creates a volume
and watches its operation run, filters the table, attaches the volume to the guest picked from a list
(the guest sees the disk), snapshots and clones it (the lineage shows), detaches, and bulk-deletes.
Every effect is checked through the REST API too, not only in the page. Screenshots go to
``$VBS_TEST_ARTIFACTS/console`` (default ``tests/artifacts/console``); with ``VBS_DOCS_SCREENSHOT=1``
``docs/console.png`` (shown in docs/console.md) is taken again as well.

The unit tests at the top check what needs no browser: the pages hold no inline script and the
module never parses API data as HTML, and the edge lets the console's files through without a key
and nothing else.
"""

from __future__ import annotations

import http.client
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from playwright.sync_api import expect

from tests import clouds
from tests.conftest import Vbs, wait_until
from vbs.controller import console
from vbs.controller.rest import edge
from vbs.ids import virtio_serial
from vbs.rigs.testguest import TestGuest

ROOT = Path(__file__).resolve().parent.parent
STATIC = ROOT / "src" / "vbs" / "controller" / "console" / "static"
CHROMIUM = "/usr/bin/chromium"
MiB = 1 << 20
TIMEOUT_MS = 30_000


def artifacts() -> Path:
    base = Path(os.environ.get("VBS_TEST_ARTIFACTS") or ROOT / "tests" / "artifacts")
    path = base / "console"
    path.mkdir(parents=True, exist_ok=True)
    return path


# -- no browser needed ----------------------------------------------------------------------------


@pytest.mark.unit
def test_the_page_has_no_inline_script_and_the_module_never_parses_api_data_as_html() -> None:
    page = (STATIC / "index.html").read_text()
    scripts = re.findall(r"<script\b[^>]*>(.*?)</script>", page, flags=re.S | re.I)
    assert scripts == [""], "one external module, no inline script"
    assert re.search(r'<script type="module" src="console.js">', page)
    assert not re.search(r"\son[a-z]+\s*=", page, flags=re.I), "no inline event handler"
    assert not re.search(r"(src|href)=\"(https?:)?//", page), "nothing from another origin"
    module = (STATIC / "console.js").read_text()
    for sink in (".innerHTML", ".outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function",
                 "createContextualFragment", "DOMParser"):
        assert sink not in module, sink
    assert "localStorage.setItem(KEY" not in module and "sessionStorage.setItem(KEY_STORAGE" in module


@pytest.mark.unit
def test_the_edge_lets_only_the_console_files_through_without_a_key() -> None:
    # Neither is consulted for a request without credentials on a public path.
    check = edge.pre_auth(cast(Any, None), cast(Any, None), insecure=False, node_certs=False)

    def refused(method: str, path: str) -> bool:
        return check({"type": "http", "method": method, "path": path, "headers": []}) is not None

    for path in ("/console", "/console/", "/console/console.js", "/console/console.css"):
        assert not refused("GET", path), path
        assert not refused("HEAD", path), path
    for method, path in (("POST", "/console/"), ("PUT", "/console/console.js"), ("DELETE", "/console/x"),
                         ("GET", "/consoles"), ("GET", "/console.js"), ("GET", "/v1/volumes"),
                         ("GET", "/openapi.json"), ("POST", "/")):
        assert refused(method, path), (method, path)
    assert console.is_console_path("/console/a") and not console.is_console_path("/consolex")


BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"


@pytest.mark.unit
def test_a_browser_at_the_root_is_sent_to_the_console_and_ec2_clients_are_not() -> None:
    check = edge.pre_auth(cast(Any, None), cast(Any, None), insecure=False, node_certs=False)

    def answer(method: str, accept: str | None, query: bytes = b"", authz: str | None = None) -> Any:
        headers = [(b"accept", accept.encode())] if accept is not None else []
        if authz is not None:
            headers.append((b"authorization", authz.encode()))
        return check({"type": "http", "method": method, "path": "/", "query_string": query, "headers": headers})

    for method in ("GET", "HEAD"):
        r = answer(method, BROWSER_ACCEPT)
        assert r is not None and r.status_code == 303 and r.headers["location"] == "/console/"
    for method, accept, query in (("POST", BROWSER_ACCEPT, b""), ("GET", None, b""), ("GET", "*/*", b""),
                                  ("GET", "text/xml", b""), ("GET", "application/xml,text/html;q=0.5", b""),
                                  ("GET", BROWSER_ACCEPT, b"Action=DescribeVolumes&Version=2016-11-15")):
        r = answer(method, accept, query)
        assert r is not None and r.status_code == 401 and b"<Response>" in r.body, (method, accept, query)
    assert answer("GET", BROWSER_ACCEPT, b"X-Amz-Signature=ab") is None  # presigned: checked with its body
    assert edge.prefers_html("text/html") and edge.prefers_html("TEXT/HTML;q=0.9, */*;q=0.8")
    assert not edge.prefers_html("") and not edge.prefers_html("text/html;q=0")


# -- a real install and a real browser --------------------------------------------------------------


class Cloud(clouds.Cloud):
    """vbs up (test hooks on) with one booted guest, vm1, behind its host agent."""

    guest: TestGuest
    instance_id: str

    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp, env={"VBS_TEST_HOOKS": "1"})

    def start(self) -> None:
        super().start()
        [self.guest] = self.start_guests({"vm1": "host-1"})
        self.instance_id = self.instance("host-1", "vm1", 60)

    def new_volume(self, **body: Any) -> str:
        vol = self.vbs.create_volume(**{"size_gib": 1, **body})
        self.vbs.wait_volume(vol["volume_id"], "available")
        return str(vol["volume_id"])

    def gone(self, volume_id: str) -> bool:
        r = self.vbs.http.get(f"/v1/volumes/{volume_id}")
        return r.status_code == 404 or r.json()["status"] == "deleted"


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cloud]:
    with Cloud(tmp_path_factory.mktemp("console")) as cloud:
        yield cloud


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    # make test installs it (scripts/install-debian-packages): missing, the console is untested, a failure.
    assert Path(CHROMIUM).exists(), "Debian's chromium is not installed (scripts/install-debian-packages)"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        # Debian's chromium, not a downloaded browser; as root it needs --no-sandbox.
        b = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], headless=True)
        expect.set_options(timeout=TIMEOUT_MS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(TIMEOUT_MS)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    # A refused API call is logged by the browser too ("Failed to load resource"): the page says why itself.
    pg.on("console", lambda msg: errors.append(msg.text)
          if msg.type == "error" and not msg.text.startswith("Failed to load resource") else None)
    try:
        yield pg
        assert errors == [], f"the page reported errors: {errors}"
    finally:
        # How the page looked at the end, pass or fail: the artifact to look at when one fails.
        pg.screenshot(path=str(artifacts() / f"end-{request.node.name}.png"), full_page=True)
        context.close()


def shot(page: Any, name: str) -> Path:
    path = artifacts() / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def sign_in(page: Any, vbs: Vbs) -> None:
    page.goto(f"{vbs.endpoint}/console")
    page.fill("#key-id", vbs.key.access_key_id)
    page.fill("#key-secret", vbs.key.secret_access_key)
    page.click("#sign-in-form button[type=submit]")
    page.wait_for_selector("#view-volumes:not([hidden])")


def open_volume(page: Any, volume_id: str) -> None:
    page.goto(f"{page.url.split('#')[0]}#/volume/{volume_id}")
    page.wait_for_selector(f"#vd-lineage li[data-volume-id='{volume_id}'] > span.current")
    expect(page.locator("#vd-title")).to_contain_text(volume_id)


def status_badge(page: Any) -> str:
    return str(page.text_content("#vd-status"))


@pytest.mark.integration
def test_the_console_files_are_served_without_a_key_with_a_strict_policy(cloud: Cloud) -> None:
    base = cloud.vbs.endpoint
    r = httpx.get(f"{base}/console")
    assert r.status_code == 308 and r.headers["location"] == "/console/"
    r = httpx.get(f"{base}/console/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    policy = r.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "default-src 'none'" in policy and "unsafe-inline" not in policy
    assert r.headers["x-content-type-options"] == "nosniff"
    assert httpx.head(f"{base}/console/").status_code == 200
    js = httpx.get(f"{base}/console/console.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert httpx.get(f"{base}/console/nothing.js").status_code == 404
    assert httpx.post(f"{base}/console/", content=b"x").status_code == 401
    assert httpx.get(f"{base}/v1/volumes").status_code == 401
    # A path that climbs out of /console reaches no API route (httpx would tidy the dots: send it raw).
    conn = http.client.HTTPConnection("127.0.0.1", int(base.rsplit(":", 1)[1]), timeout=10)
    conn.request("GET", "/console/../v1/volumes")
    climbed = conn.getresponse()
    assert climbed.status == 404 and b"volumes" not in climbed.read()
    conn.close()


@pytest.mark.integration
def test_a_wrong_key_is_refused_with_a_message_and_the_right_one_signs_in(cloud: Cloud, page: Any) -> None:
    page.goto(f"{cloud.vbs.endpoint}/console/")
    page.fill("#key-id", cloud.vbs.key.access_key_id)
    page.fill("#key-secret", "not-the-secret")
    page.click("#sign-in-form button[type=submit]")
    expect(page.locator("#sign-in-error")).to_contain_text("Sign-in refused")
    assert page.is_hidden("#nav") and page.is_hidden("#view-volumes")
    assert page.evaluate("sessionStorage.length") == 0
    shot(page, "01-sign-in-refused")

    page.fill("#key-secret", cloud.vbs.key.secret_access_key)
    page.click("#sign-in-form button[type=submit]")
    page.wait_for_selector("#view-volumes:not([hidden])")
    assert page.text_content("#who") == f"{cloud.vbs.key.access_key_id} (admin)"
    assert cloud.vbs.key.secret_access_key not in page.url
    assert page.input_value("#key-secret") == ""
    page.click("#sign-out")
    page.wait_for_selector("#sign-in:not([hidden])")
    assert page.evaluate("sessionStorage.length") == 0


@pytest.mark.integration
def test_create_a_volume_and_watch_its_operation_reach_available(cloud: Cloud, page: Any) -> None:
    sign_in(page, cloud.vbs)
    cloud.hook("hold-step", "create-volume", "storage-create")
    try:
        page.click("#show-create-volume")
        page.fill("#cv-size", "2")
        page.fill("#cv-tags", "Name=web-data, team=<img src=x onerror=alert(1)>")
        page.fill("#cv-comment", "made in the console")
        page.click("#cv-submit")
        page.wait_for_url(re.compile(r"#/volume/vol-[0-9a-f]{17}$"))
        volume_id = page.url.rsplit("/", 1)[1]
        wait_until(lambda: cloud.hook("held-step", "create-volume", "storage-create")["held"], 30,
                   what="create held at its storage step")
        # Held: the page shows it creating, its operation running at the storage step.
        page.wait_for_selector("#vd-operations li.op.s-running li.st-started")
        assert status_badge(page) == "creating" and page.is_visible("#vd-progress")
        assert cloud.vbs.volume(volume_id)["status"] == "creating"
        shot(page, "02-volume-creating")
    finally:
        cloud.hook("release-step", "create-volume", "storage-create")
    # Released: the page follows by itself (no reload) to available, every step done.
    expect(page.locator("#vd-status")).to_have_text("available")
    page.wait_for_selector("#vd-operations li.op.s-succeeded")
    steps = page.locator("#vd-operations li.op.s-succeeded li.step").all_text_contents()
    assert steps == ["storage-create: done", "mark-available: done"]
    shot(page, "03-volume-available")
    vol = cloud.vbs.volume(volume_id)
    assert vol["status"] == "available" and vol["size_gib"] == 2 and vol["comment"] == "made in the console"
    assert vol["tags"] == {"Name": "web-data", "team": "<img src=x onerror=alert(1)>"}
    ops = cloud.vbs.http.get("/v1/operations", params={"resource_id": volume_id}).json()["operations"]
    assert [(o["kind"], o["status"]) for o in ops] == [("create-volume", "succeeded")]

    # In the table, the tag shows as the text it is: no element made of it.
    page.click("a[data-view=volumes]")
    row = page.wait_for_selector(f"#volumes-body tr[data-volume-id='{volume_id}']")
    assert "team=<img src=x onerror=alert(1)>" in row.text_content()
    assert page.locator("#volumes-body img").count() == 0
    assert "web-data" in row.text_content() and "2 GiB" in row.text_content()
    # Size against used: nothing written yet (once the storage node's heartbeat has counted it).
    expect(page.locator(f"#volumes-body tr[data-volume-id='{volume_id}'] td.c-used")).to_contain_text(
        "0 B of 2.0 GiB (0 %)")
    assert cloud.vbs.volume(volume_id)["used_bytes"] == 0


@pytest.mark.integration
def test_filters_and_columns_narrow_the_table(cloud: Cloud, page: Any) -> None:
    red = cloud.new_volume(tags={"colour": "red"})
    blue = cloud.new_volume(tags={"colour": "blue"}, comment="the blue one")
    sign_in(page, cloud.vbs)
    rows = "#volumes-body tr"
    page.wait_for_selector(f"{rows}[data-volume-id='{blue}']")

    page.fill("#filter-tag", "colour=red")
    page.wait_for_selector(f"{rows}[data-volume-id='{blue}']", state="detached")
    assert [r.get_attribute("data-volume-id") for r in page.query_selector_all(rows)] == [red]

    page.fill("#filter-tag", "colour")
    page.wait_for_selector(f"{rows}[data-volume-id='{blue}']")
    page.fill("#filter-text", "blue one")
    page.wait_for_selector(f"{rows}[data-volume-id='{red}']", state="detached")
    assert [r.get_attribute("data-volume-id") for r in page.query_selector_all(rows)] == [blue]

    page.fill("#filter-text", "")
    page.select_option("#filter-status", "in-use")
    page.wait_for_selector("#volumes-empty:not([hidden])")
    page.select_option("#filter-status", "available")
    page.wait_for_selector(f"{rows}[data-volume-id='{red}']")
    shot(page, "04-filtered")

    # Columns: hide Type, show Comment; the choice outlives a reload.
    page.click("details.columns summary")
    page.uncheck("#column-choices input[value=type]")
    page.check("#column-choices input[value=comment]")
    headers = page.locator("#volumes-head th").all_text_contents()
    assert "Type" not in headers and "Comment" in headers
    page.reload()
    page.wait_for_selector(f"{rows}[data-volume-id='{blue}']")
    headers = page.locator("#volumes-head th").all_text_contents()
    assert "Type" not in headers and "Comment" in headers
    assert "the blue one" in page.text_content(f"{rows}[data-volume-id='{blue}'] td.c-comment")


@pytest.mark.integration
def test_attach_to_a_picked_instance_shows_on_the_volume_page_then_detach(cloud: Cloud, page: Any) -> None:
    # A clone of a snapshot, so that the page also has a lineage to show (docs/console.md's screenshot).
    parent = cloud.new_volume(tags={"Name": "db-primary"})
    answer = cloud.vbs.http.post("/v1/snapshots", json={"volume_id": parent, "comment": "nightly"})
    assert answer.status_code == 200, answer.text
    snap = answer.json()
    cloud.vbs.wait_snapshot(snap["snapshot_id"], "completed")
    volume_id = cloud.new_volume(snapshot_id=snap["snapshot_id"], tags={"Name": "db-replica", "team": "data"})
    sign_in(page, cloud.vbs)
    open_volume(page, volume_id)

    page.wait_for_selector(f"#attach-instance option[value='{cloud.instance_id}']", state="attached")
    page.select_option("#attach-instance", cloud.instance_id)
    page.click("#attach-submit")
    page.wait_for_selector("#vd-attachments tr td .badge.s-attached")
    expect(page.locator("#vd-status")).to_have_text("in-use")
    cells = page.locator("#vd-attachments tr td").all_text_contents()
    assert cells[0] == cloud.instance_id and cells[1] == "host-1 / vm1" and cells[2] == "vdb"
    vol = cloud.vbs.volume(volume_id)
    assert vol["status"] == "in-use"
    assert [(a["instance_id"], a["state"]) for a in vol["attachments"]] == [(cloud.instance_id, "attached")]
    dev = cloud.guest.wait_for_disk(virtio_serial(volume_id), 20)
    page.wait_for_selector("#vd-operations li.op.s-succeeded >> text=attach-volume")

    # Size against used: what the guest writes shows up, through the storage node's heartbeat.
    cloud.guest.write_pattern(dev, "console", 8)
    used = wait_until(lambda: (u := cloud.vbs.volume(volume_id)["used_bytes"]) is not None and u >= 8 * MiB and u,
                      30, what="the written bytes reported")
    assert used < 64 * MiB
    expect(page.locator("#vd-details dd .usage")).to_contain_text(" MiB of 1.0 GiB")
    screenshot = shot(page, "05-attached")
    if os.environ.get("VBS_DOCS_SCREENSHOT") == "1":
        shutil.copyfile(screenshot, ROOT / "docs" / "console.png")

    page.click("#vd-attachments button.detach")
    page.wait_for_selector("#vd-no-attachments:not([hidden])")
    expect(page.locator("#vd-status")).to_have_text("available")
    shot(page, "06-detached")
    assert cloud.vbs.volume(volume_id)["status"] == "available"
    assert cloud.vbs.volume(volume_id)["attachments"] == []
    cloud.guest.wait_disk_gone(virtio_serial(volume_id), 20)


@pytest.mark.integration
def test_a_snapshot_and_a_volume_from_it_show_as_a_lineage(cloud: Cloud, page: Any) -> None:
    parent = cloud.new_volume(tags={"Name": "origin"})
    sign_in(page, cloud.vbs)
    open_volume(page, parent)
    page.fill("#snapshot-comment", "before the upgrade")
    page.click("#snapshot-submit")
    snap_node = page.wait_for_selector(f"#vd-lineage li[data-volume-id='{parent}'] > ul > li[data-snapshot-id]")
    snapshot_id = snap_node.get_attribute("data-snapshot-id")
    page.wait_for_selector(f"li[data-snapshot-id='{snapshot_id}'] .badge.s-completed")
    snap = cloud.vbs.snapshot(str(snapshot_id))
    assert snap["volume_id"] == parent and snap["comment"] == "before the upgrade" and snap["status"] == "completed"

    page.click(f"li[data-snapshot-id='{snapshot_id}'] button.from-snapshot")
    page.wait_for_url(lambda url: re.search(r"#/volume/vol-[0-9a-f]{17}$", url) is not None and parent not in url)
    child = page.url.rsplit("/", 1)[1]
    expect(page.locator("#vd-status")).to_have_text("available")
    # The child's page draws the family from the parent down, the child marked.
    page.wait_for_selector(f"#vd-lineage li[data-volume-id='{parent}'] > ul > li[data-snapshot-id='{snapshot_id}'] "
                           f"> ul > li[data-volume-id='{child}'] > span.current")
    shot(page, "07-lineage")
    made = cloud.vbs.volume(child)
    assert made["snapshot_id"] == snapshot_id and made["status"] == "available"


@pytest.mark.integration
def test_the_snapshots_page_shows_tiers_and_locks_and_offers_no_delete_of_a_locked_one(cloud: Cloud,
                                                                                      page: Any) -> None:
    vol = cloud.new_volume(tags={"Name": "kept"})
    snaps = []
    for _ in range(2):
        made = cloud.vbs.http.post("/v1/snapshots", json={"volume_id": vol}).json()["snapshot_id"]
        cloud.vbs.wait_snapshot(made, "completed")
        snaps.append(made)
    locked, archived = snaps
    r = cloud.vbs.http.put(f"/v1/snapshots/{locked}/lock", json={"mode": "compliance", "duration_days": 1})
    assert r.status_code == 200, r.text
    assert cloud.vbs.http.put(f"/v1/snapshots/{archived}/tier", json={"tier": "archive"}).status_code == 200
    wait_until(lambda: cloud.vbs.snapshot(archived)["storage_tier"] == "archive", 60, what="archived")
    sign_in(page, cloud.vbs)
    page.click("a[data-view=snapshots]")
    row = page.wait_for_selector(f"#snapshots-body tr[data-snapshot-id='{locked}'] td.lock")
    assert str(row.text_content()).startswith("compliance until")
    expect(page.locator(f"#snapshots-body tr[data-snapshot-id='{locked}'] button.danger")).to_have_count(0)
    expect(page.locator(f"#snapshots-body tr[data-snapshot-id='{archived}'] td.tier")).to_have_text("archive")
    # An archived snapshot offers no new volume until it is restored; an unlocked one may be deleted.
    expect(page.locator(f"#snapshots-body tr[data-snapshot-id='{archived}'] button:not(.danger)")).to_have_count(0)
    expect(page.locator(f"#snapshots-body tr[data-snapshot-id='{archived}'] button.danger")).to_have_count(1)
    shot(page, "10-snapshot-locks-and-tiers")


@pytest.mark.integration
def test_the_recycle_bin_page_shows_rules_and_what_they_keep_and_restores_it(cloud: Cloud, page: Any) -> None:
    r = cloud.vbs.http.post("/v1/recycle-bin/rules", json={
        "resource_type": "EBS_SNAPSHOT", "retention_days": 7, "description": "console",
        "resource_tags": [{"key": "bin", "value": "console"}]})
    assert r.status_code == 200, r.text
    rule = r.json()["rule_id"]
    vol = cloud.new_volume()
    snap = cloud.vbs.http.post("/v1/snapshots", json={"volume_id": vol, "tags": {"bin": "console"}}).json()[
        "snapshot_id"]
    cloud.vbs.wait_snapshot(snap, "completed")
    assert cloud.vbs.http.delete(f"/v1/snapshots/{snap}").json()["status"] == "recoverable"
    sign_in(page, cloud.vbs)
    page.click("a[data-view=recycle-bin]")
    expect(page.locator(f"#rules-body tr[data-rule-id='{rule}']")).to_contain_text("tagged bin=console")
    row = page.locator(f"#bin-snapshots-body tr[data-snapshot-id='{snap}']")
    expect(row).to_contain_text(vol)
    shot(page, "11-recycle-bin")
    row.locator("button").click()
    expect(row).to_have_count(0)
    assert cloud.vbs.snapshot(snap)["status"] == "completed"
    assert cloud.vbs.http.delete(f"/v1/recycle-bin/rules/{rule}").status_code == 204


@pytest.mark.integration
def test_bulk_delete_removes_the_selected_volumes_only(cloud: Cloud, page: Any) -> None:
    batch = [cloud.new_volume(tags={"batch": "old"}) for _ in range(3)]
    keep = cloud.new_volume(tags={"batch": "keep"})
    sign_in(page, cloud.vbs)
    page.fill("#filter-tag", "batch=old")
    for vid in batch:
        page.wait_for_selector(f"#volumes-body tr[data-volume-id='{vid}']")
    expect(page.locator("#volumes-body tr")).to_have_count(3)
    page.check("#select-all")
    assert page.text_content("#bulk-delete") == "Delete selected (3)"
    page.click("#bulk-delete")
    assert all(vid in str(page.text_content("#bulk-confirm-text")) for vid in batch)
    shot(page, "08-bulk-delete-confirm")
    page.click("#bulk-confirm-yes")
    page.wait_for_selector("#message:not([hidden])")
    assert page.text_content("#message") == "Deleting 3 volume(s)."
    wait_until(lambda: all(cloud.gone(vid) for vid in batch), 60, what="the batch deleted")
    assert cloud.vbs.volume(keep)["status"] == "available"
    # Deleted volumes leave the table (a status filter of "deleted" shows them while EC2 would).
    page.wait_for_selector("#volumes-empty:not([hidden])")
    page.select_option("#filter-status", "deleted")
    for vid in batch:
        page.wait_for_selector(f"#volumes-body tr[data-volume-id='{vid}'] .badge.s-deleted")


@pytest.mark.integration
def test_hosts_instances_and_storage_nodes_with_their_capacity(cloud: Cloud, page: Any) -> None:
    sign_in(page, cloud.vbs)
    page.click("a[data-view=infrastructure]")
    page.wait_for_selector("#hosts-body tr[data-host='host-1'] .badge.s-up")
    page.wait_for_selector(f"#instances-body tr[data-instance-id='{cloud.instance_id}']")
    row = page.wait_for_selector("#storage-body tr[data-storage-node='storage-1']")
    pool = cloud.vbs.http.get("/v1/storage-nodes").json()["storage_nodes"][0]["pools"][0]
    assert pool["name"] in row.text_content()
    used_pct = round(100 * (pool["capacity_bytes"] - pool["free_bytes"]) / pool["capacity_bytes"])
    # Free space moves between the REST call and the page's: a point either way.
    shown = int(re.search(r"\((\d+) %\)", str(row.text_content())).group(1))  # type: ignore[union-attr]
    assert abs(shown - used_pct) <= 1
    shot(page, "09-infrastructure")


@pytest.mark.integration
def test_a_user_key_sees_its_tenant_only_and_no_infrastructure(cloud: Cloud, page: Any) -> None:
    theirs = cloud.new_volume(tags={"Name": "default-tenant"})
    made = cloud.vbs.http.post("/v1/keys", json={"tenant": "console-user", "role": "user"})
    assert made.status_code == 200, made.text
    key = made.json()
    bearer = {"authorization": f"Bearer {key['access_key_id']}:{key['secret_access_key']}"}
    # Through the API: another tenant's volume has no operations for this key, and does not exist.
    r = httpx.get(f"{cloud.vbs.endpoint}/v1/operations", params={"resource_id": theirs}, headers=bearer)
    assert r.status_code == 200 and r.json() == {"operations": []}
    assert httpx.get(f"{cloud.vbs.endpoint}/v1/volumes/{theirs}", headers=bearer).status_code == 404
    mine = httpx.post(f"{cloud.vbs.endpoint}/v1/volumes", json={"size_gib": 1}, headers=bearer).json()["volume_id"]
    wait_until(lambda: httpx.get(f"{cloud.vbs.endpoint}/v1/volumes/{mine}", headers=bearer).json()["status"]
               == "available", 60, what="the user's volume available")

    page.goto(f"{cloud.vbs.endpoint}/console/")
    page.fill("#key-id", key["access_key_id"])
    page.fill("#key-secret", key["secret_access_key"])
    page.click("#sign-in-form button[type=submit]")
    expect(page.locator("#who")).to_have_text(f"{key['access_key_id']} (user)")
    page.wait_for_selector(f"#volumes-body tr[data-volume-id='{mine}']")
    assert page.locator(f"#volumes-body tr[data-volume-id='{theirs}']").count() == 0
    page.click("a[data-view=infrastructure]")
    expect(page.locator("#infrastructure-note")).to_have_text("Hosts and storage nodes are shown to admin keys only.")
    page.wait_for_selector(f"#instances-body tr[data-instance-id='{cloud.instance_id}']")
    assert page.locator("#hosts-body tr").count() == 0 and page.locator("#storage-body tr").count() == 0
    shot(page, "10-user-key")


@pytest.mark.integration
def test_the_policies_page_shows_each_policy_with_its_schedule_and_last_run(cloud: Cloud, page: Any) -> None:
    cloud.new_volume(tags={"console-backup": "yes"})
    schedule = {"Name": "minutely", "CreateRule": {"Interval": 1, "IntervalUnit": "MINUTES"},
                "RetainRule": {"Count": 1}}
    r = cloud.vbs.http.post("/v1/lifecycle-policies", json={
        "description": "console", "state": "ENABLED", "policy_details": {
            "ResourceTypes": ["VOLUME"], "TargetTags": [{"Key": "console-backup", "Value": "yes"}],
            "Schedules": [schedule]}})
    assert r.status_code == 200, r.text
    pid = r.json()["policy_id"]
    wait_until(lambda: (cloud.vbs.http.get(f"/v1/lifecycle-policies/{pid}").json()["last_run"] or {}).get(
        "status") == "succeeded", 240, interval=2, what="the policy's first run")
    sign_in(page, cloud.vbs)
    page.click("a[data-view=policies]")
    row = f"#policies-body tr[data-policy-id='{pid}']"
    page.wait_for_selector(row)
    expect(page.locator(f"{row} td.last-run")).to_contain_text("succeeded")
    expect(page.locator(row)).to_contain_text("minutely: every 1 minutes")
    expect(page.locator(row)).to_contain_text("VOLUME tagged console-backup=yes")
    shot(page, "11-lifecycle-policies")
    assert cloud.vbs.http.delete(f"/v1/lifecycle-policies/{pid}").status_code == 200
