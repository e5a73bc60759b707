"""``python -m acp_proxy``, and the ``acp-proxy`` command's entry point (``main``).

The garbage collector is off while the program imports and sets itself up: nearly everything
allocated then lives as long as the process, and collecting it in passing cost about a tenth of
a proxy's start. The CLI turns it back on before an operator's command runs, ``acp_proxy.main``
before the proxy serves.
"""

import gc

gc.disable()

import sys  # noqa: E402

from acp_proxy.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
