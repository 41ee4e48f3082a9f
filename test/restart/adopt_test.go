package restart

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/crashpoint"
	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/sdk"
)

// Sandbox kinds of TestRestartWith20Sandboxes.
const (
	nServers = 8 // running, a background server and an open client stream each
	nPaused  = 6
	nMoving  = 6 // a migrate in flight at the kill
)

// Issue 13: 20 sandboxes (some running a background server with an open
// client stream, some paused, some mid-move), kill -9 of the worker
// process (space up runs the workers in its own process: the crash point
// kills it while the moves are in flight), restart. The running ones
// answer again without a new generation and their background processes
// keep their pids (re-adoption); each stream's client reconnects at most
// once; the paused ones resume with their files; the moved ones serve
// their files. It prints how many executions were re-adopted, recovered
// and retired.
func TestRestartWith20Sandboxes(t *testing.T) {
	testenv.RequirePlatform(t)
	dir, err := os.MkdirTemp("", "restart20-") // short: sockets live under it
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	// The third move to reach its target's install answer kills the
	// process: the others are in flight then, before or after it.
	opts := testenv.PlatformOptions{Dir: dir, Workers: 2, LogLevel: "info",
		Env: append(os.Environ(), crashpoint.EnvVar+"="+crashpoint.MoveInstalled+"@3")}
	p1, err := testenv.LaunchPlatform(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer p1.Kill()
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	c1 := client(t, p1)

	type server struct {
		s      *sdk.Sandbox
		pid    int
		gen    uint64
		stream *streamClient
	}
	var (
		servers        []*server
		paused, moving []*sdk.Sandbox
		mu             sync.Mutex
		wg             sync.WaitGroup
		errs           []error
	)
	for i := range nServers + nPaused + nMoving {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := c1.CreateSandbox(ctx, sdk.CreateOptions{Timeout: 15 * time.Minute})
			if err == nil {
				_, err = s.WriteFile(ctx, "/home/user/kept.txt", []byte("kept "+s.ID))
			}
			var pid int
			if err == nil && i < nServers {
				pid, err = startServer(ctx, s)
			}
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err != nil:
				errs = append(errs, err)
			case i < nServers:
				servers = append(servers, &server{s: s, pid: pid})
			case i < nServers+nPaused:
				paused = append(paused, s)
			default:
				moving = append(moving, s)
			}
		}()
	}
	wg.Wait()
	if len(errs) > 0 {
		t.Fatalf("setting up 20 sandboxes: %v", errs)
	}
	for _, sv := range servers {
		sv.gen = currentRoute(ctx, t, p1, sv.s.ID).Route.Generation
		sv.stream = openStream(ctx, sv.s)
	}
	for _, s := range paused {
		if code := rest(ctx, t, p1, http.MethodPost, "/sandboxes/"+s.ID+"/pause", nil); code != http.StatusNoContent {
			t.Fatalf("pause: %d", code)
		}
	}
	for _, sv := range servers {
		sv.stream.waitTicks(t, 2, 30*time.Second)
	}
	for _, s := range moving {
		go func() { // ends with an error when the process dies under it
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, p1.APIURL+"/space/v1/sandboxes/"+s.ID+"/migrate", strings.NewReader("{}"))
			req.Header.Set(spacev1.HeaderAPIKey, p1.APIKey)
			req.Header.Set("Content-Type", "application/json")
			if res, err := http.DefaultClient.Do(req); err == nil {
				res.Body.Close()
			}
		}()
	}
	if state, err := p1.WaitExit(2 * time.Minute); err != nil {
		t.Fatalf("the moves did not reach the crash point: %v (%v)", err, state)
	}
	killed := time.Now()

	p2, err := testenv.LaunchPlatform(testenv.PlatformOptions{Dir: dir, Workers: 2, LogLevel: "info"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("space up log after the restart:\n%s", p2.Log())
		}
		if err := p2.Stop(); err != nil {
			t.Error(err)
		}
	})
	restarted := time.Now()
	c2 := client(t, p2)
	for _, sv := range servers {
		sv.stream.retarget(c2)
	}

	// The running ones: same generation, the server's pid alive, the
	// stream's client reconnected at most once.
	var readopted, servedAgain int
	for _, sv := range servers {
		s := c2.Attach(sv.s.ID, sv.s.AccessToken)
		waitFile(ctx, t, s, "/home/user/kept.txt", "kept "+s.ID)
		servedAgain++
		if g := currentRoute(ctx, t, p2, s.ID).Route.Generation; g != sv.gen {
			t.Errorf("sandbox %s runs generation %d after the restart, want %d (re-adopted, not recovered)", s.ID, g, sv.gen)
		} else {
			readopted++
		}
		var out strings.Builder
		code, err := s.Run(ctx, fmt.Sprintf("kill -0 %d && tr '\\0' ' ' </proc/%d/cmdline", sv.pid, sv.pid), sdk.RunOptions{Stdout: &out})
		if err != nil || code != 0 || !strings.Contains(out.String(), "http.server") {
			t.Errorf("sandbox %s: background server pid %d after the restart: exit %d, %v, %q", s.ID, sv.pid, code, err, out.String())
		}
	}
	// The paused ones resume with their files.
	for _, s := range paused {
		if code := rest(ctx, t, p2, http.MethodPost, "/sandboxes/"+s.ID+"/connect", map[string]int{"timeout": 600}); code != http.StatusCreated {
			t.Errorf("connect of paused sandbox %s after the restart: %d", s.ID, code)
			continue
		}
		waitFile(ctx, t, c2.Attach(s.ID, s.AccessToken), "/home/user/kept.txt", "kept "+s.ID)
	}
	// The ones caught mid-move serve their files, wherever they are.
	for _, s := range moving {
		sm := c2.Attach(s.ID, s.AccessToken)
		if st := state(ctx, t, c2, s.ID); st == "paused" {
			rest(ctx, t, p2, http.MethodPost, "/sandboxes/"+s.ID+"/connect", map[string]int{"timeout": 600})
		}
		waitFile(ctx, t, sm, "/home/user/kept.txt", "kept "+s.ID)
	}
	servedAfter := time.Since(restarted)
	streamsBy := time.Now().Add(60 * time.Second) // one bound for all: they run at once
	for _, sv := range servers {
		sv.stream.waitTicksAfter(t, restarted, time.Until(streamsBy))
		sv.stream.stop()
		if n := sv.stream.reconnects.Load(); n > 1 {
			t.Errorf("sandbox %s: the stream's client reconnected %d times, want at most 1", sv.s.ID, n)
		}
	}
	// What happened to each execution: workers audit reclaimed, lost and
	// (with re-adoption) adopted ones; the control plane's histories say
	// which it retired since the kill.
	adopted := auditDecisions(t, p2, "adopted")
	reclaimed := auditDecisions(t, p2, "reclaimed")
	retired, recovered := 0, 0
	all := append(append([]*sdk.Sandbox{}, paused...), moving...)
	for _, sv := range servers {
		all = append(all, sv.s)
	}
	for _, s := range all {
		for _, e := range executions(ctx, t, p2, s.ID) {
			if e.State == "retired" && e.EndedAt != nil && e.EndedAt.After(killed) {
				retired++
			}
			if e.StartedAt.After(killed) {
				recovered++
			}
		}
	}
	t.Logf("after kill -9 of the worker process and a restart: %d executions re-adopted by the workers (the moves' targets included), %d recovered as new executions, %d retired, %d reclaimed; %d/%d running servers kept their generation and pid, all 20 sandboxes served %.1fs after the restart",
		adopted, recovered, retired, reclaimed, readopted, servedAgain, servedAfter.Seconds())
}

