package testenv

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestAPIKey is the bootstrap API key platforms started here get unless
// PlatformOptions.APIKey says otherwise.
const TestAPIKey = "e2b_5ace5ace5ace5ace5ace5ace5ace5ace5ace5ace"

// PlatformOptions configure a `space up` started from the built binaries.
// Zero fields are the defaults.
type PlatformOptions struct {
	// Workers is --workers. Default 1.
	Workers int
	// ExternalWorkers starts space up with --workers 0: its workers are
	// space-node processes the test starts (LaunchNode), each of which
	// can crash on its own.
	ExternalWorkers bool
	// APIKey is --api-key. Default TestAPIKey.
	APIKey string
	// LogLevel is --log-level. Default warn.
	LogLevel string
	// Args are more `space up` flags.
	Args []string
	// BinDir holds the binaries to run. Default: BinDir().
	BinDir string
	// KeepSandboxes is --keep-sandboxes: Stop leaves the sandboxes
	// running for the next LaunchPlatform on Dir to re-adopt. Default
	// false, so a test's sandboxes end with its platform (after Kill, a
	// crash, they run on until a platform on Dir stops them).
	KeepSandboxes bool
	// Dir holds the data dir (Dir/data) and the log (Dir/space-up.log);
	// Stop removes it after a clean exit. Default: a new temp dir.
	Dir string
	// Env is space up's environment. Default: this process's.
	Env []string
	// Stdin, ExtraFiles and SysProcAttr are exec.Cmd's (a test's terminal
	// and descriptors space up inherits). Default: none.
	Stdin       *os.File
	ExtraFiles  []*os.File
	SysProcAttr *syscall.SysProcAttr
	// ReadyTimeout bounds waiting for the banner. Default 90s.
	ReadyTimeout time.Duration
}

func (o PlatformOptions) withDefaults() PlatformOptions {
	if o.Workers == 0 {
		o.Workers = 1
	}
	if o.APIKey == "" {
		o.APIKey = TestAPIKey
	}
	if o.LogLevel == "" {
		o.LogLevel = "warn"
	}
	if o.ReadyTimeout == 0 {
		o.ReadyTimeout = 90 * time.Second
	}
	return o
}

// Platform is one running `space up`.
type Platform struct {
	// APIURL and SandboxURL are E2B_API_URL and E2B_SANDBOX_URL;
	// APIAddr and EdgeAddr their host:port.
	APIURL, SandboxURL string
	APIAddr, EdgeAddr  string
	APIKey             string
	// EdgeTLSAddr is the edge's HTTPS address (--edge-tls-addr), CAFile
	// the local CA its certificates come from (NODE_EXTRA_CA_CERTS in
	// Env).
	EdgeTLSAddr, CAFile string
	// BinDir holds the binaries it runs from; Dir, DataDir and LogPath
	// are its files (see PlatformOptions.Dir).
	BinDir, Dir, DataDir, LogPath string
	// Banner is what space up printed on stdout once ready.
	Banner string
	// Cmd is the running space up.
	Cmd *exec.Cmd
	// EtcdEndpoints and SnapshotDir are what a space-node joining p
	// names (ExternalWorkers only: empty otherwise).
	EtcdEndpoints, SnapshotDir string

	cancel  context.CancelFunc
	cleanup func()
	stopped bool
	stopErr error
	// keep: its sandboxes outlive it, so Stop keeps Dir (their data).
	keep bool
}

// StartPlatform starts `space up` (RequirePlatform's tier) and stops it
// when t ends: a non-zero exit after the interrupt fails t, and a failed
// t gets space up's log.
func StartPlatform(t testing.TB, o PlatformOptions) *Platform {
	t.Helper()
	RequirePlatform(t)
	p, err := LaunchPlatform(o)
	if err != nil {
		t.Fatalf("starting space up: %v", err)
	}
	t.Cleanup(func() {
		log := p.Log()
		if err := p.Stop(); err != nil {
			t.Errorf("%v", err)
		}
		if t.Failed() {
			t.Logf("space up log:\n%s", log)
		}
	})
	return p
}

// RequirePlatform skips t unless it may start a platform: root, and not
// the unit tier (-short).
func RequirePlatform(t testing.TB) {
	t.Helper()
	const why = "space up runs namespaces, cgroups, mounts and embedded etcd"
	if Short() {
		Skipf(t, "platform tier, skipped by -short; needs root and the binaries: %s", why)
	}
	if !IsRoot() {
		Skipf(t, "platform tier; needs root: %s", why)
	}
}

