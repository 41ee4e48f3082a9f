package volume

import (
	"fmt"
	"path"
	"strings"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
)

// Entry describes one file of a volume (E2B's VolumeEntryStat).
type Entry struct {
	Name string `json:"name"`
	// Type is "file", "directory", "symlink" or "unknown".
	Type string `json:"type"`
	// Path is the entry's path in the volume ("/" is its root).
	Path   string    `json:"path"`
	Size   int64     `json:"size"`
	Mode   uint32    `json:"mode"`
	UID    uint32    `json:"uid"`
	GID    uint32    `json:"gid"`
	Atime  time.Time `json:"atime"`
	Mtime  time.Time `json:"mtime"`
	Ctime  time.Time `json:"ctime"`
	Target string    `json:"target,omitempty"`
}

// Attrs are the owner and mode a change sets; nil fields keep (or, for a
// new file, default: the sandbox user, 0644 or 0755).
type Attrs struct {
	UID, GID *uint32
	Mode     *uint32
}

// MaxListEntries bounds one listing.
const MaxListEntries = 10000

// Clean turns an API path into the volume's own absolute form ("/" is
// the root); ErrInvalid for NUL bytes or an overlong path.
func Clean(p string) (string, error) {
	if strings.IndexByte(p, 0) >= 0 || len(p) > 4096 {
		return "", fmt.Errorf("%w: bad path", errdefs.ErrInvalid)
	}
	return path.Clean("/" + p), nil
}
