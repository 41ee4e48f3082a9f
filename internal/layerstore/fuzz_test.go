//go:build linux

package layerstore

import (
	"archive/tar"
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spacesbx/space/internal/testenv"
)

// FuzzApplyTar: whatever the tar, ApplyTar neither panics nor changes
// anything outside its directory, and refusals are *ApplyError or plain
// file system errors, never silent partial success outside.
func FuzzApplyTar(f *testing.F) {
	testenv.RequireRoot(f, "device nodes (whiteouts), chown, trusted.* xattrs")
	const fakeSentinel = "/fuzz/sentinel"
	for _, tc := range hostileCases() {
		ents := tc.ents(fakeSentinel)
		if tc.name == "huge-size" || tc.name == "truncated" {
			continue // unfinished tars: mkTar returns early, fine as seeds too
		}
		f.Add(mkTar(f, ents...))
	}
	f.Add(mkTar(f,
		tent{Name: "a/", Type: tar.TypeDir},
		tent{Name: "a/b", Body: "x", Xattrs: map[string]string{"user.k": "v", "security.capability": capV3(1)}},
		tent{Name: "a/l", Type: tar.TypeSymlink, Link: "../.."},
		tent{Name: "a/l/c", Body: "y"},
		tent{Name: "a/h", Type: tar.TypeLink, Link: "a/b"},
		tent{Name: "a/.wh.z", Body: ""},
		tent{Name: "a/.wh..wh..opq", Body: ""},
		tent{Name: "a/f", Type: tar.TypeFifo},
	))
	f.Add([]byte{})
	// One sentinel per worker and a fresh layer dir per input: the fuzzer
	// runs inputs thousands of times while minimizing, so an input must
	// be cheap. "../sentinel" from a layer dir is the real sentinel.
	base, sentinel, _ := sentinelDir(f)
	before := treeState(f, sentinel, true)
	f.Fuzz(func(t *testing.T, data []byte) {
		dir, err := os.MkdirTemp(base, "layer")
		if err != nil {
			t.Fatal(err)
		}
		defer os.RemoveAll(dir)
		_, err = ApplyTar(dir, bytes.NewReader(data), ApplyOptions{MaxBytes: 64 << 10, MaxEntries: 128, MaxDepth: 32})
		if err != nil {
			var ae *ApplyError
			if !errors.As(err, &ae) && !strings.HasPrefix(err.Error(), "layer tar") {
				t.Fatalf("untyped error: %v", err)
			}
		}
		if d := diffStates(before, treeState(t, sentinel, true)); len(d) > 0 {
			t.Fatalf("outside the layer changed:\n%s", strings.Join(d, "\n"))
		}
		ents, err := os.ReadDir(base)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ents {
			if n := e.Name(); n != "sentinel" && n != "layer" && n != filepath.Base(dir) {
				t.Fatalf("created outside the layer: %s", n)
			}
		}
	})
}
