package guest

import (
	"errors"
	"path/filepath"
	"strings"
)

// ErrInvalidPath is returned (wrapped) by ResolvePath for paths that can
// never name a file: NUL bytes, or "~name" forms naming another user's home.
var ErrInvalidPath = errors.New("invalid path")

// PathError describes a rejected path.
type PathError struct {
	Path   string
	Reason string
}

func (e *PathError) Error() string { return "invalid path " + quote(e.Path) + ": " + e.Reason }
func (e *PathError) Unwrap() error { return ErrInvalidPath }

// ResolvePath resolves a client-supplied path the way envd does: "~" and
// "~/..." expand to home, relative paths resolve against home, and the result
// is absolute and clean. An empty path resolves to home. home must be
// absolute (a relative or empty home is treated as "/").
//
// ResolvePath does not touch the filesystem and never panics.
func ResolvePath(p, home string) (string, error) {
	if strings.IndexByte(p, 0) >= 0 {
		return "", &PathError{Path: p, Reason: "contains a NUL byte"}
	}
	if !filepath.IsAbs(home) || strings.IndexByte(home, 0) >= 0 {
		home = "/"
	}
	if strings.HasPrefix(p, "~") {
		if len(p) > 1 && p[1] != '/' {
			return "", &PathError{Path: p, Reason: "cannot expand user-specific home dir"}
		}
		p = home + p[1:]
	}
	if !filepath.IsAbs(p) {
		p = filepath.Join(home, p)
	}
	return filepath.Clean(p), nil
}

func quote(s string) string {
	if len(s) > 256 {
		s = s[:256] + "..."
	}
	return "'" + strings.ToValidUTF8(s, "\uFFFD") + "'"
}
