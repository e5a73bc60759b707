import sys

from acp_proxy.operator.cli import main

sys.exit(main())
