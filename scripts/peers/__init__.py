"""Manual check: published ACP clients and adapters work unchanged through acp-proxy.

    scripts/check-peers [WORKDIR] [--proxy CMD] [--proxy-python PY] [--no-install] [--only NAME]...

Not run by the test suite: it needs npm, and network access to the npm registry and PyPI. It
installs the peers into WORKDIR (default /tmp/acp-peers; ``installation``): acpx (a headless
ACP client) and the adapters of the ADAPTERS table (``adapters``) from npm, and a venv with
agent-client-protocol, the Python ACP SDK, which runs this package's SDK agent and client
(``sdk_agent.py``, ``sdk_client.py``: the agent answers offline, so no API key is needed).

Every check runs twice, once straight against the peer and once with the agent command wrapped
as ``acp-proxy -- CMD``, and compares the two (``wire``): the only allowed differences are in
the initialize result: ``_meta["acp-proxy"]``, and the session capabilities the proxy serves
itself (``close``, ``list`` and ``delete``, and ``resume`` when the adapter can load), which
must be present through the proxy; ``fork`` is relayed as the adapter advertised it. After each
run no process it started may be left (every process gets a marker in its environment and /proc
is searched for it, ``harness``); a leftover after a proxied run is a failure, after a direct
run a note.

The checks, a table in ``checks``, one module per family:

* ``sdk_checks``: sdk-prompt-turn[-trio], the SDK client and agent;
* ``acpx_checks``: acpx-exec-*, acpx-sessions-sdk-agent, acpx driving the SDK agent, the
  proxy's echo agent, codex-acp and claude-agent-acp;
* ``raw_checks``: raw-*, JSON-RPC lines into each adapter, then stdin EOF, then SIGTERM;
* ``session_checks``: sessions-*, sessions-acpx-*, the session pool with ``max_live = 1``, and
  spec-*, session/close, session/delete and session/fork through the proxy;
* ``install_checks``: install-acpx-*, the install's one pool across acpx's proxies, watched
  from /proc and ``acp-proxy status --json`` (``watches``);
* ``matrix``: matrix-*, one scenario for every adapter of the ADAPTERS table, judged by
  ``scenario``.

Prints one PASS/FAIL line per check (NOTE lines add what the peers did) and exits 1 if any check
failed. Logs and transcripts are kept in WORKDIR/logs.
"""
