package gateway

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/logsetup"
)

// Control is one message on the control channel (netgtw's stdin, a pipe
// only sbx-manager holds). One JSON object per line; netgtw answers each on
// stdout with "ok\n" or "error: <reason>\n".
//
//	{"op":"activation","route":{...}}  new activation attempt (same epoch:
//	                                   streams kept; other epoch: retire)
//	{"op":"retire"}                    end every stream, serve nothing more
//
// End of input (sbx-manager gone) stops netgtw.
type Control struct {
	Op    string          `json:"op"`
	Route *identity.Route `json:"route,omitempty"`
}

// Control operations.
const (
	OpActivation = "activation"
	OpRetire     = "retire"
)

// Ready is the line netgtw prints on stdout once it listens.
const Ready = "netgtw ready\n"

// Main is netgtw's entry point (cmd/netgtw).
//
//	netgtw --listen SOCK --bundle FILE --route JSON --init-pid PID
//	       --init-start TICKS --netns-ino INO --manager-pid PID
//
// or, for a microVM (no namespace of its own on the host), --netns-path
// (the worker's egress namespace) and --dial-addr (the VM's address on
// its link) instead of --init-pid and --init-start.
func Main(args []string, stdin io.Reader, stdout, stderr io.Writer, logOpts logsetup.Options) int {
	fs := flag.NewFlagSet("netgtw", flag.ContinueOnError)
	fs.SetOutput(stderr)
	listen := fs.String("listen", "", "Unix socket to serve sbx-manager's forwarded service-port traffic on")
	bundle := fs.String("bundle", "", "key bundle file (kept current)")
	routeJSON := fs.String("route", "", "trusted activation identity (JSON)")
	initPID := fs.Int("init-pid", 0, "host pid of the sandbox's init")
	initStart := fs.Uint64("init-start", 0, "start time of the sandbox's init (clock ticks)")
	netnsIno := fs.Uint64("netns-ino", 0, "inode of the sandbox's network namespace recorded at activation")
	managerPID := fs.Int("manager-pid", 0, "pid of sbx-manager: the only peer accepted on --listen")
	netnsPath := fs.String("netns-path", "", "a microVM's: the egress network namespace's bind mount (checked against --netns-ino)")
	dialAddr := fs.String("dial-addr", "", "a microVM's: its address on its link, dialed in --netns-path")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	log, err := logsetup.New(stderr, logOpts)
	if err != nil {
		fmt.Fprintf(stderr, "netgtw: %v\n", err)
		return 2
	}
	if *listen == "" || *bundle == "" || *routeJSON == "" || *managerPID == 0 {
		fmt.Fprintln(stderr, "netgtw: --listen, --bundle, --route and --manager-pid are required")
		return 2
	}
	var route identity.Route
	if err := json.Unmarshal([]byte(*routeJSON), &route); err != nil {
		fmt.Fprintf(stderr, "netgtw: --route: %v\n", err)
		return 2
	}
	// Fail closed: without a readable bundle no capability verifies.
	ver, _ := capability.NewVerifier(capability.Bundle{Revision: -1})
	if b, err := ReadBundle(*bundle); err != nil {
		log.Warn("key bundle unreadable; denying until it appears", "err", err)
	} else if err := ver.SetBundle(b); err != nil {
		log.Warn("key bundle rejected", "err", err)
	}
	var nd *NetnsDialer
	if *netnsPath != "" {
		addr, perr := netip.ParseAddr(*dialAddr)
		if perr != nil {
			fmt.Fprintf(stderr, "netgtw: --dial-addr: %v\n", perr)
			return 2
		}
		nd, err = OpenNetnsPath(*netnsPath, *netnsIno, addr)
	} else {
		nd, err = OpenNetns(*initPID, *netnsIno, *initStart)
	}
	if err != nil {
		fmt.Fprintf(stderr, "netgtw: %v\n", err)
		return 1
	}
	defer nd.Close()
	g, err := New(Config{Route: route, Verifier: ver, Dial: nd.DialPort, Logger: log})
	if err != nil {
		fmt.Fprintf(stderr, "netgtw: %v\n", err)
		return 1
	}
	defer g.Close()
	ln, err := net.Listen("unix", *listen)
	if err != nil {
		fmt.Fprintf(stderr, "netgtw: %v\n", err)
		return 1
	}
	if err := os.Chmod(*listen, 0o600); err != nil {
		ln.Close()
		fmt.Fprintf(stderr, "netgtw: %v\n", err)
		return 1
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer cancel()
	go WatchBundle(ctx, *bundle, ver, 0, log)

	// The socket speaks the dial protocol (dial.go): netgtw admits each
	// guest connection and hands the connected socket to sbx-manager.
	srvDone := make(chan error, 1)
	go func() { srvDone <- g.ServeDialListener(ctx, &peerListener{Listener: ln, pid: *managerPID, log: log}) }()

	var outMu sync.Mutex
	reply := func(s string) {
		outMu.Lock()
		defer outMu.Unlock()
		_, _ = io.WriteString(stdout, s)
	}
	reply(Ready)
	log.Info("netgtw serving", "listen", *listen, "route", route.String(), "activation", route.ActivationID)

	ctlDone := make(chan struct{})
	go func() {
		defer close(ctlDone)
		sc := bufio.NewScanner(stdin)
		sc.Buffer(make([]byte, 64<<10), 64<<10)
		for sc.Scan() {
			reply(handleControl(g, sc.Bytes()))
		}
	}()
	code := 0
	select {
	case <-ctx.Done():
	case <-ctlDone:
		log.Info("control channel closed; stopping")
	case err := <-srvDone:
		log.Error("serve", "err", err)
		code = 1
	}
	g.Close() // ends every stream (their sockets shut down) first
	ln.Close()
	if code == 0 {
		<-srvDone // every dial connection has ended
	}
	return code
}

func handleControl(g *Gateway, line []byte) string {
	var c Control
	if err := json.Unmarshal(line, &c); err != nil {
		return "error: malformed control message\n"
	}
	switch c.Op {
	case OpActivation:
		if c.Route == nil {
			return "error: activation needs a route\n"
		}
		if err := g.SetActivation(*c.Route); err != nil {
			if errors.Is(err, ErrEpochChanged) {
				return "ok retired\n"
			}
			return "error: " + err.Error() + "\n"
		}
		return "ok\n"
	case OpRetire:
		g.Retire("retired by sbx-manager")
		return "ok retired\n"
	}
	return "error: unknown op " + strconv.Quote(c.Op) + "\n"
}

// peerListener accepts only connections whose peer (SO_PEERCRED) is
// sbx-manager's process.
type peerListener struct {
	net.Listener
	pid int
	log *slog.Logger
}

func (l *peerListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if err := checkPeer(c, l.pid); err != nil {
			l.log.Warn("refused connection", "err", err)
			c.Close()
			continue
		}
		return c, nil
	}
}

func checkPeer(c net.Conn, pid int) error {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return fmt.Errorf("not a unix connection")
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var serr error
	if err := raw.Control(func(fd uintptr) {
		cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return err
	}
	if serr != nil {
		return serr
	}
	if int(cred.Pid) != pid || cred.Uid != uint32(os.Geteuid()) {
		return fmt.Errorf("peer pid %d uid %d is not sbx-manager (pid %d)", cred.Pid, cred.Uid, pid)
	}
	return nil
}
