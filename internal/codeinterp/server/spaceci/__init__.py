"""The code interpreter server's modules.

  http_api       the HTTP API (routes, request validation, NDJSON streaming)
  contexts       contexts: which kernel a request runs in, languages
  kernel         one Jupyter kernel: start, execute, interrupt, restart
  results        Jupyter messages -> the SDK's NDJSON lines
  kernel_startup loaded inside each IPython kernel: chart/data formatters,
                 per-execution environment variables
  charts         matplotlib figure -> the SDK's `chart` field (in the kernel)
"""
