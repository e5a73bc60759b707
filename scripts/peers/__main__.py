"""scripts/check-peers [WORKDIR] [--proxy CMD] [--proxy-python PY] [--no-install] [--only NAME]..."""

from __future__ import annotations

import argparse
import sys

from .checks import CHECKS
from .harness import Peers
from .installation import install, print_versions
from .report import Report


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/check-peers",
        description="Manual check: published ACP clients and adapters work unchanged through acp-proxy.",
    )
    parser.add_argument("workdir", nargs="?", default="/tmp/acp-peers", help="where peers are installed")
    parser.add_argument("--proxy", help="the acp-proxy command (default: .venv/bin/acp-proxy)")
    parser.add_argument("--proxy-python", help="a Python that imports acp_proxy, to run its echo agent")
    parser.add_argument("--no-install", action="store_true", help="reuse the peers already in WORKDIR")
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this check (repeatable)")
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        print("check-peers: the leftover-process search reads /proc; run it on Linux", file=sys.stderr)
        return 2

    report = Report()
    peers = Peers(args, report)
    known = [check.name for check in CHECKS]
    unknown = set(args.only or ()) - set(known)
    if unknown:
        parser.error(f"unknown check(s) {', '.join(sorted(unknown))}; known: {', '.join(known)}")
    if not args.no_install:
        install(peers)
    print("== peers", flush=True)
    print_versions(peers)

    print("== checks (each direct, then through the proxy)", flush=True)
    try:
        for check in CHECKS:
            if not args.only or check.name in args.only:
                check.run(peers)
    finally:
        peers.runs.kill_everything()
    print(f"== {len(report.passed)} passed, {len(report.failed)} failed; logs in {peers.logs}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
