package codeinterp_test

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/spacesbx/space/internal/testenv"
)

// JavaScript and TypeScript run on Deno's Jupyter kernel, which the
// code-interpreter image installs. The test takes the deno binary make
// codeinterp-deps installs into .cache/codeinterp-deno (or the one
// SPACE_CODEINTERP_DENO names, or deno on PATH) and writes its kernelspec
// into a JUPYTER_PATH of its own, as `deno jupyter --install` writes it.
func TestDeno(t *testing.T) {
	requirePython(t)
	deno := os.Getenv("SPACE_CODEINTERP_DENO")
	if deno == "" {
		deno, _ = filepath.Abs("../../.cache/codeinterp-deno/node_modules/@deno/linux-x64-glibc/deno")
		if _, err := os.Stat(deno); err != nil {
			if deno, err = exec.LookPath("deno"); err != nil {
				testenv.Skipf(t, "needs deno: make codeinterp-deps, SPACE_CODEINTERP_DENO or deno on PATH")
			}
		}
	}
	jpath := t.TempDir()
	spec := map[string]any{"argv": []string{deno, "jupyter", "--kernel", "--conn", "{connection_file}"},
		"display_name": "Deno", "language": "typescript"}
	b, _ := json.Marshal(spec)
	if err := os.MkdirAll(filepath.Join(jpath, "kernels", "deno"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(jpath, "kernels", "deno", "kernel.json"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	serverEnv = []string{"JUPYTER_PATH=" + jpath, "DENO_DIR=" + filepath.Join(jpath, "cache")}
	defer func() { serverEnv = nil }()
	s := startServer(t)

	exe := s.run(map[string]any{"code": "console.log('Hello')\nconst z: number = 1\nz + 2", "language": "ts"})
	if got, _ := exe.mainText(); got != "3" || exe.stdout() != "Hello\n" {
		t.Fatalf("ts: %v", exe.lines)
	}
	// Each language has its default context (as in E2B); state stays in it.
	s.run(map[string]any{"code": "const w = 20", "language": "js"})
	if exe := s.run(map[string]any{"code": "w * 2", "language": "javascript"}); js(exe.lines) != `[{"execution_count":2,"type":"number_of_executions"},{"is_main_result":true,"text":"40","type":"result"},{"type":"end_of_execution"}]` {
		t.Fatalf("js state: %s", js(exe.lines))
	}
	if e := s.run(map[string]any{"code": "throw new TypeError('bad')", "language": "js"}).err(); e == nil || e.str("name") != "TypeError" || e.str("value") != "bad" {
		t.Fatalf("js error: %v", e)
	}
	// env_vars for one execution, cwd per context, the kernel's name as a
	// language.
	exe = s.run(map[string]any{"code": "Deno.env.get('DENO_T') + ' ' + process.cwd()", "language": "js", "env_vars": map[string]string{"DENO_T": "set"}})
	if got, _ := exe.mainText(); got != `"set `+s.cwd+`"` {
		t.Fatalf("env and cwd: %v", exe.lines)
	}
	if got, _ := s.run(map[string]any{"code": "String(Deno.env.get('DENO_T'))", "language": "js"}).mainText(); got != `"undefined"` {
		t.Fatalf("env var outlived its execution: %s", got)
	}
	// An interrupt (the client leaves) stops the code and keeps the state.
	s.run(map[string]any{"code": "let kept = 5", "language": "js"})
	ctx, cancel := context.WithCancel(context.Background())
	_, _, err := s.execute(ctx, map[string]any{"code": "console.log('looping')\nwhile (true) {}", "language": "js"}, func(l line) bool { return l.typ() != "stdout" })
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := s.run(map[string]any{"code": "kept + 1", "language": "js"}).mainText(); got != "6" {
		t.Fatalf("after an interrupt: %q", got)
	}
	dir := t.TempDir()
	c := s.createContext(map[string]any{"language": "deno", "cwd": dir})
	if got, _ := s.run(map[string]any{"code": "Deno.cwd()", "context_id": c.ID}).mainText(); got != `"`+dir+`"` {
		t.Fatalf("deno context cwd: %s", got)
	}
}
