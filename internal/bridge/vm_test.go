package bridge

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
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/vmchan"
	"github.com/spacesbx/space/internal/vmchan/vmchantest"
)

// fakeQEMU listens at qemuSock like QEMU's chardev socket backend: it
// serves one client at a time and relays its bytes to and from the
// guest's port (a connection to portSock per client).
func fakeQEMU(qemuSock, portSock string) int {
	l, err := net.Listen("unix", qemuSock)
	if err != nil {
		return 3
	}
	fmt.Println("listening")
	for {
		c, err := l.Accept()
		if err != nil {
			return 0
		}
		p, err := net.Dial("unix", portSock)
		if err != nil {
			c.Close()
			continue
		}
		done := make(chan struct{}, 2)
		go func() { io.Copy(p, c); done <- struct{}{} }()
		go func() { io.Copy(c, p); done <- struct{}{} }()
		<-done
		c.Close()
		p.Close()
		<-done
	}
}

type vmEnv struct {
	qemu     *exec.Cmd
	qemuSock string
	dir      string
}

// startVM starts an in-process guest (vmchan.Listener serving fakeGuest)
// behind a fake QEMU child process. report is the identity the guest
// ACKs and reports (nil: the one in the activation).
func startVM(t *testing.T, report *identity.Route, extra http.Handler) *vmEnv {
	t.Helper()
	dir := t.TempDir()
	e := &vmEnv{dir: dir, qemuSock: filepath.Join(dir, "qemu.sock")}
	portSock := filepath.Join(dir, "port.sock")
	pl, err := net.Listen("unix", portSock)
	if err != nil {
		t.Fatal(err)
	}
	port := &vmchantest.Port{}
	var held identity.Route
	var mu sync.Mutex
	l := vmchan.NewListener(port, vmchan.ListenerConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		PollInterval: 5 * time.Millisecond,
		Activate: func(_ vmchan.SessionID, p []byte) ([]byte, error) {
			var cfg struct {
				Identity identity.Route `json:"identity"`
			}
			if err := json.Unmarshal(p, &cfg); err != nil {
				return nil, err
			}
			mu.Lock()
			defer mu.Unlock()
			held = cfg.Identity
			if report != nil {
				held = *report
			}
			return json.Marshal(held)
		}})
	l.Start()
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+IdentityPath, func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		json.NewEncoder(w).Encode(held)
	})
	mux.Handle("/", fakeGuest(want, extra))
	srv := &http.Server{Handler: mux}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); srv.Serve(l) }()
	go func() {
		defer wg.Done()
		for {
			c, err := pl.Accept()
			if err != nil {
				return
			}
			port.Attach(c)
		}
	}()
	e.qemu = exec.Command(os.Args[0], "-test.run=^$")
	e.qemu.Env = append(os.Environ(), "BRIDGE_HELPER=fake-qemu", "QEMU_SOCK="+e.qemuSock, "PORT_SOCK="+portSock)
	out, _ := e.qemu.StdoutPipe()
	if err := e.qemu.Start(); err != nil {
		t.Fatal(err)
	}
	if line, _ := bufio.NewReader(out).ReadString('\n'); line != "listening\n" {
		t.Fatalf("fake qemu: %q", line)
	}
	t.Cleanup(func() {
		e.qemu.Process.Kill()
		e.qemu.Wait()
		srv.Close()
		l.Close()
		pl.Close()
		wg.Wait()
	})
	return e
}

func activationFor(id identity.Route) []byte {
	b, _ := json.Marshal(map[string]any{"identity": id, "env": map[string]string{"A": "1"}})
	return b
}

func (e *vmEnv) config() Config {
	return Config{GuestSocket: e.qemuSock, GuestPID: e.qemu.Process.Pid, Expected: want,
		Channel: ChannelVM, Activation: activationFor(want), BootTimeout: 10 * time.Second,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
}

// serveVM starts a bridge in VM mode and an HTTP client to it.
func serveVM(t *testing.T, e *vmEnv) (*Bridge, *http.Client, chan error) {
	t.Helper()
	b, err := New(e.config())
	if err != nil {
		t.Fatal(err)
	}
	hs := filepath.Join(e.dir, "host.sock")
	l, err := net.Listen("unix", hs)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- b.Serve(l) }()
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", hs)
	}}
	t.Cleanup(func() {
		tr.CloseIdleConnections()
		b.Close()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Error("Serve did not return")
		}
	})
	return b, &http.Client{Transport: tr}, done
}

