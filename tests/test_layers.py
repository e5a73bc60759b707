"""What the stdio proxy imports, checked statically.

The import-linter contracts in pyproject.toml hold what ``acp_proxy.serve`` (the proxy) imports,
directly or not. The command line is the one module both the proxy and the operator's commands go
through: its module-level imports must stay those the proxy needs, every command importing its
own modules in the function that runs it. These tests read that from the source.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "acp_proxy"

# (module, what it may import at module level, besides the standard library)
MODULE_LEVEL = [
    ("main.py", {"acp_proxy.operator.cli"}),
    (
        "operator/cli.py",
        # the state package's parts are what its facade (acp_proxy.state) loads for every proxy anyway
        {"acp_proxy", "acp_proxy.logs", "acp_proxy.config", "acp_proxy.state"}
        | {f"acp_proxy.state.{part}" for part in ("connection", "directory", "migrations", "writer")},
    ),
]


def module_level_imports(path: Path) -> set[str]:
    """The modules ``path`` imports outside functions and ``if TYPE_CHECKING:`` blocks."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            # ``from acp_proxy.operator import cli`` imports the module acp_proxy.operator.cli
            found |= {
                f"{node.module}.{alias.name}" if is_ours(f"{node.module}.{alias.name}") else node.module
                for alias in node.names
            }
    return found - {"__future__"}


def is_ours(module: str) -> bool:
    """Whether ``module`` is a module or package of acp_proxy."""
    parts = module.split(".")
    if parts[0] != "acp_proxy":
        return False
    path = PACKAGE.joinpath(*parts[1:])
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


@pytest.mark.parametrize(("module", "allowed"), MODULE_LEVEL, ids=[row[0] for row in MODULE_LEVEL])
def test_the_command_line_imports_what_the_proxy_needs_and_no_more(module: str, allowed: set[str]) -> None:
    imported = module_level_imports(PACKAGE / module)
    ours = {name for name in imported if name.split(".")[0] == "acp_proxy"}
    assert ours <= allowed, f"{module} imports {sorted(ours - allowed)} for every proxy: import it where it is used"
    theirs = {name.split(".")[0] for name in imported} - {"acp_proxy"}
    assert theirs <= set(sys.stdlib_module_names), f"{module} imports {sorted(theirs)}"


def test_an_import_in_a_function_or_for_type_checking_is_not_module_level(tmp_path: Path) -> None:
    source = tmp_path / "sample.py"
    source.write_text(
        "from __future__ import annotations\nimport os\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import rich\n"
        "def run() -> None:\n    import psutil\n"
    )
    assert module_level_imports(source) == {"os", "typing"}


def _adapter_fields() -> set[str]:
    """The instance fields of ``pool.adapter.Adapter``: what ``__init__`` assigns on ``self``."""
    return _init_fields("pool/adapter.py", "Adapter")


def _tenancy_fields() -> set[str]:
    """The instance fields of ``pool.tenancy.Tenancy``: what a process is to the sessions."""
    return _init_fields("pool/tenancy.py", "Tenancy")


