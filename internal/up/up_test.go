package up

// Integration tests through the full request path: SDK or raw HTTP ->
// space-edge -> node-api -> sbx-manager -> spaced-host -> spaced-guest in a
// real namespace sandbox, on the platform TestMain starts once (embedded
// etcd, control plane, two workers, edge).

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	filesystempb "github.com/spacesbx/space/api/envd/filesystem"
	"github.com/spacesbx/space/api/envd/filesystem/filesystempbconnect"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/sdk"
)

// ---- helpers ----

func ctxFor(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func sha256Hex(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

func randHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

func newClient(t *testing.T) *sdk.Client {
	t.Helper()
	c, err := sdk.New(sdk.Config{APIURL: plat.APIURL, SandboxURL: plat.SandboxURL, APIKey: plat.APIKey,
		HTTPClient: &http.Client{Transport: testTransport}})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// newSandbox creates a secure sandbox (data-plane calls need its access
// token) that is killed when the test ends.
func newSandbox(t *testing.T) *sdk.Sandbox {
	t.Helper()
	c := newClient(t)
	sbx, err := c.CreateSandbox(ctxFor(t, 30*time.Second), sdk.CreateOptions{Secure: true, Timeout: 5 * time.Minute})
	if err != nil {
		t.Fatalf("create sandbox: %v", err)
	}
	if sbx.AccessToken == "" {
		t.Fatalf("secure sandbox %s has no access token", sbx.ID)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		if err := c.KillSandbox(ctx, sbx.ID); err != nil && !errors.Is(err, sdk.ErrNotFound) {
			t.Errorf("kill %s: %v", sbx.ID, err)
		}
	})
	return sbx
}

type result struct {
	stdout, stderr string
	code           int
	err            error
}

func run(ctx context.Context, sbx *sdk.Sandbox, cmd, user string) result {
	var out, errb bytes.Buffer
	code, err := sbx.Run(ctx, cmd, sdk.RunOptions{User: user, Stdout: &out, Stderr: &errb})
	return result{stdout: out.String(), stderr: errb.String(), code: code, err: err}
}

// mustRun runs cmd and fails the test if the call itself fails (a non-zero
// exit code is a result, not a failure).
func mustRun(t *testing.T, sbx *sdk.Sandbox, cmd, user string) result {
	t.Helper()
	r := run(ctxFor(t, 30*time.Second), sbx, cmd, user)
	if r.err != nil {
		t.Fatalf("run %q as %q: %v (stdout %q, stderr %q)", cmd, user, r.err, r.stdout, r.stderr)
	}
	return r
}

// assertServing checks that the sandbox (and so the whole path) still
// answers after something hostile.
func assertServing(t *testing.T, sbx *sdk.Sandbox) {
	t.Helper()
	word := "alive-" + randHex(4)
	r := mustRun(t, sbx, "echo "+word, "")
	if r.stdout != word+"\n" || r.code != 0 {
		t.Fatalf("sandbox %s no longer serves: stdout %q code %d stderr %q", sbx.ID, r.stdout, r.code, r.stderr)
	}
}

// sdkStatus returns the HTTP status of an SDK error (0 if none).
func sdkStatus(err error) int {
	var e *sdk.Error
	if errors.As(err, &e) {
		return e.Status
	}
	return 0
}

type response struct {
	status int
	header http.Header
	body   []byte
}

func do(t *testing.T, method, u string, body io.Reader, hdr map[string]string) response {
	t.Helper()
	req, err := http.NewRequestWithContext(ctxFor(t, 30*time.Second), method, u, body)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	res, err := (&http.Client{Transport: testTransport}).Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, u, err)
	}
	defer res.Body.Close()
	b, err := io.ReadAll(io.LimitReader(res.Body, 8<<20))
	if err != nil {
		t.Fatalf("%s %s: read body: %v", method, u, err)
	}
	return response{status: res.StatusCode, header: res.Header, body: b}
}

// wantJSONError asserts a typed SPACE/E2B error: the status and a JSON body
// {code: status, message: non-empty}.
func wantJSONError(t *testing.T, what string, r response, status int) spacev1.Error {
	t.Helper()
	if r.status != status {
		t.Fatalf("%s: status %d, want %d (body %s)", what, r.status, status, r.body)
	}
	if ct := r.header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		t.Errorf("%s: Content-Type %q, want application/json", what, ct)
	}
	var e spacev1.Error
	if err := json.Unmarshal(r.body, &e); err != nil {
		t.Fatalf("%s: error body is not JSON: %v (%q)", what, err, r.body)
	}
	if e.Code != status || e.Message == "" {
		t.Fatalf("%s: error body %+v, want code %d and a message", what, e, status)
	}
	return e
}

// capabilityFor asks the control plane for a capability as the owner.
func capabilityFor(t *testing.T, id, purpose string) spacev1.CapabilityResponse {
	t.Helper()
	body, _ := json.Marshal(spacev1.CapabilityRequest{Purpose: purpose})
	r := do(t, http.MethodPost, plat.APIURL+"/space/v1/sandboxes/"+id+"/capabilities", bytes.NewReader(body),
		map[string]string{"X-API-Key": plat.APIKey, "Content-Type": "application/json"})
	if r.status != http.StatusOK {
		t.Fatalf("capability for %s: %d %s", id, r.status, r.body)
	}
	var cr spacev1.CapabilityResponse
	if err := json.Unmarshal(r.body, &cr); err != nil {
		t.Fatal(err)
	}
	if cr.Token == "" || cr.NodeURL == "" || cr.Route.SandboxID != id {
		t.Fatalf("capability for %s: incomplete answer %+v", id, cr)
	}
	return cr
}

