"""The README's shell blocks, and docs/ec2-api.md's, run as written against a real ``vbs up`` with a
real guest: a documented command that fails, or whose output contradicts its comment, fails here.

How the lines run. One ``bash`` per page, fed the page's commands one at a time in the order written
(a line ending in ``\\`` continues), so that what one line sets (``VOL=$(vbs create-volume …)``, the
``export``s, ``. .venv/bin/activate``) is there for the next, as in the user's shell. A command fails the
test when it exits non-zero (unless EXPECTED_FAILURES names it and what it must say), and its CHECKS,
keyed by the command's text, compare what it printed, and what VBS and the guest then hold, with what
its comment says (the guest is asked through ``vbs demo-vm vm1 --disks``, the README's own line).

What is set around them, and why:
- The working directory is a temporary one standing for the checkout: ``./var`` is the data dir of
  the test's ``vbs up`` and ``./.venv`` a link to the venv that runs the tests (so the README's
  ``. .venv/bin/activate`` puts the venv under test on the PATH; that venv's ``bin`` is taken off the
  PATH the shell starts with, and ``VBS_*``/``AWS_*``/``VIRTUAL_ENV`` are cleared, so no developer's
  setting stands in for a documented one). ``XDG_CONFIG_HOME`` is the test's, where its ``vbs up``
  records the CLI's key (the README's ``~/.config/vbs/credentials``). HOME is kept: the test guest's
  kernel is cached there.
- The one change made to a line: ``8770``, the documented default port, becomes the port of the test's
  ``vbs up`` (a free one: another install on the machine may hold 8770).
- ``vbs up`` itself is the test's: the README's ``make run`` (and the EC2 page's ``vbs up`` line) block
  in the foreground, so they are in NOT_RUN with the reason, and the test starts ``vbs up --data-dir
  ./var --port FREE``, what the Makefile's ``run`` target runs after the set-up (checked below).
- ``my-image.qcow2``, the README's own image for a VM of one's own, is made by the test (an empty qcow2:
  the line only needs QEMU to start and serve QMP, which it does while its firmware finds nothing to
  boot).

Lines that do not run are listed in NOT_RUN with the reason; the test fails if one of them is not on
its page any more, and every other line of every ``sh`` block of both pages runs: a new line cannot go
untested. The boto3 (Python) and Terraform blocks of docs/ec2-api.md are not shell; tests/test_ec2_api.py
drives the same actions.

One ``vbs up`` for both pages (README first), one guest at a time.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Vbs, VbsUp
from vbs.rigs.testguest import build_guest
from vbs.rigs.testguest.background import BackgroundGuest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
EC2_DOC = ROOT / "docs" / "ec2-api.md"
DEFAULT_PORT = "8770"
GIB = 2**30
COMMAND_TIMEOUT_S = 600.0  # an AWS CLI waiter polls every 15 s, up to 40 times
EVENTUALLY_S = 60.0  # how long a line that reads what settles is asked again (see Check.eventually)

# page, command (as written, continuation lines joined by "\\\n", without its comment) -> why it does not run
NOT_RUN: dict[tuple[str, str], str] = {
    ("README.md", "make run"): "blocks in the foreground (it is vbs up); the test runs vbs up itself, as the "
                               "Makefile's run target does, with ./var and a free port",
    ("README.md", "make test"): "runs the whole suite, this test among it",
    ("docs/ec2-api.md", "vbs up --data-dir ./var --port 8770"): "blocks in the foreground; the test's own vbs up "
                                                                "is this line with a free port",
    ("docs/ec2-api.md", "terraform init && terraform apply -var instance_id=i-0123456789abcdef0"):
        "no Terraform here (the page marks its Terraform section untested)",
    ("docs/ec2-api.md", "terraform destroy -var instance_id=i-0123456789abcdef0"): "the same",
}
# Non-zero on purpose, as the comment says: (page, command) -> what its stderr says.
EXPECTED_FAILURES: dict[tuple[str, str], str] = {
    ("docs/ec2-api.md", "aws ec2 create-volume --endpoint-url $EP --availability-zone us-east-1a --size 1 --dry-run"):
        "DryRunOperation",
}


@dataclass
class Command:
    page: str
    text: str  # as written, without its trailing comment
    line: str  # as written, with it: what the shell runs
    number: int  # its first line on the page


def shell_commands(path: Path) -> list[Command]:
    """The commands of every ``sh`` block of ``path``, in order."""
    page = str(path.relative_to(ROOT))
    found: list[Command] = []
    in_block = False
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        if raw.startswith("```"):
            in_block = raw.strip() == "```sh" and not in_block
            continue
        if not in_block:
            continue
        if not pending:
            if not raw.strip() or raw.lstrip().startswith("#"):
                continue
            start = number
        pending.append(raw)
        if raw.rstrip().endswith("\\"):
            continue
        line = "\n".join(pending)
        found.append(Command(page, _without_comment(line), line, start))
        pending = []
    return found


def _without_comment(line: str) -> str:
    """The command without a trailing ``  # comment`` (a ``#`` after whitespace, outside quotes)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"`":
            quote = ch
        elif ch == "#" and i > 0 and line[i - 1] in " \t":
            return line[:i].rstrip()
    return line.rstrip()


