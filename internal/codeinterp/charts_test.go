package codeinterp_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

// chart runs plotting code and returns the one figure result's chart,
// checking that the png is there too (the SDK shows both).
func chart(t *testing.T, s *server, code string) map[string]any {
	t.Helper()
	exe := s.code("import matplotlib.pyplot as plt\n" + code)
	if e := exe.err(); e != nil {
		t.Fatalf("plot code failed: %v", e)
	}
	results := exe.of("result")
	if len(results) != 1 {
		t.Fatalf("%d results, want the figure: %v", len(results), brief(results))
	}
	r := results[0]
	pngOf(t, r)
	if !strings.HasPrefix(r.str("text"), "<Figure size") {
		t.Errorf("figure text %q", r.str("text"))
	}
	c, ok := r["chart"].(map[string]any)
	if !ok {
		t.Fatalf("no chart: %v", keys(r))
	}
	return c
}

// brief drops the png data from results for messages.
func brief(ls []line) []line {
	out := make([]line, len(ls))
	for i, l := range ls {
		out[i] = line{}
		for k, v := range l {
			if k == "png" {
				v = fmt.Sprintf("(%d bytes)", len(l.str("png")))
			}
			out[i][k] = v
		}
	}
	return out
}

func keys(m map[string]any) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

func js(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

func elements(t *testing.T, c map[string]any, n int) []map[string]any {
	t.Helper()
	els, _ := c["elements"].([]any)
	if len(els) != n {
		t.Fatalf("%d elements, want %d: %s", len(els), n, js(c))
	}
	out := make([]map[string]any, n)
	for i, e := range els {
		out[i], _ = e.(map[string]any)
	}
	return out
}

func testCharts(t *testing.T, s *server) {
	requirePython(t, "matplotlib")
	t.Run("Line", func(t *testing.T) {
		c := chart(t, s, `plt.plot([1, 2, 3], [1, 4, 9], label="squares")
plt.plot([1, 2, 3], [2, 3, 4])
plt.title("Growth"); plt.xlabel("Distance (m)"); plt.ylabel("Time [s]")
plt.show()`)
		if c["type"] != "line" || c["title"] != "Growth" || c["x_label"] != "Distance (m)" || c["x_unit"] != "m" || c["y_unit"] != "s" || c["x_scale"] != "linear" {
			t.Fatalf("line chart %s", js(c))
		}
		els := elements(t, c, 2)
		if els[0]["label"] != "squares" || js(els[0]["points"]) != "[[1,1],[2,4],[3,9]]" {
			t.Errorf("first line %s", js(els[0]))
		}
		if l, _ := els[1]["label"].(string); !strings.HasPrefix(l, "Line ") {
			t.Errorf("unlabelled line named %q", l)
		}
		if ticks, _ := c["x_ticks"].([]any); len(ticks) == 0 || len(c["x_tick_labels"].([]any)) != len(ticks) {
			t.Errorf("ticks %s", js(c))
		}
	})
	t.Run("LineDates", func(t *testing.T) {
		// No plt.show(): the figure is shown at the end of the cell.
		c := chart(t, s, `import datetime
plt.plot([datetime.date(2024, 1, 1), datetime.date(2024, 1, 2)], [3, 4]);`)
		els := elements(t, c, 1)
		if c["x_scale"] != "datetime" || js(els[0]["points"]) != `[["2024-01-01",3],["2024-01-02",4]]` {
			t.Fatalf("date line %s", js(c))
		}
	})
	t.Run("Bar", func(t *testing.T) {
		c := chart(t, s, `plt.bar(["a", "b", "c"], [3, 5, 2], label="2024")
plt.xlabel("Team"); plt.ylabel("Wins")
plt.show()`)
		if c["type"] != "bar" || c["x_label"] != "Team" || c["y_label"] != "Wins" {
			t.Fatalf("bar chart %s", js(c))
		}
		if got := js(c["elements"]); got != `[{"group":"2024","label":"a","value":3},{"group":"2024","label":"b","value":5},{"group":"2024","label":"c","value":2}]` {
			t.Fatalf("bars %s", got)
		}
	})
	t.Run("BarGrouped", func(t *testing.T) {
		c := chart(t, s, `import numpy as np
x = np.arange(2)
plt.bar(x - 0.2, [1, 2], 0.4, label="A"); plt.bar(x + 0.2, [3, 4], 0.4, label="B")
plt.xticks(x, ["p", "q"]); plt.legend()
plt.show()`)
		if got := js(c["elements"]); got != `[{"group":"A","label":"p","value":1},{"group":"A","label":"q","value":2},{"group":"B","label":"p","value":3},{"group":"B","label":"q","value":4}]` {
			t.Fatalf("grouped bars %s", got)
		}
	})
	t.Run("BarHorizontal", func(t *testing.T) {
		c := chart(t, s, `plt.barh(["x", "y"], [1, 2])
plt.xlabel("Count"); plt.ylabel("Kind");`)
		els := elements(t, c, 2)
		// x_label names the categories, as for vertical bars.
		if c["x_label"] != "Kind" || c["y_label"] != "Count" || els[1]["label"] != "y" || els[1]["value"] != 2.0 {
			t.Fatalf("horizontal bars %s", js(c))
		}
	})
	t.Run("Scatter", func(t *testing.T) {
		c := chart(t, s, `plt.scatter([1, 2, 3], [4, 5, 6], label="points")
plt.show()`)
		els := elements(t, c, 1)
		if c["type"] != "scatter" || els[0]["label"] != "points" || js(els[0]["points"]) != "[[1,4],[2,5],[3,6]]" {
			t.Fatalf("scatter %s", js(c))
		}
	})
	t.Run("Pie", func(t *testing.T) {
		c := chart(t, s, `plt.pie([1, 1, 2], labels=["a", "b", "c"])
plt.title("Share")
plt.show()`)
		if c["type"] != "pie" || c["title"] != "Share" {
			t.Fatalf("pie %s", js(c))
		}
		if got := js(c["elements"]); got != `[{"angle":90,"label":"a","radius":1},{"angle":90,"label":"b","radius":1},{"angle":180,"label":"c","radius":1}]` {
			t.Fatalf("wedges %s", got)
		}
	})
	t.Run("BoxAndWhisker", func(t *testing.T) {
		c := chart(t, s, `plt.boxplot([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 30], [2, 2, 2, 3]], labels=["s", "t"], patch_artist=True)
plt.ylabel("Value (kg)")
plt.show()`)
		els := elements(t, c, 2)
		if c["type"] != "box_and_whisker" || c["y_unit"] != "kg" {
			t.Fatalf("box chart %s", js(c))
		}
		want := `{"first_quartile":3.5,"label":"s","max":10,"median":6,"min":1,"outliers":[30],"third_quartile":8.5}`
		if got := js(els[0]); got != want {
			t.Fatalf("box s %s, want %s", got, want)
		}
		if els[1]["label"] != "t" || els[1]["median"] != 2.0 || js(els[1]["outliers"]) != "[3]" {
			t.Fatalf("box t %s", js(els[1]))
		}
	})
	t.Run("Superchart", func(t *testing.T) {
		c := chart(t, s, `fig, (a, b) = plt.subplots(1, 2)
a.plot([1, 2], [3, 4]); b.bar(["p"], [1])
fig.suptitle("Both")
plt.show()`)
		els := elements(t, c, 2)
		if c["type"] != "superchart" || c["title"] != "Both" || els[0]["type"] != "line" || els[1]["type"] != "bar" {
			t.Fatalf("superchart %s", js(c))
		}
	})
	t.Run("FigureAsResult", func(t *testing.T) {
		exe := s.code("import matplotlib.pyplot as plt\nfig = plt.figure(); plt.plot([1, 2]); plt.close(fig)\nfig")
		results := exe.of("result")
		if len(results) != 1 || results[0]["is_main_result"] != true {
			t.Fatalf("figure as the cell's value: %v", results)
		}
		pngOf(t, results[0])
		if c, _ := results[0]["chart"].(map[string]any); c["type"] != "line" {
			t.Fatalf("chart %s", js(results[0]["chart"]))
		}
	})
	t.Run("Unknown", func(t *testing.T) {
		c := chart(t, s, `plt.plot([1, 2]); plt.bar([1], [1]); plt.title("Mixed");`)
		if c["type"] != "unknown" || c["title"] != "Mixed" {
			t.Fatalf("mixed axes %s", js(c))
		}
	})
	// No figure, no chart; a broken figure never leaks a formatter error.
	if exe := s.code("1"); fmt.Sprint(exe.of("result")[0]["chart"]) != "<nil>" || exe.of("stderr") != nil {
		t.Fatalf("chart on a non-figure: %v", exe.lines)
	}
}
