"""The HTTP API, as @e2b/code-interpreter 2.8.0 calls it:

  GET    /health                      200 "OK"
  POST   /execute                     {code, context_id?, language?, env_vars?}
                                      -> 200, NDJSON lines streamed as produced
  POST   /contexts                    {language?, cwd?} -> {id, language, cwd}
  GET    /contexts                    -> [{id, language, cwd}...]
  DELETE /contexts/{id}               -> 200 null
  POST   /contexts/{id}/restart       -> 200 null

Errors are plain-text bodies with the status (the SDK's extractError shows a
404's body, and the body of any other status in diagnostics mode): 400 for
a malformed request, 404 for an unknown context, 411/413 for a body sent
chunked or too large, 500 when a kernel cannot be started.
"""

import json
import logging
import math
import select
import socket
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from . import results
from .contexts import KERNEL_RESTARTED, BadRequest, NotFound, env_code
from .kernel import KernelError

log = logging.getLogger("space-code-interpreter.http")


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr, contexts, max_body):
        self.contexts = contexts
        self.max_body = max_body
        super().__init__(addr, Handler)

    def handle_error(self, request, client_address):
        # A client that resets its connection is not the server's error.
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("%s: %s", client_address, exc)
            return
        log.exception("request from %s", client_address)


class HTTPError(Exception):
    def __init__(self, status, message, close=False):
        super().__init__(message)
        self.status = status
        self.close = close


def _clean(v):
    # JavaScript's JSON.parse rejects NaN and Infinity.
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_clean(x) for x in v]
    return v


def dumps(obj):
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return json.dumps(_clean(obj), ensure_ascii=False, allow_nan=False)


def _optional_str(req, key):
    v = req.get(key)
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        raise HTTPError(400, f"{key} must be a string")
    return v


def _env_vars(req):
    env = req.get("env_vars")
    if env is None:
        return None
    if not isinstance(env, dict):
        raise HTTPError(400, "env_vars must be an object of strings")
    for k, v in env.items():
        if not k or "=" in k or "\0" in k:
            raise HTTPError(400, f"env_vars: invalid name {k!r}")
        if not isinstance(v, str) or "\0" in v:
            raise HTTPError(400, f"env_vars: the value of {k!r} must be a string without NUL")
    return env or None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "space-code-interpreter"
    # Idle keep-alive connections and stalled writes end after this.
    timeout = 120

    def log_message(self, fmt, *args):
        log.debug("%s %s", self.address_string(), fmt % args)

    # --- plumbing ------------------------------------------------------

    def _send(self, status, body, ctype):
        data = body.encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _text(self, status, msg):
        self._send(status, msg, "text/plain; charset=utf-8")

    def _json(self, status, obj):
        self._send(status, dumps(obj), "application/json")

    def _read_json(self):
        if self.headers.get("Transfer-Encoding"):
            raise HTTPError(411, "send the body with a Content-Length", close=True)
        raw = self.headers.get("Content-Length")
        n = 0
        if raw is not None:
            try:
                n = int(raw)
                if n < 0:
                    raise ValueError
            except ValueError:
                raise HTTPError(400, f"bad Content-Length {raw!r}", close=True)
        if n > self.server.max_body:
            raise HTTPError(413, f"body of {n} bytes is over the limit of {self.server.max_body}", close=True)
        body = self.rfile.read(n) if n else b""
        if len(body) < n:
            raise HTTPError(400, "body shorter than its Content-Length", close=True)
        if not body.strip():
            return {}
        try:
            req = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise HTTPError(400, f"invalid JSON body: {e}")
        if req is None:
            return {}
        if not isinstance(req, dict):
            raise HTTPError(400, "the body must be a JSON object")
        return req

    def _client_gone(self):
        # Between outputs nothing is written, so a client that went away
        # (the SDK aborts at its timeout) is seen by reading: readable with
        # nothing to read = closed.
        try:
            r, _, _ = select.select([self.connection], [], [], 0)
            if not r:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _dispatch(self, method):
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        parts = path.strip("/").split("/")
        try:
            if path == "/health":
                self._only(method, "GET")
                return self._json(200, "OK")
            if path == "/execute":
                self._only(method, "POST")
                return self._execute()
            if path == "/contexts":
                self._only(method, "GET", "POST")
                if method == "GET":
                    return self._json(200, self.server.contexts.list())
                return self._create_context()
            if len(parts) == 2 and parts[0] == "contexts":
                self._only(method, "DELETE")
                self.server.contexts.delete(parts[1])
                return self._json(200, None)
            if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart":
                self._only(method, "POST")
                self.server.contexts.restart(parts[1])
                return self._json(200, None)
            raise HTTPError(404, f"no such path {path}")
        except HTTPError as e:
            if e.close:
                self.close_connection = True
            self._text(e.status, str(e))
        except BadRequest as e:
            self._text(400, str(e))
        except NotFound as e:
            self._text(404, str(e))
        except KernelError as e:
            log.error("%s %s: %s", method, path, e)
            self._text(500, str(e))
        except OSError:
            self.close_connection = True  # the client went away
        except Exception as e:
            log.exception("%s %s", method, path)
            self.close_connection = True
            self._text(500, f"internal error: {e}")

    def _only(self, method, *allowed):
        if method not in allowed:
            raise HTTPError(405, f"method {method} not allowed; use {', '.join(allowed)}")

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_PATCH(self):
        self._dispatch("PATCH")

    # --- endpoints -----------------------------------------------------

    def _create_context(self):
        req = self._read_json()
        ctx = self.server.contexts.create(_optional_str(req, "language"), _optional_str(req, "cwd"))
        self._json(200, ctx.to_json())

    def _execute(self):
        req = self._read_json()
        code = req.get("code")
        if not isinstance(code, str):
            raise HTTPError(400, "code must be a string")
        context_id = _optional_str(req, "context_id")
        language = _optional_str(req, "language")
        env = _env_vars(req)
        if context_id and language:
            raise HTTPError(400, "Only one of context_id or language can be provided")
        contexts = self.server.contexts
        if context_id:
            ctx = contexts.get(context_id)
        else:
            ctx = contexts.default_for(language or "python")
        env_set = env_restore = None
        if env:
            env_set, env_restore = env_code(ctx.kernel.flavor, env)
        if ctx.restarted:
            # Once: the code does not run on a kernel whose state the
            # client may rely on and that is gone.
            ctx.restarted = False
            body = "".join(dumps(line) + "\n" for line in
                           (results.error(KERNEL_RESTARTED[0], KERNEL_RESTARTED[1], ""), results.END))
            return self._send(200, body, "application/x-ndjson")

        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        gone = False

        def emit(line):
            nonlocal gone
            if gone:
                return False
            data = (dumps(line) + "\n").encode("utf-8")
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            except OSError:
                gone = True
            return not gone

        try:
            ctx.kernel.execute(code, emit, lambda: gone or self._client_gone(),
                               timeout=contexts.execution_timeout,
                               env_set=env_set, env_restore=env_restore)
        except Exception as e:  # the stream has started: report in it
            log.exception("execute in context %s", ctx.id)
            emit(results.error(type(e).__name__, str(e), ""))
            emit(results.UNEXPECTED_END)
        if gone:
            self.close_connection = True
            return
        try:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            self.close_connection = True
