package controlplane

import (
	"cmp"
	"fmt"
	"log/slog"
	"net/http"
	"path/filepath"
	"regexp"
	"time"

	"github.com/spacesbx/space/internal/codeinterp"
	"github.com/spacesbx/space/internal/events"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/snapshot"
	"github.com/spacesbx/space/internal/store"
)

// Defaults.
const (
	DefaultAddr           = "127.0.0.1:3000"
	DefaultDomain         = "localhost"
	DefaultTimeout        = 300 * time.Second
	DefaultMaxTimeout     = 24 * time.Hour
	DefaultEnvdVersion    = "0.2.0"
	DefaultTeamID         = "default"
	DefaultInstallTimeout = 60 * time.Second
	DefaultNodeTimeout    = 30 * time.Second
	DefaultReapInterval   = time.Second
	DefaultTombstoneTTL   = time.Hour
	// DefaultWorkerLossGrace is Config.WorkerLossGrace's default.
	DefaultWorkerLossGrace = 30 * time.Second
	// DefaultLeaderTTL is Config.LeaderTTL's default.
	DefaultLeaderTTL = 5 * time.Second
	// MaxAuthorization bounds AuthorizedUntil of a capability response.
	MaxAuthorization = 10 * time.Minute
	// MaxBodyBytes bounds every request body.
	MaxBodyBytes = 1 << 20
)

// apiKeyRE is the form of E2B API keys: "e2b_" and 40 hex digits.
var apiKeyRE = regexp.MustCompile(`^e2b_[0-9a-f]{40}$`)

// Template describes what a template gives a sandbox (reported to E2B
// clients; CPU, memory and disk are passed to the worker as limits: the
// ns substrate's layer disk is DiskSizeMB).
type Template struct {
	CPUCount   int
	MemoryMB   int
	DiskSizeMB int
	// Substrate runs the template's sandboxes (default Config.Substrate);
	// only workers that advertise it are picked.
	Substrate string
	// StartCmd, when set, is run in every new sandbox of the template
	// (in the background, as User in Workdir: defaults user and the
	// user's home), which is answered once ReadyCmd exits 0
	// (platformtemplate.go). WarmSnapshot: the template is started once
	// per team and snapshotted, and creates restore that snapshot (for a
	// substrate whose snapshots keep processes).
	StartCmd, ReadyCmd string
	User, Workdir      string
	WarmSnapshot       bool
}

// DefaultTemplate is the "base" template's size: a 4 GiB writable layer
// (sparse: it costs the host what the sandbox writes).
var DefaultTemplate = Template{CPUCount: 2, MemoryMB: 512, DiskSizeMB: 4096}

// DefaultVMTemplate is "base-vm": the base userland in a microVM (its files
// live in guest memory, so DiskSizeMB is 0).
var DefaultVMTemplate = Template{CPUCount: 1, MemoryMB: 256, Substrate: identity.SubstrateMicroVM}

// CodeInterpreterTemplate is "code-interpreter-v1", the
// @e2b/code-interpreter SDK's default: the code interpreter image (the
// workers' image of that template name) with its server
// (internal/codeinterp) started as user in /home/user at create; a create
// answers once the server is ready.
var CodeInterpreterTemplate = Template{CPUCount: 2, MemoryMB: 1024, DiskSizeMB: 4096,
	StartCmd: codeinterp.StartCommand(), ReadyCmd: codeinterp.ReadyCommand(), User: "user", Workdir: "/home/user"}

// CodeInterpreterVMTemplate is "code-interpreter-v1-vm": the same in a
// microVM, whose creates restore a snapshot taken with the server started
// (its kernel warm).
var CodeInterpreterVMTemplate = Template{CPUCount: 2, MemoryMB: 1024, Substrate: identity.SubstrateMicroVM,
	StartCmd: codeinterp.StartCommand(), ReadyCmd: codeinterp.ReadyCommand(), User: "user", Workdir: "/home/user", WarmSnapshot: true}

