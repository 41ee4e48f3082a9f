"""One Jupyter kernel: started by jupyter_client's KernelManager, spoken to
over plain (synchronous) ZeroMQ sockets.

Why not jupyter_client's BlockingKernelClient: in 7.x it wraps asyncio
sockets with a per-thread event loop (run_sync + nest_asyncio), and the HTTP
server calls in from a different thread per request. Two sockets (shell,
iopub) and the Session that signs messages are all an execution needs.

Locking: every use of the sockets and of the KernelManager happens under
_exec_lock, which an execution holds from its request to the kernel's idle
status, so executions on one context run one at a time. restart() and
close() take over from a running execution by bumping _gen: the execution
notices within one poll interval, reports why and lets go of the lock.
"""

import logging
import os
import threading
import time
import uuid

import zmq
from jupyter_client.manager import KernelManager
from jupyter_core.paths import jupyter_runtime_dir

from . import results

log = logging.getLogger("space-code-interpreter.kernel")

POLL_MS = 200
READY_TIMEOUT = 60.0
# Deno's kernel may publish its idle status before the last outputs of an
# execution (ipykernel never does): for kernels other than ipykernel, an
# execution ends once nothing of it has arrived for this long after idle.
SETTLE = 0.15
HELPER_TIMEOUT = 30.0


class KernelError(Exception):
    """The kernel could not be started or made ready."""


class KernelExitedError(KernelError):
    """The kernel process exited before it was ready."""


# START_ATTEMPTS bounds the starts of a kernel that exits while starting.
START_ATTEMPTS = 3


