//go:build linux

// Package oci pulls container images (OCI and Docker v2 manifests and
// indexes, linux/amd64) from registries into a layerstore.Store, so a
// sandbox can run them as a stack of layers. Registries and images are
// untrusted: manifests, configs and blobs are verified against their
// digests, every layer's uncompressed content against the config's
// diffID, and a layer is published in the store only after all of that
// passed. A layer already in the store (any image's: layers are keyed by
// diffID) is not downloaded again.
package oci

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/klauspost/compress/zstd"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/layerstore"
)

// PullOptions are one pull's registry settings.
type PullOptions struct {
	// Username and Password are the registry credentials (E2B's
	// fromImageRegistry), used for HTTP basic auth and for the registry's
	// token flow; empty: anonymous. Never logged, never in errors.
	Username, Password string
	// Insecure allows plain HTTP (loopback tests, an operator's local
	// registry). Without it every request, token requests included, must
	// be HTTPS: go-containerregistry would otherwise fall back to HTTP for
	// loopback and private addresses on its own.
	Insecure bool
}

// Image is a pulled image.
type Image struct {
	// Ref is the reference asked for; Digest is the manifest pulled (the
	// linux/amd64 one when Ref names an index).
	Ref, Digest string
	// Layers are the layer ids (diffIDs), bottom first, all in the store.
	// An id may appear twice (images do repeat layers); all but the
	// topmost occurrence may be dropped from an overlay stack unchanged.
	Layers []string
	// Process defaults from the image config.
	Env        []string
	WorkingDir string
	User       string
	Entrypoint []string
	Cmd        []string
}

// Limits of a pull.
const (
	// MaxLayers is the most layers an image may have (Docker's own limit
	// is 127).
	MaxLayers = 256
	// maxTrailing is the most bytes a layer's uncompressed stream may
	// carry after the tar's end (normally only the record padding).
	maxTrailing = 1 << 20
	// zstdMaxWindow bounds a zstd decoder's memory.
	zstdMaxWindow = 128 << 20
	// MaxManifestSize and MaxConfigSize bound what is read into memory
	// from a registry (the distribution spec has registries accept
	// manifests up to 4 MiB).
	MaxManifestSize = 4 << 20
	MaxConfigSize   = 8 << 20
)

var platform = v1.Platform{OS: "linux", Architecture: "amd64"}

// Pull fetches ref's linux/amd64 image and stores its layers in st,
// returning the image with its layer ids and config. Errors are
// classified: errdefs.ErrInvalid (a bad reference, a digest or diffID
// mismatch, a hostile or malformed layer, an unsupported media type),
// ErrNotFound (no such repository, tag or platform), ErrDenied (the
// registry refused the credentials or their absence; a plain-HTTP
// registry without Insecure), ErrUnavailable (the registry unreachable,
// rate limiting, 5xx), ErrTooLarge (layer limits), ErrUpstream (other
// registry answers).
func Pull(ctx context.Context, st *layerstore.Store, ref string, opt PullOptions) (Image, error) {
	img, err := pull(ctx, st, ref, opt)
	if err != nil {
		return Image{}, fmt.Errorf("oci: pull %s: %w", ref, err)
	}
	return img, nil
}

