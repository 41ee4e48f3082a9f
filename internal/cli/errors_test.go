package cli

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"strings"
	"testing"

	"github.com/spf13/cobra"
)

func TestStripClasses(t *testing.T) {
	for in, want := range map[string]string{
		"not found: not found: sandbox x":      "sandbox x",
		"conflict: sandbox x is paused":        "sandbox x is paused",
		"invalid argument: timeout too large":  "timeout too large",
		"sandbox x is not running":             "sandbox x is not running",
		"unavailable: not found: deep":         "deep",
		"not foundation: keeps unrelated text": "not foundation: keeps unrelated text",
	} {
		if got := stripClasses(in); got != want {
			t.Errorf("stripClasses(%q) = %q, want %q", in, got, want)
		}
	}
}

// answer is one canned HTTP answer of the fake control plane below.
type answer struct {
	status int
	body   any
}

// errorServer answers the control-plane calls the table names with the
// status and body the real server sends for that case, so the SDK builds
// its real errors and the CLI words them.
func errorServer(t *testing.T, answers map[string]answer) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a, ok := answers[r.Method+" "+r.URL.Path]
		if !ok {
			a = answer{404, map[string]any{"code": 404, "message": "not found: no route for " + r.Method + " " + r.URL.Path}}
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(a.status)
		_ = json.NewEncoder(w).Encode(a.body)
	}))
	t.Cleanup(srv.Close)
	return srv
}

func TestErrorsSaidOnceWithNextStep(t *testing.T) {
	srv := errorServer(t, map[string]answer{
		"GET /sandboxes/gone":          {404, map[string]any{"code": 404, "message": "not found: sandbox gone"}},
		"POST /sandboxes/gone/pause":   {404, map[string]any{"code": 404, "message": "not found: not found: sandbox gone"}},
		"POST /sandboxes/p1/pause":     {409, map[string]any{"code": 409, "message": "conflict: sandbox p1 is paused", "reason": "paused"}},
		"POST /sandboxes/r1/resume":    {409, map[string]any{"code": 409, "message": "conflict: sandbox r1 is running, not paused"}},
		"GET /sandboxes/m1/metrics":    {403, map[string]any{"code": 403, "message": "forbidden: role member may not read metrics"}},
		"POST /v2/sandboxes":           {400, map[string]any{"code": 400, "message": "invalid argument: timeout must be at most 86400 seconds"}},
		"GET /v2/sandboxes":            {401, map[string]any{"code": 401, "message": "unauthorized: invalid API key"}},
		"POST /sandboxes/x1/snapshots": {429, map[string]any{"code": 429, "message": "too many requests"}},
	})
	ts := &tester{t: t, env: map[string]string{"SPACE_API_URL": srv.URL, "SPACE_SANDBOX_URL": srv.URL, "SPACE_API_KEY": "k"}}
	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"sandbox", "get", "gone"}, ExitError, "space: sandbox gone not found (list sandboxes with: space sandbox list)\n"},
		{[]string{"sandbox", "pause", "gone"}, ExitError, "space: sandbox gone not found (list sandboxes with: space sandbox list)\n"},
		{[]string{"exec", "gone", "--", "true"}, ExitError, "space: sandbox gone not found (list sandboxes with: space sandbox list)\n"},
		{[]string{"sandbox", "pause", "p1"}, ExitError, "space: sandbox p1 is paused (resume it with: space sandbox resume p1)\n"},
		{[]string{"sandbox", "resume", "r1"}, ExitError, "space: sandbox r1 is running, not paused (see its state with: space sandbox get r1)\n"},
		{[]string{"sandbox", "metrics", "m1"}, ExitError, "space: permission denied: role member may not read metrics (the API key's team or role may not do this)\n"},
		{[]string{"sandbox", "create"}, ExitError, "space: timeout must be at most 86400 seconds\n"},
		{[]string{"sandbox", "list"}, ExitError, "space: the API key was refused (check --api-key or SPACE_API_KEY)\n"},
		{[]string{"sandbox", "snapshot", "x1"}, ExitError, "space: sandbox x1: too many requests (rate limited: retry later)\n"},
		{[]string{"sandbox", "logs", "x1"}, ExitError, "space: this server has no sandbox logs API (it predates GET /v2/sandboxes/{id}/logs)\n"},
	} {
		r := ts.run(c.args...)
		if r.code != c.code || r.stderr != c.want {
			t.Errorf("%q: code %d, stderr %q; want %d, %q", c.args, r.code, r.stderr, c.code, c.want)
		}
	}
}

