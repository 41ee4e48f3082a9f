package worker

// Metrics over time on real sandboxes: the worker's sampler (sbxmanager
// sampler.go) reads the sandbox's cgroups, and NodePathMetricsRange
// returns the kept samples.

import (
	"context"
	"log/slog"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	processpb "github.com/spacesbx/space/api/envd/process"
	"github.com/spacesbx/space/api/envd/process/processpbconnect"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/sbxmanager"
	"github.com/spacesbx/space/internal/substrate"
)

// sampledWorker is e.worker with the sampler's interval set.
func (e *nsEnv) sampledWorker(id string, interval time.Duration) *runningWorker {
	t := e.t
	t.Helper()
	events := make(chan SandboxEvent, 16)
	w, err := New(Config{ID: id, StateDir: filepath.Join(e.dir, id), Logger: slog.New(slog.DiscardHandler),
		Manager: sbxmanager.Config{SpacedHostPath: filepath.Join(nsBin, "spaced-host"), AgentPath: filepath.Join(nsBin, "spaced-guest"),
			NetgtwPath: "/nonexistent", StartTimeout: 60 * time.Second, SampleInterval: interval}},
		Deps{Substrates: []substrate.Substrate{e.sub}, Registrar: &fakeRegistrar{}, Bundles: staticBundle{capability.Bundle{Revision: 1, Keys: []capability.Key{{ID: "k1", Public: e.pub}}}},
			Sandboxes: chanWatcher{events}, Snapshots: e.snaps})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	var once sync.Once
	rw := &runningWorker{Worker: w, events: events, stop: func() { once.Do(func() { cancel(); <-done }) }}
	t.Cleanup(rw.stop)
	// Run delivers the key bundle: until then every capability is refused.
	waitFor(t, "the worker's key bundle", func() bool { return w.Verifier().Revision() >= 1 })
	return rw
}

// burn starts a busy loop in the sandbox and returns once it runs.
func (e *nsEnv) burn(w *runningWorker, r identity.Route) {
	e.t.Helper()
	proc := processpbconnect.NewProcessClient(e.client(r, capability.PurposeProcess), w.URL(), connect.WithProtoJSON())
	ctx, cancel := context.WithCancel(context.Background())
	e.t.Cleanup(cancel)
	stream, err := proc.Start(ctx, connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{
		Cmd: "/bin/sh", Args: []string{"-c", "while :; do :; done"}}}))
	if err != nil {
		e.t.Fatal(err)
	}
	if !stream.Receive() {
		e.t.Fatalf("process stream: %v", stream.Err())
	}
	e.t.Cleanup(func() { stream.Close() })
}

func (e *nsEnv) samples(w *runningWorker, r identity.Route, start, end time.Time) []spacev1.MetricsResponse {
	e.t.Helper()
	var out spacev1.MetricsRangeResponse
	if s := e.control(w, spacev1.NodePathMetricsRange, r, spacev1.MetricsRangeRequest{Route: r, Start: start, End: end}, &out); s != 200 {
		e.t.Fatalf("metrics range: %d", s)
	}
	return out.Samples
}

// The first sample of an execution is a real CPU delta: a sandbox that
// burns CPU reports it in the very first sample (no ticker sample yet:
// the interval is an hour, so the range call samples on demand).
func TestFirstSampleHasCPU(t *testing.T) {
	e := newNSEnv(t)
	w := e.sampledWorker("wm1", time.Hour)
	r := nsRoute(1, "wm1")
	if s := e.control(w, spacev1.NodePathInstall, r, spacev1.InstallRequest{Route: r, Template: "base"}, nil); s != 200 {
		t.Fatalf("install: %d", s)
	}
	e.burn(w, r)
	got := e.samples(w, r, time.Time{}, time.Time{})
	if len(got) != 1 || got[0].CPUUsedPct <= 0 || got[0].MemUsed <= 0 || got[0].Timestamp.IsZero() {
		t.Fatalf("first sample: %+v", got)
	}
	t.Logf("first sample: cpu %.1f%% mem %d disk %d", got[0].CPUUsedPct, got[0].MemUsed, got[0].DiskUsed)
	// It is kept: the next read returns the same sample.
	if again := e.samples(w, r, time.Time{}, time.Time{}); len(again) != 1 || again[0] != got[0] {
		t.Fatalf("not kept: %+v", again)
	}
}

// The sampler keeps a series; a window selects part of it, oldest first.
func TestSampledSeries(t *testing.T) {
	e := newNSEnv(t)
	const every = 300 * time.Millisecond
	w := e.sampledWorker("wm2", every)
	r := nsRoute(1, "wm2")
	if s := e.control(w, spacev1.NodePathInstall, r, spacev1.InstallRequest{Route: r, Template: "base"}, nil); s != 200 {
		t.Fatalf("install: %d", s)
	}
	e.burn(w, r)
	start := time.Now()
	var all []spacev1.MetricsResponse
	waitFor(t, "5 samples while burning", func() bool {
		all = e.samples(w, r, start, time.Time{})
		return len(all) >= 5
	})
	for i, s := range all {
		if i > 0 && !s.Timestamp.After(all[i-1].Timestamp) {
			t.Fatalf("not oldest first: %+v", all)
		}
		if s.CPUUsedPct <= 0 {
			t.Fatalf("sample %d of a busy sandbox: cpu %.1f%%", i, s.CPUUsedPct)
		}
	}
	mid := e.samples(w, r, all[1].Timestamp, all[3].Timestamp)
	if len(mid) != 3 || mid[0] != all[1] || mid[2] != all[3] {
		t.Fatalf("window [1,3]: %+v of %+v", mid, all)
	}
	// Another execution of the sandbox is not this one's: refused.
	r2 := nsRoute(2, "wm2")
	if s := e.control(w, spacev1.NodePathMetricsRange, r2, spacev1.MetricsRangeRequest{Route: r2}, nil); s/100 == 2 {
		t.Fatalf("another generation's samples: %d", s)
	}
}
