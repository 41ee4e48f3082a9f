package node

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/layerstore"
	"github.com/spacesbx/space/internal/netpolicy"
	"github.com/spacesbx/space/internal/oci"
	"github.com/spacesbx/space/internal/substrate"
)

// imageResolver pulls the OCI images of templates built fromImage into the
// host's layer store (shared by its workers: a layer is pulled once per
// host) and describes them for the substrates (sbxmanager.ImageResolver).
type imageResolver struct {
	st *layerstore.Store
	// insecure are the registries (host[:port]) an operator allows over
	// plain HTTP and on private addresses (a local registry).
	insecure []string
	lookup   func(ctx context.Context, host string) ([]netip.Addr, error)
}

func newImageResolver(dir string, insecure []string) (*imageResolver, error) {
	st, err := layerstore.New(layerstore.Config{Root: dir})
	if err != nil {
		return nil, fmt.Errorf("node: image store: %w", err)
	}
	lookup := func(ctx context.Context, host string) ([]netip.Addr, error) {
		return net.DefaultResolver.LookupNetIP(ctx, "ip", host)
	}
	return &imageResolver{st: st, insecure: insecure, lookup: lookup}, nil
}

// Resolve pulls src (layers already here are not fetched again).
func (r *imageResolver) Resolve(ctx context.Context, src spacev1.ImageSource) (*substrate.Image, error) {
	host := registryHost(src.Ref)
	listed := slices.Contains(r.insecure, host)
	if !listed {
		if err := r.checkPublic(ctx, host); err != nil {
			return nil, err
		}
	}
	img, err := oci.Pull(ctx, r.st, src.Ref, oci.PullOptions{Username: src.Username, Password: src.Password, Insecure: listed})
	if err != nil {
		return nil, err
	}
	out := &substrate.Image{Env: img.Env, WorkingDir: img.WorkingDir, User: img.User}
	h := sha256.New()
	for _, id := range img.Layers {
		dir, err := r.st.Dir(id)
		if err != nil {
			return nil, fmt.Errorf("image %s: layer %s: %w", src.Ref, id, err)
		}
		out.Layers = append(out.Layers, dir)
		h.Write([]byte(id + "\n"))
	}
	out.ID = "sha256:" + hex.EncodeToString(h.Sum(nil))
	return out, nil
}

// checkPublic refuses a registry on a loopback, private or link-local
// address unless the operator listed it: a ref is a user's input, and the
// worker must not become a way to reach the host's own services.
func (r *imageResolver) checkPublic(ctx context.Context, host string) error {
	name := host
	if h, _, err := net.SplitHostPort(host); err == nil {
		name = h
	}
	if name == "localhost" || strings.HasSuffix(name, ".localhost") {
		return fmt.Errorf("%w: registry %s is this host; an operator allows it with --insecure-registry", errdefs.ErrDenied, host)
	}
	addrs, err := r.lookup(ctx, name)
	if a, perr := netip.ParseAddr(strings.Trim(name, "[]")); perr == nil {
		addrs, err = []netip.Addr{a}, nil
	}
	if err != nil {
		return fmt.Errorf("%w: registry %s: %v", errdefs.ErrUnavailable, host, err)
	}
	// The egress policy's always-denied and private ranges (no private
	// range opened): what a sandbox may not reach, a registry ref may not
	// name either.
	for _, a := range addrs {
		if (netpolicy.Defaults{}).Reserved(a) {
			return fmt.Errorf("%w: registry %s is on a private address (%s); an operator allows it with --insecure-registry", errdefs.ErrDenied, host, a)
		}
	}
	return nil
}

// registryHost is the registry of an image reference, as docker names
// it: the first path element when it looks like a host, else Docker Hub.
func registryHost(ref string) string {
	first, _, found := strings.Cut(ref, "/")
	if !found || !(strings.ContainsAny(first, ".:") || first == "localhost") {
		return "index.docker.io"
	}
	return first
}
