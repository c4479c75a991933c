"""The README's service recipe, step by step, in a scratch root: every step that needs no
root runs as written (its absolute paths moved under the root), the unit's own
``ExecStart`` (and the plist's command) runs with the two-line environment file the
recipe writes, and the worker must serve. Also: every ``mlxq worker`` option reads its
``MLXQ_*`` variable."""

from __future__ import annotations

import argparse
import configparser
import os
import plistlib
import re
import shlex
import signal
import stat
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from conftest import RedisServer
from opshelp import wait_for
from rq import Worker

from mlxq.producer import Client

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
#: Steps a scratch root cannot take (they need root, the network or a service manager).
#: The test's own venv stands in for the one the recipe makes and installs mlxq into.
NEEDS_ROOT = ("useradd", "systemctl", "journalctl", "launchctl", "tail")


def recipe(marker: str) -> list[str]:
    """The commands of the first ``sh`` block after ``marker`` in the README."""
    at = README.index(marker)
    block = README[
        README.index("```sh\n", at) + 6 : README.index("```", README.index("```sh\n", at) + 6)
    ]
    return [line.strip() for line in block.splitlines() if line.strip()]


@dataclass
class Scratch:
    """What running a recipe in ``root`` made: the user it names, the venv, the files the
    person edits (the environment file), the owner a file was installed for."""

    root: Path
    user: str | None = None
    home: str | None = None
    venv: str | None = None
    edited: list[str] = field(default_factory=list)
    owners: dict[str, str] = field(default_factory=dict)

    def at(self, path: str) -> Path:
        """An absolute path of the recipe, moved under the root."""
        assert path.startswith("/"), path
        return self.root / path.lstrip("/")

    def moved(self, word: str) -> str:
        return word if word == "/dev/null" or not word.startswith("/") else str(self.at(word))


#: Directories the operating system has before any recipe runs.
SYSTEM_DIRS = ("etc/systemd/system", "Library/LaunchDaemons", "usr/local")


def run_recipe(lines: list[str], root: Path) -> Scratch:
    """Take each step of a recipe in ``root``; fail on a step this test does not know, so
    the README cannot grow one untested."""
    for d in SYSTEM_DIRS:
        (root / d).mkdir(parents=True)
    s = Scratch(root)
    for line in lines:
        argv = shlex.split(line)
        if argv[0] == "sudoedit" or argv[:2] == ["sudo", "-e"]:
            s.edited.append(argv[-1])  # the person writes the settings: done below
            continue
        if argv[0] == "sudo":
            argv = argv[1:]
        cmd = argv[0]
        if cmd in NEEDS_ROOT:
            if cmd == "useradd":
                s.user, s.home = argv[-1], argv[argv.index("--home-dir") + 1]
                s.at(s.home).mkdir(parents=True)
            continue
        if argv[1:3] == ["-m", "venv"]:
            s.venv = argv[3]
            s.at(s.venv).parent.mkdir(parents=True, exist_ok=True)
            s.at(s.venv).symlink_to(sys.prefix)  # the test's venv, mlxq[worker] installed
            continue
        if cmd.endswith("/bin/pip"):
            assert s.venv and cmd == f"{s.venv}/bin/pip" and argv[1] == "install", line
            continue
        assert cmd in ("mkdir", "install", "cp"), f"a step the test does not know: {line}"
        if cmd == "install" and "-o" in argv:  # chown needs root: remember who it is for
            i = argv.index("-o")
            s.owners[argv[-1]] = argv[i + 1]
            del argv[i : i + 2]
        subprocess.run([cmd, *(s.moved(w) for w in argv[1:])], cwd=REPO, check=True)
    return s


def env_file(path: Path) -> dict[str, str]:
    """Variables of an environment file as systemd reads one (and a shell: quotes)."""
    values = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = " ".join(shlex.split(value))
    return values


def settings(s: Scratch, url: str, model: Path) -> dict[str, str]:
    """The person's edit: the two lines the README says the file needs."""
    (edited,) = s.edited
    path = s.at(edited)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # made by the recipe's install -m 600
    lines = re.findall(r"^(MLXQ_\w+)=", README[README.index("## Operating mlxq") :], re.M)[:2]
    assert lines == ["MLXQ_MODEL", "MLXQ_REDIS_URL"]
    path.write_text(f"MLXQ_MODEL={model}\nMLXQ_REDIS_URL={url}\n")
    return env_file(path)


