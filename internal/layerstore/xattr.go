//go:build linux

package layerstore

import (
	"encoding/binary"
	"strings"
)

// The opaque-directory markers of overlayfs without and with userxattr.
// A layer carries both, so an overlay mounted by host root and one mounted
// in a user namespace (userxattr) read it alike.
const (
	opaqueTrusted = "trusted.overlay.opaque"
	opaqueUser    = "user.overlay.opaque"
)

// security.capability revisions (linux/capability.h).
const (
	capRevisionMask = 0xFF000000
	capRevision1    = 0x01000000
	capRevision2    = 0x02000000
	capRevision3    = 0x03000000
	capSizeV1       = 12
	capSizeV2       = 20
	capSizeV3       = 24
)

// filterXattr decides what of an xattr from a layer tar or an upper dir
// the layer keeps. Kept: user.* (not user.overlay.*), POSIX ACLs, and
// security.capability as plain v1/v2 data (a v3 value's root id names a
// user namespace of the machine that wrote it; here it is dropped, so the
// capability applies to whichever namespace's root runs the file, as a
// v2 value does). Never kept: trusted.* and user.overlay.* (overlay's own
// redirect/metacopy/origin markers would make overlay look elsewhere;
// opacity is set only from the format's own markers), other security.*
// labels (the host's LSM policy, not the image's, decides those).
func filterXattr(name string, value []byte) ([]byte, bool) {
	switch {
	case strings.HasPrefix(name, "user.overlay."):
		return nil, false
	case strings.HasPrefix(name, "user."):
		return value, true
	case name == "system.posix_acl_access", name == "system.posix_acl_default":
		return value, true
	case name == "security.capability":
		return sanitizeCaps(value)
	}
	return nil, false
}

func sanitizeCaps(v []byte) ([]byte, bool) {
	if len(v) < 4 {
		return nil, false
	}
	magic := binary.LittleEndian.Uint32(v)
	switch magic & capRevisionMask {
	case capRevision1:
		if len(v) != capSizeV1 {
			return nil, false
		}
		return v, true
	case capRevision2:
		if len(v) != capSizeV2 {
			return nil, false
		}
		return v, true
	case capRevision3:
		if len(v) != capSizeV3 {
			return nil, false
		}
		out := make([]byte, capSizeV2)
		copy(out, v[:capSizeV2])
		binary.LittleEndian.PutUint32(out, (magic&^capRevisionMask)|capRevision2)
		return out, true
	}
	return nil, false
}
