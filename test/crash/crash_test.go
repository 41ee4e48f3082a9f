package crash

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/url"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/crashpoint"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/sdk"
)

// Operations a scenario drives into its point, each on the set every
// scenario starts from (setup): A running, B paused, C killed.
const (
	opCreate   = "create"   // a new sandbox D
	opPause    = "pause"    // A
	opResume   = "resume"   // B
	opMigrate  = "migrate"  // A to the other worker
	opKill     = "kill"     // A
	opSnapshot = "snapshot" // A
	opRotate   = "rotate"   // the signing key
)

// scenario is one crash: the point, its hit count and the operation that
// reaches it. The hit counts follow from setup: it makes 3 installs (3
// creates), 1 pause and 1 kill (1 teardown) before the operation.
type scenario struct {
	point string
	nth   int64
	op    string
	short bool // in make test's short pass
	// entries: nth is drawn from 1..entries in the long pass (a point hit
	// once per archive entry: randomised timing).
	entries bool
}

var scenarios = []scenario{
	{point: crashpoint.CreateRecorded, nth: 4, op: opCreate},
	{point: crashpoint.InstallActivated, nth: 4, op: opCreate},
	{point: crashpoint.InstallPersisted, nth: 4, op: opCreate, short: true},
	{point: crashpoint.CreateInstalled, nth: 4, op: opCreate},
	{point: crashpoint.WorkerPaused, nth: 2, op: opPause},
	{point: crashpoint.PauseFrozen, nth: 2, op: opPause, short: true},
	{point: crashpoint.WorkerResumed, nth: 1, op: opResume},
	{point: crashpoint.ResumeThawed, nth: 1, op: opResume},
	{point: crashpoint.MoveReserved, nth: 1, op: opMigrate, short: true},
	{point: crashpoint.InstallPersisted, nth: 4, op: opMigrate},
	{point: crashpoint.MoveInstalled, nth: 1, op: opMigrate},
	{point: crashpoint.MovePublished, nth: 1, op: opMigrate},
	{point: crashpoint.RestoreEntry, nth: 2, op: opMigrate, entries: true},
	{point: crashpoint.KillMarked, nth: 2, op: opKill},
	{point: crashpoint.TeardownStopped, nth: 2, op: opKill, short: true},
	{point: crashpoint.SnapshotArchived, nth: 1, op: opSnapshot},
	{point: crashpoint.RotateBegun, nth: 1, op: opRotate},
	{point: crashpoint.RotatePublished, nth: 1, op: opRotate, short: true},
	{point: crashpoint.ArchiveEntry, nth: 3, op: opSnapshot, short: true, entries: true},
	{point: crashpoint.PutWritten, nth: 1, op: opSnapshot},
}

// files is how many files setup writes into A and B (each through the
// SDK, each write acknowledged before the crash); with /home and
// /home/user an archive of A has files+2 entries or more.
const files = 4

// TestCrashPoints runs each scenario (the short pass, or every point in
// rounds with SPACE_CRASH_LONG=1) and prints a table of points with
// their violations; any violation fails the test.
func TestCrashPoints(t *testing.T) {
	testenv.RequirePlatform(t)
	long := os.Getenv("SPACE_CRASH_LONG") == "1"
	rounds := 1
	if long {
		rounds = 2
	}
	// Every point must be driven by some scenario: a point no operation
	// reaches proves nothing.
	for _, p := range crashpoint.Points {
		found := false
		for _, s := range scenarios {
			found = found || s.point == p.Name
		}
		if !found {
			t.Errorf("no scenario drives crash point %s (%s)", p.Name, p.Where)
		}
	}
	type result struct {
		name       string
		violations []string
		took       time.Duration
	}
	var results []result
	for round := range rounds {
		for _, sc := range scenarios {
			if !long && !sc.short {
				continue
			}
			if long && sc.entries && round > 0 {
				sc.nth = 1 + rand.Int64N(files+1) // randomised: anywhere in the archive
			}
			name := fmt.Sprintf("%s@%d/%s", sc.point, sc.nth, sc.op)
			start := time.Now()
			var v []string
			t.Run(name, func(t *testing.T) { v = runScenario(t, sc) })
			results = append(results, result{name, v, time.Since(start)})
		}
	}
	var tab strings.Builder
	total := 0
	fmt.Fprintf(&tab, "%-58s %6s %s\n", "crash point@hit/operation", "time", "violations")
	for _, r := range results {
		total += len(r.violations)
		fmt.Fprintf(&tab, "%-58s %5.0fs %d\n", r.name, r.took.Seconds(), len(r.violations))
		for _, v := range r.violations {
			fmt.Fprintf(&tab, "    %s\n", v)
		}
	}
	fmt.Fprintf(&tab, "%d scenarios, %d violations\n", len(results), total)
	t.Logf("crash points:\n%s", tab.String())
	if total > 0 {
		t.Errorf("%d invariant violations (table above)", total)
	}
}

