package sbxmanager

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/procid"
	"github.com/spacesbx/space/internal/substrate"
)

// adoptingSubstrate is fakeSubstrate whose instances outlive their
// manager: Detach leaves the in-process guest serving, and Adopt finds it
// again by the state the instance reported.
type adoptingSubstrate struct {
	fakeSubstrate
	mu    sync.Mutex
	insts map[string]*adoptableInstance // by activation dir
	// adoptErr, when set, fails every Adopt.
	adoptErr error
	adopted  int
}

type adoptableInstance struct {
	*fakeInstance
	dir    string
	paused bool
}

type fakeAdoptState struct {
	Dir string `json:"dir"`
	PID int    `json:"pid"`
}

func (i *adoptableInstance) AdoptState() []byte {
	b, _ := json.Marshal(fakeAdoptState{Dir: i.dir, PID: os.Getpid()})
	return b
}
func (i *adoptableInstance) Paused() bool { return i.paused }
func (i *adoptableInstance) Detach()      {}
func (i *adoptableInstance) Pause(context.Context) error {
	i.paused = true
	return nil
}
func (i *adoptableInstance) Resume(context.Context) error {
	i.paused = false
	return nil
}

func (s *adoptingSubstrate) Start(ctx context.Context, spec substrate.Spec) (substrate.Instance, error) {
	inst, err := s.fakeSubstrate.Start(ctx, spec)
	if err != nil {
		return nil, err
	}
	ai := &adoptableInstance{fakeInstance: inst.(*fakeInstance), dir: spec.Dir}
	s.mu.Lock()
	if s.insts == nil {
		s.insts = map[string]*adoptableInstance{}
	}
	s.insts[spec.Dir] = ai
	s.mu.Unlock()
	return ai, nil
}