# -- the shell ---------------------------------------------------------------------------------------


@dataclass
class Result:
    status: int
    out: str
    err: str


class Shell:
    """One ``bash``, fed commands one at a time; each one's stdout and stderr go to files of their own."""

    MARK = "__vbs_readme_done__"

    def __init__(self, cwd: Path, env: dict[str, str], logs: Path) -> None:
        self.cwd, self.logs = cwd, logs
        logs.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(["bash", "--noprofile", "--norc"], cwd=cwd, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.count = 0

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def run(self, line: str, timeout: float = COMMAND_TIMEOUT_S) -> Result:
        self.count += 1
        out, err = self.logs / f"{self.count}.out", self.logs / f"{self.count}.err"
        assert self.proc.stdin is not None
        # A group in this shell: what the line sets stays set; the newline ends a trailing comment.
        self.proc.stdin.write(f"{{ {line}\n}} >{out} 2>{err} </dev/null; printf '\\n{self.MARK} %s\\n' $?\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        said: list[str] = []
        while True:
            try:
                got = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no end of {line!r} within {timeout:g} s (shell said {said!r})") from None
            if got is None:
                raise AssertionError(f"the shell exited running {line!r}: {said!r}")
            if got.startswith(self.MARK + " "):
                return Result(int(got.split()[1]), out.read_text(), err.read_text())
            if got:
                said.append(got)

    def value(self, name: str) -> str:
        """A shell variable's value (the test's own question, not a line of the page)."""
        return self.run(f'printf %s "${name}"').out

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: bash and what it still runs
                self.proc.wait()


# -- what each line's comment says --------------------------------------------------------------------


@dataclass
class Context:
    vbs: Vbs
    shell: Shell
    cwd: Path

    def var(self, name: str) -> str:
        value = self.shell.value(name)
        assert value, f"${name} is empty"
        return value


@dataclass
class Check:
    """What a command's comment says, as code. ``eventually``: the line reads something that settles
    moments after the line before it answered (a heartbeat reports a new VM within 2 s; the guest's kernel
    takes a hot-plugged disk or a new size after QEMU did), so a failed check runs the same line again, as
    a user typing it a moment later would, for up to EVENTUALLY_S."""

    check: Callable[[Result, Context], None]
    eventually: bool = False


def _instances(r: Result) -> dict[str, dict[str, Any]]:
    import json

    return {i["vm_id"]: i for i in json.loads(r.out)["instances"]}


def _disks(r: Result) -> dict[str, int]:
    import json

    return {d["serial"]: d["size_bytes"] for d in json.loads(r.out)}


def vm_running(vm: str) -> Callable[[Result, Context], None]:
    def check(r: Result, c: Context) -> None:
        found = _instances(r).get(vm)
        assert found is not None and found["host"] == "host-1" and found["state"] == "running", r.out
        assert found["instance_id"].startswith("i-")
    return check


def demo_vm_started(r: Result, c: Context) -> None:
    import json

    said = json.loads(r.out)
    assert BackgroundGuest("vm1", c.cwd / "var").pid() == said["pid"]
    assert (c.cwd / "var" / "vms" / "vm1.qmp").is_socket()


def volume_created(r: Result, c: Context) -> None:
    vol = c.vbs.volume(c.var("VOL"))
    assert (vol["status"], vol["size_gib"], vol["comment"], vol["tags"]) == ("available", 1, "demo", {"team": "db"})


def described_available_1_gib(r: Result, c: Context) -> None:
    import json

    (vol,) = json.loads(r.out)["volumes"]
    assert (vol["volume_id"], vol["status"], vol["size_gib"]) == (c.var("VOL"), "available", 1)


def attached_to_vm1(r: Result, c: Context) -> None:
    vol = c.vbs.volume(c.var("VOL"))
    assert vol["status"] == "in-use" and [(a["vm_id"], a["state"]) for a in vol["attachments"]] == [("vm1", "attached")]


def guest_sees(gib: int) -> Callable[[Result, Context], None]:
    def check(r: Result, c: Context) -> None:
        serial = c.var("VOL").replace("-", "")
        assert _disks(r).get(serial) == gib * GIB, f"the guest's disks: {r.out}"
    return check


def grown_to_20(r: Result, c: Context) -> None:
    assert c.vbs.volume(c.var("VOL"))["size_gib"] == 20


def snapshot_completed(r: Result, c: Context) -> None:
    snap = c.vbs.snapshot(c.var("SNAP"))
    assert (snap["status"], snap["volume_id"]) == ("completed", c.var("VOL"))


def clone_created(r: Result, c: Context) -> None:
    import json

    vol = json.loads(r.out)
    assert (vol["status"], vol["snapshot_id"], vol["tags"]) == ("available", c.var("SNAP"), {"team": "db"})


def only_the_new_volume(r: Result, c: Context) -> None:
    import json

    volumes = json.loads(r.out)["volumes"]
    assert [(v["snapshot_id"], v["status"]) for v in volumes] == [(c.var("SNAP"), "available")], r.out


def ec2_lists_the_volume(r: Result, c: Context) -> None:
    assert c.var("VOL") in r.out and c.var("SNAP") in r.out, r.out  # the volume and the one made from its snapshot


def detached(r: Result, c: Context) -> None:
    assert c.vbs.volume(c.var("VOL"))["status"] == "available"


def deleted(r: Result, c: Context) -> None:
    assert c.vbs.http.get(f"/v1/volumes/{c.var('VOL')}").status_code == 404 or \
        c.vbs.volume(c.var("VOL"))["status"] == "deleted"


def vm1_stopped(r: Result, c: Context) -> None:
    assert BackgroundGuest("vm1", c.cwd / "var").pid() is None and r.out.startswith("vm1 stopped (QEMU PID ")


def myvm_stops(r: Result, c: Context) -> None:
    """``kill`` returns at once; QEMU exits moments later (the line cannot be run again: it would find no
    process)."""
    deadline = time.monotonic() + EVENTUALLY_S
    while own_vm_pid(c.cwd) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert own_vm_pid(c.cwd) is None


def own_vm_pid(cwd: Path) -> int | None:
    """The PID of the README's own QEMU if it runs: its pidfile's, if that process's command line is that
    line's (QEMU daemonized and left the directory: its arguments tell it apart)."""
    try:
        pid = int((cwd / "var" / "myvm.pid").read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return None
    return pid if b"unix:./var/vms/myvm.qmp" in cmdline and b"my-image.qcow2" in cmdline and state != "Z" else None


def ec2_instance(r: Result, c: Context) -> None:
    assert re.fullmatch(r"i-[0-9a-f]{17}", c.var("INSTANCE")) and c.var("INSTANCE") == c.vbs.instance("vm1")


def ec2_in_use(r: Result, c: Context) -> None:
    vol = c.vbs.volume(c.var("VOL"))
    assert vol["status"] == "in-use" and vol["attachments"][0]["instance_id"] == c.var("INSTANCE")


# page -> command -> the checks of its first, second, … occurrence
CHECKS: dict[str, dict[str, list[Check]]] = {
    "README.md": {
        "vbs demo-vm vm1": [Check(demo_vm_started)],
        "vbs describe-instances": [Check(vm_running("vm1"), eventually=True),
                                   Check(vm_running("myvm"), eventually=True)],
        "VOL=$(vbs create-volume --size 1 --comment demo --tag team=db --wait --query volume_id --output text)":
            [Check(volume_created)],
        "vbs describe-volumes $VOL": [Check(described_available_1_gib)],
        "vbs attach-volume $VOL --host host-1 --vm vm1 --wait": [Check(attached_to_vm1)],
        "vbs demo-vm vm1 --disks": [Check(guest_sees(1), eventually=True), Check(guest_sees(20), eventually=True)],
        "vbs modify-volume $VOL --size 20 --wait": [Check(grown_to_20)],
        "SNAP=$(vbs create-snapshot $VOL --wait --query snapshot_id --output text)": [Check(snapshot_completed)],
        "vbs create-volume --snapshot $SNAP --tag team=db --wait": [Check(clone_created)],
        "vbs describe-volumes --filter status=available --filter tag:team=db --output json":
            [Check(only_the_new_volume)],
        "AWS_SHARED_CREDENTIALS_FILE=./var/credentials aws ec2 describe-volumes \\\n"
        "    --endpoint-url http://127.0.0.1:8770 --region us-east-1": [Check(ec2_lists_the_volume)],
        "vbs detach-volume $VOL --wait": [Check(detached)],
        "vbs delete-volume $VOL --wait": [Check(deleted)],
        "vbs demo-vm vm1 --stop": [Check(vm1_stopped)],
        "kill $(cat ./var/myvm.pid)": [Check(myvm_stops)],
    },
    "docs/ec2-api.md": {
        "INSTANCE=$(aws ec2 describe-instances --endpoint-url $EP "
        "--filters Name=instance-state-name,Values=running \\\n"
        "           --query 'Reservations[0].Instances[0].InstanceId' --output text)": [Check(ec2_instance)],
        "aws ec2 wait volume-in-use --endpoint-url $EP --volume-ids $VOL": [Check(ec2_in_use)],
    },
}


# -- the run --------------------------------------------------------------------------------------------


@dataclass
class Site:
    """The test's stand-in for the checkout: its directory, its vbs up, and its shells' environment."""

    cwd: Path
    vbs: Vbs
    port: int
    env: dict[str, str] = field(default_factory=dict)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    build_guest()  # the test guest's image before anything is timed out (a first build downloads it)
    cwd = tmp_path_factory.mktemp("checkout")
    (cwd / ".venv").symlink_to(Path(sys.prefix))
    up = VbsUp(cwd / "var", cwd / "vbs-up.log")
    venv_bin = str(Path(sys.prefix) / "bin")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "VBS_")) and k != "VIRTUAL_ENV" or k == "VBS_CACHE_DIR"}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", os.defpath).split(os.pathsep) if p != venv_bin)
    env["XDG_CONFIG_HOME"] = str(cwd / "xdg")  # where VbsUp has vbs up record the CLI's key
    try:
        vbs = up.start()
        yield Site(cwd, vbs, up.port, env)
    finally:
        BackgroundGuest("vm1", cwd / "var").stop()
        _stop_own_vm(cwd)
        up.stop()


