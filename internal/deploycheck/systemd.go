package deploycheck

import (
	"fmt"
	"path"
	"strings"
)

// UnitRules are what a SPACE systemd unit is checked against.
type UnitRules struct {
	// Built names the binaries `make build` builds (the Makefile's CMDS).
	Built map[string]bool
	// Flags are each binary's flags (HelpFlags).
	Flags map[string]FlagSet
	// EnvFiles maps an EnvironmentFile= path to its example's variables
	// (deploy/systemd/env): every file a unit reads has one.
	EnvFiles map[string]map[string]string
	// Docs is the operator documentation (docs/DEPLOY.md and
	// docs/CONFIGURATION.md): users and environment files a unit names,
	// and every variable an example environment file sets, appear there.
	Docs string
	// Secret names flags that never go on a command line.
	Secret []string
}

// BinDir is where the units and the image install SPACE's binaries.
const BinDir = "/usr/local/bin"

// mountNSSettings give a service a mount namespace of its own. space-node
// must run in the host's: the mounts it makes (layer disks, volumes, its
// egress namespace) must outlive it for the next start to adopt the
// sandboxes that kept running.
var mountNSSettings = []string{
	"ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateMounts", "PrivateDevices",
	"ReadOnlyPaths", "ReadWritePaths", "InaccessiblePaths", "TemporaryFileSystem",
	"BindPaths", "BindReadOnlyPaths", "ProtectKernelModules", "ProtectKernelTunables",
	"ProtectControlGroups", "MountFlags", "RootDirectory", "RootImage",
}

// Check returns what is wrong with u. A drop-in (name ending in .conf)
// is checked for syntax and documentation only.
func (r UnitRules) Check(u *Unit) []error {
	var errs []error
	bad := func(format string, a ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", u.Name, fmt.Sprintf(format, a...)))
	}
	for _, user := range []string{u.Value("Service", "User"), u.Value("Service", "Group")} {
		if user != "" && user != "root" && !strings.Contains(r.Docs, "`"+user+"`") {
			bad("user or group %q is not documented (docs/DEPLOY.md)", user)
		}
	}
	env := map[string]string{}
	for _, f := range u.Values("Service", "EnvironmentFile") {
		f = strings.TrimPrefix(f, "-")
		ex, ok := r.EnvFiles[f]
		if !ok {
			bad("EnvironmentFile %s has no example under deploy/systemd/env", f)
			continue
		}
		if !strings.Contains(r.Docs, f) {
			bad("EnvironmentFile %s is not documented (docs/DEPLOY.md)", f)
		}
		for k, v := range ex {
			env[k] = v
		}
	}
	for _, e := range u.Values("Service", "Environment") {
		for _, kv := range strings.Fields(strings.Trim(e, `"`)) {
			if k, v, ok := strings.Cut(kv, "="); ok {
				env[k] = v
			}
		}
	}
	if strings.HasSuffix(u.Name, ".conf") {
		if len(u.Values("Service", "ExecStart")) > 0 {
			bad("a drop-in must not replace ExecStart")
		}
		return errs
	}
	if u.Value("Unit", "Description") == "" {
		bad("[Unit] Description is missing")
	}
	if u.Value("Install", "WantedBy") == "" {
		bad("[Install] WantedBy is missing: the unit would never start at boot")
	}
	execs := u.Values("Service", "ExecStart")
	if len(execs) != 1 {
		bad("want exactly one ExecStart, have %d", len(execs))
		return errs
	}
	_, argv, err := SplitCommand(execs[0], env)
	if err != nil {
		bad("ExecStart: %v", err)
		return errs
	}
	bin := path.Base(argv[0])
	if path.Dir(argv[0]) != BinDir || !r.Built[bin] {
		bad("ExecStart runs %s: not a binary make build builds, installed in %s", argv[0], BinDir)
		return errs
	}
	fs, ok := r.Flags[bin]
	if !ok {
		bad("no flags known for %s", bin)
		return errs
	}
	for _, e := range CheckArgs(fs, argv[1:], r.Secret...) {
		bad("ExecStart: %v", e)
	}
	for k := range env {
		if !strings.Contains(execs[0], "$"+k) && !strings.Contains(execs[0], "${"+k+"}") && !strings.Contains(r.Docs, "`"+k+"`") {
			bad("environment variable %s is neither used by ExecStart nor documented", k)
		}
	}
	if bin == "space-node" {
		errs = append(errs, r.checkNode(u, argv[1:])...)
	} else {
		errs = append(errs, r.checkSandboxed(u, argv[1:])...)
	}
	return errs
}

