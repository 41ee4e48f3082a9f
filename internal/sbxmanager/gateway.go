package sbxmanager

// Service ports: one netgtw per activation (DESIGN.md section 9), started
// on the activation's first service-port request.
//
// node-api hands service-port requests (E2b-Sandbox-Port set by the edge to
// a port other than the guest agent's) to the manager like any other guest
// request. The manager admits them first (service-port capability for this
// port and protocol, identity equal to the installed record) and then asks
// the activation's netgtw, over its Unix socket (peer verified per
// connection), for a guest connection; netgtw checks the capability a
// second time against the trusted activation state this file handed it,
// dials the port inside the sandbox's network namespace and passes the
// connected socket back (gateway's dial protocol). The manager forwards on
// that socket itself, one guest connection per request, never pooled: so
// no byte crosses netgtw, and every guest connection was admitted twice
// for the request it carries. netgtw keeps a handle on each socket and
// shuts it down when the execution is replaced.
//
// Lazily: most sandboxes never serve a port, and an idle netgtw is a
// process and several threads per sandbox (every one counts against the
// host's kernel.pid_max). At activation the manager records the trusted
// state netgtw will be given (the route, the sandbox init's pid and start
// time and its network namespace's inode, read right after the substrate
// started the instance); the first admitted service-port request starts
// netgtw with exactly that state, and netgtw runs the same start-time
// checks against it (init start time and namespace inode, so a pid reused
// since activation is refused). SetGatewayActivation before that start
// updates the recorded route under the gateway's own rules (same epoch:
// the new activation; another execution: retired, nothing is served).
// Stopping the activation ends the streams and netgtw exactly as before,
// and a netgtw whose start races the stop is stopped by it.
//
// A microVM has no namespace on the host: its guest serves its ports on
// its address on its tap, which lives in the worker's egress namespace.
// Its netgtw enters that namespace (bind mount path and inode recorded at
// activation) and dials the VM's address, which sbx-manager allocated.

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/gateway"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/logsetup"
	"github.com/spacesbx/space/internal/procid"
	"github.com/spacesbx/space/internal/procwait"
	"github.com/spacesbx/space/internal/substrate"
)

// gatewayProc is one activation's running netgtw.
type gatewayProc struct {
	cmd  *exec.Cmd
	proc procid.Process
	sock string
	done chan struct{}

	ctlMu sync.Mutex
	ctl   io.WriteCloser
	out   *bufio.Reader
}

// gatewayState is an activation's service-port gateway: the trusted
// state recorded at activation and, once started, the netgtw process.
type gatewayState struct {
	dir string
	// initPID, initStart and netnsIno are recorded at activation.
	initPID   int
	initStart uint64
	netnsIno  uint64
	// netnsPath and dialAddr, for a microVM (no namespace of its own):
	// the worker's egress namespace, where its tap is, and the VM's
	// address on that link; netnsIno is then the egress namespace's.
	netnsPath string
	dialAddr  netip.Addr

	mu sync.Mutex
	// route is the trusted activation state netgtw starts with (and that
	// SetGatewayActivation updates until it runs).
	route   identity.Route
	retired bool // a route of another execution arrived before the start
	stopped bool // the activation is stopping: never start netgtw again
	proc    *gatewayProc
}

// errGatewayRetired: the activation's gateway was retired before it ever
// started (it would answer RefreshRoute to everything).
var errGatewayRetired = fmt.Errorf("%w: service-port gateway retired", errdefs.ErrConflict)

// recordGateway records the trusted state a later netgtw start of inst
// gets: the route, and the init's start time and network namespace read
// now, right after the substrate started it.
func recordGateway(inst substrate.Instance, dir string) (*gatewayState, error) {
	_, ino, start, err := gateway.NetnsIdentity(inst.InitPID())
	if err != nil {
		return nil, fmt.Errorf("netgtw: record sandbox netns: %w", err)
	}
	return &gatewayState{dir: dir, initPID: inst.InitPID(), initStart: start, netnsIno: ino, route: inst.Route()}, nil
}

// tapNetns is implemented by an Egress whose namespace holds the taps of
// microVMs (internal/node's): their service ports are dialed there.
type tapNetns interface{ NetnsPath() string }

