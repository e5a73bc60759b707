"""The errors the proxy itself answers with: one type, one named constructor per ``error.data.reason``.

A gateway can act on ``data.reason`` without parsing messages, so each reason is
made in exactly one place, with its code and its data keys (the table of reasons
in docs/sessions.md lists the same names; a test holds the two to each other).
Raising ``ProxyError`` anywhere under a request's handling is how that request gets
its answer.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from typing import Any, Final

import msgspec
from msgspec import UNSET, Raw, UnsetType

from acp_proxy.protocol import jsonrpc


def describe_exit(returncode: int | None) -> str:
    """An exit status as a person reads it: ``exit status 1``, ``killed by SIGKILL``."""
    if returncode is None:
        return "exit status unknown"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def _decoded(data: Raw | UnsetType) -> Any:
    """An error's ``data`` as JSON values; ``None`` if absent (or not JSON: nothing to keep)."""
    if data is UNSET:
        return None
    try:
        return msgspec.json.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None


ATTACH_NOT_FOUND: Final = -32001
ATTACH_NOT_AUTHORISED: Final = -32002
SESSION_ELSEWHERE: Final = -32010
"""The session is held by another proxy of the install, or busy there: a state to retry or load from, not a
fault (ACP leaves -32000 to -32099 to implementations; ``data.reason`` says which)."""


