// Package guest implements spaced-guest, the agent that runs inside a SPACE
// sandbox. It serves an API compatible with E2B's "envd" (Connect services
// process.Process and filesystem.Filesystem, plus /files and /health) so the
// unmodified e2b SDK works against it, and /_space/identity for the host
// bridge.
//
// The package deliberately imports no other internal package of this
// repository but its own subpackage cgexec: only the standard library, the generated api/envd code,
// connect, protobuf, creack/pty, fsnotify and x/sys.
package guest

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// EnvdVersion is the envd version the agent claims to be compatible with.
//
// The e2b SDK gates features on this version (compareVersions in the SDK):
//   - 0.3.0 stdin=false on Start, 0.4.0 default user taken from the agent,
//   - 0.5.2 CloseStdin, 0.5.7 application/octet-stream (and gzip) upload,
//   - 0.6.2 file metadata (X-Metadata-* headers stored as user.e2b.* xattrs),
//   - 0.6.3 WatchDir include_entry,
//   - 0.6.4 WatchDir allow_network_mounts (network mounts rejected by default).
//
// All of these are implemented, and the SDK has no gate above 0.6.4, so we
// claim exactly 0.6.4 and no higher.
const EnvdVersion = "0.6.4"

// Identity is the execution identity the agent was activated with (DESIGN.md
// section 3). The host bridge reads it from GET /_space/identity and compares
// it with the identity it expects.
type Identity struct {
	Sandbox    string `json:"sandbox"`
	Generation uint64 `json:"generation"`
	Execution  string `json:"execution"`
	Worker     string `json:"worker"`
	Substrate  string `json:"substrate"`
	Activation string `json:"activation"`
	PodUID     string `json:"pod_uid,omitempty"`
}

