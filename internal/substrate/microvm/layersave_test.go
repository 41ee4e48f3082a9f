//go:build linux

package microvm

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/substrate"
)

// sparseDisk makes a layer disk-sized sparse file at path with a few
// blocks of data.
func sparseDisk(t *testing.T, path string, size int64) {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	for _, off := range []int64{0, 3 << 20, size - 4096} {
		if _, err := f.WriteAt(bytes.Repeat([]byte{byte(off>>20) | 1}, 4096), off); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSaveLayerRoundTrip: a lost VM's layer disk is saved as a layer
// state (its own version, holes skipped) and restores to the same bytes;
// data after it is refused.
func TestSaveLayerRoundTrip(t *testing.T) {
	s := &Substrate{}
	dir := t.TempDir()
	const size = MinDiskBytes
	sparseDisk(t, filepath.Join(dir, LayerDiskName), size)
	if !s.HasLayer(dir) {
		t.Fatal("HasLayer false for a directory with a layer disk")
	}
	var buf bytes.Buffer
	n, err := s.SaveLayer(context.Background(), dir, &buf)
	if err != nil {
		t.Fatal(err)
	}
	if n != int64(buf.Len()) || n > 1<<20 {
		t.Fatalf("saved %d bytes (buffer %d): holes were not skipped", n, buf.Len())
	}
	state := filepath.Join(dir, "state")
	if err := os.WriteFile(state, buf.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	f, h, err := openState(state)
	if err != nil {
		t.Fatal(err)
	}
	if h.Version != layerStateVersion || h.Layer == nil || h.Layer.Size != size || h.RootDisk != nil {
		t.Fatalf("layer state header %+v", h)
	}
	if err := checkLayerState(h, &rootSpec{}); err != nil {
		t.Fatal(err)
	}
	restored := filepath.Join(dir, "restored.img")
	err = restoreLayerState(f, restored, h.Layer.Size)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	a, _ := os.ReadFile(filepath.Join(dir, LayerDiskName))
	b, _ := os.ReadFile(restored)
	if !bytes.Equal(a, b) {
		t.Fatal("restored disk differs from the saved one")
	}

	// Anything after the disk is not a layer state.
	if err := os.WriteFile(state, append(buf.Bytes(), 'x'), 0o600); err != nil {
		t.Fatal(err)
	}
	f, h, err = openState(state)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := restoreLayerState(f, restored, h.Layer.Size); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("layer state with trailing data: %v", err)
	}
	if _, err := os.Stat(restored); !os.IsNotExist(err) {
		t.Errorf("a refused restore left its disk: %v", err)
	}
}

// TestSaveLayerRejects: no disk, a disk whose QEMU was not seen to end (its
// adoption record is there), a disk whose lock another description holds
// (a live QEMU's), a link, or a file that is no layer disk are not saved,
// and a layer state does not boot a VM without an image or without a disk.
func TestSaveLayerRejects(t *testing.T) {
	s := &Substrate{}
	ctx := context.Background()
	save := func(dir string) error {
		_, err := s.SaveLayer(ctx, dir, io.Discard)
		return err
	}

	empty := t.TempDir()
	if s.HasLayer(empty) {
		t.Error("HasLayer true without a disk")
	}
	if err := save(empty); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("no disk: %v", err)
	}

	recorded := t.TempDir()
	sparseDisk(t, filepath.Join(recorded, LayerDiskName), MinDiskBytes)
	if err := os.WriteFile(filepath.Join(recorded, RecordName), []byte("{}"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := save(recorded); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("disk with its adoption record: %v", err)
	}

	held := t.TempDir()
	sparseDisk(t, filepath.Join(held, LayerDiskName), MinDiskBytes)
	vmm, err := os.OpenFile(filepath.Join(held, LayerDiskName), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := lockLayer(vmm); err != nil {
		t.Fatal(err)
	}
	if err := save(held); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("disk held by another description: %v", err)
	}
	// Nor can a second VM take it while the first holds it.
	lf := &launchFiles{}
	if err := lf.openDisks(filepath.Join(held, LayerDiskName), filepath.Join(held, LayerDiskName)); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("a second VM's disks opened on a held layer disk: %v", err)
	}
	lf.close()
	vmm.Close() // the VMM is gone: its lock with it
	if err := save(held); err != nil {
		t.Errorf("disk no longer held: %v", err)
	}

	linked := t.TempDir()
	if err := os.Symlink(filepath.Join(held, LayerDiskName), filepath.Join(linked, LayerDiskName)); err != nil {
		t.Fatal(err)
	}
	if s.HasLayer(linked) {
		t.Error("HasLayer true for a link")
	}
	if err := save(linked); err == nil || !errors.Is(err, syscall.ELOOP) {
		t.Errorf("disk that is a link: %v", err)
	}

	odd := t.TempDir()
	sparseDisk(t, filepath.Join(odd, LayerDiskName), MinDiskBytes+4096)
	if err := save(odd); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("disk of %d bytes: %v", MinDiskBytes+4096, err)
	}

	for name, h := range map[string]stateHeader{
		"no disk":    {Version: layerStateVersion},
		"small disk": {Version: layerStateVersion, Layer: &layerRef{Size: 1 << 20}},
	} {
		if err := checkLayerState(h, &rootSpec{}); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%s: %v", name, err)
		}
	}
	if err := checkLayerState(stateHeader{Version: layerStateVersion, Layer: &layerRef{Size: MinDiskBytes}}, nil); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("a layer state for a VM without an image: %v", err)
	}
}

