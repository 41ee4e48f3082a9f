"""Contexts: the kernels requests run in, and which kernel a language gets.

A context is one kernel process (its own state, working directory and
execution count). The default python context is started with the server;
a language's default context (what /execute with `language` uses) is
created at its first use. Languages are whatever kernelspecs are installed
(jupyter_client.kernelspec, keyed by the spec's `language`); "js" and "ts"
name JavaScript and TypeScript, which Deno's kernel runs both of; "bash" is
the server's own kernel (bash_kernel.py) unless another is installed.

Contexts outlive the server when it is given a state file: each change is
saved there (ids, languages, working directories, which is a language's
default), and a server started again on the same file (the sandbox moved
to a new execution, whose processes start afresh while its files are
kept) lists them as before. Their kernels are new: the first execution in
each reports KernelRestarted instead of running, so a client learns that
its variables and imports are gone rather than meeting a NameError.
"""

import json
import logging
import os
import re
import shlex
import shutil
import sys
import tempfile
import threading
import uuid

from jupyter_client.kernelspec import KernelSpecManager

from .kernel import Kernel

log = logging.getLogger("space-code-interpreter.contexts")

STARTUP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_startup.py")

ALIASES = {"js": "javascript", "ts": "typescript", "py": "python", "python3": "python"}
# Languages one kernel runs for another: Deno's spec says "typescript"
# and runs JavaScript too.
EQUIVALENT = {"javascript": ("javascript", "typescript"), "typescript": ("typescript", "javascript")}


class BadRequest(Exception):
    """The request cannot be served as asked (HTTP 400)."""


class NotFound(Exception):
    """No such context (HTTP 404)."""


def normalize_language(language):
    if language is None:
        return "python"
    if not isinstance(language, str):
        raise BadRequest("language must be a string")
    lang = language.strip().lower()
    if not lang:
        return "python"
    return ALIASES.get(lang, lang)


class Languages:
    """Installed kernelspecs by language, read again on each miss so a
    kernel installed after the server started is found."""

    def __init__(self):
        self._ksm = KernelSpecManager()

    def _specs(self):
        specs = {}
        for name, info in sorted(self._ksm.get_all_specs().items()):
            spec = info.get("spec", {})
            lang = str(spec.get("language", "")).lower()
            specs.setdefault(lang, []).append((name, spec))
        return specs

    def installed(self):
        specs = self._specs()
        out = set(specs)
        for lang, equivalents in EQUIVALENT.items():
            if any(e in specs for e in equivalents):
                out.add(lang)
        return sorted(out)

    def find(self, language):
        """Returns (spec name, flavor) for language or raises BadRequest."""
        specs = self._specs()
        for lang in EQUIVALENT.get(language, (language,)):
            candidates = specs.get(lang)
            if not candidates:
                continue
            # python: the Debian ipykernel spec is "python3"; prefer it.
            names = [n for n, _ in candidates]
            name, spec = candidates[names.index("python3")] if "python3" in names else candidates[0]
            return name, _flavor(name, spec)
        # A kernelspec's own name works too ("deno", as E2B accepts).
        for infos in specs.values():
            for name, spec in infos:
                if name.lower() == language:
                    return name, _flavor(name, spec)
        raise BadRequest(f"language {language!r} has no kernel installed; installed: "
                         + ", ".join(self.installed()))


def install_bash_kernelspec(parent):
    """Writes the kernelspec of bash_kernel.py under parent and puts parent
    on JUPYTER_PATH, so "bash" is a language when no other bash kernel is
    installed. Returns False when there is no bash."""
    bash = shutil.which("bash")
    if not bash:
        return False
    d = os.path.join(parent, "kernels", "space-bash")
    os.makedirs(d, exist_ok=True)
    spec = {
        "argv": [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bash_kernel.py"),
                 "-f", "{connection_file}"],
        "display_name": "Bash", "language": "bash",
        "metadata": {"space_flavor": "bash"},
    }
    with open(os.path.join(d, "kernel.json"), "w") as f:
        json.dump(spec, f)
    paths = [parent] + [p for p in os.environ.get("JUPYTER_PATH", "").split(os.pathsep) if p]
    os.environ["JUPYTER_PATH"] = os.pathsep.join(paths)
    return True


def _flavor(name, spec):
    if (spec.get("metadata") or {}).get("space_flavor") == "bash":
        return "bash"
    argv = spec.get("argv") or [""]
    if "ipykernel_launcher" in argv or "ipykernel" in argv:
        return "python"
    if name == "deno" or os.path.basename(argv[0]) == "deno":
        return "deno"
    return None