func (s *adoptingSubstrate) Adopt(_ context.Context, spec substrate.Spec, state []byte) (substrate.Instance, error) {
	var st fakeAdoptState
	if err := json.Unmarshal(state, &st); err != nil || st.Dir != spec.Dir || st.PID != os.Getpid() {
		return nil, fmt.Errorf("%w: state %s", substrate.ErrNotAdoptable, state)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.adoptErr != nil {
		return nil, s.adoptErr
	}
	ai := s.insts[spec.Dir]
	if ai == nil {
		return nil, fmt.Errorf("%w: nothing runs in %s", substrate.ErrNotAdoptable, spec.Dir)
	}
	select {
	case <-ai.done:
		return nil, fmt.Errorf("%w: stopped", substrate.ErrNotAdoptable)
	default:
	}
	s.adopted++
	return ai, nil
}

func newAdoptManager(t *testing.T, dir string, sub *adoptingSubstrate, ver *capability.Verifier) *Manager {
	t.Helper()
	t.Cleanup(func() { // what a failed adoption left to a Reclaim the fake lacks
		sub.mu.Lock()
		defer sub.mu.Unlock()
		for _, ai := range sub.insts {
			ai.Stop(context.Background())
		}
	})
	m, err := New(Config{WorkerID: "w1", StateDir: dir, SpacedHostPath: spacedHost, AgentPath: "/nonexistent", EnvdVersion: "0.5.7"},
		Deps{Substrates: []substrate.Substrate{sub}, WriteError: writeTestError, Verifier: ver})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// A detached manager leaves its sandboxes and their spaced-hosts running;
// the next manager on the same state re-adopts them as they were (same
// execution, same spaced-host, paused stays paused) after probing each
// guest through its bridge, and serves them again.
func TestDetachedExecutionsAreReadopted(t *testing.T) {
	f := newFixture(t)
	f.m.Close()
	f.srv.Close()
	sub := &adoptingSubstrate{}
	m1 := newAdoptManager(t, f.dir, sub, f.m.ver)
	for _, id := range []string{"sbxa", "sbxb"} {
		if _, err := m1.Install(context.Background(), spacev1.InstallRequest{Route: route(id, 1), Template: "base"}); err != nil {
			t.Fatal(err)
		}
	}
	if err := m1.Pause(context.Background(), route("sbxb", 1)); err != nil {
		t.Fatal(err)
	}
	hostA, _, _ := m1.BridgePID("sbxa")
	if err := m1.Detach(); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(hostA, 0); err != nil {
		t.Fatalf("spaced-host of sbxa did not outlive its manager: %v", err)
	}

	m2 := newAdoptManager(t, f.dir, sub, f.m.ver)
	defer m2.Close()
	if rep := m2.StartReport(); rep.Adopted != 2 || rep.Reclaimed != 0 {
		t.Fatalf("start report %+v, want 2 adopted", rep)
	}
	if host, _, _ := m2.BridgePID("sbxa"); host != hostA {
		t.Fatalf("spaced-host after adoption %d, want the same process %d", host, hostA)
	}
	if !m2.Paused("sbxb") {
		t.Fatal("a paused execution was adopted as running")
	}
	srv := httptest.NewServer(m2)
	defer srv.Close()
	f.srv = srv
	f.m = m2
	// Nothing is served until the worker has applied the control plane's
	// view (a sandbox killed meanwhile is retired first).
	if resp, body := f.get(t, "/files?path=x", f.token(t, route("sbxa", 1), capability.PurposeFiles)); resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("before the control plane's view: %d %q", resp.StatusCode, body)
	}
	m2.ConfirmAdopted()
	resp, body := f.get(t, "/files?path=x", f.token(t, route("sbxa", 1), capability.PurposeFiles))
	if resp.StatusCode != 200 || body != "file of sbxa gen 1" || resp.Header.Get(spacev1.HeaderExecution) != "sbxa/1/e1" {
		t.Fatalf("after adoption: %d %q %q", resp.StatusCode, body, resp.Header.Get(spacev1.HeaderExecution))
	}
	if lost := m2.Lost(); len(lost) != 0 {
		t.Fatalf("adopted executions reported lost: %v", lost)
	}
	if err := m2.Resume(context.Background(), route("sbxb", 1)); err != nil {
		t.Fatal(err)
	}
	if resp, _ := f.get(t, "/files?path=x", f.token(t, route("sbxb", 1), capability.PurposeFiles)); resp.StatusCode != 200 {
		t.Fatalf("resumed adopted execution: %d", resp.StatusCode)
	}
}

// Nothing that fails a check is served: an instance the substrate will
// not adopt, a spaced-host that is not the recorded process, a guest that
// reports another execution. Each is reclaimed and reported lost instead,
// and answers 503 until recovered.
func TestFailedAdoption(t *testing.T) {
	for _, tc := range []struct {
		name   string
		spoil  func(t *testing.T, sub *adoptingSubstrate, dir string, hostPID int)
		hostUp bool // the recorded spaced-host is left alone (it was not the recorded process)
	}{
		{"refused", func(t *testing.T, sub *adoptingSubstrate, _ string, _ int) {
			sub.adoptErr = fmt.Errorf("%w: init start time differs", substrate.ErrNotAdoptable)
		}, false},
		{"guest", func(t *testing.T, sub *adoptingSubstrate, dir string, _ int) {
			sub.reportGeneration.Store(7)
		}, false},
		{"host", func(t *testing.T, sub *adoptingSubstrate, dir string, hostPID int) {
			// The record names another process than the one running: a
			// spaced-host that another process stands in for.
			st, err := openRecords(dir + "/records.db")
			if err != nil {
				t.Fatal(err)
			}
			recs, _ := st.loadAll()
			rec := recs["sbxa"]
			rec.Host.StartTime++
			if err := st.put(rec); err != nil {
				t.Fatal(err)
			}
			st.close()
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			f.m.Close()
			f.srv.Close()
			sub := &adoptingSubstrate{}
			m1 := newAdoptManager(t, f.dir, sub, f.m.ver)
			if _, err := m1.Install(context.Background(), spacev1.InstallRequest{Route: route("sbxa", 1), Template: "base"}); err != nil {
				t.Fatal(err)
			}
			hostPID, _, _ := m1.BridgePID("sbxa")
			h, err := procid.Open(hostPID)
			if err != nil {
				t.Fatal(err)
			}
			defer h.Close()
			defer h.Signal(syscall.SIGKILL)
			if err := m1.Detach(); err != nil {
				t.Fatal(err)
			}
			tc.spoil(t, sub, f.dir, hostPID)
			m2 := newAdoptManager(t, f.dir, sub, f.m.ver)
			defer m2.Close()
			if rep := m2.StartReport(); rep.Adopted != 0 || rep.Reclaimed != 1 {
				t.Fatalf("start report %+v, want nothing adopted and 1 reclaimed", rep)
			}
			if lost := m2.Lost(); len(lost) != 1 || lost[0] != route("sbxa", 1) {
				t.Fatalf("Lost() = %v", lost)
			}
			srv := httptest.NewServer(m2)
			defer srv.Close()
			f.srv, f.m = srv, m2
			if resp, body := f.get(t, "/files?path=x", f.token(t, route("sbxa", 1), capability.PurposeFiles)); resp.StatusCode != http.StatusServiceUnavailable {
				t.Fatalf("an execution that failed adoption answered %d %q", resp.StatusCode, body)
			}
			exited, err := h.Exited()
			if err != nil {
				t.Fatal(err)
			}
			select {
			case <-exited:
				if tc.hostUp {
					t.Fatal("a process that is not the recorded spaced-host was stopped")
				}
			case <-time.After(2 * time.Second):
				if !tc.hostUp {
					t.Fatal("the spaced-host of an execution that failed adoption still runs")
				}
			}
		})
	}
}

// One manager per state directory: a second one (a worker started twice
// on one data dir) would take the first one's bridges and end its
// sandboxes as unrecorded, so it does not start.
func TestSecondManagerOnAStateDirIsRefused(t *testing.T) {
	f := newFixture(t)
	_, err := New(Config{WorkerID: "w1", StateDir: f.dir, SpacedHostPath: spacedHost, AgentPath: "/nonexistent"},
		Deps{Substrates: []substrate.Substrate{&fakeSubstrate{}}, WriteError: writeTestError, Verifier: f.m.ver})
	if !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("second manager on one state dir: %v, want a conflict", err)
	}
	f.m.Close()
	m2, err := New(Config{WorkerID: "w1", StateDir: f.dir, SpacedHostPath: spacedHost, AgentPath: "/nonexistent"},
		Deps{Substrates: []substrate.Substrate{&fakeSubstrate{}}, WriteError: writeTestError, Verifier: f.m.ver})
	if err != nil {
		t.Fatalf("after the first closed: %v", err)
	}
	m2.Close()
}