def base_env(home: Path) -> dict[str, str]:
    # What a service manager gives a service of its own, nothing of this test's.
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}


def serve_and_stop(argv: list[str], env: dict[str, str], url: str, log: Path, stop_s: int) -> None:
    proc = subprocess.Popen(argv, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        conn = redis.Redis.from_url(url)

        def ready() -> bool:
            assert proc.poll() is None, log.read_text()
            return any("default" in w.queue_names() for w in Worker.all(connection=conn))

        wait_for(ready, "the service's worker", timeout=120)
        with Client(url) as client:  # the queue the recipe's worker serves: default
            assert client.submit("from a service", max_tokens=3).result(timeout=120).token_ids
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        assert url not in cmdline, cmdline
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(stop_s)  # past it the service manager would kill it
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, log.read_text()


@pytest.fixture
def private_redis(tmp_path: Path):
    workdir = tmp_path / "redis"
    workdir.mkdir()
    server = RedisServer(workdir)
    yield server
    server.stop()


def test_systemd_recipe_runs_the_units_exec_start(private_redis, tiny_model, tmp_path):
    s = run_recipe(recipe("- Linux, systemd:"), tmp_path / "root")
    values = settings(s, private_redis.url, tiny_model)
    unit_path = s.at("/etc/systemd/system/mlxq-worker.service")
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string(unit_path.read_text())
    service = unit["Service"]
    # The unit names what the recipe made: its user, its environment file, its venv.
    assert service["User"] == s.user
    assert service["EnvironmentFile"] == s.edited[0]
    argv = shlex.split(service["ExecStart"])
    assert argv[0] == f"{s.venv}/bin/mlxq" and argv[1:] == ["worker"]
    assert s.at(argv[0]).exists()
    # ${VAR} from the environment file, as systemd expands it (the unit needs none).
    argv = [re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], a) for a in argv]
    env = dict(base_env(s.at(s.home)), **values)
    stop_s = int(service["TimeoutStopSec"])
    serve_and_stop(
        [str(s.at(argv[0])), *argv[1:]], env, private_redis.url, tmp_path / "systemd.log", stop_s
    )


def test_launchd_recipe_runs_the_plists_command(private_redis, tiny_model, tmp_path):
    s = run_recipe(recipe("- macOS, launchd:"), tmp_path / "root")
    venv = s.venv
    url = private_redis.url.replace("/0", "/1")
    settings(s, url, tiny_model)
    (plist_path,) = (s.root / "Library/LaunchDaemons").iterdir()
    with plist_path.open("rb") as f:
        plist = plistlib.load(f)
    (edited,) = s.edited
    assert s.owners == {edited: plist["UserName"]}  # its shell, as that user, reads the file
    assert s.at(os.path.dirname(plist["StandardOutPath"])).is_dir()  # launchd makes no dirs
    shell, flag, script = plist["ProgramArguments"]
    assert (shell, flag) == ("/bin/sh", "-c")
    assert f". {edited};" in script and script.endswith(f"exec {venv}/bin/mlxq worker")
    script = script.replace(edited, str(s.at(edited))).replace(venv, str(s.at(venv)))
    env = base_env(tmp_path)
    serve_and_stop([shell, flag, script], env, url, tmp_path / "launchd.log", plist["ExitTimeOut"])


# -- every option from the environment ---------------------------------------------------

