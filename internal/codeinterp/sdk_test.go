package codeinterp_test

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/testenv"
)

// sdkScript drives the server with the unmodified @e2b/code-interpreter.
// With E2B_DEBUG=true the SDK makes no API call (Sandbox.create returns a
// debug sandbox) and, with E2B_SANDBOX_URL set, sends runCode and the
// context calls to that URL: the server itself. It prints what it saw as
// JSON, or throws.
const sdkScript = `
const { Sandbox } = await import(process.env.SDK_ENTRY);
const out = {};
const sbx = await Sandbox.create();
await sbx.runCode("x = 1");
out.state = (await sbx.runCode("x + 1")).text;
const logs = [];
const printed = await sbx.runCode("import sys\nprint('out')\nprint('err', file=sys.stderr)", {
  onStdout: (m) => logs.push("stdout:" + m.line), onStderr: (m) => logs.push("stderr:" + m.line) });
out.callbacks = logs;
out.logs = printed.logs;
const err = await sbx.runCode("raise ValueError('bad')");
out.error = { name: err.error.name, value: err.error.value, traceback: err.error.traceback.includes("ValueError") };
const plot = await sbx.runCode("import matplotlib.pyplot as plt\nplt.bar(['a', 'b'], [1, 2])\nplt.show()");
out.plot = { formats: plot.results[0].formats(), chart: plot.results[0].chart.type, bars: plot.results[0].chart.elements.length, png: plot.results[0].png.length > 100 };
const df = await sbx.runCode("import pandas as pd\npd.DataFrame({'a': [1, 2]})");
out.df = { html: df.results[0].html.includes("<table"), data: df.results[0].data };
out.envs = (await sbx.runCode("import os\nos.environ.get('SDK_VAR')", { envs: { SDK_VAR: "set" } })).text;
out.envsAfter = (await sbx.runCode("os.environ.get('SDK_VAR', 'unset')")).text;
out.count = (await sbx.runCode("1")).executionCount;
const ctx = await sbx.createCodeContext({ cwd: process.env.CTX_CWD, language: "python" });
out.ctx = { language: ctx.language, cwd: ctx.cwd === process.env.CTX_CWD };
out.ctxCwd = (await sbx.runCode("import os\nos.getcwd()", { context: ctx })).text === process.env.CTX_CWD;
out.listed = (await sbx.listCodeContexts()).some((c) => c.id === ctx.id);
await sbx.runCode("y = 2", { context: ctx });
await sbx.restartCodeContext(ctx);
out.afterRestart = (await sbx.runCode("y", { context: ctx })).error?.name;
try {
  await sbx.runCode("while True: pass", { context: ctx, timeoutMs: 1000 });
  out.timeout = "no error";
} catch (e) { out.timeout = e.name; }
out.afterTimeout = (await sbx.runCode("2 * 21", { context: ctx })).text;
await sbx.removeCodeContext(ctx.id);
try { await sbx.runCode("1", { context: ctx }); out.removed = "no error"; } catch (e) { out.removed = e.name; }
try { await sbx.runCode("1", { language: "cobol" }); out.cobol = "no error"; } catch (e) { out.cobol = e.message; }
console.log(JSON.stringify(out));
// runCode leaves its request timer (60 s) running when the server answers
// with an error status: exit instead of waiting for it.
process.exit(0);
`

// The real SDK against the server, directly (no platform in between):
// needs node and @e2b/code-interpreter in test/e2e/node_modules (make
// e2e-deps), or in the node_modules dir SPACE_CODEINTERP_NODE_MODULES names.
func TestRealSDK(t *testing.T) {
	requirePython(t, "matplotlib", "pandas")
	node, err := exec.LookPath("node")
	if err != nil {
		testenv.Skipf(t, "needs node (make deps)")
	}
	modules := os.Getenv("SPACE_CODEINTERP_NODE_MODULES")
	if modules == "" {
		modules, _ = filepath.Abs("../../test/e2e/node_modules")
	}
	entry := filepath.Join(modules, "@e2b", "code-interpreter", "dist", "index.mjs")
	if _, err := os.Stat(entry); err != nil {
		testenv.Skipf(t, "needs @e2b/code-interpreter in %s (make e2e-deps): %v", modules, err)
	}
	s := startServer(t)
	script := filepath.Join(t.TempDir(), "sdk.mjs")
	if err := os.WriteFile(script, []byte(sdkScript), 0o644); err != nil {
		t.Fatal(err)
	}
	ctxDir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, node, script)
	cmd.Env = append(os.Environ(), "E2B_DEBUG=true", "E2B_SANDBOX_URL="+s.url, "E2B_API_KEY=e2b_unused",
		"SDK_ENTRY=file://"+entry, "CTX_CWD="+ctxDir)
	outb, err := cmd.Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		t.Fatalf("node: %v\n%s\n%s", err, outb, stderr)
	}
	var got map[string]any
	if err := json.Unmarshal(outb, &got); err != nil {
		t.Fatalf("script output %q: %v", outb, err)
	}
	t.Logf("SDK saw: %s", outb)
	want := map[string]string{
		"state":        `"2"`,
		"callbacks":    `["stdout:out\n","stderr:err\n"]`,
		"logs":         `{"stderr":["err\n"],"stdout":["out\n"]}`,
		"error":        `{"name":"ValueError","traceback":true,"value":"bad"}`,
		"df":           `{"data":{"a":[1,2]},"html":true}`,
		"envs":         `"set"`,
		"envsAfter":    `"unset"`,
		"ctx":          `{"cwd":true,"language":"python"}`,
		"ctxCwd":       `true`,
		"listed":       `true`,
		"afterRestart": `"NameError"`,
		"timeout":      `"TimeoutError"`,
		"afterTimeout": `"42"`,
		"removed":      `"NotFoundError"`,
	}
	for k, w := range want {
		if g := js(got[k]); g != w {
			t.Errorf("%s: %s, want %s", k, g, w)
		}
	}
	plot, _ := got["plot"].(map[string]any)
	if plot["chart"] != "bar" || plot["bars"] != 2.0 || plot["png"] != true || !strings.Contains(js(plot["formats"]), "png") {
		t.Errorf("plot: %s", js(plot))
	}
	if c, _ := got["count"].(float64); c < 1 {
		t.Errorf("executionCount %v", got["count"])
	}
	if m, _ := got["cobol"].(string); !strings.Contains(m, "400") {
		t.Errorf("unknown language: %q, want a 400 error", m)
	}
}