def _init_fields(module: str, name: str) -> set[str]:
    """What ``__init__`` of the class ``name`` in ``acp_proxy/<module>`` assigns on ``self``."""
    tree = ast.parse((PACKAGE / module).read_text())
    found = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name)
    init = next(node for node in found.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    return {
        target.attr
        for node in ast.walk(init)
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
    }


def _struct_fields(module: str, name: str) -> set[str]:
    """The declared fields of the class ``name`` in ``acp_proxy/<module>``."""
    tree = ast.parse((PACKAGE / module).read_text())
    found = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name)
    return {
        node.target.id for node in found.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


def _usage_fields() -> set[str]:
    """The fields of ``pool.usage.Usage``: the pool's account of one process."""
    return _struct_fields("pool/usage.py", "Usage")


def _assigned_attributes(skip: Callable[[Path], bool]) -> Iterator[tuple[str, ast.Attribute]]:
    """Every attribute assigned (``x.a = ``, ``x.a += ``, ``x.a, y.b = ``) in the package's modules but
    those ``skip`` names: where (``path:line``), and the attribute."""
    for path in sorted(PACKAGE.rglob("*.py")):
        if skip(path):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            else:
                continue
            for target in targets:
                for part in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(part, ast.Attribute):
                        yield f"{path.relative_to(PACKAGE)}:{node.lineno}", part


def test_an_adapter_is_a_connection_and_the_pool_keeps_the_account_of_its_process() -> None:
    """``Adapter`` holds its process, pipes, pending calls and id maps; the slot, the clocks and the memory
    figures are the pool's (``Usage``), assigned by no module outside pool/ (the test below); what the
    process is to the sessions (claimed, the turn on it, muted, its replay swallowed, requests the gateway
    owes, a recycle due) is its ``Tenancy``, and whether it is busy is decided there, not by the connection."""
    accounting = {"slot", "started_at", "recent_until", "memory", "last_active", "turnaround", "quiet_at"}
    assert accounting <= _usage_fields()
    assert not accounting & _adapter_fields()
    lifecycle = {"claimed", "first_answered", "muted", "swallow_updates", "upstream_pending", "turn", "recycle"}
    assert lifecycle <= _tenancy_fields()
    assert not lifecycle & _adapter_fields()
    adapter = next(
        node
        for node in ast.parse((PACKAGE / "pool" / "adapter.py").read_text()).body
        if isinstance(node, ast.ClassDef) and node.name == "Adapter"
    )
    methods = {node.name for node in adapter.body if isinstance(node, ast.FunctionDef)}
    assert "busy" not in methods


def test_no_module_outside_the_pool_assigns_a_field_of_an_adapter() -> None:
    """An adapter is changed through its methods (``pool/adapter.py``), never field by field from above;
    the pool's account of its process (``adapter.usage``) and what it is to the sessions
    (``adapter.tenancy``) likewise."""
    fields = _adapter_fields() | _usage_fields() | _tenancy_fields()
    assert {"gateway_session", "claimed", "swallow_updates", "upstream_pending", "last_active"} <= fields
    found = [
        f"{where}: {ast.unparse(part)}"
        for where, part in _assigned_attributes(lambda path: path.parent.name == "pool")
        if part.attr in fields and ast.unparse(part.value).endswith(("adapter", "adapter.usage", "adapter.tenancy"))
    ]
    assert found == []


def _session_fields() -> set[str]:
    """The fields of ``sessions.table.Session``."""
    return _struct_fields("sessions/table.py", "Session")


def test_only_the_session_table_assigns_a_field_of_a_session() -> None:
    """A session's phase, epoch, process, queue and restore in progress change only through ``SessionTable``
    (sessions/table.py): its ``advance`` carries out the lifecycle's steps. No other module assigns any of
    them, whatever the variable is called (no other object of the package has a field of these names
    assigned from outside its own methods)."""
    fields = _session_fields()
    assert {"state", "adapter", "work", "resume_scope", "record"} <= fields  # state: phase, epoch, queue
    found = [
        f"{where}: {ast.unparse(part)}"
        for where, part in _assigned_attributes(lambda path: path == PACKAGE / "sessions" / "table.py")
        if part.attr in fields and ast.unparse(part.value) != "self"
    ]
    assert found == []


def test_the_composition_root_builds_in_order_and_wires_nothing_afterwards() -> None:
    """``serve.py`` builds each object after those it needs and hands them in: it assigns no attribute of
    any object, and the one name a function of it uses before the name is bound is the pool's ``suspend``
    over the intents (the one call that goes up, built before the intents it calls)."""
    tree = ast.parse((PACKAGE / "serve.py").read_text())
    assigned = [
        ast.unparse(part)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        for part in (target.elts if isinstance(target, ast.Tuple) else [target])
        if isinstance(part, ast.Attribute)
    ]
    assert assigned == []
    root = next(node for node in tree.body if isinstance(node, ast.AsyncFunctionDef) and node.name == "serve_gateway")
    bound_at = {
        target.id: node.lineno
        for node in ast.walk(root)
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name)
    }
    used_early = {
        (getattr(inner, "name", "<lambda>"), name.id)
        for inner in ast.walk(root)
        if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) and inner is not root
        for name in ast.walk(inner)
        if isinstance(name, ast.Name) and name.id in bound_at and bound_at[name.id] > getattr(inner, "lineno", 0)
    }
    assert used_early <= {("suspend", "intents")}, used_early


BEFORE_THE_LOOP = ("acp_proxy.main", "acp_proxy.early_signals", "acp_proxy.ownership.owner", "acp_proxy.pool.processes")
"""What a proxy imports before it launches its first adapter (``operator/cli.py``'s ``_serve``)."""
THE_RELAY = ("acp_proxy.serve", "anyio._backends._asyncio")
"""What it imports then, to serve."""
NOT_FOR_A_PROXY = (
    "hypercorn",
    "wsproto",
    "h11",
    "h2",
    "hpack",
    "rich",
    "prometheus_client",
    "acp_proxy.remote",
    "acp_proxy.operator.top",
)
"""What only ``serve --listen``, ``connect``, ``top`` and ``metrics`` need."""


def modules_after(env: dict[str, str], *modules: str) -> set[str]:
    """``sys.modules`` of a fresh interpreter (under ``env``) once it has imported ``modules``."""
    code = f"import sys\nfor m in {list(modules)!r}: __import__(m)\nprint('\\n'.join(sys.modules))"
    run = [sys.executable, "-c", code]
    done = subprocess.run(run, capture_output=True, text=True, timeout=60, cwd=PACKAGE.parent, env=env)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_a_proxy_launches_its_first_adapter_before_it_imports_an_event_loop(proc_env: dict[str, str]) -> None:
    """The adapter's start overlaps the import of the loop and the relay (``acp_proxy.main``)."""
    loaded = modules_after(proc_env, *BEFORE_THE_LOOP)
    assert {"asyncio", "trio", "acp_proxy.serve", "acp_proxy.relay.gateway"}.isdisjoint(loaded)


def test_the_stdio_proxy_imports_nothing_only_the_network_or_the_operators_views_need(
    proc_env: dict[str, str],
) -> None:
    loaded = modules_after(proc_env, *BEFORE_THE_LOOP, *THE_RELAY)
    assert {"asyncio", "acp_proxy.serve"} <= loaded  # it did import the relay
    unneeded = sorted(m for m in loaded if m.startswith(NOT_FOR_A_PROXY))
    assert not unneeded, f"a stdio proxy imports {unneeded}"
