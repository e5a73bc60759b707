"""Programs acp-proxy runs as separate processes (``python -I -S PATH ...``), standard library only.

``adapter_wrapper.py`` is the per-lease wrapper. Nothing here imports ``acp_proxy``; in the
wheel this directory is shipped as ``acp_proxy/_wrappers`` (see pyproject.toml), and
``acp_proxy.ownership.owner.wrapper_path`` finds it there or, in a checkout, here.
"""
