package sbxmanager

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/substrate"
)

// layerSubstrate saves whole states (as microvm does) and, like its image
// VMs, keeps each activation's files on a disk of its own (fakeDisk in the
// activation directory) that outlives the instance: substrate.LayerSaver.
// withoutDisk starts instances without one (a busybox VM: files in
// memory); held makes SaveLayer refuse as for a disk a live VMM holds.
type layerSubstrate struct {
	stateSubstrate
	withoutDisk bool
	held        bool
}

const (
	fakeDisk    = "disk"
	layerPrefix = "layer state: "
)

var _ substrate.LayerSaver = (*layerSubstrate)(nil)

func (s *layerSubstrate) Start(ctx context.Context, spec substrate.Spec) (substrate.Instance, error) {
	disk := fmt.Sprintf("files of %s generation %d", spec.Route.SandboxID, spec.Route.Generation)
	kept := spec.RestoreState != ""
	if kept {
		b, err := os.ReadFile(spec.RestoreState)
		if err != nil {
			return nil, err
		}
		if rest, ok := strings.CutPrefix(string(b), layerPrefix); ok {
			disk, kept = rest, false // boots with the saved files
		}
	}
	inst, err := s.stateSubstrate.Start(ctx, spec)
	if err != nil {
		return nil, err
	}
	if !s.withoutDisk {
		if err := os.WriteFile(filepath.Join(spec.Dir, fakeDisk), []byte(disk), 0o600); err != nil {
			return nil, err
		}
	}
	return &layerInstance{inst.(*stateInstance), kept}, nil
}

func (s *layerSubstrate) HasLayer(dir string) bool {
	_, err := os.Stat(filepath.Join(dir, fakeDisk))
	return err == nil
}

func (s *layerSubstrate) SaveLayer(_ context.Context, dir string, w io.Writer) (int64, error) {
	if s.held {
		return 0, fmt.Errorf("%w: disk held by a running VM", errdefs.ErrConflict)
	}
	b, err := os.ReadFile(filepath.Join(dir, fakeDisk))
	if err != nil {
		return 0, err
	}
	n, err := fmt.Fprintf(w, "%s%s", layerPrefix, b)
	return int64(n), err
}

type layerInstance struct {
	*stateInstance
	kept bool
}

func (i *layerInstance) ProcessesKept() bool { return i.kept }

// openLayerManager starts a manager on f's state dir that runs sub and
// reports lost executions on lost.
func openLayerManager(t *testing.T, f *lcFixture, sub substrate.Substrate, lost chan<- identity.Route) {
	t.Helper()
	m, err := New(Config{WorkerID: "w1", StateDir: f.dir, SpacedHostPath: spacedHost, AgentPath: "/nonexistent", NetgtwPath: "/nonexistent"},
		Deps{Substrates: []substrate.Substrate{sub}, WriteError: writeTestError, Verifier: f.ver, Snapshots: f.snaps,
			OnLost: func(r identity.Route) { lost <- r }})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(m)
	f.m, f.srv = m, srv
	t.Cleanup(func() { srv.Close(); m.Close() })
}

func auditHas(t *testing.T, dir, decision string) bool {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "audit.log"))
	if err != nil {
		t.Fatal(err)
	}
	return strings.Contains(string(b), `"decision":"`+decision+`"`)
}

