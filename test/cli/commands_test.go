package cli

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os/exec"
	"strings"
	"syscall"
	"time"
)

func testHelp(s *space) {
	t := s.t
	for args, want := range map[string][]string{
		"sandbox create --help":   {"space sandbox create [TEMPLATE] [flags]", "--template", "--timeout", "--metadata", "--json"},
		"sandbox connect --help":  {"--no-attach"},
		"sandbox logs --help":     {"--follow", "--level"},
		"sandbox metrics --help":  {"--follow"},
		"sandbox migrate --help":  {"--to"},
		"sandbox snapshot --help": {"--name"},
		"sandbox fork --help":     {"--count"},
		"exec --help":             {"-- CMD", "--no-stdin", "--user"},
		"--help":                  {"sandbox", "exec", "term", "fs", "template", "completion", "version", "Exit codes"},
	} {
		out := s.ok(strings.Fields(args)...)
		for _, w := range want {
			if !strings.Contains(out, w) {
				t.Errorf("space %s lacks %q:\n%s", args, w, out)
			}
		}
	}
	// Help for create is create's, not the general help.
	if out := s.ok("sandbox", "create", "--help"); strings.Contains(out, "Available Commands") {
		t.Errorf("create --help printed the general help:\n%s", out)
	}
	v := s.ok("--version")
	if !strings.HasPrefix(v, "space version ") || len(strings.TrimSpace(strings.TrimPrefix(v, "space version "))) == 0 {
		t.Errorf("--version: %q", v)
	}
	if v2 := s.ok("version"); !strings.HasPrefix(v2, strings.TrimSpace(v)+" ") {
		t.Errorf("version %q does not agree with --version %q", v2, v)
	}
	for _, sh := range []string{"bash", "zsh", "fish"} {
		script := s.ok("completion", sh)
		if _, err := exec.LookPath(sh); err != nil {
			if sh == "bash" {
				t.Errorf("bash is not installed")
			}
			continue
		}
		cmd := exec.Command(sh, "-n")
		cmd.Stdin = strings.NewReader(script)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("%s -n rejects `space completion %s`: %v\n%s", sh, sh, err, out)
		}
	}
	// Completion of a sandbox command's subcommands works.
	if out := s.ok("__complete", "sandbox", "pa"); !strings.Contains(out, "pause") {
		t.Errorf("completion of 'sandbox pa': %q", out)
	}
}

func testJSON(s *space) {
	t := s.t
	id := s.create()
	defer s.run("sandbox", "kill", id)
	var list []sandboxInfo
	s.json(&list, "sandbox", "list")
	found := false
	for _, l := range list {
		found = found || (l.SandboxID == id && l.State == "running")
	}
	if !found {
		t.Errorf("list --json lacks running %s: %+v", id, list)
	}
	// The shell completes sandbox ids.
	if out := s.ok("__complete", "sandbox", "pause", ""); !strings.Contains(out, id+"\t") {
		t.Errorf("completion of a sandbox id lacks %s:\n%s", id, out)
	}
	var info sandboxInfo
	s.json(&info, "sandbox", "get", id)
	if info.SandboxID != id || info.TemplateID == "" || info.State != "running" {
		t.Errorf("get --json: %+v", info)
	}
	var ms []struct {
		TimestampUnix int64   `json:"timestampUnix"`
		CPUCount      int     `json:"cpuCount"`
		MemUsed       int64   `json:"memUsed"`
		CPUUsedPct    float64 `json:"cpuUsedPct"`
	}
	s.json(&ms, "sandbox", "metrics", id)
	if len(ms) == 0 || ms[len(ms)-1].CPUCount <= 0 || ms[len(ms)-1].MemUsed <= 0 {
		t.Errorf("metrics --json: %+v", ms)
	}
	var ents []struct {
		Name string `json:"name"`
		Type string `json:"type"`
	}
	s.json(&ents, "fs", "ls", id, "/")
	if len(ents) == 0 {
		t.Error("fs ls --json: empty")
	}
	var v struct{ Version string }
	s.json(&v, "version")
	if v.Version == "" {
		t.Error("version --json: no version")
	}
	// Without a terminal, nothing but the result: no progress on stderr.
	r := s.run("sandbox", "create", "--timeout", "60")
	if r.code != 0 || r.stderr != "" || len(strings.Fields(r.stdout)) != 1 {
		t.Errorf("create without a terminal: %+v", r)
	}
	s.ok("sandbox", "kill", strings.TrimSpace(r.stdout))
}