// Config holds the control plane's settings.
type Config struct {
	// Addr is the listen address of Run (default 127.0.0.1:3000).
	Addr string
	// DataDir is this replica's own directory (template build files). A
	// signing.key left there by a release that kept the key per replica
	// is migrated into the store once (keys.go). Required.
	DataDir string
	// TemplateFilesDir keeps the files uploaded for template builds (by
	// team and hash). With several replicas it must be storage they all
	// mount (NFS or the like): an upload reaches one replica, the build
	// that copies it may run on another. Default DataDir/template-files.
	TemplateFilesDir string
	// BootstrapAPIKey is an admin key of team BootstrapTeamID, stored (by
	// hash) at start. Form "e2b_" + 40 hex. Generated when empty: read it
	// back with Server.BootstrapAPIKey.
	BootstrapAPIKey string
	// BootstrapTeamID is the team of the bootstrap key (default "default").
	BootstrapTeamID string
	// EdgeKey is space-edge's service key (any string of 16..256 bytes),
	// or empty to disable the edge role.
	EdgeKey string
	// Domain is reported in E2B "domain" fields (default "localhost"). The
	// SDKs build https://<port>-<id>.<Domain> from it, so it carries the
	// edge's HTTPS port unless that is 443 ("localhost:3443").
	Domain string
	// SandboxURL is the edge's base URL, where template builds reach their
	// build sandboxes' process and file APIs; empty disables template
	// builds (they fail with a clear error).
	SandboxURL string
	// BuildConcurrency bounds the template builds running at once
	// (default 2); more wait in "waiting".
	BuildConcurrency int
	// MaxTemplateFileBytes bounds one uploaded COPY archive (default 1 GiB).
	MaxTemplateFileBytes int64
	// DefaultTimeout is a sandbox's time to live when the create request
	// names none (default 300 s); MaxTimeout bounds any requested timeout
	// (default 24 h).
	DefaultTimeout time.Duration
	MaxTimeout     time.Duration
	// Templates that may be created, by template id (default: "base" with
	// DefaultTemplate's resources, "base-vm" with DefaultVMTemplate's and
	// the code interpreter's two).
	Templates map[string]Template
	// Substrate of new executions (default "ns").
	Substrate string
	// DefaultEnvdVersion is reported when a worker's install response
	// names no envd version (default "0.2.0").
	DefaultEnvdVersion string
	// InstallTimeout bounds one install call to a worker (default 60 s);
	// NodeTimeout bounds other node calls (default 30 s).
	InstallTimeout time.Duration
	NodeTimeout    time.Duration
	// ReapInterval is how often expired sandboxes are looked for
	// (default 1 s); TombstoneTTL is how long killed or failed records
	// stay readable (executions history) before they are purged (1 h).
	ReapInterval time.Duration
	TombstoneTTL time.Duration
	// WorkerLossGrace is how long a worker's registration must have been
	// gone before its running sandboxes are recovered on other workers as
	// new executions (workerloss.go; default 30 s, above the workers'
	// 10 s lease TTL: a worker fences itself before its lease can expire,
	// so it serves nothing by then). Counted by the reaper from the pass
	// that first finds the worker gone.
	WorkerLossGrace time.Duration
	// KeyPropagation is how long a key rotation waits between publishing
	// the new verification key and signing with it (default 2 s; negative:
	// no wait).
	KeyPropagation time.Duration
	// LeaderTTL is the lease of the control-plane election (default 5 s,
	// at least 1 s, whole seconds): every replica serves the API, the
	// elected one also runs the singletons (the reaper and what it calls,
	// completing an interrupted key rotation); a crashed leader is
	// replaced within LeaderTTL, one that shuts down at once.
	LeaderTTL time.Duration
	// EgressLimits are per-team limits on what a sandbox's network
	// options may open (by team id; teams not listed have none). The
	// operator's default policy itself (--egress allow|deny) is the
	// workers'.
	EgressLimits map[string]EgressLimit

	// Team metrics (teammetrics.go, helper "api" of issue 17):
	// TeamMetricsInterval is how often each team's sandboxes are counted
	// (default 5 s); TeamMetricsRetention how long the counts are kept
	// (default 24 h).
	TeamMetricsInterval  time.Duration
	TeamMetricsRetention time.Duration

	// Events and webhooks (events.go, webhooks.go, internal/events).
	// WebhookAllowPrivate lets webhook URLs reach loopback, private and
	// link-local addresses (tests, closed labs); default: refused at
	// registration and at every delivery's dial.
	WebhookAllowPrivate bool
	// Events tunes event retention and webhook delivery (zero fields:
	// internal/events' defaults; Instance, AllowPrivate, Logger and Clock
	// are set by the server).
	Events events.Config
}

// EgressLimit bounds a team's egress.
type EgressLimit struct {
	// Deny: the team's sandboxes never get a way out: options that would
	// open one (allowInternetAccess true, allowOut, egressProxy) are
	// refused with 403, and the workers get a policy that denies all.
	Deny bool
	// MaxAllowOut bounds the entries of network.allowOut (0: the
	// platform's own bound).
	MaxAllowOut int
}

// Deps are the objects the control plane uses.
type Deps struct {
	// Store is required; the caller opens and closes it.
	Store *store.Store
	// HTTPClient calls node-api (default: a client without overall timeout;
	// each call has its own deadline).
	HTTPClient *http.Client
	// Logger (default slog.Default()).
	Logger *slog.Logger
	// Clock (default time.Now).
	Clock func() time.Time
	// Snapshots is the snapshot store the workers write to. Optional:
	// without it, deleting a snapshot removes its record only and the
	// archive stays for an operator to collect.
	Snapshots snapshot.Store
	// Volumes reaches the team volumes' files for the volume content API
	// (volumecontent.go). Optional: without it that API answers 503.
	Volumes VolumeFiles
}

