package crash

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/spacesbx/space/internal/identity"
)

// activationDirName is sbx-manager's name of an activation directory
// (sbxmanager.activationDir): the harness computes what must exist from
// the control plane's routes, never from the worker's own records.
func activationDirName(r identity.Route) string {
	sum := sha256.Sum256(fmt.Appendf(nil, "%s/%d/%s/%s", r.SandboxID, r.Generation, r.ExecutionID, r.ActivationID))
	return hex.EncodeToString(sum[:8])
}

// host is what exists on the machine for one platform's sandboxes: the
// harness tracks its sandboxes by id (ids are random, so other platforms
// on the host never match) and its files by data dir.
type host struct {
	// dataDirs are the platform's data dir (its snapshot store first)
	// and those of its space-node workers, if any.
	dataDirs []string
	// states are glob patterns of the workers' state dirs.
	states []string
	ids    []string // every sandbox the scenario created or tried to
}

// upHost is the host of a space up running its workers in its own process.
func upHost(dataDir string) host {
	return host{dataDirs: []string{dataDir}, states: []string{filepath.Join(dataDir, "workers", "*")}}
}

// under reports whether path is inside one of h's data dirs.
func (h host) under(path string) bool {
	for _, d := range h.dataDirs {
		if strings.HasPrefix(path, d+"/") {
			return true
		}
	}
	return false
}

// leaks lists what exists beyond live, the routes the control plane
// names as current (nil after every sandbox was killed): cgroups and
// processes of other activations or of sandboxes not live, activation
// directories, spaced-host and netgtw processes, loop devices and mounts
// of anything but a live activation, and snapshot temporaries.
func (h host) leaks(live map[string]identity.Route) []string {
	var out []string
	wantAct := map[string]bool{}
	for _, r := range live {
		wantAct[activationDirName(r)] = true
	}
	// cgroups: <parent...>/<sandbox>-<activation> and agent.<sandbox>-<activation>,
	// searched at any depth under each hierarchy's space* parents (the
	// parent may gain a per-worker level).
	for _, cg := range h.cgroups() {
		base := strings.TrimPrefix(filepath.Base(cg), "agent.")
		sid, act := h.split(base)
		if r, ok := live[sid]; !ok || r.ActivationID != act {
			out = append(out, "cgroup "+cg)
		}
	}
	procs, _ := filepath.Glob("/proc/[0-9]*")
	for _, p := range procs {
		if what := h.stray(p, live, wantAct); what != "" {
			out = append(out, what)
		}
	}
	var acts []string
	for _, st := range h.states {
		a, _ := filepath.Glob(filepath.Join(st, "act", "*"))
		acts = append(acts, a...)
	}
	for _, a := range acts {
		if !wantAct[filepath.Base(a)] {
			out = append(out, "activation dir "+a)
		}
	}
	loops, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, l := range loops {
		b, err := os.ReadFile(l)
		f := strings.TrimSpace(string(b))
		if err != nil || !h.under(f) {
			continue
		}
		if strings.Contains(f, "/spare/") && !strings.HasSuffix(f, "(deleted)") {
			continue // the next sandbox's disk, made ahead of time
		}
		if act := actOf(f); act == "" || !wantAct[act] {
			out = append(out, fmt.Sprintf("loop device %s backs %s", strings.Split(l, "/")[3], f))
		}
	}
	for _, m := range h.mounts() {
		if h.isEgressNetns(m) {
			continue // the worker's own, while it runs (afterStop checks it went)
		}
		if act := actOf(m); act == "" || !wantAct[act] {
			out = append(out, "mount "+m)
		}
	}
	tmps, _ := filepath.Glob(filepath.Join(h.dataDirs[0], "snapshots", ".tmp-*"))
	for _, t := range tmps {
		out = append(out, "snapshot temporary "+t)
	}
	slices.Sort(out)
	return out
}

// mounts lists the mount points under the data dir.
func (h host) mounts() []string {
	var out []string
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	for _, line := range strings.Split(string(mi), "\n") {
		if fields := strings.Fields(line); len(fields) > 4 && h.under(fields[4]) {
			out = append(out, fields[4])
		}
	}
	return out
}