func testExec(s *space) {
	t := s.t
	id := s.create()
	defer s.run("sandbox", "kill", id)
	if r := s.runIn("hi\n", "exec", id, "--", "cat"); r.code != 0 || r.stdout != "hi\n" {
		t.Errorf("echo hi | space exec -- cat: %+v", r)
	}
	// More than one chunk of stdin arrives whole and in order.
	big := strings.Repeat("0123456789abcdef", 20000) // 320 KB
	if r := s.runIn(big, "exec", id, "--", "sha256sum"); r.code != 0 || !strings.HasPrefix(r.stdout, sha256hex(big)) {
		t.Errorf("320 KB through stdin: %+v", r)
	}
	if r := s.runIn("ignored", "exec", "--no-stdin", id, "--", "cat"); r.code != 0 || r.stdout != "" {
		t.Errorf("--no-stdin: %+v", r)
	}
	if r := s.run("exec", id, "--", "sh", "-c", "echo out; echo err >&2; exit 7"); r.code != 7 || r.stdout != "out\n" || r.stderr != "err\n" {
		t.Errorf("exit code and streams: %+v", r)
	}
	if r := s.run("exec", id, "--user", "root", "--cwd", "/tmp", "--env", "K=V", "--", "sh", "-c", "id -u; pwd; echo $K"); r.code != 0 || r.stdout != "0\n/tmp\nV\n" {
		t.Errorf("user, cwd, env: %+v", r)
	}
	if r := s.run("exec", id, "--", "sh", "-c", "kill -9 $$"); r.code != 255 {
		t.Errorf("killed remote command: %+v", r)
	}
}

func testInterrupt(s *space) {
	t := s.t
	id := s.create()
	defer s.run("sandbox", "kill", id)
	// Ctrl-C on the terminal space exec runs on.
	p := s.startPTY("exec", id, "--", "sleep", "60")
	s.waitSleeps(id, 1, 20*time.Second)
	t0 := time.Now()
	p.write(t, "\x03")
	if code := p.wait(t, 15*time.Second); code != 130 {
		t.Errorf("Ctrl-C: exit %d, want 130; terminal:\n%s", code, p.output())
	}
	t.Logf("Ctrl-C to space exec's exit, the remote sleep stopped: %v", time.Since(t0).Round(time.Millisecond))
	if n := s.sleeps(id); n != 0 {
		t.Errorf("after Ctrl-C, %d sleep processes still run in the sandbox", n)
	}
	// SIGTERM to space exec (no terminal).
	cmd := exec.Command(s.bin, "exec", id, "--", "sleep", "60")
	cmd.Env = s.env
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	s.waitSleeps(id, 1, 20*time.Second)
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		_ = cmd.Process.Kill()
		<-done
		t.Fatal("space exec did not end after SIGTERM")
	}
	if code := cmd.ProcessState.ExitCode(); code != 130 {
		t.Errorf("SIGTERM: exit %d, want 130", code)
	}
	if n := s.sleeps(id); n != 0 {
		t.Errorf("after SIGTERM, %d sleep processes still run in the sandbox", n)
	}
	// A command that ignores SIGTERM is killed after the grace period.
	p = s.startPTY("exec", id, "--", "sh", "-c", "trap '' TERM; sleep 60")
	s.waitSleeps(id, 1, 20*time.Second)
	t0 = time.Now()
	p.write(t, "\x03")
	if code := p.wait(t, 20*time.Second); code != 130 {
		t.Errorf("Ctrl-C of a TERM-ignoring command: exit %d", code)
	}
	t.Logf("Ctrl-C to exit for a command ignoring SIGTERM (SIGKILL after the grace): %v", time.Since(t0).Round(time.Millisecond))
	// SIGKILL went to the command's process group: neither sh nor its
	// sleep survived.
	if out := s.ok("exec", id, "--", "sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"); strings.Contains(out, "trap") {
		t.Errorf("the TERM-ignoring command survived: %s", out)
	}
	s.waitSleeps(id, 0, 5*time.Second)
}

