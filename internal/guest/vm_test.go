package guest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	processpb "github.com/spacesbx/space/api/envd/process"
	"github.com/spacesbx/space/api/envd/process/processpbconnect"
	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/internal/vmchan"
	"github.com/spacesbx/space/internal/vmchan/vmchantest"
)

// vmHost is one host session to the VM-mode agent.
type vmHost struct {
	c    *vmchan.Client
	tr   *http.Transport
	http *http.Client
	proc processpbconnect.ProcessClient
}

func (h *vmHost) close() {
	h.tr.CloseIdleConnections()
	h.c.Close()
}

func connectVM(t *testing.T, port *vmchantest.Port, id Identity) (*vmHost, error) {
	t.Helper()
	hc, gc := vmchantest.Socketpair(t)
	port.Attach(gc)
	act, _ := json.Marshal(map[string]any{"identity": id, "env": map[string]string{"ACT": id.Activation}})
	c, err := vmchan.NewClient(context.Background(), hc, vmchan.ClientConfig{Activation: act,
		ResendInterval: 50 * time.Millisecond, BootTimeout: 10 * time.Second, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		return nil, err
	}
	var got Identity
	if err := json.Unmarshal(c.Ack(), &got); err != nil || got != id {
		t.Fatalf("ACK identity %+v %v", got, err)
	}
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) { return c.Open(ctx) }}
	hcl := &http.Client{Transport: tr}
	return &vmHost{c: c, tr: tr, http: hcl, proc: processpbconnect.NewProcessClient(hcl, "http://guest", connect.WithProtoJSON())}, nil
}