// Validate reports whether the identity is complete.
func (id Identity) Validate() error {
	var missing []string
	for _, f := range []struct{ name, v string }{
		{"sandbox", id.Sandbox}, {"execution", id.Execution}, {"worker", id.Worker},
		{"substrate", id.Substrate}, {"activation", id.Activation},
	} {
		if f.v == "" {
			missing = append(missing, f.name)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("identity: missing %s", strings.Join(missing, ", "))
	}
	return nil
}

// Defaults applied by New for zero-valued Config fields.
const (
	DefaultUser                = "user"
	DefaultPasswdPath          = "/etc/passwd"
	DefaultGroupPath           = "/etc/group"
	DefaultMaxUploadBytes      = int64(4) << 30 // per /files request
	DefaultMaxMessageBytes     = 16 << 20       // per Connect message
	DefaultMaxWatcherEvents    = 10000          // buffered per polled watcher
	DefaultMaxWatchers         = 256            // polled watchers + WatchDir streams
	DefaultShutdownTimeout     = 5 * time.Second
	DefaultDetachedOutputBytes = 1 << 20 // per process, VM mode
	DefaultPath                = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
)

// Config configures the agent. The zero value of every field means "use the
// default" documented on the field. Fields with JSON tags can be passed to
// cmd/spaced-guest as JSON in SPACE_GUEST_CONFIG.
type Config struct {
	// Identity is the execution identity the agent was activated with.
	// Required (all fields but pod_uid).
	Identity Identity `json:"identity"`
	// Env holds default environment variables of every started process.
	// Request envs override them; HOME, USER, LOGNAME and PWD are always set
	// for the process's user; PATH defaults to DefaultPath.
	Env map[string]string `json:"env,omitempty"`
	// DefaultUser is the user when a request names none. Default "user".
	DefaultUser string `json:"default_user,omitempty"`
	// DefaultCwd is a process's working directory when its request names
	// none (an image's WORKDIR); empty or missing: the user's home.
	DefaultCwd string `json:"default_cwd,omitempty"`
	// PasswdPath and GroupPath are the account databases users are looked up
	// in. Defaults /etc/passwd and /etc/group.
	PasswdPath string `json:"passwd_path,omitempty"`
	GroupPath  string `json:"group_path,omitempty"`
	// MaxUploadBytes bounds the body of one POST /files. Default 4 GiB.
	MaxUploadBytes int64 `json:"max_upload_bytes,omitempty"`
	// MaxMessageBytes bounds one Connect request message. Default 16 MiB.
	MaxMessageBytes int `json:"max_message_bytes,omitempty"`
	// MaxWatcherEvents bounds the events buffered by one CreateWatcher
	// watcher between polls; further events are dropped. Default 10000.
	MaxWatcherEvents int `json:"max_watcher_events,omitempty"`
	// MaxWatchers bounds concurrent watches (WatchDir streams plus
	// CreateWatcher watchers). Default 256.
	MaxWatchers int `json:"max_watchers,omitempty"`
	// ShutdownTimeout bounds Close. Default 5s. (JSON: nanoseconds.)
	ShutdownTimeout time.Duration `json:"shutdown_timeout,omitempty"`
	// DetachedOutputBytes, when positive, keeps up to that many bytes of
	// each process's output produced while no stream is subscribed to it
	// (the oldest dropped first, counted) and delivers them first to the
	// next process.Process/Connect: a client that reattaches after a VM
	// move loses no output. Zero: output without a subscriber is dropped
	// (the ns substrate, where processes do not survive a move). VM mode
	// defaults it to DefaultDetachedOutputBytes.
	DetachedOutputBytes int `json:"detached_output_bytes,omitempty"`
	// Logger receives operational logs. Default: slog.Default().
	Logger *slog.Logger `json:"-"`
	// UserCgroupProcs, when set, is the cgroup.procs file (open for
	// writing) of the cgroup every started process must run in: the ns
	// substrate keeps the agent out of the group that carries the
	// sandbox's pids limit and hands this file over as SPACE_CGROUP_FD
	// (see cgexec.FromEnv). Processes are then started through the cgexec
	// wrapper and join the group before running any code of their own.
	// Nil: processes start in the agent's own cgroups.
	UserCgroupProcs *os.File `json:"-"`
	// Network, when set, is the sandbox's way out: the agent writes
	// /etc/resolv.conf (nameserver DNS) and adds CACert to the system's
	// trust store (/etc/ssl/certs/ca-certificates.crt and
	// /usr/local/share/ca-certificates/space-egress.crt), so HTTPS through
	// the egress proxy's interception verifies. In VM mode the agent also
	// configures its NIC (the one with MAC or, in a clone of a template,
	// the only Ethernet NIC, given MAC first) with MTU, Address and a
	// default route via Gateway, replacing an earlier activation's; in ns
	// mode the host configures the veth. Applied at start and again on
	// every activation (a move changes it); an invalid one fails Validate,
	// a failure to apply is logged (network.go). Nil: loopback only, and
	// nothing is changed (resolv.conf is left as the image, or an earlier
	// activation, has it).
	Network *NetworkConfig `json:"network,omitempty"`
	// ResolvConfPath, CACertPath and CABundlePath are where Network's
	// resolver and CA are written (tests point them into a temporary
	// directory). Defaults DefaultResolvConfPath, DefaultCACertPath and
	// DefaultCABundlePath.
	ResolvConfPath string `json:"-"`
	CACertPath     string `json:"-"`
	CABundlePath   string `json:"-"`
}

// NetworkConfig is the guest's side of its egress link.
type NetworkConfig struct {
	// Address is the sandbox's address with prefix, e.g. "10.201.0.6/30";
	// with Gateway, empty when the host configures the interface (ns).
	Address string `json:"address,omitempty"`
	// Gateway is the default route's next hop (the worker's side).
	Gateway string `json:"gateway,omitempty"`
	// DNS is the only resolver the sandbox can reach.
	DNS string `json:"dns"`
	// MAC names the NIC to configure in VM mode ("52:54:00:..").
	MAC string `json:"mac,omitempty"`
	// MTU of the link; 0 leaves the kernel's default.
	MTU int `json:"mtu,omitempty"`
	// CACert is the PEM of the sandbox's egress CA (certificate only).
	CACert string `json:"ca_cert,omitempty"`
}

// withDefaults returns a copy of c with zero fields replaced by the
// documented defaults.
func (c Config) withDefaults() Config {
	if c.DefaultUser == "" {
		c.DefaultUser = DefaultUser
	}
	if c.PasswdPath == "" {
		c.PasswdPath = DefaultPasswdPath
	}
	if c.GroupPath == "" {
		c.GroupPath = DefaultGroupPath
	}
	if c.MaxUploadBytes == 0 {
		c.MaxUploadBytes = DefaultMaxUploadBytes
	}
	if c.MaxMessageBytes == 0 {
		c.MaxMessageBytes = DefaultMaxMessageBytes
	}
	if c.MaxWatcherEvents == 0 {
		c.MaxWatcherEvents = DefaultMaxWatcherEvents
	}
	if c.MaxWatchers == 0 {
		c.MaxWatchers = DefaultMaxWatchers
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = DefaultShutdownTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.ResolvConfPath == "" {
		c.ResolvConfPath = DefaultResolvConfPath
	}
	if c.CACertPath == "" {
		c.CACertPath = DefaultCACertPath
	}
	if c.CABundlePath == "" {
		c.CABundlePath = DefaultCABundlePath
	}
	return c
}

// Validate reports whether the configuration is usable. It only checks: a
// zero field that has a default is valid.
func (c Config) Validate() error {
	var errs []error
	if err := c.Identity.Validate(); err != nil {
		errs = append(errs, err)
	}
	if c.DefaultCwd != "" && (!filepath.IsAbs(c.DefaultCwd) || strings.ContainsRune(c.DefaultCwd, 0)) {
		errs = append(errs, fmt.Errorf("default_cwd %q: not an absolute path", c.DefaultCwd))
	}
	if strings.ContainsAny(c.DefaultUser, ":\n\x00") {
		errs = append(errs, fmt.Errorf("default_user %q: invalid user name", c.DefaultUser))
	}
	for k := range c.Env {
		if k == "" || strings.ContainsAny(k, "=\x00") {
			errs = append(errs, fmt.Errorf("env: invalid variable name %q", k))
		}
	}
	for k, v := range c.Env {
		if strings.ContainsRune(v, 0) {
			errs = append(errs, fmt.Errorf("env: value of %q contains NUL", k))
		}
	}
	if c.MaxUploadBytes < 0 || c.DetachedOutputBytes < 0 || c.MaxMessageBytes < 0 || c.MaxWatcherEvents < 0 || c.MaxWatchers < 0 || c.ShutdownTimeout < 0 {
		errs = append(errs, errors.New("limits must not be negative"))
	}
	if c.Network != nil {
		if err := c.Network.Validate(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
