package sbxmanager

// spaced-host supervision: one bridge process per activation, launched
// (and recorded) while its sandbox starts, handed the sandbox once it
// runs, and stopped with the activation. netgtw, the other host process,
// is started on demand (gateway.go).

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/logsetup"
	"github.com/spacesbx/space/internal/procid"
	"github.com/spacesbx/space/internal/procwait"
	"github.com/spacesbx/space/internal/substrate"
)

// bridgeProc is a spaced-host launched ahead of its sandbox: recorded
// at launch, it waits for its arguments on stdin (--args-from-stdin).
type bridgeProc struct {
	cmd      *exec.Cmd
	hh       *procid.Handle
	stdin    io.WriteCloser
	ready    chan error
	hostDone chan struct{}
}

// launchBridge starts spaced-host for the activation in dir and records
// it; startBridge hands it its sandbox.
func (m *Manager) launchBridge(dir string) (*bridgeProc, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("bridge: %w", err)
	}
	logPath := filepath.Join(dir, "spaced-host.log")
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("bridge log: %w", err)
	}
	defer logf.Close()
	cmd := exec.Command(m.cfg.SpacedHostPath, "--args-from-stdin")
	cmd.Stderr = logf
	cmd.Env = append([]string{"GOMAXPROCS=1", "GOGC=50"}, logsetup.Env(m.cfg.ChildLog)...)
	cmd.Env = append(cmd.Env, m.cfg.ChildEnv...)
	// No parent-death signal: a bridge outlives its worker, like its
	// sandbox, and the next worker takes it over (adopt.go). One that is
	// never handed a sandbox exits when its stdin closes.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, fmt.Errorf("bridge: %w", err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		stdin.Close()
		return nil, fmt.Errorf("bridge: %w", err)
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start spaced-host: %w", err)
	}
	// Record the bridge before anything can reap it, so its pid cannot have
	// been reused: pid, start time, executable (device+inode, SHA-256) and
	// a pidfd that keeps naming this very process.
	hh, err := procid.Open(cmd.Process.Pid)
	if err != nil {
		cmd.Process.Kill()
		stdin.Close()
		procwait.Wait(cmd)
		return nil, fmt.Errorf("spaced-host identity: %w", err)
	}
	bp := &bridgeProc{cmd: cmd, hh: hh, stdin: stdin, ready: make(chan error, 1), hostDone: make(chan struct{})}
	go func() { procwait.Wait(cmd); hh.Close(); close(bp.hostDone) }()
	go func() {
		line, err := bufio.NewReader(stdout).ReadString('\n')
		// spaced-host writes nothing after its ready line: one
		// descriptor less per sandbox held here (RLIMIT_NOFILE).
		stdout.Close()
		if err != nil || line != "spaced-host ready\n" {
			bp.ready <- fmt.Errorf("spaced-host did not become ready (see %s): %v", logPath, err)
			return
		}
		bp.ready <- nil
	}()
	return bp, nil
}

// kill stops a launched spaced-host and waits until it is reaped.
func (bp *bridgeProc) kill() {
	bp.cmd.Process.Kill()
	bp.stdin.Close()
	<-bp.hostDone
}

// startBridge hands inst to the spaced-host bp and waits until it has
// verified the guest and listens.
func (m *Manager) startBridge(ctx context.Context, bp *bridgeProc, inst substrate.Instance, dir string, caps substrate.Capabilities) (*activation, error) {
	r := inst.Route()
	sock := filepath.Join(dir, "host.sock")
	want, _ := json.Marshal(r)
	args := []string{"--guest-socket", inst.GuestSocket(), "--guest-pid", strconv.Itoa(inst.InitPID()),
		"--listen", sock, "--expected", string(want), "--manager-pid", strconv.Itoa(os.Getpid()),
		"--manager-file", m.managerFile()}
	if !caps.Activation {
		// The agent's executable was hashed here before (once per binary):
		// spaced-host records the agent without reading it again, unless
		// the agent's executable is not exactly that file, unchanged.
		if stmt, err := procid.ExeHash(m.cfg.AgentPath); err == nil {
			args = append(args, "--guest-exe-hash", stmt)
		}
	} else {
		// One verified connection to QEMU's chardev socket, multiplexed;
		// the guest is (re)activated with the activation file first.
		args = append(args, "--channel", "vmchan", "--activation-file", filepath.Join(dir, activationFile),
			"--boot-timeout", m.cfg.StartTimeout.String())
	}
	fail := func(err error) (*activation, error) {
		bp.kill()
		return nil, err
	}
	line, _ := json.Marshal(args)
	_, err := bp.stdin.Write(append(line, '\n'))
	bp.stdin.Close()
	if err != nil {
		return fail(fmt.Errorf("spaced-host arguments: %w", err))
	}
	select {
	case err := <-bp.ready:
		if err != nil {
			return fail(err)
		}
	case <-ctx.Done():
		return fail(fmt.Errorf("spaced-host: %w", ctx.Err()))
	}
	if err := bp.hh.Check(); err != nil {
		return fail(fmt.Errorf("spaced-host identity: %w", err))
	}
	return m.newActivation(inst, bp.hh, bp.hostDone, sock), nil
}

// newActivation serves inst through the spaced-host hh listening on sock.
func (m *Manager) newActivation(inst substrate.Instance, hh *procid.Handle, hostDone <-chan struct{}, sock string) *activation {
	r := inst.Route()
	actx, cancel := context.WithCancel(context.Background())
	a := &activation{route: r, inst: inst, host: hh, hostProc: hh.Process(), hostSock: sock, ctx: actx, cancel: cancel, hostDone: hostDone}
	// Per connection, never per request: the bridge must be the process
	// this manager launched, still alive and unchanged.
	tr, rt := newBridgeTransport(sock, func(c net.Conn) error {
		if err := hh.VerifyPeer(c); err != nil {
			m.metrics.bridgeRejects.Inc()
			m.metrics.bridgeChecks.WithLabelValues("rejected").Inc()
			m.log.Warn("bridge endpoint verification failed", "sandbox", r.SandboxID, "err", err)
			return err
		}
		m.metrics.bridgeChecks.WithLabelValues("ok").Inc()
		return nil
	})
	a.tr = tr
	a.proxy = &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme, pr.Out.URL.Host = "http", "spaced-host"
			pr.Out.Header.Del(spacev1.HeaderCapability)
		},
		Transport:     rt,
		FlushInterval: -1,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			m.writeError(w, m.unreachable("sandbox bridge", r, err))
		},
	}
	return a
}

// stopHost ends the activation's spaced-host: SIGTERM, then SIGKILL
// after 3 s, and waits until it has exited.
func (a *activation) stopHost() {
	select {
	case <-a.hostDone:
		return
	default:
	}
	_ = a.host.Signal(syscall.SIGTERM)
	select {
	case <-a.hostDone:
	case <-time.After(3 * time.Second):
		_ = a.host.Signal(syscall.SIGKILL)
		<-a.hostDone
	}
}