// A VM whose process died while served but whose files are on a disk of
// its own is reported lost, its disk is its snapshot, and the new
// execution boots with those files (its processes restarted, which the
// install says).
func TestLostVMIsRecoveredFromItsDisk(t *testing.T) {
	sub := &layerSubstrate{}
	f := newLCFixtureOn(t, &sub.connectSubstrate, sub)
	f.crash()
	lost := make(chan identity.Route, 1)
	openLayerManager(t, f, sub, lost)
	ctx := context.Background()
	r1 := route("sbxl", 1)
	f.install(t, r1)
	if err := sub.last().Stop(ctx); err != nil { // its VMM dies
		t.Fatal(err)
	}
	select {
	case got := <-lost:
		if got != r1 {
			t.Fatalf("reported %s lost, want %s", got, r1)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a VM that died with its files on its disk was not reported lost")
	}
	resp, err := f.m.Snapshot(ctx, r1, "lay1")
	if err != nil {
		t.Fatalf("snapshot of the lost VM: %v", err)
	}
	if !auditHas(t, f.dir, "lost") || !auditHas(t, f.dir, "layer-saved") {
		t.Error("the loss and the disk's save are not audited")
	}
	want := layerPrefix + "files of sbxl generation 1"
	if resp.SizeBytes != int64(len(want)) {
		t.Fatalf("snapshot %+v, want the disk's %d bytes", resp, len(want))
	}
	r2 := route("sbxl", 2)
	ir, err := f.m.Install(ctx, spacev1.InstallRequest{Route: r2, Template: "base", RestoreSnapshot: "lay1"})
	if err != nil {
		t.Fatal(err)
	}
	if ir.ProcessesKept {
		t.Error("an install that booted from a saved disk says the processes were kept")
	}
	b, err := os.ReadFile(filepath.Join(f.m.records["sbxl"].Dir, fakeDisk))
	if err != nil || string(b) != "files of sbxl generation 1" {
		t.Fatalf("the new execution's disk holds %q (%v), want the lost one's files", b, err)
	}
	// A retried install of the same execution says the same.
	if ir, err := f.m.Install(ctx, spacev1.InstallRequest{Route: r2, Template: "base", RestoreSnapshot: "lay1"}); err != nil || ir.ProcessesKept {
		t.Fatalf("retried install: %+v %v", ir, err)
	}
}

// After a worker restart that nothing could be adopted from, a VM with its
// disk is reported lost; one whose files lived in its memory is audited as
// unrecoverable and neither reported nor snapshotted.
func TestLostVMsAfterARestart(t *testing.T) {
	for _, tc := range []struct {
		name        string
		withoutDisk bool
	}{{"disk", false}, {"memory", true}} {
		t.Run(tc.name, func(t *testing.T) {
			sub := &layerSubstrate{withoutDisk: tc.withoutDisk}
			f := newLCFixtureOn(t, &sub.connectSubstrate, sub)
			r1 := route("sbxr", 1)
			f.install(t, r1)
			f.crash()
			lost := make(chan identity.Route, 1)
			openLayerManager(t, f, sub, lost)
			got := f.m.Lost()
			_, err := f.m.Snapshot(context.Background(), r1, "lay1")
			if tc.withoutDisk {
				if len(got) != 0 {
					t.Fatalf("Lost() = %v for a VM whose files lived in its memory", got)
				}
				if !auditHas(t, f.dir, "unrecoverable") {
					t.Error("not audited as unrecoverable")
				}
				if !errors.Is(err, errdefs.ErrConflict) {
					t.Fatalf("snapshot of a VM without a disk: %v, want a conflict", err)
				}
				return
			}
			if len(got) != 1 || got[0] != r1 {
				t.Fatalf("Lost() = %v, want %s", got, r1)
			}
			if auditHas(t, f.dir, "unrecoverable") {
				t.Error("a VM with its disk audited as unrecoverable")
			}
			if err != nil {
				t.Fatalf("snapshot of the lost VM: %v", err)
			}
		})
	}
}

// A VM that dies without a disk is not reported lost (nothing would
// recover it) but audited; a disk the substrate will not read (a live VMM
// may hold it) is no snapshot.
func TestLostVMWithoutItsDiskIsNotRecovered(t *testing.T) {
	sub := &layerSubstrate{withoutDisk: true}
	f := newLCFixtureOn(t, &sub.connectSubstrate, sub)
	f.crash()
	lost := make(chan identity.Route, 1)
	openLayerManager(t, f, sub, lost)
	ctx := context.Background()
	r1 := route("sbxm", 1)
	f.install(t, r1)
	if err := sub.last().Stop(ctx); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for !auditHas(t, f.dir, "unrecoverable") {
		if time.Now().After(deadline) {
			t.Fatal("a VM that died with its files in its memory is not audited as unrecoverable")
		}
		time.Sleep(10 * time.Millisecond)
	}
	select {
	case r := <-lost:
		t.Fatalf("%s reported lost: nothing recovers it", r)
	case <-time.After(200 * time.Millisecond):
	}

	sub.withoutDisk, sub.held = false, true
	r2 := route("sbxh", 1)
	f.install(t, r2)
	if err := sub.last().Stop(ctx); err != nil {
		t.Fatal(err)
	}
	<-lost
	if _, err := f.m.Snapshot(ctx, r2, "held"); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("snapshot of a disk the substrate refuses: %v, want a conflict", err)
	}
	if _, err := f.snaps.Open(ctx, "held"); err == nil {
		t.Error("a refused save left a snapshot")
	}
}
