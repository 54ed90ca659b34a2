"""docs/install.md run as written on the machines of a namespace cluster (src/vbs/rigs/netns.py; the
guide's section "Trying it in network namespaces" says what differs).

Every ``vbs`` command of the guide's shell blocks is run word for word in its machine's namespace, apart
from two things: the guide's addresses (10.0.0.N) become the cluster's (10.77.0.N), and, as the
namespaces share one file system, the absolute paths a machine keeps (/etc/vbs, /var/lib/vbs, /srv/vbs,
/root) are under that machine's own directory. The configurations the guide writes (``cat > … <<EOF``)
are written from its text the same way. The controller's user is the guide's too: ``useradd``,
``runuser -u vbs --``, ``install -d -o vbs -g vbs``, ``chown``, ``chgrp`` and ``chmod`` run as written
(``GuideUser`` says when the user is made and removed), and a unit with ``User=`` starts as that user.
The commands this host has no use or no means for are done by their equivalents here: ``scp`` is a copy
between the machines' directories, ``systemctl enable --now`` starts the unit's ExecStart line,
``apt-get`` is left out (the packages are there). The guide runner records each line it ran, so the
test can check that none was left out.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tests.installed import REPO, exec_start, unit_lines
from vbs.rigs.netns import Machine, NetnsCluster
from vbs.system.files import write_private

DOC = REPO / "docs" / "install.md"
GUIDE_NET, CLUSTER_NET = "10.0.0.", "10.77.0."
ROOTED = ("/etc/vbs", "/etc/ceph", "/var/lib/vbs", "/srv/vbs", "/root/")
UNIT_ROLES = {"vbs-controller.service": "controller", "vbs-storage-agent.service": "storage-agent",
              "vbs-host-agent.service": "host-agent"}
# Lines with nothing to do here: packages, symlink, shell state and systemd's reload; a copy of the
# units (they are started from their ExecStart lines); the wheelhouse's copy (one venv serves every
# namespace).
SKIPPED = re.compile(r"^(cd |umask |apt-get |ln -sf |cp /root/vbs-dist/"
                     r"|systemctl daemon-reload|python3 -m venv |/opt/vbs/bin/pip |scp -r root@\$BUILD)")
VBS_LINE = re.compile(r"^(?:runuser -u vbs -- )?vbs |^[A-Z]+=\$\(vbs ")
HEREDOC = re.compile(r"^cat > (/\S+) <<EOF$")
CEPH_LINE = re.compile(r"^(?:ceph|rbd) ")  # Ceph's admin tools, on a machine whose /etc/ceph has the admin key
# The lines that make the controller's user and give it its files, run as written (the test checks each ran).
OWNERSHIP = re.compile(r"^(useradd |install -d |chown |chgrp |chmod )")
RUNUSER = "runuser -u vbs -- "


def sections() -> dict[str, list[str]]:
    """The guide's shell blocks under each heading (its text after the ``#``s)."""
    found: dict[str, list[str]] = {}
    heading = ""
    for part in re.split(r"^(#{2,3} .*)$", DOC.read_text(), flags=re.M):
        if re.match(r"^#{2,3} ", part):
            heading = part.lstrip("#").strip()
            continue
        found.setdefault(heading, []).extend(re.findall(r"^```sh\n(.*?)^```", part, flags=re.S | re.M))
    return found


def section(title_start: str) -> list[str]:
    (blocks,) = [b for title, b in sections().items() if title.startswith(title_start)]
    return blocks


def vbs_lines(blocks: list[str]) -> list[str]:
    """The lines of ``blocks`` that run ``vbs``."""
    return [line for block in blocks for line in block.splitlines() if VBS_LINE.match(line)]


