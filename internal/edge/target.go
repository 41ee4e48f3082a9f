package edge

import (
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
)

// Header names the e2b SDK sets on every envd request sent to
// E2B_SANDBOX_URL.
const (
	HeaderSandboxID   = "E2b-Sandbox-Id"
	HeaderSandboxPort = "E2b-Sandbox-Port"
)

// Service-port protocols.
const (
	ProtocolHTTP = "http"
	ProtocolWS   = "ws"
	// ProtocolTCP is raw TCP carried as an HTTP upgrade ("Upgrade: tcp",
	// "Connection: Upgrade"): netgtw answers 101 and splices bytes.
	ProtocolTCP = "tcp"
)

// HeaderTrafficAccessToken is E2B's header for service-port traffic to
// sandboxes created with private traffic (network.allowPublicTraffic false).
const HeaderTrafficAccessToken = "E2b-Traffic-Access-Token"

// target is what a client request addresses.
type target struct {
	sandbox  string
	port     int
	purpose  capability.Purpose
	protocol string // service ports only
	// idempotent reads may be retried once on a transport failure.
	idempotent bool
	// clientStream marks calls whose request body is an open-ended stream:
	// it is never held for a rebuilt attempt.
	clientStream bool
	// sig is a signed /files URL's signature (uploadUrl/downloadUrl of a
	// secure sandbox), presented instead of an access token.
	sig fileSignature
}

// fileSignature is what a signed /files URL carries (E2B envd semantics:
// signature = "v1_" + base64(sha256(path:operation:username:token[:exp]))).
// The control plane verifies it against the sandbox's access token.
type fileSignature struct {
	signature, expiration, path, username, operation string
}

// Query parameters of a signed /files URL, forwarded to the control plane's
// capability endpoint.
const (
	QuerySignature           = "signature"
	QuerySignatureExpiration = "signature_expiration"
)

// signatureOf returns the signature a /files request presents instead of
// an access token: GET (and HEAD) sign the "read" operation, POST "write".
// ok is false when the request carries none or the method signs nothing.
func signatureOf(r *http.Request) (fileSignature, bool) {
	q := r.URL.Query()
	if r.URL.Path != "/files" || !q.Has(QuerySignature) {
		return fileSignature{}, false
	}
	op := ""
	switch r.Method {
	case http.MethodGet, http.MethodHead:
		op = "read"
	case http.MethodPost:
		op = "write"
	default:
		return fileSignature{}, false
	}
	return fileSignature{signature: q.Get(QuerySignature), expiration: q.Get(QuerySignatureExpiration),
		path: q.Get("path"), username: q.Get("username"), operation: op}, true
}

// query is the signature as the control plane reads it.
func (s fileSignature) query() url.Values {
	q := url.Values{}
	q.Set(QuerySignature, s.signature)
	if s.expiration != "" {
		q.Set(QuerySignatureExpiration, s.expiration)
	}
	q.Set("path", s.path)
	q.Set("username", s.username)
	q.Set("operation", s.operation)
	return q
}

// cacheToken is the cache identity of a signature: the edge must not reuse
// one signed URL's authorization for another path, user or operation.
func (s fileSignature) cacheToken() string {
	return strings.Join([]string{"\x00signed", s.operation, s.path, s.username, s.expiration, s.signature}, "\x00")
}

// parseSandboxPort extracts sandbox id and port from the E2B headers or the
// Host. ok is false when the request addresses no sandbox at all (the edge's
// own endpoints); err is set for malformed sandbox addressing.
func parseSandboxPort(r *http.Request, domain string) (sandbox string, port int, ok bool, err error) {
	id, ph := r.Header.Get(HeaderSandboxID), r.Header.Get(HeaderSandboxPort)
	if id != "" || ph != "" {
		if id == "" || ph == "" {
			return "", 0, false, badRequest("both " + HeaderSandboxID + " and " + HeaderSandboxPort + " are required")
		}
		p, perr := parsePort(ph)
		if perr != nil {
			return "", 0, false, perr
		}
		if e := identity.ValidateSandboxID(id); e != nil {
			return "", 0, false, badRequest("invalid sandbox id")
		}
		return id, p, true, nil
	}
	host := r.Host
	if h, _, e := net.SplitHostPort(host); e == nil {
		host = h
	}
	host = strings.ToLower(strings.TrimSuffix(host, "."))
	suffix := "." + domain
	if !strings.HasSuffix(host, suffix) {
		return "", 0, false, nil
	}
	label := strings.TrimSuffix(host, suffix)
	ps, id, found := strings.Cut(label, "-")
	if !found || strings.Contains(label, ".") {
		return "", 0, false, badRequest("host must have the form <port>-<sandbox>." + domain)
	}
	p, perr := parsePort(ps)
	if perr != nil {
		return "", 0, false, perr
	}
	if e := identity.ValidateSandboxID(id); e != nil {
		return "", 0, false, badRequest("invalid sandbox id")
	}
	return id, p, true, nil
}

func parsePort(s string) (int, error) {
	if len(s) == 0 || len(s) > 5 {
		return 0, badRequest("invalid sandbox port")
	}
	for _, c := range s {
		if c < '0' || c > '9' {
			return 0, badRequest("invalid sandbox port")
		}
	}
	p, err := strconv.Atoi(s)
	if err != nil || p < 1 || p > 65535 {
		return 0, badRequest("invalid sandbox port")
	}
	return p, nil
}

// classify maps a request for (sandbox, port) to a capability purpose.
func classify(r *http.Request, sandbox string, port int) (target, error) {
	t := target{sandbox: sandbox, port: port}
	if port != EnvdPort {
		t.purpose = capability.PurposeServicePort
		t.protocol = ProtocolHTTP
		if up := r.Header.Get("Upgrade"); up != "" {
			t.protocol = ProtocolWS
			if strings.EqualFold(strings.TrimSpace(up), ProtocolTCP) {
				t.protocol = ProtocolTCP
			}
			t.clientStream = true
		}
		// Service-port bodies of unknown length may be open-ended.
		if r.ContentLength < 0 {
			t.clientStream = true
		}
		return t, nil
	}
	p := r.URL.Path
	switch {
	case strings.HasPrefix(p, "/process.Process/"):
		t.purpose = capability.PurposeProcess
		t.clientStream = p == "/process.Process/StreamInput"
	case strings.HasPrefix(p, "/filesystem.Filesystem/"):
		t.purpose = capability.PurposeFilesystem
		switch p {
		case "/filesystem.Filesystem/Stat", "/filesystem.Filesystem/ListDir":
			t.idempotent = true
		}
	case p == "/files" || p == "/health":
		t.purpose = capability.PurposeFiles
		t.idempotent = r.Method == http.MethodGet || r.Method == http.MethodHead
	default:
		return t, answer(errdefs.ErrNotFound, "not_found", "no such envd endpoint")
	}
	return t, nil
}