func listWorkers(t *testing.T) []spacev1.Worker {
	t.Helper()
	r := do(t, http.MethodGet, plat.APIURL+"/space/v1/workers", nil, map[string]string{"X-API-Key": plat.APIKey})
	if r.status != http.StatusOK {
		t.Fatalf("list workers: %d %s", r.status, r.body)
	}
	var ws []spacev1.Worker
	if err := json.Unmarshal(r.body, &ws); err != nil {
		t.Fatal(err)
	}
	if len(ws) != 2 {
		t.Fatalf("workers: %+v, want 2", ws)
	}
	return ws
}

// nodeGet sends a request straight to a node-api with a capability.
func nodeGet(t *testing.T, nodeURL, token, pathQuery string, extra map[string]string) response {
	t.Helper()
	hdr := map[string]string{spacev1.HeaderCapability: token}
	for k, v := range extra {
		hdr[k] = v
	}
	return do(t, http.MethodGet, nodeURL+pathQuery, nil, hdr)
}

// tamper flips one character in the middle of the token's signed payload
// (it stays valid base64url, so only the signature check can catch it).
func tamper(t *testing.T, tok string) string {
	t.Helper()
	parts := strings.SplitN(tok, ".", 4)
	if len(parts) < 3 || parts[0] != "v4" || parts[1] != "public" {
		t.Fatalf("capability is not a PASETO v4.public token: %.20q", tok)
	}
	p := []byte(parts[2])
	i := len(p) / 2
	if p[i] == 'A' {
		p[i] = 'B'
	} else {
		p[i] = 'A'
	}
	parts[2] = string(p)
	out := strings.Join(parts, ".")
	if out == tok {
		t.Fatal("tamper changed nothing")
	}
	return out
}