#: A value for each option's variable, and what the worker's config must then hold.
SAMPLES = {
    "model": ("some/model", "model", "some/model"),
    "redis_url": ("redis://10.0.0.9:6390/2", "redis_url", "redis://10.0.0.9:6390/2"),
    "queue": ("chat team-a:3,team-b:1 sweeps", "queues", ("chat", "team-a:3,team-b:1", "sweeps")),
    "preempt": ("1", "preempt", False),
    "warm_up": ("1", "warm_up", False),
    "reserve_rows": ("2", "reserve_rows", 2),
    "max_pauses": ("5", "max_pauses", 5),
    "paused_kv_bytes": ("1000", "paused_kv_bytes", 1000),
    "window_ms": ("7.5", "window_ms", 7.5),
    "window_max_ms": ("40", "window_max_ms", 40.0),
    "max_batch": ("12", "max_batch", 12),
    "admit_hold_steps": ("0", "admit_hold_steps", 0),
    "prefill_buckets": ("on", "prefill_buckets", True),
    "fused_prefill": ("off", "fused_prefill", False),
    "name": (f"env-{uuid.uuid4().hex[:6]}", "name", None),
    "grace_s": ("3", "grace_s", 3.0),
    "slow_turn_ms": ("250", "slow_turn_ms", 250.0),
    "stream_ttl": ("60", "stream_ttl", 60),
    "stream_interval_ms": ("0", "stream_interval_ms", 0.0),
    "max_tokens_cap": ("99", "max_tokens_cap", 99),
    "metrics_port": ("9999", "metrics_port", 9999),
    "metrics_host": ("127.0.0.1", "metrics_host", "127.0.0.1"),
    "prompt_cache_bytes": ("0", "prompt_cache_bytes", 0),
    "routing": ("yes", "routing", False),
    "allow_mixed_models": ("1", "allow_mixed_models", True),
    "wait_replicas": ("2", "wait_replicas", 2),
    "log_level": ("DEBUG", None, None),
    "log_format": ("json", None, None),
}


def _worker_parser() -> argparse.ArgumentParser:
    from mlxq.worker.cli import add_worker_arguments

    p = argparse.ArgumentParser()
    add_worker_arguments(p)
    return p


def test_every_worker_option_reads_its_variable_and_the_command_line_wins():
    from mlxq.worker.cli import ENV, config_from

    p = _worker_parser()
    options = [a for a in p._actions if a.option_strings and a.dest != "help"]
    assert {a.dest for a in options} == set(ENV.options) == set(SAMPLES)
    for a in options:  # --help names each variable
        assert f"${ENV.options[a.dest].env}" in (a.help or ""), a.option_strings
    environ = {ENV.options[d].env: text for d, (text, _, _) in SAMPLES.items()}
    args = p.parse_args([])
    ENV.resolve(args, environ)
    assert (args.log_level, args.log_format) == ("DEBUG", "json")
    os_env = dict(os.environ)
    try:
        os.environ.update(environ)
        config = config_from(p.parse_args([]))
        given = config_from(p.parse_args(["--max-batch", "5", "--queue", "q", "--no-routing"]))
    finally:
        os.environ.clear()
        os.environ.update(os_env)
    for dest, (text, attr, want) in SAMPLES.items():
        if attr is not None:
            assert getattr(config, attr) == (text if want is None else want), dest
    assert (given.max_batch, given.queues, given.routing, given.window_ms) == (
        5,
        ("q",),
        False,
        7.5,
    )


def test_a_bad_variable_is_named_with_its_value():
    from mlxq.worker.cli import ENV

    p = _worker_parser()
    args = p.parse_args(["--max-batch", "8"])
    bad = {"MLXQ_MAX_BATCH": "lots", "MLXQ_WINDOW_MS": "soon", "MLXQ_NO_ROUTING": "maybe"}
    with pytest.raises(ValueError) as e:
        ENV.resolve(args, dict(bad, MLXQ_PREFILL_BUCKETS="sideways"))
    text = str(e.value)
    assert "MLXQ_MAX_BATCH" not in text  # the command line's --max-batch 8 won
    for part in (
        "MLXQ_WINDOW_MS='soon'",
        "MLXQ_NO_ROUTING='maybe'",
        "MLXQ_PREFILL_BUCKETS='sideways'",
    ):
        assert part in text, text
    assert "--model is needed" in text and "$MLXQ_MODEL" in text
    assert args.max_batch == 8 and args.window_ms == 20.0  # filled whole all the same
    out = subprocess.run(
        [sys.executable, "-m", "mlxq.producer.cli", "worker"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("MLXQ_")}
        | {"MLXQ_MAX_BATCH": "x"},
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "MLXQ_MAX_BATCH='x'" in out.stderr and "--model is needed" in out.stderr