// checkNode: root, delegated cgroups, sandboxes that outlive a restart,
// the host's mount namespace.
func (r UnitRules) checkNode(u *Unit, args []string) []error {
	var errs []error
	bad := func(format string, a ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", u.Name, fmt.Sprintf(format, a...)))
	}
	if v := u.Value("Service", "User"); v != "" && v != "root" {
		bad("space-node needs root, has User=%s", v)
	}
	if u.Value("Service", "DynamicUser") == "yes" {
		bad("space-node needs root, has DynamicUser=yes")
	}
	if u.Value("Service", "Delegate") != "yes" {
		bad("space-node makes cgroups: want Delegate=yes")
	}
	if u.Value("Service", "KillMode") != "process" {
		bad("want KillMode=process: a stop or restart must not kill the kept sandboxes' processes")
	}
	if v, ok := ArgValue(args, "keep-sandboxes"); ok && v == "false" {
		bad("--keep-sandboxes=false: a restart would end every sandbox")
	}
	for _, k := range mountNSSettings {
		if v := u.Value("Service", k); v != "" && v != "no" && v != "false" {
			bad("%s=%s gives space-node a mount namespace of its own: its mounts would not outlive it and the next start could not adopt its sandboxes", k, v)
		}
	}
	return errs
}

// checkSandboxed: no root, a read-only system, state only where systemd
// made it.
func (r UnitRules) checkSandboxed(u *Unit, args []string) []error {
	var errs []error
	bad := func(format string, a ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", u.Name, fmt.Sprintf(format, a...)))
	}
	if u.Value("Service", "DynamicUser") != "yes" && (u.Value("Service", "User") == "" || u.Value("Service", "User") == "root") {
		bad("runs as root: want DynamicUser=yes or a User= of its own")
	}
	for k, want := range map[string]string{
		"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
		"PrivateDevices": "yes", "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes",
		"ProtectControlGroups": "yes", "RestrictNamespaces": "yes", "LockPersonality": "yes",
		"MemoryDenyWriteExecute": "yes", "RestrictSUIDSGID": "yes",
	} {
		if got := u.Value("Service", k); got != want {
			bad("want %s=%s, have %q", k, want, got)
		}
	}
	if !u.Has("Service", "CapabilityBoundingSet") {
		bad("CapabilityBoundingSet is unset: every capability stays possible")
	}
	var state []string
	for _, s := range u.Values("Service", "StateDirectory") {
		for _, d := range strings.Fields(s) {
			state = append(state, path.Join("/var/lib", d))
		}
	}
	for _, f := range []string{"data-dir", "tls-ca-dir"} {
		v, ok := ArgValue(args, f)
		if !ok || strings.Contains(v, "$") {
			continue
		}
		in := false
		for _, s := range state {
			in = in || v == s || strings.HasPrefix(v, s+"/")
		}
		if !in {
			bad("--%s=%s is not under a StateDirectory= (ProtectSystem=strict leaves it read-only)", f, v)
		}
	}
	return errs
}

// ArgValue returns the value args give flag name (the last one wins, as in
// Go's flag package); a boolean flag given bare reads "true".
func ArgValue(args []string, name string) (string, bool) {
	val, found := "", false
	for i := 0; i < len(args); i++ {
		a := strings.TrimPrefix(strings.TrimPrefix(args[i], "-"), "-")
		n, v, hasVal := strings.Cut(a, "=")
		if n != name {
			continue
		}
		found = true
		switch {
		case hasVal:
			val = v
		case i+1 < len(args) && !strings.HasPrefix(args[i+1], "-"):
			val = args[i+1]
			i++
		default:
			val = "true"
		}
	}
	return val, found
}