def _stop_own_vm(cwd: Path) -> None:
    """The README's own QEMU, if a failed run left it: by its pidfile's PID, if that process is it."""
    pid = own_vm_pid(cwd)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)


def run_page(site: Site, path: Path) -> list[str]:
    """Run every command of the page's ``sh`` blocks; the commands that ran."""
    page = str(path.relative_to(ROOT))
    commands = shell_commands(path)
    texts = [c.text for c in commands]
    listed = {text for (p, text) in NOT_RUN if p == page}
    assert listed <= set(texts), f"NOT_RUN names lines {page} does not have: {listed - set(texts)}"
    checked = CHECKS.get(page, {})
    assert set(checked) <= set(texts), f"CHECKS name lines {page} does not have: {set(checked) - set(texts)}"
    failing = {text for (p, text) in EXPECTED_FAILURES if p == page}
    assert failing <= set(texts), f"EXPECTED_FAILURES name lines {page} does not have: {failing - set(texts)}"
    for text, checks in checked.items():
        assert texts.count(text) == len(checks), f"{page}: {text!r} is there {texts.count(text)} times"
    shell = Shell(site.cwd, site.env, site.cwd / "logs" / path.stem)
    context = Context(site.vbs, shell, site.cwd)
    seen: dict[str, int] = {}
    ran: list[str] = []
    try:
        for command in commands:
            if (page, command.text) in NOT_RUN:
                continue
            line = command.line.replace(DEFAULT_PORT, str(site.port))
            where = f"{page}:{command.number}: {command.line}"
            result = shell.run(line)
            expected = EXPECTED_FAILURES.get((page, command.text))
            if expected is not None:
                assert result.status != 0 and expected in result.err, f"{where}\nexit {result.status}\n{result.err}"
            else:
                assert result.status == 0, f"{where}\nexit {result.status}\nstdout: {result.out}\nstderr: {result.err}"
            occurrence = seen.get(command.text, 0)
            seen[command.text] = occurrence + 1
            if command.text in checked:
                _check(checked[command.text][occurrence], result, context, shell, line, where)
            ran.append(command.text)
    finally:
        shell.close()
    return ran