def env_code(flavor, env_vars):
    """Helper code that sets env_vars for one execution and code that puts
    the previous values back, or raises BadRequest for a kernel with no
    known way to set them."""
    if flavor == "python":
        # kernel_startup keeps the previous values (os.environ, so child
        # processes see them too).
        return (f"__import__('_space_ci_kernel').push_env({env_vars!r})",
                "__import__('_space_ci_kernel').pop_env()")
    if flavor == "deno":
        js = json.dumps(env_vars)
        return ("void (() => { const e = " + js + "; globalThis.__spaceEnvSaved = "
                "Object.fromEntries(Object.keys(e).map((k) => [k, Deno.env.get(k)])); "
                "for (const [k, v] of Object.entries(e)) Deno.env.set(k, v); })()",
                "void (() => { for (const [k, v] of Object.entries(globalThis.__spaceEnvSaved ?? {})) "
                "{ if (v === undefined) Deno.env.delete(k); else Deno.env.set(k, v); } "
                "delete globalThis.__spaceEnvSaved; })()")
    if flavor == "bash":
        bad = [k for k in env_vars if not _BASH_NAME.match(k)]
        if bad:
            raise BadRequest(f"env_vars: {bad[0]!r} is not a bash variable name")
        names = " ".join(env_vars)
        pattern = "|".join(env_vars)
        # `export -p` prints the current exports as commands that set them
        # again; what was not exported is unset after.
        return ("__space_env_saved=$(export -p | grep -E '^declare -x (" + pattern + ")(=|$)'); export "
                + " ".join(f"{k}={shlex.quote(v)}" for k, v in env_vars.items()),
                f"unset {names}; eval \"$__space_env_saved\"; unset __space_env_saved")
    raise BadRequest("env_vars are not supported for this context's kernel")


_BASH_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Context:
    def __init__(self, id, language, cwd, kernel, restarted=False):
        self.id = id
        self.language = language
        self.cwd = cwd
        self.kernel = kernel
        # restarted: recreated from the state file with a new kernel; the
        # next execution reports it (and clears it) instead of running.
        self.restarted = restarted

    def to_json(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}


KERNEL_RESTARTED = ("KernelRestarted",
                    "this context's kernel was restarted (the sandbox moved to a new execution, "
                    "or its code interpreter restarted): its variables and imports are gone and "
                    "this code did not run; run it again, after any set-up it needs")


