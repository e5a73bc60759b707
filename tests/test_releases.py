"""Releases and the state schema: what ``--version`` says, what CHANGELOG.md and the releases table
hold, how a release refuses a database a newer one wrote, and an older release serving beside this
one on one install."""

from __future__ import annotations

import itertools
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from acp_proxy import __version__, releases
from acp_proxy.state import StateDB
from acp_proxy.state.connection import StateError
from acp_proxy.state.migrations import SCHEMA_VERSION, schema_written_by
from tests.kit.gateway import Gateway as KitGateway
from tests.support import Gateway, cli_json, fake_command

ROOT = Path(__file__).parent.parent
CHANGELOG = ROOT / "CHANGELOG.md"

RELEASE_BEFORE = "572148d3d3c376fbad34a202745fd3b996bb504c"
"""0.12.0, the last release that wrote schema 6, as its commit."""


# --- the releases, the changelog and --version ---------------------------------------------------


def changelog_releases() -> list[tuple[str, int]]:
    """(version, schema) of each release CHANGELOG.md lists, newest first.

    An ``[Unreleased]`` section (Keep a Changelog's: what ``main`` holds beyond the last release)
    may come first, above every release, and only there: anywhere else it fails as no version."""
    found: list[tuple[str, int]] = []
    for heading, body in re.findall(r"^## \[([^\]]+)\][^\n]*\n(.*?)(?=^## |\Z)", CHANGELOG.read_text(), re.M | re.S):
        if heading == "Unreleased" and not found:
            continue
        schema = re.search(r"[Ss]tate schema (\d+)", body)
        assert schema, f"the release {heading} names its state schema"
        found.append((heading, int(schema.group(1))))
    return found


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def test_the_changelog_lists_every_release_newest_first_this_one_on_top() -> None:
    listed = changelog_releases()
    assert listed[0] == (__version__, SCHEMA_VERSION)
    assert [v for v, _ in listed] == sorted((v for v, _ in listed), key=version_key, reverse=True)
    assert all(re.fullmatch(r"\d+\.\d+\.\d+", v) for v, _ in listed), "semantic versions"
    first: dict[int, str] = {}
    for version, schema in reversed(listed):
        first.setdefault(schema, version)
    assert first == dict(releases.FIRST_WRITERS), "the table names the first release of each schema the changelog lists"
    assert list(first) == list(range(1, SCHEMA_VERSION + 1)), "every schema, in order"


def test_each_schema_change_is_at_least_a_minor_release() -> None:
    listed = list(reversed(changelog_releases()))
    for (older, older_schema), (newer, newer_schema) in itertools.pairwise(listed):
        if newer_schema != older_schema:
            assert version_key(newer)[:2] > version_key(older)[:2], (older, newer)


