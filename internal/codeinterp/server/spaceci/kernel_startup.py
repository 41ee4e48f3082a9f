"""Runs inside each IPython kernel at start (IPKernelApp.exec_lines, through
runpy so none of its names land in the user's namespace).

It adds what E2B's kernels have and a plain ipykernel lacks:
  - the e2b/chart formatter: a matplotlib Figure's data as the SDK's `chart`
    (charts.py), next to the png the inline backend renders;
  - the e2b/data formatter: a pandas DataFrame as {column: [values]};
  - push_env/pop_env, which the server calls (silently) around an execution
    that has env_vars, on a module named _space_ci_kernel.
The formatters never raise: IPython would print a formatter's exception into
the user's output.
"""

import datetime
import importlib.util
import math
import os
import sys
import types


def _load_charts():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "charts.py")
    spec = importlib.util.spec_from_file_location("_space_ci_charts", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["_space_ci_charts"] = mod
    return mod


def _env_module():
    mod = types.ModuleType("_space_ci_kernel", "env_vars of one execution (SPACE's code interpreter)")
    saved = []

    def push_env(env):
        # Previous values (None: unset), restored by pop_env after the run.
        saved.append({k: os.environ.get(k) for k in env})
        os.environ.update({str(k): str(v) for k, v in env.items()})

    def pop_env():
        if not saved:
            return
        for k, v in saved.pop().items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    mod.push_env = push_env
    mod.pop_env = pop_env
    sys.modules[mod.__name__] = mod
    return mod


def _json_value(v):
    # numpy scalars -> Python ones, NaN/inf -> null, timestamps -> ISO
    # strings (as E2B's formatter gives them); anything else JSON cannot
    # hold -> its str.
    if hasattr(v, "item") and type(v).__module__ == "numpy":
        v = v.item()
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, (datetime.datetime, datetime.date)):
        try:
            if v != v:  # NaT
                return None
        except Exception:
            pass
        return v.isoformat()
    return str(v)


def _dataframe_data(df):
    return {str(col): [_json_value(v) for v in values]
            for col, values in df.to_dict(orient="list").items()}


def _install(ip):
    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    # charts.py imports matplotlib: loaded at the first figure (matplotlib
    # is imported by then), not at every kernel start.
    charts = []

    class ChartFormatter(BaseFormatter):
        format_type = Unicode("e2b/chart")
        print_method = ObjectName("_repr_e2b_chart_")
        _return_type = (dict,)

        def __call__(self, obj):
            mpl = sys.modules.get("matplotlib.figure")
            if mpl is None or not isinstance(obj, mpl.Figure):
                return None
            try:
                if not charts:
                    charts.append(_load_charts())
                return charts[0].figure_to_chart(obj)
            except Exception:
                return None

    class DataFormatter(BaseFormatter):
        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict,)

        def __call__(self, obj):
            pd = sys.modules.get("pandas")
            if pd is None or not isinstance(obj, pd.DataFrame):
                return None
            try:
                return _dataframe_data(obj)
            except Exception:
                return None

    formatters = ip.display_formatter.formatters
    formatters["e2b/chart"] = ChartFormatter(parent=ip.display_formatter)
    formatters["e2b/data"] = DataFormatter(parent=ip.display_formatter)


_env_module()
try:
    from IPython import get_ipython

    _install(get_ipython())
except Exception as e:  # a kernel without charts still runs code
    print(f"space code interpreter: kernel startup: {e}", file=sys.__stderr__)
