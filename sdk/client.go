// Package sdk is SPACE's Go client library. It speaks E2B's public wire
// formats: REST/JSON to the control plane (E2B_API_URL) and Connect RPC plus
// HTTP /files to sandboxes through space-edge (E2B_SANDBOX_URL), so it works
// against SPACE and anything else that implements those contracts.
//
//	c, _ := sdk.New(sdk.Config{APIURL: api, SandboxURL: edge, APIKey: key})
//	sbx, _ := c.CreateSandbox(ctx, sdk.CreateOptions{Template: "base"})
//	code, _ := sbx.Run(ctx, "echo hi", sdk.RunOptions{Stdout: os.Stdout})
package sdk

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
)

// Config configures a Client.
type Config struct {
	// APIURL is the control plane's base URL (E2B_API_URL), e.g.
	// "http://127.0.0.1:3000", or several replicas' comma-separated: a call
	// goes to the replica that answered last and, when that one is down,
	// to the next (any call whose connection was refused; a GET, HEAD or
	// DELETE also on another transport error or a 502/503/504 answer; a
	// POST or PATCH never after it may have reached a replica, so nothing
	// is done twice).
	APIURL string
	// SandboxURL is the data-plane edge's base URL (E2B_SANDBOX_URL), e.g.
	// "http://127.0.0.1:3001". Needed only for sandbox operations.
	SandboxURL string
	// APIKey authenticates control-plane calls (X-API-Key).
	APIKey string
	// AccessToken (sk_e2b_...) authenticates control-plane calls as a user
	// when APIKey is empty (Authorization: Bearer); TeamID picks one of the
	// user's teams (X-Team-ID; default: the user's default team). See
	// teams.go.
	AccessToken, TeamID string
	// HTTPClient sends every request. It must not set an overall Timeout
	// if streams (Run, PTY) are used; use contexts instead. Default: a
	// client with http.DefaultTransport.
	HTTPClient *http.Client
}

// Client is a SPACE API client. It is safe for concurrent use.
type Client struct {
	cfg  Config
	http *http.Client
	// apis are APIURL's replicas; pref the one to try first.
	apis []string
	pref atomic.Int32
}

// New returns a client for cfg.
func New(cfg Config) (*Client, error) {
	var apis []string
	for _, a := range strings.Split(cfg.APIURL, ",") {
		if a = strings.TrimRight(strings.TrimSpace(a), "/"); a != "" {
			apis = append(apis, a)
		}
	}
	cfg.APIURL = strings.Join(apis, ",")
	cfg.SandboxURL = strings.TrimRight(cfg.SandboxURL, "/")
	for name, vs := range map[string][]string{"APIURL": apis, "SandboxURL": {cfg.SandboxURL}} {
		for _, v := range vs {
			if v == "" {
				continue
			}
			u, err := url.Parse(v)
			if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
				return nil, fmt.Errorf("sdk: %s %q is not an http(s) URL", name, v)
			}
		}
	}
	if cfg.APIURL == "" && cfg.SandboxURL == "" {
		return nil, errors.New("sdk: APIURL or SandboxURL is required")
	}
	hc := cfg.HTTPClient
	if hc == nil {
		hc = &http.Client{}
	}
	return &Client{cfg: cfg, http: hc, apis: apis}, nil
}

// CreateOptions are the options of CreateSandbox.
type CreateOptions struct {
	// Template is the template id or alias. Default "base".
	Template string
	// Timeout is how long the sandbox lives before it is killed (whole
	// seconds; zero leaves the server default).
	Timeout  time.Duration
	Metadata map[string]string
	EnvVars  map[string]string
	// Secure makes data-plane access require the sandbox's access token.
	Secure bool
	// AllowInternetAccess is E2B's allow_internet_access (nil: the
	// platform's default); Network its network options.
	AllowInternetAccess *bool
	Network             *Network
}