// cgroupValue reads a cgroup file of the sandbox's activation from the
// host side (v1: per controller; v2: unified), under the cgroup parent of
// whichever worker runs it (node.NSCgroupParent).
func cgroupValue(t *testing.T, sandboxID, controller, file string) string {
	t.Helper()
	base := filepath.Join("/sys/fs/cgroup", controller)
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err == nil {
		base = "/sys/fs/cgroup"
	}
	dirs, _ := filepath.Glob(filepath.Join(base, "space", "*", sandboxID+"-*")) // node.NSCgroupParent
	if len(dirs) != 1 {
		t.Fatalf("cgroup of %s under %s: found %v", sandboxID, base, dirs)
	}
	b, err := os.ReadFile(filepath.Join(dirs[0], file))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// ---- tests ----

func TestExec(t *testing.T) {
	sbx := newSandbox(t)

	r := mustRun(t, sbx, "echo hello", "")
	if r.stdout != "hello\n" || r.code != 0 {
		t.Fatalf("echo hello: stdout %q code %d stderr %q", r.stdout, r.code, r.stderr)
	}
	r = mustRun(t, sbx, "echo to-stderr >&2; exit 7", "")
	if r.code != 7 || r.stderr != "to-stderr\n" || r.stdout != "" {
		t.Fatalf("exit 7: code %d stdout %q stderr %q", r.code, r.stdout, r.stderr)
	}
	r = mustRun(t, sbx, "false", "")
	if r.code != 1 {
		t.Fatalf("false: code %d", r.code)
	}
	// Commands run as user (uid 1000, home /home/user) by default.
	r = mustRun(t, sbx, `echo "$(id -u) $(id -un) $HOME $(pwd)"`, "")
	if r.stdout != "1000 user /home/user /home/user\n" {
		t.Fatalf("default user: %q (stderr %q)", r.stdout, r.stderr)
	}
	r = mustRun(t, sbx, `echo "$(id -u) $(id -un)"`, "root")
	if r.stdout != "0 root\n" {
		t.Fatalf("root: %q (stderr %q)", r.stdout, r.stderr)
	}
	// An unknown user is a clear error, not a silent fallback.
	if r := run(ctxFor(t, 30*time.Second), sbx, "id -u", "nobody-"+randHex(2)); r.err == nil {
		t.Fatalf("unknown user ran: %q code %d", r.stdout, r.code)
	}
	// Environment and argv pass through unchanged (no shell).
	var out bytes.Buffer
	code, err := sbx.Exec(ctxFor(t, 30*time.Second), []string{"/usr/bin/printf", "%s|%s", "a b", "$X"},
		sdk.RunOptions{Stdout: &out, Envs: map[string]string{"X": "unused"}})
	if err != nil || code != 0 || out.String() != "a b|$X" {
		t.Fatalf("exec argv: %q code %d err %v", out.String(), code, err)
	}
}

func TestFiles(t *testing.T) {
	sbx := newSandbox(t)
	ctx := ctxFor(t, 30*time.Second)

	text := []byte("hello from the test\n")
	if _, err := sbx.WriteFile(ctx, "/home/user/dir/hello.txt", text); err != nil {
		t.Fatalf("write: %v", err)
	}
	blob := make([]byte, 4096)
	rand.Read(blob)
	if _, err := sbx.WriteFile(ctx, "/home/user/dir/blob.bin", blob); err != nil {
		t.Fatalf("write blob: %v", err)
	}
	got, err := sbx.ReadFile(ctx, "/home/user/dir/hello.txt")
	if err != nil || !bytes.Equal(got, text) {
		t.Fatalf("read back: %q, %v", got, err)
	}
	got, err = sbx.ReadFile(ctx, "/home/user/dir/blob.bin")
	if err != nil || !bytes.Equal(got, blob) {
		t.Fatalf("read back blob: %d bytes equal=%v, %v", len(got), bytes.Equal(got, blob), err)
	}
	// The file is really in the sandbox (seen by a process there), owned by
	// the default user.
	r := mustRun(t, sbx, "sha256sum /home/user/dir/blob.bin | cut -d' ' -f1; stat -c %U /home/user/dir/hello.txt", "")
	if want := sha256Hex(blob) + "\nuser\n"; r.stdout != want {
		t.Fatalf("in-sandbox view: %q, want %q", r.stdout, want)
	}
	entries, err := sbx.ListDir(ctx, "/home/user/dir")
	if err != nil {
		t.Fatalf("list: %v", err)
	}
	seen := map[string]sdk.EntryInfo{}
	for _, e := range entries {
		seen[e.Name] = e
	}
	if e, ok := seen["hello.txt"]; !ok || e.Type != "file" || e.Size != int64(len(text)) || e.Path != "/home/user/dir/hello.txt" {
		t.Fatalf("ListDir hello.txt: %+v (all %+v)", e, entries)
	}
	if e, ok := seen["blob.bin"]; !ok || e.Size != 4096 {
		t.Fatalf("ListDir blob.bin: %+v", e)
	}
	if len(entries) != 2 {
		t.Fatalf("ListDir: %d entries, want 2: %+v", len(entries), entries)
	}
	// A missing file is a typed not-found.
	if _, err := sbx.ReadFile(ctx, "/home/user/dir/missing"); !errors.Is(err, sdk.ErrNotFound) {
		t.Fatalf("missing file: %v", err)
	}
}

func TestPTY(t *testing.T) {
	sbx := newSandbox(t)
	ctx := ctxFor(t, 30*time.Second)
	p, err := sbx.PTY(ctx, 24, 80)
	if err != nil {
		t.Fatalf("pty: %v", err)
	}
	defer p.Close()
	if err := p.Resize(ctx, 30, 100); err != nil {
		t.Fatalf("resize: %v", err)
	}
	// printf's output "pty-ok" differs from the echoed input, so seeing it
	// proves the command ran; stty reports the resized window.
	if _, err := p.Write([]byte("stty size; printf 'pty-%s\\n' ok; exit\n")); err != nil {
		t.Fatalf("pty write: %v", err)
	}
	out, err := io.ReadAll(p) // until the shell exits
	if err != nil {
		t.Fatalf("pty read: %v (so far %q)", err, out)
	}
	if !bytes.Contains(out, []byte("pty-ok")) {
		t.Fatalf("pty output lacks pty-ok: %q", out)
	}
	if !bytes.Contains(out, []byte("30 100")) {
		t.Fatalf("pty output lacks the resized size 30 100: %q", out)
	}
	if code, err := p.Wait(); err != nil || code != 0 {
		t.Fatalf("pty exit: %d, %v", code, err)
	}
}

// headerTransport addresses every request to one sandbox through the edge.
type headerTransport struct {
	base http.RoundTripper
	hdr  map[string]string
}

func (h headerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	for k, v := range h.hdr {
		r.Header.Set(k, v)
	}
	return h.base.RoundTrip(r)
}

func TestWatchDir(t *testing.T) {
	sbx := newSandbox(t)
	ctx := ctxFor(t, 30*time.Second)
	mustRun(t, sbx, "mkdir -p /home/user/watched", "")

	hc := &http.Client{Transport: headerTransport{base: testTransport, hdr: map[string]string{
		"E2b-Sandbox-Id": sbx.ID, "E2b-Sandbox-Port": "49983", "X-Access-Token": sbx.AccessToken}}}
	fs := filesystempbconnect.NewFilesystemClient(hc, plat.SandboxURL, connect.WithProtoJSON())
	stream, err := fs.WatchDir(ctx, connect.NewRequest(&filesystempb.WatchDirRequest{Path: "/home/user/watched", IncludeEntry: true}))
	if err != nil {
		t.Fatalf("watch: %v", err)
	}
	defer stream.Close()
	if !stream.Receive() || stream.Msg().GetStart() == nil {
		t.Fatalf("no start event: %v", stream.Err())
	}
	if got := stream.ResponseHeader().Get(spacev1.HeaderExecution); !strings.HasPrefix(got, sbx.ID+"/") {
		t.Errorf("watch response %s = %q, want this sandbox's execution", spacev1.HeaderExecution, got)
	}
	mustRun(t, sbx, "echo x > /home/user/watched/created.txt", "")
	for stream.Receive() {
		ev := stream.Msg().GetFilesystem()
		if ev == nil {
			continue
		}
		if ev.GetName() == "created.txt" && ev.GetType() == filesystempb.EventType_EVENT_TYPE_CREATE {
			if p := ev.GetEntry().GetPath(); p != "/home/user/watched/created.txt" {
				t.Errorf("create event entry path %q", p)
			}
			return
		}
	}
	t.Fatalf("no create event for created.txt: %v", stream.Err())
}

func TestCapabilityAtNodeAPI(t *testing.T) {
	sbx := newSandbox(t)
	cr := capabilityFor(t, sbx.ID, "files")
	ws := listWorkers(t)
	var other string
	found := false
	for _, w := range ws {
		if w.NodeURL == cr.NodeURL {
			found = true
			if w.ID != cr.Route.WorkerID {
				t.Fatalf("node %s is worker %s, capability names %s", w.NodeURL, w.ID, cr.Route.WorkerID)
			}
		} else {
			other = w.NodeURL
		}
	}
	if !found || other == "" {
		t.Fatalf("capability node %s not among workers %+v", cr.NodeURL, ws)
	}
	const path = "/files?path=/etc/hostname"

	// The untampered capability is admitted and reaches exactly this
	// execution.
	r := nodeGet(t, cr.NodeURL, cr.Token, path, nil)
	if r.status != http.StatusOK || len(r.body) == 0 {
		t.Fatalf("untampered: %d %q", r.status, r.body)
	}
	if got, want := r.header.Get(spacev1.HeaderExecution), cr.Route.ExecutionLabel(); got != want {
		t.Fatalf("%s = %q, want %q", spacev1.HeaderExecution, got, want)
	}

	// A tampered one is denied, with the outcome on the wire and a JSON
	// reason, and nothing is forwarded.
	r = nodeGet(t, cr.NodeURL, tamper(t, cr.Token), path, nil)
	e := wantJSONError(t, "tampered", r, http.StatusForbidden)
	if got := r.header.Get(spacev1.HeaderRouteOutcome); got != spacev1.OutcomeDeny {
		t.Fatalf("tampered: outcome %q, want deny", got)
	}
	if e.Reason != spacev1.OutcomeDeny {
		t.Errorf("tampered: reason %q", e.Reason)
	}
	if r.header.Get(spacev1.HeaderExecution) != "" {
		t.Fatal("tampered request reached the sandbox")
	}
	// No capability at all, and a capability for another purpose, are
	// denied too.
	r = nodeGet(t, cr.NodeURL, "", path, nil)
	wantJSONError(t, "no capability", r, http.StatusForbidden)
	if r.header.Get(spacev1.HeaderRouteOutcome) != spacev1.OutcomeDeny {
		t.Fatal("no capability: not a deny")
	}
	pc := capabilityFor(t, sbx.ID, "process")
	r = nodeGet(t, cr.NodeURL, pc.Token, path, nil)
	wantJSONError(t, "wrong purpose", r, http.StatusForbidden)
	if r.header.Get(spacev1.HeaderRouteOutcome) != spacev1.OutcomeDeny {
		t.Fatal("wrong purpose: not a deny")
	}

	// The right sandbox at the other worker: that worker holds no record
	// for it, so the route must be refreshed (never served, never denied).
	r = nodeGet(t, other, cr.Token, path, nil)
	e = wantJSONError(t, "other worker", r, http.StatusMisdirectedRequest)
	if got := r.header.Get(spacev1.HeaderRouteOutcome); got != spacev1.OutcomeRefreshRoute {
		t.Fatalf("other worker: outcome %q, want refresh-route", got)
	}
	if e.Reason != spacev1.OutcomeRefreshRoute {
		t.Errorf("other worker: reason %q", e.Reason)
	}

	// The denials did not disturb the sandbox: the capability still works.
	r = nodeGet(t, cr.NodeURL, cr.Token, path, nil)
	if r.status != http.StatusOK {
		t.Fatalf("after denials: %d %s", r.status, r.body)
	}
	assertServing(t, sbx)
}

func TestSandboxCannotReachAnother(t *testing.T) {
	a, b := newSandbox(t), newSandbox(t)
	secret := "b-secret-" + randHex(8)
	mustRun(t, b, "echo "+secret+" > /tmp/b-secret", "")
	c := newClient(t)
	ctx := ctxFor(t, 30*time.Second)

	// Through the edge: B's id with A's access token is refused for every
	// kind of operation.
	mixed := c.Attach(b.ID, a.AccessToken)
	_, err := mixed.ReadFile(ctx, "/tmp/b-secret")
	if st := sdkStatus(err); st != http.StatusUnauthorized && st != http.StatusForbidden {
		t.Fatalf("read B with A's token: status %d err %v", st, err)
	}
	var out bytes.Buffer
	_, err = mixed.Run(ctx, "cat /tmp/b-secret", sdk.RunOptions{Stdout: &out})
	if st := sdkStatus(err); (st != http.StatusUnauthorized && st != http.StatusForbidden) || strings.Contains(out.String(), secret) {
		t.Fatalf("run in B with A's token: status %d err %v out %q", st, err, out.String())
	}
	if _, err := mixed.ListDir(ctx, "/tmp"); !errors.Is(err, sdk.ErrUnauthorized) && !errors.Is(err, sdk.ErrForbidden) {
		t.Fatalf("list B with A's token: %v", err)
	}
	// The control plane does not issue a capability for B to A's token.
	body, _ := json.Marshal(spacev1.CapabilityRequest{Purpose: "files"})
	r := do(t, http.MethodPost, plat.APIURL+"/space/v1/sandboxes/"+b.ID+"/capabilities", bytes.NewReader(body),
		map[string]string{"X-Access-Token": a.AccessToken, "Content-Type": "application/json"})
	if r.status != http.StatusUnauthorized && r.status != http.StatusForbidden {
		t.Fatalf("capability for B with A's token: %d %s", r.status, r.body)
	}

	// Straight at node-api: A's capability only ever reaches A, whatever
	// the request says about B, at either worker.
	capA := capabilityFor(t, a.ID, "files")
	reachedA := false
	for _, w := range listWorkers(t) {
		r := nodeGet(t, w.NodeURL, capA.Token, "/files?path=/tmp/b-secret",
			map[string]string{"E2b-Sandbox-Id": b.ID, "E2b-Sandbox-Port": "49983"})
		if bytes.Contains(r.body, []byte(secret)) {
			t.Fatalf("A's capability read B's file at %s", w.ID)
		}
		switch r.status {
		case http.StatusNotFound: // served by A, which has no such file
			if got := r.header.Get(spacev1.HeaderExecution); got != capA.Route.ExecutionLabel() {
				t.Fatalf("A's capability at %s reached %q, want %q", w.ID, got, capA.Route.ExecutionLabel())
			}
			reachedA = true
		case http.StatusMisdirectedRequest: // the worker does not host A
			if w.ID == capA.Route.WorkerID {
				t.Fatalf("A's own worker %s answered refresh-route", w.ID)
			}
		default:
			t.Fatalf("A's capability at %s: %d %s", w.ID, r.status, r.body)
		}
	}
	if !reachedA {
		t.Fatal("A's capability reached A nowhere")
	}
	// B's file is where it was and B still serves.
	got, err := b.ReadFile(ctx, "/tmp/b-secret")
	if err != nil || string(got) != secret+"\n" {
		t.Fatalf("B's own read: %q, %v", got, err)
	}
}

func TestIsolation(t *testing.T) {
	a, b := newSandbox(t), newSandbox(t)

	t.Run("host file outside the template", func(t *testing.T) {
		ctx := ctxFor(t, 30*time.Second)
		content := "host-marker-" + randHex(8)
		marker := filepath.Join("/root", "space-up-test-marker-"+randHex(6))
		if err := os.WriteFile(marker, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		defer os.Remove(marker)
		for _, user := range []string{"", "root"} {
			r := mustRun(t, a, "cat "+marker, user)
			if r.code == 0 || strings.Contains(r.stdout+r.stderr, content) {
				t.Fatalf("as %q the sandbox reads the host marker: code %d stdout %q stderr %q", user, r.code, r.stdout, r.stderr)
			}
			r = mustRun(t, a, "ls -a /root 2>&1; grep -rs "+content+" /root /home /tmp /etc /var 2>/dev/null | head -1; true", user)
			if strings.Contains(r.stdout, filepath.Base(marker)) || strings.Contains(r.stdout, content) {
				t.Fatalf("as %q the sandbox sees the host marker: %q", user, r.stdout)
			}
		}
		if got, err := a.ReadFile(ctx, marker, sdk.FileOptions{User: "root"}); err == nil || bytes.Contains(got, []byte(content)) {
			t.Fatalf("/files read the host marker: %q, %v", got, err)
		}
	})

	t.Run("host shadow", func(t *testing.T) {
		ctx := ctxFor(t, 30*time.Second)
		host, err := os.ReadFile("/etc/shadow")
		if err != nil {
			testenv.Skipf(t, "host has no readable /etc/shadow: %v", err)
		}
		r := mustRun(t, a, "cat /etc/shadow", "")
		if r.code == 0 {
			t.Fatalf("user read /etc/shadow: %q", r.stdout)
		}
		r = mustRun(t, a, "cat /etc/shadow 2>/dev/null; true", "root")
		if leaksShadow(host, []byte(r.stdout)) {
			t.Fatalf("the sandbox's root reads the host's shadow: %q", r.stdout)
		}
		for _, p := range []string{"/etc/shadow", "../../../../etc/shadow"} {
			got, _ := a.ReadFile(ctx, p, sdk.FileOptions{User: "root"})
			if leaksShadow(host, got) {
				t.Fatalf("/files %s leaks the host's shadow", p)
			}
		}
	})

	t.Run("own processes only", func(t *testing.T) {
		r := mustRun(t, a, `for d in /proc/[0-9]*; do echo "${d#/proc/} $(cat $d/comm 2>/dev/null)"; done`, "root")
		lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
		if len(lines) == 0 || len(lines) > 12 {
			t.Fatalf("sandbox sees %d processes: %q", len(lines), r.stdout)
		}
		for _, l := range lines {
			pid, comm, _ := strings.Cut(l, " ")
			switch comm {
			case "up.test", "spaced-host", "systemd", "init", "go", "etcd":
				t.Fatalf("sandbox sees host process %q (pid %s): %q", comm, pid, r.stdout)
			}
		}
		if !strings.HasPrefix(r.stdout, "1 ") {
			t.Fatalf("no pid 1 of the sandbox's own: %q", r.stdout)
		}
		// The test's own pid, seen from inside, is not this process.
		self := strconv.Itoa(os.Getpid())
		r = mustRun(t, a, "cat /proc/"+self+"/cmdline 2>/dev/null | tr '\\0' ' '; true", "root")
		if strings.Contains(r.stdout, "up.test") || strings.Contains(r.stdout, os.Args[0]) {
			t.Fatalf("host test process visible as pid %s: %q", self, r.stdout)
		}
		r = mustRun(t, a, "ps -eo comm= | sort -u", "")
		if strings.Contains(r.stdout, "up.test") || strings.Contains(r.stdout, "spaced-host") {
			t.Fatalf("ps shows host processes: %q", r.stdout)
		}
	})

	t.Run("another sandbox's files", func(t *testing.T) {
		ctx := ctxFor(t, 30*time.Second)
		name := "a-only-" + randHex(6)
		content := "a-content-" + randHex(8)
		if _, err := a.WriteFile(ctx, "/tmp/"+name, []byte(content)); err != nil {
			t.Fatal(err)
		}
		if _, err := a.WriteFile(ctx, "/home/user/"+name, []byte(content)); err != nil {
			t.Fatal(err)
		}
		for _, p := range []string{"/tmp/" + name, "/home/user/" + name} {
			if got, err := b.ReadFile(ctx, p); !errors.Is(err, sdk.ErrNotFound) || bytes.Contains(got, []byte(content)) {
				t.Fatalf("B reads A's %s: %q, %v", p, got, err)
			}
		}
		r := mustRun(t, b, "ls -a /tmp /home/user; grep -rs "+content+" /tmp /home /var/tmp; true", "root")
		if strings.Contains(r.stdout, name) || strings.Contains(r.stdout, content) {
			t.Fatalf("B sees A's file: %q", r.stdout)
		}
	})

	t.Run("no route to the host", func(t *testing.T) {
		// The control plane listens on the host's loopback; the sandbox's
		// own network namespace has no way there.
		u, _ := url.Parse(plat.APIURL)
		r := mustRun(t, a, "timeout 3 bash -c 'echo > /dev/tcp/127.0.0.1/"+u.Port()+"' 2>&1; echo rc=$?", "")
		if strings.Contains(r.stdout, "rc=0") {
			t.Fatalf("sandbox reached the host's control plane: %q", r.stdout)
		}
	})
}

// leaksShadow reports whether got holds any password entry of the host's
// shadow file.
func leaksShadow(host, got []byte) bool {
	if len(got) == 0 {
		return false
	}
	if bytes.Equal(bytes.TrimSpace(host), bytes.TrimSpace(got)) {
		return true
	}
	for _, l := range strings.Split(string(host), "\n") {
		f := strings.Split(l, ":")
		if len(f) > 2 && strings.HasPrefix(f[1], "$") && bytes.Contains(got, []byte(f[1])) {
			return true
		}
	}
	return false
}

func TestMemoryLimit(t *testing.T) {
	sbx := newSandbox(t)
	// The control plane installs the template's memoryMB, which takes
	// precedence over the workers' DefaultLimits.MemoryBytes.
	info, err := newClient(t).GetSandbox(ctxFor(t, 10*time.Second), sbx.ID)
	if err != nil {
		t.Fatal(err)
	}
	limit := cgroupMemoryLimit(t, sbx.ID)
	if info.MemoryMB <= 0 || limit != int64(info.MemoryMB)<<20 {
		t.Fatalf("cgroup memory limit %d, sandbox memoryMB %d", limit, info.MemoryMB)
	}
	if limit >= 1000<<20 {
		t.Fatalf("memory limit %d too large for the hog below", limit)
	}
	// tail buffers its whole (newline-free) input: it grows past the limit.
	r := run(ctxFor(t, 60*time.Second), sbx, "head -c 1000m /dev/zero | tail", "")
	if r.err != nil {
		t.Fatalf("memory hog: %v", r.err)
	}
	if r.code != 137 {
		t.Fatalf("memory hog exit code %d, want 137 (SIGKILL by the OOM killer); stderr %q", r.code, r.stderr)
	}
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err != nil {
		if oc := cgroupValue(t, sbx.ID, "memory", "memory.oom_control"); !strings.Contains(oc, "oom_kill ") || strings.Contains(oc, "oom_kill 0") {
			t.Fatalf("no OOM kill recorded by the sandbox's cgroup: %q", oc)
		}
	} else if ev := cgroupValue(t, sbx.ID, "", "memory.events"); strings.Contains(ev, "oom_kill 0") {
		t.Fatalf("no OOM kill recorded by the sandbox's cgroup: %q", ev)
	}
	assertServing(t, sbx)
}

func cgroupMemoryLimit(t *testing.T, id string) int64 {
	t.Helper()
	var s string
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err == nil {
		s = cgroupValue(t, id, "", "memory.max")
	} else {
		s = cgroupValue(t, id, "memory", "memory.limit_in_bytes")
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		t.Fatalf("memory limit %q: %v", s, err)
	}
	return n
}

// TestForkBomb: the sandbox's pids limit stops a fork bomb, the agent keeps
// serving while the sandbox is saturated, other sandboxes are unaffected,
// and once the bomb is killed the sandbox answers as before.
func TestForkBomb(t *testing.T) {
	sbx, bystander := newSandbox(t), newSandbox(t)
	if got := cgroupValue(t, sbx.ID, "pids", "pids.max"); got != strconv.Itoa(testPidsLimit) {
		t.Fatalf("pids.max %q, want %d", got, testPidsLimit)
	}
	pidsCurrent := func() int {
		n, _ := strconv.Atoi(cgroupValue(t, sbx.ID, "pids", "pids.current"))
		return n
	}
	// The bomb's leader execs into sleep so that timeout is still there
	// after 5 s to kill the bomb's whole process group (bomb processes
	// whose parent already returned are orphans, but stay in the group).
	// SIGKILL: bash blocks SIGTERM while it retries a failed fork.
	done := make(chan result, 1)
	go func() {
		done <- run(ctxFor(t, 60*time.Second), sbx, "timeout -s KILL 5 bash -c 'b(){ b|b& }; b; exec sleep 60' >/dev/null 2>&1; echo bomb-rc=$?", "")
	}()
	// The count is read once per check: bomb processes that hit the limit
	// exit and fork again, so a second read may be lower.
	deadline := time.Now().Add(5 * time.Second)
	peak := 0
	for peak < testPidsLimit && time.Now().Before(deadline) {
		peak = max(peak, pidsCurrent())
		if peak < testPidsLimit {
			time.Sleep(50 * time.Millisecond)
		}
	}
	if peak < testPidsLimit {
		t.Fatalf("the bomb did not reach the pids limit: at most %d of %d", peak, testPidsLimit)
	}
	// Other sandboxes are unaffected.
	assertServing(t, bystander)
	// While the sandbox is saturated its agent still serves what needs no
	// new process, several requests at once (the agent may need threads).
	ctx := ctxFor(t, 15*time.Second)
	errs := make(chan error, 8)
	for i := range cap(errs) {
		go func() {
			var err error
			if i%2 == 0 {
				_, err = sbx.ReadFile(ctx, "/etc/hostname")
			} else {
				_, err = sbx.ListDir(ctx, "/home/user")
			}
			errs <- err
		}()
	}
	for range cap(errs) {
		if err := <-errs; err != nil {
			t.Errorf("guest API while the sandbox is saturated: %v%s", err, agentFatal())
			break
		}
	}
	r := <-done
	if r.err != nil {
		t.Fatalf("fork bomb run: %v (stdout %q)%s", r.err, r.stdout, agentFatal())
	}
	if r.stdout != "bomb-rc=137\n" {
		t.Fatalf("fork bomb run: %q, want 137 (timeout killed it)", r.stdout)
	}
	if ev := cgroupValue(t, sbx.ID, "pids", "pids.events"); !strings.HasPrefix(ev, "max ") || ev == "max 0" {
		t.Fatalf("the pids limit never stopped a fork: pids.events %q", ev)
	}
	// The bomb is gone and the sandbox answers.
	deadline = time.Now().Add(10 * time.Second)
	for pidsCurrent() > 16 {
		if time.Now().After(deadline) {
			t.Fatalf("bomb leftovers: %d pids in the sandbox", pidsCurrent())
		}
		time.Sleep(50 * time.Millisecond)
	}
	assertServing(t, sbx)
}

// agentFatal returns the start of any agent crash report on the platform
// (for failure messages).
func agentFatal() string {
	logs, _ := filepath.Glob(filepath.Join(plat.cfg.DataDir, "workers", "*", "act", "*", "agent.log"))
	for _, l := range logs {
		b, _ := os.ReadFile(l)
		if i := bytes.Index(b, []byte("fatal error")); i >= 0 {
			start := i
			if j := bytes.LastIndex(b[:i], []byte("runtime: failed")); j >= 0 {
				start = j
			}
			end := min(len(b), i+120)
			return "\nagent crashed (" + l + "):\n" + string(b[start:end])
		}
	}
	return ""
}

func TestBadInput(t *testing.T) {
	sbx := newSandbox(t)
	key := map[string]string{"X-API-Key": plat.APIKey, "Content-Type": "application/json"}

	t.Run("malformed JSON", func(t *testing.T) {
		r := do(t, http.MethodPost, plat.APIURL+"/v2/sandboxes", strings.NewReader(`{"templateID": "base",`), key)
		wantJSONError(t, "malformed JSON", r, http.StatusBadRequest)
		r = do(t, http.MethodPost, plat.APIURL+"/v2/sandboxes", strings.NewReader(`{"templateID": 42}`), key)
		wantJSONError(t, "wrong field type", r, http.StatusBadRequest)
		assertServing(t, sbx)
	})
	t.Run("unknown template", func(t *testing.T) {
		r := do(t, http.MethodPost, plat.APIURL+"/v2/sandboxes", strings.NewReader(`{"templateID": "no-such-template-`+randHex(4)+`"}`), key)
		e := wantJSONError(t, "unknown template", r, http.StatusNotFound)
		if !strings.Contains(e.Message, "no-such-template") {
			t.Errorf("message does not name the template: %q", e.Message)
		}
		assertServing(t, sbx)
	})
	t.Run("oversized body", func(t *testing.T) {
		big := `{"templateID":"base","metadata":{"k":"` + strings.Repeat("x", 3<<20) + `"}}`
		r := do(t, http.MethodPost, plat.APIURL+"/v2/sandboxes", strings.NewReader(big), key)
		wantJSONError(t, "oversized body", r, http.StatusRequestEntityTooLarge)
		assertServing(t, sbx)
	})
	t.Run("path traversal", func(t *testing.T) {
		host, _ := os.ReadFile("/etc/shadow")
		q := url.Values{"path": {"../../../../etc/shadow"}, "username": {"root"}}
		r := do(t, http.MethodGet, plat.SandboxURL+"/files?"+q.Encode(), nil, map[string]string{
			"E2b-Sandbox-Id": sbx.ID, "E2b-Sandbox-Port": "49983", "X-Access-Token": sbx.AccessToken})
		if len(host) > 0 && leaksShadow(host, r.body) {
			t.Fatalf("path traversal leaks the host's shadow (%d)", r.status)
		}
		if r.status != http.StatusOK && (r.status < 400 || r.status > 499) {
			t.Fatalf("path traversal: status %d %s", r.status, r.body)
		}
		assertServing(t, sbx)
	})
	t.Run("missing or wrong API key", func(t *testing.T) {
		r := do(t, http.MethodGet, plat.APIURL+"/v2/sandboxes", nil, nil)
		wantJSONError(t, "missing API key", r, http.StatusUnauthorized)
		r = do(t, http.MethodPost, plat.APIURL+"/v2/sandboxes", strings.NewReader(`{"templateID":"base"}`),
			map[string]string{"Content-Type": "application/json"})
		wantJSONError(t, "create without key", r, http.StatusUnauthorized)
		r = do(t, http.MethodGet, plat.APIURL+"/v2/sandboxes", nil, map[string]string{"X-API-Key": "e2b_" + strings.Repeat("0", 40)})
		wantJSONError(t, "wrong API key", r, http.StatusUnauthorized)
		bad, _ := sdk.New(sdk.Config{APIURL: plat.APIURL, APIKey: "e2b_" + randHex(20), HTTPClient: &http.Client{Transport: testTransport}})
		if _, err := bad.CreateSandbox(ctxFor(t, 10*time.Second), sdk.CreateOptions{}); !errors.Is(err, sdk.ErrUnauthorized) {
			t.Fatalf("SDK with a wrong key: %v", err)
		}
		assertServing(t, sbx)
	})
	t.Run("wrong access token", func(t *testing.T) {
		wrong := newClient(t).Attach(sbx.ID, "wrong-"+randHex(16))
		ctx := ctxFor(t, 30*time.Second)
		if _, err := wrong.Run(ctx, "echo no", sdk.RunOptions{}); sdkStatus(err) != http.StatusUnauthorized {
			t.Fatalf("run with a wrong token: %v", err)
		}
		if _, err := wrong.ReadFile(ctx, "/etc/hostname"); sdkStatus(err) != http.StatusUnauthorized || !errors.Is(err, sdk.ErrUnauthorized) {
			t.Fatalf("read with a wrong token: %v", err)
		}
		// And none at all.
		r := do(t, http.MethodGet, plat.SandboxURL+"/files?path=/etc/hostname", nil, map[string]string{
			"E2b-Sandbox-Id": sbx.ID, "E2b-Sandbox-Port": "49983"})
		if r.status != http.StatusUnauthorized && r.status != http.StatusForbidden {
			t.Fatalf("no access token: %d %s", r.status, r.body)
		}
		wantJSONError(t, "no access token", r, r.status)
		assertServing(t, sbx)
	})
	t.Run("malformed sandbox addressing", func(t *testing.T) {
		for _, h := range []map[string]string{
			{"E2b-Sandbox-Id": "../etc", "E2b-Sandbox-Port": "49983"},
			{"E2b-Sandbox-Id": sbx.ID, "E2b-Sandbox-Port": "99999"},
			{"E2b-Sandbox-Id": sbx.ID},
		} {
			h["X-Access-Token"] = sbx.AccessToken
			r := do(t, http.MethodGet, plat.SandboxURL+"/files?path=/etc/hostname", nil, h)
			wantJSONError(t, "addressing "+h["E2b-Sandbox-Id"]+":"+h["E2b-Sandbox-Port"], r, http.StatusBadRequest)
		}
		assertServing(t, sbx)
	})
}

func TestKill(t *testing.T) {
	c := newClient(t)
	sbx := newSandbox(t)
	assertServing(t, sbx)
	hostPID, guestPID, worker := 0, 0, -1
	for i, w := range plat.Workers {
		if h, g, ok := w.Manager().BridgePID(sbx.ID); ok {
			hostPID, guestPID, worker = h, g, i
		}
	}
	if worker < 0 {
		t.Fatalf("no worker runs %s", sbx.ID)
	}
	// Warm the edge's caches so the kill has to invalidate a live route.
	if _, err := sbx.ListDir(ctxFor(t, 10*time.Second), "/home/user"); err != nil {
		t.Fatal(err)
	}

	if err := c.KillSandbox(ctxFor(t, 30*time.Second), sbx.ID); err != nil {
		t.Fatalf("kill: %v", err)
	}
	ctx := ctxFor(t, 30*time.Second)
	r := run(ctx, sbx, "echo still-here", "")
	if r.err == nil || sdkStatus(r.err) != http.StatusBadGateway || !errors.Is(r.err, sdk.ErrNotFound) {
		t.Fatalf("run after kill: %+v (status %d)", r, sdkStatus(r.err))
	}
	if _, err := sbx.ReadFile(ctx, "/etc/hostname"); sdkStatus(err) != http.StatusBadGateway || !errors.Is(err, sdk.ErrNotFound) {
		t.Fatalf("read after kill: %v", err)
	}
	resp := do(t, http.MethodGet, plat.SandboxURL+"/files?path=/etc/hostname", nil, map[string]string{
		"E2b-Sandbox-Id": sbx.ID, "E2b-Sandbox-Port": "49983", "X-Access-Token": sbx.AccessToken})
	if e := wantJSONError(t, "edge after kill", resp, http.StatusBadGateway); e.Reason != sdk.ReasonSandboxNotFound {
		t.Fatalf("edge after kill: reason %q", e.Reason)
	}
	if _, err := c.GetSandbox(ctx, sbx.ID); !errors.Is(err, sdk.ErrNotFound) {
		t.Fatalf("get after kill: %v", err)
	}

	// No worker keeps an activation, a record or the processes.
	deadline := time.Now().Add(15 * time.Second)
	for {
		left := ""
		for _, w := range plat.Workers {
			if _, _, ok := w.Manager().BridgePID(sbx.ID); ok {
				left = "activation"
			}
			for _, rec := range w.Manager().Records() {
				if rec.Route.SandboxID == sbx.ID {
					left = "record"
				}
			}
		}
		for _, pid := range []int{hostPID, guestPID} {
			if alive(pid) {
				left = "process " + strconv.Itoa(pid)
			}
		}
		if left == "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after kill worker %d still holds a %s for %s", worker, left, sbx.ID)
		}
		time.Sleep(50 * time.Millisecond)
	}
	// A second kill is a typed not-found; the platform keeps serving.
	if err := c.KillSandbox(ctxFor(t, 10*time.Second), sbx.ID); !errors.Is(err, sdk.ErrNotFound) {
		t.Fatalf("second kill: %v", err)
	}
	assertServing(t, newSandbox(t))
}

// alive reports whether pid names a live (non-zombie) process.
func alive(pid int) bool {
	if pid <= 0 {
		return false
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	s := string(b)
	if i := strings.LastIndexByte(s, ')'); i >= 0 && len(s) > i+2 {
		return s[i+2] != 'Z' && s[i+2] != 'X'
	}
	return true
}
