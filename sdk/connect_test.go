package sdk

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
)

// ConnectSandbox goes through the replicas like every control-plane call
// (it once built a client without them and crashed), and reports a resume
// from the 201.
func TestConnectSandboxResumed(t *testing.T) {
	for _, code := range []int{http.StatusOK, http.StatusCreated} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method != http.MethodPost || r.URL.Path != "/v2/sandboxes/sbx1/connect" {
				http.Error(w, "unexpected "+r.Method+" "+r.URL.Path, http.StatusNotFound)
				return
			}
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(code)
			w.Write([]byte(`{"sandboxID":"sbx1","templateID":"base","clientID":"x","envdVersion":"0.2.0","envdAccessToken":"tok"}`))
		}))
		c, err := New(Config{APIURL: "http://127.0.0.1:1," + srv.URL, SandboxURL: srv.URL, APIKey: "e2b_0000000000000000000000000000000000000000"})
		if err != nil {
			t.Fatal(err)
		}
		sbx, resumed, err := c.ConnectSandbox(context.Background(), "sbx1", 0)
		srv.Close()
		if err != nil || sbx == nil {
			t.Fatalf("connect (%d): %v", code, err)
		}
		if resumed != (code == http.StatusCreated) {
			t.Errorf("status %d: resumed %v", code, resumed)
		}
	}
}