// Network is E2B's SandboxNetworkConfig: egress (AllowOut, DenyOut,
// Rules, EgressProxy) and ingress (AllowPublicTraffic, MaskRequestHost)
// options. AllowOut entries are CIDRs, IPs, domains or "*.domain" and win
// over DenyOut (CIDRs and IPs).
type Network struct {
	AllowOut           []string                        `json:"allowOut,omitempty"`
	DenyOut            []string                        `json:"denyOut,omitempty"`
	Rules              map[string][]e2bapi.NetworkRule `json:"rules,omitempty"`
	EgressProxy        *EgressProxy                    `json:"egressProxy,omitempty"`
	AllowPublicTraffic *bool                           `json:"allowPublicTraffic,omitempty"`
	MaskRequestHost    string                          `json:"maskRequestHost,omitempty"`
}

// EgressProxy is an upstream SOCKS5 proxy egress goes through after the
// policy's checks.
type EgressProxy struct {
	Address  string `json:"address"`
	Username string `json:"username,omitempty"`
	Password string `json:"password,omitempty"`
}

// NetworkUpdate is E2B's SandboxNetworkUpdateConfig: it replaces a
// running sandbox's egress configuration as a whole (omitted fields are
// cleared).
type NetworkUpdate struct {
	AllowInternetAccess *bool                           `json:"allow_internet_access,omitempty"`
	AllowOut            []string                        `json:"allowOut,omitempty"`
	DenyOut             []string                        `json:"denyOut,omitempty"`
	Rules               map[string][]e2bapi.NetworkRule `json:"rules,omitempty"`
	EgressProxy         *EgressProxy                    `json:"egressProxy,omitempty"`
}

// SecretPlaceholder is what a network rule's header value names a team
// secret by; the egress proxy substitutes the value, so the sandbox only
// ever sees the placeholder.
func SecretPlaceholder(name string) string { return "${e2b.secrets." + name + "}" }

// SandboxInfo describes a sandbox (E2B's SandboxDetail / ListedSandbox).
type SandboxInfo struct {
	SandboxID   string            `json:"sandboxID"`
	TemplateID  string            `json:"templateID"`
	Alias       string            `json:"alias,omitempty"`
	ClientID    string            `json:"clientID,omitempty"`
	State       string            `json:"state,omitempty"`
	StartedAt   time.Time         `json:"startedAt,omitzero"`
	EndAt       time.Time         `json:"endAt,omitzero"`
	CPUCount    int               `json:"cpuCount,omitempty"`
	MemoryMB    int               `json:"memoryMB,omitempty"`
	DiskSizeMB  int               `json:"diskSizeMB,omitempty"`
	Metadata    map[string]string `json:"metadata,omitempty"`
	EnvdVersion string            `json:"envdVersion,omitempty"`
	// EnvdAccessToken is set by GetSandbox for secure sandboxes.
	EnvdAccessToken string `json:"envdAccessToken,omitempty"`
	Domain          string `json:"domain,omitempty"`
	// AllowInternetAccess and Network are the sandbox's network options
	// (GetSandbox only).
	AllowInternetAccess *bool                  `json:"allowInternetAccess,omitempty"`
	Network             *e2bapi.SandboxNetwork `json:"network,omitempty"`
}

// CreateSandbox creates a sandbox and returns a handle for its data plane.
// Secure sandboxes are created with POST /v2/sandboxes (which always issues
// an envd access token), others with POST /sandboxes and secure=false.
func (c *Client) CreateSandbox(ctx context.Context, o CreateOptions) (*Sandbox, error) {
	if o.Template == "" {
		o.Template = "base"
	}
	if o.Timeout < 0 {
		return nil, &Error{kind: ErrBadRequest, Message: "timeout must not be negative"}
	}
	body := e2bapi.NewSandbox{TemplateID: o.Template, Metadata: o.Metadata, EnvVars: o.EnvVars, AllowInternetAccess: o.AllowInternetAccess}
	if o.Network != nil {
		raw, err := json.Marshal(o.Network)
		if err != nil {
			return nil, &Error{kind: ErrBadRequest, Message: "network: " + err.Error()}
		}
		body.Network = raw
	}
	if o.Timeout > 0 {
		secs := int32((o.Timeout + time.Second - 1) / time.Second)
		body.Timeout = &secs
	}
	path := "/v2/sandboxes"
	if !o.Secure {
		path = "/sandboxes"
		body.Secure = new(bool)
	}
	var out e2bapi.Sandbox
	if err := c.rest(ctx, http.MethodPost, path, body, &out, nil); err != nil {
		return nil, err
	}
	if out.SandboxID == "" {
		return nil, &Error{kind: ErrServer, Message: "create response names no sandbox"}
	}
	return c.Attach(out.SandboxID, out.EnvdAccessToken), nil
}

