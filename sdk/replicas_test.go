package sdk_test

import (
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/spacesbx/space/sdk"
	"github.com/spacesbx/space/sdk/sdktest"
)

// With several API URLs a call moves to the next replica when one is
// down; a POST is moved only when it reached nobody.
func TestAPIFailover(t *testing.T) {
	f := sdktest.New()
	t.Cleanup(f.Close)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "http://" + ln.Addr().String()
	ln.Close()
	var calls atomic.Int32
	unavailable := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	defer unavailable.Close()

	// Refused connection: any call moves on, a create included.
	c, err := sdk.New(sdk.Config{APIURL: dead + "," + f.API.URL, SandboxURL: f.Edge.URL, APIKey: sdktest.APIKey})
	if err != nil {
		t.Fatal(err)
	}
	sbx, err := c.CreateSandbox(ctx(t), sdk.CreateOptions{})
	if err != nil {
		t.Fatalf("create with the first replica down: %v", err)
	}
	if _, err := c.GetSandbox(ctx(t), sbx.ID); err != nil {
		t.Fatal(err)
	}

	// 503: a GET moves on, a POST does not (it may have been acted on).
	c2, err := sdk.New(sdk.Config{APIURL: unavailable.URL + "/, " + f.API.URL, SandboxURL: f.Edge.URL, APIKey: sdktest.APIKey})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c2.CreateSandbox(ctx(t), sdk.CreateOptions{}); err == nil || !errors.Is(err, sdk.ErrUnavailable) {
		t.Fatalf("POST answered 503 by the first replica: %v", err)
	}
	if calls.Load() != 1 {
		t.Fatalf("unavailable replica calls %d", calls.Load())
	}
	if _, err := c2.ListSandboxes(ctx(t)); err != nil {
		t.Fatalf("GET with the first replica unavailable: %v", err)
	}
	// The replica that answered is tried first from now on.
	if _, err := c2.CreateSandbox(ctx(t), sdk.CreateOptions{}); err != nil {
		t.Fatalf("create on the replica that answered: %v", err)
	}
	if calls.Load() != 2 {
		t.Fatalf("unavailable replica calls %d, want 2", calls.Load())
	}
	if _, err := sdk.New(sdk.Config{APIURL: f.API.URL + ",ftp://x"}); err == nil {
		t.Fatal("bad second URL accepted")
	}
}