func pull(ctx context.Context, st *layerstore.Store, ref string, opt PullOptions) (Image, error) {
	var nopts []name.Option
	if opt.Insecure {
		nopts = append(nopts, name.Insecure)
	}
	r, err := name.ParseReference(ref, nopts...)
	if err != nil {
		return Image{}, fmt.Errorf("%w: %w", errdefs.ErrInvalid, err)
	}
	tr := newTransport(opt.Insecure)
	defer tr.base.CloseIdleConnections()
	var auth authn.Authenticator = authn.Anonymous
	if opt.Username != "" || opt.Password != "" {
		auth = &authn.Basic{Username: opt.Username, Password: opt.Password}
	}
	puller, err := remote.NewPuller(remote.WithContext(ctx), remote.WithTransport(tr), remote.WithAuth(auth),
		remote.WithPlatform(platform), remote.WithUserAgent("space"))
	if err != nil {
		return Image{}, err
	}
	desc, err := puller.Get(ctx, r)
	if err != nil {
		return Image{}, classifyRemote(ctx, "manifest", err)
	}
	var im v1.Image
	switch {
	case desc.MediaType.IsIndex():
		im, err = platformImage(ctx, desc)
		if err != nil {
			return Image{}, err
		}
	case desc.MediaType.IsImage():
		if desc.MediaType == types.DockerManifestSchema1 || desc.MediaType == types.DockerManifestSchema1Signed {
			return Image{}, fmt.Errorf("%w: schema 1 manifests are not supported", errdefs.ErrInvalid)
		}
		im, err = desc.Image()
		if err != nil {
			return Image{}, classifyRemote(ctx, "manifest", err)
		}
	default:
		return Image{}, fmt.Errorf("%w: %s is not an image (media type %q)", errdefs.ErrInvalid, ref, desc.MediaType)
	}
	digest, err := im.Digest()
	if err != nil {
		return Image{}, classifyRemote(ctx, "manifest", err)
	}
	m, err := im.Manifest()
	if err != nil {
		return Image{}, classifyRemote(ctx, "manifest", err)
	}
	if m.Config.Size < 0 || m.Config.Size > MaxConfigSize {
		return Image{}, fmt.Errorf("%w: config of %d bytes (at most %d)", errdefs.ErrTooLarge, m.Config.Size, MaxConfigSize)
	}
	cfg, err := im.ConfigFile() // fetched by digest and verified
	if err != nil {
		return Image{}, classifyRemote(ctx, "config", err)
	}
	if (cfg.OS != "" && cfg.OS != platform.OS) || (cfg.Architecture != "" && cfg.Architecture != platform.Architecture) {
		return Image{}, fmt.Errorf("%w: image is %s/%s, want %s/%s", errdefs.ErrNotFound, cfg.OS, cfg.Architecture, platform.OS, platform.Architecture)
	}
	if len(m.Layers) > MaxLayers {
		return Image{}, fmt.Errorf("%w: %d layers (at most %d)", errdefs.ErrTooLarge, len(m.Layers), MaxLayers)
	}
	if len(m.Layers) != len(cfg.RootFS.DiffIDs) {
		return Image{}, fmt.Errorf("%w: manifest has %d layers, config %d diffIDs", errdefs.ErrInvalid, len(m.Layers), len(cfg.RootFS.DiffIDs))
	}
	out := Image{
		Ref: ref, Digest: digest.String(),
		Env: cfg.Config.Env, WorkingDir: cfg.Config.WorkingDir, User: cfg.Config.User,
		Entrypoint: cfg.Config.Entrypoint, Cmd: cfg.Config.Cmd,
	}
	var missing []int
	inImage := map[string]bool{}
	for i, ld := range m.Layers {
		diffID := cfg.RootFS.DiffIDs[i]
		if err := checkLayerDesc(ld, diffID); err != nil {
			return Image{}, fmt.Errorf("layer %d: %w", i, err)
		}
		id := diffID.String()
		out.Layers = append(out.Layers, id)
		if inImage[id] {
			continue
		}
		inImage[id] = true
		if _, err := st.Dir(id); err == nil {
			continue // in the store already: not downloaded again
		}
		missing = append(missing, i)
	}
	if err := fetchLayers(ctx, st, puller, r, m, cfg, missing); err != nil {
		return Image{}, err
	}
	return out, nil
}

// pullJobs is how many layers of one image are fetched at once.
const pullJobs = 3

