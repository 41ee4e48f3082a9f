//go:build linux

package microvm

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/substrate"
)

// A state file is stateMagic, a big-endian uint32 length, that many bytes
// of JSON stateHeader, then QEMU's migration stream to the end. A layer
// state (layersave.go: an image VM's layer disk without its machine) has
// a version of its own, so a substrate that does not boot from one
// refuses it by its version rather than fail to load its machine.
const (
	stateMagic        = "SPACEVM\x00"
	stateVersion      = 1
	layerStateVersion = 2
	maxHeaderBytes    = 64 << 10
	stateFDName       = "space-state"
)

// stateHeader describes the machine a state was saved from; a restore
// must rebuild the same machine.
type stateHeader struct {
	Version int          `json:"version"`
	ImageID string       `json:"image_id"`
	Shape   machineShape `json:"shape"`
	CPU     string       `json:"cpu"`
	Accel   string       `json:"accel"`
	SavedAt time.Time    `json:"saved_at"`
	// RootDisk names an image VM's flattened image (its content hash:
	// guest memory caches its blocks); Layer says that the layer disk's
	// records (layerdisk.go) follow the header. Both nil for a busybox VM.
	RootDisk *rootDiskRef `json:"root_disk,omitempty"`
	Layer    *layerRef    `json:"layer,omitempty"`
}

type rootDiskRef struct {
	ImageID string `json:"image_id"`
	SHA256  string `json:"sha256"`
}

type layerRef struct {
	Size int64 `json:"size"`
}

func (h stateHeader) marshal() ([]byte, error) {
	j, err := json.Marshal(h)
	if err != nil {
		return nil, err
	}
	b := make([]byte, 0, len(stateMagic)+4+len(j))
	b = append(b, stateMagic...)
	b = binary.BigEndian.AppendUint32(b, uint32(len(j)))
	return append(b, j...), nil
}

// readHeader reads exactly the header from r (leaving r at the migration
// stream).
func readHeader(r io.Reader) (stateHeader, error) {
	var h stateHeader
	var pre [len(stateMagic) + 4]byte
	if _, err := io.ReadFull(r, pre[:]); err != nil {
		return h, fmt.Errorf("microvm: state header: %w", err)
	}
	if string(pre[:len(stateMagic)]) != stateMagic {
		return h, errors.New("microvm: not a microvm state file (bad magic)")
	}
	n := binary.BigEndian.Uint32(pre[len(stateMagic):])
	if n == 0 || n > maxHeaderBytes {
		return h, fmt.Errorf("microvm: state header length %d out of range", n)
	}
	j := make([]byte, n)
	if _, err := io.ReadFull(r, j); err != nil {
		return h, fmt.Errorf("microvm: state header: %w", err)
	}
	if err := json.Unmarshal(j, &h); err != nil {
		return h, fmt.Errorf("microvm: state header: %w", err)
	}
	if h.Version != stateVersion && h.Version != layerStateVersion {
		return h, fmt.Errorf("microvm: state format version %d, this substrate reads %d and %d", h.Version, stateVersion, layerStateVersion)
	}
	return h, nil
}

// openState opens a state file and reads its header; the file is left at
// the start of the migration stream.
func openState(path string) (*os.File, stateHeader, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, stateHeader{}, fmt.Errorf("microvm: restore: %w", err)
	}
	h, err := readHeader(f)
	if err != nil {
		f.Close()
		return nil, h, err
	}
	return f, h, nil
}

