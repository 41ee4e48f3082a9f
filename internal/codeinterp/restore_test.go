package codeinterp_test

import (
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
)

// crash ends s and its kernels as a move ends a sandbox's processes (the
// files stay); s's cleanup then finds it gone.
func (s *server) crash() {
	_ = syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
	<-s.done
	s.done <- nil
}

// TestContextsOutliveTheServer: a server started again on the state file
// (what an ns move does: processes restart, files stay) lists the
// contexts as before, and each reports once that its kernel restarted
// instead of running code that may rely on the state it lost.
func TestContextsOutliveTheServer(t *testing.T) {
	state := filepath.Join(t.TempDir(), "state", "contexts.json")
	s1 := startServer(t, "--state-file", state)
	c := s1.createContext(map[string]any{"language": "python"})
	s1.run(map[string]any{"code": "x = 41", "context_id": c.ID})
	s1.code("y = 1")
	before := s1.listContexts()
	s1.crash()
	if fi, err := os.Stat(state); err != nil || fi.Mode().Perm()&0o077 != 0 {
		t.Fatalf("state file: %v %v", fi, err)
	}

	s2 := startServer(t, "--state-file", state)
	after := s2.listContexts()
	for _, b := range before {
		if !slices.ContainsFunc(after, func(a contextInfo) bool { return a == b }) {
			t.Errorf("context %+v not listed after the restart: %+v", b, after)
		}
	}
	for _, body := range []map[string]any{{"code": "x + 1", "context_id": c.ID}, {"code": "y"}} {
		e := s2.run(body)
		if er := e.err(); er == nil || er.str("name") != "KernelRestarted" || len(e.of("result")) != 0 {
			t.Errorf("%v: first run after the restart: %v, want KernelRestarted and nothing run", body, e.lines)
		}
	}
	if e := s2.run(map[string]any{"code": "x", "context_id": c.ID}); e.err() == nil || e.err().str("name") != "NameError" {
		t.Errorf("the restarted kernel kept x: %v", e.lines)
	}
	if txt, _ := s2.run(map[string]any{"code": "40 + 2", "context_id": c.ID}).mainText(); txt != "42" {
		t.Errorf("second run: %q", txt)
	}
	if code, body := s2.status("DELETE", "/contexts/"+c.ID, nil); code != 204 && code != 200 {
		t.Fatalf("delete: %d %s", code, body)
	}
	s2.crash()
	s3 := startServer(t, "--state-file", state)
	if slices.ContainsFunc(s3.listContexts(), func(a contextInfo) bool { return a.ID == c.ID }) {
		t.Errorf("a deleted context came back")
	}
}

// TestDamagedStateFile: a state file that is not what the server wrote
// loses the old contexts, never the server.
func TestDamagedStateFile(t *testing.T) {
	for _, content := range []string{"not json", `{"id": 1}`, `[{"id": "a"}, 7, {"id": "b", "language": "python", "cwd": "/nonexistent"}]`} {
		state := filepath.Join(t.TempDir(), "contexts.json")
		if err := os.WriteFile(state, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		s := startServer(t, "--state-file", state)
		if txt, _ := s.code("1 + 1").mainText(); txt != "2" {
			t.Errorf("%q: server does not run code", content)
		}
		// "b" is well-formed but its directory is gone: listed until used,
		// then not found.
		if code, _ := s.status("POST", "/execute", []byte(`{"code": "1", "context_id": "b"}`)); code != 404 && code != 200 {
			t.Errorf("%q: context with a missing cwd: %d", content, code)
		}
		s.crash()
	}
}
