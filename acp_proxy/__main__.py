import sys

from acp_proxy.main import main

sys.exit(main())