// TestImageVMRecoversFromItsLayer: an image VM whose QEMU is killed left
// its files on its layer disk; the disk is not saved while QEMU runs,
// and once QEMU is gone a new VM boots cold on the saved disk, with the
// files and without the old processes (ProcessesKept false).
func TestImageVMRecoversFromItsLayer(t *testing.T) {
	s, agent, ctx := agentSubstrate(t)
	s.cfg.RootDiskDir = filepath.Join(t.TempDir(), "vm-images")
	img := testImage(t, t.TempDir())
	base := t.TempDir()
	spec := func(act string) substrate.Spec {
		return substrate.Spec{Route: testRoute(act), Template: "img", Dir: filepath.Join(base, act), AgentPath: agent, Image: img,
			Limits: substrate.Limits{DiskBytes: 128 << 20}}
	}
	sp1 := spec("l1")
	inst, err := s.Start(ctx, sp1)
	if err != nil {
		t.Fatal(err)
	}
	defer inst.Stop(context.Background())
	if inst.(substrate.RestoreReporter).ProcessesKept() {
		t.Error("a new VM says it kept processes")
	}
	a := activate(t, ctx, inst, sp1.Route)
	a.mustExec(t, ctx, "user", `echo survived > ~/kept; setsid sleep 99999 </dev/null >/dev/null 2>&1 & sync`)
	// The pattern does not match its own command line.
	const running = `for f in /proc/[0-9]*/cmdline; do tr '\0' ' ' <$f; echo; done | grep -c 'sleep 9999[9]'; true`
	if out := a.mustExec(t, ctx, "user", running); out != "1\n" {
		t.Fatalf("background process before the kill: %q", out)
	}
	a.close()

	// While QEMU runs, its disk is not read: by its record, and by its
	// lock when the record is out of the way.
	if _, err := s.SaveLayer(ctx, sp1.Dir, io.Discard); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("save of a running VM's disk: %v", err)
	}
	rec := filepath.Join(sp1.Dir, RecordName)
	if err := os.Rename(rec, rec+".away"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.SaveLayer(ctx, sp1.Dir, io.Discard); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("save of a disk QEMU holds: %v", err)
	}
	if err := os.Rename(rec+".away", rec); err != nil {
		t.Fatal(err)
	}

	if err := unix.Kill(inst.InitPID(), unix.SIGKILL); err != nil { // an OOM kill
		t.Fatal(err)
	}
	select {
	case <-inst.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("QEMU still running after SIGKILL")
	}
	if err := inst.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	state := filepath.Join(base, "layer.state")
	f, err := os.Create(state)
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	n, err := s.SaveLayer(ctx, sp1.Dir, f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("layer disk of the killed VM saved: %.1f MiB in %s", float64(n)/(1<<20), time.Since(t0).Round(time.Millisecond))

	// Not for a VM without an image.
	bad := spec("l2")
	bad.Image, bad.RestoreState = nil, state
	if i, err := s.Start(ctx, bad); err == nil {
		i.Stop(ctx)
		t.Fatal("a layer state booted a VM without an image")
	}

	sp3 := spec("l3")
	sp3.RestoreState = state
	t0 = time.Now()
	inst3, err := s.Start(ctx, sp3)
	if err != nil {
		t.Fatal(err)
	}
	defer inst3.Stop(context.Background())
	if inst3.(substrate.RestoreReporter).ProcessesKept() {
		t.Error("a VM booted from a layer state says it kept processes")
	}
	a3 := activate(t, ctx, inst3, sp3.Route)
	defer a3.close()
	t.Logf("VM booted on the saved layer activated %s after Start began", time.Since(t0).Round(time.Millisecond))
	if out := a3.mustExec(t, ctx, "user", "cat ~/kept; "+running); out != "survived\n0\n" {
		t.Errorf("after the recovery: %q, want the file and not the old process", out)
	}
	checkImageFiles(t, ctx, a3)
}

// FuzzLayerState: any input either restores as a layer disk of the size
// its header names, with nothing after it, or is refused and leaves no
// disk behind.
func FuzzLayerState(f *testing.F) {
	hdr := func(h stateHeader) []byte {
		b, err := h.marshal()
		if err != nil {
			f.Fatal(err)
		}
		return b
	}
	good := hdr(stateHeader{Version: layerStateVersion, Layer: &layerRef{Size: MinDiskBytes}})
	f.Add(append(append(good, layerRecord(4096, 3, []byte("abc"))...), layerRecord(0, 0, nil)...))
	f.Add(append(append(good, layerRecord(0, 0, nil)...), 'x'))
	f.Add(hdr(stateHeader{Version: layerStateVersion, Layer: &layerRef{Size: MinDiskBytes + 1}}))
	f.Add(hdr(stateHeader{Version: stateVersion, Layer: &layerRef{Size: MinDiskBytes}}))
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, in []byte) {
		src := filepath.Join(dir, "state")
		if err := os.WriteFile(src, in, 0o600); err != nil {
			t.Fatal(err)
		}
		dst := filepath.Join(dir, "layer.img")
		os.Remove(dst)
		f, h, err := openState(src)
		if err != nil {
			return
		}
		defer f.Close()
		if h.Version != layerStateVersion || checkLayerState(h, &rootSpec{}) != nil {
			return
		}
		if err := restoreLayerState(f, dst, h.Layer.Size); err != nil {
			if _, serr := os.Stat(dst); serr == nil {
				t.Fatalf("refused input (%v) left a disk", err)
			}
			return
		}
		if fi, err := os.Stat(dst); err != nil || fi.Size() != h.Layer.Size {
			t.Fatalf("accepted input left %v, %v; want a %d-byte disk", fi, err, h.Layer.Size)
		}
	})
}
