package gateway

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/identity"
)

// The dial protocol is how sbx-manager gets a guest connection from netgtw
// without netgtw carrying its bytes. Per guest connection sbx-manager opens
// one connection to netgtw's socket and sends one DialRequest line; netgtw
// runs its own checks (Admit), dials the port inside the sandbox's network
// namespace and answers one DialReply line. On success the reply carries
// the connected socket (SCM_RIGHTS) and sbx-manager forwards the request
// on it itself: one proxy hop fewer than netgtw reverse-proxying every
// byte, with the same two independent admissions.
//
// netgtw keeps its own descriptor of the socket and the dial connection
// open for the stream's life: when sbx-manager is done it closes its socket
// and then the dial connection (netgtw then just drops its copy); when the
// lease the stream was admitted under ends (a new execution, Retire),
// netgtw shuts the socket down, which ends sbx-manager's copy too, since
// both descriptors name one socket.

// DialRequest is the one line sbx-manager sends per guest connection.
type DialRequest struct {
	Token    string `json:"token"`
	Port     int    `json:"port"`
	Protocol string `json:"protocol"`
}

// DialReply is netgtw's one-line answer. Status 200 comes with the socket;
// anything else is a refusal sbx-manager passes on as is (status, route
// outcome, reason).
type DialReply struct {
	Status  int    `json:"status"`
	Outcome string `json:"outcome,omitempty"`
	Reason  string `json:"reason,omitempty"`
}

// maxDialLine bounds a DialRequest line (a capability is well under 2 KiB).
const maxDialLine = 16 << 10

// dialReadTimeout bounds how long netgtw waits for the request line.
const dialReadTimeout = 10 * time.Second

// ParseDialRequest parses and checks one request line: exactly one JSON
// object of known fields, a service port (never the guest agent's) and a
// known protocol.
func ParseDialRequest(line []byte) (DialRequest, error) {
	var req DialRequest
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		return DialRequest{}, errors.New("dial request: malformed")
	}
	if dec.More() {
		return DialRequest{}, errors.New("dial request: more than one value")
	}
	if req.Port < 1 || req.Port > 65535 || req.Port == EnvdPort {
		return DialRequest{}, errors.New("dial request: invalid service port")
	}
	switch req.Protocol {
	case ProtocolHTTP, ProtocolWS, ProtocolTCP:
	default:
		return DialRequest{}, errors.New("dial request: unknown protocol")
	}
	return req, nil
}

// RefusedError is a refusal from netgtw's dial protocol.
type RefusedError struct{ DialReply }

func (e *RefusedError) Error() string {
	return fmt.Sprintf("netgtw refused: %d %s", e.Status, e.Reason)
}

// WriteRefusal answers a refused service-port request the way netgtw's
// checks decided it (status, route outcome header, JSON error).
func WriteRefusal(w http.ResponseWriter, e *RefusedError) {
	writeJSON(w, e.Status, e.Outcome, e.Reason)
}

// ServeDialListener serves the dial protocol on ln until ln is closed or
// ctx ends; it returns once every connection it accepted is done.
func (g *Gateway) ServeDialListener(ctx context.Context, ln net.Listener) error {
	done := make(chan struct{})
	defer close(done)
	active := make(chan struct{}, 1024) // one token per open dial connection
	defer func() {
		for i := 0; i < cap(active); i++ {
			active <- struct{}{} // waits for the open ones to end
		}
	}()
	for {
		c, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) || ctx.Err() != nil {
				return nil
			}
			return err
		}
		uc, ok := c.(*net.UnixConn)
		if !ok {
			c.Close()
			continue
		}
		select {
		case active <- struct{}{}:
		default: // over the bound: refuse rather than queue
			c.Close()
			continue
		}
		go func() {
			defer func() { <-active }()
			g.ServeDial(ctx, uc)
		}()
	}
}

// ServeDial serves one dial connection (see DialRequest) and closes it.
func (g *Gateway) ServeDial(ctx context.Context, c *net.UnixConn) {
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(dialReadTimeout))
	line, err := bufio.NewReaderSize(io.LimitReader(c, maxDialLine), maxDialLine).ReadSlice('\n')
	if err != nil {
		g.replyDial(c, DialReply{Status: http.StatusBadRequest, Reason: "dial request: no complete line"}, -1)
		return
	}
	req, err := ParseDialRequest(line)
	if err != nil {
		g.replyDial(c, DialReply{Status: http.StatusBadRequest, Reason: err.Error()}, -1)
		return
	}
	ad := g.Admit(req.Token, req.Port, req.Protocol)
	g.count(ad.Decision.Outcome)
	level := slog.LevelInfo
	if ad.Decision.Outcome == identity.Allow {
		level = slog.LevelDebug
	}
	g.log.Log(ctx, level, "decision", "outcome", ad.Decision.Outcome.String(), "reason", ad.Decision.Reason,
		"jti", ad.Claims.JTI, "port", req.Port, "protocol", req.Protocol)
	switch ad.Decision.Outcome {
	case identity.Allow:
	case identity.RefreshRoute:
		g.replyDial(c, DialReply{Status: http.StatusMisdirectedRequest, Outcome: spacev1.OutcomeRefreshRoute, Reason: ad.Decision.Reason}, -1)
		return
	default:
		g.replyDial(c, DialReply{Status: http.StatusForbidden, Outcome: spacev1.OutcomeDeny, Reason: ad.Decision.Reason}, -1)
		return
	}
	// The stream lives no longer than the epoch it was admitted under.
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(ad.lease, cancel)
	defer stop()
	if ad.lease.Err() != nil {
		g.replyDial(c, DialReply{Status: http.StatusMisdirectedRequest, Outcome: spacev1.OutcomeRefreshRoute, Reason: spacev1.ReasonExecutionReplaced}, -1)
		return
	}
	g.streams.Add(1)
	defer g.streams.Add(-1)
	guest, err := g.dialGuest(sctx, req.Port)
	if err != nil {
		g.replyDial(c, DialReply{Status: http.StatusBadGateway, Reason: "sandbox port unreachable: " + err.Error()}, -1)
		return
	}
	defer guest.Close()
	sc, ok := guest.(syscall.Conn)
	if !ok {
		g.replyDial(c, DialReply{Status: http.StatusBadGateway, Reason: "sandbox port unreachable: not a socket"}, -1)
		return
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		g.replyDial(c, DialReply{Status: http.StatusBadGateway, Reason: "sandbox port unreachable: " + err.Error()}, -1)
		return
	}
	sent := false
	_ = raw.Control(func(fd uintptr) { sent = g.replyDial(c, DialReply{Status: http.StatusOK}, int(fd)) })
	if !sent {
		return
	}
	// Hold the stream: sbx-manager closing the dial connection ends it;
	// the lease ending cuts the socket for both holders.
	_ = c.SetReadDeadline(time.Time{})
	eof := make(chan struct{})
	go func() {
		defer close(eof)
		var b [64]byte
		for {
			if _, err := c.Read(b[:]); err != nil {
				return
			}
		}
	}()
	select {
	case <-eof:
	case <-sctx.Done():
		_ = raw.Control(func(fd uintptr) { _ = unix.Shutdown(int(fd), unix.SHUT_RDWR) })
		c.Close()
		<-eof
	}
}

