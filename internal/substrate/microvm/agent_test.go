//go:build linux

package microvm

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	processpb "github.com/spacesbx/space/api/envd/process"
	"github.com/spacesbx/space/api/envd/process/processpbconnect"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/substrate"
	"github.com/spacesbx/space/internal/vmchan"
)

// agentSession is a host session with the real spaced-guest in a VM, as
// spaced-host holds it: one vmchan session over the guest socket, HTTP
// over its streams.
type agentSession struct {
	c    *vmchan.Client
	tr   *http.Transport
	proc processpbconnect.ProcessClient
}

func activate(t *testing.T, ctx context.Context, inst substrate.Instance, r identity.Route) *agentSession {
	t.Helper()
	return activateWith(t, ctx, inst, r, nil)
}

// activateWith is activate with more fields of the agent's configuration
// in the activation message.
func activateWith(t *testing.T, ctx context.Context, inst substrate.Instance, r identity.Route, extra map[string]any) *agentSession {
	t.Helper()
	conn, err := net.Dial("unix", inst.GuestSocket())
	if err != nil {
		t.Fatal(err)
	}
	// As spaced-host sends it: fresh host entropy with every activation.
	entropy := make([]byte, 64)
	rand.Read(entropy)
	msg := map[string]any{"identity": r, "entropy": entropy}
	for k, v := range extra {
		msg[k] = v
	}
	act, _ := json.Marshal(msg)
	c, err := vmchan.NewClient(ctx, conn, vmchan.ClientConfig{
		Activation: act, BootTimeout: 90 * time.Second, ResendInterval: 500 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatalf("activate: %v; console:\n%s", err, inst.(*instance).consoleTail(3000))
	}
	var got identity.Route
	if err := json.Unmarshal(c.Ack(), &got); err != nil || got != r {
		t.Fatalf("guest ACKed identity %s (%v), want %+v", c.Ack(), err, r)
	}
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) { return c.Open(ctx) }}
	s := &agentSession{c: c, tr: tr, proc: processpbconnect.NewProcessClient(&http.Client{Transport: tr}, "http://guest", connect.WithProtoJSON())}
	t.Cleanup(s.close)
	return s
}

func (s *agentSession) close() {
	s.tr.CloseIdleConnections()
	s.c.Close()
}

// run runs cmd as the e2b SDK does (/bin/bash -l -c, default user) and
// returns its stdout.
func (s *agentSession) run(t *testing.T, ctx context.Context, cmd string) string {
	t.Helper()
	st, err := s.proc.Start(ctx, connect.NewRequest(&processpb.StartRequest{
		Process: &processpb.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-l", "-c", cmd}},
	}))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	var out, errOut strings.Builder
	var end *processpb.ProcessEvent_EndEvent
	for st.Receive() {
		ev := st.Msg().GetEvent()
		if d := ev.GetData(); d != nil {
			out.Write(d.GetStdout())
			errOut.Write(d.GetStderr())
		}
		if e := ev.GetEnd(); e != nil {
			end = e
		}
	}
	if err := st.Err(); err != nil {
		t.Fatalf("%q: %v", cmd, err)
	}
	if end == nil || end.GetExitCode() != 0 {
		t.Fatalf("%q: end %v, stdout %q, stderr %q", cmd, end, out.String(), errOut.String())
	}
	return out.String()
}

// TestAgentKeepsFilesAndProcessesAcrossRestore runs the real spaced-guest
// (VM mode) as the guest's pid 1: activation over the channel, a command
// the way the e2b SDK runs it, then a file and a background process that
// are still there after SaveState and a restore in another activation.
func TestAgentKeepsFilesAndProcessesAcrossRestore(t *testing.T) {
	s, agent, ctx := agentSubstrate(t)
	t0 := time.Now()
	_, img, err := s.ensureImage(agent)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(img); err == nil {
		t.Logf("image with the agent: %.1f MiB, built in %s", float64(fi.Size())/(1<<20), time.Since(t0).Round(time.Millisecond))
	}
	base := t.TempDir()
	r1 := testRoute("b1")
	t0 = time.Now()
	inst, err := s.Start(ctx, substrate.Spec{Route: r1, Template: "base", Dir: filepath.Join(base, "b1"), AgentPath: agent})
	if err != nil {
		t.Fatal(err)
	}
	defer inst.Stop(context.Background())
	a := activate(t, ctx, inst, r1)
	t.Logf("agent booted and activated (ACK) %s after Start began", time.Since(t0).Round(time.Millisecond))

	out := a.run(t, ctx, `echo $((6*7)) > ~/answer; cat ~/answer; whoami; echo $$ > /dev/null
		setsid sh -c 'while :; do sleep 1; done' </dev/null >/dev/null 2>&1 & echo $!`)
	f := strings.Fields(out)
	if len(f) != 3 || f[0] != "42" || f[1] != "user" {
		t.Fatalf("first command printed %q", out)
	}
	bgPID := f[2]
	// Running, not a zombie (kill -0 succeeds on a zombie until it is
	// reaped): Debian's busybox has no nohup, and a command that does not
	// exist passed this test while its zombie waited for the reaper.
	alive := "grep -q '^State:[[:space:]]*[RS]' /proc/" + bgPID + "/status && echo alive"
	if out := a.run(t, ctx, alive); out != "alive\n" {
		t.Fatalf("background process %s before the pause: %q", bgPID, out)
	}

	if err := inst.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	state := filepath.Join(base, "state")
	sf, err := os.Create(state)
	if err != nil {
		t.Fatal(err)
	}
	t0 = time.Now()
	n, err := inst.(substrate.StateSaver).SaveState(ctx, sf)
	if err != nil {
		t.Fatal(err)
	}
	sf.Close()
	t.Logf("SaveState with the agent: %.1f MiB in %s", float64(n)/(1<<20), time.Since(t0).Round(time.Millisecond))
	a.close()
	if err := inst.Stop(ctx); err != nil {
		t.Fatal(err)
	}

	r2 := r1
	r2.Generation, r2.ExecutionID, r2.ActivationID = 2, "exec2", "b2"
	t0 = time.Now()
	inst2, err := s.Start(ctx, substrate.Spec{Route: r2, Template: "base", Dir: filepath.Join(base, "b2"), AgentPath: agent, RestoreState: state})
	if err != nil {
		t.Fatal(err)
	}
	defer inst2.Stop(context.Background())
	a2 := activate(t, ctx, inst2, r2)
	t.Logf("restored agent re-activated %s after Start began", time.Since(t0).Round(time.Millisecond))
	if out := a2.run(t, ctx, "cat ~/answer; "+alive); out != "42\nalive\n" {
		t.Fatalf("after restore: %q", out)
	}
	if err := inst2.Stop(ctx); err != nil {
		t.Fatal(err)
	}
}

// buildAgent builds spaced-guest (static) into a temporary directory.
func buildAgent(t *testing.T) string {
	t.Helper()
	agent := filepath.Join(t.TempDir(), "spaced-guest")
	build := exec.Command("go", "build", "-trimpath", "-o", agent, "./cmd/spaced-guest")
	build.Dir = repoRoot(t)
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build spaced-guest: %v\n%s", err, out)
	}
	return agent
}

// agentSubstrate is a substrate (templates on) for tests with the real
// agent, the agent it runs and a context bounding the test; both are
// closed when the test ends.
func agentSubstrate(t *testing.T) (*Substrate, string, context.Context) {
	t.Helper()
	cfg := testConfig(t)
	cfg.testMode, cfg.NoTemplates = "", false
	agent := buildAgent(t)
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	t.Cleanup(cancel)
	return s, agent, ctx
}
