package bridge

// The manager file: how a restarted sbx-manager takes over the bridges of
// the sandboxes it re-adopts (Config.ManagerFile).

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/spacesbx/space/internal/atomicfile"
	"github.com/spacesbx/space/internal/procid"
)

// WriteManagerFile names the calling process as the manager in path:
// "<pid> <start time>". Written whole (rename), so a bridge never reads
// half of it.
func WriteManagerFile(path string) error {
	pid := os.Getpid()
	st, err := procid.StartTime(pid)
	if err != nil {
		return fmt.Errorf("bridge: manager file: %w", err)
	}
	return atomicfile.Write(path, []byte(fmt.Sprintf("%d %d\n", pid, st)), 0o600)
}

// ReadManagerFile returns the pid the manager file names, if that process
// is alive with the start time written there.
func ReadManagerFile(path string) (int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, fmt.Errorf("bridge: manager file: %w", err)
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return 0, fmt.Errorf("bridge: manager file %s: malformed", path)
	}
	pid, err1 := strconv.Atoi(f[0])
	st, err2 := strconv.ParseUint(f[1], 10, 64)
	if err1 != nil || err2 != nil || pid <= 0 {
		return 0, fmt.Errorf("bridge: manager file %s: malformed", path)
	}
	now, err := procid.StartTime(pid)
	if err != nil || now != st {
		return 0, fmt.Errorf("bridge: manager file %s: %w: pid %d is not the process written there", path, procid.ErrMismatch, pid)
	}
	return pid, nil
}