// replyDial writes rep as one line, with fd attached when fd >= 0. It
// reports whether the whole line went out.
func (g *Gateway) replyDial(c *net.UnixConn, rep DialReply, fd int) bool {
	b, _ := json.Marshal(rep)
	b = append(b, '\n')
	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	_ = c.SetWriteDeadline(time.Now().Add(dialReadTimeout))
	n, _, err := c.WriteMsgUnix(b, oob, nil)
	_ = c.SetWriteDeadline(time.Time{})
	return err == nil && n == len(b)
}

// OpenGuest asks the netgtw listening at sock for a connection to req's
// port. verify checks the dial connection's peer before anything is sent
// (sbx-manager: is it the netgtw it launched?). On success it returns the
// guest connection and the dial connection, which the caller closes after
// the guest connection, when the stream is done. A refusal is a
// *RefusedError.
func OpenGuest(ctx context.Context, sock string, verify func(net.Conn) error, req DialRequest) (guest net.Conn, hold net.Conn, err error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", sock)
	if err != nil {
		return nil, nil, err
	}
	uc := c.(*net.UnixConn)
	fail := func(err error) (net.Conn, net.Conn, error) {
		uc.Close()
		return nil, nil, err
	}
	if verify != nil {
		if err := verify(uc); err != nil {
			return fail(err)
		}
	}
	if dl, ok := ctx.Deadline(); ok {
		_ = uc.SetDeadline(dl)
	} else {
		_ = uc.SetDeadline(time.Now().Add(dialReadTimeout + 5*time.Second))
	}
	stop := context.AfterFunc(ctx, func() { _ = uc.SetDeadline(time.Now()) })
	defer stop()
	b, _ := json.Marshal(req)
	if _, err := uc.Write(append(b, '\n')); err != nil {
		return fail(fmt.Errorf("netgtw dial: %w", err))
	}
	var line []byte
	var fds []int
	buf := make([]byte, 1024)
	oob := make([]byte, unix.CmsgSpace(4*4))
	for len(line) == 0 || line[len(line)-1] != '\n' {
		if len(line) > maxDialLine {
			closeFDs(fds)
			return fail(errors.New("netgtw dial: reply too long"))
		}
		n, oobn, _, _, err := uc.ReadMsgUnix(buf, oob)
		if oobn > 0 {
			got, perr := parseRights(oob[:oobn])
			fds = append(fds, got...)
			if perr != nil {
				closeFDs(fds)
				return fail(fmt.Errorf("netgtw dial: %w", perr))
			}
		}
		line = append(line, buf[:n]...)
		if err != nil {
			closeFDs(fds)
			return fail(fmt.Errorf("netgtw dial: %w", err))
		}
		if n == 0 && oobn == 0 {
			closeFDs(fds)
			return fail(fmt.Errorf("netgtw dial: %w", io.ErrUnexpectedEOF))
		}
	}
	var rep DialReply
	if err := json.Unmarshal(line, &rep); err != nil {
		closeFDs(fds)
		return fail(errors.New("netgtw dial: malformed reply"))
	}
	if rep.Status != http.StatusOK {
		closeFDs(fds)
		if rep.Status < 400 || rep.Status > 599 {
			rep.Status = http.StatusBadGateway
		}
		return fail(&RefusedError{rep})
	}
	if len(fds) != 1 {
		closeFDs(fds)
		return fail(fmt.Errorf("netgtw dial: want one socket, got %d", len(fds)))
	}
	f := os.NewFile(uintptr(fds[0]), "sandbox-tcp")
	gc, err := net.FileConn(f)
	f.Close()
	if err != nil {
		return fail(fmt.Errorf("netgtw dial: %w", err))
	}
	if _, ok := gc.(*net.TCPConn); !ok {
		gc.Close()
		return fail(errors.New("netgtw dial: passed descriptor is not a TCP socket"))
	}
	_ = uc.SetDeadline(time.Time{})
	return gc, uc, nil
}

func parseRights(oob []byte) ([]int, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, err
	}
	var fds []int
	for i := range msgs {
		got, err := unix.ParseUnixRights(&msgs[i])
		if err != nil {
			continue
		}
		fds = append(fds, got...)
	}
	return fds, nil
}

func closeFDs(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}
