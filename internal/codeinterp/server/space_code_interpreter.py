#!/usr/bin/python3
"""SPACE's code interpreter server: the HTTP API @e2b/code-interpreter talks
to on port 49999 (/health, /execute, /contexts), backed by one Jupyter kernel
per context.

It runs inside a sandbox as the sandbox's user on Debian's own packages
(python3-jupyter-client, python3-ipykernel, matplotlib, pandas): nothing is
installed with pip, so the image is reproducible from the Debian mirror
alone. See spaceci/ for the pieces.
"""

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading

# Imported only after the runtime dir is set: jupyter_core reads
# JUPYTER_RUNTIME_DIR when the modules first ask for it.


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="0.0.0.0",
                   help="address to listen on (the sandbox edge reaches 0.0.0.0:PORT)")
    p.add_argument("--port", type=int, default=49999)
    p.add_argument("--cwd", default="/home/user",
                   help="working directory of contexts created without one "
                        "(this process's own when it does not exist)")
    p.add_argument("--execution-timeout", type=float, default=0,
                   help="seconds after which an execution is interrupted "
                        "(0: none; the SDK's own timeout closes the connection, "
                        "which interrupts too)")
    p.add_argument("--interrupt-grace", type=float, default=10,
                   help="seconds a kernel gets to stop after an interrupt before it is "
                        "restarted (code that ignores SIGINT or is stuck in C)")
    p.add_argument("--max-body-bytes", type=int, default=16 << 20,
                   help="largest request body accepted (413 above it)")
    p.add_argument("--state-file", default="",
                   help="file the contexts are kept in, so a server started again on it "
                        "(after the sandbox moved) lists them with new kernels (empty: none)")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("space-code-interpreter")

    # A private runtime dir: kernel connection files hold the HMAC key that
    # lets anyone who reads them run code in the kernel, and the default
    # ($XDG_RUNTIME_DIR or ~/.local/share/jupyter/runtime) may be missing,
    # shared or not writable for whoever runs the server (root on a test
    # host, uid 1000 in the sandbox). mkdtemp makes it 0700.
    runtime_dir = tempfile.mkdtemp(prefix="space-code-interpreter-")
    os.environ["JUPYTER_RUNTIME_DIR"] = runtime_dir
    # debugpy (imported with ipykernel) prints a notice about frozen
    # modules into the log of every process that loads it.
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")

    from spaceci.contexts import Contexts, install_bash_kernelspec
    from spaceci.http_api import Server

    # "bash" runs on a kernel of this server's own (spaceci/bash_kernel.py).
    install_bash_kernelspec(os.path.join(runtime_dir, "share"))
    default_cwd = args.cwd if os.path.isdir(args.cwd) else os.getcwd()
    contexts = Contexts(default_cwd=default_cwd,
                        execution_timeout=args.execution_timeout,
                        interrupt_grace=args.interrupt_grace,
                        state_file=args.state_file or None)
    try:
        # Warm before serving: /health answers only once the default python
        # context can run code, so a sandbox is handed out ready (and a
        # microVM's snapshot holds a started kernel).
        contexts.start_default()
    except Exception as e:  # any start failure is fatal and must say why
        log.error("cannot start the default python kernel: %s", e)
        contexts.close()
        shutil.rmtree(runtime_dir, ignore_errors=True)
        return 1

    server = Server((args.host, args.port), contexts, max_body=args.max_body_bytes)
    log.info("listening on %s:%d (default cwd %s)", args.host, server.server_port, default_cwd)

    def stop(signum, frame):
        # shutdown() waits for serve_forever to return: call it off the
        # main thread, which is the one serving.
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        server.server_close()
        contexts.close()
        shutil.rmtree(runtime_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