class ProxyError(Exception):
    """A JSON-RPC error the proxy answers a request with; ``data["reason"]`` says which."""

    def __init__(self, code: int, message: str, reason: str, **data: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data: dict[str, Any] = {"reason": reason, **data}

    @property
    def reason(self) -> str:
        return str(self.data["reason"])

    def response(self, request_id: jsonrpc.RequestId, **extra: Any) -> bytes:
        """This error as the answer to ``request_id`` (``extra`` joins ``data``, e.g. the method)."""
        return jsonrpc.error_response(request_id, self.code, self.message, {**self.data, **extra})

    # --- the requests themselves --------------------------------------------------------------

    @classmethod
    def invalid_request(cls, message: str) -> ProxyError:
        return cls(jsonrpc.INVALID_REQUEST, f"Invalid request: {message}", "invalid_request")

    @classmethod
    def invalid_params(cls, message: str) -> ProxyError:
        return cls(jsonrpc.INVALID_PARAMS, message, "invalid_params")

    @classmethod
    def line_too_long(cls, limit: int) -> ProxyError:
        return cls(
            jsonrpc.INVALID_REQUEST,
            f"Message too large: a line exceeded {limit} bytes and was discarded",
            "line_too_long",
            maxLineBytes=limit,
        )

    @classmethod
    def cancelled(cls) -> ProxyError:
        """The gateway withdrew a request (``$/cancel_request``) before it was sent on."""
        return cls(jsonrpc.REQUEST_CANCELLED, "Request cancelled", "cancelled")

    # --- sessions -------------------------------------------------------------------------------

    @classmethod
    def unknown_session(cls, session_id: str) -> ProxyError:
        return cls(jsonrpc.RESOURCE_NOT_FOUND, f"Unknown session {session_id}", "unknown_session", sessionId=session_id)

    @classmethod
    def session_closed(cls, session_id: str) -> ProxyError:
        """A request for a session the gateway closed (the proxy never reopens one by itself)."""
        message = f"Session {session_id} was closed: session/load or session/resume it first"
        return cls(jsonrpc.RESOURCE_NOT_FOUND, message, "session_closed", sessionId=session_id)

    @classmethod
    def session_deleted(cls, session_id: str) -> ProxyError:
        """A request for a session the gateway deleted: it cannot be brought back."""
        message = f"Session {session_id} was deleted"
        return cls(jsonrpc.RESOURCE_NOT_FOUND, message, "session_deleted", sessionId=session_id)

    # --- shared sessions (the draft RFD's codes: -32001 not found, -32002 not authorised) --------

    @classmethod
    def not_attachable(cls, session_id: str, why: str) -> ProxyError:
        """``session/attach`` to a session no live proxy of the install holds (or none at all)."""
        return cls(ATTACH_NOT_FOUND, f"Session not found: {why}", "not_live", sessionId=session_id)

    @classmethod
    def observer_cannot(cls, method: str) -> ProxyError:
        """An observer's request to act on the session it watches."""
        return cls(ATTACH_NOT_AUTHORISED, f"Not authorised: an observer cannot send {method}", "observer")

    @classmethod
    def too_many_clients(cls, session_id: str, why: str) -> ProxyError:
        """The holder refused another attached client: ``[attach] max_clients``, or its own limit."""
        return cls(ATTACH_NOT_AUTHORISED, f"Not authorised to attach: {why}", "too_many_clients", sessionId=session_id)

    @classmethod
    def attach_forbidden(cls, why: str) -> ProxyError:
        """The holder's control socket refused the attaching proxy (another uid)."""
        return cls(ATTACH_NOT_AUTHORISED, f"Not authorised to attach to this session: {why}", "forbidden")

    @classmethod
    def attach_refused(cls, session_id: str, why: str) -> ProxyError:
        """The holder refused the attach for a reason of its own (shutting down, a bug)."""
        return cls(
            jsonrpc.INTERNAL_ERROR,
            f"The session's acp-proxy refused the attach: {why}",
            "attach_refused",
            sessionId=session_id,
        )

    @classmethod
    def session_busy(cls, session_id: str, *, holder: str | None = None, waited: float | None = None) -> ProxyError:
        """A prompt while another controller's turn runs, under ``[attach] prompts = "refuse"``; or (``holder``)
        a session whose holder's turn ran past ``[sessions] handover_timeout`` (``waited``) while it was asked
        to hand it over."""
        if holder is None:
            message = f"Session {session_id} is running another client's turn; try again when it ends"
            return cls(SESSION_ELSEWHERE, message, "session_busy", sessionId=session_id)
        message = (
            f"Session {session_id} is running a turn in another acp-proxy process of this install (instance "
            f"{holder}), which did not end within handover_timeout ({waited:g}s); try again when it ends"
        )
        return cls(SESSION_ELSEWHERE, message, "session_busy", sessionId=session_id, holder=holder)

    @classmethod
    def session_moved(cls, session_id: str, holder: str | None) -> ProxyError:
        """A request for a session this proxy served, handed since to another proxy of the install."""
        where = f"another acp-proxy process of this install (instance {holder})" if holder else "another acp-proxy"
        message = f"Session {session_id} has moved to {where}; session/load brings it back here"
        return cls(SESSION_ELSEWHERE, message, "session_moved", sessionId=session_id, holder=holder)

    @classmethod
    def permission_claimed(cls, request: str, claimed_by: str) -> ProxyError:
        """A claim of, or an answer to, an agent's request another client has claimed."""
        message = f"Request {request} is claimed by {claimed_by}: only it answers, unless it disconnects first"
        return cls(ATTACH_NOT_AUTHORISED, message, "permission_claimed", request=request, claimedBy=claimed_by)

    @classmethod
    def not_eligible(cls, request: str, policy: str) -> ProxyError:
        """A claim of an agent's request by a client that ``[attach] permissions`` does not ask."""
        message = f'Request {request} is not for this client to answer ([attach] permissions = "{policy}")'
        return cls(ATTACH_NOT_AUTHORISED, message, "not_eligible", request=request, policy=policy)

    @classmethod
    def no_such_request(cls, session_id: str, named: str) -> ProxyError:
        """A claim naming no request of the agent's that still waits in that session."""
        message = f"No request of the agent's waits in session {session_id} as {named} (answered, withdrawn, or never)"
        return cls(ATTACH_NOT_FOUND, message, "no_such_request", sessionId=session_id)

    @classmethod
    def holder_gone(cls, session_id: str) -> ProxyError:
        """A request over an attachment whose session's proxy went away before answering it."""
        message = f"The acp-proxy holding session {session_id} exited before answering"
        return cls(jsonrpc.INTERNAL_ERROR, message, "holder_gone", sessionId=session_id)

    @classmethod
    def not_attached_method(cls, method: str) -> ProxyError:
        message = (
            f"{method} is not available to an attached client (session/prompt, session/cancel, session/detach are)"
        )
        return cls(jsonrpc.METHOD_NOT_FOUND, message, "not_for_attached")

    @classmethod
    def cancelled_request(cls) -> ProxyError:
        """A request withdrawn with ``$/cancel_request`` before it was sent on."""
        return cls(jsonrpc.REQUEST_CANCELLED, "Request cancelled", "cancelled")

    @classmethod
    def closed_in_flight(cls) -> ProxyError:
        """A request in flight when its session was closed."""
        return cls(jsonrpc.REQUEST_CANCELLED, "The session was closed", "session_closed")

    @classmethod
    def session_in_use(cls, session_id: str, instance_id: str | None = None) -> ProxyError:
        """A session held by another proxy of the install that could not be asked for it (its control socket
        did not answer), or that another proxy claimed again while this one took it over."""
        if instance_id is None:
            message = f"Session {session_id} is being served by another acp-proxy process"
            return cls(SESSION_ELSEWHERE, message, "session_in_use", sessionId=session_id)
        message = (
            f"Session {session_id} is live in another acp-proxy process (instance {instance_id}), "
            "which did not hand it over"
        )
        return cls(SESSION_ELSEWHERE, message, "session_in_use", sessionId=session_id, instanceId=instance_id)

    @classmethod
    def unknown_backend(cls, name: object, configured: Iterable[str]) -> ProxyError:
        """``_meta["acp-proxy"].backend`` names no configured backend."""
        names = sorted(configured)
        return cls(
            jsonrpc.INVALID_PARAMS,
            f'Unknown backend {name!r} in _meta["acp-proxy"].backend (configured: {", ".join(names)})',
            "unknown_backend",
            configured=names,
        )

    @classmethod
    def backend_gone(cls, session_id: str, backend: str) -> ProxyError:
        """A stored session of a backend the configuration no longer has."""
        return cls(
            jsonrpc.INTERNAL_ERROR,
            f"Session {session_id} belongs to backend {backend!r}, which is no longer configured",
            "unknown_backend",
            backend=backend,
        )

    @classmethod
    def fork_unsupported(cls, session_id: str, backend: str) -> ProxyError:
        """``session/fork`` for a session whose backend does not advertise forking."""
        message = f"Method not found: backend {backend!r} does not fork sessions"
        return cls(jsonrpc.METHOD_NOT_FOUND, message, "fork_unsupported", sessionId=session_id, backend=backend)

    @classmethod
    def resume_disabled(cls, session_id: str, backend: str) -> ProxyError:
        return cls(
            jsonrpc.RESOURCE_NOT_FOUND,
            f'Session {session_id} cannot be resumed (backend {backend!r} has resume = "never")',
            "resume_disabled",
            sessionId=session_id,
        )

    @classmethod
    def restore_failed(cls, method: str, backend: str, error: jsonrpc.ErrorObject) -> ProxyError:
        """The adapter answered a request of the proxy's own (a restore step) with an error.

        The gateway gets the adapter's own code, message and ``data`` (whatever it says of why, such as
        gemini's ``data.details``), as it would without the proxy; the proxy's ``reason``, ``method`` and
        ``backend`` join ``data``. Adapter data that is not an object, or whose keys those would replace,
        is kept whole as ``data.adapterData``.
        """
        ours = {"method": method, "backend": backend}
        theirs = _decoded(error.data)
        if isinstance(theirs, dict) and not theirs.keys() & {"reason", *ours}:
            return cls(error.code, error.message, "restore_failed", **theirs, **ours)
        if theirs is None:
            return cls(error.code, error.message, "restore_failed", **ours)
        return cls(error.code, error.message, "restore_failed", **ours, adapterData=theirs)

    @classmethod
    def no_session_id(cls, method: str, backend: str) -> ProxyError:
        """A fallback ``session/new`` answered without the id of the session it opened."""
        return cls(
            jsonrpc.INTERNAL_ERROR,
            f"{method} answered without a sessionId",
            "restore_failed",
            method=method,
            backend=backend,
        )

    @classmethod
    def restore_timeout(cls, method: str, backend: str, timeout: float) -> ProxyError:
        return cls(
            jsonrpc.INTERNAL_ERROR,
            f"{method} timed out after {timeout:g}s",
            "restore_timeout",
            method=method,
            backend=backend,
        )

    @classmethod
    def start_timeout(cls, method: str, backend: str, timeout: float) -> ProxyError:
        """A process started (or taken fresh) for a request had not answered it within ``start_timeout``."""
        return cls(
            jsonrpc.INTERNAL_ERROR,
            f"The agent process did not answer {method} within start_timeout ({timeout:g}s); it was stopped",
            "start_timeout",
            method=method,
            backend=backend,
            startTimeout=timeout,
        )

    # --- processes ------------------------------------------------------------------------------

    @classmethod
    def spawn_failed(cls, backend: str, why: str) -> ProxyError:
        return cls(jsonrpc.INTERNAL_ERROR, why, "spawn_failed", backend=backend)

    @classmethod
    def pool_exhausted(cls, backend: str, cap: int) -> ProxyError:
        return cls(
            jsonrpc.INTERNAL_ERROR,
            f"No adapter process is free: all {cap} live sessions of backend {backend!r} are busy",
            "pool_exhausted",
            maxLive=cap,
            backend=backend,
        )

    @classmethod
    def adapter_exited(cls, returncode: int | None, backend: str, *, during: str | None = None) -> ProxyError:
        """The adapter exited with a request unanswered (``during``: a request of the proxy's own)."""
        if during is not None:
            return cls(
                jsonrpc.INTERNAL_ERROR,
                f"The agent process exited during {during} ({describe_exit(returncode)})",
                "adapter_exited",
                method=during,
                backend=backend,
            )
        return cls(
            jsonrpc.INTERNAL_ERROR,
            f"The agent process exited before answering ({describe_exit(returncode)})",
            "adapter_exited",
            exitStatus=returncode,
            backend=backend,
        )

    @classmethod
    def proxy_shutdown(cls, **data: Any) -> ProxyError:
        return cls(jsonrpc.REQUEST_CANCELLED, "acp-proxy is shutting down", "proxy_shutdown", **data)

    @classmethod
    def state_error(cls, exc: Exception) -> ProxyError:
        return cls(jsonrpc.INTERNAL_ERROR, f"acp-proxy's state database failed: {exc}", "state_error")