// sandbox is one the scenario tracks and what was acknowledged about it.
type sandbox struct {
	id, token string
	role      string            // a (running), b (paused), c (killed), d (the create)
	acked     bool              // its create returned
	killed    bool              // its kill returned
	files     map[string]string // acknowledged writes: path -> content
}

// runScenario crashes space up at sc's point and checks the invariants
// after a restart. It returns the violations (and fails t on harness
// errors, which are not violations: the scenario did not run).
func runScenario(t *testing.T, sc scenario) []string {
	// Short: sockets live under it and a Unix socket path fits in 108 bytes.
	dir, err := os.MkdirTemp("", "crash-")
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if !t.Failed() {
			os.RemoveAll(dir)
		}
	}()
	opts := testenv.PlatformOptions{Dir: dir, Workers: 2, LogLevel: "info",
		Env: append(os.Environ(), crashpoint.EnvVar+"="+fmt.Sprintf("%s@%d", sc.point, sc.nth))}
	p1, err := testenv.LaunchPlatform(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer p1.Kill() // when the harness fails before the crash
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	c1 := client(t, p1)
	h := upHost(p1.DataDir)
	a, b, cs := setup(ctx, t, c1, p1)
	for _, s := range []*sandbox{a, b, cs} {
		h.ids = append(h.ids, s.id)
	}

	// The operation: its call fails when the process dies under it.
	d := &sandbox{role: "d", files: map[string]string{}}
	opDone := make(chan error, 1)
	go func() { opDone <- operate(ctx, p1, c1, sc.op, a, b, d) }()
	state, werr := p1.WaitExit(90 * time.Second)
	opErr := <-opDone
	log1, _ := os.ReadFile(p1.LogPath)
	if werr != nil {
		t.Fatalf("crash point %s@%d was not hit by %s (operation: %v): %v\nlog:\n%s", sc.point, sc.nth, sc.op, opErr, werr, log1)
	}
	ws, _ := state.Sys().(syscall.WaitStatus)
	hit := fmt.Sprintf("%s%s (hit %d)", crashpoint.HitMessage, sc.point, sc.nth)
	if !ws.Signaled() || ws.Signal() != syscall.SIGKILL || !bytes.Contains(log1, []byte(hit)) {
		t.Fatalf("space up ended with %v, without %q in its log: not the crash point\nlog:\n%s", state, hit, log1)
	}
	if opErr == nil && sc.op != opKill {
		t.Errorf("the %s was acknowledged though space up died inside it", sc.op)
	}
	if d.id != "" {
		h.ids = append(h.ids, d.id)
	}

	// Restart without the crash point.
	opts.Env = os.Environ()
	p2, err := testenv.LaunchPlatform(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if t.Failed() {
			t.Logf("space up log after the restart:\n%s", p2.Log())
		}
		if err := p2.Stop(); err != nil {
			t.Error(err)
		}
		for _, l := range h.afterStop() {
			t.Errorf("left after space up stopped (--keep-sandboxes=false): %s", l)
		}
	}()
	return afterRestart(ctx, t, p2, sc.op, []*sandbox{a, b, cs}, d, &h, p2.Log)
}

