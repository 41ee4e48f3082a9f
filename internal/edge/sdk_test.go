package edge

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"net/http/httputil"
	"net/url"
	"testing"
	"time"

	"github.com/spacesbx/space/sdk"
	"github.com/spacesbx/space/sdk/sdktest"
)

// TestSDKThroughEdge drives the Go SDK (connect-go streaming, /files) through
// the edge to a node that verifies capabilities and then serves envd, and
// moves the sandbox between requests so the edge repairs the route.
func TestSDKThroughEdge(t *testing.T) {
	h := newHarness(t)
	envd := sdktest.New()
	defer envd.Close()
	c, err := sdk.New(sdk.Config{APIURL: envd.API.URL, SandboxURL: h.srv.URL, APIKey: sdktest.APIKey})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	sbx, err := c.CreateSandbox(ctx, sdk.CreateOptions{}) // not secure: the node sees no access token
	if err != nil {
		t.Fatal(err)
	}
	h.sandbox(sbx.ID)
	target, _ := url.Parse(envd.Edge.URL)
	rp := httputil.NewSingleHostReverseProxy(target)
	rp.FlushInterval = -1
	for _, p := range []string{"/process.Process/Start", "/process.Process/SendInput", "/filesystem.Filesystem/ListDir", "/files"} {
		h.node.handle(p, rp.ServeHTTP)
	}
	var out bytes.Buffer
	code, err := sbx.Run(ctx, "echo via edge", sdk.RunOptions{Stdout: &out})
	if err != nil || code != 0 || out.String() != "via edge\n" {
		t.Fatalf("run: %d %v %q", code, err, out.String())
	}
	if _, err := sbx.WriteFile(ctx, "/tmp/f", []byte("data")); err != nil {
		t.Fatal(err)
	}
	// The sandbox moves: every cached route is now stale.
	h.node.install(route(sbx.ID, 2))
	h.cp.setRoute(sbx.ID, route(sbx.ID, 2))
	got, err := sbx.ReadFile(ctx, "/tmp/f")
	if err != nil || string(got) != "data" {
		t.Fatalf("read after move: %q %v", got, err)
	}
	out.Reset()
	code, err = sbx.Exec(ctx, []string{"echo", "moved"}, sdk.RunOptions{Stdout: &out})
	if err != nil || code != 0 || out.String() != "moved\n" {
		t.Fatalf("exec after move: %d %v %q", code, err, out.String())
	}
	entries, err := sbx.ListDir(ctx, "/tmp")
	if err != nil || len(entries) != 1 {
		t.Fatalf("listdir: %v %v", entries, err)
	}
	if n := h.cp.repairs(); n != 2 {
		t.Fatalf("repairs = %d, want 2 (files, process; filesystem was first resolved after the move)", n)
	}
	// Unknown sandbox: typed error through the edge.
	_, err = c.Attach("nosuch", "").ListDir(ctx, "/")
	if se, ok := err.(*sdk.Error); !ok || se.Status != http.StatusBadGateway || !errors.Is(err, sdk.ErrNotFound) {
		t.Fatalf("unknown sandbox: %v", err)
	}
}