// recordTapGateway records the trusted state of a microVM's netgtw: the
// egress namespace (its inode now) and the VM's address on link l, which
// sbx-manager allocated (a guest cannot move it: its link is a /30 of
// its own).
func (m *Manager) recordTapGateway(inst substrate.Instance, dir string, l *Link) (*gatewayState, error) {
	tn, ok := m.egress.(tapNetns)
	if !ok || l == nil || !l.Addr.IsValid() {
		return nil, nil
	}
	path := tn.NetnsPath()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return nil, fmt.Errorf("netgtw: record egress netns: %w", err)
	}
	return &gatewayState{dir: dir, netnsIno: st.Ino, netnsPath: path, dialAddr: l.Addr.Addr(), route: inst.Route()}, nil
}

// gateway returns act's netgtw, starting it on first use. (nil, nil): no
// netgtw is installed.
func (m *Manager) gateway(act *activation) (*gatewayProc, error) {
	gs := act.gwState
	if gs == nil {
		return nil, nil
	}
	gs.mu.Lock()
	defer gs.mu.Unlock()
	switch {
	case gs.proc != nil:
		return gs.proc, nil
	case gs.stopped:
		return nil, fmt.Errorf("%w: activation stopping", errdefs.ErrUnavailable)
	case gs.retired:
		return nil, errGatewayRetired
	}
	// Bounded by the activation: stopping it aborts a start in progress.
	ctx, cancel := context.WithTimeout(act.ctx, m.cfg.StartTimeout)
	defer cancel()
	t0 := time.Now()
	g, err := m.startGateway(ctx, gs)
	if err != nil {
		m.log.Warn("netgtw start failed", "sandbox", gs.route.SandboxID, "err", err)
		return nil, err
	}
	if g != nil {
		m.log.Debug("netgtw started on first service-port request", "sandbox", gs.route.SandboxID, "took", time.Since(t0))
	}
	gs.proc = g
	return g, nil
}

// stopGateway marks act's gateway stopped (no later start) and stops a
// running netgtw: its streams end at once.
func (act *activation) stopGateway() {
	gs := act.gwState
	if gs == nil {
		return
	}
	gs.mu.Lock()
	gs.stopped = true
	g := gs.proc
	gs.mu.Unlock()
	if g != nil {
		g.stop()
	}
}

