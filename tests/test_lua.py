"""The Lua scripts' copies of Python's lists, held equal to them, and their wrappers."""

from __future__ import annotations

import re
from importlib import resources

from mlxq.producer.outcome import RQ_TERMINAL


def _lua(package: str, name: str) -> str:
    return resources.files(package).joinpath("lua", name).read_text("utf-8")


def test_lua_terminal_set_is_the_outcomes_one():
    (table,) = re.findall(r"^local TERMINAL = \{(.*)\}$", _lua("mlxq.producer", "lib.lua"), re.M)
    names = {k for k, v in re.findall(r"(\w+) = (\w+)", table) if v == "true"}
    assert names == set(RQ_TERMINAL)


def test_every_script_has_one_wrapper_and_is_installed():
    from mlxq.producer import scripts
    from mlxq.worker import commit
    from mlxq.worker import scripts as worker_scripts

    for package, names in (
        ("mlxq.worker", set(worker_scripts.NAMES)),
        ("mlxq.producer", {scripts.CANCEL.name, scripts.RETRY.name, "lib"}),
    ):
        files = {f.name for f in resources.files(package).joinpath("lua").iterdir()}
        assert files == {f"{n}.lua" for n in names}
    for name in worker_scripts.NAMES:  # the writer's beside its one caller, the others here
        assert callable(getattr(worker_scripts, name, None) or getattr(commit, name))
