"""acp-proxy's releases and the state schema each wrote, so that what is said about a state database can name versions.

Versions follow semantic versioning. While the major version is 0, a release that changes the
state schema or what the proxy does is a minor one, a release of fixes alone a patch.
CHANGELOG.md says what each release changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from acp_proxy import __version__

FIRST_WRITERS: Final[Mapping[int, str]] = {
    1: "0.1.0",
    2: "0.2.0",
    3: "0.3.0",
    4: "0.4.0",
    5: "0.5.0",
    6: "0.7.0",
    7: "0.13.0",
}
"""Each state schema version, and the first release that wrote it (the release that brought its migration)."""

WRITTEN_BY_KEY: Final = "schema_written_by"
"""The ``meta`` key naming the release that last migrated the database, set with each migration."""


def first_writer(schema: int) -> str | None:
    """The first release that wrote state schema ``schema``; ``None`` for one this release does not know."""
    return FIRST_WRITERS.get(schema)


def release_of(schema: int, written_by: str | None) -> str:
    """Who wrote a database of ``schema``, as a message says it: the release it recorded, else the first to write it."""
    if written_by:
        return f"acp-proxy {written_by}"
    first = first_writer(schema)
    return f"acp-proxy {first} or newer" if first else "a newer acp-proxy"


def newer_schema(path: object, schema: int, understood: int, written_by: str | None) -> str:
    """Why this release refuses a database ``path`` of a ``schema`` newer than the ``understood`` one."""
    return (
        f"{path} has schema version {schema}, written by {release_of(schema, written_by)}; this is "
        f"acp-proxy {__version__}, which understands schema {understood} at most"
    )
