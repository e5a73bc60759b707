"""A scriptable ACP adapter for tests, run as ``python tests/fake_adapter.py OPTIONS``. Standard
library only.

Startup behaviour comes from one JSON object in argv[1] (all keys optional):

    caps               agentCapabilities to advertise (default {"loadSession": true})
    ignore_sigterm     ignore SIGTERM
    ignore_eof         keep running after stdin closes
    noise              lines of non-JSON text to print on stdout at startup
    record             path: append {"in": line} / {"out": line} for every line read / written
    init_delay         seconds to wait before answering initialize
    memory             MB of resident memory to hold for the process's life (every page written)
    memory_delay       seconds to wait before taking that memory (and answering anything): an
                       adapter that grows for a while after it starts
    load_replay        number of history updates to replay on session/load (default: all)
    load_result        what session/load answers (default {}; null is allowed)
    resume_result      what session/resume answers (default {})
    title              rewrite argv[0]/comm as seen in /proc (where supported)
    store              directory: each session's state (history, mode, config values, completed
                       turns) is kept in STORE/<sessionId>.json, rewritten after every change, so
                       another adapter process can load or resume its conversation (history and
                       turns; mode and config start afresh there); session ids become
                       "fake-" + 12 hex digits instead of "fake-N"
    modes              session/new also answers "modes" (default and plan; current: default)
    auth_methods       the initialize result's authMethods (default [])
    chatty             like claude-agent-acp: an available_commands_update right behind the answer to
                       session/new, /load and /resume, whose results also name the session and its modes
    fail               {method: code or error object}: such requests get that error (a code alone:
                       message "injected failure"; an object: {"code", "message", "data"} as given)
    hang               [method, ...]: such requests are read and never answered
    mode_option        like qwen-code: session/new, /load and /resume answer "modes" and a configOptions
                       entry of category "mode" (id "mode"), both with the session's current mode (a new
                       process: "default"); set_config_option "mode" sets the mode

Per-turn behaviour comes from the prompt text: commands separated by ";" run in order,
then the turn ends with end_turn unless a command ended it first.

    stream N           N agent_message_chunk updates
    permission         ask session/request_permission; refusal unless "allow" is chosen
    read PATH          fs/read_text_file, the content is echoed as a message chunk
    spawn_tree         start a child that starts a grandchild (same process group)
    escape             start a grandchild that leaves with setsid + double fork
    escape_clean       the same, and the grandchild clears its environment (keeping only the
                       tests' own marker): the lease's marker is gone from it
    fork_loop          start a child that keeps forking short-lived and long-lived children
    crash N            exit immediately with status N
    close_stdout       close stdout (a broken connection) and live on until stdin's EOF or a signal
    sleep S            sleep S seconds
    trickle S          S x 10 message chunks ".", 0.1 s apart (a long turn that keeps talking)
    silent             say nothing until session/cancel arrives, then stop with "cancelled"
    grow N             keep N more MiB resident, until the process ends
    grow_for_turn N    keep N more MiB resident until the turn ends
    grow_until_cancel N
                       N more MiB every 0.1 s (and a "."), until session/cancel arrives
    wait_cancel        stream until session/cancel arrives, then stop with "cancelled"
    ignore_cancel S    stream until session/cancel arrives, then S seconds more ("late" chunks), then stop
                       with "cancelled" (gemini --acp ends its network retries before it ends a turn)
    ext                send a "_fake/notice" extension notification with _meta
    ask_then_cancel    ask permission, then withdraw it with $/cancel_request
    elicit MODE        elicitation/create for the session, MODE "form" (default; tied to tool call
                       "call-1") or "url" (elicitationId "url-" + the session id); the answer
                       message is echoed as a message chunk: "elicited " + JSON (sorted keys)
    elicit_later MODE  the same from a thread of its own: the turn ends without waiting for the
                       answer, which is echoed when it comes
    elicit_then_cancel elicit, then withdraw it with $/cancel_request; the answer is echoed
    elicit_complete ID an elicitation/complete notification for elicitationId ID
    meta               echo the prompt's _meta back in a message chunk
    state              a message chunk whose text is JSON (sorted keys): {"session", "mode",
                       "config", "turns": turns completed before this one, "history": updates
                       before this turn, "pid"}
    auth               a message chunk whose text is the JSON list of methodIds authenticated
                       in this process
    emit Z             write base64(zlib(bytes)) Z to stdout exactly as the bytes are, not recorded:
                       garbage, broken or oversized lines, stray messages (compressed so that a
                       long line fits in a prompt under the proxy's line limit)
    title T            a session_info_update with title T (and updatedAt now); "title -" clears it
    background S       after the turn has ended, keep sending an agent_message_chunk every 0.1 s for
                       S seconds (background work, as agents with background shells do), then
                       "background done"

A turn that ends (whatever the stop reason) counts as completed; a crash does not.

Sessions: session/list lists the sessions in memory and in the store, for its "cwd" if given (pages
of "list_page" sessions with a nextCursor, if set), each titled with the first line of its first
prompt as qwen-code does, a title it never announces; session/load replays the history then
answers; session/resume answers without replaying; session/close forgets the session in memory (the stored file stays);
session/delete forgets it in memory and in the store; session/fork copies the session
(history and turns) under a new id; logout forgets the methodIds authenticated. A session
not in memory is read from the store; unknown sessions get -32002, except that a prompt
for one starts it afresh. session/set_mode and session/set_config_option record the value
(answers {} and {"configOptions": []}); authenticate records its methodId.

Other requests: "_fake/echo" answers its params; "_fake/slow" {"seconds": S} answers
after S seconds unless cancelled with $/cancel_request (then -32800); "_fake/pids"
answers the pids it started; "_fake/sessions" answers {"sessions": ids in memory, sorted};
"_fake/elicit" makes a url elicitation scoped to itself (its requestId is this request's id)
and answers {"answer": the answer message}.
Anything unknown gets -32601.
"""