// LaunchPlatform starts `space up` from BinDir's binaries and waits for
// its banner; the caller Stops it (a suite's shared platform, stopped in
// TestMain). Callers check the tier first (RequirePlatform).
func LaunchPlatform(o PlatformOptions) (_ *Platform, err error) {
	o = o.withDefaults()
	bin, cleanup, err := o.BinDir, func() {}, error(nil)
	if bin == "" {
		if bin, cleanup, err = BinDir(); err != nil {
			return nil, err
		}
	}
	p := &Platform{BinDir: bin, APIKey: o.APIKey, Dir: o.Dir, cleanup: cleanup, keep: o.KeepSandboxes}
	defer func() {
		if err != nil && p.Cmd == nil {
			p.cleanup()
		}
	}()
	if p.Dir == "" {
		if p.Dir, err = os.MkdirTemp("", "space-platform-"); err != nil {
			return nil, err
		}
	}
	p.DataDir, p.LogPath = filepath.Join(p.Dir, "data"), filepath.Join(p.Dir, "space-up.log")
	if p.APIAddr, err = freeAddr(); err != nil {
		return nil, err
	}
	if p.EdgeAddr, err = freeAddr(); err != nil {
		return nil, err
	}
	if p.EdgeTLSAddr, err = freeAddr(); err != nil {
		return nil, err
	}
	p.APIURL, p.SandboxURL = "http://"+p.APIAddr, "http://"+p.EdgeAddr
	p.CAFile = filepath.Join(p.DataDir, "tls", "ca.pem")
	logf, err := os.Create(p.LogPath)
	if err != nil {
		return nil, err
	}
	defer logf.Close() // space up holds its own descriptor
	ctx, cancel := context.WithCancel(context.Background())
	p.cancel = cancel
	workers, readyLine := o.Workers, "export E2B_API_KEY="
	if o.ExternalWorkers {
		workers, readyLine = 0, "  space-node " // printed after the key
	}
	args := append([]string{"up", "--api-addr", p.APIAddr, "--edge-addr", p.EdgeAddr, "--edge-tls-addr", p.EdgeTLSAddr, "--data-dir", p.DataDir,
		"--api-metrics-addr", "127.0.0.1:0", "--edge-metrics-addr", "127.0.0.1:0", "--node-metrics-addr", "127.0.0.1:0", // parallel platforms: no fixed ports
		"--api-key", o.APIKey, "--workers", strconv.Itoa(workers), "--log-level", o.LogLevel,
		"--keep-sandboxes=" + strconv.FormatBool(o.KeepSandboxes)}, o.Args...)
	cmd := exec.CommandContext(ctx, filepath.Join(bin, "space"), args...)
	cmd.Env, cmd.Stdin, cmd.ExtraFiles, cmd.SysProcAttr = o.Env, o.Stdin, o.ExtraFiles, o.SysProcAttr
	cmd.Stderr = logf
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 20 * time.Second
	out, err := cmd.StdoutPipe()
	if err != nil {
		cancel()
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		cancel()
		return nil, err
	}
	p.Cmd = cmd
	ready := make(chan string, 1)
	go func() { // owned: ends when space up closes its stdout
		sc := bufio.NewScanner(out)
		var banner strings.Builder
		for sc.Scan() {
			banner.WriteString(sc.Text() + "\n")
			if strings.HasPrefix(sc.Text(), readyLine) {
				ready <- banner.String()
			}
		}
		close(ready)
	}()
	select {
	case b, ok := <-ready:
		if !ok {
			log := p.Log() // before Stop, which removes it after a clean exit
			p.Stop()
			return nil, fmt.Errorf("space up exited before it was ready:\n%s", log)
		}
		p.Banner = b
		if o.ExternalWorkers {
			p.EtcdEndpoints, p.SnapshotDir = parseJoin(b)
		}
	case <-time.After(o.ReadyTimeout):
		p.Stop()
		return nil, fmt.Errorf("space up not ready after %v", o.ReadyTimeout)
	}
	return p, nil
}

// Log is space up's log (stderr) so far.
func (p *Platform) Log() string {
	b, _ := os.ReadFile(p.LogPath)
	return string(b)
}

// Env is os.Environ() plus what the e2b SDK and the space CLI need to
// reach p.
func (p *Platform) Env() []string {
	env := append(os.Environ(), "E2B_API_URL="+p.APIURL, "E2B_SANDBOX_URL="+p.SandboxURL, "E2B_API_KEY="+p.APIKey,
		"SPACE_API_URL="+p.APIURL, "SPACE_SANDBOX_URL="+p.SandboxURL, "SPACE_API_KEY="+p.APIKey)
	if _, err := os.Stat(p.CAFile); err == nil { // not with --edge-tls-addr= (no HTTPS)
		env = append(env, "NODE_EXTRA_CA_CERTS="+p.CAFile)
	}
	return env
}