// checkHeader rejects a state this substrate cannot continue: another
// image (kernel, modules, busybox or agent differ), another CPU model or
// accelerator, or a spec whose explicit limits give another machine shape.
func (s *Substrate) checkHeader(h stateHeader, imageID string, specLim substrate.Limits, root *rootSpec) error {
	if h.ImageID != imageID {
		return fmt.Errorf("microvm: restore: state was saved from guest image %.16s…, this worker runs %.16s… (kernel, modules, busybox or agent differ)", h.ImageID, imageID)
	}
	switch {
	case root == nil && (h.RootDisk != nil || h.Layer != nil):
		return fmt.Errorf("microvm: restore: %w: state is of an image VM (%s), the spec names no image", errdefs.ErrInvalid, h.RootDisk.describe())
	case root != nil && (h.RootDisk == nil || h.Layer == nil):
		return fmt.Errorf("microvm: restore: %w: state is of a VM without an image, the spec names image %s", errdefs.ErrInvalid, root.img.ID)
	case root != nil && (h.RootDisk.ImageID != root.img.ID || h.RootDisk.SHA256 != root.disk.SHA256):
		return fmt.Errorf("microvm: restore: %w: state was saved on root disk %s, this worker's is %s (sha256 %.16s…)", errdefs.ErrConflict,
			h.RootDisk.describe(), root.img.ID, root.disk.SHA256)
	}
	if h.CPU != machineFor(s.accel, 0).cpu || h.Accel != s.accel {
		return fmt.Errorf("microvm: restore: state was saved with -cpu %s under %s, this worker runs -cpu %s under %s", h.CPU, h.Accel, machineFor(s.accel, 0).cpu, s.accel)
	}
	if h.Shape.VCPUs < 1 || h.Shape.VCPUs > MaxVCPUs || h.Shape.MemoryMiB < MinMemoryBytes>>20 || h.Shape.MemoryMiB > 1<<20 {
		return fmt.Errorf("microvm: restore: state header has an invalid shape %+v", h.Shape)
	}
	want := shapeOf(mergeLimits(specLim, substrate.Limits{MemoryBytes: h.Shape.MemoryMiB << 20, CPUMillis: int64(h.Shape.VCPUs) * 1000}))
	if want != h.Shape {
		return fmt.Errorf("microvm: restore: state is a %d MiB, %d vCPU machine; the spec asks for %d MiB, %d vCPU", h.Shape.MemoryMiB, h.Shape.VCPUs, want.MemoryMiB, want.VCPUs)
	}
	return nil
}

// SaveState writes the paused VM's complete state (memory, which holds
// the files too, vCPUs and devices) to w: the header, then QEMU's
// migration stream (QMP migrate to a pipe handed over with getfd). The VM
// stays paused; Resume continues it. It returns the bytes written.
func (i *instance) SaveState(ctx context.Context, w io.Writer) (int64, error) {
	return i.saveState(ctx, w, true)
}