// currentRoutes returns, for each sandbox of live, the route the control
// plane names now (a recovery may replace the one a check saw).
func currentRoutes(ctx context.Context, p *testenv.Platform, live map[string]identity.Route) map[string]identity.Route {
	out := make(map[string]identity.Route, len(live))
	for id, r := range live {
		var execs []spacev1.Execution
		get(ctx, p, "/space/v1/sandboxes/"+id+"/executions", &execs)
		for _, e := range execs {
			if e.State == "running" || e.State == "paused" {
				r = e.Route
			}
		}
		out[id] = r
	}
	return out
}

// settled returns what check finds once it finds nothing, or still finds
// after 15 s: what a restart or a kill ends asynchronously (a retire, the
// reaper) gets that long.
func settled(check func() []string) []string {
	deadline := time.Now().Add(15 * time.Second)
	for {
		found := check()
		if len(found) == 0 || time.Now().After(deadline) {
			return found
		}
		time.Sleep(500 * time.Millisecond)
	}
}

func client(t *testing.T, p *testenv.Platform) *sdk.Client {
	c, err := sdk.New(sdk.Config{APIURL: p.APIURL, SandboxURL: p.SandboxURL, APIKey: p.APIKey})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// setup makes A (running) and B (paused) with acknowledged files, and C,
// killed. The hit counts of the scenarios depend on exactly these calls.
func setup(ctx context.Context, t *testing.T, c *sdk.Client, p *testenv.Platform) (a, b, killed *sandbox) {
	t.Helper()
	mk := func(name string) *sandbox {
		s, err := c.CreateSandbox(ctx, sdk.CreateOptions{Timeout: 10 * time.Minute, Secure: true, Metadata: map[string]string{"name": name}})
		if err != nil {
			t.Fatal(err)
		}
		sb := &sandbox{id: s.ID, role: name, token: s.AccessToken, acked: true, files: map[string]string{}}
		for i := range files {
			path, content := fmt.Sprintf("/home/user/%s%d.txt", name, i), fmt.Sprintf("%s %d %x", name, i, rand.Uint64())
			if _, err := s.WriteFile(ctx, path, []byte(content)); err != nil {
				t.Fatal(err)
			}
			sb.files[path] = content
		}
		return sb
	}
	a, b, killed = mk("a"), mk("b"), mk("c")
	if code := rest(ctx, p, http.MethodPost, "/sandboxes/"+b.id+"/pause", nil, nil); code != http.StatusNoContent {
		t.Fatalf("pause: %d", code)
	}
	if err := c.KillSandbox(ctx, killed.id); err != nil {
		t.Fatal(err)
	}
	killed.killed = true
	return a, b, killed
}

// operate runs op, which the armed point ends with the process.
func operate(ctx context.Context, p *testenv.Platform, c *sdk.Client, op string, a, b, d *sandbox) error {
	var code int
	switch op {
	case opCreate:
		var out struct {
			SandboxID       string `json:"sandboxID"`
			EnvdAccessToken string `json:"envdAccessToken"`
		}
		code = rest(ctx, p, http.MethodPost, "/sandboxes", map[string]any{"templateID": "base", "timeout": 600, "secure": true}, &out)
		d.id, d.token = out.SandboxID, out.EnvdAccessToken
		d.acked = code == http.StatusCreated
	case opPause:
		code = rest(ctx, p, http.MethodPost, "/sandboxes/"+a.id+"/pause", nil, nil)
	case opResume:
		code = rest(ctx, p, http.MethodPost, "/sandboxes/"+b.id+"/resume", map[string]int{"timeout": 600}, nil)
	case opMigrate:
		code = rest(ctx, p, http.MethodPost, "/space/v1/sandboxes/"+a.id+"/migrate", map[string]string{}, nil)
	case opKill:
		err := c.KillSandbox(ctx, a.id)
		a.killed = err == nil
		return err
	case opSnapshot:
		code = rest(ctx, p, http.MethodPost, "/sandboxes/"+a.id+"/snapshots", map[string]string{}, nil)
	case opRotate:
		code = rest(ctx, p, http.MethodPost, "/space/v1/keys/rotate", nil, nil)
	}
	if code >= 200 && code < 300 {
		return nil
	}
	return fmt.Errorf("%s: status %d", op, code)
}

// serves waits until s runs (resuming it when paused), then checks every
// acknowledged file through the edge and that the execution which served
// each read is the one the control plane names; it returns that route.
func serves(ctx context.Context, t *testing.T, p *testenv.Platform, s *sandbox) (identity.Route, []string) {
	var vs []string
	deadline := time.Now().Add(120 * time.Second)
	var cur spacev1.Execution
	for {
		var execs []spacev1.Execution
		get(ctx, p, "/space/v1/sandboxes/"+s.id+"/executions", &execs)
		cur = spacev1.Execution{}
		for _, e := range execs {
			if e.State == "running" || e.State == "paused" {
				cur = e
			}
		}
		if cur.State == "paused" {
			rest(ctx, p, http.MethodPost, "/sandboxes/"+s.id+"/connect", map[string]int{"timeout": 600}, nil)
		} else if cur.State == "running" {
			if _, _, err := readFile(ctx, p, s, "/etc/hostname"); err == nil {
				break
			}
		}
		if time.Now().After(deadline) {
			return identity.Route{}, append(vs, fmt.Sprintf("sandbox %s does not serve 120s after the restart (executions %+v)", s.id, execs))
		}
		time.Sleep(250 * time.Millisecond)
	}
	for path, want := range s.files {
		got, served, err := readFile(ctx, p, s, path)
		if err != nil || got != want {
			vs = append(vs, fmt.Sprintf("sandbox %s: acknowledged write %s reads %q, %v; want %q", s.id, path, got, err, want))
		}
		if served != cur.Route.ExecutionLabel() {
			// The control plane may have moved it meanwhile: ask again.
			var execs []spacev1.Execution
			get(ctx, p, "/space/v1/sandboxes/"+s.id+"/executions", &execs)
			ok := false
			for _, e := range execs {
				ok = ok || (e.State == "running" && e.Route.ExecutionLabel() == served)
			}
			if !ok {
				vs = append(vs, fmt.Sprintf("sandbox %s: read served by %q, the control plane names %q", s.id, served, cur.Route.ExecutionLabel()))
			}
		}
	}
	return cur.Route, vs
}

// readFile reads path through the edge and returns the content and the
// Space-Execution that served it.
func readFile(ctx context.Context, p *testenv.Platform, s *sandbox, path string) (string, string, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, p.SandboxURL+"/files?"+url.Values{"path": {path}}.Encode(), nil)
	req.Header.Set(sdk.HeaderSandboxID, s.id)
	req.Header.Set(sdk.HeaderSandboxPort, "49983")
	if s.token != "" {
		req.Header.Set(sdk.HeaderAccessToken, s.token)
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", "", err
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	if res.StatusCode != http.StatusOK || res.Header.Get(spacev1.HeaderExecution) == "" {
		return "", "", fmt.Errorf("status %d, headers %v: %q", res.StatusCode, res.Header, b)
	}
	return string(b), res.Header.Get(spacev1.HeaderExecution), nil
}

func get(ctx context.Context, p *testenv.Platform, path string, out any) {
	rest(ctx, p, http.MethodGet, path, nil, out)
}

// rest calls the control plane; a transport error (the process died)
// is status 0.
func rest(ctx context.Context, p *testenv.Platform, method, path string, body, out any) int {
	var rd io.Reader = http.NoBody
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, _ := http.NewRequestWithContext(ctx, method, p.APIURL+path, rd)
	req.Header.Set(spacev1.HeaderAPIKey, p.APIKey)
	req.Header.Set("Content-Type", "application/json")
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0
	}
	defer res.Body.Close()
	if out != nil && res.StatusCode < 300 {
		json.NewDecoder(res.Body).Decode(out)
	}
	return res.StatusCode
}

