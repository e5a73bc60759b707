"""Which module states SQL on which table, checked from the source.

Every statement on ``sessions`` lives in the sessions registry, every statement on ``tasks`` in
the task records, and so on for every table (``OWNERS``), so that the operator's views
(``status``, ``sessions``, ``metrics``, ``top``, ``tasks``, all read through
``operator/install_view.py``) read the same rows the same way. The state module's migrations are the exception: they
rewrite every table once. A task's session title is read by the
sessions registry (``titles_of``) and joined in Python by whoever shows or tells it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "acp_proxy"

OWNERS = {
    "sessions": "sessions/registry.py",
    "tasks": "tasks/records.py",
    "leases": "ownership/leases.py",
    "instances": "ownership/instances.py",
    "backend_facts": "pool/learned.py",
    "events": "journal.py",
    "counters": "journal.py",
    "tokens": "remote/tokens.py",  # remote.db, beside the state database
    "session_owners": "remote/tokens.py",
}
MIGRATIONS = "state/migrations.py"
KNOWN = {
    ("ownership/instances.py", "leases"),  # an instance ends once none of its leases is active
}
"""(module, table): statements outside the owner, named so that no new one slips in."""


def _statements_on(table: str, source: str) -> bool:
    return re.search(rf"\b(FROM|JOIN|UPDATE|INTO)\s+{table}\b", source) is not None


@pytest.mark.parametrize("table", sorted(OWNERS))
def test_statements_on_a_table_live_in_its_owner(table: str) -> None:
    stating = {
        str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if _statements_on(table, path.read_text())
    }
    assert OWNERS[table] in stating  # the check finds what it looks for
    assert stating - {OWNERS[table], MIGRATIONS} == {module for module, known in KNOWN if known == table}
