"""The wheel carries the wrapper program, and an installed acp-proxy finds and runs it from there.

The wheel is built offline from this checkout (``pip wheel --no-build-isolation``: hatchling
is in the test extra) and installed with ``pip install --target``; the installed copy is then
put first on the path of the processes under test, ahead of this checkout.
"""

from __future__ import annotations

import email
import fcntl
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

import acp_proxy
from acp_proxy.ownership.owner import WRAPPER_NAME
from acp_proxy.state.migrations import SCHEMA_VERSION
from tests.support import Gateway

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parent.parent
SHIPPED = f"acp_proxy/_wrappers/{WRAPPER_NAME}"


def pip(*args: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", *args, "--quiet", "--disable-pip-version-check", "--no-index", "--no-deps"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"pip {args[0]} failed:\n{done.stdout}{done.stderr}"


def once_per_run(
    tmp_path_factory: pytest.TempPathFactory, worker_id: str, name: str, make: Callable[[Path], None]
) -> Path:
    """A directory of this test run's, shared by its xdist workers: the first to ask makes it (``make``
    fills a directory beside it, renamed into place once complete) under a lock, and the others use
    it (building the wheel and installing it take about 15 s of CPU each)."""
    base = tmp_path_factory.getbasetemp()
    shared = base if worker_id == "master" else base.parent  # under xdist: the run's, above each worker's
    made = shared / name
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.exists():
            making = shared / f"{name}.{os.getpid()}"
            make(making)
            making.rename(made)
    return made


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    def build(into: Path) -> None:
        pip("wheel", "--no-build-isolation", "--wheel-dir", str(into), str(ROOT))

    (built,) = once_per_run(tmp_path_factory, worker_id, "wheel", build).glob("acp_proxy-*.whl")
    return built


@pytest.fixture(scope="session")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """A directory with the wheel installed in it, as site-packages would have it."""

    def install(into: Path) -> None:
        pip("install", "--target", str(into), str(wheel))

    return once_per_run(tmp_path_factory, worker_id, "site", install).resolve()


def installed_env(base: dict[str, str], site: Path) -> dict[str, str]:
    """The installed copy first on sys.path: before site-packages (and this checkout's .pth), no cwd."""
    return {**base, "PYTHONPATH": str(site), "PYTHONSAFEPATH": "1"}


def test_the_wheel_ships_the_wrapper_inside_the_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        assert archive.read(SHIPPED) == (ROOT / "wrappers" / WRAPPER_NAME).read_bytes()
        core = "adapter_wrapper_core.py"  # the program's code, which the script starts
        assert archive.read(f"acp_proxy/_wrappers/{core}") == (ROOT / "wrappers" / core).read_bytes()
    assert "acp_proxy/_wrappers/__init__.py" in names
    # Nothing at the top level but the package and its metadata: no generic `wrappers` package.
    assert {name.split("/")[0] for name in names} == {"acp_proxy", wheel.name.split("-py3")[0] + ".dist-info"}
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]


def test_the_wheel_ships_the_example_agent_and_nothing_of_the_checkout(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert "acp_proxy/examples/echo_agent.py" in names
    assert "acp_proxy/py.typed" in names
    assert f"{wheel.name.split('-py3')[0]}.dist-info/licenses/LICENSE" in names
    shipped_from_checkout = [n for n in names if n.split("/")[0] in ("tests", "scripts", "benchmarks", "docs")]
    assert shipped_from_checkout == []
    assert not [n for n in names if "/tests/" in n or n.endswith("conftest.py")]


def test_the_wheel_metadata_is_complete_and_its_version_is_the_packages(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = email.message_from_bytes(archive.read(name))
    assert metadata["Name"] == "acp-proxy"
    assert metadata["Version"] == acp_proxy.__version__
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["License-File"] == "LICENSE"
    assert metadata["Requires-Python"] == ">=3.11"
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert metadata.get_payload().startswith("# acp-proxy"), "the README is the long description"
    classifiers = metadata.get_all("Classifier") or []
    assert {"Environment :: Console", "Typing :: Typed", "Framework :: Trio"} <= set(classifiers)
    assert metadata.get_all("Project-URL")
    required = {re.split(r"[<>=;\s]", r)[0] for r in metadata.get_all("Requires-Dist") or [] if "extra ==" not in r}
    assert required == {
        "anyio",
        "trio",
        "psutil",
        "msgspec",
        "sniffio",
        "prometheus-client",
        "rich",
        "hypercorn",
        "wsproto",
        "hpack",
    }


def test_an_installed_package_says_its_version(proc_env: dict[str, str], installed: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "acp_proxy", "--version"],
        env=installed_env(dict(proc_env), installed),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert done.stdout.strip() == f"acp-proxy {acp_proxy.__version__} (state schema {SCHEMA_VERSION})"


def test_an_installed_package_finds_the_wrapper_it_ships(
    proc_env: dict[str, str], installed: Path, tmp_path: Path
) -> None:
    probe = "import acp_proxy.ownership.owner as owner\nprint(owner.__file__)\nprint(owner.wrapper_path())\n"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env=installed_env(dict(proc_env), installed),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    module, wrapper = done.stdout.splitlines()
    assert Path(module) == installed / "acp_proxy" / "ownership" / "owner.py"
    assert Path(wrapper) == installed / SHIPPED


def test_an_install_without_the_wrapper_says_where_it_should_be(
    proc_env: dict[str, str], installed: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "site"
    subprocess.run(["cp", "-r", str(installed), str(broken)], check=True, timeout=30)
    (broken / SHIPPED).unlink()
    probe = (
        "from acp_proxy.ownership.owner import WrapperMissing, wrapper_path\n"
        "try:\n"
        "    wrapper_path()\n"
        "except WrapperMissing as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env=installed_env(dict(proc_env), broken),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert done.stdout.startswith("the adapter wrapper is missing: expected")
    assert str(broken.resolve() / SHIPPED) in done.stdout


def process_argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [arg.decode() for arg in fh.read().split(b"\0")[:-1]]
    except OSError:
        return []


def children_of(pid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as fh:
                    if int(fh.read().rsplit(b")", 1)[1].split()[1]) == pid:
                        found.append(int(name))
            except OSError:
                continue
    return found


@pytest.mark.anyio
async def test_an_installed_proxy_runs_the_wrapper_from_its_install(
    installed: Path, proc_env: dict[str, str], tmp_path: Path
) -> None:
    """An installed proxy in front of the bundled echo agent: its wrapper runs from the install."""
    env = installed_env(proc_env, installed)
    echo = [sys.executable, "-m", "acp_proxy.examples.echo_agent"]
    async with Gateway.start(env, tmp_path, adapter=echo, forked=False) as gw:  # the installed package, exec'd
        response = await gw.initialize()
        assert "result" in response
        await gw.new_session()
        wrappers = [argv for argv in map(process_argv, children_of(gw.pid)) if argv[1:3] == ["-I", "-S"]]
        assert wrappers, "no wrapper process under the proxy"
        for argv in wrappers:
            assert Path(argv[3]) == installed / SHIPPED
            assert argv[argv.index("--") + 1 :] == echo
