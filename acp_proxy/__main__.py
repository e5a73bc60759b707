import sys

from acp_proxy.cli import main

sys.exit(main())