func testTerminal(s *space) {
	t := s.t
	id := s.create()
	defer s.run("sandbox", "kill", id)
	p := s.startPTY("term", id)
	p.write(t, "echo ready-$((6*7))\r")
	p.waitFor(t, "ready-42", 30*time.Second)
	// Ctrl-C inside the session goes to the remote terminal: it stops the
	// remote sleep and the session goes on.
	p.write(t, "sleep 60\r")
	s.waitSleeps(id, 1, 20*time.Second)
	p.write(t, "\x03")
	s.waitSleeps(id, 0, 10*time.Second)
	p.write(t, "echo still-$((7*6))\r")
	p.waitFor(t, "still-42", 10*time.Second)
	p.write(t, "exit 3\r")
	if code := p.wait(t, 15*time.Second); code != 3 {
		t.Errorf("terminal exit: %d, want 3", code)
	}
}

func testLifecycle(s *space) {
	t := s.t
	id := s.create()
	s.ok("exec", id, "--", "sh", "-c", "echo kept > /home/user/f")
	state := func() string {
		var info sandboxInfo
		s.json(&info, "sandbox", "get", id)
		return info.State
	}
	s.ok("sandbox", "pause", id)
	if st := state(); st != "paused" {
		t.Fatalf("after pause: %s", st)
	}
	// A paused sandbox's error says how to resume it, once.
	r := s.run("exec", id, "--", "true")
	want := "space: sandbox " + id + " is paused (resume it with: space sandbox resume " + id + ")\n"
	if r.code != 1 || r.stderr != want {
		t.Errorf("exec on a paused sandbox: %+v, want stderr %q", r, want)
	}
	var resumed sandboxInfo
	s.json(&resumed, "sandbox", "resume", id)
	if resumed.State != "running" {
		t.Errorf("resume --json: %+v", resumed)
	}
	s.ok("sandbox", "pause", id)
	// connect resumes a paused sandbox.
	var conn sandboxInfo
	s.json(&conn, "sandbox", "connect", id)
	if conn.State != "running" || conn.SandboxID != id {
		t.Errorf("connect --json: %+v", conn)
	}
	if out := s.ok("sandbox", "connect", "--no-attach", id); !strings.Contains(out, id) || !strings.Contains(out, "running") {
		t.Errorf("connect --no-attach: %s", out)
	}
	// connect through a terminal attaches a shell.
	s.ok("sandbox", "pause", id)
	p := s.startPTY("sandbox", "connect", id)
	p.write(t, "cat /home/user/f\r")
	p.waitFor(t, "kept", 60*time.Second)
	p.write(t, "exit\r")
	if code := p.wait(t, 15*time.Second); code != 0 {
		t.Errorf("connect session: exit %d\n%s", code, p.output())
	}
	var snap struct {
		SnapshotID string   `json:"snapshotID"`
		Names      []string `json:"names"`
	}
	s.json(&snap, "sandbox", "snapshot", id, "--name", "cli-snap")
	if snap.SnapshotID == "" || len(snap.Names) == 0 {
		t.Errorf("snapshot --json: %+v", snap)
	}
	var forks []struct {
		Sandbox *struct {
			SandboxID string `json:"sandboxID"`
		} `json:"sandbox"`
		Error *struct{ Message string } `json:"error"`
	}
	s.json(&forks, "sandbox", "fork", id, "--count", "1", "--timeout", "120")
	if len(forks) != 1 || forks[0].Sandbox == nil {
		t.Fatalf("fork --json: %+v", forks)
	}
	fork := forks[0].Sandbox.SandboxID
	if out := s.ok("exec", fork, "--", "cat", "/home/user/f"); out != "kept\n" {
		t.Errorf("fork's file: %q", out)
	}
	s.ok("sandbox", "kill", fork)
	var mv struct {
		SandboxID string `json:"sandbox_id"`
		From      struct {
			Worker string `json:"worker"`
		} `json:"from"`
		Route struct {
			Worker     string `json:"worker"`
			Generation uint64 `json:"generation"`
		} `json:"route"`
		FilesKept bool `json:"files_kept"`
	}
	s.json(&mv, "sandbox", "migrate", id)
	if mv.SandboxID != id || mv.Route.Worker == "" || mv.Route.Worker == mv.From.Worker || !mv.FilesKept {
		t.Errorf("migrate --json: %+v", mv)
	}
	if out := s.ok("exec", id, "--", "cat", "/home/user/f"); out != "kept\n" {
		t.Errorf("after migrate: %q", out)
	}
	s.ok("sandbox", "kill", id)
	r = s.run("sandbox", "get", id)
	if r.code != 1 || r.stderr != "space: sandbox "+id+" not found (list sandboxes with: space sandbox list)\n" {
		t.Errorf("get after kill: %+v", r)
	}
}

