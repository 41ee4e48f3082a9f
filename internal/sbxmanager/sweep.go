package sbxmanager

import (
	"os"
	"path/filepath"
)

// removeUnrecorded removes the activation directories under the state
// directory that no runtime record names: an install the previous process
// died in before it persisted the record (the control plane never got an
// answer and will not name that execution) left them, and with them its
// writable layer. Runs at start, after reclaimLost.
func (m *Manager) removeUnrecorded() {
	named := map[string]bool{}
	for _, r := range m.records {
		named[filepath.Clean(r.Dir)] = true
	}
	dirs, _ := filepath.Glob(filepath.Join(m.cfg.StateDir, "act", "*"))
	for _, d := range dirs {
		if named[filepath.Clean(d)] {
			continue
		}
		if err := os.RemoveAll(d); err != nil {
			m.log.Warn("removing an unrecorded activation's files", "dir", d, "err", err)
			continue
		}
		m.log.Info("removed an activation no record names (its install was cut off)", "dir", d)
	}
}