// startServer starts a background HTTP server in s that outlives the
// command that started it and returns its pid.
func startServer(ctx context.Context, s *sdk.Sandbox) (int, error) {
	var out strings.Builder
	code, err := s.Run(ctx, "cd /tmp && nohup python3 -m http.server 8000 >/dev/null 2>&1 & echo $!", sdk.RunOptions{Stdout: &out})
	if err != nil || code != 0 {
		return 0, fmt.Errorf("start server in %s: exit %d, %w", s.ID, code, err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(out.String()))
	if err != nil {
		return 0, fmt.Errorf("server pid in %s: %q", s.ID, out.String())
	}
	return pid, nil
}

// streamClient is a client of a sandbox holding one process stream open
// (the server's client: it polls it once a second and prints each
// answer); when the stream ends it reconnects with a new one and counts
// it.
type streamClient struct {
	mu         sync.Mutex
	s          *sdk.Sandbox
	lastTick   time.Time
	ticks      int
	reconnects atomic.Int64
	cancel     context.CancelFunc
	done       chan struct{}
}

func openStream(ctx context.Context, s *sdk.Sandbox) *streamClient {
	ctx, cancel := context.WithCancel(ctx)
	c := &streamClient{s: s, cancel: cancel, done: make(chan struct{})}
	go func() { // owned: ends with stop
		defer close(c.done)
		for first := true; ctx.Err() == nil; first = false {
			c.mu.Lock()
			s := c.s
			before := c.ticks
			c.mu.Unlock()
			s.Run(ctx, `while true; do (exec 3<>/dev/tcp/127.0.0.1/8000 && printf 'GET / HTTP/1.0\r\n\r\n' >&3 && head -c 12 <&3 && echo " tick"); sleep 1; done`,
				sdk.RunOptions{Stdout: c})
			c.mu.Lock()
			delivered := c.ticks > before
			c.mu.Unlock()
			// A reconnect the client sees is a new stream that served it;
			// attempts while the platform is down are not.
			if !first && delivered {
				c.reconnects.Add(1)
			}
			if ctx.Err() == nil {
				time.Sleep(500 * time.Millisecond) // the platform may be down: reconnect after a pause
			}
		}
	}()
	return c
}

// Write counts the ticks the stream delivers.
func (c *streamClient) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if n := strings.Count(string(p), "tick"); n > 0 {
		c.ticks += n
		c.lastTick = time.Now()
	}
	return len(p), nil
}