func testObserve(s *space) {
	t := s.t
	id := s.create()
	defer s.run("sandbox", "kill", id)
	// Logs: the route may or may not exist on this server; either way the
	// command says so clearly.
	r := s.run("sandbox", "logs", id, "--json")
	switch {
	case r.code == 1 && r.stderr == "space: this server has no sandbox logs API (it predates GET /v2/sandboxes/{id}/logs)\n":
		t.Logf("this server has no logs API")
	case r.code == 0:
		sc := bufio.NewScanner(strings.NewReader(r.stdout))
		for sc.Scan() {
			var l struct {
				Timestamp string            `json:"timestamp"`
				Level     string            `json:"level"`
				Message   string            `json:"message"`
				Fields    map[string]string `json:"fields"`
			}
			if err := json.Unmarshal(sc.Bytes(), &l); err != nil || l.Timestamp == "" {
				t.Errorf("logs --json line %q: %v", sc.Text(), err)
			}
		}
		s.ok("sandbox", "logs", id)
	default:
		t.Errorf("logs: %+v", r)
	}
	// metrics --follow prints samples until interrupted.
	p := s.startPTY("sandbox", "metrics", id, "--follow", "--json")
	deadline := time.Now().Add(20 * time.Second)
	for strings.Count(p.output(), "timestampUnix") < 2 && time.Now().Before(deadline) {
		time.Sleep(200 * time.Millisecond)
	}
	if n := strings.Count(p.output(), "timestampUnix"); n < 2 {
		t.Errorf("metrics --follow printed %d samples in 20s:\n%s", n, p.output())
	}
	p.write(t, "\x03")
	if code := p.wait(t, 10*time.Second); code != 0 {
		t.Errorf("metrics --follow after Ctrl-C: exit %d", code)
	}
	out := s.ok("sandbox", "metrics", id)
	if !strings.Contains(out, "CPU%") || strings.Count(out, "\n") < 2 {
		t.Errorf("metrics table: %s", out)
	}
}

func testErrors(s *space) {
	t := s.t
	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"sandbox", "get", "nosuchid"}, 1, "space: sandbox nosuchid not found (list sandboxes with: space sandbox list)\n"},
		{[]string{"sandbox", "kill", "nosuchid"}, 1, "space: sandbox nosuchid not found (list sandboxes with: space sandbox list)\n"},
		{[]string{"sandbox", "pause", "nosuchid"}, 1, "space: sandbox nosuchid not found (list sandboxes with: space sandbox list)\n"},
		{[]string{"exec", "nosuchid", "--", "true"}, 1, "space: sandbox nosuchid not found (list sandboxes with: space sandbox list)\n"},
		{[]string{"--api-key", "e2b_00000000000000000000000000000000", "sandbox", "list"}, 1, "space: the API key was refused (check --api-key or SPACE_API_KEY)\n"},
		{[]string{"sandbox", "get"}, 2, "space: sandbox get: expected ID, got 0 argument(s)\nRun 'space sandbox get --help' for usage.\n"},
		{[]string{"sandbox", "frobnicate"}, 2, "space: unknown command \"frobnicate\" for \"space sandbox\"\nRun 'space sandbox --help' for usage.\n"},
		{[]string{"exec", "x", "--bogus", "--", "true"}, 2, "space: unknown flag: --bogus\nRun 'space exec --help' for usage.\n"},
	} {
		r := s.run(c.args...)
		if r.code != c.code || r.stderr != c.want {
			t.Errorf("space %q: exit %d, stderr %q; want %d, %q", c.args, r.code, r.stderr, c.code, c.want)
		}
		// No class word said twice.
		for _, w := range []string{"not found", "unauthorized", "conflict"} {
			if strings.Count(r.stderr, w) > 1 {
				t.Errorf("space %q repeats %q: %q", c.args, w, r.stderr)
			}
		}
	}
}

func sha256hex(s string) string {
	h := sha256.Sum256([]byte(s))
	return hex.EncodeToString(h[:])
}