// TestPauseAlreadyPaused keeps the paused wording to one hint.
func TestPauseAlreadyPausedOneHint(t *testing.T) {
	srv := errorServer(t, map[string]answer{
		"POST /sandboxes/p1/pause": {409, map[string]any{"code": 409, "message": "conflict: sandbox p1 is paused", "reason": "paused"}},
	})
	ts := &tester{t: t, env: map[string]string{"SPACE_API_URL": srv.URL, "SPACE_API_KEY": "k"}}
	r := ts.run("sandbox", "pause", "p1")
	if strings.Count(r.stderr, "space sandbox resume p1") != 1 {
		t.Fatalf("pause of a paused sandbox: %q", r.stderr)
	}
}

func TestFlagParsing(t *testing.T) {
	ts := newTester(t)
	// Connection flags before or after the command, = or space.
	for _, args := range [][]string{
		{"--api-key", "wrong", "sandbox", "list"},
		{"sandbox", "list", "--api-key=wrong"},
		{"sandbox", "--api-key", "wrong", "list"},
	} {
		if r := ts.run(args...); r.code != ExitError || !strings.Contains(r.stderr, "API key was refused") {
			t.Errorf("%q: %+v", args, r)
		}
	}
	// Usage errors name the command whose help to read.
	for args, help := range map[string]string{
		"sandbox create --timeout x":     "space sandbox create --help",
		"sandbox create --metadata nope": "space sandbox create --help",
		"sandbox fork sbx1 --count 0":    "space sandbox fork --help",
		"sandbox logs sbx1 --level loud": "space sandbox logs --help",
		"exec sbx1 a -- echo":            "space exec --help",
		"sandbox get":                    "space sandbox get --help",
		"sandbox nope":                   "space sandbox --help",
	} {
		r := ts.run(strings.Fields(args)...)
		if r.code != ExitUsage || !strings.Contains(r.stderr, "Run '"+help+"' for usage.") {
			t.Errorf("%s: %+v", args, r)
		}
	}
	// Per-command help shows that command's flags.
	for args, flags := range map[string][]string{
		"sandbox create --help":  {"--template", "--timeout", "--metadata", "--json", "--api-key"},
		"exec --help":            {"--user", "--cwd", "--env", "--no-stdin"},
		"sandbox connect -h":     {"--no-attach", "--timeout"},
		"sandbox logs --help":    {"--follow", "--level", "--search"},
		"sandbox metrics --help": {"--follow", "--json"},
		"sandbox migrate --help": {"--to"},
		"template build --help":  {"--name", "--build-arg", "--tag"},
		"help sandbox fork":      {"--count"},
	} {
		r := ts.run(strings.Fields(args)...)
		for _, f := range flags {
			if r.code != 0 || !strings.Contains(r.stdout, f) {
				t.Errorf("%s: lacks %s: %+v", args, f, r)
			}
		}
		if strings.Contains(r.stdout, sdkKey(ts)) {
			t.Errorf("%s: help shows the API key", args)
		}
	}
	// exec: flags between the id and --, nothing after -- is parsed.
	r := ts.run("exec", "--cwd", "/srv", ts.create(), "--user", "root", "--", "echo", "--user", "-x")
	if r.code != 0 || r.stdout != "--user -x\n" {
		t.Fatalf("exec after --: %+v", r)
	}
}

func sdkKey(ts *tester) string { return ts.env["E2B_API_KEY"] }

func TestVersionAndCompletion(t *testing.T) {
	ts := newTester(t)
	Version = "v1.2.3-test"
	t.Cleanup(func() { Version = "" })
	if r := ts.run("--version"); r.code != 0 || r.stdout != "space version v1.2.3-test\n" {
		t.Fatalf("--version: %+v", r)
	}
	r := ts.run("version", "--json")
	var v struct{ Version, Go string }
	if r.code != 0 || json.Unmarshal([]byte(r.stdout), &v) != nil || v.Version != "v1.2.3-test" || v.Go == "" {
		t.Fatalf("version --json: %+v", r)
	}
	id := ts.create()
	if r := ts.run("__complete", "exec", ""); r.code != 0 || !strings.Contains(r.stdout, id+"\tbase running") {
		t.Fatalf("completion of an id: %+v", r)
	}
	if r := ts.run("__complete", "exec", id, ""); r.code != 0 || strings.Contains(r.stdout, id) {
		t.Fatalf("completion after the id: %+v", r)
	}
	for _, sh := range []string{"bash", "zsh", "fish"} {
		r := ts.run("completion", sh)
		if r.code != 0 || !strings.Contains(r.stdout, "space") {
			t.Fatalf("completion %s: %+v", sh, r)
		}
		if _, err := exec.LookPath(sh); err != nil {
			continue
		}
		cmd := exec.Command(sh, "-n")
		cmd.Stdin = strings.NewReader(r.stdout)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("%s -n rejects the completion script: %v\n%s", sh, err, out)
		}
	}
}

