"""A matplotlib Figure -> the `chart` field of an @e2b/code-interpreter Result.

Runs inside the kernel (loaded by kernel_startup). The shapes are the SDK's
charts.d.ts: a chart is {type, title, elements}; line and scatter charts add
x/y labels, units, ticks, tick labels and scales with elements
{label, points: [[x, y]...]}; bar charts {label, group, value}; pie charts
{label, angle, radius}; box-and-whisker charts {label, min, first_quartile,
median, third_quartile, max, outliers}; a figure of several axes is a
superchart whose elements are the charts. The type of an axes follows what
it holds, as in E2B's extractor: only lines -> line, patches from boxplot
(patch_artist=True) and lines -> box_and_whisker, only point collections ->
scatter, only wedges -> pie, only rectangles -> bar, anything else ->
unknown (type and title only).

Every value is made JSON-safe here: numpy scalars -> numbers, NaN/inf ->
null, datetimes -> ISO strings.
"""

import datetime
import math
import re

import numpy as np
from matplotlib import dates as mdates
from matplotlib.category import StrCategoryConverter
from matplotlib.collections import PathCollection
from matplotlib.container import BarContainer
from matplotlib.lines import Line2D
from matplotlib.patches import PathPatch, Rectangle, Wedge
from matplotlib.text import Text

# "Time (s)" or "Time [s]" -> unit "s", as E2B reads units from labels.
_UNIT = re.compile(r"\s\((.*?)\)|\[(.*?)\]")
_NO_LINE = ("None", "none", "", " ")


def figure_to_chart(fig):
    axes = fig.get_axes()
    if not axes:
        return None
    _ensure_drawn(fig, axes)
    if len(axes) == 1:
        return axes_to_chart(axes[0])
    suptitle = getattr(fig, "_suptitle", None)
    title = suptitle.get_text() if suptitle is not None else ""
    return {"type": "superchart", "title": title or None,
            "elements": [axes_to_chart(ax) for ax in axes]}


def _ensure_drawn(fig, axes):
    # Tick labels are filled in at draw time. The inline backend has drawn
    # the png by the time this formatter runs; a figure displayed some
    # other way may not have been.
    for ax in axes:
        if any(t.get_text() for t in ax.get_xticklabels() + ax.get_yticklabels()):
            return
    try:
        fig.canvas.draw()
    except Exception:
        pass


def axes_to_chart(ax):
    kind = _chart_type(ax)
    if kind == "line":
        return _line_chart(ax)
    if kind == "scatter":
        return _scatter_chart(ax)
    if kind == "bar":
        return _bar_chart(ax)
    if kind == "pie":
        return _pie_chart(ax)
    if kind == "box_and_whisker":
        return _box_chart(ax)
    return {"type": "unknown", "title": ax.get_title() or None, "elements": []}


def _children(ax):
    children = getattr(ax, "_children", None)
    if children is None:  # matplotlib < 3.5
        children = list(ax.lines) + list(ax.patches) + list(ax.collections) + list(ax.texts)
    return [a for a in children if not isinstance(a, Text)]


def _is_straight(line):
    # axhline/axvline and grid-like segments: two points on one x or one y.
    x, y = line.get_xdata(), line.get_ydata()
    if len(x) != 2 or len(y) != 2:
        return False
    try:
        return x[0] == x[1] or y[0] == y[1]
    except Exception:
        return False


def _chart_type(ax):
    objs = _children(ax)
    if all(isinstance(o, Line2D) for o in objs):
        return "line"
    if all(isinstance(o, (PathPatch, Line2D)) for o in objs):
        return "box_and_whisker"
    objs = [o for o in objs if not (isinstance(o, Line2D) and _is_straight(o))]
    if all(isinstance(o, PathCollection) for o in objs):
        return "scatter"
    if all(isinstance(o, Wedge) for o in objs):
        return "pie"
    if all(isinstance(o, Rectangle) for o in objs):
        return "bar"
    return "unknown"


# --- values --------------------------------------------------------------

def _value(v):
    if isinstance(v, np.datetime64):
        return str(v.astype("datetime64[s]"))
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, (datetime.datetime, datetime.date)):
        return v.isoformat()
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, (int, float)):
        f = float(v)
        return f if math.isfinite(f) else None
    return str(v)