// GetSandbox returns a sandbox's details (GET /sandboxes/{id}).
func (c *Client) GetSandbox(ctx context.Context, id string) (*SandboxInfo, error) {
	if err := checkID(id); err != nil {
		return nil, err
	}
	var d e2bapi.SandboxDetail
	if err := c.rest(ctx, http.MethodGet, "/sandboxes/"+url.PathEscape(id), nil, &d, nil); err != nil {
		return nil, err
	}
	info := &SandboxInfo{SandboxID: d.SandboxID, TemplateID: d.TemplateID, Alias: d.Alias, ClientID: d.ClientID,
		State: d.State, StartedAt: d.StartedAt, EndAt: d.EndAt, CPUCount: d.CPUCount, MemoryMB: d.MemoryMB,
		DiskSizeMB: d.DiskSizeMB, Metadata: d.Metadata, EnvdVersion: d.EnvdVersion, EnvdAccessToken: d.EnvdAccessToken,
		AllowInternetAccess: d.AllowInternetAccess, Network: d.Network}
	if d.Domain != nil {
		info.Domain = *d.Domain
	}
	return info, nil
}

// maxListPages bounds pagination of ListSandboxes.
const maxListPages = 1000

// ListSandboxes lists the caller's sandboxes (GET /v2/sandboxes, following
// X-Next-Token pages).
func (c *Client) ListSandboxes(ctx context.Context) ([]SandboxInfo, error) {
	var all []SandboxInfo
	next := ""
	for page := 0; page < maxListPages; page++ {
		q := url.Values{"limit": {strconv.Itoa(e2bapi.MaxLimit)}}
		if next != "" {
			q.Set("nextToken", next)
		}
		var out []e2bapi.ListedSandbox
		var hdr http.Header
		if err := c.rest(ctx, http.MethodGet, "/v2/sandboxes?"+q.Encode(), nil, &out, &hdr); err != nil {
			return nil, err
		}
		for _, d := range out {
			all = append(all, SandboxInfo{SandboxID: d.SandboxID, TemplateID: d.TemplateID, Alias: d.Alias,
				ClientID: d.ClientID, State: d.State, StartedAt: d.StartedAt, EndAt: d.EndAt, CPUCount: d.CPUCount,
				MemoryMB: d.MemoryMB, DiskSizeMB: d.DiskSizeMB, Metadata: d.Metadata, EnvdVersion: d.EnvdVersion})
		}
		next = hdr.Get(e2bapi.HeaderNextToken)
		if next == "" || len(out) == 0 {
			break
		}
	}
	return all, nil
}

// KillSandbox kills a sandbox (DELETE /sandboxes/{id}).
func (c *Client) KillSandbox(ctx context.Context, id string) error {
	if err := checkID(id); err != nil {
		return err
	}
	return c.rest(ctx, http.MethodDelete, "/sandboxes/"+url.PathEscape(id), nil, nil, nil)
}

// SetTimeout sets the sandbox to end timeout from now
// (POST /sandboxes/{id}/timeout).
func (c *Client) SetTimeout(ctx context.Context, id string, timeout time.Duration) error {
	if err := checkID(id); err != nil {
		return err
	}
	if timeout <= 0 {
		return &Error{kind: ErrBadRequest, Message: "timeout must be positive"}
	}
	body := e2bapi.TimeoutRequest{Timeout: int32((timeout + time.Second - 1) / time.Second)}
	return c.rest(ctx, http.MethodPost, "/sandboxes/"+url.PathEscape(id)+"/timeout", body, nil, nil)
}

