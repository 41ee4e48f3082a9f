//go:build linux

package microvm

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/substrate"
)

// TestLayerRecordsRoundTrip: a sparse disk written as layer records reads
// back to the same bytes with the same holes.
func TestLayerRecordsRoundTrip(t *testing.T) {
	dir := t.TempDir()
	const size = 8 << 20
	src, err := os.Create(filepath.Join(dir, "src"))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if err := src.Truncate(size); err != nil {
		t.Fatal(err)
	}
	for _, off := range []int64{0, 1 << 20, 5<<20 + 4096, size - 4096} {
		if _, err := src.WriteAt(bytes.Repeat([]byte{byte(off>>12) | 1}, 4096), off); err != nil {
			t.Fatal(err)
		}
	}
	var buf bytes.Buffer
	n, err := writeLayer(&buf, src, size)
	if err != nil {
		t.Fatal(err)
	}
	if n != int64(buf.Len()) || n > 1<<20 {
		t.Fatalf("wrote %d bytes (buffer %d): holes were not skipped", n, buf.Len())
	}
	dst, err := os.Create(filepath.Join(dir, "dst"))
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Close()
	if err := readLayer(&buf, dst, size); err != nil {
		t.Fatal(err)
	}
	a, _ := os.ReadFile(src.Name())
	b, _ := os.ReadFile(dst.Name())
	if !bytes.Equal(a, b) {
		t.Fatal("restored disk differs")
	}
	fi, _ := dst.Stat()
	if fi.Size() != size {
		t.Fatalf("restored size %d", fi.Size())
	}
}

func layerRecord(off, n uint64, data []byte) []byte {
	b := binary.BigEndian.AppendUint64(nil, off)
	b = binary.BigEndian.AppendUint64(b, n)
	return append(b, data...)
}

// TestReadLayerRejects: records past the disk, out of order, overlapping
// or cut short are refused.
func TestReadLayerRejects(t *testing.T) {
	const size = 1 << 20
	end := layerRecord(0, 0, nil)
	for name, in := range map[string][]byte{
		"past the end":   append(layerRecord(size-10, 20, make([]byte, 20)), end...),
		"offset too big": append(layerRecord(size+1, 1, []byte{1}), end...),
		"wrapping":       append(layerRecord(^uint64(0)-1, 4, make([]byte, 4)), end...),
		"out of order":   append(append(layerRecord(4096, 1, []byte{1}), layerRecord(0, 1, []byte{1})...), end...),
		"overlapping":    append(append(layerRecord(0, 100, make([]byte, 100)), layerRecord(50, 1, []byte{1})...), end...),
		"cut short":      layerRecord(0, 100, make([]byte, 10)),
		"no end":         layerRecord(0, 1, []byte{1}),
		"empty":          nil,
	} {
		dst, err := os.Create(filepath.Join(t.TempDir(), "d"))
		if err != nil {
			t.Fatal(err)
		}
		if err := readLayer(bytes.NewReader(in), dst, size); err == nil {
			t.Errorf("%s: accepted", name)
		}
		dst.Close()
	}
}

func FuzzReadLayer(f *testing.F) {
	f.Add(append(layerRecord(0, 3, []byte("abc")), layerRecord(0, 0, nil)...))
	f.Add(layerRecord(1<<19, 1<<19, nil))
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, in []byte) {
		dst, err := os.Create(filepath.Join(dir, "d"))
		if err != nil {
			t.Fatal(err)
		}
		defer dst.Close()
		if err := readLayer(bytes.NewReader(in), dst, 1<<20); err == nil {
			if fi, _ := dst.Stat(); fi.Size() != 1<<20 {
				t.Fatalf("accepted input left a %d-byte disk", fi.Size())
			}
		}
	})
}

