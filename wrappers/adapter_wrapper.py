"""The per-lease wrapper's program: ``python -I -S adapter_wrapper.py ARGS`` (what it does, and how:
``adapter_wrapper_core.py`` beside it).

Python compiles the script it is given at every start (2 ms of every adapter spawn), but a module it
imports from its cached bytecode: the program lives in that module, and this script only starts it.
``-I`` leaves this directory off ``sys.path``; it is put first, so that the module imported is this
directory's own.
"""

if __name__ == "__main__":
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import adapter_wrapper_core  # type: ignore[import-not-found]  # found through the path just set

    adapter_wrapper_core.main()