// isEgressNetns reports whether mount point m is a worker's egress
// network namespace (sbxnet's <worker state>/egress.netns): it lives as
// long as its worker, not any sandbox.
func (h host) isEgressNetns(m string) bool {
	for _, st := range h.states {
		if ok, _ := filepath.Match(filepath.Join(st, "egress.netns"), m); ok {
			return true
		}
	}
	return false
}

// afterStop lists what a platform stopped without keeping its sandboxes
// left mounted under the data dir: nothing may be, the workers' egress
// namespaces included.
func (h host) afterStop() []string {
	var out []string
	for _, m := range h.mounts() {
		out = append(out, "mount "+m)
	}
	return out
}

// split returns the sandbox id and activation of a cgroup base name
// "<sandbox>-<activation>" for a tracked sandbox ("" otherwise).
func (h host) split(base string) (string, string) {
	for _, id := range h.ids {
		if act, ok := strings.CutPrefix(base, id+"-"); ok {
			return id, act
		}
	}
	return "", ""
}

func (h host) cgroups() []string {
	var out []string
	ctrls, _ := filepath.Glob("/sys/fs/cgroup/*")
	ctrls = append(ctrls, "/sys/fs/cgroup")
	for _, c := range ctrls {
		parents, _ := filepath.Glob(filepath.Join(c, "space*"))
		for _, p := range parents {
			filepath.WalkDir(p, func(path string, d fs.DirEntry, err error) error {
				if err != nil || !d.IsDir() {
					return nil
				}
				if sid, _ := h.split(strings.TrimPrefix(d.Name(), "agent.")); sid != "" {
					out = append(out, path)
					return fs.SkipDir
				}
				if strings.Count(strings.TrimPrefix(path, p), "/") >= 2 {
					return fs.SkipDir // sandbox cgroups are at most one level below the parent's own children
				}
				return nil
			})
		}
	}
	return out
}

// stray describes process dir p when it belongs to this platform's
// sandboxes but not to a live activation: a task in a tracked sandbox's
// cgroup of another activation, or a spaced-host or netgtw whose files
// are in an activation directory that must not exist.
func (h host) stray(p string, live map[string]identity.Route, wantAct map[string]bool) string {
	cg, err := os.ReadFile(filepath.Join(p, "cgroup"))
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(cg), "\n") {
		i := strings.LastIndexByte(line, '/')
		if i < 0 {
			continue
		}
		sid, act := h.split(strings.TrimPrefix(line[i+1:], "agent."))
		if sid == "" {
			continue
		}
		if r, ok := live[sid]; !ok || r.ActivationID != act {
			return fmt.Sprintf("process %s (%s) in cgroup %s", filepath.Base(p), comm(p), line)
		}
		return ""
	}
	exe, _ := os.Readlink(filepath.Join(p, "exe"))
	switch filepath.Base(strings.TrimSuffix(exe, " (deleted)")) {
	case "spaced-host", "netgtw", "spaced-guest", "space-nsinit":
	default:
		return ""
	}
	// Which activation: its log (spaced-host's stderr) or its arguments.
	var refs []string
	for _, fd := range []string{"fd/1", "fd/2"} {
		if l, err := os.Readlink(filepath.Join(p, fd)); err == nil {
			refs = append(refs, l)
		}
	}
	if b, err := os.ReadFile(filepath.Join(p, "cmdline")); err == nil {
		refs = append(refs, strings.Split(string(b), "\x00")...)
	}
	for _, r := range refs {
		if !h.under(r) {
			continue
		}
		if act := actOf(r); act != "" && wantAct[act] {
			return ""
		}
		return fmt.Sprintf("process %s (%s) of %s", filepath.Base(p), filepath.Base(exe), r)
	}
	return ""
}

// actOf returns the activation directory name in path (…/act/<name>/…).
func actOf(path string) string {
	_, rest, ok := strings.Cut(path, "/act/")
	if !ok {
		return ""
	}
	name, _, _ := strings.Cut(rest, "/")
	return name
}

func comm(p string) string {
	b, _ := os.ReadFile(filepath.Join(p, "comm"))
	return strings.TrimSpace(string(b))
}
