package volume

import (
	"fmt"
	"path"
	"regexp"
	"strings"

	"github.com/spacesbx/space/internal/errdefs"
)

// Limits on what a sandbox may mount.
const (
	// MaxMounts is the most volumes one sandbox mounts: the ns init gets
	// each as a descriptor next to its five own, in one message.
	MaxMounts = 8
	// MaxPathLen bounds a mount path inside the sandbox.
	MaxPathLen = 1024
	// MaxNameLen bounds a volume name.
	MaxNameLen = 128
)

// reserved are the sandbox paths a volume may never cover or sit under:
// the kernel's and the agent's (/.space holds spaced-guest).
var reserved = []string{"/proc", "/sys", "/dev", "/.space"}

// ValidatePath checks a mount path inside a sandbox: absolute, clean (no
// "..", ".", "//" or trailing "/"), not the root, not under a reserved
// tree, printable without control characters. Every rejection is
// errdefs.ErrInvalid.
func ValidatePath(p string) error {
	switch {
	case p == "" || len(p) > MaxPathLen:
		return fmt.Errorf("%w: volume mount path must be 1..%d bytes", errdefs.ErrInvalid, MaxPathLen)
	case !strings.HasPrefix(p, "/"):
		return fmt.Errorf("%w: volume mount path %q must be absolute", errdefs.ErrInvalid, p)
	case path.Clean(p) != p:
		return fmt.Errorf("%w: volume mount path %q must be clean (no '.', '..', '//' or trailing '/')", errdefs.ErrInvalid, p)
	case p == "/":
		return fmt.Errorf("%w: a volume cannot be mounted at /", errdefs.ErrInvalid)
	}
	for _, r := range p {
		if r < 0x20 || r == 0x7f || r == '\\' || r == 0xfffd {
			return fmt.Errorf("%w: volume mount path %q has a control character or backslash", errdefs.ErrInvalid, p)
		}
	}
	for _, r := range reserved {
		if p == r || strings.HasPrefix(p, r+"/") {
			return fmt.Errorf("%w: volume mount path %q is under %s, which the platform owns", errdefs.ErrInvalid, p, r)
		}
	}
	return nil
}

// ValidatePaths checks a sandbox's mount paths together: each valid, at
// most MaxMounts, none equal to or under another (a volume mounted inside
// another would depend on the order of mounts and hide files).
func ValidatePaths(paths []string) error {
	if len(paths) > MaxMounts {
		return fmt.Errorf("%w: at most %d volume mounts", errdefs.ErrInvalid, MaxMounts)
	}
	for i, p := range paths {
		if err := ValidatePath(p); err != nil {
			return err
		}
		for _, q := range paths[:i] {
			if p == q || strings.HasPrefix(p, q+"/") || strings.HasPrefix(q, p+"/") {
				return fmt.Errorf("%w: volume mount paths %q and %q overlap", errdefs.ErrInvalid, q, p)
			}
		}
	}
	return nil
}

// nameRE: E2B volume names (letters, digits, '-', '_', '.'; no '/', so a
// name is one store key part).
var nameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]*$`)

// ValidateName checks a volume name (errdefs.ErrInvalid).
func ValidateName(name string) error {
	if len(name) > MaxNameLen || !nameRE.MatchString(name) {
		return fmt.Errorf("%w: volume name must be 1..%d characters of letters, digits, '-', '_' and '.', starting with a letter or digit", errdefs.ErrInvalid, MaxNameLen)
	}
	return nil
}

// idRE: ids the control plane makes (NewID) and the only ones a worker
// turns into file names.
var idRE = regexp.MustCompile(`^vol_[0-9a-f]{24}$`)

// ValidateID checks a volume id (errdefs.ErrInvalid): a worker names the
// volume's files after it, so nothing else passes.
func ValidateID(id string) error {
	if !idRE.MatchString(id) {
		return fmt.Errorf("%w: volume id %q is not of the form vol_<24 hex>", errdefs.ErrInvalid, id)
	}
	return nil
}
