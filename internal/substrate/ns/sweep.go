//go:build linux

package ns

// Sweeping a worker's cgroup parent at start. Sandboxes outlive their
// worker, so one the worker started but never recorded (it died between
// the start and the record's write), or anything else a crash left under
// its parent, would run on unseen: Sweep ends every sandbox there that
// the caller has no record of.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/spacesbx/space/internal/substrate"
)

var _ substrate.Sweeper = (*Substrate)(nil)

// Sweep implements substrate.Sweeper: every group directly under this
// substrate's cgroup parent is named by its sandbox's cgroup name
// (<sandbox>-<activation>, also for the agent's group and a warm init's
// warm.<random>); each name keep rejects is ended like Reclaim ends one
// (thawed, killed, removed), which also removes empty leftover groups.
// Groups of the inits this substrate runs (started, warm or adopted) are
// never offered to keep, nor are groups with groups below them (the
// parent of another substrate nested under this one). swept counts the
// names removed.
func (s *Substrate) Sweep(ctx context.Context, keep func(cgroupName string) bool) (swept int, err error) {
	parent := s.cfg.CgroupParent
	names := map[string]bool{}
	nested := map[string]bool{}
	seen := map[string]bool{}
	for _, g := range s.cgroups.groups(parent, "x") {
		pdir := filepath.Join(g.root, parent)
		if seen[pdir] {
			continue
		}
		seen[pdir] = true
		ents, err := os.ReadDir(pdir)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return 0, fmt.Errorf("ns: sweep: %w", err)
		}
		for _, e := range ents {
			if !e.IsDir() {
				continue
			}
			name := strings.TrimPrefix(e.Name(), agentGroupPrefix)
			if hasSubdir(filepath.Join(pdir, e.Name())) {
				nested[name] = true
			}
			names[name] = true
		}
	}
	sorted := make([]string, 0, len(names))
	for n := range names {
		if !nested[n] {
			sorted = append(sorted, n)
		}
	}
	slices.Sort(sorted)
	var errs []error
	for _, name := range sorted {
		if err := ctx.Err(); err != nil {
			return swept, err
		}
		s.liveMu.Lock()
		live := s.live[name]
		s.liveMu.Unlock()
		if live || keep(name) {
			continue
		}
		if err := existingCgroup(s.cgroups, parent, name).remove(ctx); err != nil {
			errs = append(errs, err)
			continue
		}
		s.cfg.Logger.Info("ns: swept a sandbox nobody recorded", "cgroup", filepath.Join(parent, name))
		swept++
	}
	if len(errs) > 0 {
		return swept, fmt.Errorf("ns: sweep: %w", errors.Join(errs...))
	}
	return swept, nil
}

// hasSubdir reports whether dir holds a directory (a child group).
func hasSubdir(dir string) bool {
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if e.IsDir() {
			return true
		}
	}
	return false
}