class Contexts:
    def __init__(self, default_cwd, execution_timeout=0, interrupt_grace=10.0, state_file=None):
        self.default_cwd = default_cwd
        self.state_file = state_file
        # _saved: contexts of an earlier server on the state file, not yet
        # recreated (by id: language, cwd, whether it was a default).
        self._saved = _load_state(state_file)
        self.execution_timeout = execution_timeout
        self.interrupt_grace = interrupt_grace
        self.languages = Languages()
        self._lock = threading.Lock()
        self._by_id = {}
        self._default_by_language = {}
        # One lock per language so two first uses of a language start one
        # kernel, while other languages are not held up.
        self._language_locks = {}

    def start_default(self):
        self.default_for("python")

    def _save_locked(self):
        """Writes the state file (atomically: a crash leaves the old one).
        Called with _lock held."""
        if not self.state_file:
            return
        defaults = set(self._default_by_language.values())
        entries = [{"id": c.id, "language": c.language, "cwd": c.cwd, "default": c.id in defaults}
                   for c in self._by_id.values()]
        entries += [dict(v, id=k) for k, v in self._saved.items()]
        try:
            d = os.path.dirname(self.state_file)
            os.makedirs(d, mode=0o700, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=d, prefix=".contexts-")
            with os.fdopen(fd, "w") as f:
                json.dump(entries, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.state_file)
        except OSError as e:
            log.warning("saving contexts to %s: %s", self.state_file, e)

    def _restore(self, ctx_id):
        """Recreates saved context ctx_id with a new kernel (marked
        restarted), or returns None when nothing is saved under it."""
        with self._lock:
            saved = self._saved.pop(ctx_id, None)
        if saved is None:
            return None
        try:
            ctx = self.create(saved["language"], saved["cwd"], ctx_id=ctx_id, restarted=True)
        except BadRequest as e:
            # Its language or directory is gone: it cannot come back.
            log.warning("context %s not restored: %s", ctx_id, e)
            with self._lock:
                self._save_locked()
            return None
        if saved.get("default"):
            with self._lock:
                self._default_by_language.setdefault(ctx.language, ctx.id)
                self._save_locked()
        log.info("context %s restored with a new %s kernel", ctx_id, ctx.language)
        return ctx

    def _kernel_env(self, flavor):
        env = dict(os.environ)
        # The connection files and the server's own kernelspecs (under the
        # runtime dir) are the server's business, not the user's.
        runtime = env.pop("JUPYTER_RUNTIME_DIR", None)
        paths = [p for p in env.get("JUPYTER_PATH", "").split(os.pathsep)
                 if p and not (runtime and p.startswith(runtime))]
        if paths:
            env["JUPYTER_PATH"] = os.pathsep.join(paths)
        else:
            env.pop("JUPYTER_PATH", None)
        if flavor == "python":
            # Figures go through IPython's display system (png + chart) at
            # the end of a cell or on plt.show(), as in E2B's kernels: the
            # inline backend (rendered with Agg), whatever MPLBACKEND the
            # server was started with.
            env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
            # debugpy's notice about frozen modules, printed at every start.
            env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
        elif flavor == "deno":
            # Deno colours what it prints and its results' text/plain:
            # escape codes in execution.text are noise for an API client.
            env["NO_COLOR"] = "1"
        return env

    def create(self, language=None, cwd=None, ctx_id=None, restarted=False):
        language = normalize_language(language)
        if cwd is None or cwd == "":
            cwd = self.default_cwd
        if not isinstance(cwd, str):
            raise BadRequest("cwd must be a string")
        if not os.path.isdir(cwd):
            raise BadRequest(f"cwd {cwd!r} is not a directory")
        spec, flavor = self.languages.find(language)
        extra = []
        if flavor == "python":
            # Loaded by path into a module of its own: the user's namespace
            # gets nothing but what `import` of it would not show.
            extra.append("--IPKernelApp.exec_lines="
                         f"__import__('runpy').run_path({STARTUP!r}, run_name='_space_ci_kernel_loader');")
        kernel = Kernel(spec, cwd, self._kernel_env(flavor), extra, flavor,
                        interrupt_grace=self.interrupt_grace)
        ctx = Context(ctx_id or str(uuid.uuid4()), language, cwd, kernel, restarted)
        with self._lock:
            self._by_id[ctx.id] = ctx
            self._save_locked()
        log.info("context %s: %s kernel %s in %s", ctx.id, language, spec, cwd)
        return ctx

    def default_for(self, language):
        language = normalize_language(language)
        with self._lock:
            lock = self._language_locks.setdefault(language, threading.Lock())
        with lock:
            with self._lock:
                ctx_id = self._default_by_language.get(language)
                if ctx_id in self._by_id:
                    return self._by_id[ctx_id]
                saved = [k for k, v in self._saved.items() if v.get("default") and v.get("language") == language]
            if saved:
                ctx = self._restore(saved[0])
                if ctx is not None:
                    return ctx
            ctx = self.create(language)
            with self._lock:
                self._default_by_language[language] = ctx.id
                self._save_locked()
            return ctx

    def get(self, ctx_id):
        with self._lock:
            ctx = self._by_id.get(ctx_id)
        if ctx is None:
            ctx = self._restore(ctx_id)
        if ctx is None:
            raise NotFound(f"Context {ctx_id} not found")
        return ctx

    def list(self):
        with self._lock:
            return ([c.to_json() for c in self._by_id.values()]
                    + [{"id": k, "language": v["language"], "cwd": v["cwd"]} for k, v in self._saved.items()])

    def delete(self, ctx_id):
        with self._lock:
            ctx = self._by_id.pop(ctx_id, None)
            saved = self._saved.pop(ctx_id, None)
            for lang, d in list(self._default_by_language.items()):
                if d == ctx_id:
                    del self._default_by_language[lang]
            self._save_locked()
        if ctx is None and saved is None:
            raise NotFound(f"Context {ctx_id} not found")
        if ctx is not None:
            ctx.kernel.close()

    def restart(self, ctx_id):
        ctx = self.get(ctx_id)
        ctx.kernel.restart()
        ctx.restarted = False  # the client asked for it: nothing to report

    def close(self):
        with self._lock:
            ctxs = list(self._by_id.values())
            self._by_id.clear()
        for c in ctxs:
            try:
                c.kernel.close()
            except Exception as e:
                log.warning("context %s: close: %s", c.id, e)


def _load_state(path):
    """The contexts saved in path ({} when there is none or it is not a
    list of well-formed entries: a damaged file loses the old contexts,
    never the server)."""
    if not path:
        return {}
    try:
        with open(path) as f:
            entries = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("contexts in %s not read: %s", path, e)
        return {}
    out = {}
    if not isinstance(entries, list):
        return out
    for e in entries:
        if (isinstance(e, dict) and isinstance(e.get("id"), str) and isinstance(e.get("language"), str)
                and isinstance(e.get("cwd"), str)):
            out[e["id"]] = {"language": e["language"], "cwd": e["cwd"], "default": bool(e.get("default"))}
    return out
