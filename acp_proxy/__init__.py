"""acp-proxy: a sidecar between ACP gateways and the coding-agent adapters they launch."""

__version__ = "0.14.0"