class Kernel:
    def __init__(self, spec_name, cwd, env, extra_arguments=(), flavor=None, interrupt_grace=10.0):
        self.spec_name = spec_name
        self.cwd = cwd
        # "python" (ipykernel + kernel_startup), "deno", "bash"
        # (bash_kernel) or None: how env_vars are set, how an interrupt is
        # sent, whether output may trail the idle status.
        self.flavor = flavor
        # How long the kernel gets to stop after an interrupt before it is
        # restarted instead: code stuck in C, or that ignores SIGINT.
        self.interrupt_grace = interrupt_grace
        self.closed = False
        self._exec_lock = threading.Lock()
        self._admin_lock = threading.Lock()
        self._gen = 0
        self._abort = ("ContextRestarting", "Context was restarted")
        self.shell = self.iopub = None
        # The kernel's ports are chosen free before the kernel binds them
        # (jupyter_client), so another process can take one in between;
        # a kernel that exits while starting is started again, on new
        # ports, a bounded number of times.
        for attempt in range(1, START_ATTEMPTS + 1):
            # The connection file (the kernel's ports and HMAC key) in the
            # server's private runtime dir; a bare KernelManager would make
            # it with mkstemp in $TMPDIR.
            self.km = KernelManager(kernel_name=spec_name, connection_file=os.path.join(
                jupyter_runtime_dir(), f"kernel-{uuid.uuid4()}.json"))
            if flavor == "deno":
                # Deno's kernel exits on SIGINT (its kernelspec leaves the
                # signal mode) but stops the running code, state kept, on an
                # interrupt_request.
                self.km.kernel_spec.interrupt_mode = "message"
            try:
                self.km.start_kernel(cwd=cwd, env=env, extra_arguments=list(extra_arguments))
                self._connect()
                self._wait_ready()
                break
            except KernelExitedError as e:
                self._teardown()
                if attempt == START_ATTEMPTS:
                    raise KernelError(f"kernel {spec_name!r}: {e}") from e
                log.warning("kernel %s: exited while starting (attempt %d), starting it again", spec_name, attempt)
            except Exception as e:
                self._teardown()
                raise KernelError(f"kernel {spec_name!r}: {e}") from e

    # --- sockets -------------------------------------------------------

    def _connect(self):
        self.session = self.km.session
        self.shell = self.km.connect_shell()
        self.iopub = self.km.connect_iopub()
        self.poller = zmq.Poller()
        self.poller.register(self.shell, zmq.POLLIN)
        self.poller.register(self.iopub, zmq.POLLIN)

    def _disconnect(self):
        for s in (self.shell, self.iopub):
            if s is not None:
                s.close(linger=0)
        self.shell = self.iopub = None

    def _teardown(self):
        self._disconnect()
        try:
            if self.km.has_kernel:
                self.km.shutdown_kernel(now=True)
            else:
                self.km.cleanup_resources()
        except Exception as e:
            log.warning("kernel %s: shutdown: %s", self.spec_name, e)

    def _recv(self, sock):
        try:
            _, msg = self.session.recv(sock, mode=zmq.NOBLOCK)
        except zmq.ZMQError:
            return None
        except Exception as e:  # a bad signature or frame: drop it
            log.warning("kernel %s: dropped a message: %s", self.spec_name, e)
            return None
        return msg

    def _alive(self):
        try:
            return self.km.is_alive()
        except Exception:
            return False

    def _exit_code(self):
        try:
            return self.km.provisioner.process.poll()
        except Exception:
            return None

    def _wait_ready(self):
        # iopub is a SUB socket: what the kernel publishes before the
        # subscription is through is lost. Ask kernel_info until a reply
        # and an iopub message have both arrived, as jupyter_client does.
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if not self._alive():
                raise KernelExitedError(f"the kernel exited (code {self._exit_code()}) while starting")
            req = self.session.send(self.shell, "kernel_info_request", {})
            msg_id = req["header"]["msg_id"]
            replied = published = False
            until = time.monotonic() + 1.0
            while time.monotonic() < until and not (replied and published):
                for sock, _ in self.poller.poll(POLL_MS):
                    msg = self._recv(sock)
                    if msg is None:
                        continue
                    if sock is self.shell and msg["parent_header"].get("msg_id") == msg_id:
                        replied = True
                    elif sock is self.iopub:
                        published = True
            if replied and published:
                self._drain()
                return
        raise KernelError(f"not ready within {READY_TIMEOUT:.0f} s")

    def _drain(self):
        while self.poller.poll(0):
            for sock in (self.shell, self.iopub):
                while self._recv(sock) is not None:
                    pass

    # --- helpers run between executions ------------------------------

    def _run_helper(self, code):
        """Runs code silently (no output, no execution count); returns the
        error (ename, evalue) or None."""
        req = self.session.send(self.shell, "execute_request", {
            "code": code, "silent": True, "store_history": False,
            "user_expressions": {}, "allow_stdin": False, "stop_on_error": False})
        msg_id = req["header"]["msg_id"]
        deadline = time.monotonic() + HELPER_TIMEOUT
        while time.monotonic() < deadline:
            for sock, _ in self.poller.poll(POLL_MS):
                while True:
                    msg = self._recv(sock)
                    if msg is None:
                        break
                    if sock is not self.shell or msg["parent_header"].get("msg_id") != msg_id:
                        continue
                    c = msg["content"]
                    if c.get("status") == "ok":
                        return None
                    return (c.get("ename", "Error"), c.get("evalue", ""))
            if not self._alive():
                return ("KernelDied", "the kernel exited")
        return ("TimeoutError", "the kernel did not answer")

    # --- executions ----------------------------------------------------

    def execute(self, code, emit, client_gone, timeout=0, env_set=None, env_restore=None):
        """Runs code and passes each NDJSON line to emit, which returns False
        once the client is gone. client_gone() says whether the client left
        (checked between polls, so a silent execution notices too). A gone
        client or an expired timeout interrupts the kernel; the execution
        still runs to the kernel's idle status so the next one starts clean.
        env_set/env_restore are helper code run before and after (silently)."""
        with self._exec_lock:
            if self.closed:
                emit(results.error("ContextDeleted", "the context was deleted", ""))
                return
            if client_gone():
                return
            if not self._alive():
                log.warning("kernel %s: found dead (code %s): restarting", self.spec_name, self._exit_code())
                self._restart_locked()
            gen = self._gen
            if env_set:
                err = self._run_helper(env_set)
                if err:
                    emit(results.error(err[0], "setting env_vars: " + err[1], ""))
                    emit(results.END)
                    return
            try:
                self._run(code, gen, emit, client_gone, timeout)
            finally:
                if env_restore and gen == self._gen and not self.closed and self._alive():
                    err = self._run_helper(env_restore)
                    if err:
                        log.warning("kernel %s: restoring env_vars: %s: %s", self.spec_name, *err)

    def _run(self, code, gen, emit, client_gone, timeout):
        # stop_on_error would make ipykernel abort requests that arrive
        # shortly after an error (an interrupt is one): the next execution
        # would get an empty "aborted" reply. Executions here are queued by
        # the server, one at a time, so there is nothing to abort.
        req = self.session.send(self.shell, "execute_request", {
            "code": code, "silent": False, "store_history": True,
            "user_expressions": {}, "allow_stdin": False, "stop_on_error": False})
        msg_id = req["header"]["msg_id"]
        started = time.monotonic()
        gone = False
        interrupted_at = None
        # After a server-side timeout the kernel's KeyboardInterrupt is
        # replaced by one TimeoutError (the SDK keeps the last error only).
        suppress_error = False
        last_alive_check = started
        settle = self.flavor not in ("python", "bash")  # ipykernel's ordering
        idle_at = None
        last_msg_at = started
        # Deno reports some errors (an interrupted execution) only in the
        # execute_reply. ipykernel always publishes them, and the reply can
        # arrive before that (two sockets): used for other kernels only,
        # when nothing else reported the error.
        reply_error = None
        error_sent = False

        def send(line):
            nonlocal gone
            if not gone and not emit(line):
                gone = True

        while True:
            if self._gen != gen:
                # restart() or close() took over.
                send(results.error(self._abort[0], self._abort[1], ""))
                return
            for sock, _ in self.poller.poll(POLL_MS if idle_at is None else SETTLE * 1000 / 3):
                while True:
                    msg = self._recv(sock)
                    if msg is None:
                        break
                    if msg["parent_header"].get("msg_id") != msg_id:
                        continue  # others' output
                    if sock is self.shell:
                        # execute_reply: its error came on iopub too. An
                        # aborted request has no other trace.
                        status = msg["content"].get("status")
                        if status == "aborted":
                            send(results.error("ExecutionAborted", "the kernel aborted the execution", ""))
                        elif status == "error":
                            reply_error = msg
                        continue
                    t = msg["msg_type"]
                    c = msg["content"]
                    last_msg_at = time.monotonic()
                    if t == "stream":
                        send(results.stream(msg))
                    elif t == "display_data":
                        send(results.result(c.get("data"), False))
                    elif t == "execute_result":
                        send(results.result(c.get("data"), True))
                    elif t == "error":
                        error_sent = True
                        if not suppress_error:
                            send(results.kernel_error(msg))
                    elif t == "execute_input":
                        send(results.number_of_executions(c.get("execution_count")))
                    elif t == "status" and c.get("execution_state") == "idle":
                        if not settle:
                            send(results.END)
                            return
                        idle_at = last_msg_at
            now = time.monotonic()
            if idle_at is not None and now - last_msg_at >= SETTLE:
                if reply_error is not None and not error_sent and not suppress_error:
                    send(results.kernel_error(reply_error))
                send(results.END)
                return
            if not gone and client_gone():
                gone = True
            if interrupted_at is None:
                if gone:
                    log.info("kernel %s: client gone: interrupting", self.spec_name)
                    interrupted_at = self._interrupt(now)
                elif timeout and now - started > timeout:
                    send(results.error("TimeoutError",
                                       f"execution exceeded {timeout:g} s and was interrupted", ""))
                    suppress_error = True
                    interrupted_at = self._interrupt(now)
            elif now - interrupted_at > self.interrupt_grace:
                log.warning("kernel %s: did not stop on interrupt: restarting", self.spec_name)
                send(results.error("ContextRestarting",
                                   "the kernel did not stop on interrupt and was restarted; its state is lost", ""))
                send(results.UNEXPECTED_END)
                self._restart_locked()
                return
            if now - last_alive_check >= 1.0:
                last_alive_check = now
                if not self._alive():
                    code = self._exit_code()
                    log.warning("kernel %s: died (code %s) during an execution: restarting", self.spec_name, code)
                    send(results.error("ContextRestarting",
                                       f"the kernel died (exit code {code}) and was restarted; its state is lost", ""))
                    send(results.UNEXPECTED_END)
                    self._restart_locked()
                    return

    def _interrupt(self, now):
        try:
            self.km.interrupt_kernel()
        except Exception as e:
            log.warning("kernel %s: interrupt: %s", self.spec_name, e)
        return now

    # --- lifecycle -----------------------------------------------------

    def _restart_locked(self):
        self._gen += 1
        self._disconnect()
        try:
            self.km.restart_kernel(now=True)
            self._connect()
            self._wait_ready()
        except Exception as e:
            raise KernelError(f"kernel {self.spec_name!r}: restart: {e}") from e

    def restart(self):
        with self._admin_lock:
            if self.closed:
                raise KernelError("the context was deleted")
            self._abort = ("ContextRestarting", "Context was restarted")
            self._gen += 1
            with self._exec_lock:
                self._restart_locked()

    def close(self):
        with self._admin_lock:
            if self.closed:
                return
            self._abort = ("ContextDeleted", "the context was deleted")
            self._gen += 1
            self.closed = True
            with self._exec_lock:
                self._teardown()
