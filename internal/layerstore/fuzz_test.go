//go:build linux

package layerstore

import (
	"archive/tar"
	"bytes"
	"errors"
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
	f.Fuzz(func(t *testing.T, data []byte) {
		base, _, dir := sentinelDir(t)
		before := treeState(t, base, true)
		delete(before, "layer")
		_, err := ApplyTar(dir, bytes.NewReader(data), ApplyOptions{MaxBytes: 1 << 20, MaxEntries: 512, MaxDepth: 32})
		if err != nil {
			var ae *ApplyError
			if !errors.As(err, &ae) && !strings.HasPrefix(err.Error(), "layer tar") {
				t.Fatalf("untyped error: %v", err)
			}
		}
		after := treeState(t, base, true)
		for k := range after {
			if k == "layer" || strings.HasPrefix(k, "layer/") {
				delete(after, k)
			}
		}
		if d := diffStates(before, after); len(d) > 0 {
			t.Fatalf("outside the layer changed:\n%s", strings.Join(d, "\n"))
		}
	})
}
