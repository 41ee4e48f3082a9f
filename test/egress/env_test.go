package egress

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/netsim"
	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/sdk"
)

// The simulated internet's names. Hosts 0..2 serve; the others point at
// addresses no policy may reach (DNS rebinding).
const (
	nameAllowed = "allowed.test"          // host 0
	nameAPI     = "api.allowed.test"      // host 1
	nameDeep    = "deep.sub.allowed.test" // host 1
	nameDenied  = "denied.test"           // host 2
	nameRebind  = "rebind.test"           // 169.254.169.254 and 127.0.0.1
	namePrivate = "private.test"          // 10.20.30.40
	nameSecret  = "secret.test"           // host 0
	nameOther   = "other.test"            // host 2
)

// world is the suite's shared simulated internet and platform.
type world struct {
	inet   *netsim.Internet
	plat   *testenv.Platform
	client *sdk.Client
	caFile string // the simulated internet's CA, as a file
	dir    string
}

var (
	worldOnce sync.Once
	shared    *world
	worldErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if shared != nil {
		if code != 0 {
			fmt.Fprintf(os.Stderr, "space up log (tail):\n%s\n", tail(shared.plat.Log(), 64<<10))
		}
		if err := shared.close(); err != nil {
			fmt.Fprintln(os.Stderr, "egress:", err)
			if code == 0 {
				code = 1
			}
		}
	}
	os.Exit(code)
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// getWorld starts the simulated internet and a `space up` whose workers
// use it as their upstream (DNS and trusted CA), once for the suite.
func getWorld(t *testing.T) *world {
	t.Helper()
	testenv.RequirePlatform(t)
	worldOnce.Do(func() { shared, worldErr = startWorld() })
	if worldErr != nil {
		t.Fatal(worldErr)
	}
	return shared
}

func startWorld() (_ *world, err error) {
	w := &world{}
	defer func() {
		if err != nil {
			w.close()
		}
	}()
	w.inet, err = netsim.Start(netsim.Options{Hosts: 3})
	if err != nil {
		return nil, fmt.Errorf("simulated internet: %w", err)
	}
	h := w.inet.Host
	zone := map[string][]netip.Addr{
		nameAllowed: {h(0)}, nameAPI: {h(1)}, nameDeep: {h(1)}, nameDenied: {h(2)},
		nameRebind:  {netip.MustParseAddr("169.254.169.254"), netip.MustParseAddr("127.0.0.1")},
		namePrivate: {netip.MustParseAddr("10.20.30.40")}, nameSecret: {h(0)}, nameOther: {h(2)},
	}
	for name, addrs := range zone {
		if err := w.inet.SetZone(name, addrs...); err != nil {
			return nil, err
		}
	}
	if w.dir, err = os.MkdirTemp("", "egress-suite-"); err != nil {
		return nil, err
	}
	w.caFile = filepath.Join(w.dir, "inet-ca.pem")
	if err := os.WriteFile(w.caFile, w.inet.CAPEM(), 0o644); err != nil {
		return nil, err
	}
	w.plat, err = testenv.LaunchPlatform(testenv.PlatformOptions{
		Workers: 2, LogLevel: "info",
		Args: []string{"--egress=deny", "--egress-dns=" + w.inet.DNS().String(), "--egress-upstream-ca=" + w.caFile},
	})
	if err != nil {
		return nil, err
	}
	w.client, err = sdk.New(sdk.Config{APIURL: w.plat.APIURL, SandboxURL: w.plat.SandboxURL, APIKey: w.plat.APIKey})
	if err != nil {
		return nil, err
	}
	return w, nil
}

func (w *world) close() error {
	var errs []error
	if w.plat != nil {
		errs = append(errs, w.plat.Stop())
	}
	if w.inet != nil {
		errs = append(errs, w.inet.Close())
	}
	if w.dir != "" {
		os.RemoveAll(w.dir)
	}
	return errors.Join(errs...)
}

// sandbox is a sandbox the test kills at its end.
type sandbox struct {
	*sdk.Sandbox
	w *world
}

func (w *world) sandbox(t *testing.T, o sdk.CreateOptions) *sandbox {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	if o.Timeout == 0 {
		o.Timeout = 10 * time.Minute
	}
	s, err := w.client.CreateSandbox(ctx, o)
	if err != nil {
		t.Fatalf("create sandbox: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		if err := s.Kill(ctx); err != nil && !errors.Is(err, sdk.ErrNotFound) {
			t.Errorf("kill sandbox %s: %v", s.ID, err)
		}
	})
	sb := &sandbox{s, w}
	// The test servers' CA, for HTTPS that is not intercepted.
	if _, err := s.WriteFile(ctx, "/tmp/inet-ca.pem", w.inet.CAPEM()); err != nil {
		t.Fatalf("upload CA: %v", err)
	}
	return sb
}

// result is a finished command.
type result struct {
	out  string
	code int
	err  error
}

func (r result) ok() bool { return r.err == nil && r.code == 0 }

// sh runs a shell command line as root in the sandbox.
func (s *sandbox) sh(t *testing.T, cmd string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var out bytes.Buffer
	var mu sync.Mutex
	wr := writerFunc(func(b []byte) (int, error) { mu.Lock(); defer mu.Unlock(); return out.Write(b) })
	code, err := s.Exec(ctx, []string{"/bin/bash", "-c", cmd}, sdk.RunOptions{User: "root", Stdout: wr, Stderr: wr})
	mu.Lock()
	defer mu.Unlock()
	return result{out.String(), code, err}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(b []byte) (int, error) { return f(b) }

// curl fetches url from inside the sandbox (5 s budget); extra are more
// curl arguments. It returns the body and whether curl succeeded.
func (s *sandbox) curl(t *testing.T, url string, extra ...string) result {
	t.Helper()
	args := []string{"curl", "-sS", "--max-time", "5", "--cacert", "/tmp/inet-ca.pem"}
	args = append(args, extra...)
	args = append(args, url)
	return s.sh(t, shellJoin(args))
}

func shellJoin(args []string) string {
	var b strings.Builder
	for i, a := range args {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString("'" + strings.ReplaceAll(a, "'", `'\''`) + "'")
	}
	return b.String()
}

// mustReach fails t unless url answers from inside s.
func (s *sandbox) mustReach(t *testing.T, url string, extra ...string) string {
	t.Helper()
	r := s.curl(t, url, extra...)
	if !r.ok() {
		t.Fatalf("%s: want reachable, got exit %d %v:\n%s", url, r.code, r.err, r.out)
	}
	return r.out
}

// mustNotReach fails t if url answers from inside s.
func (s *sandbox) mustNotReach(t *testing.T, url string, extra ...string) {
	t.Helper()
	r := s.curl(t, url, extra...)
	if r.ok() {
		t.Fatalf("%s: want unreachable, got an answer:\n%s", url, r.out)
	}
}

// resolves reports whether name resolves inside s (the sandbox's only
// resolver is the platform's).
func (s *sandbox) resolves(t *testing.T, name string) (bool, string) {
	t.Helper()
	r := s.sh(t, "getent ahostsv4 "+name)
	return r.ok() && strings.TrimSpace(r.out) != "", r.out
}

func ptr[T any](v T) *T { return &v }