func (h *vmHost) identity(t *testing.T) Identity {
	t.Helper()
	resp, err := h.http.Get("http://guest" + PathIdentity)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var id Identity
	if err := json.NewDecoder(resp.Body).Decode(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

// startVMAgent runs ServeVM over a fake port with test accounts.
func startVMAgent(t *testing.T) *vmchantest.Port {
	t.Helper()
	testenv.RequireRoot(t, "runs processes as other users")
	dir, err := os.MkdirTemp("", "guest-vm-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	os.Chmod(dir, 0o755)
	passwd, group := filepath.Join(dir, "passwd"), filepath.Join(dir, "group")
	writeFile(t, passwd, fmt.Sprintf("root:x:0:0:root:%s:/bin/sh\nuser:x:1000:1000::%s:/bin/sh\n", dir, dir))
	writeFile(t, group, "root:x:0:\nuser:x:1000:\n")
	port := &vmchantest.Port{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- ServeVM(ctx, port, Config{PasswdPath: passwd, GroupPath: group, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("ServeVM: %v", err)
		}
	})
	return port
}

var vmID = Identity{Sandbox: "sbx1", Generation: 3, Execution: "ex1", Worker: "w1", Substrate: "microvm", Activation: "a1"}

func TestVMModeActivationAndReactivation(t *testing.T) {
	port := startVMAgent(t)
	h1, err := connectVM(t, port, vmID)
	if err != nil {
		t.Fatal(err)
	}
	if got := h1.identity(t); got != vmID {
		t.Fatalf("identity %+v", got)
	}
	h1.close()

	// Restored elsewhere: a new host with a new identity.
	moved := vmID
	moved.Generation, moved.Worker, moved.Activation = 4, "w2", "a2"
	h2, err := connectVM(t, port, moved)
	if err != nil {
		t.Fatal(err)
	}
	defer h2.close()
	if got := h2.identity(t); got != moved {
		t.Fatalf("identity after reactivation %+v", got)
	}
	// The per-activation env is replaced too.
	st, err := h2.proc.Start(ctxT(t), connect.NewRequest(sh("echo $ACT")))
	if err != nil {
		t.Fatal(err)
	}
	r := collect(t, func() (*processpb.ProcessEvent, bool) {
		if !st.Receive() {
			return nil, false
		}
		return st.Msg().GetEvent(), true
	}, st.Err)
	st.Close()
	if r.stdout != "a2\n" {
		t.Fatalf("env after reactivation %q", r.stdout)
	}
	// An invalid activation is refused in the ACK; the agent keeps its identity.
	bad := moved
	bad.Execution = ""
	if _, err := connectVM(t, port, bad); !errors.As(err, new(*vmchan.ActivationError)) {
		t.Fatalf("invalid activation: %v", err)
	}
	h3, err := connectVM(t, port, moved)
	if err != nil {
		t.Fatal(err)
	}
	defer h3.close()
	if got := h3.identity(t); got != moved {
		t.Fatalf("identity after a refused activation %+v", got)
	}
}

// A client reattaching after a move gets the output the process produced
// while nobody was subscribed, first, then the rest: nothing is lost.
func TestVMModeOutputReplayAfterReconnect(t *testing.T) {
	port := startVMAgent(t)
	h1, err := connectVM(t, port, vmID)
	if err != nil {
		t.Fatal(err)
	}
	const n = 25
	script := fmt.Sprintf("i=0; while [ $i -lt %d ]; do echo line$i; i=$((i+1)); sleep 0.1; done", n)
	st, err := h1.proc.Start(ctxT(t), connect.NewRequest(sh(script)))
	if err != nil {
		t.Fatal(err)
	}
	var pid uint32
	var seen strings.Builder
	for st.Receive() {
		ev := st.Msg().GetEvent()
		if ev.GetStart() != nil {
			pid = ev.GetStart().GetPid()
		}
		seen.Write(ev.GetData().GetStdout())
		if strings.Contains(seen.String(), "line3\n") {
			break
		}
	}
	// The host goes away (pause, move); the process keeps writing.
	h1.close()
	st.Close()
	time.Sleep(600 * time.Millisecond)
	moved := vmID
	moved.Activation = "a2"
	h2, err := connectVM(t, port, moved)
	if err != nil {
		t.Fatal(err)
	}
	defer h2.close()
	cs, err := h2.proc.Connect(ctxT(t), connect.NewRequest(&processpb.ConnectRequest{
		Process: &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: pid}}}))
	if err != nil {
		t.Fatal(err)
	}
	defer cs.Close()
	r := collect(t, func() (*processpb.ProcessEvent, bool) {
		if !cs.Receive() {
			return nil, false
		}
		return cs.Msg().GetEvent(), true
	}, cs.Err)
	var want strings.Builder
	for i := range n {
		fmt.Fprintf(&want, "line%d\n", i)
	}
	if got := seen.String() + r.stdout; got != want.String() {
		t.Fatalf("output across the move:\nfirst stream %q\nafter reattach %q", seen.String(), r.stdout)
	}
}

func TestDetachedOutputIsBounded(t *testing.T) {
	p := &proc{subs: map[*subscriber]struct{}{}, detachLimit: 10}
	for i := range 5 {
		p.publish(dataEvent(1, []byte(fmt.Sprintf("abcd%d", i))))
	}
	_, _, kept, dropped := p.reattach()
	var got string
	for _, ev := range kept {
		got += string(ev.GetData().GetStdout())
	}
	if got != "abcd3abcd4" || dropped != 15 {
		t.Fatalf("kept %q dropped %d", got, dropped)
	}
	// Without a limit (ns mode) nothing is kept.
	q := &proc{subs: map[*subscriber]struct{}{}}
	q.publish(dataEvent(1, []byte("x")))
	if _, _, kept, _ := q.reattach(); len(kept) != 0 {
		t.Fatal("output kept without a limit")
	}
}

func TestResolvePort(t *testing.T) {
	dir := t.TempDir()
	for name, port := range map[string]string{"vport0p1": "org.qemu.guest_agent.0", "vport1p1": "space.0"} {
		os.MkdirAll(filepath.Join(dir, name), 0o755)
		writeFile(t, filepath.Join(dir, name, "name"), port+"\n")
	}
	got, err := ResolvePort(dir, "/dev", "space.0")
	if err != nil || got != "/dev/vport1p1" {
		t.Fatalf("%q %v", got, err)
	}
	if _, err := ResolvePort(dir, "/dev", "space.1"); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing port: %v", err)
	}
}