// Every command that prints data takes --json.
func TestJSONFlagEverywhere(t *testing.T) {
	g := &globals{e: &env{getenv: func(string) string { return "" }}}
	root := newRoot(g)
	data := map[string]bool{
		"space sandbox create": true, "space sandbox list": true, "space sandbox get": true,
		"space sandbox connect": true, "space sandbox resume": true, "space sandbox snapshot": true,
		"space sandbox fork": true, "space sandbox migrate": true, "space sandbox logs": true,
		"space sandbox metrics": true, "space fs ls": true, "space template build": true, "space version": true,
	}
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		if data[c.CommandPath()] && c.Flags().Lookup("json") == nil {
			t.Errorf("%s has no --json", c.CommandPath())
		}
		delete(data, c.CommandPath())
		for _, s := range c.Commands() {
			walk(s)
		}
	}
	walk(root)
	for p := range data {
		t.Errorf("no command %s", p)
	}
}

// stripClasses only ever drops a prefix, and a second pass changes nothing.
func FuzzStripClasses(f *testing.F) {
	for _, s := range []string{"not found: not found: x", "conflict: ", "x", "", "internal: internal: "} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got := stripClasses(s)
		if !strings.HasSuffix(s, got) || stripClasses(got) != got {
			t.Fatalf("stripClasses(%q) = %q", s, got)
		}
	})
}

// kvFlag accepts exactly key=value with a non-empty key.
func FuzzKVFlag(f *testing.F) {
	for _, s := range []string{"a=b", "a=", "=b", "novalue", "a=b=c"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		m := kvFlag{}
		err := m.Set(s)
		k, v, ok := strings.Cut(s, "=")
		if (err == nil) != (ok && k != "") || (err == nil && m[k] != v) {
			t.Fatalf("Set(%q): %v, %v", s, err, m)
		}
	})
}

// An access token authenticates control-plane calls (Bearer, X-Team-ID);
// a flag beats the environment, and at the same level the API key wins.
func TestAccessToken(t *testing.T) {
	type seen struct{ key, auth, team string }
	var got []seen
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got = append(got, seen{r.Header.Get("X-API-Key"), r.Header.Get("Authorization"), r.Header.Get("X-Team-ID")})
		if r.Header.Get("Authorization") == "Bearer sk_e2b_bad" {
			w.WriteHeader(401)
			_, _ = w.Write([]byte(`{"code":401,"message":"unauthorized: invalid access token"}`))
			return
		}
		_, _ = w.Write([]byte(`[]`))
	}))
	defer srv.Close()
	for _, c := range []struct {
		env  map[string]string
		args []string
		want seen
		code int
	}{
		{map[string]string{}, []string{"--access-token", "sk_e2b_1", "--team", "t1"}, seen{"", "Bearer sk_e2b_1", "t1"}, 0},
		{map[string]string{"E2B_API_KEY": "e2b_k"}, []string{"--access-token", "sk_e2b_1"}, seen{"", "Bearer sk_e2b_1", ""}, 0},
		{map[string]string{"E2B_API_KEY": "e2b_k", "E2B_ACCESS_TOKEN": "sk_e2b_2"}, nil, seen{"e2b_k", "", ""}, 0},
		{map[string]string{"SPACE_ACCESS_TOKEN": "sk_e2b_2", "SPACE_TEAM_ID": "t2"}, nil, seen{"", "Bearer sk_e2b_2", "t2"}, 0},
		{map[string]string{"E2B_ACCESS_TOKEN": "sk_e2b_2"}, []string{"--api-key", "e2b_k"}, seen{"e2b_k", "", ""}, 0},
		{map[string]string{}, []string{"--access-token", "sk_e2b_bad"}, seen{"", "Bearer sk_e2b_bad", ""}, 1},
	} {
		got = nil
		env := map[string]string{"SPACE_API_URL": srv.URL}
		for k, v := range c.env {
			env[k] = v
		}
		ts := &tester{t: t, env: env}
		r := ts.run(append([]string{"sandbox", "list", "--json"}, c.args...)...)
		if r.code != c.code || len(got) != 1 || got[0] != c.want {
			t.Errorf("%v %q: %+v, sent %+v; want %+v", c.env, c.args, r, got, c.want)
		}
		if c.code == 1 && r.stderr != "space: the access token was refused (check --access-token or SPACE_ACCESS_TOKEN)\n" {
			t.Errorf("refused token: %q", r.stderr)
		}
	}
}