def _is_date(axis):
    conv = getattr(axis, "converter", None)
    switchable = getattr(mdates, "_SwitchableDateConverter", ())
    return isinstance(conv, (mdates.DateConverter, mdates.ConciseDateConverter) + ((switchable,) if switchable else ()))


def _is_categorical(axis):
    return isinstance(getattr(axis, "converter", None), StrCategoryConverter)


def _num2iso(x):
    try:
        return mdates.num2date(float(x)).isoformat()
    except Exception:
        return _value(x)


def _category(axis, x):
    # A categorical axis plots category i at i.
    mapping = getattr(getattr(axis, "units", None), "_mapping", None) or {}
    for name, i in mapping.items():
        if i == round(float(x)):
            return str(name)
    return None


def _coord(axis, x):
    """A converted (numeric) coordinate back in the axis' own terms."""
    if _is_date(axis):
        return _num2iso(x)
    if _is_categorical(axis):
        return _category(axis, x) or _value(x)
    return _value(x)


def _is_number(text):
    try:
        float(text.replace("\u2212", "-"))  # matplotlib's minus sign
        return True
    except ValueError:
        return False


def _tick_label_at(axis, pos):
    """The label a reader sees at pos on axis: the category, the label of
    a tick at pos, the text label of the nearest tick (bars grouped around
    a labelled tick), or else the position itself."""
    if _is_categorical(axis):
        name = _category(axis, pos)
        if name is not None:
            return name
    ticks = [(float(loc), label.get_text()) for loc, label in zip(axis.get_ticklocs(), axis.get_ticklabels())]
    for loc, text in ticks:
        if math.isclose(loc, float(pos), rel_tol=1e-9, abs_tol=1e-9) and text:
            return text
    named = [(loc, text) for loc, text in ticks if text and not _is_number(text)]
    if named:
        locs = sorted(loc for loc, _ in named)
        half = min((b - a for a, b in zip(locs, locs[1:])), default=float("inf")) / 2
        loc, text = min(named, key=lambda lt: abs(lt[0] - float(pos)))
        if abs(loc - float(pos)) < half or len(named) == 1:
            return text
    c = _coord(axis, pos)
    if isinstance(c, float):
        return format(c, "g")
    return str(c)


# --- charts ----------------------------------------------------------------

def _unit(label):
    if not label:
        return None
    m = _UNIT.search(label)
    return (m.group(1) or m.group(2)) if m else None


def _chart2d(ax, kind):
    xl, yl = ax.get_xlabel() or None, ax.get_ylabel() or None
    return {"type": kind, "title": ax.get_title() or None,
            "x_label": xl, "y_label": yl, "x_unit": _unit(xl), "y_unit": _unit(yl),
            "elements": []}


def _swap_axes(chart):
    # Horizontal bars and boxes: x_label names the category axis, y_label
    # the values, as E2B reports them.
    chart["x_label"], chart["y_label"] = chart["y_label"], chart["x_label"]
    chart["x_unit"], chart["y_unit"] = chart["y_unit"], chart["x_unit"]


def _point_chart(ax, kind):
    chart = _chart2d(ax, kind)
    for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
        date = _is_date(axis)
        chart[name + "_ticks"] = [_num2iso(t) if date else _value(t) for t in axis.get_ticklocs()]
        chart[name + "_tick_labels"] = [t.get_text() for t in axis.get_ticklabels()]
        if date:
            scale = "datetime"
        elif _is_categorical(axis):
            scale = "categorical"
        else:
            scale = axis.get_scale()
        chart[name + "_scale"] = scale
    return chart


def _line_chart(ax):
    chart = _point_chart(ax, "line")
    for line in ax.get_lines():
        if _is_straight(line):
            continue
        label = line.get_label()
        if label.startswith("_child"):
            label = "Line " + label[len("_child"):]
        points = [[_value(x), _value(y)] for x, y in zip(line.get_xdata(), line.get_ydata())]
        chart["elements"].append({"label": label, "points": points})
    return chart


def _scatter_chart(ax):
    chart = _point_chart(ax, "scatter")
    for coll in ax.collections:
        points = [[_coord(ax.xaxis, x), _coord(ax.yaxis, y)] for x, y in coll.get_offsets()]
        chart["elements"].append({"label": coll.get_label(), "points": points})
    return chart


