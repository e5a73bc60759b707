"""The fake adapter's command: ``python tests/fake_adapter.py OPTIONS`` (see ``tests/fake_adapter_core.py``).

Python compiles the script it is given at every start but a module it imports once: the program
lives in a module, and this script only starts it (the suite starts hundreds of these adapters).
"""

import fake_adapter_core  # this script's directory is the first on sys.path

fake_adapter_core.main()
