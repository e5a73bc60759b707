"""``acp-proxy top``: a live, full-screen view of the install, refreshed about once a second.

Kept apart so that the decisions are plain functions over plain data:

* ``snapshot``: the ``Snapshot`` (plain data) and the ``Gatherer`` that reads it from the
  state database, the slot records and the proxies' control sockets;
* ``view``: ``render`` and ``on_key``, pure functions of a snapshot and the view state;
* ``terminal``: the loop (terminal modes, the refresher thread, the acts), and ``run``.

``rich`` draws the screen and owns the alternate screen and the cursor; this package is
imported only by ``acp-proxy top``, never by the relay.
"""

from acp_proxy.operator.top.terminal import run

__all__ = ["run"]