// Stop interrupts space up and waits for it. A non-zero exit is an error
// (and Dir stays for its log); after a clean exit Dir is removed, unless
// the sandboxes outlive the platform (KeepSandboxes: the next platform on
// Dir adopts them). Stop is idempotent.
func (p *Platform) Stop() error {
	if p.stopped {
		return p.stopErr
	}
	p.stopped = true
	p.cancel()
	err := p.Cmd.Wait() // reports the cancellation itself; the exit status tells how it ended
	if code := p.Cmd.ProcessState.ExitCode(); code != 0 {
		p.stopErr = fmt.Errorf("space up exited with %d after SIGINT (%v); log %s", code, err, p.LogPath)
	} else if !p.keep {
		os.RemoveAll(p.Dir)
	}
	p.cleanup()
	return p.stopErr
}

// Kill ends space up with SIGKILL, a crash (nothing shuts down), waits
// for it and keeps Dir: a new LaunchPlatform with the same Dir restarts it
// on the same data. Stop after Kill does nothing.
func (p *Platform) Kill() error {
	if p.stopped {
		return p.stopErr
	}
	p.stopped = true
	err := p.Cmd.Process.Kill()
	_ = p.Cmd.Wait() // reports the kill itself
	p.cancel()
	p.cleanup()
	return err
}

func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// BinDir returns the directory of the built binaries: $SPACE_BIN_DIR
// (make test sets it) or, without it, a fresh build of every command into
// a temp dir that cleanup removes.
func BinDir() (dir string, cleanup func(), err error) {
	if d := os.Getenv("SPACE_BIN_DIR"); d != "" {
		return d, func() {}, nil
	}
	d, err := os.MkdirTemp("", "space-test-bin-")
	if err != nil {
		return "", nil, err
	}
	cleanup = func() { os.RemoveAll(d) }
	if err := Build(d); err != nil {
		cleanup()
		return "", nil, err
	}
	return d, cleanup, nil
}

// Build builds the commands `make build` builds into dir (spaced-guest
// static, as it runs inside sandboxes).
func Build(dir string) error {
	const mod = "github.com/spacesbx/space/cmd/"
	args := []string{"build", "-o", dir + "/"}
	for _, c := range []string{"space", "space-api", "space-edge", "space-node", "spaced-host", "netgtw", "space-nsinit"} {
		args = append(args, mod+c)
	}
	for _, c := range []struct {
		static bool
		args   []string
	}{
		{false, args},
		{true, []string{"build", "-trimpath", "-ldflags=-s -w", "-o", filepath.Join(dir, "spaced-guest"), mod + "spaced-guest"}},
	} {
		cmd := exec.Command("go", c.args...)
		cmd.Env = os.Environ()
		if c.static {
			cmd.Env = append(cmd.Env, "CGO_ENABLED=0")
		}
		if out, err := cmd.CombinedOutput(); err != nil {
			return errors.Join(fmt.Errorf("go %s: %w", strings.Join(c.args, " "), err), errors.New(string(out)))
		}
	}
	return nil
}

// RequireBinDir returns $SPACE_BIN_DIR (make build's bin/, which make test
// sets), or skips t: for tests that run the built binaries but build
// none themselves.
func RequireBinDir(t testing.TB) string {
	t.Helper()
	d := os.Getenv("SPACE_BIN_DIR")
	if d == "" {
		Skipf(t, "needs the built binaries: SPACE_BIN_DIR=$PWD/bin after make build")
	}
	return d
}

// WaitExit waits up to d for space up to end by itself (a crash test's
// armed point kills it) and keeps Dir, as Kill does. It returns how space
// up ended; when it is still running after d, it is killed and the error
// says so. Stop after WaitExit does nothing.
func (p *Platform) WaitExit(d time.Duration) (*os.ProcessState, error) {
	if p.stopped {
		return p.Cmd.ProcessState, p.stopErr
	}
	p.stopped = true
	defer p.cleanup()
	defer p.cancel()
	done := make(chan struct{})
	go func() { // owned: ends when space up does (it is killed below otherwise)
		_ = p.Cmd.Wait()
		close(done)
	}()
	select {
	case <-done:
		return p.Cmd.ProcessState, nil
	case <-time.After(d):
		_ = p.Cmd.Process.Kill()
		<-done
		return p.Cmd.ProcessState, fmt.Errorf("space up still ran %v later; killed", d)
	}
}
