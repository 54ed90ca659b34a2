#!/usr/bin/env python3
"""CLI start-up benchmark of VBS: prints figures (it is not a test).

The ``vbs`` executable is paid on every command, process start included. This runs, as separate
processes and interleaved round by round (so that the load of a shared machine falls on all of them
alike), the wall time of:

* baselines: ``python -c pass`` (the interpreter alone), ``python -c "import typer"`` (the CLI
  framework alone) and ``aws --version`` (the AWS CLI, where installed);
* ``vbs --help``, ``vbs describe-volumes --help``, ``vbs --version`` (if the CLI has it);
* ``vbs describe-volumes`` against a running ``vbs up`` (a temporary data dir, a free loopback port,
  stopped by its PID at the end) holding ``--volumes`` volumes, its JSON answer checked first.

For each: the median and p90 over the rounds, the ratio to ``python -c pass`` and to ``aws --version``,
and, for ``vbs --help`` and ``vbs describe-volumes``, the ratio to the targets of issue 15 (150 ms and
300 ms) and whether the median meets them. The load average is printed with the figures, and the
median CPU time (user + system) of each process beside its wall time: on a busy machine wall time
is mostly waiting for a core, and CPU time is what the process itself costs (describe-volumes
also waits for the controller, whose time is not in it).

    .venv/bin/python bench/cli_startup.py --quick    # 20 rounds (about a minute)
    .venv/bin/python bench/cli_startup.py            # 50 rounds
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import log, pct  # noqa: E402
from tests.conftest import Vbs, running_vbs_up, wait_until  # noqa: E402

TARGET_HELP_MS = 150.0
TARGET_DESCRIBE_MS = 300.0
BIN = Path(sys.executable).parent
VBS_EXE = BIN / "vbs"


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


@dataclass
class Command:
    label: str
    argv: list[str]
    target_ms: float | None = None
    times_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)

    def run(self, env: dict[str, str]) -> None:
        """One run: its wall time in ms (fork and exec included) and its CPU time; a failure stops the
        benchmark."""
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        proc = subprocess.run(self.argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,  # noqa: S603
                              stderr=subprocess.PIPE, check=False)
        self.times_ms.append((time.perf_counter() - started) * 1000)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.cpu_ms.append((after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) * 1000)
        if proc.returncode != 0:
            raise RuntimeError(f"{self.label} exited {proc.returncode}: {proc.stderr.decode(errors='replace')[-500:]}")

    @property
    def median(self) -> float:
        return statistics.median(self.times_ms)


def client_env(vbs: Vbs, config_home: Path) -> dict[str, str]:
    """What a user's shell would give the CLI: the endpoint and key, and a profile directory of its own."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith("VBS_")}
    return {**keep, "XDG_CONFIG_HOME": str(config_home), "VBS_ENDPOINT": vbs.endpoint,
            "VBS_ACCESS_KEY_ID": vbs.key.access_key_id, "VBS_SECRET_ACCESS_KEY": vbs.key.secret_access_key}


def has_version_option(env: dict[str, str]) -> bool:
    proc = subprocess.run([str(VBS_EXE), "--version"], env=env, capture_output=True, check=False)  # noqa: S603
    return proc.returncode == 0


def make_volumes(vbs: Vbs, count: int) -> list[str]:
    made = [vbs.http.post("/v1/volumes", json={"size_gib": 1}).json()["volume_id"] for _ in range(count)]
    wait_until(lambda: all(vbs.volume(v)["status"] == "available" for v in made), 120, 0.2, what="volumes available")
    return made


def commands(env: dict[str, str]) -> list[Command]:
    py = sys.executable
    found = [Command("python -c pass", [py, "-c", "pass"]),
             Command('python -c "import typer"', [py, "-c", "import typer"])]
    aws = BIN / "aws" if (BIN / "aws").exists() else shutil.which("aws")
    if aws is not None:
        found.append(Command("aws --version", [str(aws), "--version"]))
    found += [Command("vbs --help", [str(VBS_EXE), "--help"], TARGET_HELP_MS),
              Command("vbs describe-volumes --help", [str(VBS_EXE), "describe-volumes", "--help"]),
              Command("vbs describe-volumes", [str(VBS_EXE), "describe-volumes"], TARGET_DESCRIBE_MS)]
    if has_version_option(env):
        found.append(Command("vbs --version", [str(VBS_EXE), "--version"]))
    return found


def report(cmds: list[Command], rounds: int, loads: list[str]) -> None:
    base = cmds[0].median
    aws = next((c.median for c in cmds if c.label == "aws --version"), None)
    print(f"\nCLI start-up, wall ms per process, {rounds} rounds interleaved (load average before/after: "
          f"{loads[0]} / {loads[-1]})")
    print(f"{'command':30} {'median':>8} {'p90':>8} {'cpu':>6} {'x pass':>7} {'x aws':>7} {'target':>7} "
          f"{'x target':>9}  met")
    for c in cmds:
        x_aws = f"{c.median / aws:7.2f}" if aws else f"{'-':>7}"
        if c.target_ms is None:
            target = f"{'-':>7} {'-':>9}  -"
        else:
            met = "met" if c.median <= c.target_ms else "NOT met"
            target = f"{c.target_ms:7.0f} {c.median / c.target_ms:9.2f}  {met}"
        print(f"{c.label:30} {c.median:8.1f} {pct(c.times_ms, 90):8.1f} {statistics.median(c.cpu_ms):6.0f} "
              f"{c.median / base:7.2f} {x_aws} {target}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 50; 20 with --quick)")
    parser.add_argument("--volumes", type=int, default=10, help="volumes that describe-volumes lists")
    args = parser.parse_args()
    rounds = args.rounds or (20 if args.quick else 50)
    if rounds < 1 or args.volumes < 0:
        parser.error("--rounds must be >= 1 and --volumes >= 0")
    if not VBS_EXE.exists():
        sys.exit(f"no {VBS_EXE}: run this with the venv's python (make venv)")
    import vbs

    log(f"vbs from {Path(vbs.__file__).parent}, {VBS_EXE}; load {load()}")
    with tempfile.TemporaryDirectory(prefix="vbs-bench-cli-") as tmp_name, running_vbs_up(Path(tmp_name)) as up:
        tmp = Path(tmp_name)
        (tmp / "client-config").mkdir()
        env = client_env(up, tmp / "client-config")
        made = make_volumes(up, args.volumes)
        answer = subprocess.run([str(VBS_EXE), "describe-volumes"], env=env, capture_output=True, text=True,  # noqa: S603
                                check=True)
        listed = sorted(v["volume_id"] for v in json.loads(answer.stdout)["volumes"])
        if listed != sorted(made):
            raise RuntimeError(f"describe-volumes listed {len(listed)} volumes, not the {len(made)} made")
        cmds = commands(env)
        for c in cmds:
            c.run(env)  # warm the page cache and the bytecode caches
            c.times_ms.clear()
            c.cpu_ms.clear()
        loads = [load()]
        log(f"{len(cmds)} commands x {rounds} rounds, describe-volumes listing {len(made)} volumes")
        for _ in range(rounds):
            for c in cmds:
                c.run(env)
        loads.append(load())
    report(cmds, rounds, loads)


if __name__ == "__main__":
    main()