// retarget makes the next reconnect go to the restarted platform.
func (c *streamClient) retarget(cl *sdk.Client) {
	c.mu.Lock()
	c.s = cl.Attach(c.s.ID, c.s.AccessToken)
	c.mu.Unlock()
}

func (c *streamClient) waitTicks(t *testing.T, n int, d time.Duration) {
	t.Helper()
	for deadline := time.Now().Add(d); ; time.Sleep(100 * time.Millisecond) {
		c.mu.Lock()
		got := c.ticks
		c.mu.Unlock()
		if got >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandbox %s: the stream delivered %d ticks in %v", c.s.ID, got, d)
		}
	}
}

func (c *streamClient) waitTicksAfter(t *testing.T, since time.Time, d time.Duration) {
	t.Helper()
	for deadline := time.Now().Add(d); ; time.Sleep(100 * time.Millisecond) {
		c.mu.Lock()
		last := c.lastTick
		c.mu.Unlock()
		if last.After(since) {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("sandbox %s: its stream delivered nothing within 60s of the restart's checks", c.s.ID)
			return
		}
	}
}

func (c *streamClient) stop() {
	c.cancel()
	<-c.done
}

func waitFile(ctx context.Context, t *testing.T, s *sdk.Sandbox, path, want string) {
	t.Helper()
	var got []byte
	var err error
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(200 * time.Millisecond) {
		got, err = s.ReadFile(ctx, path)
		if (err == nil && string(got) == want) || time.Now().After(deadline) {
			break
		}
	}
	if err != nil || string(got) != want {
		t.Errorf("sandbox %s after the restart: %s reads %q, %v; want %q", s.ID, path, got, err, want)
	}
}

func state(ctx context.Context, t *testing.T, c *sdk.Client, id string) string {
	info, err := c.GetSandbox(ctx, id)
	if err != nil {
		t.Fatalf("sandbox %s after the restart: %v", id, err)
	}
	return info.State
}

func executions(ctx context.Context, t *testing.T, p *testenv.Platform, id string) []spacev1.Execution {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, p.APIURL+"/space/v1/sandboxes/"+id+"/executions", nil)
	req.Header.Set(spacev1.HeaderAPIKey, p.APIKey)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	var execs []spacev1.Execution
	if err := jsonDecode(res, &execs); err != nil {
		t.Fatal(err)
	}
	return execs
}

// auditDecisions counts the workers' audit lines of a decision, spelled
// as a JSON field or a key=value pair.
func auditDecisions(t *testing.T, p *testenv.Platform, decision string) int {
	t.Helper()
	re := regexp.MustCompile(`"?decision"?\s*[:=]\s*"?` + regexp.QuoteMeta(decision) + `\b`)
	logs, _ := filepath.Glob(filepath.Join(p.DataDir, "workers", "*", "audit.log"))
	n := 0
	for _, l := range logs {
		b, err := os.ReadFile(l)
		if err != nil {
			t.Fatal(err)
		}
		n += len(re.FindAll(b, -1))
	}
	return n
}
