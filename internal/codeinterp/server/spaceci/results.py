"""Jupyter messages -> the NDJSON lines @e2b/code-interpreter parses.

The SDK (parseOutput) dispatches on `type`: stdout, stderr, result, error,
number_of_executions; other types are ignored, which is what lets the stream
end with an end_of_execution line (E2B's server keeps that one internal; it is
sent here so a reader can tell a finished stream from a cut one).
"""

import datetime

# MIME type -> the result field the SDK reads (Result's constructor). Every
# other MIME type goes into `extra`, as E2B's server does.
MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    # Set by kernel_startup's formatters (E2B's own MIME names).
    "e2b/data": "data",
    "e2b/chart": "chart",
}


def _timestamp(header):
    # jupyter_client parses the header's date into a datetime.
    d = header.get("date")
    if isinstance(d, datetime.datetime):
        return d.isoformat()
    if isinstance(d, str):
        return d
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def stream(msg):
    c = msg["content"]
    kind = "stderr" if c.get("name") == "stderr" else "stdout"
    return {"type": kind, "text": c.get("text", ""), "timestamp": _timestamp(msg["header"])}


def result(data, is_main):
    out = {"type": "result"}
    extra = {}
    for mime, value in (data or {}).items():
        field = MIME_FIELDS.get(mime)
        if field is None:
            extra[mime] = value
        else:
            out[field] = value
    text = out.get("text")
    # E2B strips the quotes of a str's repr ('abc' -> abc): SDK users
    # compare execution.text with the plain string.
    if isinstance(text, str) and len(text) >= 2 and text[0] == "'" and text[-1] == "'":
        out["text"] = text[1:-1]
    if extra:
        out["extra"] = extra
    out["is_main_result"] = is_main
    return out


def error(name, value, traceback):
    # The SDK's ExecutionError.traceback is one string; Jupyter gives a list
    # of frames. Joined with newlines (kept as the kernel formats them,
    # ANSI colours included, as E2B's kernels do).
    if isinstance(traceback, list):
        traceback = "\n".join(traceback)
    return {"type": "error", "name": name, "value": value, "traceback": traceback or ""}


def kernel_error(msg):
    c = msg["content"]
    return error(c.get("ename", "Error"), c.get("evalue", ""), c.get("traceback", []))


def number_of_executions(count):
    return {"type": "number_of_executions", "execution_count": count}


END = {"type": "end_of_execution"}
UNEXPECTED_END = {"type": "unexpected_end_of_execution"}