def test_version_names_the_release_and_the_schema_it_writes(proc_env: dict[str, str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "acp_proxy", "--version"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        env=proc_env,
    )
    assert done.stdout.strip() == f"acp-proxy {__version__} (state schema {SCHEMA_VERSION})"


# --- the refusal of a newer schema ---------------------------------------------------------------


def database_of(tmp_path: Path, schema: int, written_by: str | None) -> Path:
    StateDB(tmp_path).close()
    with sqlite3.connect(tmp_path / "state.db") as conn:
        conn.execute("DELETE FROM meta WHERE key = ?", (releases.WRITTEN_BY_KEY,))
        if written_by is not None:
            conn.execute("INSERT INTO meta (key, value) VALUES (?, ?)", (releases.WRITTEN_BY_KEY, written_by))
        conn.execute(f"PRAGMA user_version = {schema}")
    conn.close()
    return tmp_path / "state.db"


# (sentence, the database's schema, the release it says wrote it, who the refusal names)
REFUSALS = [
    ("a release that recorded itself is named", SCHEMA_VERSION + 1, "0.8.0", "acp-proxy 0.8.0"),
    ("so is one of a far newer schema", SCHEMA_VERSION + 5, "2.1.3", "acp-proxy 2.1.3"),
    ("one that did not: a newer acp-proxy", SCHEMA_VERSION + 1, None, "a newer acp-proxy"),
]


@pytest.mark.parametrize(("schema", "written_by", "named"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_a_newer_schema_is_refused_naming_both_releases(
    tmp_path: Path, schema: int, written_by: str | None, named: str
) -> None:
    path = database_of(tmp_path, schema, written_by)
    with pytest.raises(StateError) as refused:
        StateDB(tmp_path)
    assert str(refused.value) == (
        f"{path} has schema version {schema}, written by {named}; this is acp-proxy {__version__}, "
        f"which understands schema {SCHEMA_VERSION} at most: upgrade acp-proxy"
    )
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == schema, "refused, not rewritten"
    conn.close()


@pytest.mark.parametrize(
    ("schema", "written_by", "said"),
    [
        (SCHEMA_VERSION, None, f"acp-proxy {releases.FIRST_WRITERS[SCHEMA_VERSION]} or newer"),
        (SCHEMA_VERSION + 1, None, "a newer acp-proxy"),
        (SCHEMA_VERSION + 1, "0.9.2", "acp-proxy 0.9.2"),
    ],
)
def test_who_wrote_a_schema(schema: int, written_by: str | None, said: str) -> None:
    assert releases.release_of(schema, written_by) == said


def test_a_migration_records_the_release_that_made_it(tmp_path: Path) -> None:
    StateDB(tmp_path).close()
    with sqlite3.connect(tmp_path / "state.db") as conn:
        conn.execute("DELETE FROM meta WHERE key = ?", (releases.WRITTEN_BY_KEY,))
        conn.execute("DROP INDEX tasks_by_operation")
        conn.execute("ALTER TABLE tasks DROP COLUMN answer")
        conn.execute("ALTER TABLE tasks DROP COLUMN operation_id")
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION - 1}")  # as the release before this one left it
    conn.close()
    db = StateDB(tmp_path)
    try:
        assert schema_written_by(db.conn) == __version__
        assert db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    finally:
        db.close()


# --- an older release beside this one ----------------------------------------------------------


def older_release(tmp_path: Path, commit: str) -> Path:
    """The package and wrapper of ``commit``, from git history, in a directory of their own."""
    if subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True
    ).returncode:
        pytest.skip(f"this checkout has no git history with {commit[:12]} (a git clone of main has it)")
    tree = tmp_path / f"release-{commit[:12]}"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "acp_proxy", "wrappers"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


def user_version(state_dir: Path) -> int:
    with sqlite3.connect(state_dir / "state.db") as conn:
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    conn.close()
    return version


@pytest.mark.anyio
async def test_the_release_before_and_this_one_serve_one_install_at_once(
    proc_env: dict[str, str], tmp_path: Path, anyio_backend: str
) -> None:
    tree = older_release(tmp_path, RELEASE_BEFORE)
    state_dir = Path(proc_env["ACP_PROXY_STATE_DIR"])
    old_env = {**proc_env, "PYTHONPATH": str(tree)}
    old_argv = [sys.executable, "-m", "acp_proxy", "--async-backend", anyio_backend, "--", *fake_command()]
    async with KitGateway.launch(old_argv, env=old_env, cwd=tree, name="the older proxy", first_id=1001) as old:
        old_meta = (await old.initialize())["result"]["_meta"]["acp-proxy"]
        assert user_version(state_dir) == SCHEMA_VERSION - 1, "the older release made the database"
        async with Gateway.start(proc_env, tmp_path) as new:
            new_meta = (await new.initialize())["result"]["_meta"]["acp-proxy"]
            assert user_version(state_dir) == SCHEMA_VERSION, "this one migrated it, the older one serving"
            old_session, new_session = await old.new_session(), await new.new_session()
            old_answer = await old.prompt(old_session, "hello from the older release")
            new_answer = await new.prompt(new_session, "hello from this one")
            listed = await cli_json(proc_env, "sessions", "list")
    assert (old_meta["version"], new_meta["version"]) == ("0.12.0", __version__), "the two releases, as each says"
    assert old_answer["result"]["stopReason"] == new_answer["result"]["stopReason"] == "end_turn"
    assert {s["sessionId"] for s in listed["sessions"]} == {old_session, new_session}
    db = StateDB(state_dir, read_only=True)
    try:
        assert schema_written_by(db.conn) == __version__
    finally:
        db.close()