func TestVMChannelForwardsOverStreams(t *testing.T) {
	e := startVM(t, nil, nil)
	b, client, _ := serveVM(t, e)
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			msg := strings.Repeat(fmt.Sprint(i), 100000)
			resp, err := client.Post("http://x/echo", "text/plain", strings.NewReader(msg))
			if err != nil {
				t.Error(err)
				return
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if string(body) != msg || resp.Header.Get("Space-Execution") != "sbx1/3/e3" {
				t.Errorf("echo %d: %d bytes, header %q", i, len(body), resp.Header.Get("Space-Execution"))
			}
		}()
	}
	wg.Wait()
	resp, err := client.Get("http://x/stream")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(body) != "tick 0\ntick 1\ntick 2\n" {
		t.Fatalf("stream %q", body)
	}
	if b.verified.Load() < 2 {
		t.Fatalf("verified %d", b.verified.Load())
	}
}

func TestVMChannelGuestReportingAnotherIdentityIsRefused(t *testing.T) {
	other := want
	other.ActivationID = "a0" // the identity it held before the restore
	e := startVM(t, &other, nil)
	_, err := New(e.config())
	if !errors.Is(err, ErrGuestIdentity) || checkOf(err) != CheckGuestIdentity {
		t.Fatalf("got %v", err)
	}
	cfg := e.config()
	cfg.Activation = activationFor(other)
	if _, err := New(cfg); err == nil || !strings.Contains(err.Error(), "activation identity") {
		t.Fatalf("activation of another identity: %v", err)
	}
}

func TestVMChannelListenerOfAnotherProcessIsRefused(t *testing.T) {
	e := startVM(t, nil, nil)
	cfg := e.config()
	cfg.GuestPID = os.Getpid() // not the process holding the listener
	if _, err := New(cfg); !errors.Is(err, ErrListener) {
		t.Fatalf("got %v", err)
	}
}

func TestVMChannelSocketReboundByAnotherProcessIsRefused(t *testing.T) {
	e := startVM(t, nil, nil)
	_, client, _ := serveVM(t, e)
	os.Remove(e.qemuSock)
	imp := exec.Command(os.Args[0], "-test.run=^$")
	imp.Env = append(os.Environ(), "BRIDGE_IMPOSTOR="+e.qemuSock)
	out, _ := imp.StdoutPipe()
	if err := imp.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { imp.Process.Kill(); imp.Wait() }()
	if l, _ := bufio.NewReader(out).ReadString('\n'); l != "listening\n" {
		t.Fatalf("impostor: %q", l)
	}
	resp, err := client.Get("http://x/echo")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadGateway || !strings.Contains(string(body), CheckPathInode+" check failed") {
		t.Fatalf("status %d body %s", resp.StatusCode, body)
	}
}

// The channel's connection drops (the VMM died): open streams fail, new
// requests are refused and Serve ends with ErrChannelLost.
func TestVMChannelDropFailsStreamsAndStops(t *testing.T) {
	slow := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			w.Write([]byte("first\n"))
			w.(http.Flusher).Flush()
			<-r.Context().Done()
		}
	})
	e := startVM(t, nil, slow)
	_, client, done := serveVM(t, e)
	resp, err := client.Get("http://x/slow")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	if line, err := br.ReadString('\n'); err != nil || line != "first\n" {
		t.Fatalf("first line %q %v", line, err)
	}
	e.qemu.Process.Kill()
	e.qemu.Wait()
	if _, err := io.ReadAll(br); err == nil {
		t.Fatal("stream survived the channel")
	}
	select {
	case err := <-done:
		done <- err // for the cleanup
		if !errors.Is(err, ErrChannelLost) || !errors.Is(err, vmchan.ErrChannelLost) {
			t.Fatalf("Serve: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Serve did not stop")
	}
}

// Every activation carries 64 fresh random bytes beside the payload's
// fields; a payload that is not a JSON object is refused.
func TestActivationEntropy(t *testing.T) {
	in := []byte(`{"identity":{"sandbox":"s"},"env":{"A":"1"}}`)
	a, err := withEntropy(in)
	if err != nil {
		t.Fatal(err)
	}
	b, err := withEntropy(in)
	if err != nil {
		t.Fatal(err)
	}
	var ma, mb struct {
		Identity map[string]string `json:"identity"`
		Env      map[string]string `json:"env"`
		Entropy  []byte            `json:"entropy"`
	}
	if err := json.Unmarshal(a, &ma); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &mb); err != nil {
		t.Fatal(err)
	}
	if ma.Identity["sandbox"] != "s" || ma.Env["A"] != "1" || len(ma.Entropy) != 64 {
		t.Fatalf("payload %s", a)
	}
	if bytes.Equal(ma.Entropy, mb.Entropy) {
		t.Fatal("two activations carry the same entropy")
	}
	for _, bad := range []string{``, `[]`, `"x"`, `{`} {
		if _, err := withEntropy([]byte(bad)); err == nil {
			t.Errorf("payload %q accepted", bad)
		}
	}
}