// withDefaults returns c with every zero field set to its documented
// default (and every template's empty Substrate to Config.Substrate). The
// caller's Templates map is not modified.
func (c Config) withDefaults() Config {
	c.Addr = cmp.Or(c.Addr, DefaultAddr)
	if c.TemplateFilesDir == "" && c.DataDir != "" {
		c.TemplateFilesDir = filepath.Join(c.DataDir, "template-files")
	}
	c.BootstrapTeamID = cmp.Or(c.BootstrapTeamID, DefaultTeamID)
	c.Domain = cmp.Or(c.Domain, DefaultDomain)
	c.BuildConcurrency = cmp.Or(c.BuildConcurrency, 2)
	c.MaxTemplateFileBytes = cmp.Or(c.MaxTemplateFileBytes, 1<<30)
	c.DefaultTimeout = cmp.Or(c.DefaultTimeout, DefaultTimeout)
	c.MaxTimeout = cmp.Or(c.MaxTimeout, DefaultMaxTimeout)
	c.Substrate = cmp.Or(c.Substrate, identity.SubstrateNS)
	c.Templates = c.templates()
	c.DefaultEnvdVersion = cmp.Or(c.DefaultEnvdVersion, DefaultEnvdVersion)
	c.InstallTimeout = cmp.Or(c.InstallTimeout, DefaultInstallTimeout)
	c.NodeTimeout = cmp.Or(c.NodeTimeout, DefaultNodeTimeout)
	c.ReapInterval = cmp.Or(c.ReapInterval, DefaultReapInterval)
	c.TombstoneTTL = cmp.Or(c.TombstoneTTL, DefaultTombstoneTTL)
	c.WorkerLossGrace = cmp.Or(c.WorkerLossGrace, DefaultWorkerLossGrace)
	c.KeyPropagation = cmp.Or(c.KeyPropagation, DefaultKeyPropagation)
	c.LeaderTTL = cmp.Or(c.LeaderTTL, DefaultLeaderTTL)
	c.TeamMetricsInterval = cmp.Or(c.TeamMetricsInterval, DefaultTeamMetricsInterval)
	c.TeamMetricsRetention = cmp.Or(c.TeamMetricsRetention, DefaultTeamMetricsRetention)
	return c
}

// templates is a copy of the configured templates (or the default ones),
// each with its substrate resolved.
func (c Config) templates() map[string]Template {
	in := c.Templates
	if len(in) == 0 {
		in = map[string]Template{"base": DefaultTemplate, "base-vm": DefaultVMTemplate,
			"code-interpreter-v1": CodeInterpreterTemplate, "code-interpreter-v1-vm": CodeInterpreterVMTemplate}
	}
	out := make(map[string]Template, len(in))
	for name, t := range in {
		t.Substrate = cmp.Or(t.Substrate, c.Substrate, identity.SubstrateNS)
		out[name] = t
	}
	return out
}

// Validate checks c; a zero field that has a default is valid (New fills
// the defaults first).
func (c Config) Validate() error {
	// The timeouts are compared as they will be used.
	defTimeout, maxTimeout := cmp.Or(c.DefaultTimeout, DefaultTimeout), cmp.Or(c.MaxTimeout, DefaultMaxTimeout)
	switch {
	case c.DataDir == "":
		return fmt.Errorf("controlplane config: data dir required")
	case c.BootstrapAPIKey != "" && !apiKeyRE.MatchString(c.BootstrapAPIKey):
		return fmt.Errorf("controlplane config: bootstrap api key must be e2b_ followed by 40 lowercase hex digits")
	case c.EdgeKey != "" && (len(c.EdgeKey) < 16 || len(c.EdgeKey) > 256):
		return fmt.Errorf("controlplane config: edge key must be 16..256 bytes")
	case c.EdgeKey != "" && c.EdgeKey == c.BootstrapAPIKey:
		return fmt.Errorf("controlplane config: edge key must differ from the bootstrap api key")
	case defTimeout < time.Second || maxTimeout < time.Second:
		return fmt.Errorf("controlplane config: timeouts must be at least 1 s")
	case defTimeout > maxTimeout:
		return fmt.Errorf("controlplane config: default timeout %s above max %s", defTimeout, maxTimeout)
	case c.InstallTimeout < 0 || c.NodeTimeout < 0 || c.ReapInterval < 0 || c.TombstoneTTL < 0 || c.WorkerLossGrace < 0 || c.LeaderTTL < 0:
		return fmt.Errorf("controlplane config: negative duration")
	case c.LeaderTTL != 0 && c.LeaderTTL < store.MinElectionTTL:
		return fmt.Errorf("controlplane config: leader ttl %s below %s", c.LeaderTTL, store.MinElectionTTL)
	}
	for name, t := range c.templates() {
		if name == "" || t.CPUCount < 0 || t.MemoryMB < 0 || t.DiskSizeMB < 0 {
			return fmt.Errorf("controlplane config: bad template %q", name)
		}
		if !identity.KnownSubstrate(t.Substrate) {
			return fmt.Errorf("controlplane config: template %q: unknown substrate %q", name, t.Substrate)
		}
	}
	return nil
}

// withDefaults returns d with every nil dependency that has a default set.
func (d Deps) withDefaults() Deps {
	if d.HTTPClient == nil {
		d.HTTPClient = &http.Client{}
	}
	if d.Logger == nil {
		d.Logger = slog.Default()
	}
	if d.Clock == nil {
		d.Clock = time.Now
	}
	return d
}