from __future__ import annotations

# Only what every start needs is imported here: the suite starts hundreds of these adapters, and
# what a few commands need (base64, ctypes, signal, subprocess, uuid, zlib) is imported where they run.
import itertools
import os
import sys
import threading
import time

import fake_json as json  # json's answers without its import (tests/fake_json.py)

TYPE_CHECKING = False  # typing costs a start 4 ms more
if TYPE_CHECKING:
    from typing import Any

SLEEP = "/bin/sleep" if os.path.exists("/bin/sleep") else "/usr/bin/sleep"
SLEEPER = [SLEEP, "3600"]
"""A process that only waits, for the trees the fake spawns (a program of a few KB: no interpreter to start)."""
TEST_MARKER = "ACP_PROXY_TEST_MARKER"
"""The suite's own marker (``tests.support.MARKER_VARIABLE``): how it finds what a test left running."""


class FakeAdapter:
    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        self.out_lock = threading.Lock()
        self.ids = itertools.count(100)
        self.waiting: dict[int, tuple[threading.Event, list[Any]]] = {}
        self.cancelled_sessions: set[str] = set()
        self.hoard: list[bytes] = []
        """Memory the ``grow`` commands keep."""
        self.turn_hoard: list[bytes] = []
        """Memory ``grow_for_turn`` keeps until the turn ends."""
        self.cancelled_requests: set[Any] = set()
        self.sessions: dict[str, dict[str, Any]] = {}  # id -> {"history", "mode", "config", "turns"}
        self.sessions_lock = threading.RLock()
        self.authenticated: list[str] = []
        self.children: list[int] = []
        self.session_numbers = itertools.count(1)
        record = options.get("record")
        self.record = open(record, "a", buffering=1) if record else None  # noqa: SIM115

    # --- io -------------------------------------------------------------------

    def log(self, direction: str, line: str) -> None:
        if self.record is not None:
            self.record.write(json.dumps({direction: line, "pid": os.getpid()}) + "\n")

    def send(self, message: dict[str, Any]) -> None:
        line = json.dumps({"jsonrpc": "2.0", **message}, separators=(",", ":"), ensure_ascii=False)
        with self.out_lock:
            self.log("out", line)
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def update(self, session_id: str, update: dict[str, Any]) -> None:
        with self.sessions_lock:  # history order is the order sent
            self.session(session_id, create=True)["history"].append(update)
            self.persist(session_id)
            self.send({"method": "session/update", "params": {"sessionId": session_id, "update": update}})

    def say(self, session_id: str, text: str) -> None:
        self.update(session_id, {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": text}})

    def ask(self, method: str, params: dict[str, Any]) -> tuple[int, threading.Event, list[Any]]:
        request_id = next(self.ids)
        done, box = threading.Event(), []
        self.waiting[request_id] = (done, box)
        self.send({"id": request_id, "method": method, "params": params})
        return request_id, done, box

    # --- sessions -------------------------------------------------------------------

    def session(self, session_id: str, create: bool = False) -> dict[str, Any]:
        """The session's state: from memory, else from the store, else new (if create) or -32002."""
        with self.sessions_lock:
            state = self.sessions.get(session_id)
            if state is None:
                state = self.read_stored(session_id)
            if state is None:
                if not create:
                    raise RpcError(-32002, f"unknown session {session_id}")
                state = {"history": [], "mode": None, "config": {}, "turns": 0}
            self.sessions[session_id] = state
            return state

    def stored_path(self, session_id: Any) -> str | None:
        store = self.options.get("store")
        if not store or not isinstance(session_id, str) or not session_id:
            return None
        if "/" in session_id or session_id.startswith("."):
            return None  # never a path outside the store
        return os.path.join(store, session_id + ".json")

    def read_stored(self, session_id: str) -> dict[str, Any] | None:
        path = self.stored_path(session_id)
        if path is None or not os.path.exists(path):
            return None
        with open(path) as f:
            stored = json.load(f)
        # Like most real adapters, a new process restores the conversation, not the settings:
        # the mode and config options are the proxy's to re-apply after a resume.
        mode = "default" if self.options.get("modes") else None
        restored = {"history": stored["history"], "turns": stored["turns"], "mode": mode, "config": {}}
        for kept in ("title", "cwd"):
            if kept in stored:
                restored[kept] = stored[kept]
        return restored

    def persist(self, session_id: str) -> None:
        path = self.stored_path(session_id)
        if path is None:
            return
        with self.sessions_lock:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            temp = f"{path}.{os.getpid()}.tmp"
            with open(temp, "w") as f:
                json.dump({"sessionId": session_id, **self.sessions[session_id]}, f)
            os.replace(temp, path)

    def restored(self, session_id: str) -> dict[str, Any]:
        """A load/resume result: {} unless "chatty", then the session's id and modes, as claude-agent-acp answers
        (or "mode_option": its modes and mode config option, as qwen-code answers)."""
        if self.options.get("mode_option"):
            return self.mode_state(self.session(session_id)["mode"] or "default")
        if not self.options.get("chatty"):
            return {}
        mode = self.session(session_id)["mode"] or "default"
        modes = [{"id": "default", "name": "Default"}, {"id": "plan", "name": "Plan"}]
        return {"sessionId": session_id, "modes": {"currentModeId": mode, "availableModes": modes}}

    @staticmethod
    def mode_state(mode: str) -> dict[str, Any]:
        """ "modes" and the "mode" config option, both saying ``mode``."""
        modes = [{"id": "default", "name": "Default"}, {"id": "plan", "name": "Plan"}]
        option = {
            "id": "mode",
            "name": "Mode",
            "category": "mode",
            "type": "select",
            "currentValue": mode,
            "options": [{"value": m["id"], "name": m["name"]} for m in modes],
        }
        return {"modes": {"currentModeId": mode, "availableModes": modes}, "configOptions": [option]}

    def listed(self, params: dict[str, Any]) -> dict[str, Any]:
        """session/list: every session in memory or in the store, titled by its first prompt."""
        with self.sessions_lock:
            ids = set(self.sessions)
            store = self.options.get("store")
            if store and os.path.isdir(store):
                ids |= {name.removesuffix(".json") for name in os.listdir(store) if name.endswith(".json")}
            infos = []
            for session_id in sorted(ids):
                state = self.sessions.get(session_id) or self.read_stored(session_id) or {}
                if params.get("cwd") not in (None, state.get("cwd", "/tmp")):
                    continue
                info = {"sessionId": session_id, "cwd": state.get("cwd", "/tmp")}
                if state.get("title"):
                    info["title"] = state["title"]
                infos.append(info)
        page = int(self.options.get("list_page", 0)) or len(infos) or 1
        start = int(params.get("cursor") or 0)
        result: dict[str, Any] = {"sessions": infos[start : start + page]}
        if start + page < len(infos):
            result["nextCursor"] = str(start + page)
        return result

    def new_session_id(self) -> str:
        if self.options.get("store"):
            return f"fake-{os.urandom(6).hex()}"
        return f"fake-{next(self.session_numbers)}"

    # --- dispatch -------------------------------------------------------------------

    def handle(self, msg: dict[str, Any]) -> None:
        method, params, request_id = msg.get("method"), msg.get("params") or {}, msg.get("id")
        if method is None:
            waiter = self.waiting.pop(request_id, None)
            if waiter is not None:
                waiter[1].append(msg)
                waiter[0].set()
            return
        if method == "session/cancel":
            self.cancelled_sessions.add(params.get("sessionId"))
            return
        if method == "$/cancel_request":
            self.cancelled_requests.add(params.get("requestId"))
            return
        if "id" not in msg:
            return  # other notifications (extensions included) are only recorded
        threading.Thread(target=self.answer, args=(request_id, method, params), daemon=True).start()

    def answer(self, request_id: Any, method: str, params: dict[str, Any]) -> None:
        try:
            result = self.dispatch(request_id, method, params)
        except RpcError as exc:
            error = {"code": exc.code, "message": exc.message}
            if exc.data is not None:
                error["data"] = exc.data
            self.send({"id": request_id, "error": error})
            return
        if result is not NO_ANSWER:
            self.send({"id": request_id, "result": result})
        if self.options.get("chatty") and method in ("session/new", "session/load", "session/resume"):
            session_id = result.get("sessionId") if method == "session/new" else params.get("sessionId")
            # As claude-agent-acp does: an update right behind the answer.
            commands = {"sessionUpdate": "available_commands_update", "availableCommands": []}
            self.send({"method": "session/update", "params": {"sessionId": session_id, "update": commands}})

    def dispatch(self, request_id: Any, method: str, params: dict[str, Any]) -> Any:
        if method in self.options.get("hang", []):
            return NO_ANSWER
        if method in self.options.get("fail", {}):
            error = self.options["fail"][method]
            if isinstance(error, dict):
                raise RpcError(error["code"], error.get("message", "injected failure"), error.get("data"))
            raise RpcError(error, "injected failure")
        if method == "initialize":
            time.sleep(float(self.options.get("init_delay", 0)))
            return {
                "protocolVersion": 1,
                "agentCapabilities": self.options.get("caps", {"loadSession": True}),
                "authMethods": self.options.get("auth_methods", []),
                "agentInfo": {"name": "fake-adapter", "version": "0.0.1"},
            }
        if method == "authenticate":
            self.authenticated.append(params.get("methodId"))
            return {}
        if method == "session/new":
            return self.new_session(params)
        if method == "session/list":
            return self.listed(params)
        if method == "session/load":
            session_id = params.get("sessionId")
            replay = list(self.session(session_id)["history"])
            limit = self.options.get("load_replay")
            for update in replay if limit is None else replay[:limit]:
                self.send({"method": "session/update", "params": {"sessionId": session_id, "update": update}})
            return self.options.get("load_result", self.restored(session_id))
        if method == "session/resume":
            self.session(params.get("sessionId"))
            return self.options.get("resume_result", self.restored(params.get("sessionId")))
        if method == "session/close":
            with self.sessions_lock:
                self.session(params.get("sessionId"))
                del self.sessions[params["sessionId"]]
            return {}
        if method == "session/delete":
            with self.sessions_lock:
                self.sessions.pop(params.get("sessionId"), None)
                path = self.stored_path(params.get("sessionId"))
                if path is not None and os.path.exists(path):
                    os.remove(path)
            return {}
        if method == "session/fork":
            with self.sessions_lock:
                parent = self.session(params.get("sessionId"))
                fork_id = self.new_session_id()
                self.sessions[fork_id] = {**json.loads(json.dumps(parent)), "mode": parent["mode"]}
                self.persist(fork_id)
            return {"sessionId": fork_id}
        if method == "logout":
            self.authenticated.clear()
            return {}
        if method == "session/set_mode":
            with self.sessions_lock:
                self.session(params.get("sessionId"))["mode"] = params.get("modeId")
                self.persist(params["sessionId"])
            return {}
        if method == "session/set_config_option":
            with self.sessions_lock:
                state = self.session(params.get("sessionId"))
                state["config"][params.get("configId")] = params.get("value")
                if self.options.get("mode_option") and params.get("configId") == "mode":
                    state["mode"] = params.get("value")
                self.persist(params["sessionId"])
                if self.options.get("mode_option"):
                    return {"configOptions": self.mode_state(state["mode"])["configOptions"]}
            return {"configOptions": []}
        if method == "session/prompt":
            return self.prompt(request_id, params)
        if method == "_fake/echo":
            return params
        if method == "_fake/slow":
            deadline = time.monotonic() + float(params.get("seconds", 1))
            while time.monotonic() < deadline:
                if request_id in self.cancelled_requests:
                    raise RpcError(-32800, "Request cancelled")
                time.sleep(0.01)
            return {"slept": params.get("seconds", 1)}
        if method == "_fake/elicit":
            scope = {"requestId": request_id, "mode": "url", "elicitationId": "url-request", "message": "Sign in"}
            _, done, box = self.ask("elicitation/create", {**scope, "url": "https://agent.example/sign-in"})
            done.wait()
            return {"answer": box[0]}
        if method == "_fake/pids":
            return {"adapter": os.getpid(), "children": self.children}
        if method == "_fake/sessions":
            with self.sessions_lock:
                return {"sessions": sorted(self.sessions)}
        raise RpcError(-32601, f"Method not found: {method}")

    def new_session(self, params: dict[str, Any]) -> dict[str, Any]:
        modes = self.options.get("modes") or self.options.get("mode_option")
        with self.sessions_lock:
            session_id = self.new_session_id()
            mode = "default" if modes else None
            self.sessions[session_id] = {"history": [], "mode": mode, "config": {}, "turns": 0}
            if isinstance(params.get("cwd"), str):
                self.sessions[session_id]["cwd"] = params["cwd"]
            self.persist(session_id)
        if self.options.get("mode_option"):
            return {"sessionId": session_id, **self.mode_state("default")}
        result: dict[str, Any] = {"sessionId": session_id}
        if modes:
            result["modes"] = {
                "currentModeId": "default",
                "availableModes": [{"id": "default", "name": "Default"}, {"id": "plan", "name": "Plan"}],
            }
        return result

    # --- turns -------------------------------------------------------------------

    def prompt(self, request_id: Any, params: dict[str, Any]) -> Any:
        session_id = params.get("sessionId", "")
        self.cancelled_sessions.discard(session_id)
        history_before = len(self.session(session_id, create=True)["history"])
        text = " ".join(b.get("text", "") for b in params.get("prompt", []) if b.get("type") == "text")
        with self.sessions_lock:
            state = self.session(session_id, create=True)
            if not state.get("title") and text.strip():
                state["title"] = text.strip().splitlines()[0][:60]  # kept, never announced
                self.persist(session_id)
        stop = None
        for command in filter(None, (c.strip() for c in text.split(";"))):
            verb, _, arg = command.partition(" ")
            stop = self.run_command(session_id, verb, arg.strip(), params, history_before)
            if stop is not None:
                break
        self.turn_hoard.clear()  # what grow_for_turn kept goes with the turn
        with self.sessions_lock:  # the turn has ended: count it
            self.session(session_id, create=True)["turns"] += 1
            self.persist(session_id)
        return {"stopReason": stop or "end_turn"}

    def run_command(
        self, session_id: str, verb: str, arg: str, params: dict[str, Any], history_before: int
    ) -> str | None:
        if verb == "stream":
            for i in range(int(arg)):
                self.say(session_id, f"chunk {i} ")
        elif verb == "permission":
            _, done, box = self.ask("session/request_permission", self.permission_params(session_id))
            done.wait()
            outcome = box[0].get("result", {}).get("outcome", {})
            if outcome.get("optionId") != "allow":
                return "refusal"
            self.say(session_id, "permission granted")
        elif verb == "ask_then_cancel":
            request_id, done, box = self.ask("session/request_permission", self.permission_params(session_id))
            time.sleep(0.05)
            self.send({"method": "$/cancel_request", "params": {"requestId": request_id}})
            done.wait()
            self.say(session_id, "withdrawn: " + json.dumps(box[0], sort_keys=True))
        elif verb == "elicit":
            self.elicit(session_id, arg)
        elif verb == "elicit_later":
            threading.Thread(target=self.elicit, args=(session_id, arg), daemon=True).start()
        elif verb == "elicit_then_cancel":
            request_id, done, box = self.ask("elicitation/create", self.elicitation_params(session_id, "form"))
            self.send({"method": "$/cancel_request", "params": {"requestId": request_id}})
            done.wait()
            self.say(session_id, "elicited " + json.dumps(box[0], sort_keys=True))
        elif verb == "elicit_complete":
            self.send({"method": "elicitation/complete", "params": {"elicitationId": arg}})
        elif verb == "read":
            _, done, box = self.ask("fs/read_text_file", {"sessionId": session_id, "path": arg})
            done.wait()
            self.say(session_id, box[0].get("result", {}).get("content", "<error>"))
        elif verb == "spawn_tree":
            self.spawn_tree()
            self.say(session_id, "spawned " + json.dumps(self.children))
        elif verb in ("escape", "escape_clean"):
            self.escape(clean=verb == "escape_clean")
            self.say(session_id, "escaped " + json.dumps(self.children))
        elif verb == "fork_loop":
            code = (
                "import os, time\n"
                "for i in range(100000):\n"
                "    if os.fork() == 0:\n"
                "        time.sleep(3600 if i % 10 == 0 else 0.05); os._exit(0)\n"
                "    time.sleep(0.005)\n"
                "    try: os.waitpid(-1, os.WNOHANG)\n"
                "    except ChildProcessError: pass\n"
            )
            import subprocess

            self.children.append(subprocess.Popen([sys.executable, "-c", code]).pid)
            time.sleep(0.3)
            self.say(session_id, "forking")
        elif verb == "crash":
            sys.stdout.flush()
            os._exit(int(arg or 1))
        elif verb == "close_stdout":
            sys.stdout.flush()
            os.close(1)
            while sys.stdin.buffer.read(65536):  # lives on, deaf, until the proxy lets it go
                pass
            os._exit(0)
        elif verb == "sleep":
            time.sleep(float(arg))
        elif verb == "trickle":  # a long turn that keeps talking: ARG x 10 dots, 0.1 s apart (a count, not a
            for _ in range(round(float(arg) * 10)):  # deadline: a loaded machine's late sleeps drop none)
                self.say(session_id, ".")
                time.sleep(0.1)
        elif verb == "silent":  # until cancelled
            while session_id not in self.cancelled_sessions:
                time.sleep(0.01)
            return "cancelled"
        elif verb == "grow":  # keeps ARG more MiB, resident, until the process ends
            self.hoard.append(b"\x01" * (int(arg) * 2**20))
            self.say(session_id, f"holding {sum(map(len, self.hoard)) >> 20} MiB")
        elif verb == "grow_for_turn":  # keeps ARG more MiB resident until the turn ends
            self.turn_hoard.append(b"\x01" * (int(arg) * 2**20))
        elif verb == "grow_until_cancel":  # ARG more MiB every 0.1 s, talking, until cancelled
            while session_id not in self.cancelled_sessions:
                self.hoard.append(b"\x01" * (int(arg) * 2**20))
                self.say(session_id, ".")
                time.sleep(0.1)
            return "cancelled"
        elif verb == "wait_cancel":
            for i in itertools.count():
                if session_id in self.cancelled_sessions:
                    return "cancelled"
                if i % 10 == 0:
                    self.say(session_id, ".")
                time.sleep(0.01)
        elif verb == "ignore_cancel":
            until = None
            while until is None or time.monotonic() < until:
                if until is None and session_id in self.cancelled_sessions:
                    until = time.monotonic() + float(arg)
                self.say(session_id, "." if until is None else "late ")
                time.sleep(0.05)
            return "cancelled"
        elif verb == "ext":
            self.send(
                {
                    "method": "_fake/notice",
                    "params": {"sessionId": session_id, "_meta": {"traceparent": "00-abc-def-01"}},
                }
            )
        elif verb == "meta":
            self.say(session_id, json.dumps(params.get("_meta"), sort_keys=True))
        elif verb == "state":
            with self.sessions_lock:
                state = self.session(session_id, create=True)
                report = {
                    "session": session_id,
                    "mode": state["mode"],
                    "config": state["config"],
                    "turns": state["turns"],
                    "history": history_before,
                    "pid": os.getpid(),
                }
                self.say(session_id, json.dumps(report, sort_keys=True))
        elif verb == "auth":
            self.say(session_id, json.dumps(self.authenticated))
        elif verb == "title":
            title = None if arg == "-" else arg
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            info = {"sessionUpdate": "session_info_update", "title": title, "updatedAt": stamp}
            self.send({"method": "session/update", "params": {"sessionId": session_id, "update": info}})
        elif verb == "background":
            threading.Thread(target=self.background, args=(session_id, float(arg)), daemon=True).start()
        elif verb == "emit":
            import base64
            import zlib

            with self.out_lock:
                sys.stdout.flush()
                sys.stdout.buffer.write(zlib.decompress(base64.b64decode(arg)))
                sys.stdout.buffer.flush()
        return None

    def background(self, session_id: str, seconds: float) -> None:
        time.sleep(0.05)  # the turn's answer goes first
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            chunk = {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": "working "}}
            self.send({"method": "session/update", "params": {"sessionId": session_id, "update": chunk}})
            time.sleep(0.1)
        done = {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": "background done"}}
        self.send({"method": "session/update", "params": {"sessionId": session_id, "update": done}})

    def elicit(self, session_id: str, mode: str) -> None:
        _, done, box = self.ask("elicitation/create", self.elicitation_params(session_id, mode or "form"))
        done.wait()
        self.say(session_id, "elicited " + json.dumps(box[0], sort_keys=True))

    @staticmethod
    def elicitation_params(session_id: str, mode: str) -> dict[str, Any]:
        if mode == "url":
            url = f"https://agent.example/connect?session={session_id}"
            return {
                "sessionId": session_id,
                "mode": "url",
                "elicitationId": f"url-{session_id}",
                "url": url,
                "message": "Connect your account",
            }
        schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
        return {
            "sessionId": session_id,
            "toolCallId": "call-1",
            "mode": "form",
            "message": "Your name?",
            "requestedSchema": schema,
        }

    @staticmethod
    def permission_params(session_id: str) -> dict[str, Any]:
        return {
            "sessionId": session_id,
            "toolCall": {"toolCallId": "call-1", "title": "Run the tool"},
            "options": [
                {"optionId": "allow", "name": "Allow", "kind": "allow_once"},
                {"optionId": "reject", "name": "Reject", "kind": "reject_once"},
            ],
        }

    def spawn_tree(self) -> None:
        # The child starts a grandchild and reports its pid on stdout; both sleep.
        import subprocess

        code = f"{SLEEP} 3600 & echo $!; exec {SLEEP} 3600"
        child = subprocess.Popen(["/bin/sh", "-c", code], stdout=subprocess.PIPE)
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        self.children += [child.pid, grandchild]

    def escape(self, *, clean: bool = False) -> None:
        # setsid + double fork: the grandchild is in its own session and reparented away. ``clean``:
        # it also drops the environment it inherited, ACP_PROXY_LEASE with it; the tests' own marker
        # stays, so that the suite still finds it if it outlives the test.
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.setsid()
            grandchild = os.fork()
            if grandchild == 0:
                os.close(read_fd)
                os.close(write_fd)
                if clean:
                    kept = {name: os.environ[name] for name in (TEST_MARKER,) if name in os.environ}
                    os.execve(SLEEPER[0], SLEEPER, kept)
                os.execv(SLEEPER[0], SLEEPER)
            os.write(write_fd, str(grandchild).encode())
            os._exit(0)
        os.close(write_fd)
        escaped = int(os.read(read_fd, 64))
        os.close(read_fd)
        os.waitpid(pid, 0)
        self.children.append(escaped)

    def run(self) -> None:
        for text in self.options.get("noise", []):
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
        for raw in sys.stdin.buffer:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.log("in", line)
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict):
                self.handle(msg)
        if self.options.get("ignore_eof"):
            while True:
                time.sleep(3600)


class RpcError(Exception):
    def __init__(self, code: int, message: str, data: Any = None) -> None:
        self.code, self.message, self.data = code, message, data


NO_ANSWER = object()


def set_title(title: str) -> None:
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, title.encode(), 0, 0, 0)  # PR_SET_NAME: what /proc/PID/comm shows
    except (OSError, AttributeError):
        pass


def main() -> None:
    options = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    if options.get("ignore_sigterm"):
        import signal  # with enum: 6 ms of a start

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if options.get("title"):
        set_title(options["title"])
    time.sleep(options.get("memory_delay", 0))
    ballast = bytearray(int(options.get("memory", 0) * 1024 * 1024))
    for page in range(0, len(ballast), 4096):
        ballast[page] = 1  # resident, not just reserved
    FakeAdapter(options).run()