def _check(check: Check, result: Result, context: Context, shell: Shell, line: str, where: str) -> None:
    deadline = time.monotonic() + (EVENTUALLY_S if check.eventually else 0)
    while True:
        try:
            check.check(result, context)
            return
        except (AssertionError, KeyError, ValueError) as exc:
            if time.monotonic() >= deadline:
                raise AssertionError(f"{where}\ndoes not do what its comment says: {exc}\nstdout: {result.out}\n"
                                     f"stderr: {result.err}") from exc
        time.sleep(1)
        result = shell.run(line)
        assert result.status == 0, f"{where} (again)\nexit {result.status}\n{result.err}"


def test_the_makefile_runs_what_the_test_runs_for_make_run() -> None:
    """NOT_RUN's reason for ``make run``: it is ``vbs up --data-dir ./var --port 8770`` after the set-up."""
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^DATA_DIR \?= \./var$", makefile, re.M) and re.search(r"^PORT \?= 8770$", makefile, re.M)
    assert re.search(r"^run: setup\n\t\$\(BIN\)/vbs up --data-dir \$\(DATA_DIR\) --port \$\(PORT\)$", makefile, re.M)


def test_the_readme_quick_start_works_as_written(site: Site) -> None:
    (site.cwd / "my-image.qcow2").unlink(missing_ok=True)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(site.cwd / "my-image.qcow2"), "1G"], check=True,
                   timeout=60)
    ran = run_page(site, README)
    assert "vbs demo-vm vm1 --stop" in ran and "vbs attach-volume $VOL --host host-1 --vm vm1 --wait" in ran


def test_the_ec2_pages_aws_cli_blocks_work_as_written(site: Site) -> None:
    ran = run_page(site, EC2_DOC)
    assert sum(text.startswith("aws ec2 ") or "$(aws ec2 " in text for text in ran) >= 25
