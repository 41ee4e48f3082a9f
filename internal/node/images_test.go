package node

import (
	"context"
	"errors"
	"net/netip"
	"testing"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
)

func TestRegistryHost(t *testing.T) {
	for ref, want := range map[string]string{
		"debian:12":                       "index.docker.io",
		"library/debian:12":               "index.docker.io",
		"ghcr.io/org/img:1":               "ghcr.io",
		"127.0.0.1:5000/img":              "127.0.0.1:5000",
		"localhost/img":                   "localhost",
		"registry.local:443/a/b@sha256:x": "registry.local:443",
	} {
		if got := registryHost(ref); got != want {
			t.Errorf("%s: %s, want %s", ref, got, want)
		}
	}
}

// A registry on the host's own or a private address is refused unless
// the operator listed it: an image reference is a user's input.
func TestImageRegistryMustBePublic(t *testing.T) {
	r, err := newImageResolver(t.TempDir(), []string{"127.0.0.1:5000"})
	if err != nil {
		t.Fatal(err)
	}
	addrs := map[string]string{"metadata.example": "169.254.169.254", "lan.example": "10.1.2.3", "local.example": "127.0.0.2", "cgnat.example": "100.64.0.1", "v6.example": "::1"}
	r.lookup = func(_ context.Context, host string) ([]netip.Addr, error) {
		if a, ok := addrs[host]; ok {
			return []netip.Addr{netip.MustParseAddr(a)}, nil
		}
		return nil, errors.New("no such host")
	}
	for _, ref := range []string{"127.0.0.1:5001/img", "localhost:5000/img", "[::1]:5000/img", "metadata.example/img", "lan.example:5000/img", "local.example/img", "cgnat.example/img", "v6.example/img", "10.0.0.1/img"} {
		_, err := r.Resolve(t.Context(), spacev1.ImageSource{Ref: ref})
		if !errors.Is(err, errdefs.ErrDenied) {
			t.Errorf("%s: %v, want denied", ref, err)
		}
	}
	// The listed registry is not refused for its address (the pull then
	// fails: nothing listens there).
	if _, err := r.Resolve(t.Context(), spacev1.ImageSource{Ref: "127.0.0.1:5000/img"}); errors.Is(err, errdefs.ErrDenied) {
		t.Errorf("listed registry refused: %v", err)
	}
}