// TestCheckHeaderRootDisk: a state restores only as what it was saved
// from: an image VM's with that image's very disk, a busybox VM's without
// an image.
func TestCheckHeaderRootDisk(t *testing.T) {
	s := &Substrate{accel: "tcg"}
	img := &substrate.Image{ID: "sha256:a", Layers: []string{"/l"}}
	root := &rootSpec{img: img, disk: &rootDisk{ImageID: img.ID, SHA256: "11"}, layerSize: 64 << 20}
	h := stateHeader{Version: stateVersion, ImageID: "i", Shape: machineShape{MemoryMiB: 256, VCPUs: 1}, CPU: "max", Accel: "tcg"}
	if err := s.checkHeader(h, "i", substrate.Limits{}, nil); err != nil {
		t.Fatalf("busybox state: %v", err)
	}
	if err := s.checkHeader(h, "i", substrate.Limits{}, root); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("busybox state as an image VM: %v", err)
	}
	hi := h
	hi.RootDisk, hi.Layer = &rootDiskRef{ImageID: img.ID, SHA256: "11"}, &layerRef{Size: 64 << 20}
	if err := s.checkHeader(hi, "i", substrate.Limits{}, root); err != nil {
		t.Fatalf("image state: %v", err)
	}
	if err := s.checkHeader(hi, "i", substrate.Limits{}, nil); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("image state without an image: %v", err)
	}
	other := *root
	other.disk = &rootDisk{ImageID: img.ID, SHA256: "22"}
	if err := s.checkHeader(hi, "i", substrate.Limits{}, &other); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("image state on another build of the disk: %v", err)
	}
	noLayer := hi
	noLayer.Layer = nil
	if err := s.checkHeader(noLayer, "i", substrate.Limits{}, root); err == nil {
		t.Error("image state without its layer disk accepted")
	}
}

// TestImageSpecRejects: what an image VM cannot run is refused with a
// typed error before anything starts: a layer that is missing or not a
// directory, a layer disk below MinDiskBytes, volumes, a state whose layer
// disk size is out of range.
func TestImageSpecRejects(t *testing.T) {
	dir := t.TempDir()
	s := &Substrate{cfg: Config{StateDir: dir, RootDiskDir: filepath.Join(dir, "disks")}.withDefaults(), rootDisks: map[string]*rootDisk{}}
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := s.ensureRootDisk(&substrate.Image{ID: "sha256:gone", Layers: []string{filepath.Join(dir, "gone")}}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("missing layer: %v", err)
	}
	if _, err := s.ensureRootDisk(&substrate.Image{ID: "sha256:file", Layers: []string{file}}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("file as a layer: %v", err)
	}
	if err := s.PrepareImage(&substrate.Image{ID: "", Layers: []string{dir}}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("image without an id: %v", err)
	}
	img := &substrate.Image{ID: "sha256:a", Layers: []string{dir}}
	if _, err := s.rootFor(img, substrate.Limits{DiskBytes: MinDiskBytes - 1<<20}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("small layer disk: %v", err)
	}
	s.diskErr = errors.New("no overlay module")
	if _, err := s.rootFor(img, substrate.Limits{DiskBytes: DefaultDiskBytes}); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("kernel without the disk modules: %v", err)
	}
	agent := filepath.Join(dir, "agent")
	if err := os.WriteFile(agent, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	spec := substrate.Spec{Route: testRoute("v1"), Dir: filepath.Join(dir, "v1"), AgentPath: agent,
		Volumes: []substrate.VolumeMount{{Name: "v", Source: dir, Path: "/data"}}}
	if err := validateSpec(&spec); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("volumes: %v", err)
	}
	spec.Volumes, spec.Image = nil, &substrate.Image{ID: "sha256:a", Layers: []string{"relative"}}
	if err := validateSpec(&spec); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("bad image: %v", err)
	}
	st, err := os.Create(filepath.Join(dir, "state"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	for _, size := range []int64{0, MinDiskBytes - 1<<20, MaxDiskBytes + 1<<20, MinDiskBytes + 1} {
		if err := restoreLayer(st, filepath.Join(dir, "layer.img"), size); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("restore of a %d-byte layer disk: %v", size, err)
		}
	}
}