// saveState is SaveState; withLayer false leaves an image VM's layer disk
// out (a template: its clones copy the disk file).
func (i *instance) saveState(ctx context.Context, w io.Writer, withLayer bool) (int64, error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if err := i.live(); err != nil {
		return 0, err
	}
	st, err := i.qmp.status(ctx)
	if err != nil {
		return 0, fmt.Errorf("microvm: save state: %w", err)
	}
	if st != "paused" && st != "postmigrate" {
		return 0, fmt.Errorf("microvm: save state: the vm must be paused, it is %q", st)
	}
	h := stateHeader{
		Version: stateVersion, ImageID: i.imageID, Shape: i.shape,
		CPU: machineFor(i.accel, 0).cpu, Accel: i.accel, SavedAt: time.Now().UTC(),
	}
	var layer *os.File
	if i.root != nil {
		h.RootDisk = &rootDiskRef{ImageID: i.root.ImageID, SHA256: i.root.SHA256}
		if withLayer {
			// QEMU drained and flushed the disk when the vCPUs stopped:
			// the file is what the guest's memory expects.
			if layer, err = os.Open(i.layerPath); err != nil {
				return 0, fmt.Errorf("microvm: save state: layer disk: %w", err)
			}
			defer layer.Close()
			fi, err := layer.Stat()
			if err != nil {
				return 0, err
			}
			h.Layer = &layerRef{Size: fi.Size()}
		}
	}
	hdr, err := h.marshal()
	if err != nil {
		return 0, err
	}
	if _, err := i.qmp.execute(ctx, "migrate-set-parameters", map[string]any{"max-bandwidth": int64(1) << 40}, nil); err != nil {
		return 0, fmt.Errorf("microvm: save state: %w", err)
	}
	nw, err := w.Write(hdr)
	nh := int64(nw)
	if err != nil {
		return nh, fmt.Errorf("microvm: save state: %w", err)
	}
	if layer != nil {
		n, err := writeLayer(w, layer, h.Layer.Size)
		nh += n
		if err != nil {
			return nh, fmt.Errorf("microvm: save state: %w", err)
		}
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		return nh, err
	}
	_, err = i.qmp.execute(ctx, "getfd", map[string]any{"fdname": stateFDName}, []int{int(pw.Fd())})
	pw.Close() // QEMU has its own copy; EOF comes when it closes it
	if err != nil {
		pr.Close()
		return nh, fmt.Errorf("microvm: save state: %w", err)
	}
	type result struct {
		n   int64
		err error
	}
	copied := make(chan result, 1)
	go func() { // owned: every path below waits for copied
		n, err := io.Copy(w, pr)
		copied <- result{n, err}
	}()
	finish := func(err error) (int64, error) {
		if err != nil {
			cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			_, _ = i.qmp.execute(cctx, "migrate_cancel", nil, nil)
			_, _ = i.qmp.execute(cctx, "closefd", map[string]any{"fdname": stateFDName}, nil)
			cancel()
			pr.Close()
		}
		var r result
		select {
		case r = <-copied:
		case <-ctx.Done():
			// QEMU did not close its end: cut the copy off.
			pr.Close()
			r = <-copied
			if err == nil {
				err = ctx.Err()
			}
		}
		pr.Close()
		if err == nil && r.err != nil {
			err = r.err
		}
		if err != nil {
			return nh + r.n, fmt.Errorf("microvm: save state: %w", err)
		}
		return nh + r.n, nil
	}
	if _, err := i.qmp.execute(ctx, "migrate", map[string]any{"uri": "fd:" + stateFDName}, nil); err != nil {
		return finish(err)
	}
	if _, err := i.pollMigration(ctx); err != nil {
		return finish(err)
	}
	return finish(nil)
}

// startIncoming starts loading a template's state (QEMU was started with
// -incoming defer) from QEMU's descriptor fd, with x-ignore-shared: the
// stream has no RAM pages, the RAM file holds them.
func (i *instance) startIncoming(ctx context.Context, fd int) error {
	if _, err := i.qmp.execute(ctx, "migrate-set-capabilities", map[string]any{
		"capabilities": []map[string]any{{"capability": "x-ignore-shared", "state": true}},
	}, nil); err != nil {
		return fmt.Errorf("clone: %w", err)
	}
	if _, err := i.qmp.execute(ctx, "migrate-incoming", map[string]any{"uri": fmt.Sprintf("fd:%d", fd)}, nil); err != nil {
		return fmt.Errorf("clone: %w", err)
	}
	return nil
}

// finishIncoming waits until QEMU has loaded the state given with
// -incoming, then continues the guest.
func (i *instance) finishIncoming(ctx context.Context) error {
	if _, err := i.pollMigration(ctx); err != nil {
		return fmt.Errorf("restore: %w", err)
	}
	st, err := i.qmp.status(ctx)
	if err != nil {
		return err
	}
	if st != "running" {
		if _, err := i.qmp.execute(ctx, "cont", nil, nil); err != nil {
			return fmt.Errorf("restore: %w", err)
		}
	}
	return nil
}

func (r *rootDiskRef) describe() string {
	if r == nil {
		return "none"
	}
	return fmt.Sprintf("%s (sha256 %.16s…)", r.ImageID, r.SHA256)
}