class GuideUser:
    """The guide's system user (``vbs``) on this host, which every namespace shares (one /etc/passwd).

    ``add`` runs the guide's ``useradd`` line where no such user exists, and marks the user it made (its
    comment, ``MARK``); where it exists (another controller machine's ``useradd`` already ran, or the
    machine has one of its own) the line is satisfied by it. On exit, a user this or an earlier test made
    (marked) is removed (``userdel``) by the last cluster to leave (each holds a shared lock on /etc while
    it lives: another cluster's controllers may run as the same user); a ``vbs`` the machine had before is
    never touched."""

    MARK = "VBS namespace cluster test"
    LOCK = "/etc"  # a directory: useradd replaces /etc/passwd, the directory stays

    def __init__(self, name: str = "vbs") -> None:
        self.name = name
        self.lock = -1

    def __enter__(self) -> GuideUser:
        self.lock = os.open(self.LOCK, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(self.lock, fcntl.LOCK_SH)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if (entry := self.entry()) is not None and entry.pw_gecos == self.MARK:
                subprocess.run(["userdel", self.name], check=True, capture_output=True, timeout=60)
        except BlockingIOError:
            pass  # another cluster lives on, perhaps with controllers of this user: the last one removes it
        finally:
            os.close(self.lock)

    def entry(self) -> pwd.struct_passwd | None:
        try:
            return pwd.getpwnam(self.name)
        except KeyError:
            return None

    def add(self, argv: list[str]) -> None:
        """The guide's ``useradd … NAME`` (``argv``), unless the user exists."""
        assert argv[0] == "useradd" and argv[-1] == self.name, argv
        if self.entry() is None:
            subprocess.run(argv, check=True, capture_output=True, timeout=60)
            subprocess.run(["usermod", "--comment", self.MARK, self.name], check=True, capture_output=True, timeout=60)

    def uid(self) -> int:
        entry = self.entry()
        assert entry is not None, f"no user {self.name}"
        return entry.pw_uid


@dataclass
class GuideMachine:
    """A machine of the cluster as the guide sees it: its namespace, its own directory for its absolute
    paths, and the guide's per-machine variables once its blocks set them."""

    machine: Machine
    root: Path
    variables: dict[str, str] = field(default_factory=dict)

    def rooted(self, text: str) -> str:
        for path in ROOTED:
            text = re.sub(rf"(?<![\w/.-]){re.escape(path)}", f"{self.root}{path}", text)
        return text

    def expand(self, text: str, rooted: bool = True) -> str:
        """``text`` with the variables set so far, the cluster's addresses, and (``rooted``) this machine's
        paths."""
        text = re.sub(r"\$\{?([A-Z0-9_]+)\}?", lambda m: self.variables.get(m.group(1), m.group(0)), text)
        text = text.replace(GUIDE_NET, CLUSTER_NET)
        return self.rooted(text) if rooted else text

    def path(self, guide_path: str) -> Path:
        return Path(self.rooted(guide_path))


class GuideRunner:
    """Runs the guide's blocks on the cluster's machines with the installed ``vbs`` first on PATH, the
    controller's user made and removed by ``user``."""

    def __init__(self, cluster: NetnsCluster, machines: Mapping[str, GuideMachine], vbs_path: Path,
                 env: Mapping[str, str], logs: Path, user: GuideUser) -> None:
        self.cluster, self.machines, self.vbs_path, self.logs, self.user = cluster, machines, vbs_path, logs, user
        self.env = {**env, "PATH": f"{vbs_path.parent}:/usr/sbin:/usr/bin:/sbin:/bin"}
        self.ran: list[str] = []  # the guide's vbs lines, as the guide writes them
        self.done: list[str] = []  # every line of the guide run (or, for useradd, satisfied), as it writes it
        self.services: dict[str, subprocess.Popen[bytes]] = {}  # by machine name
        self.on_sql: Callable[[str], None] | None = None  # the database's equivalent of psql

    def by_address(self, address: str) -> GuideMachine:
        (found,) = [m for m in self.machines.values() if m.machine.address == address]
        return found

    def run_blocks(self, blocks: list[str], on: str, env: dict[str, str] | None = None, *,
                   variables: Mapping[str, str] | None = None, record: bool = True) -> dict[str, str]:
        """Run ``blocks`` on machine ``on`` as its heading says; ``env`` collects ``export`` lines;
        ``variables`` replace what the per-machine blocks set (a further machine's name and address, as
        the guide's "and each further one" asks); ``record``: count its vbs lines as the guide's. The
        output of each ``VAR=$(vbs …)`` by its name."""
        m = self.machines[on]
        recorded, done = len(self.ran), len(self.done)
        captured: dict[str, str] = {}
        env = env if env is not None else {}
        for block in blocks:
            body = [line for line in block.splitlines() if not line.startswith("#")]
            if block.startswith("# per ") and all(re.match(r"^[A-Z0-9_]+=", line) for line in body):
                for name, value in re.findall(r"^([A-Z0-9_]+)=(.*)$", block, flags=re.M):
                    m.variables[name] = m.expand(value.strip("'"))
                m.variables.update(variables or {})
                continue
            lines = iter(block.splitlines())
            for line in lines:
                if heredoc := HEREDOC.match(line):
                    body = []
                    for next_line in lines:
                        if next_line == "EOF":
                            break
                        body.append(next_line)
                    write_private(m.path(heredoc.group(1)), m.expand("\n".join(body) + "\n"))
                else:
                    self.run_line(m, line, env, captured)
        if not record:
            del self.ran[recorded:]
            del self.done[done:]
        return captured

    def run_line(self, m: GuideMachine, line: str, env: dict[str, str], captured: dict[str, str]) -> None:
        if not line.strip() or line.lstrip().startswith("#") or SKIPPED.match(line):
            return
        self.done.append(line)
        if VBS_LINE.match(line):
            self.run_vbs(m, line, env, captured)
        elif CEPH_LINE.match(line):
            self.run_ceph(m, line)
        elif line.startswith("export "):
            name, value = line.removeprefix("export ").split("=", 1)
            env[name] = m.expand(value)
        elif line.startswith("useradd "):
            self.user.add(shlex.split(m.expand(line)))
        elif OWNERSHIP.match(line):  # install -d, chown, chgrp, chmod: as written, on the machine's paths
            subprocess.run(shlex.split(m.expand(line)), check=True, capture_output=True, timeout=60)
        elif line.startswith("scp "):
            self.copy(m, line)
        elif line.startswith("rm "):
            for target in shlex.split(m.expand(line))[1:]:
                if target != "-r":
                    shutil.rmtree(target) if Path(target).is_dir() else Path(target).unlink(missing_ok=True)
        elif line.startswith("python3 -c ") and " > " in line:
            command, target = line.rsplit(" > ", 1)
            out = subprocess.run(shlex.split(command), capture_output=True, text=True, check=True, timeout=60)
            write_private(m.path(target), out.stdout)
        elif line.startswith("printf 'postgresql"):
            self.database_url(m, line)
        elif line.startswith("printf \"ALTER ROLE"):
            assert self.on_sql is not None
            fmt = shlex.split(line.split(" | ", 1)[0])[1]
            self.on_sql(fmt.replace("\\n", "\n") % m.path("/root/vbs-db-password").read_text().strip())
        elif line.startswith("systemctl enable --now "):
            self.start_unit(m, line.rsplit(" ", 1)[1])
        else:
            raise AssertionError(f"no equivalent for this line of docs/install.md: {line}")

    def run_vbs(self, m: GuideMachine, line: str, env: dict[str, str], captured: dict[str, str]) -> None:
        """A vbs line as the guide writes it (``runuser -u vbs -- vbs …`` as ``vbs``), its ``> FILE`` into
        the machine's file (by root, as the guide's shell does), its ``VAR=$(…)`` captured."""
        self.ran.append(line)
        # The demo guest boots on the hypervisor node, whichever machine's blocks name it (section 9).
        where = self.machines["hv-1"] if line.startswith("vbs demo-vm ") else m
        as_user = line.startswith(RUNUSER)
        text = where.expand(line.removeprefix(RUNUSER))
        var = None
        if match := re.fullmatch(r"([A-Z]+)=\$\((.*)\)", text):
            var, text = match.groups()
        target = None
        if " > " in text:
            text, target = text.rsplit(" > ", 1)
        argv = [str(self.vbs_path) if a == "vbs" else a for a in shlex.split(text)]
        if as_user:
            argv = [*shlex.split(RUNUSER), *argv]
        proc = self.cluster.run(where.machine, argv, env={**self.env, **env}, cwd="/", timeout=600)
        assert proc.returncode == 0, f"{line} on {where.machine.name} exited {proc.returncode}: {proc.stderr}"
        if var is not None:
            captured[var] = proc.stdout.strip()
            env[var] = captured[var]
            m.variables[var] = captured[var]
        if target is not None:
            write_private(Path(target), proc.stdout)

    def run_ceph(self, m: GuideMachine, line: str) -> None:
        """A line of Ceph's tools: in the machine's namespace, its /etc/ceph/ceph.conf named by CEPH_CONF (the
        tools' default path is the host's), its ``> FILE`` into the machine's file (0600)."""
        text, target = (m.expand(line).rsplit(" > ", 1) + [""])[:2]
        env = {**self.env, "CEPH_CONF": str(m.path("/etc/ceph/ceph.conf"))}
        proc = self.cluster.run(m.machine, shlex.split(text), env=env, timeout=300)
        assert proc.returncode == 0, f"{line} on {m.machine.name} exited {proc.returncode}: {proc.stderr}"
        if target:
            write_private(Path(target), proc.stdout)

    def copy(self, m: GuideMachine, line: str) -> None:
        """``scp root@ADDR:SOURCES DEST``: from that machine's directory to this one's."""
        _, source, dest = shlex.split(line)
        remote, paths = source.split(":", 1)
        origin = self.by_address(m.expand(remote.removeprefix("root@")))
        paths = m.expand(paths, rooted=False)  # the source's paths are the other machine's
        if match := re.fullmatch(r"(.*)\{(.*)\}", paths):
            sources = [match.group(1) + name for name in match.group(2).split(",")]
        else:
            sources = [paths]
        for path in sources:
            src, dst = origin.path(path), Path(m.expand(dest))
            target = dst / src.name if dst.is_dir() else dst
            if src != target:
                shutil.copy2(src, target)
                os.chmod(target, 0o600) if src.name != "ca.pem" else None

    def database_url(self, m: GuideMachine, line: str) -> None:
        fmt = shlex.split(line.split(" > ", 1)[0])[1].replace("\\n", "\n")
        password = m.path("/root/vbs-db-password").read_text().strip()
        write_private(m.path(line.rsplit(" > ", 1)[1]), fmt % (password, m.variables["DB"]))

    def start_unit(self, m: GuideMachine, unit: str) -> None:
        """``systemctl enable --now UNIT``: the unit's ExecStart in the machine's namespace, as the unit's
        ``User=`` and ``Group=`` if it has them (``setpriv`` executes it in its place: the PID is the
        service's; ``--no-new-privs`` for the unit's NoNewPrivileges=yes)."""
        argv = exec_start(UNIT_ROLES[unit], self.vbs_path, m.path("/etc/vbs/vbs.toml"))
        if users := unit_lines(unit, "User"):
            (user,), (group,) = users, unit_lines(unit, "Group")
            argv = ["setpriv", f"--reuid={user}", f"--regid={group}", "--init-groups", "--no-new-privs", "--", *argv]
        self.services[m.machine.name] = self.cluster.start(
            m.machine, argv, log=self.logs / f"{m.machine.name}.log", env=self.env)