// fetchLayers adds the layers at indexes missing to the store, pullJobs
// at a time; the first failure cancels the others.
func fetchLayers(ctx context.Context, st *layerstore.Store, p *remote.Puller, r name.Reference, m *v1.Manifest, cfg *v1.ConfigFile, missing []int) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	sem := make(chan struct{}, pullJobs)
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		cause error // the first failure; the others' are mostly its cancellation
	)
	fail := func(err error) {
		mu.Lock()
		if cause == nil {
			cause = err
		}
		mu.Unlock()
		cancel()
	}
	for _, i := range missing {
		ld, diffID := m.Layers[i], cfg.RootFS.DiffIDs[i]
		wg.Add(1)
		go func() {
			defer wg.Done()
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
				fail(ctx.Err())
				return
			}
			defer func() { <-sem }()
			id := diffID.String()
			_, err := st.Add(ctx, id, func(dir string) error {
				return fetchLayer(ctx, p, r.Context().Digest(ld.Digest.String()), ld, diffID, dir)
			})
			if err != nil {
				fail(fmt.Errorf("layer %s: %w", id, err))
			}
		}()
	}
	wg.Wait()
	return cause
}

// platformImage picks the linux/amd64 image of an index.
func platformImage(ctx context.Context, desc *remote.Descriptor) (v1.Image, error) {
	idx, err := desc.ImageIndex()
	if err != nil {
		return nil, classifyRemote(ctx, "index", err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		return nil, classifyRemote(ctx, "index", err)
	}
	for _, c := range im.Manifests {
		if c.Platform == nil || c.Platform.OS != platform.OS || c.Platform.Architecture != platform.Architecture || !c.MediaType.IsImage() {
			continue
		}
		img, err := idx.Image(c.Digest) // fetched by digest and verified
		if err != nil {
			return nil, classifyRemote(ctx, "manifest", err)
		}
		return img, nil
	}
	return nil, fmt.Errorf("%w: no %s/%s image in the index", errdefs.ErrNotFound, platform.OS, platform.Architecture)
}

// checkLayerDesc refuses layers this puller does not fetch: foreign
// (URLs elsewhere: the registry's manifest must not make us fetch other
// hosts), non-distributable, encrypted or otherwise unknown media types.
func checkLayerDesc(ld v1.Descriptor, diffID v1.Hash) error {
	switch ld.MediaType {
	case types.DockerLayer, types.DockerUncompressedLayer, types.OCILayer, types.OCILayerZStd, types.OCIUncompressedLayer:
	default:
		return fmt.Errorf("%w: unsupported layer media type %q", errdefs.ErrInvalid, ld.MediaType)
	}
	if len(ld.URLs) > 0 {
		return fmt.Errorf("%w: foreign layer (URLs)", errdefs.ErrInvalid)
	}
	if ld.Digest.Algorithm != "sha256" || diffID.Algorithm != "sha256" {
		return fmt.Errorf("%w: digests must be sha256", errdefs.ErrInvalid)
	}
	if ld.Size < 0 {
		return fmt.Errorf("%w: negative layer size", errdefs.ErrInvalid)
	}
	return nil
}

// fetchLayer downloads one layer blob into dir through ApplyTar, checking
// the blob's size and digest and the uncompressed stream's diffID. Any
// failure leaves dir to be discarded by Store.Add.
func fetchLayer(ctx context.Context, p *remote.Puller, ref name.Digest, ld v1.Descriptor, diffID v1.Hash, dir string) error {
	l, err := p.Layer(ctx, ref)
	if err != nil {
		return classifyRemote(ctx, "blob", err)
	}
	rc, err := l.Compressed()
	if err != nil {
		return classifyRemote(ctx, "blob", err)
	}
	defer rc.Close()
	// The blob is read only up to its declared size (plus one byte, to
	// see that it is longer).
	blob := newHashReader(ctx, io.LimitReader(rc, ld.Size+1))
	br := bufio.NewReaderSize(blob, 64<<10)
	magic, _ := br.Peek(4)
	var (
		ur      io.Reader
		closeUR func()
		derr    error
	)
	switch {
	case bytes.HasPrefix(magic, []byte{0x1f, 0x8b}):
		var gz *gzip.Reader
		gz, derr = gzip.NewReader(br)
		if derr == nil {
			ur, closeUR = gz, func() { gz.Close() }
		}
	case bytes.HasPrefix(magic, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		var zr *zstd.Decoder
		zr, derr = zstd.NewReader(br, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxWindow(zstdMaxWindow))
		if derr == nil {
			ur, closeUR = zr, zr.Close
		}
	default:
		ur, closeUR = br, func() {}
	}
	var applyErr error
	var tarHash *hashReader
	if derr == nil {
		tarHash = newHashReader(ctx, ur)
		_, applyErr = layerstore.ApplyTar(dir, tarHash, layerstore.ApplyOptions{})
		if applyErr == nil {
			// The diffID covers the tar's padding and anything after it.
			var n int64
			n, applyErr = io.Copy(io.Discard, io.LimitReader(tarHash, maxTrailing+1))
			if applyErr == nil && n > maxTrailing {
				applyErr = fmt.Errorf("%w: more than %d bytes after the tar's end", errdefs.ErrInvalid, maxTrailing)
			}
		}
		closeUR()
	}
	// Whatever happened above, read the blob to its end: its digest
	// decides first whether the registry served the blob the manifest
	// names (a tampered blob usually also breaks the decompressor or the
	// tar, and then says so less clearly).
	_, _ = io.Copy(io.Discard, blob)
	if blob.err != nil && transient(ctx, blob.err) {
		return classifyRemote(ctx, "blob", blob.err)
	}
	if blob.n != ld.Size {
		return fmt.Errorf("%w: blob %s is %d bytes or more, the manifest says %d", errdefs.ErrInvalid, ld.Digest, blob.n, ld.Size)
	}
	if got := blob.sum(); got != ld.Digest.String() {
		return fmt.Errorf("%w: blob digest mismatch: got %s, want %s", errdefs.ErrInvalid, got, ld.Digest)
	}
	if blob.err != nil {
		return fmt.Errorf("%w: blob: %w", errdefs.ErrInvalid, blob.err)
	}
	if derr != nil {
		return fmt.Errorf("%w: layer decompression: %w", errdefs.ErrInvalid, derr)
	}
	if applyErr != nil {
		var ae *layerstore.ApplyError
		if errors.As(applyErr, &ae) || errors.Is(applyErr, errdefs.ErrInvalid) {
			return applyErr
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		// A decompressor's complaint about an intact blob: the layer
		// itself is malformed.
		return fmt.Errorf("%w: layer: %w", errdefs.ErrInvalid, applyErr)
	}
	if got := tarHash.sum(); got != diffID.String() {
		return fmt.Errorf("%w: diffID mismatch: got %s, want %s", errdefs.ErrInvalid, got, diffID)
	}
	return nil
}

// hashReader hashes and counts what passes through it, remembers the
// first error other than EOF, and stops when ctx is done.
type hashReader struct {
	ctx context.Context
	r   io.Reader
	h   hash.Hash
	n   int64
	err error
}

func newHashReader(ctx context.Context, r io.Reader) *hashReader {
	return &hashReader{ctx: ctx, r: r, h: sha256.New()}
}

func (h *hashReader) Read(p []byte) (int, error) {
	if err := h.ctx.Err(); err != nil {
		if h.err == nil {
			h.err = err
		}
		return 0, err
	}
	n, err := h.r.Read(p)
	h.h.Write(p[:n])
	h.n += int64(n)
	if err != nil && err != io.EOF && h.err == nil {
		h.err = err
	}
	return n, err
}

func (h *hashReader) sum() string { return "sha256:" + hex.EncodeToString(h.h.Sum(nil)) }

// transient reports whether err is the transfer failing (network, a
// deadline, cancellation) rather than the bytes being wrong.
func transient(ctx context.Context, err error) bool {
	if ctx.Err() != nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	var ne net.Error
	if errors.As(err, &ne) {
		return true
	}
	return errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed)
}

// classifyRemote gives a registry error its class, keeping the cause.
func classifyRemote(ctx context.Context, what string, err error) error {
	if cerr := ctx.Err(); cerr != nil {
		return fmt.Errorf("%s: %w", what, cerr)
	}
	for _, c := range []error{errdefs.ErrDenied, errdefs.ErrInvalid, errdefs.ErrNotFound, errdefs.ErrTooLarge} {
		if errors.Is(err, c) {
			return fmt.Errorf("%s: %w", what, err)
		}
	}
	var te *transport.Error
	if errors.As(err, &te) {
		for _, d := range te.Errors {
			switch d.Code {
			case transport.UnauthorizedErrorCode, transport.DeniedErrorCode:
				return fmt.Errorf("%s: %w: %w", what, errdefs.ErrDenied, err)
			case transport.ManifestUnknownErrorCode, transport.NameUnknownErrorCode, transport.BlobUnknownErrorCode:
				return fmt.Errorf("%s: %w: %w", what, errdefs.ErrNotFound, err)
			case transport.TooManyRequestsErrorCode, transport.UnavailableErrorCode:
				return fmt.Errorf("%s: %w: %w", what, errdefs.ErrUnavailable, err)
			}
		}
		switch {
		case te.StatusCode == http.StatusUnauthorized || te.StatusCode == http.StatusForbidden:
			return fmt.Errorf("%s: %w: %w", what, errdefs.ErrDenied, err)
		case te.StatusCode == http.StatusNotFound:
			return fmt.Errorf("%s: %w: %w", what, errdefs.ErrNotFound, err)
		case te.StatusCode == http.StatusTooManyRequests || te.StatusCode >= 500:
			return fmt.Errorf("%s: %w: %w", what, errdefs.ErrUnavailable, err)
		}
		return fmt.Errorf("%s: %w: %w", what, errdefs.ErrUpstream, err)
	}
	if transient(ctx, err) {
		return fmt.Errorf("%s: %w: %w", what, errdefs.ErrUnavailable, err)
	}
	if strings.Contains(err.Error(), "error verifying") || strings.Contains(err.Error(), "unexpected media type") {
		// go-containerregistry's digest/size checks (its error type is
		// internal).
		return fmt.Errorf("%s: %w: %w", what, errdefs.ErrInvalid, err)
	}
	return fmt.Errorf("%s: %w: %w", what, errdefs.ErrUpstream, err)
}

// httpsOnly refuses plain-HTTP requests unless the pull is Insecure.
type httpsOnly struct {
	base     *http.Transport
	insecure bool
}

func newTransport(insecure bool) *httpsOnly {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.Proxy = nil // the platform's own network settings, not the environment's
	t.ResponseHeaderTimeout = 60 * time.Second
	t.TLSHandshakeTimeout = 15 * time.Second
	t.MaxIdleConnsPerHost = 4
	return &httpsOnly{base: t, insecure: insecure}
}

func (t *httpsOnly) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Scheme != "https" && !t.insecure {
		if req.Body != nil {
			req.Body.Close()
		}
		return nil, fmt.Errorf("%w: plain-HTTP request to %s refused (not an insecure pull)", errdefs.ErrDenied, req.URL.Host)
	}
	resp, err := t.base.RoundTrip(req)
	if err == nil && strings.Contains(req.URL.Path, "/manifests/") {
		resp.Body = &limitedBody{ReadCloser: resp.Body, left: MaxManifestSize}
	}
	return resp, err
}

// limitedBody fails a response body longer than its limit (instead of
// truncating it: a cut manifest must not parse as a smaller one).
type limitedBody struct {
	io.ReadCloser
	left int64
}

func (b *limitedBody) Read(p []byte) (int, error) {
	if int64(len(p)) > b.left+1 {
		p = p[:b.left+1]
	}
	n, err := b.ReadCloser.Read(p)
	b.left -= int64(n)
	if b.left < 0 {
		return 0, fmt.Errorf("%w: manifest larger than %d bytes", errdefs.ErrTooLarge, MaxManifestSize)
	}
	return n, err
}
