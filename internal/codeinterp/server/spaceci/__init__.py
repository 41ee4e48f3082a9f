"""The code interpreter server's modules.

  http_api       the HTTP API (routes, request validation, NDJSON streaming)
  contexts       contexts: which kernel a request runs in, languages
  kernel         one Jupyter kernel: start, execute, interrupt, restart
  results        Jupyter messages -> the SDK's NDJSON lines
  kernel_startup loaded inside each IPython kernel: chart/data formatters,
                 per-execution environment variables
  charts         matplotlib figure -> the SDK's `chart` field (in the kernel)
  bash_kernel    the kernel of language "bash" (one bash per context), whose
                 kernelspec the server writes at start

Where it differs from E2B's own server (on purpose, or by what it runs on):
  - each stream ends with {"type": "end_of_execution"} (or
    unexpected_end_of_execution when the kernel died); the SDK ignores both.
  - an error's traceback is the kernel's frames joined with newlines, as
    Jupyter frontends show them (E2B's joins them with nothing); IPython's
    colour codes are kept, as E2B's kernels send them.
  - env_vars are set and restored by silent helper executions, not by code
    prepended to the cell: line numbers in tracebacks stay the user's. Deno's
    kernel ignores `silent`, so there the helpers take execution counts too;
    a kernel with no known way to set them answers 400.
  - a context's working directory is the kernel process's own (set when it
    starts), for every language.
  - the sandbox's environment variables are the server's own environment,
    passed to each kernel (E2B's server asks envd for them at the first
    execution).
  - no X-Access-Token check here: the edge authorizes every request to a
    sandbox port before it reaches the server.
  - "bash" is a kernel of this server's own (E2B's image has bash_kernel
    from pip): a non-zero status is an error ExitCode with the status as its
    value; the code runs in a function, so `declare` needs -g to last.
  - with --state-file, contexts outlive the server: one started again on
    the file (after an ns move) lists them, and each one's next execution
    is an error KernelRestarted instead of running (E2B loses them).
  - box-and-whisker charts need boxplot(..., patch_artist=True), as in E2B's
    extractor (a plain boxplot is lines only and reads as a line chart).
"""