// OpenSandbox returns a data-plane handle for an existing sandbox, reading
// its access token from the control plane.
func (c *Client) OpenSandbox(ctx context.Context, id string) (*Sandbox, error) {
	info, err := c.GetSandbox(ctx, id)
	if err != nil {
		return nil, err
	}
	return c.Attach(id, info.EnvdAccessToken), nil
}

// Attach returns a data-plane handle for sandbox id without calling the
// control plane. accessToken may be empty for sandboxes created without
// Secure.
func (c *Client) Attach(id, accessToken string) *Sandbox {
	return newSandbox(c, id, accessToken)
}

func checkID(id string) error {
	if id == "" || len(id) > 63 || strings.ContainsAny(id, "/?#% ") {
		return &Error{kind: ErrBadRequest, Message: fmt.Sprintf("invalid sandbox id %q", id)}
	}
	return nil
}

// send sends one control-plane call, failing over between the APIURL
// replicas (see Config.APIURL).
func (c *Client) send(ctx context.Context, method, path string, data []byte, hasBody bool) (*http.Response, error) {
	idempotent := method == http.MethodGet || method == http.MethodHead || method == http.MethodDelete
	n := len(c.apis)
	if n == 0 {
		return nil, errors.New("sdk: APIURL is not configured")
	}
	first := int(c.pref.Load())
	var lastErr error
	for i := range n {
		idx := (first + i) % n
		var body io.Reader
		if hasBody {
			body = bytes.NewReader(data)
		}
		req, err := http.NewRequestWithContext(ctx, method, c.apis[idx]+path, body)
		if err != nil {
			return nil, err
		}
		if hasBody {
			req.Header.Set("Content-Type", "application/json")
		}
		req.Header.Set("Accept", "application/json")
		if c.cfg.APIKey != "" {
			req.Header.Set("X-API-Key", c.cfg.APIKey)
		} else if c.cfg.AccessToken != "" {
			req.Header.Set("Authorization", "Bearer "+c.cfg.AccessToken)
		}
		if c.cfg.TeamID != "" {
			req.Header.Set("X-Team-ID", c.cfg.TeamID)
		}
		res, err := c.http.Do(req)
		last := i == n-1
		if err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			lastErr = fmt.Errorf("%w: %v", ErrUnavailable, err)
			if last || !(idempotent || refused(err)) {
				return nil, lastErr
			}
			continue
		}
		down := res.StatusCode == http.StatusBadGateway || res.StatusCode == http.StatusServiceUnavailable || res.StatusCode == http.StatusGatewayTimeout
		if !down || !idempotent || last {
			if i > 0 && !down {
				c.pref.Store(int32(idx))
			}
			return res, nil
		}
		_, _ = io.Copy(io.Discard, io.LimitReader(res.Body, maxRESTResponse))
		res.Body.Close()
	}
	return nil, lastErr
}

// refused reports whether err is a connection that was never made (the
// request reached nobody).
func refused(err error) bool {
	var op *net.OpError
	return errors.Is(err, syscall.ECONNREFUSED) || (errors.As(err, &op) && op.Op == "dial")
}

// maxRESTResponse bounds a control-plane answer.
const maxRESTResponse = 32 << 20

func (c *Client) rest(ctx context.Context, method, path string, in, out any, hdr *http.Header) error {
	if c.cfg.APIURL == "" {
		return errors.New("sdk: APIURL is not configured")
	}
	var data []byte
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		data = b
	}
	res, err := c.send(ctx, method, path, data, in != nil)
	if err != nil {
		return err
	}
	defer res.Body.Close()
	if res.StatusCode < 200 || res.StatusCode > 299 {
		return errorFromResponse(res)
	}
	if hdr != nil {
		*hdr = res.Header
	}
	if out == nil {
		_, _ = io.Copy(io.Discard, io.LimitReader(res.Body, maxRESTResponse))
		return nil
	}
	if err := json.NewDecoder(io.LimitReader(res.Body, maxRESTResponse)).Decode(out); err != nil {
		return &Error{Status: res.StatusCode, kind: ErrServer, Message: "malformed response: " + err.Error()}
	}
	return nil
}