// startGateway launches netgtw with the state recorded in gs (gs.mu
// held). It returns (nil, nil) when no netgtw binary is installed: the
// sandbox then has no service ports (every service-port request is
// answered 503).
func (m *Manager) startGateway(ctx context.Context, gs *gatewayState) (*gatewayProc, error) {
	bin := m.cfg.NetgtwPath
	if _, err := os.Stat(bin); err != nil {
		m.log.Warn("netgtw not installed; service ports unavailable", "path", bin)
		return nil, nil
	}
	r, dir, ino, start := gs.route, gs.dir, gs.netnsIno, gs.initStart
	sock := filepath.Join(dir, "gw.sock")
	want, _ := json.Marshal(r)
	logf, err := os.OpenFile(filepath.Join(dir, "netgtw.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("netgtw log: %w", err)
	}
	defer logf.Close()
	args := []string{"--listen", sock, "--bundle", filepath.Join(m.cfg.StateDir, "bundle.json"),
		"--route", string(want), "--netns-ino", strconv.FormatUint(ino, 10), "--manager-pid", strconv.Itoa(os.Getpid())}
	if gs.netnsPath != "" {
		args = append(args, "--netns-path", gs.netnsPath, "--dial-addr", gs.dialAddr.String())
	} else {
		args = append(args, "--init-pid", strconv.Itoa(gs.initPID), "--init-start", strconv.FormatUint(start, 10))
	}
	cmd := exec.Command(bin, args...)
	cmd.Stderr = logf
	cmd.Env = append([]string{"GOMAXPROCS=1", "GOGC=50"}, logsetup.Env(m.cfg.ChildLog)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, fmt.Errorf("netgtw: %w", err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, fmt.Errorf("netgtw: %w", err)
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start netgtw: %w", err)
	}
	g := &gatewayProc{cmd: cmd, sock: sock, done: make(chan struct{}), ctl: stdin, out: bufio.NewReader(stdout)}
	go func() { procwait.Wait(cmd); close(g.done) }()
	fail := func(err error) (*gatewayProc, error) {
		cmd.Process.Kill()
		stdin.Close()
		<-g.done
		return nil, err
	}
	ready := make(chan error, 1)
	go func() {
		line, err := g.out.ReadString('\n')
		if err != nil || line != gateway.Ready {
			ready <- fmt.Errorf("netgtw did not become ready (see %s): %v", filepath.Join(dir, "netgtw.log"), err)
			return
		}
		ready <- nil
	}()
	select {
	case err := <-ready:
		if err != nil {
			return fail(err)
		}
	case <-ctx.Done():
		return fail(fmt.Errorf("netgtw: %w", ctx.Err()))
	}
	if g.proc, err = procid.Read(cmd.Process.Pid); err != nil {
		return fail(fmt.Errorf("netgtw identity: %w", err))
	}
	return g, nil
}

// proxyBuffers are the copy buffers of the manager's service-port proxies.
var proxyBuffers = gateway.NewBufferPool()

// control sends one control message and waits for netgtw's answer.
func (g *gatewayProc) control(c gateway.Control) (string, error) {
	b, _ := json.Marshal(c)
	g.ctlMu.Lock()
	defer g.ctlMu.Unlock()
	if _, err := g.ctl.Write(append(b, '\n')); err != nil {
		return "", fmt.Errorf("netgtw control: %w", err)
	}
	type res struct {
		line string
		err  error
	}
	ch := make(chan res, 1)
	go func() { l, err := g.out.ReadString('\n'); ch <- res{l, err} }()
	select {
	case r := <-ch:
		if r.err != nil {
			return "", fmt.Errorf("netgtw control: %w", r.err)
		}
		line := strings.TrimSuffix(r.line, "\n")
		if strings.HasPrefix(line, "error: ") {
			return "", errors.New("netgtw: " + strings.TrimPrefix(line, "error: "))
		}
		return line, nil
	case <-time.After(5 * time.Second):
		return "", errors.New("netgtw control: no answer")
	}
}

// stop retires netgtw (its streams end at once) and stops it.
func (g *gatewayProc) stop() {
	g.cmd.Process.Signal(syscall.SIGTERM)
	g.ctl.Close()
	select {
	case <-g.done:
	case <-time.After(3 * time.Second):
		g.cmd.Process.Kill()
		<-g.done
	}
}

// SetGatewayActivation tells the netgtw of sandbox's running activation
// about a new activation attempt over its control channel. Within the same
// identity epoch netgtw keeps its established streams and requires the new
// identity for new opens; a route of another execution makes it end every
// stream and serve nothing more. It is the hook for re-activations that
// keep the instance (and the tests drive it directly).
//
// Before netgtw has started, the same rules apply to the state it will
// start with: a route of another sandbox is refused, one of the same
// epoch becomes the trusted route, one of another execution retires the
// gateway (it will never start; its requests get RefreshRoute).
func (m *Manager) SetGatewayActivation(sandbox string, r identity.Route) (string, error) {
	m.mu.RLock()
	act := m.active[sandbox]
	m.mu.RUnlock()
	if act == nil || act.gwState == nil {
		return "", fmt.Errorf("%w: no service-port gateway for %s", errdefs.ErrNotFound, sandbox)
	}
	gs := act.gwState
	gs.mu.Lock()
	if g := gs.proc; g != nil {
		gs.mu.Unlock()
		return g.control(gateway.Control{Op: gateway.OpActivation, Route: &r})
	}
	defer gs.mu.Unlock()
	if err := r.Validate(); err != nil {
		return "", fmt.Errorf("netgtw: gateway: %w", err)
	}
	if r.SandboxID != gs.route.SandboxID {
		return "", fmt.Errorf("netgtw: gateway: route names sandbox %s, this gateway serves %s", r.SandboxID, gs.route.SandboxID)
	}
	if gs.retired || r.Epoch() != gs.route.Epoch() {
		gs.retired = true
		return "ok retired", nil
	}
	gs.route = r
	return "ok", nil
}

// GatewayPID returns the pid of sandbox's netgtw (tests, measurements);
// false until its first service-port request has started it.
func (m *Manager) GatewayPID(sandbox string) (int, bool) {
	m.mu.RLock()
	a := m.active[sandbox]
	m.mu.RUnlock()
	if a == nil || a.gwState == nil {
		return 0, false
	}
	a.gwState.mu.Lock()
	defer a.gwState.mu.Unlock()
	if a.gwState.proc == nil {
		return 0, false
	}
	return a.gwState.proc.proc.PID, true
}

// isServicePort reports whether r addresses a service port (the edge sets
// E2b-Sandbox-Port on everything it forwards; the guest agent's port and
// its absence mean the guest API).
func isServicePort(r *http.Request) bool {
	p := r.Header.Get(gateway.HeaderSandboxPort)
	return p != "" && p != strconv.Itoa(gateway.EnvdPort)
}

// AdmitServicePort runs the manager's receiver checks on a service-port
// capability for port and protocol, then compares its identity with the
// installed record.
func (m *Manager) AdmitServicePort(token string, port int, protocol string) Admission {
	if m.ver == nil {
		return Admission{Decision: identity.Decision{Outcome: identity.Deny, Reason: "service ports need capability verification"}}
	}
	return m.admit(token, func() (capability.Claims, error) { return m.ver.VerifyServicePort(token, port, protocol) })
}

// serveServicePort admits a service-port request and forwards it to the
// activation's netgtw, which checks it again before dialing the port.
func (m *Manager) serveServicePort(w http.ResponseWriter, r *http.Request) {
	port, err := gateway.ParsePort(r.Header.Get(gateway.HeaderSandboxPort))
	if err != nil {
		m.writeError(w, fmt.Errorf("%w: %v", errdefs.ErrInvalid, err))
		return
	}
	proto := gateway.RequestProtocol(r)
	ad := m.AdmitServicePort(r.Header.Get(spacev1.HeaderCapability), port, proto)
	traceDecision(r.Context(), ad)
	if !m.judge(w, ad, capability.PurposeServicePort, fmt.Sprintf("port %d/%s %s", port, proto, r.URL.Path)) {
		return
	}
	act := ad.act // read with the record it was admitted against
	if act != nil && act.route != ad.Claims.Route {
		writeOutcome(w, http.StatusMisdirectedRequest, spacev1.OutcomeRefreshRoute, "execution replaced")
		return
	}
	if act == nil || act.gwState == nil {
		m.writeError(w, fmt.Errorf("%w: no service-port gateway for %s on this worker", errdefs.ErrUnavailable, ad.Claims.SandboxID))
		return
	}
	if act.awaitingView.Load() {
		m.writeError(w, awaitingViewError(ad.Claims.SandboxID))
		return
	}
	if act.paused.Load() {
		m.writeError(w, pausedError(ad.Claims.SandboxID)) // never into a frozen guest
		return
	}
	ctx, _, release, ok := act.leaseContext(r.Context(), m.fence.epoch())
	if !ok {
		m.refuseEnded(w)
		return
	}
	defer release()
	gw, err := m.gateway(act) // the first request starts it
	switch {
	case errors.Is(err, errGatewayRetired):
		writeOutcome(w, http.StatusMisdirectedRequest, spacev1.OutcomeRefreshRoute, "service-port gateway retired")
		return
	case err != nil:
		m.writeError(w, m.unreachable("service-port gateway", r, err))
		return
	case gw == nil:
		m.writeError(w, fmt.Errorf("%w: no service-port gateway for %s on this worker", errdefs.ErrUnavailable, ad.Claims.SandboxID))
		return
	}
	if act.awaitingView.Load() {
		m.writeError(w, awaitingViewError(ad.Claims.SandboxID))
		return
	}
	if proto == gateway.ProtocolTCP {
		if err := gateway.CheckTCPUpgrade(r); err != nil {
			m.writeError(w, fmt.Errorf("%w: %v", errdefs.ErrInvalid, err))
			return
		}
	}
	// netgtw admits the stream a second time, on its own, and hands over
	// the guest socket; this process then forwards on it directly.
	gc, hold, err := gateway.OpenGuest(ctx, gw.sock, func(c net.Conn) error {
		// Per connection: the gateway must be the process launched here.
		if err := procid.VerifyPeer(c, gw.proc); err != nil {
			return fmt.Errorf("netgtw endpoint verification: %w", err)
		}
		return nil
	}, gateway.DialRequest{Token: r.Header.Get(spacev1.HeaderCapability), Port: port, Protocol: proto})
	var refused *gateway.RefusedError
	switch {
	case errors.As(err, &refused):
		gateway.WriteRefusal(w, refused)
		return
	case err != nil:
		if ctx.Err() == nil {
			m.writeError(w, m.unreachable("service-port gateway", r, err))
		}
		return
	}
	defer hold.Close() // after the guest socket: netgtw then just drops its copy
	defer gc.Close()
	if proto == gateway.ProtocolTCP {
		gateway.ServeTCP(ctx, w, r, gc)
		return
	}
	// Full duplex: see gateway.Gateway.ServeHTTP (golang/go#68560).
	_ = http.NewResponseController(w).EnableFullDuplex()
	defer r.Body.Close()
	gateway.ProxyOn(w, gateway.GuestRequest(r.WithContext(ctx), port), gc, proxyBuffers, m.log)
}
