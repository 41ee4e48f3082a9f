"""A Jupyter kernel for language "bash": one long-lived bash per context,
so variables, functions and the working directory carry over between
executions, as with E2B's bash contexts.

Run as a script by the kernelspec the server writes at start (see
contexts.install_bash_kernelspec); built on ipykernel's Kernel base class,
so the message protocol, execution counts and interrupts are ipykernel's.

Each execution's code is written to a file and sourced from a small
function (a syntax error or an unclosed quote stays inside the file), then a
marker line with the exit status tells where its output ends. bash stays in
the kernel's process group: an interrupt (SIGINT to the group) stops the
running command, and the function's trap returns from the rest of the code
(status 130), as an interactive shell drops the rest of a command line.
Because the code runs inside a function, `declare`/`typeset` make local
variables there: `declare -g` makes them last. A non-zero status is an
error named ExitCode; `exit` ends bash, which is started again (its state
lost).
"""

import os
import select
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from ipykernel.kernelapp import IPKernelApp
from ipykernel.kernelbase import Kernel

# After an interrupt, how long bash gets to reach its marker before it is
# killed and started again.
INTERRUPT_GRACE = 5.0


class BashKernel(Kernel):
    implementation = "space-bash"
    implementation_version = "1"
    language = "bash"
    language_version = ""
    language_info = {"name": "bash", "mimetype": "text/x-sh", "file_extension": ".sh"}
    banner = "bash (SPACE code interpreter)"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # The cell file goes beside the connection file: the server's
        # private runtime dir, which it removes when it stops (a kernel
        # killed outright never runs do_shutdown).
        conn = sys.argv[sys.argv.index("-f") + 1] if "-f" in sys.argv else ""
        where = os.path.dirname(os.path.abspath(conn)) if conn else tempfile.gettempdir()
        self._cell = os.path.join(where, "bash-cell-%d-%s.sh" % (os.getpid(), uuid.uuid4().hex[:8]))
        self._marker = ("__space_bash_%s__" % uuid.uuid4().hex).encode()
        self._start_bash()

    def _start_bash(self):
        env = dict(os.environ)
        env.pop("JPY_PARENT_PID", None)
        # ipykernel ignores SIGINT outside its handlers, and a signal ignored
        # when bash starts can never be trapped (nor reset for its commands):
        # while bash is started, SIGINT has a handler, which exec resets.
        old = signal.getsignal(signal.SIGINT)
        if old == signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            self._bash = subprocess.Popen(
                ["bash", "--noprofile", "--norc"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, bufsize=0)
        finally:
            signal.signal(signal.SIGINT, old)
        # Between executions a trap that does nothing (not an ignore, which
        # commands would inherit) keeps bash alive on SIGINT; during one,
        # the trap returns from the code.
        self._bash.stdin.write(
            b"trap ':' INT\n"
            b"__space_run() { trap 'return 130' INT; . \"$__space_cell\"; }\n")

    def _send(self, name, data, silent):
        if data and not silent:
            text = data.decode("utf-8", errors="replace")
            self.send_response(self.iopub_socket, "stream", {"name": name, "text": text})

    def do_execute(self, code, silent, store_history=True, user_expressions=None, allow_stdin=False):
        path = self._cell
        with open(path, "w") as f:
            f.write(code)
            f.write("\n")
        status = None
        try:
            self._bash.stdin.write(
                b"__space_cell=%s; __space_run; __space_status=$?; trap ':' INT; "
                b"printf '%s %%d\\n' \"$__space_status\"\n" % (shlex.quote(path).encode(), self._marker))
            status = self._read_until_marker(silent)
        except (BrokenPipeError, OSError):
            status = None
        if status is None:
            # bash exited (`exit` in the code) or was killed: a new one.
            try:
                self._bash.kill()
            except OSError:
                pass
            self._bash.wait()
            self._start_bash()
            return self._error(silent, "BashExited", "bash exited; a new one was started (its state is lost)")
        if status != 0:
            return self._error(silent, "ExitCode", str(status))
        return {"status": "ok", "execution_count": self.execution_count, "payload": [], "user_expressions": {}}

    def _error(self, silent, name, value):
        content = {"ename": name, "evalue": value, "traceback": []}
        if not silent:
            self.send_response(self.iopub_socket, "error", content)
        return dict(content, status="error", execution_count=self.execution_count)

    def _read_until_marker(self, silent):
        """Streams bash's output until the marker; returns the exit status,
        or None if bash went away."""
        out_fd, err_fd = self._bash.stdout.fileno(), self._bash.stderr.fileno()
        buf = b""
        interrupted_at = None
        while True:
            try:
                ready, _, _ = select.select([out_fd, err_fd], [], [], 0.5)
                for fd in ready:
                    data = os.read(fd, 65536)
                    if not data:
                        if fd == out_fd:
                            self._send("stdout", buf, silent)
                            self._drain_stderr(err_fd, silent)
                            return None
                        continue
                    if fd == err_fd:
                        self._send("stderr", data, silent)
                        continue
                    buf += data
                    i = buf.find(self._marker)
                    if i >= 0:
                        end = buf.find(b"\n", i)
                        # Output without a final newline ends where the
                        # marker starts.
                        self._send("stdout", buf[:i], silent)
                        self._drain_stderr(err_fd, silent)
                        return int(buf[i + len(self._marker):end].strip() or b"0")
                    # The marker line is one write (bash's stdout is line
                    # buffered) of a few bytes to a pipe, which is atomic:
                    # it is never split across reads, so what came without
                    # it is all output.
                    self._send("stdout", buf, silent)
                    buf = b""
                if interrupted_at is not None and time.monotonic() - interrupted_at > INTERRUPT_GRACE:
                    return None
            except KeyboardInterrupt:
                # The group got SIGINT: the command stops, bash goes on to
                # the marker (status 130).
                interrupted_at = time.monotonic()

    def _drain_stderr(self, fd, silent):
        while select.select([fd], [], [], 0)[0]:
            data = os.read(fd, 65536)
            if not data:
                return
            self._send("stderr", data, silent)

    def do_shutdown(self, restart):
        try:
            self._bash.kill()
        except OSError:
            pass
        try:
            os.unlink(self._cell)
        except OSError:
            pass
        return {"status": "ok", "restart": restart}


if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=BashKernel, argv=sys.argv[1:])