def _bar_chart(ax):
    chart = _chart2d(ax, "bar")
    horizontal = False
    for container in ax.containers:
        if not isinstance(container, BarContainer):
            continue
        group = container.get_label() or ""
        if group.startswith("_container"):
            group = "Group " + group[len("_container"):]
        orientation = getattr(container, "orientation", None)
        if orientation is None:
            heights = [r.get_height() for r in container.patches]
            orientation = "horizontal" if len(set(heights)) == 1 and len(heights) > 1 else "vertical"
        horizontal = orientation == "horizontal"
        for rect in container.patches:
            if horizontal:
                label = _tick_label_at(ax.yaxis, rect.get_y() + rect.get_height() / 2)
                value = rect.get_width()
            else:
                label = _tick_label_at(ax.xaxis, rect.get_x() + rect.get_width() / 2)
                value = rect.get_height()
            chart["elements"].append({"label": label, "group": group, "value": _value(value)})
    if horizontal:
        _swap_axes(chart)
    return chart


def _pie_chart(ax):
    chart = {"type": "pie", "title": ax.get_title() or None, "elements": []}
    for wedge in ax.patches:
        if isinstance(wedge, Wedge):
            chart["elements"].append({
                "label": wedge.get_label(),
                "angle": _value(abs(round(wedge.theta2 - wedge.theta1, 4))),
                "radius": _value(wedge.r),
            })
    return chart


def _box_chart(ax):
    chart = _chart2d(ax, "box_and_whisker")
    lines = []
    for line in ax.get_lines():
        try:
            lines.append((line, np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)))
        except (TypeError, ValueError):
            continue
    # A vertical boxplot (the default) has whiskers at one x, and caps and
    # medians at one y: more of the latter.
    seg = [(x, y) for _, x, y in lines if len(x) == 2 and len(y) == 2]
    along_x = sum(1 for x, y in seg if y[0] == y[1] and x[0] != x[1])
    along_y = sum(1 for x, y in seg if x[0] == x[1] and y[0] != y[1])
    vertical = along_x >= along_y
    pos_axis = ax.xaxis if vertical else ax.yaxis

    boxes = []
    for patch in ax.patches:
        if not isinstance(patch, PathPatch):
            continue
        v = patch.get_path().vertices
        p, q = (v[:, 0], v[:, 1]) if vertical else (v[:, 1], v[:, 0])
        q1, q3 = float(np.min(q)), float(np.max(q))
        boxes.append({"lo": float(np.min(p)), "hi": float(np.max(p)), "q1": q1, "q3": q3,
                      "median": None, "min": q1, "max": q3, "outliers": []})

    def box_at(lo, hi):
        eps = 1e-9
        for b in boxes:
            if b["lo"] - eps <= lo and hi <= b["hi"] + eps:
                return b
        return None

    for line, x, y in lines:
        p, q = (x, y) if vertical else (y, x)
        if len(p) == 0:
            continue
        if line.get_linestyle() in _NO_LINE:
            # fliers: markers only
            for pi, qi in zip(p, q):
                b = box_at(pi, pi)
                if b is not None:
                    b["outliers"].append(_value(qi))
            continue
        if len(p) != 2:
            continue
        b = box_at(min(p), max(p))
        if b is None:
            continue
        if q[0] == q[1]:
            # across the box: the median spans it, caps are narrower
            if math.isclose(min(p), b["lo"]) and math.isclose(max(p), b["hi"]):
                b["median"] = float(q[0])
        elif p[0] == p[1]:
            if max(q) <= b["q1"] + 1e-9:
                b["min"] = float(min(q))
            elif min(q) >= b["q3"] - 1e-9:
                b["max"] = float(max(q))

    for i, b in enumerate(boxes):
        label = _tick_label_at(pos_axis, (b["lo"] + b["hi"]) / 2) or str(i + 1)
        chart["elements"].append({
            "label": label, "min": _value(b["min"]), "first_quartile": _value(b["q1"]),
            "median": _value(b["median"]), "third_quartile": _value(b["q3"]),
            "max": _value(b["max"]), "outliers": b["outliers"],
        })
    if not vertical:
        _swap_axes(chart)
    return chart