// afterRestart checks the invariants once the crashed process runs again
// on p2: setup's sandboxes (a, b, c), d (op's create, if any) and the
// leaks of h. logs is the restarted processes' log, shown with a
// violation.
func afterRestart(ctx context.Context, t *testing.T, p2 *testenv.Platform, op string, abc []*sandbox, d *sandbox, h *host, logs func() string) []string {
	c2 := client(t, p2)
	a, b, cs := abc[0], abc[1], abc[2]
	all := append([]*sandbox(nil), abc...)
	if d.id != "" {
		all = append(all, d)
	}
	var violations []string
	violation := func(f string, args ...any) {
		v := fmt.Sprintf(f, args...)
		t.Log("VIOLATION: " + v)
		violations = append(violations, v)
	}
	// D's create never returned: not acknowledged, so it may be gone, but
	// a listed D must serve. A's kill never returned either: A is gone or
	// serves.
	list, err := c2.ListSandboxes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	listed := map[string]bool{}
	for _, s := range list {
		listed[s.SandboxID] = true
		if d.id == "" && s.SandboxID != a.id && s.SandboxID != b.id && s.SandboxID != cs.id {
			d.id = s.SandboxID // created, never acknowledged
			h.ids = append(h.ids, d.id)
			all = append(all, d)
		}
	}
	live := map[string]identity.Route{}
	for _, s := range all {
		switch {
		case s.killed:
			if _, err := c2.GetSandbox(ctx, s.id); err == nil || listed[s.id] {
				violation("sandbox %s was killed (acknowledged) and is back", s.id)
			}
			continue
		case !s.acked && !listed[s.id]:
			continue
		case op == opKill && s == a && !listed[s.id]:
			continue // the kill took effect, unacknowledged
		case !listed[s.id]:
			violation("sandbox %s (acknowledged) is not listed after the restart", s.id)
			continue
		}
		if d == s && s.token == "" {
			if info, err := c2.GetSandbox(ctx, s.id); err == nil {
				s.token = info.EnvdAccessToken
			}
		}
		r, vs := serves(ctx, t, p2, s)
		for _, v := range vs {
			violation("%s", v)
		}
		if r.SandboxID != "" {
			live[s.id] = r
		}
		t.Logf("sandbox %s (%s) after the restart: %v", s.id, s.role, r)
	}
	if op == opRotate {
		for _, v := range rotationCompleted(ctx, p2) {
			violation("%s", v)
		}
	}
	for _, l := range settled(func() []string { return h.leaks(currentRoutes(ctx, p2, live)) }) {
		violation("leak after the restart: %s", l)
	}
	// Everything killed (a sandbox that did not serve too): nothing of
	// these sandboxes may be left.
	for _, s := range all {
		if s.killed {
			continue
		}
		if err := c2.KillSandbox(ctx, s.id); err != nil && live[s.id].SandboxID != "" {
			violation("kill of %s after the restart: %v", s.id, err)
		}
	}
	for _, l := range settled(func() []string { return h.leaks(nil) }) {
		violation("leak after killing every sandbox: %s", l)
	}
	if len(violations) > 0 {
		var notable []string
		for _, line := range strings.Split(logs(), "\n") {
			if strings.Contains(line, "level=WARN") || strings.Contains(line, "level=ERROR") {
				notable = append(notable, line)
			}
		}
		t.Logf("warnings and errors after the restart:\n%s", strings.Join(notable, "\n"))
	}
	return violations
}

// rotationCompleted checks that the rotation the crash cut off does not
// block rotations for good: the restarted control plane completes it (its
// leader takes it over once the dead instance's registration lapsed, or a
// rotate request does), so a rotate answers 200 within a minute (409
// while one is in progress). The sandboxes served meanwhile (checked by
// afterRestart) with capabilities of whatever key was current.
func rotationCompleted(ctx context.Context, p *testenv.Platform) []string {
	deadline := time.Now().Add(60 * time.Second)
	for {
		var out spacev1.RotateResponse
		code := rest(ctx, p, http.MethodPost, "/space/v1/keys/rotate", nil, &out)
		switch {
		case code == http.StatusOK && out.PreviousKeyID != "" && len(out.Keys) >= 2:
			return nil
		case code == http.StatusOK:
			return []string{fmt.Sprintf("rotation after the restart answered %+v", out)}
		case code != http.StatusConflict:
			return []string{fmt.Sprintf("rotation after the restart: status %d", code)}
		case time.Now().After(deadline):
			return []string{"the interrupted key rotation was not completed within 60 s (rotate still answers 409)"}
		}
		time.Sleep(500 * time.Millisecond)
	}
}
